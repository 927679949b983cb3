"""Process-wide push_pull timing: one lock-free ring and an interned table of tensor names.

Times are CLOCK_MONOTONIC nanoseconds (:func:`now_ns`, the clock of ``time.monotonic_ns()``),
sizes are bytes. The ring is :class:`dynamix_byteps._core.TimingRing`; its capacity comes
from ``DYNAMIX_TIMING_CAPACITY`` (events, default 65536) when it is first used.
"""

from __future__ import annotations

import os
import threading

from dynamix_byteps._core import TimingRing, now_ns
from dynamix_byteps.env import optional_int

__all__ = ["TimingRing", "name_id", "names", "now_ns", "record", "ring"]

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


def record(name: str, nbytes: int, start_ns: int, end_ns: int) -> None:
    """Record one push_pull of ``nbytes`` bytes on tensor ``name`` from ``start_ns`` to ``end_ns``.

    A full ring drops the event (counted in ``ring().dropped``) but it still counts in
    ``ring().end_step()``. Raises ValueError if ``end_ns < start_ns`` or ``nbytes < 0``.
    """
    i = _ids.get(name)
    if i is None:
        i = name_id(name)
    (_ring or ring()).record(i, nbytes, start_ns, end_ns)
