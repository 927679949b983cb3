"""Output paths a careless user gives the ``dynamix`` subcommands: a directory where a file goes,
a file where a directory goes, a path under a file, a path in /proc. Each exits 2 with one line naming
the flag and the fix, before anything starts, instead of a bare ``OSError`` (or none at all) later.
So do values the command could never work with (a job name the workers refuse, a port out of range)."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import run_bpslaunch

from dynamix_byteps.cli import build_parser, main
from dynamix_byteps.engine.ps_rendezvous import MAX_SERVERS
from dynamix_byteps.launcher.cli import parse_args


@pytest.fixture
def paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "decisions.jsonl").write_text("")
    return tmp_path


DIR_FOR_FILE = "adir is a directory; give the path of a file in it, e.g. adir/"
FILE_FOR_DIR = "afile is a file; give a directory (it is created if missing)"
UNDER_FILE = "afile/x: {}/afile is a file, not a directory; give a path under a directory"
NOT_WRITABLE = "/proc/x: cannot create anything in /proc ("

CASES = [
    (["scheduler", "--port-file", "adir"], "--port-file", DIR_FOR_FILE + "out"),
    (["scheduler", "--run-dir", "afile"], "--run-dir", FILE_FOR_DIR),
    (["scheduler", "--run-dir", "afile/x"], "--run-dir", UNDER_FILE),
    (["agent", "--job", "j", "--scheduler", "127.0.0.1:1", "--ready-file", "afile/x"], "--ready-file", UNDER_FILE),
    (["sim", "fit", "run", "--out", "adir"], "--out", DIR_FOR_FILE + "sim_params.json"),
    (["sim", "fit", "run", "--out", "afile/x"], "--out", UNDER_FILE),
    (["report", "run", "--out", "afile"], "--out", FILE_FOR_DIR),
    (["policy", "train", "--scenario", "homogeneous", "--out", "afile"], "--out", FILE_FOR_DIR),
    (["policy", "export", "adir", "--out", "afile/x"], "--out", UNDER_FILE),
    (["policy", "eval", "adir", "--scenario", "homogeneous", "--json", "adir"], "--json", DIR_FOR_FILE + "out"),
    # nothing can be created in /proc, not even by root: a bare "[Errno 2] ... '/proc/x'" came later
    (["scheduler", "--run-dir", "/proc/x"], "--run-dir", NOT_WRITABLE),
    (["sim", "fit", "run", "--out", "/proc/x/sim.json"], "--out", "/proc/x/sim.json" + NOT_WRITABLE[len("/proc/x"):]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, flag, why", CASES, ids=[" ".join(c[0][:2]) + " " + c[1] for c in CASES])
def test_an_output_path_that_cannot_be_written_is_usage_naming_the_flag(paths, capsys, argv, flag, why):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {why.format(paths)}" in err, err
    assert "Traceback" not in err and not (paths / "afile" / "x").exists()


@pytest.fixture
def unwritable(monkeypatch):
    """Folders nothing can be created in, as for a user without write permission there (the tests run
    as root, who may create anywhere but in /proc)."""
    folders = set()
    create = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if Path(dir) in folders:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return create(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return folders


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_an_output_file_is_checked_where_its_symlink_leads(paths, unwritable, capsys):
    # The port file is written where the link leads (atomic_write follows it): a link in a folder
    # the user cannot write was refused, a link into /proc was accepted and failed later.
    (paths / "ro").mkdir()
    (paths / "ro" / "port").symlink_to(paths / "adir" / "port")
    unwritable.add(paths / "ro")
    assert build_parser().parse_args(["scheduler", "--port-file", "ro/port"]).port_file == Path("ro/port")
    assert "argument --port-file: ro/port2: cannot create anything in" in parse_error(
        ["scheduler", "--port-file", "ro/port2"], capsys)
    (paths / "to_proc").symlink_to("/proc/x/port")
    assert ("argument --port-file: to_proc (which leads to /proc/x/port): cannot create anything in /proc ("
            in parse_error(["scheduler", "--port-file", "to_proc"], capsys))


def test_a_run_dir_whose_files_can_be_appended_to_is_taken_though_nothing_can_be_created_in_it(
        paths, unwritable, capsys):
    # a shared run directory prepared by an admin: decisions.jsonl and tensorboard/scheduler writable
    (paths / "run" / "tensorboard" / "scheduler").mkdir(parents=True)
    unwritable.add(paths / "run")
    assert build_parser().parse_args(["scheduler", "--run-dir", "run"]).run_dir == Path("run")
    # bpslaunch's and the workers' name for the same folder (DYNAMIX_LOG_DIR), as the torchrun recipe passes it
    assert build_parser().parse_args(["scheduler", "--log-dir", "run"]).run_dir == Path("run")
    assert "argument --out: run: cannot create anything in" in parse_error(["report", "run", "--out", "run"], capsys)
    (paths / "run" / "tensorboard" / "scheduler").rmdir()  # the scheduler would have to create it
    assert "argument --run-dir: run: cannot create anything in" in parse_error(["scheduler", "--run-dir", "run"], capsys)


RUN_DIR_ENTRIES = [  # what the folder holds: folders end in /
    (["decisions.jsonl/"], "decisions.jsonl", "a directory, where the command appends to a file"),
    (["tensorboard"], "tensorboard", "a file, where the command writes in a folder"),
    (["tensorboard/", "tensorboard/scheduler"], "tensorboard/scheduler", "a file, where the command writes in a folder"),
]


def _make(root: Path, entries: list[str]) -> None:
    (root / "decisions.jsonl").unlink()  # the fixture's
    for entry in entries:
        (root / entry).mkdir() if entry.endswith("/") else (root / entry).write_text("")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entries, odd, what", RUN_DIR_ENTRIES, ids=[c[1] for c in RUN_DIR_ENTRIES])
def test_a_run_dir_entry_of_the_other_kind_is_usage_naming_it(paths, capsys, entries, odd, what):
    # the scheduler started and then died with a bare "[Errno 21] Is a directory: 'run/decisions.jsonl'"
    # (or "[Errno 20] Not a directory: 'run/tensorboard/scheduler'")
    _make(paths / "run", entries)
    assert f"argument --run-dir: run: {paths / 'run' / odd} is {what}; move it away or give another directory" \
        in parse_error(["scheduler", "--run-dir", "run"], capsys)


def test_a_run_dir_entry_that_cannot_be_written_is_usage_naming_it(paths, monkeypatch, capsys):
    log = paths / "run" / "decisions.jsonl"
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != log and access(path, mode))  # as for a non-root user
    assert f"argument --run-dir: run: {log} is not writable; make it writable or give another directory" in parse_error(
        ["scheduler", "--run-dir", "run"], capsys)


@pytest.mark.timeout(60)
def test_bpslaunch_refuses_a_log_dir_whose_tensorboard_folder_is_a_file_before_starting(paths):
    # the job started (here: exit 0); a worker opening its scalars there raised OSError '[Errno 20] Not a directory'
    (paths / "run" / "tensorboard").write_text("")
    code, output = run_bpslaunch(["-n", "1", "--log-dir", paths / "run", "--", sys.executable, "-c", "print('started')"],
                                 timeout=50)
    assert code == 2, output
    assert f"argument --log-dir: {paths / 'run' / 'tensorboard'} is a file, where the command writes in a folder" in output
    assert "started" not in output


def test_a_check_that_cannot_remove_its_probe_says_so_and_names_it(paths, monkeypatch, capsys):
    def refuse(path):  # e.g. a sync client dropped a file into it
        raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY))

    monkeypatch.setattr(os, "rmdir", refuse)
    err = parse_error(["scheduler", "--port-file", "adir/port"], capsys)
    monkeypatch.undo()
    [probe] = (paths / "adir").glob(".dynamix-probe-*")
    probe.rmdir()
    # it said "cannot create anything in", the opposite of what happened
    assert f"argument --port-file: adir/port: the empty directory {probe} that this check created cannot be removed " \
           "(Directory not empty); remove it and run again" in err, err


@pytest.mark.parametrize("count", ["999999999", "1025", "0", "-1"])
def test_bpslaunch_refuses_a_server_count_beyond_what_a_worker_accepts(capsys, count):
    # 999999999 used to pass the parser and hang the launcher building that many servers
    with pytest.raises(SystemExit) as stop:
        parse_args(["--engine", "ps", "--num-servers", count, "-n", "2", "--", "true"])
    assert stop.value.code == 2
    assert f"argument --num-servers: --num-servers {count} must be between 1 and {MAX_SERVERS}" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content", [b"", bytes(range(256)) * 20], ids=["empty", "damaged"])
def test_report_on_a_run_whose_event_file_is_empty_or_damaged_says_so(paths, capsys, content):
    worker = paths / "run" / "tensorboard" / "worker-0"
    worker.mkdir(parents=True)
    (worker / "events.out.tfevents.1.host").write_bytes(content)
    assert main(["report", "run"]) == 2
    err = capsys.readouterr().err
    assert "run has no readable TensorBoard event in worker-0 (event files missing, empty or damaged)" in err, err


@pytest.mark.parametrize("argv, why", [([], "the following arguments are required: COMMAND"),
                                       (["--bogus"], "unrecognized arguments: --bogus")])
def test_dynamix_without_a_command_or_with_an_unknown_flag_names_what_is_wrong(capsys, argv, why):
    assert main(argv) == 2  # `dynamix --bogus` said "required: COMMAND"
    assert f"dynamix: error: {why}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, why", [
    (["agent", "--job", "../../etc/x", "--scheduler", "127.0.0.1:1"],
     "argument --job: job name '../../etc/x' must be non-empty and use only [A-Za-z0-9_-]"),
    (["agent", "--job", "", "--scheduler", "127.0.0.1:1"], "argument --job: job name '' must be non-empty"),
    (["agent", "--job", "j", "--scheduler", "garbage"],
     "argument --scheduler: 'garbage' is not HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:50051 or [::1]:50051"),
    (["agent", "--job", "j", "--scheduler", "[::1]:99999"], "(port 99999 is outside 1..65535)"),
    (["agent", "--job", "j", "--scheduler", "unix:/tmp/s.sock"], "(a unix: target; the scheduler listens on TCP only)"),
    (["scheduler", "--max-change", "1"], "argument --max-change: 1 must be a finite number > 1"),
])
def test_a_value_the_command_could_never_work_with_is_refused_naming_the_flag(capsys, argv, why):
    # each was accepted: the agent then monitored nothing forever, the scheduler could change no size
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("target", ["dns:///127.0.0.1:50051", "ipv4:127.0.0.1:50051", "ipv6:[::1]:50051"])
def test_the_agent_takes_the_grpc_targets_the_workers_take(target):
    # DYNAMIX_SCHEDULER and --scheduler share one rule; these were refused as "not HOST:PORT"
    assert build_parser().parse_args(["agent", "--job", "j", "--scheduler", target]).scheduler == target


def test_the_max_change_help_says_a_size_always_moves_by_one_sample(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--help"])
    assert "a size may always move by one sample" in " ".join(capsys.readouterr().out.split())


@pytest.mark.timeout(60)
def test_policy_train_refuses_an_unknown_scenario_before_importing_ray(paths, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "dynamix_byteps.policy.ppo.train", None)  # importing it now fails
    assert main(["policy", "train", "--scenario", "homogeneous,nope", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert "error: argument --scenario: unknown scenario 'nope'; choose one of homogeneous," in err, err
