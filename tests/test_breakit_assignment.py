"""Odd batch-size texts for ``--batch-size``/``--batch-schedule``/``$DYNAMIX_BATCH_SIZE``
(:mod:`dynamix_byteps.assignment`): every one is refused with a message naming it, before any
worker trains on it."""

from __future__ import annotations

import re

import pytest

from dynamix_byteps.assignment import env_batch_sizes, parse_batch_schedule, parse_batch_sizes
from dynamix_byteps.errors import ConfigurationError


@pytest.mark.parametrize("text, why", [
    ("0", "batch sizes '0': 0 is no batch size; each must be at least 1 sample"),
    ("-1", "batch sizes '-1': -1 is no batch size; each must be at least 1 sample"),
    ("8,0,8,8", "batch sizes '8,0,8,8': 0 is no batch size; each must be at least 1 sample"),
    ("3,", "batch sizes '3,' are not comma-separated integers: '' is not written in the digits 0-9; write each "
           "size as plain digits, e.g. 32,96"),
    ("a", "batch sizes 'a' are not comma-separated integers: 'a' is not written in the digits 0-9; write each size "
          "as plain digits, e.g. 32,96"),
    ("", "batch sizes '' are not comma-separated integers: '' is not written in the digits 0-9; write each size as "
         "plain digits, e.g. 32,96"),
    ("1,2", "batch sizes '1,2' give 2 values for 4 workers; give 1 or 4, one per worker"),
    ("8,2147483648", "batch sizes '8,2147483648': 2147483648 is above the largest batch size, 2147483647 samples"),
])
def test_odd_batch_sizes_are_refused_naming_the_text(text, why):
    with pytest.raises(ConfigurationError) as error:
        parse_batch_sizes(text, 4)
    assert str(error.value) == why


# int() reads these too, but the text goes to every worker as it is, where other readers may not.
@pytest.mark.parametrize("text, field", [
    ("+5", "'+5'"), ("8,1_6", "'1_6'"), ("\uff13\uff12", "'\uff13\uff12'"), ("8,\u0663\u0662", "'\u0663\u0662'"),
    ("8,\t8", "'\\t8'"),
])
def test_sizes_are_written_in_ascii_digits_only(text, field):
    with pytest.raises(ConfigurationError, match=re.escape(f"are not comma-separated integers: {field} is not written "
                                                            "in the digits 0-9")):
        parse_batch_sizes(text, 2)


def test_spaces_around_a_size_stay_accepted():
    assert parse_batch_sizes(" 32, 96 ", 2) == (32, 96)
    assert parse_batch_schedule("0: 8, 16 ; 12 :4", 2) == [(0, (8, 16)), (12, (4, 4))]


def test_a_long_text_is_shortened_in_the_message():
    text = ",".join(["8"] * 20_000)
    with pytest.raises(ConfigurationError) as error:
        parse_batch_sizes(text, 2)
    assert str(error.value) == f"batch sizes {text[:60]!r}... (39999 characters) give 20000 values for 2 workers; " \
                               "give 1 or 2, one per worker"
    schedule = f"x:{text}"
    with pytest.raises(ConfigurationError, match=re.escape(f"schedule entry {schedule[:60]!r}... (40001 characters) is")):
        parse_batch_schedule(schedule, 2)
    with pytest.raises(ConfigurationError, match=r"no batch size; each must be 1 to 2147483647 samples$"):
        parse_batch_sizes("9" * 5000, 2)  # more digits than int() reads


@pytest.mark.parametrize("text, why", [
    ("5:0", "batch sizes '0': 0 is no batch size"),
    ("-1:8", "schedule entry '-1:8' is not STEP:SIZES"),
    ("0:8;00:16", "names a step twice"),
    ("\u0663:8", "schedule entry '\u0663:8' is not STEP:SIZES"),  # str.isdigit() is true of other digits
    ("\u00b2:8", "schedule entry '\u00b2:8' is not STEP:SIZES"),  # and of '\u00b2', which int() refuses
])
def test_odd_schedules_are_refused(text, why):
    with pytest.raises(ConfigurationError, match=why):
        parse_batch_schedule(text, 4)


@pytest.mark.parametrize("garbage", ["0", "-3", "x", "64,", "1,2,3"])
def test_a_garbage_dynamix_batch_size_names_the_variable(monkeypatch, garbage):
    monkeypatch.setenv("DYNAMIX_BATCH_SIZE", garbage)
    with pytest.raises(ConfigurationError, match=f"^DYNAMIX_BATCH_SIZE: batch sizes '{garbage}'"):
        env_batch_sizes("DYNAMIX_BATCH_SIZE", 4)
