"""The suite's per-test time limit ends a test that never returns, Hypothesis tests included."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

TWO_LIMITS = """
import pytest


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.timeout(100))])
@pytest.mark.timeout(5)
def test_two_limits(n):
    pass
"""

ENDLESS = """
from hypothesis import given, settings, strategies as st


@settings(deadline=None, database=None)
@given(st.integers())
def test_endless(x):
    while True:
        pass
"""


def run_pytest(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", *args, "test_case.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(TESTS)}, capture_output=True, text=True, timeout=60,
    )


def test_a_hypothesis_example_that_never_ends_fails_at_the_limit_instead_of_being_shrunk(tmp_path):
    run = run_pytest(tmp_path, ENDLESS, "--timeout", "2")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "TestTimedOut" in run.stdout and "ran past its 2 s limit" in run.stdout


def test_a_case_with_its_own_timeout_and_one_on_the_function_is_refused_at_collection(tmp_path):
    """pytest puts the function's mark before the param's, so the case's longer limit was ignored
    (a 1,500-s case killed at 240 s)."""
    run = run_pytest(tmp_path, TWO_LIMITS)
    assert run.returncode == 4, run.stdout + run.stderr  # usage error
    assert "test_two_limits[1] has 2 timeout marks" in run.stdout + run.stderr
