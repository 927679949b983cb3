"""The launchers' environment contracts (BytePS's DMLC_*/BYTEPS_*, torchrun's RANK/WORLD_SIZE/..., MPI
launchers' OMPI_COMM_WORLD_*/PMI_*, srun's SLURM_*), engine selection, and the framework-neutral API."""

import re

import pytest
import torch
import torch.distributed as dist

import dynamix_byteps as bps
from dynamix_byteps import engine
from dynamix_byteps.argtypes import dial_host
from dynamix_byteps.env import WorkerEnv, resolve_engine
from dynamix_byteps.errors import ConfigurationError, EngineUnavailableError, NotInitializedError
from dynamix_byteps.torch.ops import check_tensor

ROOT = {"DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "1234"}
TORCHRUN = {"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}


def test_no_variables_is_a_single_worker():
    env = WorkerEnv.from_environ({})
    assert (env.rank, env.size, env.engine) == (0, 1, "gloo")


def test_global_rank_follows_byteps():
    env = WorkerEnv.from_environ({
        "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "4",
        "BYTEPS_LOCAL_RANK": "3", **ROOT,
    })
    assert (env.rank, env.size, env.local_rank, env.local_size) == (7, 8, 3, 4)
    assert (env.root_addr, env.root_port, env.contract) == ("10.0.0.1", 1234, "byteps")


@pytest.mark.parametrize("variables, named", [
    ({"DMLC_NUM_WORKER": "x"}, "DMLC_NUM_WORKER"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "2", **ROOT}, "DMLC_WORKER_ID=2 must be < DMLC_NUM_WORKER=2"),
    ({"DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_SIZE": "2", "BYTEPS_LOCAL_RANK": "2", **ROOT},
     "BYTEPS_LOCAL_RANK=2 must be < BYTEPS_LOCAL_SIZE=2"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "0", **ROOT, "DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "0", **ROOT, "DMLC_PS_ROOT_PORT": "0"}, "DMLC_PS_ROOT_PORT"),
    ({**TORCHRUN, "RANK": "6"}, "RANK=6 must be < WORLD_SIZE=6"),
    ({**TORCHRUN, "LOCAL_RANK": "3"}, "LOCAL_RANK=3 must be < LOCAL_WORLD_SIZE=3"),
    ({**TORCHRUN, "RANK": "0"}, "RANK=0 - LOCAL_RANK=1"),  # rank 0 cannot be local rank 1
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0", "RANK": "4"}, "this node's ranks must lie inside"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({**TORCHRUN, "WORLD_SIZE": "4097"}, "WORLD_SIZE=4097 must be <= 4096"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    # int() reads these; atoi in another process of the job reads 1, 1 and 0 (or nothing)
    ({**TORCHRUN, "RANK": "+1"}, r"RANK='\+1' is not an integer written in the digits 0-9"),
    ({**TORCHRUN, "WORLD_SIZE": "1_6"}, "WORLD_SIZE='1_6' is not an integer"),
    ({**TORCHRUN, "MASTER_PORT": "\u0662\u0669\u0665\u0660\u0660"}, "MASTER_PORT='٢٩٥٠٠' is not an integer"),
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


@pytest.mark.parametrize("value, why", [
    ("[::1]:99999", "port 99999 is outside 1..65535"),  # the workers waited for it to come back, forever
    ("h0:0", "port 0 is outside 1..65535"),
    (":5", "no host before the port"),
    ("h0:", "no :PORT at its end"),
    ("h0:5x", "no :PORT at its end"),
    ("::1:50051", "an IPv6 address goes in brackets"),
    ("[h0]:50051", "[h0] is not an IPv6 address in brackets"),
    ("h 0:50051", "'h 0' is not a host name"),
    ("x:h0:50051", "'x:h0' is not a host name"),
    ("h0/x:50051", "'h0/x' is not a host name"),  # were kept: the rendezvous hosts refused / @ ? # already
    ("user@h0:50051", "'user@h0' is not a host name"),
    # gRPC targets: the scheduler listens on TCP, at one address
    ("unix:/tmp/scheduler.sock", "a unix: target; the scheduler listens on TCP only"),
    ("dns:///h0", "no :PORT at its end"),
    ("dns:///h0:99999", "port 99999 is outside 1..65535"),
    ("dns://8.8.8.8/h0:50051", "the DNS server '8.8.8.8': no :PORT at its end"),  # gRPC: "Cannot parse authority"
    ("ipv4:h0:50051", "'h0' is not an IPv4 address"),
    ("ipv6:::1:50051", "an IPv6 address goes in brackets"),
    ("ipv6:10.0.0.1:50051", "'10.0.0.1' is not an IPv6 address in brackets"),
    ("ipv4:10.0.0.1:1,10.0.0.2:1", "ipv4: lists several addresses; give the scheduler's one"),
])
def test_a_scheduler_address_that_cannot_be_dialled_is_refused_with_the_valid_form(value, why):
    with pytest.raises(ConfigurationError) as caught:
        WorkerEnv.from_environ({"DYNAMIX_SCHEDULER": value})
    assert str(caught.value) == (f"DYNAMIX_SCHEDULER: {value!r} is not HOST:PORT with a port in 1..65535, "
                                 "e.g. 10.0.0.1:50051 or [::1]:50051, or a gRPC target dns:///HOST:PORT, "
                                 f"ipv4:IP:PORT or ipv6:[IP]:PORT ({why})")


@pytest.mark.parametrize("value", ["127.0.0.1:50051", "h0.example:1", "[::1]:65535", "[fe80::1%eth0]:50051",
                                   # gRPC targets, passed to the channel as they are (they were refused)
                                   "dns:///h0.example:50051", "dns:h0:1", "DNS:///h0:1", "dns://10.0.0.53:53/h0:1",
                                   "ipv4:10.0.0.1:50051", "ipv6:[::1]:50051"])
def test_scheduler_addresses_a_client_can_dial_are_kept(value):
    assert WorkerEnv.from_environ({"DYNAMIX_SCHEDULER": value}).scheduler == value


@pytest.mark.parametrize("address, host", [("h0:50051", "h0"), ("[::1]:50051", "::1"), ("dns:///h0:50051", "h0"),
                                           ("dns://10.0.0.53:53/h0:1", "h0"), ("ipv4:10.0.0.1:5", "10.0.0.1"),
                                           ("ipv6:[::1]:5", "::1")])
def test_the_host_a_tls_certificate_must_name_is_the_dialled_one(address, host):
    assert dial_host(address) == host


def test_queries_before_init_raise():
    assert not bps.is_initialized()
    with pytest.raises(NotInitializedError, match="bps.init"):
        bps.rank()


def test_single_process_init_and_shutdown(no_job_variables):
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


@pytest.mark.parametrize("variables", [
    {"DYNAMIX_BATCH_SIZE": "48"},
    {"DYNAMIX_BATCH_SIZE": "48", "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", **ROOT},
    {"DYNAMIX_BATCH_SIZE": "32,96", "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", **ROOT},
    {"DYNAMIX_BATCH_SIZE": "8,8,8,8,16,16", **TORCHRUN},
])
def test_the_starting_batch_size_may_be_one_for_all_or_one_per_worker(variables):
    assert WorkerEnv.from_environ(variables).engine == "gloo"


@pytest.mark.parametrize("variables, message", [
    ({"DYNAMIX_BATCH_SIZE": "32,96"}, "batch sizes '32,96' give 2 values for 1 worker; give 1"),
    ({"DYNAMIX_BATCH_SIZE": "32,64,96", **TORCHRUN}, "batch sizes '32,64,96' give 3 values for 6 workers; give 1 or 6, one per worker"),
    ({"DYNAMIX_BATCH_SIZE": "0"}, "batch sizes '0': 0 is no batch size"),
    ({"DYNAMIX_BATCH_SIZE": "32;96"}, "batch sizes '32;96' are not comma-separated integers"),
])
def test_a_starting_batch_size_that_does_not_fit_the_job_is_refused_naming_the_variable(variables, message):
    with pytest.raises(ConfigurationError, match=re.escape(f"DYNAMIX_BATCH_SIZE: {message}")):
        WorkerEnv.from_environ(variables)


@pytest.mark.parametrize("variables, missing", [
    ({"DMLC_NUM_WORKER": "2"}, "DMLC_WORKER_ID, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT are not set"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "DMLC_PS_ROOT_URI": "h"}, "DMLC_PS_ROOT_PORT is not set"),
    ({"DMLC_WORKER_ID": "0", **ROOT}, "DMLC_NUM_WORKER is not set"),
    ({"DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_SIZE": "2", **ROOT}, "BYTEPS_LOCAL_RANK is not set"),
    ({"DMLC_NUM_WORKER": "1", "BYTEPS_LOCAL_RANK": "0"}, "BYTEPS_LOCAL_SIZE is not set"),
    ({"WORLD_SIZE": "3"}, "RANK, MASTER_ADDR, MASTER_PORT are not set"),
    ({"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
    ({"WORLD_SIZE": "3", "RANK": "0", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    ({"RANK": "0"}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE is not set"),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, "LOCAL_RANK is not set"),
])
def test_a_partial_contract_names_exactly_what_is_missing(variables, missing):
    """Never a silent single worker: the message lists every missing variable, and only those."""
    with pytest.raises(ConfigurationError, match=f"^environment variables? {missing}, but this process has"):
        WorkerEnv.from_environ(variables)


def test_a_job_of_one_needs_no_rendezvous():
    for variables in ({"WORLD_SIZE": "1"}, {"DMLC_NUM_WORKER": "1"}, {"WORLD_SIZE": "1", "RANK": "0"}):
        env = WorkerEnv.from_environ(variables)
        assert (env.rank, env.size, env.root_port) == (0, 1, None)


def test_torchrun_contract_gives_rank_size_and_root():
    env = WorkerEnv.from_environ(TORCHRUN)
    assert (env.rank, env.size, env.local_rank, env.local_size) == (4, 6, 1, 3)
    assert (env.num_nodes, env.node_rank, env.rank_offset) == (2, 1, 3)
    assert (env.root_addr, env.root_port, env.contract, env.engine) == ("10.0.0.2", 29500, "torchrun", "gloo")
    assert env.root_variables == "MASTER_ADDR/MASTER_PORT"


def test_torchrun_without_local_variables_is_one_worker_per_node():
    """A Kubeflow PyTorchJob without torchrun sets RANK/WORLD_SIZE/MASTER_* only: one process per pod."""
    env = WorkerEnv.from_environ({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (env.rank, env.size, env.local_rank, env.local_size, env.num_nodes, env.node_rank) == (2, 3, 0, 1, 3, 2)


OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
MPICH = {"PMI_RANK": "4", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
# What horovodrun's Gloo mode sets (horovod/runner/gloo_run.py); horovod itself cannot be built here, so no job runs.
HOROVODRUN = {"HOROVOD_RANK": "4", "HOROVOD_SIZE": "6", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "3",
              "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_CONTROLLER": "gloo",
              "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000"}


@pytest.mark.parametrize("variables, contract", [(OPEN_MPI, "openmpi"), (MPICH, "mpich"), (HOROVODRUN, "horovodrun")])
def test_an_mpi_launchers_ranks_with_the_rendezvous_the_job_gives(variables, contract):
    """mpirun/mpiexec (Horovod's launchers) name the ranks; MASTER_ADDR/MASTER_PORT name the rendezvous."""
    env = WorkerEnv.from_environ({**variables, "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"})
    assert (env.rank, env.size, env.local_rank, env.local_size) == (4, 6, 1, 3)
    assert (env.root_addr, env.root_port, env.contract, env.root_variables) == (
        "10.0.0.2", 29500, contract, "MASTER_ADDR/MASTER_PORT")


@pytest.mark.parametrize("variables", [OPEN_MPI, MPICH, HOROVODRUN])
def test_an_mpi_job_says_which_rendezvous_variables_it_lacks_and_how_to_pass_them(variables):
    with pytest.raises(ConfigurationError, match=r"RANK=4 of \w+=6, started by \w+.*sets no rendezvous: give every "
                                                 r"rank MASTER_ADDR and MASTER_PORT \(the host of rank 0 and"):
        WorkerEnv.from_environ(variables)
    with pytest.raises(ConfigurationError, match="give every rank MASTER_ADDR .*e.g. .*(mpi|horovodrun)"):
        WorkerEnv.from_environ({**variables, "MASTER_PORT": "29500"})


def test_an_mpi_job_on_one_host_needs_only_a_port_and_one_rank_needs_nothing():
    one_host = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
    with pytest.raises(ConfigurationError, match="give every rank MASTER_PORT \\(a free TCP port there\\), e.g. mpirun -x"):
        WorkerEnv.from_environ(one_host)
    env = WorkerEnv.from_environ({**one_host, "MASTER_PORT": "29500"})
    assert (env.rank, env.size, env.root_addr, env.root_port) == (2, 3, "127.0.0.1", 29500)
    alone = WorkerEnv.from_environ({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert (alone.rank, alone.size, alone.root_port, alone.contract) == (0, 1, None, "mpich")


RENDEZVOUS_HOSTS = [  # (the job's variables, the one that names the rendezvous host, its launcher)
    (TORCHRUN, "MASTER_ADDR", "torchrun"),
    ({**OPEN_MPI, "MASTER_PORT": "29500"}, "MASTER_ADDR", r"mpirun \(Open MPI\)"),
    ({"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", **ROOT}, "DMLC_PS_ROOT_URI", "bpslaunch"),
]


@pytest.mark.parametrize("variables, name, launcher", RENDEZVOUS_HOSTS)
@pytest.mark.parametrize("value, problem", [
    # each rendezvoused at the text as it is: " " and "h 0" waited for DYNAMIX_TIMEOUT, "10.0.0.2:29500" failed with
    # torch's "Port could not be cast to integer value as '29500:29500'"
    (" ", "is blank, but {launcher} reads the host of rank 0 from it: set it to that host's name or IP address"),
    ("\t\n", "is blank"),
    ("10.0.0.2:29500", "has a port in it, but {launcher} reads the host alone from it, and the port from {port}: set "
                       "{name}=10.0.0.2 and {port}=29500"),
    ("[::1]:29500", "has a port in it.*set {name}=::1 and {port}=29500"),
    ("h 0", "is not a host name or an IP address: set it to the host of rank 0, e.g. {name}=10.0.0.1"),
    ("tcp://h0", "is not a host name or an IP address"),
    ("[h0]", "is not a host name or an IP address"),
])
def test_a_rendezvous_host_that_is_no_host_is_refused_naming_the_variable(variables, name, launcher, value, problem):
    port = "MASTER_PORT" if name == "MASTER_ADDR" else "DMLC_PS_ROOT_PORT"
    message = f"environment variable {name}={re.escape(repr(value))} " + problem.format(launcher=launcher, name=name,
                                                                                        port=port)
    with pytest.raises(ConfigurationError, match=message):
        WorkerEnv.from_environ({**variables, name: value})


@pytest.mark.parametrize("variables, name, launcher", RENDEZVOUS_HOSTS)
@pytest.mark.parametrize("value, host", [
    (" 10.0.0.2 ", "10.0.0.2"),  # as the integers: spaces around cut (the padded host waited for DYNAMIX_TIMEOUT)
    ("job-master-0.svc", "job-master-0.svc"),
    ("::1", "::1"),
    ("[::1]", "::1"),
    ("fe80::1%eth0", "fe80::1%eth0"),
])
def test_a_rendezvous_host_is_read_without_spaces_around_it_or_ipv6_brackets(variables, name, launcher, value, host):
    assert WorkerEnv.from_environ({**variables, name: value}).root_addr == host


def test_a_partial_mpi_contract_names_what_is_missing():
    with pytest.raises(ConfigurationError, match="^environment variable OMPI_COMM_WORLD_RANK is not set, but .*"
                                                 "OMPI_COMM_WORLD_SIZE=6.*mpirun \\(Open MPI\\)"):
        WorkerEnv.from_environ({"OMPI_COMM_WORLD_SIZE": "6", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ConfigurationError, match="MPI_LOCALRANKID=3 must be < MPI_LOCALNRANKS=3"):
        WorkerEnv.from_environ({**MPICH, "MPI_LOCALRANKID": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_the_launchers_own_variables_win_over_the_mpi_ranks_they_were_started_with():
    """mpirun may start one torchrun (or bpslaunch) per host: its workers inherit that host's MPI rank."""
    inherited = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PMI_RANK": "1", "PMI_SIZE": "2"}
    env = WorkerEnv.from_environ({**inherited, **TORCHRUN})
    assert (env.rank, env.size, env.contract) == (4, 6, "torchrun")
    byteps = {"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_SIZE": "2", "BYTEPS_LOCAL_RANK": "1", **ROOT}
    env = WorkerEnv.from_environ({**inherited, **byteps})
    assert (env.rank, env.size, env.contract) == (1, 4, "byteps")
    assert WorkerEnv.from_environ({**OPEN_MPI, **{k: "9" for k in MPICH}, "MASTER_ADDR": "h",
                                   "MASTER_PORT": "1"}).contract == "openmpi"


SRUN = {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "6"}


def test_an_srun_task_reads_its_node_s_entry_of_the_tasks_per_node():
    env = WorkerEnv.from_environ({**SRUN, "MASTER_ADDR": "n0", "MASTER_PORT": "29500"})
    assert (env.rank, env.size, env.local_rank, env.local_size, env.contract) == (4, 6, 1, 3, "slurm")
    uneven = {**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4,2(x1)", "SLURM_PROCID": "5", "MASTER_ADDR": "n0",
              "MASTER_PORT": "1"}
    assert WorkerEnv.from_environ(uneven).local_size == 2
    with pytest.raises(ConfigurationError, match=r"give every rank MASTER_ADDR and MASTER_PORT .*scontrol show hostnames"):
        WorkerEnv.from_environ(SRUN)


@pytest.mark.parametrize("per_node, node, message", [
    ("3(x2", "1", "is not Slurm's list of tasks per node"),
    ("3,x", "0", "is not Slurm's list of tasks per node"),
    ("1" * 50, "0", "is not Slurm's list of tasks per node"),
    ("3(x2)", "2", "SLURM_NODEID=2 has no entry in SLURM_STEP_TASKS_PER_NODE='3\\(x2\\)'"),
])
def test_a_malformed_tasks_per_node_is_refused_naming_it(per_node, node, message):
    with pytest.raises(ConfigurationError, match=message):
        WorkerEnv.from_environ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": node,
                                "MASTER_ADDR": "n0", "MASTER_PORT": "1"})


@pytest.mark.parametrize("variables, message", [
    # the entry alone was shown: "SLURM_LOCALID=1 must be < SLURM_STEP_TASKS_PER_NODE=1"
    ({"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"},
     "SLURM_LOCALID=1 must be < 1 (the tasks of node SLURM_NODEID=1 in SLURM_STEP_TASKS_PER_NODE='3,1'); start the "
     "job with srun (Slurm)"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,4", "SLURM_LOCALID": "0"},
     "SLURM_PROCID=4 - SLURM_LOCALID=0 + 4 (the tasks of node SLURM_NODEID=1 in SLURM_STEP_TASKS_PER_NODE='2,4') must "
     "lie in 0..SLURM_STEP_NUM_TASKS=6"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,0"},  # was "SLURM_STEP_TASKS_PER_NODE=0 must be >= 1"
     "the local size 0 (the tasks of node SLURM_NODEID=1 in SLURM_STEP_TASKS_PER_NODE='3,0') must be 1 to 4096"),
])
def test_a_local_size_read_from_the_tasks_per_node_is_shown_as_the_list_and_its_node(variables, message):
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        WorkerEnv.from_environ({**SRUN, **variables, "MASTER_ADDR": "n0", "MASTER_PORT": "1"})


def test_tasks_per_node_that_differ_from_node_to_node_need_the_node_s_index():
    """Read by hand without SLURM_NODEID, node 0's 1 task was every node's: local rank 0 of 1 instead of 3."""
    uneven = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1,3",
              "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
    with pytest.raises(ConfigurationError, match="environment variable SLURM_NODEID is not set, but this process has "
                                                 ".*SLURM_STEP_TASKS_PER_NODE=1,3"):
        WorkerEnv.from_environ(uneven)
    even = {**uneven, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "2"}
    assert WorkerEnv.from_environ(even).local_size == 2


def test_an_srun_task_without_the_step_s_size_names_it_instead_of_running_a_single_worker():
    """Only srun's tasks have SLURM_STEP_TASKS_PER_NODE: without SLURM_STEP_NUM_TASKS, rank 4 trained alone."""
    partial = {key: value for key, value in SRUN.items() if key != "SLURM_STEP_NUM_TASKS"}
    with pytest.raises(ConfigurationError, match="environment variable SLURM_STEP_NUM_TASKS is not set, but this process "
                                                 "has SLURM_PROCID=4, SLURM_STEP_TASKS_PER_NODE=3\\(x2\\), SLURM_LOCALID=1"):
        WorkerEnv.from_environ({**partial, "MASTER_ADDR": "n0", "MASTER_PORT": "1"})


def test_a_batch_script_or_an_allocation_is_one_worker_not_rank_0_of_its_tasks():
    """sbatch's script has SLURM_PROCID=0 of SLURM_NTASKS too: only srun's tasks have SLURM_STEP_*."""
    batch_script = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
                    "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "7"}
    env = WorkerEnv.from_environ(batch_script)
    assert (env.rank, env.size, env.contract) == (0, 1, "byteps")


def test_srun_s_own_pmi_variables_leave_the_local_ranks_to_srun_s():
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE (no MPI_LOCAL*): srun's variables give the local ones."""
    pmi2 = {**SRUN, "PMI_RANK": "4", "PMI_SIZE": "6", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
    env = WorkerEnv.from_environ(pmi2)
    assert (env.rank, env.local_rank, env.local_size, env.contract) == (4, 1, 3, "slurm")
    # mpiexec inside an allocation: its ranks inherit the srun step that started its proxies (one per node).
    hydra = {**MPICH, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
    env = WorkerEnv.from_environ(hydra)
    assert (env.rank, env.size, env.local_rank, env.local_size, env.contract) == (4, 6, 1, 3, "mpich")


def test_both_contracts_must_agree():
    byteps = {"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "3", "BYTEPS_LOCAL_RANK": "1", **ROOT}
    env = WorkerEnv.from_environ({**TORCHRUN, **byteps})
    assert (env.rank, env.size, env.root_addr, env.contract) == (4, 6, "10.0.0.1", "byteps")  # BytePS's root wins
    for disagreeing in ({"DMLC_WORKER_ID": "0"}, {"BYTEPS_LOCAL_RANK": "2", "DMLC_WORKER_ID": "0",
                                                   "BYTEPS_LOCAL_SIZE": "6", "DMLC_NUM_WORKER": "1"}):
        with pytest.raises(ConfigurationError, match="torchrun's RANK=4 of WORLD_SIZE=6.*one launcher"):
            WorkerEnv.from_environ({**TORCHRUN, **byteps, **disagreeing})


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
    with pytest.raises(EngineUnavailableError, match="nccl engine needs a CUDA build.*--engine gloo.*docs/engines.md"):
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
