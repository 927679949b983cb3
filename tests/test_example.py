"""The main job: the README's example, 4 workers through bpslaunch, on real Fashion-MNIST."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_trains_four_workers_to_80_percent(tmp_path):
    metrics_file = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dynamix_byteps.launcher", "--num-workers", "4", "--",
         sys.executable, str(REPO / "examples/torch_fashion_mnist.py"), "--epochs", "1",
         "--output", str(metrics_file)],
        cwd=tmp_path, capture_output=True, text=True, timeout=840,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads(metrics_file.read_text())
    assert metrics["workers"] == 4
    assert metrics["test_samples"] == 10_000
    assert metrics["test_accuracy"] >= 0.80, metrics
    assert "[0] test_accuracy=" in proc.stdout
