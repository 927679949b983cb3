"""Integers from the environment are bounded before anything is sized by them: the job's size
variables (BytePS's DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE, torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE, ...)
at MAX_WORKERS, in bpslaunch's environment mode and in a worker, and a message repeats at most 60
characters of a value however long it is."""


import pytest

from dynamix_byteps.env import WorkerEnv, optional_int
from dynamix_byteps.errors import ConfigurationError

NINES = "9" * 4300  # the most digits int() reads


@pytest.mark.parametrize("text, maximum, message", [
    (NINES, 65535, "environment variable MASTER_PORT='" + "9" * 60 + "'... (4300 characters) must be <= 65535"),
    (" " * 10 + "9" * 4295, 65535, "environment variable MASTER_PORT='" + "9" * 60 + "'... (4295 characters) must be <= 65535"),
    ("-" + NINES, 65535, "environment variable MASTER_PORT='-" + "9" * 59 + "'... (4301 characters) must be >= 1"),
    ("9" * 5000, None, "environment variable MASTER_PORT='" + "9" * 60 + "'... (5000 characters) is out of range: "
                       "it has over 640 digits"),
    ("70000", 65535, "environment variable MASTER_PORT=70000 must be <= 65535"),
    ("0", 65535, "environment variable MASTER_PORT=0 must be >= 1"),
])
def test_optional_int_says_a_long_value_is_out_of_range_quoting_60_characters_of_it(text, maximum, message):
    with pytest.raises(ConfigurationError) as error:
        optional_int({"MASTER_PORT": text}, "MASTER_PORT", 1, maximum)
    assert str(error.value) == message


def test_optional_int_reads_an_integer_behind_many_zeros_or_spaces():
    assert optional_int({"X": "0" * 5000 + "7"}, "X", 1, 9) == 7
    assert optional_int({"X": " " * 5000 + "7 "}, "X", 1, 9) == 7
    assert optional_int({"X": "-0"}, "X", 0, 9) == 0
    with pytest.raises(ConfigurationError, match="is not an integer written in the digits 0-9"):
        optional_int({"X": " " * 5000 + "+7"}, "X", 1, 9)


def test_a_partial_contract_s_message_repeats_a_long_value_cut():
    with pytest.raises(ConfigurationError, match="DMLC_WORKER_ID, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT are not set") as error:
        WorkerEnv.from_environ({"DMLC_NUM_WORKER": "2" + " " * 5000})
    assert "has DMLC_NUM_WORKER=2, which makes it" in str(error.value)
    assert len(str(error.value)) < 600, len(str(error.value))
