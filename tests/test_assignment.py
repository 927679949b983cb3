"""Assignment schedules and the batch-size flag syntax."""

import pytest

from dynamix_byteps.assignment import (
    Assignment,
    AssignmentSchedule,
    BatchBounds,
    InvalidAssignmentError,
    parse_batch_schedule,
    parse_batch_sizes,
)
from dynamix_byteps.errors import ConfigurationError


def test_at_returns_the_assignment_in_force():
    schedule = AssignmentSchedule([4, 4])
    schedule.apply(Assignment((8, 8), 10, 1))
    schedule.apply(Assignment((2, 6), 20, 2))
    assert [schedule.at(s).batch_sizes for s in (0, 9, 10, 19, 20, 99)] == [(4, 4)] * 2 + [(8, 8)] * 2 + [(2, 6)] * 2


def test_a_new_assignment_replaces_pending_later_ones():
    schedule = AssignmentSchedule([4, 4])
    schedule.apply(Assignment((8, 8), 20, 1))
    schedule.apply(Assignment((6, 6), 10, 2))
    assert schedule.at(25).batch_sizes == (6, 6)


def test_stale_versions_are_rejected():
    schedule = AssignmentSchedule([4])
    schedule.apply(Assignment((8,), 5, 3))
    with pytest.raises(InvalidAssignmentError, match="not newer"):
        schedule.apply(Assignment((6,), 9, 3))


def test_per_worker_bounds():
    bounds = BatchBounds.build(2, min_batch=[2, 8], max_batch=[16, 32])
    schedule = AssignmentSchedule([4, 8], bounds)
    with pytest.raises(InvalidAssignmentError, match="rank 1 is outside its bounds"):
        schedule.apply(Assignment((4, 4), 1, 1))
    with pytest.raises(ConfigurationError, match="max_batch for rank 0"):
        BatchBounds.build(2, min_batch=8, max_batch=[4, 16])


def test_state_round_trip():
    schedule = AssignmentSchedule([4, 4])
    schedule.apply(Assignment((8, 2), 7, 1))
    copy = AssignmentSchedule([1, 1])
    copy.load_state_dict(schedule.state_dict())
    assert copy.at(7) == schedule.at(7) and copy.at(0) == schedule.at(0)


def test_flag_syntax():
    assert parse_batch_sizes("64", 3) == (64, 64, 64)
    assert parse_batch_sizes("1,2,3", 3) == (1, 2, 3)
    assert parse_batch_schedule("500:32; 0:8,16", 2) == [(0, (8, 16)), (500, (32, 32))]
    assert parse_batch_schedule("", 2) == []


@pytest.mark.parametrize("text, message", [
    ("1,2", "2 values for 3 workers"),
    ("a", "not comma-separated integers"),
])
def test_bad_sizes(text, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_batch_sizes(text, 3)


@pytest.mark.parametrize("text, message", [("32", "STEP:SIZES"), ("-1:32", "STEP:SIZES"), ("5:32;5:64", "twice")])
def test_bad_schedules(text, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_batch_schedule(text, 2)


def test_batch_arguments_default_to_what_bpslaunch_sets_in_the_environment(monkeypatch):
    import argparse

    from dynamix_byteps.assignment import add_batch_arguments

    def parse(*argv):
        parser = argparse.ArgumentParser()
        add_batch_arguments(parser, batch_size=16)
        return parser.parse_args(argv)

    monkeypatch.delenv("DYNAMIX_BATCH_SIZE", raising=False)
    monkeypatch.delenv("DYNAMIX_LR_SCALING", raising=False)
    args = parse()
    assert (args.batch_size, args.batch_schedule, args.lr_scaling) == ("16", "", "linear")
    monkeypatch.setenv("DYNAMIX_BATCH_SIZE", "24,40")
    monkeypatch.setenv("DYNAMIX_LR_SCALING", "sqrt")
    assert (parse().batch_size, parse().lr_scaling) == ("24,40", "sqrt")
    assert parse("--batch-size", "8", "--lr-scaling", "adascale").batch_size == "8"
    with pytest.raises(SystemExit):
        parse("--lr-scaling", "cubic")
