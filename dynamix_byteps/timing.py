"""Communication timing: a lock-free ring of transfer spans and an interned table of tensor names,
owned by the running engine.

Times are CLOCK_MONOTONIC nanoseconds (:func:`now_ns`, the clock of ``time.monotonic_ns()``),
sizes are bytes. The ring is :class:`dynamix_byteps._core.TimingRing`; its capacity comes
from ``DYNAMIX_TIMING_CAPACITY`` (events, default 65536) when its owner is created.

Every engine owns one :class:`CommTiming` (``engine.timing``), created with it by ``bps.init()``
and dropped with it by ``bps.shutdown()``: a session started after a shutdown sees no event and
no name of the one before. The engines record into their own; the module functions
(:func:`ring`, :func:`record`, :func:`name_id`, :func:`names`, :func:`step_comm`) act on the
running engine's, so nothing here is module state.

Every event has a kind (:data:`KINDS`): :data:`PUSH_PULL`, a whole collective of the gloo, nccl
or byteps engine; :data:`PUSH` and :data:`PULL`, the two halves of a ``ps`` engine transfer.
The ring keeps each step's aggregates per kind, so :func:`step_comm` gives a worker's own push
and pull time of the step apart. Given the step's exposed wait (the time the worker blocked on its
gradients after backward), it also measures how much of that wait this worker's own pushes and
pulls were in flight: the communication backward did not hide, without the wait for other workers.
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass

import numpy as np

from dynamix_byteps._core import TIMING_KINDS, TimingRing, now_ns
from dynamix_byteps.env import optional_int

__all__ = ["KINDS", "NO_COMM", "PULL", "PUSH", "PUSH_PULL", "CommTiming", "Span", "StepComm", "TimingRing", "covered_ns",
           "current", "name_id", "names", "now_ns", "record", "ring", "step_comm"]

#: Names of the kinds, by value: ``KINDS[PUSH] == "push"``.
KINDS: tuple[str, ...] = TIMING_KINDS
PUSH_PULL, PUSH, PULL = (KINDS.index(k) for k in ("push_pull", "push", "pull"))

DEFAULT_CAPACITY = 65536
_TRANSFERS_PER_STEP = 65536  # push and pull spans one step keeps for its exposed time


def _capacity_from_env() -> int:
    return optional_int(os.environ, "DYNAMIX_TIMING_CAPACITY", 1, 2**30) or DEFAULT_CAPACITY


@dataclass(frozen=True)
class StepComm:
    """One step's communication by kind, wall-clock seconds from the first start to the last end
    of that kind's events (overlapping partitions count once); 0.0 when the step had none.

    Attributes:
        push_pull_s: collectives of a ring engine.
        push_s: ``ps`` pushes, from issue until the server acknowledged them.
        pull_s: ``ps`` pulls, the sums' transfer (the server's wait for the other workers excluded).
        exposed_s: ``ps``: seconds of the step's exposed wait (given to :meth:`CommTiming.step_comm`)
            during which at least one of this worker's pushes or pulls was in flight: its own
            communication that backward did not hide. Pushes and pulls overlap backward and each
            other, so ``push_s + pull_s`` can exceed the whole step while ``exposed_s`` cannot
            exceed the wait. 0.0 without a wait or without ``ps`` transfers.
    """

    push_pull_s: float
    push_s: float
    pull_s: float
    exposed_s: float = 0.0

    def __add__(self, other: StepComm) -> StepComm:
        """Kind by kind sum: the spans of two parts of one step (an untimed section between them)."""
        return StepComm(self.push_pull_s + other.push_pull_s, self.push_s + other.push_s, self.pull_s + other.pull_s,
                        self.exposed_s + other.exposed_s)


NO_COMM = StepComm(0.0, 0.0, 0.0)


def covered_ns(start_ns: np.ndarray, end_ns: np.ndarray, window: tuple[int, int]) -> int:
    """Nanoseconds of ``window = (begin, end)`` covered by at least one interval ``[start_ns[k], end_ns[k]]``
    (int64 arrays of equal length; overlapping intervals count once)."""
    begin, end = window
    s = np.clip(start_ns, begin, end)
    e = np.clip(end_ns, begin, end)
    keep = e > s
    if not keep.any():
        return 0
    order = np.argsort(s[keep], kind="stable")
    s, e = s[keep][order], e[keep][order]
    reached = np.concatenate(([begin], np.maximum.accumulate(e)[:-1]))
    return int(np.clip(e - np.maximum(s, reached), 0, None).sum())


class CommTiming:
    """One engine's timing ring and the names its events refer to by id.

    Args:
        capacity: events the ring holds before it drops (rounded up to a power of two by the ring);
            None: ``DYNAMIX_TIMING_CAPACITY``, default :data:`DEFAULT_CAPACITY`.

    Attributes:
        ring: the :class:`TimingRing`.

    Raises:
        ConfigurationError: ``DYNAMIX_TIMING_CAPACITY`` is not an integer in [1, 2**30].
    """

    def __init__(self, capacity: int | None = None):
        self.ring = TimingRing(_capacity_from_env() if capacity is None else capacity)
        # This step's push and pull spans, (start_ns, end_ns), for the exposed part of its wait; bounded
        # for an owner whose steps nobody closes. deque appends and pops are atomic across threads.
        self._transfers: collections.deque[tuple[int, int]] = collections.deque(maxlen=_TRANSFERS_PER_STEP)
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._names: list[str] = []

    def name_id(self, name: str) -> int:
        """The uint32 id of ``name``: assigned on first use (0, 1, 2, ...), stable for this owner."""
        i = self._ids.get(name)
        if i is None:
            with self._lock:
                i = self._ids.get(name)
                if i is None:
                    i = len(self._names)
                    self._names.append(name)
                    self._ids[name] = i
        return i

    def names(self) -> list[str]:
        """All interned names; ``names()[i]`` is the name whose id is ``i``."""
        with self._lock:
            return list(self._names)

    def record(self, name: str, nbytes: int, start_ns: int, end_ns: int, kind: int = PUSH_PULL) -> None:
        """Record one transfer of ``nbytes`` bytes on tensor ``name`` from ``start_ns`` to ``end_ns``,
        of ``kind`` (:data:`PUSH_PULL`, :data:`PUSH` or :data:`PULL`).

        A full ring drops the event (counted in ``ring.dropped``) but it still counts in
        ``ring.end_step()``. Raises ValueError if ``end_ns < start_ns``, ``nbytes < 0`` or
        ``kind`` is not one of the three.
        """
        i = self._ids.get(name)
        if i is None:
            i = self.name_id(name)
        self.ring.record(i, nbytes, start_ns, end_ns, kind)
        if kind == PUSH or kind == PULL:
            self._transfers.append((start_ns, end_ns))

    def start(self, name: str, nbytes: int) -> Span:
        """A :class:`Span` of ``nbytes`` bytes on ``name`` starting now."""
        return Span(self, name, nbytes, now_ns())

    def step_comm(self, wait_ns: tuple[int, int] | None = None) -> StepComm:
        """Close the ring's step (``ring.end_step()``) and return its spans per kind.

        Args:
            wait_ns: the step's exposed wait, ``(begin, end)`` in :func:`now_ns` nanoseconds; the
                result's ``exposed_s`` is the part of it covered by this worker's push and pull
                events (:func:`covered_ns`). None: ``exposed_s`` is 0.

        One consumer per engine calls it once per training step (the step monitor does); another
        caller would split the steps' aggregates between them.
        """
        kinds = self.ring.end_step()["kinds"]
        spans = []
        while self._transfers:
            spans.append(self._transfers.popleft())
        exposed = 0.0
        if wait_ns is not None and spans:
            starts, ends = np.array(spans, dtype=np.int64).T
            exposed = covered_ns(starts, ends, wait_ns) * 1e-9
        return StepComm(*(kinds[k]["span_ns"] * 1e-9 for k in ("push_pull", "push", "pull")), exposed)


@dataclass(slots=True)
class Span:
    """A transfer being timed, recorded into its owner's ring by :meth:`end`.

    Attributes:
        owner: the :class:`CommTiming` it is recorded into.
        name: the tensor's name.
        nbytes: bytes transferred.
        start_ns: when the transfer was issued, :func:`now_ns` nanoseconds.
    """

    owner: CommTiming
    name: str
    nbytes: int
    start_ns: int

    def end(self, end_ns: int | None = None, kind: int = PUSH_PULL) -> None:
        """Record the transfer as ending at ``end_ns`` (None: now), of ``kind``."""
        self.owner.record(self.name, self.nbytes, self.start_ns, now_ns() if end_ns is None else end_ns, kind)


def current() -> CommTiming:
    """The running engine's :class:`CommTiming`.

    Raises:
        NotInitializedError: no engine runs (``bps.init()`` not called, or ``bps.shutdown()`` was).
    """
    from dynamix_byteps import engine

    return engine.current().timing


def ring() -> TimingRing:
    """The running engine's timing ring. Raises NotInitializedError when none runs."""
    return current().ring


def name_id(name: str) -> int:
    """The id of ``name`` in the running engine's table (:meth:`CommTiming.name_id`)."""
    return current().name_id(name)


def names() -> list[str]:
    """The running engine's interned names (:meth:`CommTiming.names`)."""
    return current().names()


def record(name: str, nbytes: int, start_ns: int, end_ns: int, kind: int = PUSH_PULL) -> None:
    """Record one transfer into the running engine's ring (:meth:`CommTiming.record`)."""
    current().record(name, nbytes, start_ns, end_ns, kind)


def step_comm(wait_ns: tuple[int, int] | None = None) -> StepComm:
    """Close the running engine's step and return its spans per kind (:meth:`CommTiming.step_comm`);
    :data:`NO_COMM` when no engine runs (nothing was communicated)."""
    from dynamix_byteps.errors import NotInitializedError

    try:
        owner = current()
    except NotInitializedError:
        return NO_COMM
    return owner.step_comm(wait_ns)
