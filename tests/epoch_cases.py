"""Worker functions for tests/test_epoch_agreement.py: every worker must draw its own slice of
the same epoch's permutation of the same sampler, else every worker raises TensorMismatchError at
the first step that differs (the round's trailer carries each worker's epoch, step, the digest of
its sampler's settings and its sampler's rank); samplers drawing their own shards
(``num_replicas=1``) are not compared, but may not be mixed with shared ones."""

from __future__ import annotations

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps.errors import TensorMismatchError

SIZE, BATCH, EPOCHS = 100, 10, 3


def _dataset() -> torch.utils.data.TensorDataset:
    x = torch.randn(SIZE, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return torch.utils.data.TensorDataset(x, torch.arange(SIZE))


def _frontend(variant: str, model: torch.nn.Module):
    plain = torch.optim.SGD(model.parameters(), lr=0.01)
    if variant == "ddp":
        return bps.DistributedDataParallel(model), plain
    return model, bps.DistributedOptimizer(plain, model.named_parameters())


MISBUILT = ("swapped_sizes", "rank_sizes", "rank_zero", "mixed_shards", "shards")


def _sampler_for(mode: str, rank: int) -> bps.DynamicBatchSampler:
    """The sampler ``mode`` builds on ``rank``: as the other modes below, or ``swapped_sizes``
    (batch_size [8, 12] on rank 0, [12, 8] elsewhere), ``rank_sizes`` (batch_size 10 (r + 1)),
    ``rank_zero`` (rank=0 everywhere), ``shards`` (num_replicas=1, rank=0, seed=rank: each worker
    shuffles its own copy of the data), ``mixed_shards`` (rank 0 shuffles its own half of the
    data with num_replicas=1, the others share a sampler)."""
    if mode == "swapped_sizes":
        return bps.DynamicBatchSampler(SIZE, [8, 12] if rank == 0 else [12, 8], seed=1)
    if mode == "rank_sizes":
        return bps.DynamicBatchSampler(SIZE, BATCH * (rank + 1), seed=1)
    if mode == "rank_zero":
        return bps.DynamicBatchSampler(SIZE, BATCH, seed=1, rank=0)
    if mode == "mixed_shards" and rank == 0:  # its own half: as many steps per epoch as the shared one's
        return bps.DynamicBatchSampler(SIZE // 2, BATCH, num_replicas=1, rank=0)
    if mode == "shards":
        return bps.DynamicBatchSampler(SIZE, BATCH, seed=rank, num_replicas=1, rank=0)
    length = SIZE - 10 * rank if mode == "rank_seed_and_size" else SIZE
    return bps.DynamicBatchSampler(length, BATCH, seed=rank if mode.startswith("rank_seed") else 1)


def _epoch_for(mode: str, epoch: int, rank: int) -> int | None:
    """The epoch ``mode`` hands ``set_epoch`` before ``epoch`` on ``rank`` (None: no call)."""
    if mode in ("same", "mid_epoch", "rank_seed", "rank_seed_and_size", *MISBUILT):
        return epoch
    if mode == "rank_dependent":
        return epoch + rank
    if mode == "rank0_only":
        return epoch * 2 if rank == 0 else None
    raise ValueError(mode)


def train_epochs(mode: str, variant: str, loader_workers: int = 0) -> dict:
    """The tester's script: 3 epochs over 100 samples, 10 per worker and step, through a
    DataLoader. ``mode``: ``same`` (set_epoch(epoch) everywhere), ``rank_dependent``
    (set_epoch(epoch + rank)), ``rank0_only`` (set_epoch(2 * epoch) on rank 0, no call
    elsewhere), ``mid_epoch`` (as ``same``, and rank 0 calls set_epoch(5) after its second step),
    ``rank_seed`` (as ``same`` with seed=rank), ``rank_seed_and_size`` (as ``rank_seed``, and rank
    r samples the first 100 - 10r), or one of :data:`MISBUILT` (:func:`_sampler_for`). Returns the
    indices this rank trained by epoch, the steps it took and the error it raised."""
    rank, data = bps.rank(), _dataset()
    torch.manual_seed(0)
    sampler = _sampler_for(mode, rank)
    extra = {"num_workers": loader_workers, "prefetch_factor": 2} if loader_workers else {}
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, **extra)
    model = torch.nn.Linear(4, 1).double()
    net, opt = _frontend(variant, model)
    seen: dict[int, list[int]] = {}
    steps = 0
    try:
        for epoch in range(EPOCHS):
            chosen = _epoch_for(mode, epoch, rank)
            if chosen is not None:
                sampler.set_epoch(chosen)
            for x, index in loader:
                opt.zero_grad()
                net(x).sum().backward()
                opt.step()
                steps += 1
                seen.setdefault(epoch, []).extend(index.tolist())
                if mode == "mid_epoch" and rank == 0 and epoch == 0 and steps == 2:
                    sampler.set_epoch(5)
    except TensorMismatchError as exc:
        return {"error": str(exc), "steps": steps, "seen": seen}
    return {"error": None, "steps": steps, "seen": seen}


def misbuilt_samplers(variant: str) -> dict:
    """:func:`train_epochs` for each mode of :data:`MISBUILT` in turn, in one job: mode -> result."""
    return {mode: train_epochs(mode, variant) for mode in MISBUILT}


def resumed_from_checkpoint(where: str) -> dict:
    """A job stopped 3 steps into epoch 1 resumes from its sampler's state: loaded on every
    worker (``where="every"``: the resumed sampler keeps the saved epoch, so set_epoch(1) in the
    resumed loop is a no-op, the workers agree, and epochs 1 and 2 are each covered exactly once)
    or on rank 0 only (``"rank0"``: every worker raises at the first step)."""
    rank, data = bps.rank(), _dataset()
    seen: dict[int, list[int]] = {}
    ahead = bps.DynamicBatchSampler(data, BATCH, seed=1)
    for epoch in range(2):
        ahead.set_epoch(epoch)
        for step, indices in enumerate(ahead):
            seen.setdefault(epoch, []).extend(indices)
            if epoch == 1 and step == 2:
                break
    state = ahead.state_dict()
    sampler = bps.DynamicBatchSampler(data, BATCH, seed=1)
    if where == "every" or rank == 0:
        sampler.load_state_dict(state)
    model = torch.nn.Linear(4, 1).double()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   batch_plan=sampler.batch_plan)
    try:
        for epoch in range(1, 3):
            sampler.set_epoch(epoch)
            for indices in sampler:
                opt.zero_grad()
                model(data.tensors[0][indices]).sum().backward()
                opt.step()
                seen.setdefault(epoch, []).extend(indices)
    except TensorMismatchError as exc:
        return {"error": str(exc), "seen": seen}
    return {"error": None, "seen": seen}


def tensorflow_tape() -> dict:
    """TensorFlow's DistributedGradientTape fed by a sampler (the frontend takes its batch
    sizes from the sampler's draws, as the torch ones do), in one job: 2 epochs trained alike
    (``error`` None, ``seen``: the samples of each), then set_epoch(epoch + rank) on a new sampler
    raises on every worker at the first step (``epoch_error``), and so does one step from a new
    sampler built with seed=rank (``seed_error``)."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import dynamix_byteps.tensorflow as tbps

    rank = tbps.rank()
    x_all = np.random.default_rng(3).normal(size=(SIZE, 4))
    w = tf.Variable(tf.zeros((4, 1), tf.float64))

    def train(sampler, epochs: dict[int, int], seen: dict[int, list[int]]) -> str | None:
        """Train the epochs ``epochs`` maps to what set_epoch gets; the TensorMismatchError's text."""
        try:
            for epoch, chosen in epochs.items():
                sampler.set_epoch(chosen)
                for indices in sampler:
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(tf.constant(x_all[indices]) @ w)
                    (grad,) = tbps.DistributedGradientTape(tape).gradient(loss, [w])
                    w.assign_sub(0.01 * grad)
                    seen.setdefault(epoch, []).extend(indices)
        except TensorMismatchError as exc:
            return str(exc)
        return None

    seen: dict[int, list[int]] = {}
    error = train(tbps.DynamicBatchSampler(SIZE, BATCH, seed=1), {0: 0, 1: 1}, seen)
    return {"error": error, "seen": seen,
            "epoch_error": train(tbps.DynamicBatchSampler(SIZE, BATCH, seed=1), {0: rank}, {}),
            "seed_error": train(tbps.DynamicBatchSampler(SIZE, BATCH, seed=rank), {0: 0}, {})}


def untaken_batches(frontend: str, sizes: list[int]) -> list[str]:
    """Three epochs of ``sizes`` (100 / sum(sizes) steps each) through ``torch_ddp`` (torch's own
    DistributedDataParallel on the process group bps.init() set up) or ``ddp`` (bps's, given the
    training sampler's plan, evaluating each epoch on batches of a validation sampler built next,
    which no frontend takes); the texts of the warnings that no frontend trains on a sampler's batches."""
    import warnings

    torch.set_num_threads(1)
    sampler = bps.DynamicBatchSampler(SIZE, sizes, seed=1)
    validation = bps.DynamicBatchSampler(SIZE, sizes, seed=2) if frontend == "ddp" else None
    model = torch.nn.Linear(4, 1, dtype=torch.float64)
    model = (torch.nn.parallel.DistributedDataParallel(model) if frontend == "torch_ddp"
             else bps.DistributedDataParallel(model, batch_plan=sampler.batch_plan))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for x, _ in torch.utils.data.DataLoader(_dataset(), batch_sampler=sampler):
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
            with torch.no_grad():
                for x, _ in torch.utils.data.DataLoader(_dataset(), batch_sampler=validation or []):
                    model(x)
    return [str(w.message) for w in caught if "no dynamix_byteps frontend" in str(w.message)]
