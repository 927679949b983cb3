"""The DMLC_*/BYTEPS_* environment contract and the framework-neutral API."""

import pytest

import dynamix_byteps as bps
from dynamix_byteps.env import WorkerEnv
from dynamix_byteps.errors import ConfigurationError, NotInitializedError


def test_no_variables_is_a_single_worker():
    env = WorkerEnv.from_environ({})
    assert (env.rank, env.size, env.engine) == (0, 1, "gloo")


def test_global_rank_follows_byteps():
    env = WorkerEnv.from_environ({
        "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "4",
        "BYTEPS_LOCAL_RANK": "3", "DMLC_PS_ROOT_PORT": "1234",
    })
    assert (env.rank, env.size, env.local_rank, env.local_size) == (7, 8, 3, 4)


@pytest.mark.parametrize("variables, named", [
    ({"DMLC_NUM_WORKER": "2"}, "DMLC_PS_ROOT_PORT"),
    ({"DMLC_NUM_WORKER": "x"}, "DMLC_NUM_WORKER"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "2", "DMLC_PS_ROOT_PORT": "1"}, "DMLC_WORKER_ID"),
    ({"BYTEPS_LOCAL_SIZE": "2", "BYTEPS_LOCAL_RANK": "2", "DMLC_PS_ROOT_PORT": "1"}, "BYTEPS_LOCAL_RANK"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT"),
    ({"DYNAMIX_ENGINE": "nccl"}, "DYNAMIX_ENGINE"),
    ({"DYNAMIX_TIMEOUT": "0"}, "DYNAMIX_TIMEOUT"),
    ({"DYNAMIX_TIMEOUT": "nan"}, "DYNAMIX_TIMEOUT"),
    ({"DYNAMIX_TIMEOUT": "1e300"}, "DYNAMIX_TIMEOUT"),
    ({"DYNAMIX_SLOWDOWN": "0.5"}, "DYNAMIX_SLOWDOWN"),
    ({"DYNAMIX_SLOWDOWN": "3@10-5"}, "DYNAMIX_SLOWDOWN"),
    ({"DYNAMIX_SLOWDOWN": "3@-1-5"}, "DYNAMIX_SLOWDOWN"),
    ({"DYNAMIX_SLOWDOWN": "3@5"}, "DYNAMIX_SLOWDOWN"),
    ({"DYNAMIX_SLOWDOWN": "nan"}, "DYNAMIX_SLOWDOWN"),
    ({"DYNAMIX_SCHEDULER": "nohost"}, "DYNAMIX_SCHEDULER"),
])
def test_bad_variables_are_named(variables, named):
    with pytest.raises(ConfigurationError, match=named):
        WorkerEnv.from_environ(variables)


def test_queries_before_init_raise():
    assert not bps.is_initialized()
    with pytest.raises(NotInitializedError, match="bps.init"):
        bps.rank()


def test_single_process_init_and_shutdown(monkeypatch):
    for name in ("DMLC_NUM_WORKER", "BYTEPS_LOCAL_SIZE", "DYNAMIX_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    bps.init()
    try:
        assert (bps.rank(), bps.size(), bps.local_rank(), bps.local_size()) == (0, 1, 0, 1)
    finally:
        bps.shutdown()
    bps.shutdown()
    assert not bps.is_initialized()


def test_slowdown_with_and_without_a_window():
    assert WorkerEnv.from_environ({"DYNAMIX_SLOWDOWN": "2.5"}).slowdown_window == (0.0, float("inf"))
    env = WorkerEnv.from_environ({"DYNAMIX_SLOWDOWN": "3@40-80.5"})
    assert (env.slowdown, env.slowdown_window) == (3.0, (40.0, 80.5))
