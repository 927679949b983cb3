"""scripts/gpu_check.sh, the hardware check of the CUDA path, on a machine without a GPU."""

import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run scripts/gpu_check.sh itself")
def test_gpu_check_fails_quickly_and_clearly_without_cuda():
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                            timeout=55)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("FAIL cuda: no CUDA device"), result.stdout + result.stderr
