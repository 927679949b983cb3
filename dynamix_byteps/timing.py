"""Process-wide communication timing: one lock-free ring and an interned table of tensor names.

Times are CLOCK_MONOTONIC nanoseconds (:func:`now_ns`, the clock of ``time.monotonic_ns()``),
sizes are bytes. The ring is :class:`dynamix_byteps._core.TimingRing`; its capacity comes
from ``DYNAMIX_TIMING_CAPACITY`` (events, default 65536) when it is first used.

Every event has a kind (:data:`KINDS`): :data:`PUSH_PULL`, a whole collective of the gloo, nccl
or byteps engine; :data:`PUSH` and :data:`PULL`, the two halves of a ``ps`` engine transfer.
The ring keeps each step's aggregates per kind, so :func:`step_comm` gives a worker's own push
and pull time of the step apart.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from dynamix_byteps._core import TIMING_KINDS, TimingRing, now_ns
from dynamix_byteps.env import optional_int

__all__ = ["KINDS", "PULL", "PUSH", "PUSH_PULL", "StepComm", "TimingRing", "name_id", "names", "now_ns", "record",
           "ring", "step_comm"]

#: Names of the kinds, by value: ``KINDS[PUSH] == "push"``.
KINDS: tuple[str, ...] = TIMING_KINDS
PUSH_PULL, PUSH, PULL = (KINDS.index(k) for k in ("push_pull", "push", "pull"))

DEFAULT_CAPACITY = 65536

_lock = threading.Lock()
_ring: TimingRing | None = None
_ids: dict[str, int] = {}
_names: list[str] = []


def _capacity_from_env() -> int:
    return optional_int(os.environ, "DYNAMIX_TIMING_CAPACITY", 1, 2**30) or DEFAULT_CAPACITY


def ring() -> TimingRing:
    """The process's timing ring, created on first call.

    Raises:
        ConfigurationError: ``DYNAMIX_TIMING_CAPACITY`` is not an integer in [1, 2**30].
    """
    global _ring
    r = _ring
    if r is None:
        with _lock:
            if _ring is None:
                _ring = TimingRing(_capacity_from_env())
            r = _ring
    return r


def name_id(name: str) -> int:
    """The uint32 id of ``name``: assigned on first use (0, 1, 2, ...), stable for the process."""
    i = _ids.get(name)
    if i is None:
        with _lock:
            i = _ids.get(name)
            if i is None:
                i = len(_names)
                _names.append(name)
                _ids[name] = i
    return i


def names() -> list[str]:
    """All interned names; ``names()[i]`` is the name whose id is ``i``."""
    with _lock:
        return list(_names)


def record(name: str, nbytes: int, start_ns: int, end_ns: int, kind: int = PUSH_PULL) -> None:
    """Record one transfer of ``nbytes`` bytes on tensor ``name`` from ``start_ns`` to ``end_ns``,
    of ``kind`` (:data:`PUSH_PULL`, :data:`PUSH` or :data:`PULL`).

    A full ring drops the event (counted in ``ring().dropped``) but it still counts in
    ``ring().end_step()``. Raises ValueError if ``end_ns < start_ns``, ``nbytes < 0`` or
    ``kind`` is not one of the three.
    """
    i = _ids.get(name)
    if i is None:
        i = name_id(name)
    (_ring or ring()).record(i, nbytes, start_ns, end_ns, kind)


@dataclass(frozen=True)
class StepComm:
    """One step's communication by kind, wall-clock seconds from the first start to the last end
    of that kind's events (overlapping partitions count once); 0.0 when the step had none.

    Attributes:
        push_pull_s: collectives of a ring engine.
        push_s: ``ps`` pushes, from issue until the server acknowledged them.
        pull_s: ``ps`` pulls, the sums' transfer (the server's wait for the other workers excluded).
    """

    push_pull_s: float
    push_s: float
    pull_s: float


def step_comm() -> StepComm:
    """Close the process ring's step (``ring().end_step()``) and return its spans per kind.

    One consumer per process calls it once per training step (the step monitor does); another
    caller would split the steps' aggregates between them.
    """
    kinds = ring().end_step()["kinds"]
    return StepComm(*(kinds[k]["span_ns"] * 1e-9 for k in ("push_pull", "push", "pull")))
