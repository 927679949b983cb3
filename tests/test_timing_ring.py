"""Timing ring of the native core (dynamix_byteps._core) and its Python owner (dynamix_byteps.timing)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamix_byteps import _core, timing

KEYS = {"name_id": np.uint32, "nbytes": np.uint64, "start_ns": np.int64, "end_ns": np.int64}


def as_tuples(d: dict) -> list[tuple[int, int, int, int]]:
    return list(zip(*(d[k].tolist() for k in KEYS)))


def totals(step: dict) -> dict:
    """end_step()'s aggregates over every kind, without the per-kind breakdown."""
    return {k: v for k, v in step.items() if k != "kinds"}


EMPTY = {"count": 0, "bytes": 0, "busy_ns": 0, "span_ns": 0}


@pytest.mark.timeout(60)
def test_round_trip_preserves_values_dtypes_and_order():
    ring = _core.TimingRing(16)
    events = [(i % 3, 1000 * i, 10 * i, 10 * i + i) for i in range(10)]
    events.append((2**32 - 1, 2**62, -5, 2**62))  # extreme but valid values survive unchanged
    for e in events:
        assert ring.record(*e) is True
    assert ring.size == len(events)
    out = ring.drain()
    assert set(out) == set(KEYS) | {"kind"}
    assert out["kind"].dtype == np.uint8 and out["kind"].tolist() == [timing.PUSH_PULL] * len(events)
    for key, dtype in KEYS.items():
        assert out[key].dtype == dtype
        assert out[key].shape == (len(events),)
    assert as_tuples(out) == events
    assert ring.size == 0
    assert as_tuples(ring.drain()) == []
    assert ring.dropped == 0


@pytest.mark.timeout(60)
def test_drain_max_events_takes_oldest_first():
    ring = _core.TimingRing(8)
    for i in range(6):
        ring.record(i, i, i, i)
    assert [e[0] for e in as_tuples(ring.drain(2))] == [0, 1]
    assert [e[0] for e in as_tuples(ring.drain(0))] == []
    assert [e[0] for e in as_tuples(ring.drain(100))] == [2, 3, 4, 5]


@pytest.mark.timeout(60)
def test_capacity_rounds_up_to_power_of_two():
    assert _core.TimingRing().capacity == 65536
    assert _core.TimingRing(5).capacity == 8
    assert _core.TimingRing(8).capacity == 8
    assert _core.TimingRing(1000).capacity == 1024
    assert _core.TimingRing(1).capacity == 2  # the per-slot sequence scheme needs two slots


@pytest.mark.timeout(60)
def test_overflow_returns_false_and_counts_drops_exactly():
    ring = _core.TimingRing(8)
    results = [ring.record(i, 1, i, i + 1) for i in range(8 + 13)]
    assert results == [True] * 8 + [False] * 13
    assert ring.dropped == 13
    assert ring.size == 8
    # the ring keeps the first 8 events, not the last ones
    assert [e[0] for e in as_tuples(ring.drain())] == list(range(8))
    # room again after draining
    assert ring.record(99, 1, 0, 1) is True
    assert ring.dropped == 13
    # dropped events still count in the step aggregates
    step = ring.end_step()
    assert step["count"] == 22
    assert step["bytes"] == 22


@pytest.mark.timeout(60)
def test_wrap_around_over_many_cycles():
    ring = _core.TimingRing(8)
    next_id = 0
    expected_next = 0
    for cycle in range(2000):
        n = 1 + cycle % 8  # 1..8 events per cycle, so positions drift across slot boundaries
        for _ in range(n):
            assert ring.record(next_id, next_id, next_id, next_id + 1)
            next_id += 1
        take = n if cycle % 3 else max(1, n // 2)
        got = [e[0] for e in as_tuples(ring.drain(take))]
        assert got == list(range(expected_next, expected_next + len(got)))
        expected_next += len(got)
        rest = [e[0] for e in as_tuples(ring.drain())]
        assert rest == list(range(expected_next, expected_next + len(rest)))
        expected_next += len(rest)
    assert expected_next == next_id
    assert next_id > 8 * 500
    assert ring.dropped == 0


@pytest.mark.timeout(60)
def test_end_step_aggregates_are_exact_and_reset():
    ring = _core.TimingRing(64)
    assert ring.end_step() == {**EMPTY, "kinds": {k: EMPTY for k in timing.KINDS}}
    ring.record(0, 100, 1_000, 1_500)
    ring.record(1, 200, 1_200, 1_300)
    ring.record(2, 300, 900, 2_000)  # earliest start and latest end, out of order
    step = ring.end_step()
    assert totals(step) == {"count": 3, "bytes": 600, "busy_ns": 500 + 100 + 1_100, "span_ns": 2_000 - 900}
    assert step["kinds"]["push_pull"] == totals(step)  # the default kind
    assert step["kinds"]["push"] == step["kinds"]["pull"] == EMPTY
    assert totals(ring.end_step()) == EMPTY
    ring.record(0, 7, -10, -4)
    # draining does not touch the aggregates, and end_step does not touch the events
    assert len(ring.drain()["name_id"]) == 4
    assert totals(ring.end_step()) == {"count": 1, "bytes": 7, "busy_ns": 6, "span_ns": 6}
    ring.record(0, 7, 5, 5)
    assert totals(ring.end_step()) == {"count": 1, "bytes": 7, "busy_ns": 0, "span_ns": 0}
    assert ring.size == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [0, -1, 2**30 + 1])
def test_bad_capacity_raises_value_error(capacity):
    with pytest.raises(ValueError):
        _core.TimingRing(capacity)


@pytest.mark.timeout(60)
def test_bad_record_and_drain_arguments_raise_value_error():
    ring = _core.TimingRing(8)
    with pytest.raises(ValueError):
        ring.record(0, 1, 10, 9)
    with pytest.raises(ValueError):
        ring.record(0, -1, 0, 1)
    with pytest.raises(ValueError):
        ring.record(-1, 1, 0, 1)
    with pytest.raises(ValueError):
        ring.record(2**32, 1, 0, 1)
    with pytest.raises(ValueError):
        ring.drain(-1)
    # rejected calls record nothing
    assert ring.size == 0 and ring.dropped == 0
    assert ring.end_step()["count"] == 0


@pytest.mark.timeout(60)
def test_now_ns_agrees_with_time_monotonic_ns():
    best = None
    for _ in range(20):
        a = time.monotonic_ns()
        n = _core.now_ns()
        b = time.monotonic_ns()
        gap = max(a - n, n - b, 0)  # 0 when n lies between the two Python readings
        best = gap if best is None else min(best, gap)
    assert best < 1_000_000


def _drain_until(ring, done: threading.Event, out: list) -> None:
    while True:
        finished = done.is_set()
        d = ring.drain()
        out.extend(as_tuples(d))
        if finished and ring.size == 0:
            return
        if not len(d["name_id"]):
            time.sleep(0)


def _check_exactly_once_in_order(events, producers: int, per_producer: int, make):
    by_producer: dict[int, list] = {p: [] for p in range(producers)}
    for e in events:
        by_producer[e[0]].append(e)
    for p in range(producers):
        assert by_producer[p] == [make(p, i) for i in range(per_producer)], f"producer {p}"


@pytest.mark.timeout(60)
def test_python_threads_produce_while_consumer_drains():
    producers, per = 4, 20_000
    ring = _core.TimingRing(1024)  # small: producers hit a full ring and retry

    def make(p, i):
        return (p, i, 1_000 * i, 1_000 * i + p + 1)

    retried = [[0, 0, 0] for _ in range(producers)]  # failed attempts: count, bytes, busy_ns

    def produce(p):
        for i in range(per):
            e = make(p, i)
            while not ring.record(*e):
                retried[p][0] += 1
                retried[p][1] += e[1]
                retried[p][2] += e[3] - e[2]
                time.sleep(0)

    got: list = []
    done = threading.Event()
    consumer = threading.Thread(target=_drain_until, args=(ring, done, got))
    consumer.start()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    consumer.join()

    assert len(got) == producers * per
    _check_exactly_once_in_order(got, producers, per, make)
    fails = sum(r[0] for r in retried)
    assert ring.dropped == fails
    # every call counts in the step, including the ones the full ring rejected
    step = ring.end_step()
    assert step["count"] == producers * per + fails
    assert step["bytes"] == producers * (per * (per - 1) // 2) + sum(r[1] for r in retried)
    assert step["busy_ns"] == per * sum(p + 1 for p in range(producers)) + sum(r[2] for r in retried)
    assert step["span_ns"] == 1_000 * (per - 1) + producers
    assert ring.end_step()["count"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [1 << 20, 64])
def test_native_threads_record_concurrently_without_gil(capacity):
    """Real multi-producer contention: C++ threads record with the GIL released."""
    producers, per = 4, 50_000
    ring = _core.TimingRing(capacity)
    got: list = []
    done = threading.Event()
    consumer = threading.Thread(target=_drain_until, args=(ring, done, got))
    consumer.start()
    try:
        fails = _core._record_concurrently(ring, producers, per)
    finally:
        done.set()
        consumer.join()
    # thread t records (t, i, i, i + t + 1) for i in 0..per-1
    _check_exactly_once_in_order(got, producers, per, lambda t, i: (t, i, i, i + t + 1))
    assert len(got) == producers * per
    assert ring.dropped == fails
    if capacity >= producers * per:
        assert fails == 0
    step = ring.end_step()
    assert step["count"] == producers * per + fails
    if fails == 0:
        assert step["bytes"] == producers * (per * (per - 1) // 2)
        assert step["busy_ns"] == per * sum(t + 1 for t in range(producers))
        assert step["span_ns"] == (per - 1) + producers
        # thread t records kind t % 3: with 4 producers, push_pull gets threads 0 and 3
        by_kind = step["kinds"]
        assert [by_kind[k]["count"] for k in timing.KINDS] == [2 * per, per, per]
        assert [by_kind[k]["busy_ns"] for k in timing.KINDS] == [per * (1 + 4), per * 2, per * 3]
        assert [by_kind[k]["span_ns"] for k in timing.KINDS] == [per - 1 + 4, per - 1 + 2, per - 1 + 3]


@pytest.mark.timeout(60)
def test_kinds_are_kept_apart_in_events_and_step_aggregates():
    ring = _core.TimingRing(16)
    ring.record(0, 10, 0, 40, timing.PUSH)
    ring.record(1, 10, 20, 60, timing.PUSH)  # overlaps the first: the span counts the overlap once
    ring.record(0, 30, 100, 130, kind=timing.PULL)
    ring.record(2, 5, 200, 210)
    out = ring.drain()
    assert out["kind"].tolist() == [timing.PUSH, timing.PUSH, timing.PULL, timing.PUSH_PULL]
    step = ring.end_step()
    assert step["kinds"]["push"] == {"count": 2, "bytes": 20, "busy_ns": 80, "span_ns": 60}
    assert step["kinds"]["pull"] == {"count": 1, "bytes": 30, "busy_ns": 30, "span_ns": 30}
    assert step["kinds"]["push_pull"] == {"count": 1, "bytes": 5, "busy_ns": 10, "span_ns": 10}
    assert totals(step) == {"count": 4, "bytes": 55, "busy_ns": 120, "span_ns": 210}
    for bad in (-1, 3, 2**40):
        with pytest.raises(ValueError, match="kind must be 0"):
            ring.record(0, 1, 1, 2, bad)
    with pytest.raises(TypeError, match="kind"):
        ring.record(0, 1, 1, 2, 1, kind=2)  # kind given twice
    with pytest.raises(TypeError):
        ring.record(0, 1, 1, 2, 1, 0)
    assert ring.size == 0 and totals(ring.end_step()) == EMPTY  # refused calls record nothing


@pytest.mark.timeout(60)
def test_step_comm_gives_each_kinds_wall_clock_span_in_seconds():
    owner = timing.CommTiming()
    t0 = timing.now_ns()
    owner.record("test_timing.p0", 100, t0, t0 + 3_000_000, timing.PUSH)
    owner.record("test_timing.p1", 100, t0 + 1_000_000, t0 + 5_000_000, timing.PUSH)
    timing.Span(owner, "test_timing.p0", 100, t0 + 5_000_000).end(t0 + 7_000_000, timing.PULL)
    comm = owner.step_comm()
    assert comm == timing.StepComm(push_pull_s=0.0, push_s=pytest.approx(5e-3), pull_s=pytest.approx(2e-3))
    assert owner.step_comm() == timing.NO_COMM  # the step was closed

    span = owner.start("test_timing.p2", 8)  # starts now, ends when end() is called without a time
    assert span.start_ns >= t0
    span.end()
    assert owner.step_comm().push_pull_s >= 0.0 and owner.names()[-1] == "test_timing.p2"


def test_exposed_communication_is_the_part_of_the_wait_own_pushes_and_pulls_covered():
    """A push that began during backward and a pull after a gap (the server waiting for another
    worker): only their time inside the wait counts, overlaps once, gaps and ring collectives never."""
    owner = timing.CommTiming()
    ms = 1_000_000
    owner.record("b1", 8, 0, 30 * ms, timing.PUSH)  # issued 10 ms before the wait
    owner.record("b2", 8, 15 * ms, 25 * ms, timing.PUSH)  # inside the first: counts once
    owner.record("b1", 8, 40 * ms, 45 * ms, timing.PULL)  # after a 10-ms hold
    owner.record("b2", 8, 44 * ms, 48 * ms, timing.PULL)
    owner.record("metric", 8, 10 * ms, 60 * ms, timing.PUSH_PULL)  # a ring collective is not ps traffic
    comm = owner.step_comm((10 * ms, 60 * ms))
    assert comm.exposed_s == pytest.approx((20 + 8) * 1e-3)
    assert comm.push_s + comm.pull_s == pytest.approx((30 + 8) * 1e-3)  # the whole spans, overlap included
    owner.record("b1", 8, 0, 5 * ms, timing.PUSH)
    assert owner.step_comm((10 * ms, 20 * ms)).exposed_s == 0.0  # hidden entirely behind backward
    assert owner.step_comm((10 * ms, 20 * ms)).exposed_s == 0.0  # the step used its spans up
    owner.record("b1", 8, 0, 5 * ms, timing.PUSH)
    assert owner.step_comm().exposed_s == 0.0  # no wait given: nothing measured


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)), max_size=12),
       st.integers(0, 1000), st.integers(0, 400))
@settings(max_examples=200, deadline=None)
def test_covered_ns_matches_counting_covered_nanoseconds(spans, begin, length):
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([s + d for s, d in spans], dtype=np.int64)
    covered = {t for s, e in zip(starts.tolist(), ends.tolist()) for t in range(max(s, begin), min(e, begin + length))}
    assert timing.covered_ns(starts, ends, (begin, begin + length)) == len(covered)


@pytest.mark.timeout(60)
def test_end_step_concurrent_with_native_producers_loses_nothing():
    """Events recorded while end_step() runs land wholly in exactly one step."""
    producers, per = 4, 100_000
    ring = _core.TimingRing(1 << 20)
    steps: list[dict] = []
    stop = threading.Event()

    def stepper():
        while not stop.is_set():
            steps.append(ring.end_step())
            time.sleep(0)

    t = threading.Thread(target=stepper)
    t.start()
    try:
        assert _core._record_concurrently(ring, producers, per) == 0
    finally:
        stop.set()
        t.join()
    steps.append(ring.end_step())
    assert sum(s["count"] for s in steps) == producers * per
    assert sum(s["bytes"] for s in steps) == producers * (per * (per - 1) // 2)
    assert sum(s["busy_ns"] for s in steps) == per * sum(p + 1 for p in range(producers))
    assert all(s["span_ns"] >= 0 for s in steps)


@pytest.mark.timeout(60)
def test_comm_timing_interns_names_and_records_into_its_ring():
    owner = timing.CommTiming()
    a = owner.name_id("test_timing.layer1.weight")
    b = owner.name_id("test_timing.layer1.bias")
    assert (a, b) == (0, 1)  # each owner numbers its names from 0
    assert owner.name_id("test_timing.layer1.weight") == a
    assert owner.names() == ["test_timing.layer1.weight", "test_timing.layer1.bias"]

    ring = owner.ring
    start = timing.now_ns()
    owner.record("test_timing.layer2.weight", 4096, start, start + 250)
    c = owner.name_id("test_timing.layer2.weight")
    out = ring.drain()
    assert as_tuples(out) == [(c, 4096, start, start + 250)]
    assert totals(ring.end_step()) == {"count": 1, "bytes": 4096, "busy_ns": 250, "span_ns": 250}
    with pytest.raises(ValueError):
        owner.record("test_timing.layer2.weight", 1, 10, 9)
    assert timing.CommTiming().names() == []  # nothing is shared between owners


@pytest.mark.timeout(60)
def test_module_functions_need_a_running_engine():
    from dynamix_byteps import engine
    from dynamix_byteps.errors import NotInitializedError

    assert not engine.is_started()
    for call in (timing.ring, timing.names, lambda: timing.name_id("x"), lambda: timing.record("x", 1, 0, 1)):
        with pytest.raises(NotInitializedError):
            call()
    assert timing.step_comm() == timing.NO_COMM  # no engine: nothing was communicated


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "DYNAMIX_TIMING_CAPACITY"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
def test_timing_capacity_comes_from_environment():
    code = "from dynamix_byteps import timing; print(timing.CommTiming().ring.capacity)"
    default = _run_python(code)
    assert default.returncode == 0, default.stderr
    assert default.stdout.strip() == "65536"
    custom = _run_python(code, DYNAMIX_TIMING_CAPACITY="100")
    assert custom.returncode == 0, custom.stderr
    assert custom.stdout.strip() == "128"
    bad = _run_python(code, DYNAMIX_TIMING_CAPACITY="lots")
    assert bad.returncode != 0
    assert "ConfigurationError" in bad.stderr and "DYNAMIX_TIMING_CAPACITY" in bad.stderr
