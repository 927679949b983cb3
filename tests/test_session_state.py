"""Issue 21: a session's state (timing ring and names, push_pull handles) belongs to its engine,
so ``shutdown()`` then ``init()`` starts clean, and a training step changes no module-level state
but the engine handle and the default batch plan."""

import pytest
from multiworker import ok, run_workers


@pytest.mark.timeout(120)
def test_a_new_session_sees_no_handle_name_or_event_of_the_one_before():
    [result] = ok(run_workers(1, "session_cases:fresh_session_after_shutdown"))
    assert set(result["first_names"]) >= {"first.session.tensor", "push_pull.noname.0"}
    assert "unknown" in result["stale_handle"]
    assert result["names_at_start"] == [] and result["events_at_start"] == 0
    assert "push_pull.noname.0" in result["second_names"]  # auto names count from 0 again
    assert "first.session.tensor" not in result["second_names"]


@pytest.mark.timeout(120)
def test_a_training_step_changes_no_module_state_but_the_engine_and_default_plan(tmp_path):
    env = {"DYNAMIX_LOG_DIR": str(tmp_path), "DYNAMIX_DECISION_INTERVAL": "1"}  # scalars written every step
    [changed] = ok(run_workers(1, "session_cases:module_state_across_a_step", env=env))
    assert changed == []
    assert list((tmp_path / "tensorboard" / "worker-0").glob("events.out.tfevents.*"))


def test_a_handle_table_numbers_from_1_and_forgets_what_was_popped():
    from dynamix_byteps.engine.base import HandleTable

    table = HandleTable()
    first, second = table.add("a"), table.add("b")
    assert second == first + 1 and 0 < first < 2**52 and len(table) == 2
    assert table.get(first) == "a" and table.pop(first) == "a"
    for stale in (first, 99):
        with pytest.raises(ValueError, match="unknown, was already synchronized"):
            table.pop(stale)
    assert [table.auto_name("push_pull.noname") for _ in range(2)] == ["push_pull.noname.0", "push_pull.noname.1"]
    # a later session's table: empty, and its handles are not the earlier session's numbers
    later = HandleTable()
    issued = [later.add(n) for n in range(1000)]
    assert first not in issued and second not in issued
    with pytest.raises(ValueError, match="unknown, was already synchronized"):
        later.pop(second)
