"""Packaging: --version on both commands, ``python -m dynamix_byteps``, and a worker that imports
without the optional extras."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import dynamix_byteps
from dynamix_byteps.cli import main as dynamix_main
from dynamix_byteps.launcher.launch import main as bpslaunch_main

OPTIONAL_MODULES = ("tensorboard", "matplotlib", "prometheus_client", "pynvml")

# Makes the optional libraries look uninstalled in a child interpreter.
BLOCK_OPTIONAL = textwrap.dedent(f"""
    import sys

    class BlockOptional:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {OPTIONAL_MODULES!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, BlockOptional())
""")


@pytest.mark.parametrize("main", [dynamix_main, bpslaunch_main], ids=["dynamix", "bpslaunch"])
def test_version_prints_package_version(main, capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dynamix_byteps {dynamix_byteps.__version__}"


def test_python_m_runs_the_dynamix_cli():
    out = subprocess.run([sys.executable, "-m", "dynamix_byteps", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("usage: dynamix ")
    assert "scheduler" in out and "report" in out


def _run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_OPTIONAL + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=180)


def test_torch_frontend_imports_without_the_optional_libraries():
    done = _run_blocked(f"""
        import dynamix_byteps.torch
        print(sorted(m for m in sys.modules if m.partition(".")[0] in {OPTIONAL_MODULES!r}))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_torch_frontend_leaves_the_installed_optional_libraries_unimported():
    # pynvml is left out here: torch.cuda imports it itself when it is installed.
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import dynamix_byteps.torch
        print(sorted(m for m in sys.modules if m.partition(".")[0] in ("tensorboard", "matplotlib", "prometheus_client")))
    """)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_missing_extra_names_the_install_command(tmp_path):
    done = _run_blocked(f"""
        from dynamix_byteps.extras import MissingExtraError
        from dynamix_byteps.summaries import ScalarWriter
        try:
            ScalarWriter({str(tmp_path)!r}).open()
        except MissingExtraError as error:
            assert isinstance(error, ImportError)
            print(error)
    """)
    assert done.returncode == 0, done.stderr
    assert "pip install 'dynamix-byteps[monitoring]'" in done.stdout


def test_without_tensorboard_a_log_dir_warns_and_trains_on(tmp_path):
    done = _run_blocked(f"""
        import warnings
        from dynamix_byteps import summaries
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            writer = summaries.open_writer(summaries.worker_logdir({str(tmp_path)!r}, 0))
        print(writer, [str(w.message) for w in caught])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None [")
    assert "pip install 'dynamix-byteps[monitoring]'" in done.stdout and "going on without" in done.stdout
