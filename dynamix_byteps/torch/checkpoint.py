"""One call to save and one to restore a job: model, optimizer, sampler position, assignments,
gradient statistics and the LR-scaling base, written atomically.

Resuming continues the epoch where the last *trained* step left it, also with a different
number of workers (see ``DynamicBatchSampler.load_state_dict``), so no sample is lost or
repeated.

The file is what ``torch.save`` writes (``torch.load`` reads it), with the SHA-256 digest of
everything before it in the zip archive's comment, at the very end: loading checks the digest
before it unpickles anything, so one changed bit anywhere, or a truncation, is refused.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Mapping
from typing import IO, Any

import torch

from dynamix_byteps import engine as _engine
from dynamix_byteps.atomic import atomic_write
from dynamix_byteps.errors import CommunicationError, ConfigurationError
from dynamix_byteps.negotiation import gather_text, negotiate, round_lock
from dynamix_byteps.regular_files import open_regular
from dynamix_byteps.training_step import check_state_dict

FORMAT_VERSION = 2  # 2: a SHA-256 digest ends the file; 1: none (still read, checked by the zip CRCs)

_DIGEST_LABEL = b"dynamix_byteps sha256 "
_TRAILER_LENGTH = len(_DIGEST_LABEL) + 64  # the label and the hex digest: the zip comment
_END_RECORD = struct.Struct("<4s4H2LH")  # zip end of central directory, the last field the comment's length
_END_SIGNATURE = b"PK\x05\x06"
_CHUNK = 1 << 20
_REDO = "load an older checkpoint or save this one again"


class _DigestingWriter:
    """The file object ``torch.save`` writes to: passes the bytes on to ``file`` and hashes
    them, holding back the zip's end record until :meth:`finish` gives it a comment."""

    def __init__(self, file: IO[bytes]):
        self.file, self.digest, self.held = file, hashlib.sha256(), b""

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) >= _END_RECORD.size:
            self._pass_on(self.held)
            self._pass_on(data[:-_END_RECORD.size])
            self.held = bytes(data[-_END_RECORD.size:])
        else:
            joined = self.held + bytes(data)
            self._pass_on(joined[:-_END_RECORD.size])
            self.held = joined[-_END_RECORD.size:]
        return len(data)

    def flush(self) -> None:
        self.file.flush()

    def _pass_on(self, data) -> None:
        self.digest.update(data)
        self.file.write(data)

    def finish(self) -> None:
        """Write the end record, naming a comment, and the comment: label and digest."""
        fields = list(_END_RECORD.unpack(self.held))
        if fields[0] != _END_SIGNATURE or fields[-1] != 0:
            raise RuntimeError("torch.save did not end its archive with a plain zip end record")
        fields[-1] = _TRAILER_LENGTH
        self._pass_on(_END_RECORD.pack(*fields))
        self.file.write(_DIGEST_LABEL + self.digest.hexdigest().encode("ascii"))


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None, optimizer=None,
                    sampler=None, **extra: Any) -> None:
    """Save the job's state to ``path`` (a collective: every worker calls it; rank 0 writes).

    The file is written to a temporary name, flushed to disk and renamed, so a crash never
    leaves a half-written checkpoint at ``path``. A symlink at ``path`` is followed: the file
    it points to is replaced and the link stays.

    Args:
        model: its ``state_dict()`` (identical on every worker).
        optimizer: a ``DistributedOptimizer`` (or a plain optimizer): its state, its class name
            and its parameters' shapes (checked by :func:`load_checkpoint`), and its noise
            statistics and step.
        sampler: a ``DynamicBatchSampler``: its position at the first step not trained on yet
            (not the sampler's own, which runs ahead when a DataLoader prefetches), also when a
            ``DistributedDataParallel`` trains a plain torch optimizer (``sampler.state_dict()``).
        extra: anything else picklable (epoch counters, metrics); returned by ``load_checkpoint``.

    Raises:
        TensorMismatchError: not every worker called it at this point (e.g. only rank 0): the
            call raises on the ranks that made it, and the other ranks' next collective raises
            (if the others never issue another collective, they cannot be told: the call then
            fails with CommunicationError after the engine's timeout). Nothing is written.
        Exception: on rank 0, whatever kept it from writing the file, as raised (OSError for an
            unwritable path or a full disk, TypeError or pickle.PicklingError for an unpicklable
            ``extra``); ``path`` keeps its old content.
        CommunicationError: on the other ranks, at once, when rank 0 could not write the file; the
            message names ``path`` and rank 0's error.
    """
    engine = _engine.current()
    # A checked round, not a bare barrier: called on rank 0 alone (``if rank() == 0:``, the
    # BytePS idiom), it meets the other ranks' next collective and every rank raises
    # TensorMismatchError instead of waiting until the timeout; nothing is written then.
    with round_lock:
        negotiate(engine, "save_checkpoint", "save_checkpoint (a collective: call it on every worker)")
    failure: Exception | None = None
    if engine.rank == 0:
        try:
            _write_checkpoint(path, engine.size, model, optimizer, sampler, extra)
        except Exception as error:
            failure = error
    # Rank 0's outcome, so that the others raise at once when it failed instead of waiting at a
    # barrier that rank 0, carrying on after catching its error, never reaches.
    with round_lock:
        outcome = gather_text(engine, "" if failure is None else f"{type(failure).__name__}: {failure}")[0]
    if failure is not None:
        raise failure
    if outcome:
        raise CommunicationError(f"save_checkpoint: rank 0 could not write {path} ({outcome}); the file there, "
                                 "if any, is unchanged")


def _write_checkpoint(path, workers: int, model, optimizer, sampler, extra: dict) -> None:
    state: dict[str, Any] = {"format": FORMAT_VERSION, "workers": workers, "extra": extra}
    if model is not None:
        state["model"] = model.state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        state["optimizer_class"] = type(optimizer).__name__
        state["optimizer_shapes"] = [list(param.shape) for param in _parameters(optimizer)]
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    with atomic_write(path) as f:
        writer = _DigestingWriter(f)
        torch.save(state, writer)
        writer.finish()


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None, optimizer=None,
                    sampler=None, trusted: bool = False) -> dict:
    """Restore what :func:`save_checkpoint` saved into the given objects; return its ``extra``.

    Every worker reads the file (it must be visible to all of them). By default only tensors and
    plain containers are unpickled (``torch.load(weights_only=True)``), so a foreign file cannot
    run code; pass ``trusted=True`` for checkpoints whose ``extra`` holds other objects.

    All or nothing: the file's digest is checked, then every part asked for is checked against
    its object (the model's keys and shapes; the optimizer's class, parameter groups and
    parameter shapes, and its state tensors against their parameters; the sampler's state), and
    only then is anything changed. A load that still fails half-way is undone from a copy taken
    before it. A load that raises leaves ``model``, ``optimizer`` and ``sampler`` as they were.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ConfigurationError: ``path`` cannot be opened (a directory, a symlink loop, no
            permission), the file is empty, truncated, corrupted (its digest does not match),
            not a dynamix_byteps checkpoint (also: a format number that is not a version),
            written by a newer dynamix_byteps, lacks a part asked for, holds a part that does not
            fit its object (another model, another optimizer class, the optimizer's parameters
            in another order), holds objects that need ``trusted=True``, or could not be loaded
            into the objects; the message names the file and the problem.
    """
    state = _read_checkpoint(path, trusted)
    for name, target in (("model", model), ("optimizer", optimizer), ("sampler", sampler)):
        if target is not None and name not in state:
            raise ConfigurationError(f"{path} holds no {name} state; it was saved without {name}=")
    loads = []  # (what reads the object's state, what loads a state into it, the file's state)
    if model is not None:
        _check_model_state(path, model, state["model"])
        loads.append((model.state_dict, model.load_state_dict, state["model"]))
    if optimizer is not None:
        _check_optimizer_state(path, optimizer, state)
        loads.append((optimizer.state_dict, optimizer.load_state_dict, state["optimizer"]))
        if "dynamix" not in state["optimizer"] and "dynamix" in state and hasattr(optimizer, "load_dynamix_state_dict"):
            # a file from before DistributedOptimizer.state_dict() carried it
            loads.append((optimizer.dynamix_state_dict, optimizer.load_dynamix_state_dict, state["dynamix"]))
    if sampler is not None:
        try:
            sampler.check_state_dict(state["sampler"])
        except ConfigurationError as error:
            raise ConfigurationError(f"{path} holds a sampler state this sampler cannot continue: {error}") from None
        loads.append((sampler.state_dict, sampler.load_state_dict, state["sampler"]))
    undo = []
    try:
        for read, load, saved in loads:
            undo.append((load, _host_copy(read())))
            load(saved)
    except Exception as error:
        for load, previous in reversed(undo):
            load(previous)
        raise ConfigurationError(f"{path} could not be loaded ({type(error).__name__}: {error}); model, optimizer "
                                 "and sampler are as they were; build them as they were when it was saved") from error
    return state.get("extra", {})


def _host_copy(state):
    """A deep copy of ``state`` with its tensors in host memory (a copy on the accelerator could
    take memory the training needs), through the same serialisation as the checkpoint."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=False)


def _parameters(optimizer) -> list:
    """The optimizer's parameters in the order its ``state_dict`` numbers them."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def _read_checkpoint(path, trusted: bool) -> dict:
    """The checkpoint's state after its integrity check; ConfigurationError for anything else."""
    try:
        file = open_regular(path)
    except FileNotFoundError:
        raise
    except OSError as error:  # a directory, a FIFO, a symlink loop, no permission
        raise ConfigurationError(f"{path} cannot be opened as a checkpoint ({error.strerror}); name a "
                                 "checkpoint file") from error
    with file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise ConfigurationError(f"{path} is empty (0 bytes), not a dynamix_byteps checkpoint; {_REDO}")
        digested = _check_digest(path, file, size)
        if not digested:
            _check_zip_crcs(path, file)
        file.seek(0)
        state = _unpickle(path, file, trusted)
    if not isinstance(state, dict) or not isinstance(state.get("format"), int) or isinstance(state["format"], bool):
        raise ConfigurationError(f"{path} is not a dynamix_byteps checkpoint (no format number in it)")
    if state["format"] < 1:
        raise ConfigurationError(f"{path} is not a dynamix_byteps checkpoint (format {state['format']}; versions "
                                 f"start at 1); {_REDO}")
    if state["format"] > FORMAT_VERSION:
        raise ConfigurationError(f"{path} was written by a newer dynamix_byteps (format {state['format']}; this "
                                 f"version reads up to {FORMAT_VERSION}); upgrade dynamix_byteps to load it")
    if state["format"] >= 2 and not digested:
        raise ConfigurationError(f"{path} lacks the digest that ends every format-{state['format']} checkpoint: "
                                 f"it was truncated or changed; {_REDO}")
    return state


def _check_digest(path, file: IO[bytes], size: int) -> bool:
    """True when the file ends with a digest that matches its content; False when it ends with
    none (format 1, or not a checkpoint); ConfigurationError when the digest does not match."""
    if size < _TRAILER_LENGTH + _END_RECORD.size:
        return False
    file.seek(size - _TRAILER_LENGTH)
    trailer = file.read(_TRAILER_LENGTH)
    if not trailer.startswith(_DIGEST_LABEL):
        return False
    file.seek(0)
    digest, left = hashlib.sha256(), size - _TRAILER_LENGTH
    while left > 0:
        chunk = file.read(min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    if digest.hexdigest().encode("ascii") != trailer[len(_DIGEST_LABEL):]:
        raise ConfigurationError(f"{path} is corrupted: its content does not match the SHA-256 digest stored at "
                                 f"its end (a byte was changed or lost); {_REDO}")
    return True


def _check_zip_crcs(path, file: IO[bytes]) -> None:
    """For a file without a digest: it must be a zip archive whose every member matches its CRC."""
    file.seek(0)
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except Exception as error:  # zipfile raises many kinds (BadZipFile, EOFError, ValueError, ...)
        raise ConfigurationError(f"{path} is truncated, corrupted or not a dynamix_byteps checkpoint (not a "
                                 f"complete zip archive: {error}); {_REDO}") from error
    if bad is not None:
        raise ConfigurationError(f"{path} is corrupted: its member {bad!r} does not match its CRC; {_REDO}")


def _unpickle(path, file: IO[bytes], trusted: bool):
    try:
        return torch.load(file, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as error:
        raise ConfigurationError(f"{path} cannot be read as a dynamix_byteps checkpoint ({error}); if you "
                                 "wrote it yourself with objects in extra=, load it with trusted=True") from None
    except Exception as error:  # torch.load raises RuntimeError, EOFError, KeyError, ... on foreign files
        raise ConfigurationError(f"{path} is not a dynamix_byteps checkpoint ({type(error).__name__}: "
                                 f"{error})") from error


def _check_model_state(path, model: torch.nn.Module, saved) -> None:
    """ConfigurationError unless ``saved`` has exactly ``model``'s keys, with its tensor shapes."""
    if not isinstance(saved, Mapping):
        raise ConfigurationError(f"{path} holds a model state that is a {type(saved).__name__}, not a state_dict")
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise ConfigurationError(f"{path} holds a model state for another model: missing keys {missing[:5]}, "
                                 f"unexpected keys {unexpected[:5]}; build the model as it was when saved")
    for key, tensor in expected.items():
        value = saved[key]
        if isinstance(tensor, torch.Tensor) and (not isinstance(value, torch.Tensor) or value.shape != tensor.shape):
            found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigurationError(f"{path} holds {key!r} of shape {found}, the model has {tuple(tensor.shape)}; "
                                     "build the model as it was when saved")


def _check_optimizer_state(path, optimizer, state: dict) -> None:
    """ConfigurationError unless ``state["optimizer"]`` is a state_dict for ``optimizer`` (what
    ``Optimizer.load_state_dict`` would refuse half-way, or load onto the wrong parameters):
    the same class and parameter shapes where the file records them (older files do not), the
    same group sizes, state tensors that fit their parameters; and its ``"dynamix"`` part (in
    older files ``state["dynamix"]``) a valid extra state."""
    saved = state["optimizer"]
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if (not isinstance(groups, list) or not isinstance(saved.get("state"), Mapping)
            or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)):
        raise ConfigurationError(f"{path} holds an optimizer state that is not an optimizer state_dict")
    name = type(optimizer).__name__
    saved_name = state.get("optimizer_class", name)
    if saved_name != name:
        raise ConfigurationError(f"{path} holds the state of an optimizer of class {saved_name}, this one's class "
                                 f"is {name}; build a {saved_name} to resume, or load without optimizer= "
                                 "to start this one afresh")
    saved_sizes = [len(g["params"]) for g in groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise ConfigurationError(f"{path} holds an optimizer state for parameter groups of sizes {saved_sizes}, "
                                 f"this optimizer has {sizes}; build the optimizer as it was when saved")
    parameters = _parameters(optimizer)
    shapes = [list(param.shape) for param in parameters]
    saved_shapes = state.get("optimizer_shapes", shapes)
    if saved_shapes != shapes:
        index = next((i for i, (a, b) in enumerate(zip(saved_shapes, shapes)) if a != b), None)
        where = "" if index is None else (f": parameter {index} had shape {saved_shapes[index]}, this "
                                          f"optimizer's has {shapes[index]}")
        raise ConfigurationError(f"{path} holds an optimizer state for parameters of other shapes{where}; build "
                                 "the optimizer over the same parameters, in the same order, as when saved")
    for index, param in enumerate(parameters):
        entry = saved["state"].get(index)
        for key, value in entry.items() if isinstance(entry, Mapping) else ():
            # At least the parameter's size in another shape: the state of another parameter.
            # Smaller or 0-d tensors can be the optimizer's own (Adafactor's factors, Adam's step).
            if (isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() >= param.numel()
                    and value.shape != param.shape):
                raise ConfigurationError(f"{path} holds optimizer state {key!r} of shape {list(value.shape)} for "
                                         f"parameter {index} of shape {list(param.shape)} (the optimizer lists its "
                                         "parameters in another order than when saved, or is another optimizer); "
                                         "build it as it was then")
    dynamix = saved.get("dynamix", state.get("dynamix"))
    if dynamix is not None and hasattr(optimizer, "load_dynamix_state_dict"):
        _check_dynamix_state(path, dynamix)


def _check_dynamix_state(path, state) -> None:
    """The base batch, gradient statistics and step ``DistributedOptimizer`` restores."""
    try:
        check_state_dict(state)
    except ValueError as error:
        raise ConfigurationError(f"{path} holds an invalid DistributedOptimizer state ({error})") from None
