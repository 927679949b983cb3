"""How the ``ps`` engine cuts tensors into partitions and which server owns each partition's key.

As in BytePS, a tensor is cut into partitions of at most ``BYTEPS_PARTITION_BYTES`` bytes
(default 4,096,000); each partition gets an integer key, in the order tensors are first seen,
and is owned by one summation server. Every worker issues the same collectives in the same order
(the engines' contract), so every worker builds the same plan without talking to the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from dynamix_byteps.env import optional_int

DEFAULT_PARTITION_BYTES = 4096000


def partition_bytes_from_env(env: Mapping[str, str] | None = None) -> int:
    """``BYTEPS_PARTITION_BYTES`` (bytes per partition, default 4,096,000).

    Raises:
        ConfigurationError: not a positive integer.
    """
    return optional_int(os.environ if env is None else env, "BYTEPS_PARTITION_BYTES", 1) or DEFAULT_PARTITION_BYTES


@dataclass(frozen=True)
class Partition:
    """One partition of a tensor: elements ``[start, stop)`` of its flattened view.

    Attributes:
        key: the partition's key, the same on every worker.
        server: index of the server that owns the key, ``0 <= server < num_servers``.
        start, stop: element offsets in the flattened tensor.
        nbytes: ``(stop - start) * element_size``.
        label: ``<tensor>:<index>``, the name its push and its pull are timed under in the timing
            ring (told apart by the events' kind, ``timing.PUSH`` / ``timing.PULL``).
    """

    key: int
    server: int
    start: int
    stop: int
    nbytes: int
    label: str


class KeyPlan:
    """Partitions and key owners of every tensor a worker pushes, balanced by bytes over the servers.

    Each new partition goes to the server that owns the fewest bytes so far (the lowest index on a
    tie), which depends only on the order and sizes of the tensors declared: identical on every worker.
    """

    def __init__(self, num_servers: int, partition_bytes: int = DEFAULT_PARTITION_BYTES):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        if partition_bytes < 1:
            raise ValueError(f"partition_bytes must be >= 1, got {partition_bytes}")
        self.num_servers = num_servers
        self.partition_bytes = partition_bytes
        self.server_bytes = [0] * num_servers  # bytes of the keys each server owns
        self._plans: dict[tuple, tuple[Partition, ...]] = {}
        self._next_key = 0

    @property
    def num_keys(self) -> int:
        return self._next_key

    def partitions(self, name: str, numel: int, element_size: int, dtype: str) -> tuple[Partition, ...]:
        """The partitions of tensor ``name`` (``numel`` elements of ``element_size`` bytes, ``dtype``
        its name), declared on first use. A name seen again with another size or dtype is a new
        tensor with new keys. An empty tensor has no partitions."""
        signature = (name, numel, dtype)
        plan = self._plans.get(signature)
        if plan is None:
            plan = self._plans[signature] = self._declare(name, numel, element_size)
        return plan

    def _declare(self, name: str, numel: int, element_size: int) -> tuple[Partition, ...]:
        per_partition = max(1, self.partition_bytes // element_size)
        parts = []
        for index, start in enumerate(range(0, numel, per_partition)):
            stop = min(start + per_partition, numel)
            nbytes = (stop - start) * element_size
            server = min(range(self.num_servers), key=lambda s: (self.server_bytes[s], s))
            self.server_bytes[server] += nbytes
            parts.append(Partition(self._next_key, server, start, stop, nbytes, f"{name}:{index}"))
            self._next_key += 1
        return tuple(parts)
