"""Damaged, foreign and mismatched checkpoints, and paths that are not files, loaded in one
real worker (tests/test_checkpoint_integrity.py): every load is refused and changes nothing, also
into optimizers the checkpoint does not fit; and a save through a symlink."""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.torch import checkpoint

DATASET_SIZE, BATCH = 50, 5


def _model(features: int = 6, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _job(dataset_size: int = DATASET_SIZE, features: int = 6):
    model = _model(features)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters())
    sampler = bps.DynamicBatchSampler(dataset_size, BATCH, seed=3)
    return model, opt, sampler


def _train(model, opt, sampler, steps: int, features: int = 6) -> None:
    data = torch.randn(sampler.dataset_size, features, generator=torch.Generator().manual_seed(1))
    for step, indices in enumerate(sampler):
        opt.zero_grad()
        model(data[indices]).square().mean().backward()
        opt.step()
        if step + 1 == steps:
            break


def _plain(value):
    """JSON-comparable copy of a (nested) state: tensors as lists."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _snapshot(model, opt, sampler) -> dict:
    return _plain({"model": model.state_dict(), "optimizer": opt.state_dict(), "dynamix": opt.dynamix_state_dict(),
                   "sampler": sampler.state_dict()})


def _member_data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each zip member's (first byte of its data, length) in the file."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            f.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", f.read(4))
            offsets[info.filename] = (info.header_offset + 30 + name_length + extra_length, info.file_size)
    return offsets


def _damaged_copies(good: Path, directory: Path) -> dict[str, Path]:
    """Copies of ``good`` with one bit flipped in each region (zip headers, tensor data, the
    pickled sampler state, the digest) and truncated at several lengths."""
    data = good.read_bytes()
    members = _member_data_offsets(good)
    pickle_start, pickle_length = next(v for k, v in members.items() if k.endswith("data.pkl"))
    pickled = data[pickle_start:pickle_start + pickle_length]
    sampler_at = pickle_start + pickled.index(b"dataset_size")
    flips = {"header:first byte": 0, "header:local header size field": 20, "header:first member name": 35,
             "header:central directory": data.rindex(b"PK\x01\x02") + 16, "header:end record": len(data) - 100,
             "digest": len(data) - 1, "sampler:key": sampler_at + 3, "sampler:value": sampler_at + 20,
             "pickle:start": pickle_start + 1}
    for name, (start, length) in members.items():
        if "/data/" in name and length:
            flips[f"tensor data:{name.rsplit('/', 1)[-1]}"] = start + length // 2
    copies = {}
    for label, offset in flips.items():
        damaged = bytearray(data)
        damaged[offset] ^= 0x10
        copies[f"flip {label} @{offset}"] = damaged
    trailer = len(checkpoint._DIGEST_LABEL) + 64
    for length in (0, 1, 21, 100, len(data) // 2, len(data) - trailer - 1, len(data) - trailer, len(data) - 1):
        copies[f"truncated to {length} of {len(data)} bytes"] = data[:length]
    paths = {}
    for index, (label, content) in enumerate(copies.items()):
        paths[label] = directory / f"damaged{index}.pt"
        paths[label].write_bytes(bytes(content))
    return paths


def _foreign_and_mismatched(directory: Path, good: Path) -> dict[str, Path]:
    paths = {"text file": directory / "notes.pt", "plain torch.save": directory / "plain.pt",
             "pickle": directory / "pickle.pt", "newer format": directory / "newer.pt",
             "negative format": directory / "negative.pt", "format 0": directory / "zero.pt",
             "a directory": directory / "a-directory.pt", "a symlink loop": directory / "loop.pt"}
    paths["text file"].write_text("not a checkpoint\n")
    torch.save({"weights": torch.ones(3)}, paths["plain torch.save"])
    paths["pickle"].write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.")
    for label, version in (("newer format", checkpoint.FORMAT_VERSION + 97), ("negative format", -5), ("format 0", 0)):
        _write_with_digest(paths[label], {**torch.load(good, weights_only=True), "format": version})
    paths["a directory"].mkdir()
    os.symlink(paths["a symlink loop"].name, paths["a symlink loop"])
    # Intact files whose sampler, model or optimizer part does not fit: only one part is wrong.
    edits = {
        "another model": lambda state: state["model"].update({"0.weight": torch.zeros(8, 7)}),
        "sampler for another dataset": lambda state: state["sampler"].update(dataset_size=DATASET_SIZE + 10),
        "sampler position out of range": lambda state: state["sampler"]["position"].update(offset=-4),
        "sampler without assignments": lambda state: state["sampler"]["schedule"].update(assignments=[]),
        "optimizer group of another size": lambda state: state["optimizer"]["param_groups"][0]["params"].pop(),
        "invalid gradient statistics": lambda state: state["optimizer"]["dynamix"]["gradient_noise"].update(smoothing=7.0),
    }
    for index, (label, edit) in enumerate(edits.items()):
        state = torch.load(good, weights_only=True)
        edit(state)
        paths[label] = directory / f"mismatched{index}.pt"
        _write_with_digest(paths[label], state)
    return paths


def _write_with_digest(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        writer = checkpoint._DigestingWriter(f)
        torch.save(state, writer)
        writer.finish()


def refused_loads(directory: str) -> dict:
    """Save a checkpoint after 2 steps, train on, then try every damaged, foreign or mismatched
    file: returns per case the error raised and whether model, optimizer or sampler changed; and
    whether the good file loads and brings the saved state back."""
    directory = Path(directory)
    model, opt, sampler = _job()
    _train(model, opt, sampler, 2)
    good = directory / "good.pt"
    bps.save_checkpoint(good, model, opt, sampler)
    saved = _snapshot(model, opt, sampler)
    cases = {**_damaged_copies(good, directory), **_foreign_and_mismatched(directory, good)}
    _train(model, opt, sampler, 1)
    before = _snapshot(model, opt, sampler)
    results = {}
    for label, path in cases.items():
        try:
            bps.load_checkpoint(path, model, opt, sampler)
            error = None
        except Exception as exc:  # the test asserts it is a ConfigurationError
            error = {"type": type(exc).__name__, "message": str(exc),
                     "configuration_error": isinstance(exc, ConfigurationError)}
        results[label] = {"path": str(path), "error": error, "unchanged": _snapshot(model, opt, sampler) == before}
    bps.load_checkpoint(good, model, opt, sampler)
    return {"cases": results, "good_restores": _snapshot(model, opt, sampler) == saved, "changed": before != saved}


def legacy_format_1(directory: str) -> dict:
    """A format-1 checkpoint (no digest, as older versions wrote) still loads; one flipped bit
    in its tensor data is caught by the zip CRCs."""
    directory = Path(directory)
    model, opt, sampler = _job()
    _train(model, opt, sampler, 2)
    state = {"format": 1, "workers": 1, "extra": {"note": "old"}, "model": model.state_dict()}
    legacy = directory / "legacy.pt"
    torch.save(state, legacy)
    start, length = next(v for k, v in _member_data_offsets(legacy).items() if "/data/" in k and v[1])
    damaged = bytearray(legacy.read_bytes())
    damaged[start + length // 2] ^= 0x01
    (directory / "legacy_damaged.pt").write_bytes(bytes(damaged))
    extra = bps.load_checkpoint(legacy, model)
    try:
        bps.load_checkpoint(directory / "legacy_damaged.pt", model)
        error = None
    except ConfigurationError as exc:
        error = str(exc)
    return {"extra": extra, "damaged_error": error}


def _stepped(model, make_optimizer):
    """``make_optimizer(model)`` after one step, so that it has state a failed load could spoil."""
    opt = make_optimizer(model)
    _train(model, opt, bps.DynamicBatchSampler(DATASET_SIZE, BATCH, seed=3), 1)
    return opt


def _wrapped(optimizer_class, **options):
    return lambda model: bps.DistributedOptimizer(optimizer_class(model.parameters(), **options),
                                                  model.named_parameters())


def _reversed_sgd(model):
    return torch.optim.SGD(list(model.parameters())[::-1], lr=0.1, momentum=0.9)


def _try_load(path: Path, model, opt) -> dict:
    """Load ``path`` into ``model`` and ``opt``: the error (None when it loaded), whether either
    changed, and the error of one more step (None when the optimizer could still step)."""
    before = _plain({"model": model.state_dict(), "optimizer": opt.state_dict()})
    try:
        bps.load_checkpoint(path, model, opt)
        error = None
    except Exception as exc:  # the test asserts it is a ConfigurationError
        error = {"type": type(exc).__name__, "message": str(exc),
                 "configuration_error": isinstance(exc, ConfigurationError)}
    unchanged = _plain({"model": model.state_dict(), "optimizer": opt.state_dict()}) == before
    try:
        _train(model, opt, bps.DynamicBatchSampler(DATASET_SIZE, BATCH, seed=3), 1)
        step_error = None
    except Exception as exc:  # the test asserts there is none
        step_error = f"{type(exc).__name__}: {exc}"
    return {"path": str(path), "error": error, "unchanged": unchanged, "step_error": step_error}


def optimizer_mismatches(directory: str) -> dict:
    """A checkpoint of SGD with momentum loaded into optimizers it does not fit (Adam, wrapped
    or plain; SGD over the parameters in reverse order), from a current file and from one
    without the optimizer's class and shapes (as older versions wrote), into freshly stepped
    objects: the error and whether model or optimizer changed, per case; what the current file
    records of the optimizer. Also loads that must work: the older file into the same optimizer,
    and Adafactor (whose state is not shaped like its parameters) into Adafactor."""
    directory = Path(directory)
    model, opt, sampler = _job()
    _train(model, opt, sampler, 2)
    current, older = directory / "sgd.pt", directory / "sgd-older.pt"
    bps.save_checkpoint(current, model, opt)
    state = torch.load(current, weights_only=True)
    recorded = {key: state.pop(key, None) for key in ("optimizer_class", "optimizer_shapes")}
    _write_with_digest(older, state)
    targets = {"Adam, wrapped": _wrapped(torch.optim.Adam, lr=0.01),
               "Adam, plain": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
               "parameters in reverse order": _reversed_sgd}
    refused = {}
    for file_label, path in (("current file", current), ("older file", older)):
        for label, make in targets.items():
            target = _model(seed=1)
            refused[f"{file_label} into {label}"] = _try_load(path, target, _stepped(target, make))
    target = _model(seed=1)
    loaded = {"older file into the same optimizer": _try_load(older, target, _stepped(target, _wrapped(
        torch.optim.SGD, lr=0.1, momentum=0.9)))}
    model = _model()
    bps.save_checkpoint(directory / "adafactor.pt", model, _stepped(model, _wrapped(torch.optim.Adafactor)))
    target = _model(seed=1)
    loaded["Adafactor into Adafactor"] = _try_load(directory / "adafactor.pt", target,
                                                   _stepped(target, _wrapped(torch.optim.Adafactor)))
    return {"recorded": recorded, "refused": refused, "loaded": loaded}


def save_through_symlink(directory: str) -> dict:
    """save_checkpoint to a symlink (a run directory's name for a file on shared storage)."""
    directory = Path(directory)
    (directory / "shared").mkdir()
    (directory / "run").mkdir()
    target, link = directory / "shared" / "ckpt.pt", directory / "run" / "ckpt.pt"
    target.write_text("the previous checkpoint\n")
    link.symlink_to(target)
    model = _model()
    bps.save_checkpoint(link, model, note="new")
    return {"link_is_symlink": link.is_symlink(), "target_extra": bps.load_checkpoint(target, _model(seed=1)),
            "files": sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))}
