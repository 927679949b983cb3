"""The suite's per-test time limit ends a test that never returns, Hypothesis tests included."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

ENDLESS = """
from hypothesis import given, settings, strategies as st


@settings(deadline=None, database=None)
@given(st.integers())
def test_endless(x):
    while True:
        pass
"""


def test_a_hypothesis_example_that_never_ends_fails_at_the_limit_instead_of_being_shrunk(tmp_path):
    (tmp_path / "test_endless.py").write_text(ENDLESS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "--timeout", "2", "-q",
         "test_endless.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(TESTS)}, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "TestTimedOut" in run.stdout and "ran past its 2 s limit" in run.stdout
