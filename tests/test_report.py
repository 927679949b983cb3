"""`dynamix report RUN_DIR` on a recorded run, and on directories that hold none."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import RECORDED_INTERVAL

from dynamix_byteps.report import PLOTS


def dynamix_report(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamix_byteps.cli", "report", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_report_writes_decodable_pngs_and_the_summary_table(recorded_run, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "plots"
    result = dynamix_report(recorded_run.dir, "--out", out)
    assert result.returncode == 0, result.stderr
    for name in PLOTS:
        image = imread(out / name)  # decodes the PNG
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400, name
        assert image[..., :3].std() > 0.05, f"{name} is blank"
    assert not list(recorded_run.dir.glob("*.png")), "--out was not honoured"
    rows = {int(m[1]): [float(x) for x in m.groups()[1:]]
            for m in re.finditer(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+$", result.stdout, re.M)}
    assert sorted(rows) == [0, 1], result.stdout
    for rank, (batch, theta, step_ms, push_pull_ms) in rows.items():
        sizes = json.loads((recorded_run.out / f"rank{rank}.json").read_text())
        interval_means = np.reshape(sizes, (-1, RECORDED_INTERVAL)).mean(axis=1)
        assert batch == pytest.approx(interval_means[1:].mean(), abs=0.051)  # the first interval is warm-up
        assert theta > 0 and step_ms > push_pull_ms >= 0
    assert re.search(r"job: [\d.]+ s wall time, 96 steps, last training loss \(mean of the workers. last logged steps\) [\d.]+", result.stdout), result.stdout
    assert re.search(r"final accuracy: 0\.\d{4} \(test/accuracy \(worker 0\)\)", result.stdout), result.stdout


def test_an_empty_directory_is_a_usage_error_that_says_how_to_record_a_run(tmp_path):
    result = dynamix_report(tmp_path)
    assert result.returncode == 2
    assert "has no TensorBoard event files" in result.stderr
    assert "tensorboard/worker-<rank>" in result.stderr and "bpslaunch --log-dir" in result.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written on error"


def test_a_missing_directory_and_one_without_worker_scalars_are_usage_errors(tmp_path):
    result = dynamix_report(tmp_path / "nope")
    assert result.returncode == 2 and "is not a directory" in result.stderr
    from dynamix_byteps.summaries import ScalarWriter

    writer = ScalarWriter(tmp_path / "tensorboard" / "worker-0")
    writer.open()  # an event file, but the job ended before its first interval
    writer.close()
    result = dynamix_report(tmp_path)
    assert result.returncode == 2 and "has no TensorBoard scalars of any worker yet" in result.stderr
