"""Check the CUDA path (the nccl engine) on a machine with NVIDIA GPUs; run it as ``bash scripts/gpu_check.sh``.

    python scripts/gpu_check.py                  # the whole check: prints PASS/FAIL lines
    python scripts/gpu_check.py worker OUT_DIR   # one worker, started by bpslaunch (internal)

The check starts ``bpslaunch -n N --engine nccl`` with N = 2 workers (1 on a machine with one GPU:
NCCL cannot put two ranks on one device, so the cross-worker sums then have one term). Each worker
checks, on CUDA tensors: the engine and device it got, exact sums through ``bps.push_pull`` (float64
and int64, in place and async) and a broadcast of a CPU and a CUDA tensor; one
``DistributedOptimizer`` step and one ``bps.DistributedDataParallel`` step with unequal batches
(3 and 5 samples), each against the same step computed in one process in float64 on the CPU; and
that the timing ring received the reductions' CUDA-timed durations. Rank 0 also checks that the
NVML collector of the node agent (``dynamix_byteps.agent.gpu``) sees the GPU. Exit status: 0 when
every check passes, 1 otherwise (also when no CUDA device is visible, which is checked first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BATCHES = (3, 5)  # samples per worker (rank r takes BATCHES[r]; one worker takes the first)
LR = 0.1
TOLERANCE = 1e-12  # relative, float64 on the GPU against float64 on the CPU
JOB_TIMEOUT_S = 240


def _data(workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch, float64 on the CPU: rows for rank 0 first, then rank 1's."""
    generator = torch.Generator().manual_seed(7)
    n = sum(BATCHES[:workers])
    return torch.randn(n, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (n,), generator=generator)


def _model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _reference(workers: int) -> list[torch.Tensor]:
    """Parameters after one SGD step on the mean loss over the whole global batch (CPU, float64)."""
    model = _model()
    x, y = _data(workers)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return [p.detach().clone() for p in model.parameters()]


def _relative_error(params, reference) -> float:
    return max(float((p.detach().cpu() - r).norm() / r.norm()) for p, r in zip(params, reference))


def worker(out_dir: Path) -> None:
    """One rank's checks; writes OUT_DIR/rank<r>.json with ``checks``: name -> [passed, detail]."""
    import dynamix_byteps.torch as bps
    from dynamix_byteps import engine, timing

    checks: dict[str, list] = {}

    def check(name: str, passed: bool, detail: str) -> None:
        checks[name] = [bool(passed), detail]

    bps.init()
    rank, size = bps.rank(), bps.size()
    try:
        running = engine.current()
        device = torch.device("cuda", torch.cuda.current_device())
        check("engine", running.name == "nccl" and running.device == device,
              f"engine {running.name} on {running.device}, current CUDA device {device}")

        expected = size * (size + 1) / 2
        floats = bps.push_pull(torch.full((1000,), rank + 1.0, dtype=torch.float64, device=device), average=False,
                               name="check.float64")
        ints = torch.full((7,), rank + 1, dtype=torch.int64, device=device)
        bps.synchronize(bps.push_pull_async_inplace(ints, average=False, name="check.int64"))
        check("push_pull", floats.device == device and bool((floats == expected).all()) and
              bool((ints == expected).all()), f"sums {floats[0].item()} and {ints[0].item()}, expected {expected}")

        on_cpu, on_gpu = torch.full((3,), float(rank)), torch.full((3,), float(rank), device=device)
        bps.broadcast_parameters([("check.cpu", on_cpu), ("check.gpu", on_gpu)], root_rank=0)
        check("broadcast", on_cpu.device.type == "cpu" and bool((on_cpu == 0).all()) and bool((on_gpu == 0).all()),
              f"rank 0's zeros arrived: CPU {on_cpu.tolist()}, CUDA {on_gpu.tolist()}")

        x, y = _data(size)
        start = sum(BATCHES[:rank])
        mine = x[start:start + BATCHES[rank]].to(device), y[start:start + BATCHES[rank]].to(device)
        reference = _reference(size)

        model = _model().to(device)
        optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                             named_parameters=model.named_parameters())
        optimizer.set_local_batch_size(len(mine[1]))
        torch.nn.functional.cross_entropy(model(mine[0]), mine[1]).backward()
        optimizer.step()
        error = _relative_error(model.parameters(), reference)
        check("optimizer", error < TOLERANCE, f"relative error {error:.2e} against the float64 CPU reference")

        ddp = bps.DistributedDataParallel(_model(), device_ids=[device.index])
        sgd = torch.optim.SGD(ddp.parameters(), lr=LR)
        torch.nn.functional.cross_entropy(ddp(mine[0]), mine[1]).backward()
        sgd.step()
        error = _relative_error(ddp.module.parameters(), reference)
        check("ddp", error < TOLERANCE, f"relative error {error:.2e} against the float64 CPU reference")

        running.flush_timings()
        events = timing.ring().drain()
        durations = events["end_ns"] - events["start_ns"]
        check("timing", len(durations) > 0 and bool((durations >= 0).all()) and bool((durations > 0).any()),
              f"{len(durations)} CUDA-timed collectives in the ring, {durations.sum() / 1e6:.3f} ms in all")

        if rank == 0:
            from dynamix_byteps.agent.gpu import GpuMonitor

            monitor = GpuMonitor()
            seen = monitor.sample([os.getpid()], device_of={os.getpid(): device.index}).get(os.getpid())
            check("nvml", monitor.available and monitor.device_count >= 1 and seen is not None and seen.available
                  and seen.mem_total_bytes, f"{monitor.device_count} GPUs, this worker's: {seen}"
                  if monitor.available else f"unavailable: {monitor.reason}")
            monitor.close()
    except Exception:  # noqa: BLE001 - a check that crashes is a failed check, reported with its traceback
        check("worker", False, traceback.format_exc())
    finally:
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checks": checks}))
        bps.shutdown()


def main() -> int:
    if not torch.cuda.is_available():
        print(f"FAIL cuda: no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}) "
              "sees no GPU; run this on a machine with an NVIDIA GPU and a CUDA build of torch (README.md, "
              "'Engines and devices')")
        return 1
    workers = min(2, torch.cuda.device_count())
    print(f"PASS cuda: {torch.cuda.device_count()} GPU(s), {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if workers == 1:
        print("NOTE one GPU: NCCL cannot put two ranks on one device, so 1 worker runs; sums have one term")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "dynamix_byteps.launcher", "-n", str(workers), "--engine", "nccl", "--",
                   sys.executable, str(Path(__file__).resolve()), "worker", tmp]
        try:
            job = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired as timeout:
            print(f"FAIL job: bpslaunch did not finish in {JOB_TIMEOUT_S} s\n{timeout.stdout or ''}{timeout.stderr or ''}")
            return 1
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    failed = job.returncode != 0 or len(results) != workers
    print(f"{'FAIL' if failed else 'PASS'} job: bpslaunch -n {workers} --engine nccl exited {job.returncode}, "
          f"{len(results)} of {workers} workers reported")
    for result in results:
        for name, (passed, detail) in result["checks"].items():
            print(f"{'PASS' if passed else 'FAIL'} rank {result['rank']} {name}: {detail}")
            failed = failed or not passed
    if failed:
        print(f"--- bpslaunch output ---\n{job.stdout}{job.stderr}")
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(Path(sys.argv[2]))
    else:
        sys.exit(main())
