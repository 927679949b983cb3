"""Handles that are no handle of the running session, given to ``bps.poll``/``bps.synchronize``
by a careless caller: each is refused with the documented ValueError (NotInitializedError after
``shutdown()``), whatever its type."""

from __future__ import annotations

import pytest
from multiworker import ok, run_workers

from dynamix_byteps.engine.base import HandleTable

UNKNOWN = "is unknown, was already synchronized, or belongs to a session ended by shutdown()"


@pytest.mark.parametrize("bogus", [[1], {}, {"a": 1}, bytearray(b"x"), -1, 1.5, "abc", None])
def test_an_unhashable_or_bogus_handle_is_an_unknown_handle_not_a_type_error(bogus):
    table = HandleTable()
    table.add("entry")  # pop on an empty dict never hashes its key: test a table in use
    for method in (table.get, table.pop):
        with pytest.raises(ValueError, match=UNKNOWN):
            method(bogus)
    assert len(table) == 1


@pytest.mark.timeout(120)
def test_a_real_session_refuses_every_bogus_handle_with_value_error_and_a_closed_one_with_not_initialized():
    [outcomes] = ok(run_workers(1, "breakit_handle_cases:bogus_handles"))
    closed = outcomes.pop("after shutdown")
    assert closed.startswith("NotInitializedError: dynamix_byteps has not been initialized"), closed
    for attack, outcome in outcomes.items():
        assert outcome.startswith("ValueError: handle ") and outcome.endswith(UNKNOWN), (attack, outcome)
