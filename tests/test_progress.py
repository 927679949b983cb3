"""bpslaunch's console progress bar: on a terminal only, fed by rank 0, never inside a worker's line."""

import io
import json
import os
import pty
import sys
import threading
import tty

import pytest
from conftest import OBSERVED_WORKER, run_bpslaunch, wait_until

from dynamix_byteps.launcher.output import Output
from dynamix_byteps.progress import ConsoleProgress


def test_the_bar_follows_the_progress_file_epoch_by_epoch(tmp_path):
    path, stream = tmp_path / "progress.json", io.StringIO()
    with ConsoleProgress(path, stream=stream, poll_s=0.02):
        path.write_text(json.dumps({"step": 812, "epoch": 2, "samples": 27000, "dataset_size": 60000}))
        assert wait_until(lambda: "27.0k/60.0k" in stream.getvalue(), 20), stream.getvalue()
        path.write_text(json.dumps({"step": 900, "epoch": 3, "samples": 600, "dataset_size": 60000}))
        assert wait_until(lambda: "epoch 4" in stream.getvalue(), 20), stream.getvalue()
    text = stream.getvalue()
    assert "epoch 3:  45%" in text  # sampler epoch 2 is the third and "step 812" in text
    assert not path.exists(), "the progress file outlives the job"


def test_without_a_sampler_the_bar_counts_steps(tmp_path):
    path, stream = tmp_path / "progress.json", io.StringIO()
    with ConsoleProgress(path, stream=stream, poll_s=0.02):
        path.write_text(json.dumps({"step": 42, "epoch": None, "samples": None, "dataset_size": None}))
        assert wait_until(lambda: "42step" in stream.getvalue().replace(" ", ""), 20), stream.getvalue()


def test_the_bar_gives_way_to_a_worker_that_draws_its_own(tmp_path):
    # Keras's model.fit(verbose=1) on rank 0 redraws its bar with \r on the line bpslaunch's bar was redrawn on:
    # on a terminal the two overwrote each other at every update.
    calls, sink = [], io.BytesIO()
    output = Output(sink, sink, on_child_bar=lambda: calls.append(1))
    output.write(sink, b"Epoch 1/3\n", b"[0] ", None)
    assert calls == []
    for step in (1, 2):
        output.write(sink, f"{step}/47 - loss: 2.3\r".encode(), b"[0] ", None)
    assert calls == [1]
    path, stream = tmp_path / "progress.json", io.StringIO()
    with ConsoleProgress(path, stream=stream, poll_s=0.02) as bar:
        path.write_text(json.dumps({"step": 5, "epoch": 0, "samples": 320, "dataset_size": 6000}))
        assert wait_until(lambda: "epoch 1" in stream.getvalue(), 20), stream.getvalue()
        bar.give_way()
        drawn = stream.getvalue()
        path.write_text(json.dumps({"step": 40, "epoch": 1, "samples": 2560, "dataset_size": 6000}))
        threading.Event().wait(0.2)
        assert stream.getvalue() == drawn and "epoch 2" not in drawn


@pytest.mark.timeout(200)
def test_on_a_terminal_bpslaunch_draws_the_bar_between_whole_worker_lines(tmp_path):
    master, slave = pty.openpty()
    tty.setraw(slave)  # no \n -> \r\n translation: the bytes are what bpslaunch wrote
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # One worker with its compute stretched 20x: 2 epochs of 64 steps take several seconds.
        code, _ = run_bpslaunch(["-n", 1, "--slowdown", "0=20", "--", sys.executable, OBSERVED_WORKER, tmp_path, 2],
                                timeout=150, stdout=slave, stderr=slave)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert code == 0, text
    assert "epoch 1:" in text and "sample" in text, f"no progress bar drawn:\n{text!r}"
    worker_lines = [line.split("\r")[-1] for line in text.split("\n") if "test_accuracy=" in line]
    assert len(worker_lines) == 2, text
    for line in worker_lines:  # the bar was cleared first, so the line stands alone
        assert line.startswith("[0] epoch "), repr(line)


@pytest.mark.timeout(300)
def test_no_bar_when_stderr_is_not_a_terminal(recorded_run):
    assert "sample/s" not in recorded_run.output and "%|" not in recorded_run.output
