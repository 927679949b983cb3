"""The DMLC_*/BYTEPS_* environment contract, engine selection, and the framework-neutral API."""

import pytest
import torch
import torch.distributed as dist

import dynamix_byteps as bps
from dynamix_byteps import engine
from dynamix_byteps.env import WorkerEnv, resolve_engine
from dynamix_byteps.errors import ConfigurationError, EngineUnavailableError, NotInitializedError
from dynamix_byteps.torch.ops import check_tensor

ROOT = {"DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "1234"}


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
    ({"DYNAMIX_ENGINE": "mpi"}, "DYNAMIX_ENGINE"),
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


@pytest.mark.parametrize("cuda, nccl, gpus, local_size, expected", [
    (False, False, 0, 1, "gloo"),
    (True, True, 2, 2, "nccl"),
    (True, True, 1, 2, "gloo"),  # a worker would have no GPU of its own
    (True, False, 2, 2, "gloo"),  # a CUDA torch without NCCL
])
def test_auto_engine_is_nccl_only_when_every_local_worker_has_a_gpu(monkeypatch, cuda, nccl, gpus, local_size,
                                                                     expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    assert resolve_engine("auto", local_size) == expected
    assert resolve_engine("gloo", local_size) == "gloo"
    variables = {"DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_SIZE": str(local_size), "BYTEPS_LOCAL_RANK": "0",
                 "DYNAMIX_ENGINE": "auto", **ROOT}
    assert WorkerEnv.from_environ(variables).engine == expected


def test_nccl_without_cuda_is_unavailable_with_the_way_out():
    with pytest.raises(EngineUnavailableError, match="nccl engine needs a CUDA build.*--engine gloo.*README"):
        engine.create(WorkerEnv(engine="nccl"))
    assert not dist.is_initialized()


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device (this torch has no CUDA to make a real one)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.mark.parametrize("tensor, device, message", [
    (torch.zeros(2).as_subclass(_OnCuda), torch.device("cpu"),
     "tensor on cuda:0, but this worker's engine reduces tensors on cpu: start the job with --engine nccl"),
    (torch.zeros(2), torch.device("cuda", 0), r"on cuda:0: move it with .to\('cuda:0'\), or start the job with --engine gloo"),
    (torch.zeros(2, device="meta"), torch.device("cpu"), r"on cpu: move it with .to\('cpu'\)"),
    (torch.zeros(2).to_sparse(), torch.device("cpu"), "needs a dense tensor, got layout torch.sparse_coo"),
    (torch.zeros(2, dtype=torch.bool), torch.device("cpu"), "cannot sum torch.bool tensors"),
    ([1.0], torch.device("cpu"), "expects a torch.Tensor, got list"),
])
def test_push_pull_refuses_tensors_the_engine_cannot_reduce(tensor, device, message):
    with pytest.raises(TypeError, match=message):
        check_tensor(tensor, device)
    check_tensor(torch.zeros(2), torch.device("cpu"))
