"""Integers from the environment are bounded before anything is sized by them: the job's size
variables (BytePS's DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE, torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE, ...)
at MAX_WORKERS, in bpslaunch's environment mode and in a worker, and a message repeats at most 60
characters of a value however long it is."""

import re
import resource
import subprocess
import sys

import pytest
from conftest import clean_env
from multiworker import free_port

from dynamix_byteps.env import MAX_WORKERS, WorkerEnv, optional_int
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.cli import parse_args
from dynamix_byteps.launcher.specs import env_mode, local_mode

NINES = "9" * 4300  # the most digits int() reads
TOO_LONG = "'... (4300 characters) must be <= "  # how a message ends that refuses NINES
ROOT = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "29657"}
ENV_WORKER = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", **ROOT}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the unbounded size grew to GBs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", ["100000000", str(2**63 - 1), NINES])
def test_env_mode_refuses_a_num_worker_above_the_limit_with_a_usage_error(num_workers):
    env = clean_env(unset=("OMP_NUM_THREADS", "NVIDIA_VISIBLE_DEVICES"), **ENV_WORKER, DMLC_NUM_WORKER=num_workers,
                    BYTEPS_LOCAL_SIZE="2")
    result = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", "--", "true"], env=env,
                            capture_output=True, timeout=60, preexec_fn=_limit_memory)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.decode().splitlines()[-1]
    assert last.startswith("bpslaunch: error: environment variable DMLC_NUM_WORKER=") and last.endswith(
        f"must be <= {MAX_WORKERS}; set it to the number of worker nodes"), last
    assert len(last) < 250, last


@pytest.mark.parametrize("env, needle", [
    ({"DMLC_NUM_WORKER": "2", "BYTEPS_LOCAL_SIZE": "4097"}, "BYTEPS_LOCAL_SIZE=4097 must be <= 4096"),
    ({"DMLC_NUM_WORKER": "4097"}, "DMLC_NUM_WORKER=4097 must be <= 4096"),
    ({"DMLC_NUM_WORKER": "3000", "BYTEPS_LOCAL_SIZE": "2"},
     "DMLC_NUM_WORKER=3000 x BYTEPS_LOCAL_SIZE=2 make a job of 6000 workers, more than the 4096 a job may have"),
    ({"DMLC_NUM_WORKER": "2", "NVIDIA_VISIBLE_DEVICES": ",".join(["0"] * 3000)},
     "DMLC_NUM_WORKER=2 x 3000 workers a node (BYTEPS_LOCAL_SIZE is unset: one per GPU in NVIDIA_VISIBLE_DEVICES) "
     "make a job of 6000 workers"),
])
def test_env_mode_bounds_the_nodes_the_local_size_and_their_product(env, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        env_mode(parse_args(["--", "true"]), {**ENV_WORKER, **env}, [])


def test_env_mode_takes_a_job_of_exactly_the_limit():
    specs = env_mode(parse_args(["--", "true"]), {**ENV_WORKER, "DMLC_NUM_WORKER": "2048", "BYTEPS_LOCAL_SIZE": "2"}, [])
    assert [WorkerEnv.from_environ(s.env).size for s in specs] == [MAX_WORKERS] * 2


@pytest.mark.parametrize("role, env, needle", [
    ("server", {"DMLC_NUM_WORKER": "3000", "BYTEPS_LOCAL_SIZE": "2"}, "DMLC_NUM_WORKER=3000 x BYTEPS_LOCAL_SIZE=2"),
    ("server", {"DMLC_NUM_WORKER": NINES}, TOO_LONG + "4096; set it to the number of worker nodes"),
    ("server", {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1025"}, "DMLC_NUM_SERVER=1025 must be <= 1024"),
])
def test_a_ps_server_role_bounds_the_job_it_serves(role, env, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        env_mode(parse_args(["--engine", "ps"]), {"DMLC_ROLE": role, "DMLC_NUM_SERVER": "1", **ROOT, **env}, [])


WORKER = {"DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_RANK": "0", **ROOT}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, named, needle", [
    ({**WORKER, "DMLC_NUM_WORKER": NINES, "BYTEPS_LOCAL_SIZE": "1"}, "DMLC_NUM_WORKER='9999", TOO_LONG + "4096"),
    ({**WORKER, "DMLC_NUM_WORKER": str(2**63 - 1), "BYTEPS_LOCAL_SIZE": "1"}, "DMLC_NUM_WORKER=9223372036854775807",
     "must be <= 4096"),
    ({**WORKER, "DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_SIZE": "5000"}, "BYTEPS_LOCAL_SIZE=5000", "must be <= 4096"),
    ({**WORKER, "DMLC_NUM_WORKER": "3000", "BYTEPS_LOCAL_SIZE": "2"}, "DMLC_NUM_WORKER=3000 x BYTEPS_LOCAL_SIZE=2",
     "make a job of 6000 workers, more than the 4096 a job may have"),
    ({**WORKER, "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": NINES}, "DMLC_WORKER_ID='9999", TOO_LONG + "4095"),
    ({**WORKER, "DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_SIZE": "1", "BYTEPS_LOCAL_RANK": NINES}, "BYTEPS_LOCAL_RANK='9999",
     TOO_LONG + "4095"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": NINES}, "LOCAL_WORLD_SIZE='9999", TOO_LONG + "4096"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "RANK": NINES}, "RANK='9999", TOO_LONG + "4095"),
])
def test_a_worker_refuses_sizes_and_ranks_above_the_limit_naming_the_variable(env, named, needle):
    with pytest.raises(ConfigurationError, match=re.escape(named)) as error:
        WorkerEnv.from_environ(env)
    assert needle in str(error.value) and len(str(error.value)) < 250, error.value


def test_uneven_hosts_may_have_more_nodes_times_local_size_than_workers():
    """--hosts H0:3000,H1:1 gives node 0 DMLC_NUM_WORKER=2 and BYTEPS_LOCAL_SIZE=3000, a job of DYNAMIX_SIZE=3001."""
    env = WorkerEnv.from_environ({**WORKER, "DMLC_NUM_WORKER": "2", "BYTEPS_LOCAL_SIZE": "3000",
                                  "DYNAMIX_RANK_OFFSET": "0", "DYNAMIX_SIZE": "3001"})
    assert (env.rank, env.size) == (0, 3001)


@pytest.mark.timeout(60)
def test_bps_init_refuses_a_4300_digit_num_worker_with_a_configuration_error():
    env = clean_env(**WORKER, DMLC_NUM_WORKER=NINES, BYTEPS_LOCAL_SIZE="1", OMP_NUM_THREADS="1")
    code = ("import dynamix_byteps.torch as bps\nfrom dynamix_byteps.errors import ConfigurationError\n"
            "try:\n    bps.init()\nexcept ConfigurationError as error:\n    print('refused:', error)\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=50, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused: environment variable DMLC_NUM_WORKER='9999"), result.stdout
    assert result.stdout.rstrip().endswith("(4300 characters) must be <= 4096"), result.stdout


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


@pytest.mark.parametrize("variable", ["DYNAMIX_BATCH_SIZE", "DYNAMIX_MIN_BATCH", "DYNAMIX_MAX_BATCH"])
def test_hosts_mode_refuses_an_inherited_per_rank_list_of_the_wrong_count(variable):
    """The elastic restart indexes these lists rank by rank: a wrong count must stop the job at its start."""
    argv = ["--hosts", "127.0.0.1:3,127.0.0.1:1", "--node-rank", "1", "--port", str(free_port()), "--", "true"]
    with pytest.raises(UsageError, match=re.escape(f"environment variable {variable}: batch sizes '8,9' give 2 "
                                                   "values for 4 workers; give 1 or 4, one per worker")):
        local_mode(parse_args(argv), {variable: "8,9"}, [])
    assert local_mode(parse_args(argv), {variable: "8,9,10,11"}, [])  # one per rank is taken
