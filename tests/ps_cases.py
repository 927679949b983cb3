"""Cases run in the workers of a ``ps`` job (tests/test_ps_engine.py, benchmarks/ps_engine.py)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

import dynamix_byteps.torch as bps
from dynamix_byteps import engine as engines
from dynamix_byteps import timing
from dynamix_byteps.errors import CommunicationError

# (name, dtype, elements); with BYTEPS_PARTITION_BYTES=4096 they are cut into 3, 1, 2, 2 and 1 partitions
SPECS = (("f32", torch.float32, 3000), ("f64", torch.float64, 100), ("f16", torch.float16, 3000),
         ("i64", torch.int64, 1000), ("one", torch.float32, 1))


def _value(rank: int, round_: int, dtype, numel: int) -> torch.Tensor:
    """Small integers, exact in every dtype and in their sum over a few workers."""
    return (torch.arange(numel) % 13 + (rank + 1) * (1 + round_ % 7)).to(dtype)


def _expected(size: int, round_: int, dtype, numel: int) -> torch.Tensor:
    ranks = sum(rank + 1 for rank in range(size))
    return (size * (torch.arange(numel) % 13) + ranks * (1 + round_ % 7)).to(dtype)


def sums(rounds: int, in_flight: int) -> dict:
    """``rounds`` rounds, back to back; each issues ``in_flight`` tensors of :data:`SPECS` (cycling)
    before waiting for them. Returns the wrong results (at most 5 described), the rounds per second
    and whether every partition's push and pull was timed, once each, under its kind."""
    engine, size, rank = engines.current(), bps.size(), bps.rank()
    wrong, examples, issued, partitions = 0, [], 0, 0
    timing.ring().end_step()
    start = time.perf_counter()
    for round_ in range(rounds):
        pending = []
        for _ in range(in_flight):
            name, dtype, numel = SPECS[issued % len(SPECS)]
            issued += 1
            tensor = _value(rank, round_, dtype, numel)
            pending.append((name, dtype, numel, tensor, engine.all_reduce_async(tensor, name)))
            partitions += len(engine.plan.partitions(name, numel, tensor.element_size(), str(dtype)))
        for name, dtype, numel, tensor, handle in pending:
            handle.wait()
            if not torch.equal(tensor, _expected(size, round_, dtype, numel)):
                wrong += 1
                if len(examples) < 5:
                    examples.append(f"round {round_} {name}: {tensor.view(-1)[:4].tolist()}")
    elapsed = time.perf_counter() - start
    engine.flush_timings()
    kinds = timing.ring().end_step()["kinds"]  # counts include events a full ring dropped
    timed = [kinds[k]["count"] for k in timing.KINDS] == [0, partitions, partitions]
    return {"wrong": wrong, "examples": examples, "rounds_per_s": rounds / elapsed, "timed": timed}


def pull_without_wait(rounds: int, delay_s: float) -> dict:
    """Rank 0 sleeps ``delay_s`` before each round's push, so the others wait for it at the server.
    Returns per round this worker's push and pull spans from the timing ring, the seconds its
    ``wait`` took and the part of them its own transfers covered: the others' pulls and exposed
    communication must not contain the wait."""
    engine, rank = engines.current(), bps.rank()
    engine.all_reduce_async(torch.ones(1000), "wait").wait()  # connections are set up here
    timing.ring().end_step()
    pushes, pulls, waits, exposed = [], [], [], []
    for _ in range(rounds):
        engine.barrier()
        timing.step_comm()  # the barrier's own push and pull are not this round's
        if rank == 0:
            time.sleep(delay_s)
        begin = timing.now_ns()
        engine.all_reduce_async(torch.ones(1000), "wait").wait()
        end = timing.now_ns()
        waits.append((end - begin) * 1e-9)
        comm = timing.step_comm((begin, end))
        pushes.append(comm.push_s)
        pulls.append(comm.pull_s)
        exposed.append(comm.exposed_s)
    return {"push_s": pushes, "pull_s": pulls, "wait_s": waits, "exposed_s": exposed}


def averages(rounds: int) -> dict:
    """``bps.push_pull(average=True)`` of random floats and of integers over ``rounds`` rounds: the
    largest error against the exact mean, and a digest of every result (the same on every rank)."""
    size, rank = bps.size(), bps.rank()
    digest, worst = hashlib.sha256(), 0.0
    for round_ in range(rounds):
        for dtype in (torch.float32, torch.float64, torch.float16):
            values = [torch.randn(700, generator=torch.Generator().manual_seed(1000 * round_ + r)).to(dtype)
                      for r in range(size)]
            mean = bps.push_pull(values[rank].clone(), average=True, name=f"avg.{dtype}")
            exact = torch.stack([v.double() for v in values]).mean(0)
            tolerance = {torch.float16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
            worst = max(worst, float((mean.double() - exact).abs().max()) / tolerance)
            digest.update(mean.numpy().tobytes())
        total = bps.push_pull(torch.tensor([rank + round_]), average=False, name="avg.int")
        if int(total) != sum(r + round_ for r in range(size)):
            worst = float("inf")
    return {"worst_over_tolerance": worst, "digest": digest.hexdigest()}


def all_checks(one_in_flight_rounds: int, five_in_flight_rounds: int, average_rounds: int) -> dict:
    """:func:`sums` with one tensor in flight, then five, then :func:`averages`: one job, three checks."""
    import torch.distributed as dist

    return {"one_in_flight": sums(one_in_flight_rounds, 1), "five_in_flight": sums(five_in_flight_rounds, 5),
            "averages": averages(average_rounds), "default_group_size": dist.get_world_size()}


def frontend(batch_sizes: list[int], steps: int) -> dict:
    """The torch frontend's cases of tests/dist_cases.py in one job: batch-weighted training,
    broadcasts from rank 1, and mismatches that must raise everywhere and leave the job usable."""
    import dist_cases

    return {"training": dist_cases.weighted_training(batch_sizes, steps, 1),
            "broadcasts": dist_cases.broadcasts(), "mismatches": dist_cases.mismatches(),
            "dtypes": broadcast_every_dtype(1)}


BROADCAST_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def _bit_patterns(dtype, rank: int) -> torch.Tensor:
    """Rank-dependent values of ``dtype``: random bytes, so -0.0, NaN payloads and infinities too
    (a bool's byte is 0 or 1: other bytes are no bool)."""
    size = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    return torch.randint(0, high, (5 * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank)).view(dtype)


def broadcast_every_dtype(root: int) -> dict:
    """``broadcast_parameters`` from ``root`` of a 0-d, an empty and a 5-element tensor of each
    dtype torch can store in a model; per dtype, whether every byte now equals the root's."""
    rank, equal = bps.rank(), {}
    for dtype in BROADCAST_DTYPES:
        tensors = {"scalar": _bit_patterns(dtype, rank)[0].clone(), "empty": _bit_patterns(dtype, rank)[:0],
                   "five": _bit_patterns(dtype, rank)}
        bps.broadcast_parameters(tensors, root_rank=root)
        roots = {"scalar": _bit_patterns(dtype, root)[0], "empty": _bit_patterns(dtype, root)[:0],
                 "five": _bit_patterns(dtype, root)}
        equal[str(dtype)] = all(torch.equal(tensors[k].view(-1).view(torch.uint8), roots[k].view(-1).view(torch.uint8))
                                for k in tensors)
    return equal


def until_failure(ready_dir: str, limit_s: float) -> dict:
    """Sum rounds until one fails; rank 0 leaves ``ready_dir/ready`` after 5 rounds. Returns the
    error's type and message and the seconds from the last good round to the error."""
    engine, rank = engines.current(), bps.rank()
    last_good = time.monotonic()
    deadline = last_good + limit_s
    round_ = 0
    while time.monotonic() < deadline:
        tensor = torch.ones(5000)
        try:
            engine.all_reduce_async(tensor, "x").wait()
        except CommunicationError as error:
            return {"error": type(error).__name__, "message": str(error)[:300],
                    "after_s": time.monotonic() - last_good, "rounds": round_}
        last_good = time.monotonic()
        round_ += 1
        if round_ == 5 and rank == 0:
            Path(ready_dir, "ready").touch()
    return {"error": None, "rounds": round_}


def round_trip(nbytes: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` in-place sums of ``nbytes`` of float32, after a barrier each."""
    engine = engines.current()
    tensor = torch.ones(nbytes // 4)
    engine.all_reduce_async(tensor, "bench").wait()  # connections and keys are set up here
    times = []
    for _ in range(repeats):
        engine.barrier()
        start = time.perf_counter()
        engine.all_reduce_async(tensor, "bench").wait()
        times.append(time.perf_counter() - start)
    return times


def pid() -> int:
    return os.getpid()
