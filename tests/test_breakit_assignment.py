"""Odd batch-size texts for ``--batch-size``/``--batch-schedule``/``$DYNAMIX_BATCH_SIZE``
(:mod:`dynamix_byteps.assignment`): every one is refused with a message naming it, before any
worker trains on it."""

from __future__ import annotations

import pytest

from dynamix_byteps.assignment import env_batch_sizes, parse_batch_schedule, parse_batch_sizes
from dynamix_byteps.errors import ConfigurationError


@pytest.mark.parametrize("text, why", [
    ("0", "batch sizes '0': 0 is no batch size; each must be at least 1 sample"),
    ("-1", "batch sizes '-1': -1 is no batch size; each must be at least 1 sample"),
    ("8,0,8,8", "batch sizes '8,0,8,8': 0 is no batch size; each must be at least 1 sample"),
    ("3,", "batch sizes '3,' are not comma-separated integers"),
    ("a", "batch sizes 'a' are not comma-separated integers"),
    ("", "batch sizes '' are not comma-separated integers"),
    ("1,2", "batch sizes '1,2' give 2 values for 4 workers; give 1 or 4, one per worker"),
    ("8,2147483648", "batch sizes '8,2147483648': 2147483648 is above the largest batch size, 2147483647 samples"),
])
def test_odd_batch_sizes_are_refused_naming_the_text(text, why):
    with pytest.raises(ConfigurationError) as error:
        parse_batch_sizes(text, 4)
    assert str(error.value) == why


@pytest.mark.parametrize("text, why", [
    ("5:0", "batch sizes '0': 0 is no batch size"),
    ("-1:8", "schedule entry '-1:8' is not STEP:SIZES"),
    ("0:8;00:16", "names a step twice"),
])
def test_odd_schedules_are_refused(text, why):
    with pytest.raises(ConfigurationError, match=why):
        parse_batch_schedule(text, 4)


@pytest.mark.parametrize("garbage", ["0", "-3", "x", "64,", "1,2,3"])
def test_a_garbage_dynamix_batch_size_names_the_variable(monkeypatch, garbage):
    monkeypatch.setenv("DYNAMIX_BATCH_SIZE", garbage)
    with pytest.raises(ConfigurationError, match=f"^DYNAMIX_BATCH_SIZE: batch sizes '{garbage}'"):
        env_batch_sizes("DYNAMIX_BATCH_SIZE", 4)
