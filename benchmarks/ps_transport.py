"""Which transport the ``ps`` engine is built on: push+pull round trips over two candidates,
against the gloo ring all-reduce of the same bytes.

Candidates, each with W worker processes and K summation-server processes on loopback, the
tensor cut into 4,096,000-byte partitions spread round-robin over the servers:

* ``rpc``: ``torch.distributed.rpc`` (TensorPipe, uv transport as the ps engine); per partition one ``push`` RPC (the server
  adds the payload and acknowledges) and one ``pull`` RPC answered by the server once the
  round's last push arrived (``@rpc.functions.async_execution``);
* ``gloo-p2p``: a second ``ProcessGroupGloo`` (own TCPStore) over workers and servers; per
  partition a header and a payload ``send`` to the server, which sums and ``send``s the sum
  back to every worker on a tag per partition;
* ``ring``: ``dist.all_reduce`` over the W workers' default gloo group (the current engine).

A round trip is the time from the first push to the last sum received, on worker 0; rounds follow
each other (the ring's after a barrier) and the first, which sets up connections, is not timed.
The median over ``--repeats`` and the min-max spread are printed and written as JSON.

    python benchmarks/ps_transport.py --workers 4 --servers 2 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_report  # noqa: E402

from dynamix_byteps.launcher.topology import free_port  # noqa: E402

PARTITION_BYTES = 4096000
TRANSPORTS = ["uv"]  # as the ps engine: TensorPipe's shm transport busy-polls a core in every process
SIZES = {"1.7MB": 1_700_000, "36MB": 36_000_000}


def _partitions(numel: int) -> list[tuple[int, int]]:
    step = PARTITION_BYTES // 4
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


# ---- rpc: the probe's server state lives in this process's _RpcServer (one per server process)
class _RpcServer:
    lock = threading.Lock()
    workers = 0
    sums: dict = {}
    counts: dict = {}
    waiting: dict = {}

    @staticmethod
    def push(key, tensor):
        s = _RpcServer
        with s.lock:
            if key in s.sums:
                s.sums[key] += tensor
            else:
                s.sums[key] = tensor.clone()
            s.counts[key] = s.counts.get(key, 0) + 1
            if s.counts[key] == s.workers:
                total = s.sums.pop(key)
                s.counts.pop(key)
                waiters = s.waiting.pop(key, [])
                if len(waiters) < s.workers:
                    s.sums[("done", key)] = total
                    s.counts[("pulled", key)] = len(waiters)
                for future in waiters:
                    future.set_result(total)

    @staticmethod
    @torch.distributed.rpc.functions.async_execution
    def pull(key):
        s = _RpcServer
        future = torch.futures.Future()
        with s.lock:
            done = s.sums.get(("done", key))
            if done is None:
                s.waiting.setdefault(key, []).append(future)
                return future
            s.counts[("pulled", key)] += 1
            if s.counts[("pulled", key)] == s.workers:
                s.sums.pop(("done", key))
                s.counts.pop(("pulled", key))
        future.set_result(done)
        return future


def _rpc_role(role, index, workers, servers, port, sizes, repeats):
    from torch.distributed import rpc

    channels = os.environ.get("PS_PROBE_CHANNELS")  # None: every channel TensorPipe has (cma on one host)

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120,
                                           _transports=TRANSPORTS, _channels=channels.split(",") if channels else None)
    rank = index if role == "server" else servers + index
    name = f"server{index}" if role == "server" else f"worker{index}"
    _RpcServer.workers = workers
    rpc.init_rpc(name, rank=rank, world_size=workers + servers, rpc_backend_options=opts)
    results = {}
    if role == "worker":
        for label, nbytes in sizes.items():
            tensor = torch.ones(nbytes // 4)
            times = []
            for r in range(repeats + 1):
                start = time.perf_counter()
                futures = []
                for p, (a, b) in enumerate(_partitions(tensor.numel())):
                    server = f"server{p % servers}"
                    key = (label, r, p)
                    futures.append(rpc.rpc_async(server, _RpcServer.push, args=(key, tensor[a:b].clone())))
                    futures.append(rpc.rpc_async(server, _RpcServer.pull, args=(key,)))
                for f in futures:
                    f.wait()
                if r:  # the first round pays for connection setup
                    times.append(time.perf_counter() - start)
            results[label] = times
    rpc.shutdown()
    return results


def _gloo_p2p_role(role, index, workers, servers, port, sizes, repeats):
    import datetime

    import torch.distributed as dist

    rank = index if role == "server" else servers + index
    store = dist.TCPStore("127.0.0.1", port, workers + servers, rank == 0, datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("ps", store), rank, workers + servers,
                                  datetime.timedelta(seconds=120))
    results = {}
    if role == "server":
        lock = threading.Lock()
        sums, counts = {}, {}

        def serve(worker):
            while True:
                header = torch.zeros(2, dtype=torch.int64)
                group.recv([header], servers + worker, 0).wait()
                key, numel = int(header[0]), int(header[1])
                if numel < 0:
                    return
                payload = torch.empty(numel)
                group.recv([payload], servers + worker, 0).wait()
                with lock:
                    if key in sums:
                        sums[key] += payload
                    else:
                        sums[key] = payload
                    counts[key] = counts.get(key, 0) + 1
                    complete = counts[key] == workers
                    if complete:
                        total = sums.pop(key)
                        counts.pop(key)
                if complete:
                    for w in range(workers):
                        group.send([total], servers + w, 1 + key % 1000).wait()

        threads = [threading.Thread(target=serve, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        key = 0
        for label, nbytes in sizes.items():
            tensor = torch.ones(nbytes // 4)
            times = []
            for r in range(repeats + 1):
                start = time.perf_counter()
                works = []
                for p, (a, b) in enumerate(_partitions(tensor.numel())):
                    server = p % servers
                    header = torch.tensor([key, b - a], dtype=torch.int64)
                    works.append(group.send([header], server, 0))
                    works.append(group.send([tensor[a:b].contiguous()], server, 0))
                    works.append(group.recv([tensor[a:b]], server, 1 + key % 1000))
                    key += 1
                for w in works:
                    w.wait()
                tensor.fill_(1.0)
                if r:
                    times.append(time.perf_counter() - start)
            results[label] = times
        for server in range(servers):
            group.send([torch.tensor([0, -1], dtype=torch.int64)], server, 0).wait()
    return results


def _ring_role(role, index, workers, servers, port, sizes, repeats):
    import torch.distributed as dist

    results = {}
    if role == "server":
        return results
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=workers)
    for label, nbytes in sizes.items():
        tensor = torch.ones(nbytes // 4)
        times = []
        for r in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if r:
                times.append(time.perf_counter() - start)
        results[label] = times
    dist.destroy_process_group()
    return results


ROLES = {"rpc": _rpc_role, "gloo-p2p": _gloo_p2p_role, "ring": _ring_role}


def _child(argv):
    transport, role, index, workers, servers, port, repeats, out = argv
    torch.set_num_threads(1)
    results = ROLES[transport](role, int(index), int(workers), int(servers), int(port), SIZES, int(repeats))
    Path(out).write_text(json.dumps(results))



def run(transport: str, workers: int, servers: int, repeats: int, timeout: float = 600) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            roles = [("server", i) for i in range(servers)] + [("worker", i) for i in range(workers)]
            for role, i in roles:
                procs.append(subprocess.Popen([sys.executable, __file__, "--child", transport, role, str(i),
                                               str(workers), str(servers), str(port), str(repeats),
                                               os.path.join(tmp, f"{role}{i}.json")],
                                              env={**os.environ, "OMP_NUM_THREADS": "1"}))
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        return json.loads(Path(tmp, "worker0.json").read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--transports", default="ring,rpc,gloo-p2p")
    parser.add_argument("--rpc-channels", default="all",
                        help="TensorPipe channels of the rpc candidate, comma-separated, or 'all' (the default, "
                             "as the ps engine): TensorPipe's choice")
    parser.add_argument("--out", type=Path, default=RESULTS / "ps_transport.json")
    args = parser.parse_args()
    if args.rpc_channels != "all":
        os.environ["PS_PROBE_CHANNELS"] = args.rpc_channels
    rows = []
    load_before = os.getloadavg()[0]
    for transport in args.transports.split(","):
        times = run(transport, args.workers, args.servers, args.repeats)
        for label, values in times.items():
            row = {"transport": transport, "size": label,
                   "rpc_channels": args.rpc_channels if transport == "rpc" else None, "median_ms": statistics.median(values) * 1e3,
                   "min_ms": min(values) * 1e3, "max_ms": max(values) * 1e3, "times_s": values}
            rows.append(row)
            print(f"{transport:<9} {label:>6}  median {row['median_ms']:8.2f} ms  "
                  f"[{row['min_ms']:.2f}, {row['max_ms']:.2f}]", flush=True)
    write_report(args.out, {"benchmark": "ps_transport", "workers": args.workers, "servers": args.servers,
                            "repeats": args.repeats, "partition_bytes": PARTITION_BYTES,
                            "load_average_1min_before": load_before, "results": rows})


if __name__ == "__main__":
    main()
