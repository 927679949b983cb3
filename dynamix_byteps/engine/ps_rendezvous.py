"""Where the ``ps`` engine's workers and servers meet: a ``torch.distributed.rpc`` (TensorPipe) group
of its own, apart from torch.distributed's default process group (which stays the workers' only).

The RPC group has ``num_servers + num_workers`` members: servers ``server0 .. server{K-1}`` are
RPC ranks ``0 .. K-1``, worker rank ``r`` is ``worker{r}`` at RPC rank ``K + r``. Server 0 hosts
the rendezvous store at ``DMLC_PS_ROOT_URI:DYNAMIX_PS_PORT`` (the PS host, beside the scheduler).

Variables (BytePS's names where BytePS has one):

* ``DMLC_NUM_SERVER``: number of summation servers K (required);
* ``DYNAMIX_PS_PORT``: TCP port of the RPC rendezvous; default ``DMLC_PS_ROOT_PORT + 1``;
* ``DYNAMIX_PS_ADDR``: its host, server 0's (``bpslaunch --server-hosts``); default ``DMLC_PS_ROOT_URI``,
  the host of the workers' process group;
* ``DYNAMIX_SERVER_ID``: a server's index 0..K-1 (servers only);
* ``DYNAMIX_TIMEOUT``: seconds an RPC may take, as every collective;
* ``DYNAMIX_PS_CHANNELS``: the TensorPipe channels tensors may take, comma-separated names of
  :data:`CHANNELS` (default: TensorPipe's choice, ``cma`` between processes of one machine).
  ``basic`` sends every tensor through the transport's socket, so over the network; the network
  test bed sets it, because its emulated hosts share one kernel and ``cma`` would copy tensors
  from process to process past their emulated links.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping

from dynamix_byteps.argtypes import url_host
from dynamix_byteps.env import DEFAULT_TIMEOUT_S, optional_int
from dynamix_byteps.errors import ConfigurationError

MAX_SERVERS = 1024
SCHEME = "dynamixps"  # torch.distributed.rendezvous's scheme of meet()
#: A server's exit status when a worker stopped it because the job failed: the workers' own exits
#: say why, so bpslaunch does not count it as the cause.
STOPPED_BY_A_WORKER = 3
#: TensorPipe's CPU channels (how tensor payloads travel): through the socket, cross-memory attach
#: between processes of one machine, multiplexed sockets, and within one process.
CHANNELS = ("basic", "cma", "mpt_uv", "xth")


def channels_from_env(env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """``DYNAMIX_PS_CHANNELS`` as a tuple of channel names; None when unset or empty.

    Raises:
        ConfigurationError: a name that is not one of :data:`CHANNELS`.
    """
    text = (os.environ if env is None else env).get("DYNAMIX_PS_CHANNELS", "")
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in CHANNELS]
    if unknown:
        raise ConfigurationError(f"DYNAMIX_PS_CHANNELS={text!r} names unknown TensorPipe channel(s) {unknown}; "
                                 f"use a comma-separated list of {', '.join(CHANNELS)}, or unset it")
    return names or None


def server_name(index: int) -> str:
    return f"server{index}"


def worker_name(rank: int) -> str:
    return f"worker{rank}"


@dataclass(frozen=True)
class PSRendezvous:
    """The RPC group of one ``ps`` job.

    Attributes:
        num_servers: summation servers K.
        num_workers: worker processes W.
        addr, port: the rendezvous store (hosted by server 0).
        timeout_s: seconds an RPC (a push, a pull, the rendezvous) may take.
        channels: the TensorPipe channels tensors may take (:data:`CHANNELS`); None: TensorPipe's choice.
    """

    num_servers: int
    num_workers: int
    addr: str
    port: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    channels: tuple[str, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.num_servers + self.num_workers

    def worker_rpc_rank(self, rank: int) -> int:
        return self.num_servers + rank

    @classmethod
    def from_environ(cls, num_workers: int, root_addr: str, root_port: int | None, timeout_s: float,
                     env: Mapping[str, str] | None = None) -> "PSRendezvous":
        """The group as ``DMLC_NUM_SERVER`` and ``DYNAMIX_PS_PORT`` give it, for a job of ``num_workers``.

        Raises:
            ConfigurationError: ``DMLC_NUM_SERVER`` unset or invalid, no port for the rendezvous, or
                an unknown channel in ``DYNAMIX_PS_CHANNELS``.
        """
        env = os.environ if env is None else env
        servers = optional_int(env, "DMLC_NUM_SERVER", 1, MAX_SERVERS)
        if servers is None:
            raise ConfigurationError("the ps engine needs DMLC_NUM_SERVER (the number of summation servers); "
                                     "start the job with bpslaunch --engine ps --num-servers K, or set it as BytePS does")
        port = optional_int(env, "DYNAMIX_PS_PORT", 1, 65535)
        if port is None and root_port is not None:
            port = root_port + 1 if root_port < 65535 else None
        if port is None:
            raise ConfigurationError("the ps engine needs DYNAMIX_PS_PORT (or DMLC_PS_ROOT_PORT, to use the port "
                                     "after it) for the rendezvous of its servers and workers")
        return cls(servers, num_workers, env.get("DYNAMIX_PS_ADDR") or root_addr, port, timeout_s, channels_from_env(env))

    def wait_for_store(self) -> None:
        """Return once the rendezvous store (server 0) accepts connections; ``torch.distributed.rpc``
        itself would wait for it for 30 minutes whatever its timeout.

        Raises:
            RuntimeError: nothing listens there within ``timeout_s`` (torch's DistNetworkError or
                DistStoreError).
        """
        import datetime

        import torch.distributed as dist

        dist.TCPStore(self.addr, self.port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s))

    def rpc_options(self):
        """TensorPipe options: this group's store (:func:`meet`), the RPC timeout and its channels."""
        from torch.distributed import rpc

        _register_meet()
        # TensorPipe's shm transport busy-polls a core in every process, which starves a host that
        # runs several workers and servers (26 rounds/s instead of ~100 on 2 cores); uv (TCP) does
        # not, and is what crosses hosts anyway. Channels stay TensorPipe's choice (cma on one host).
        return rpc.TensorPipeRpcBackendOptions(init_method=f"{SCHEME}://{url_host(self.addr)}:{self.port}"
                                                           f"?timeout={self.timeout_s!r}",
                                               rpc_timeout=self.timeout_s, _transports=["uv"],
                                               _channels=list(self.channels) if self.channels else None)


def meet(url: str, **_):
    """torch.distributed.rendezvous handler of ``dynamixps://HOST:PORT?timeout=S&rank=R&world_size=N``:
    torch's ``tcp://`` store (RPC rank 0 hosts it), returned once every member of the group has
    joined it and all count the same members. Without this, init_rpc waited forever (its gloo
    group's 24-day timeout) for a member that never came: a server started for more workers than
    torchrun started, or a server or worker that never started.

    Raises:
        RuntimeError: ``S`` seconds passed before all ``N`` members joined, or the members that
            joined count different group sizes (the message says how many and what to check).
    """
    import datetime
    from urllib.parse import parse_qs, urlparse

    import torch.distributed as dist

    parsed = urlparse(url)
    query = {name: values[0] for name, values in parse_qs(parsed.query).items()}
    rank, world_size, timeout_s = int(query["rank"]), int(query["world_size"]), float(query["timeout"])
    store = dist.TCPStore(parsed.hostname, parsed.port, world_size, rank == 0, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, multi_tenant=True)
    _wait_for_every_member(store, world_size, timeout_s, hosting=rank == 0)
    yield store, rank, world_size
    raise RuntimeError(f"{SCHEME}:// cannot meet again")  # as tcp://: a static group meets once


def _wait_for_every_member(store, world_size: int, timeout_s: float, hosting: bool) -> None:
    store.add(f"dynamix.ps.counting.{world_size}", 1)  # before joining: counted once all have joined
    if store.add("dynamix.ps.joined", 1) == world_size:
        store.set("dynamix.ps.complete", "1")
    try:
        store.wait(["dynamix.ps.complete"])
    except RuntimeError:
        problem = (f"only {store.add('dynamix.ps.joined', 0)} of the {world_size} members of the ps group (servers "
                   "and workers) joined it in time.")
    else:
        agreeing = store.add(f"dynamix.ps.counting.{world_size}", 0)
        if agreeing == world_size:
            return
        problem = (f"the servers and the workers count different numbers of members: this process counts {world_size} "
                   f"(servers + workers) and {agreeing} of the {store.add('dynamix.ps.joined', 0)} that joined count "
                   "so; a server started in BytePS's environment mode serves DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE "
                   "workers, which must be the workers started (torchrun's --nnodes x --nproc-per-node).")
    store.add("dynamix.ps.told", 1)
    if hosting:  # the store leaves with this process: once the others have read why, or after the timeout
        deadline = time.monotonic() + timeout_s
        while store.add("dynamix.ps.told", 0) < store.add("dynamix.ps.joined", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
    raise RuntimeError(problem)


def _register_meet() -> None:
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(SCHEME, meet)
    except RuntimeError:
        pass  # registered already: an earlier group of this process
