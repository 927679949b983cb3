"""Every reader of a run directory's files refuses a FIFO (or a device) in a file's place, naming it,
instead of blocking in ``open`` until a writer comes (for ever without one)."""

import os
import sys
import threading

import pytest
from conftest import run_in_session

from dynamix_byteps.control.cluster import DECISION_LOG
from dynamix_byteps.errors import ConfigurationError

FIFO = "a FIFO (named pipe), not a regular file"


def _worker_events(run_dir):
    from dynamix_byteps.tensorboard_scalars import ScalarWriter

    writer = ScalarWriter(run_dir / "tensorboard" / "worker-0")
    writer.open()
    writer.add({"batch_size": 8.0}, step=10)
    writer.close()


def _raised_at_once(read, fifo) -> BaseException:
    """What ``read()`` raised; fails if it is still blocked after 20 s (a writer then releases it)."""
    raised = []

    def reading():
        try:
            read()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised.append(error)

    thread = threading.Thread(target=reading, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # the blocked open returns, then reads end of file
        thread.join(10)
        pytest.fail(f"reading {fifo} blocked")
    assert raised, f"{fifo} was read without an error"
    return raised[0]


def _load_decisions():
    from dynamix_byteps.report import load_decisions

    return lambda run_dir: load_decisions(run_dir, 0.0)


def _tail_decisions():
    from dynamix_byteps.policy.ppo.finetune import DecisionTail

    return lambda run_dir: DecisionTail(run_dir / DECISION_LOG).read()


def _read_decisions():
    from dynamix_byteps.control.decision_record import read_decisions

    return lambda run_dir: list(read_decisions(run_dir / DECISION_LOG))


def _read_decisions_lenient():
    from dynamix_byteps.control.decision_record import read_decisions_lenient

    return lambda run_dir: read_decisions_lenient(run_dir / DECISION_LOG)


def _scheduler_log():
    from dynamix_byteps.control.scheduler import DecisionLog

    return lambda run_dir: DecisionLog(run_dir / DECISION_LOG)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader, error", [
    (_load_decisions, ConfigurationError), (_tail_decisions, OSError), (_read_decisions, OSError),
    (_read_decisions_lenient, OSError), (_scheduler_log, OSError)])
def test_a_fifo_as_the_decision_log_is_refused_naming_it(tmp_path, reader, error):
    read = reader()  # its imports (seconds for the fine-tuner's) before the clock starts
    fifo = tmp_path / DECISION_LOG
    os.mkfifo(fifo)
    raised = _raised_at_once(lambda: read(tmp_path), fifo)
    assert isinstance(raised, error) and f"{fifo} is {FIFO}" in str(raised), repr(raised)


@pytest.mark.timeout(60)
def test_a_fifo_as_an_event_file_is_refused_naming_it(tmp_path):
    from dynamix_byteps.report import load_run

    _worker_events(tmp_path)
    fifo = tmp_path / "tensorboard" / "worker-1" / "events.out.tfevents.1.host"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    raised = _raised_at_once(lambda: load_run(tmp_path), fifo)
    assert isinstance(raised, ConfigurationError) and f"{fifo} is {FIFO}" in str(raised), repr(raised)


@pytest.mark.timeout(60)
def test_a_fifo_as_a_checkpoint_is_refused_naming_it(tmp_path):
    import dynamix_byteps.torch as bps

    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    raised = _raised_at_once(lambda: bps.load_checkpoint(fifo), fifo)
    assert isinstance(raised, ConfigurationError) and f"{fifo} cannot be opened as a checkpoint ({FIFO})" in str(raised)


@pytest.mark.timeout(60)
def test_dynamix_report_on_a_run_with_a_fifo_for_its_decision_log_is_a_usage_error_naming_it(tmp_path):
    _worker_events(tmp_path)
    os.mkfifo(tmp_path / DECISION_LOG)
    code, output = run_in_session([sys.executable, "-m", "dynamix_byteps.cli", "report", tmp_path,
                                   "--out", tmp_path / "plots"], timeout=45)
    assert code == 2 and f"{tmp_path / DECISION_LOG} is {FIFO}" in output and "Traceback" not in output, output
    assert not (tmp_path / "plots").exists()


def test_the_checks_take_a_regular_file_or_a_symlink_to_one_and_refuse_a_device(tmp_path):
    from dynamix_byteps.regular_files import NotRegularFileError, check_regular, read_regular

    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    check_regular(tmp_path / "link")
    assert read_regular(tmp_path / "link") == b"x"
    for read in (check_regular, read_regular):
        with pytest.raises(NotRegularFileError, match="/dev/null is a character device, not a regular file"):
            read("/dev/null")
        with pytest.raises(NotRegularFileError, match=f"{tmp_path} is a directory, not a regular file"):
            read(tmp_path)
