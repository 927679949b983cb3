"""``ruff check`` is clean on every Python file of the repository, with the rules of pyproject.toml."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECKED = ["dynamix_byteps", "tests", "benchmarks", "scripts", "examples", "setup.py"]


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[lint]' (make install installs it)")
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(180)
def test_ruff_check_is_clean():
    done = ruff(*CHECKED)
    assert done.returncode == 0, f"ruff check found problems (ruff check --fix repairs the safe ones):\n{done.stdout}{done.stderr}"


@pytest.mark.timeout(180)
def test_the_project_rules_catch_an_unused_import_unsorted_imports_and_an_invalid_escape(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nprint(os.sep, \"a\\ b\")\n")  # '\\ ' warns at import (W605)
    done = ruff("--config", str(REPO / "pyproject.toml"), "--output-format", "concise", str(bad), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "F401" in done.stdout and "I001" in done.stdout and "W605" in done.stdout
