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
from dataclasses import dataclass
from typing import Mapping

from dynamix_byteps.argtypes import url_host
from dynamix_byteps.env import DEFAULT_TIMEOUT_S, optional_int
from dynamix_byteps.errors import ConfigurationError

MAX_SERVERS = 1024
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
        """TensorPipe options: this group's store, the RPC timeout and its channels."""
        from torch.distributed import rpc

        # TensorPipe's shm transport busy-polls a core in every process, which starves a host that
        # runs several workers and servers (26 rounds/s instead of ~100 on 2 cores); uv (TCP) does
        # not, and is what crosses hosts anyway. Channels stay TensorPipe's choice (cma on one host).
        return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{url_host(self.addr)}:{self.port}",
                                               rpc_timeout=self.timeout_s, _transports=["uv"],
                                               _channels=list(self.channels) if self.channels else None)
