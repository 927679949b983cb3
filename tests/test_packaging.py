"""Packaging: --version on both commands, ``python -m dynamix_byteps``, and a worker that imports
without the optional extras."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import dynamix_byteps
from dynamix_byteps.cli import main as dynamix_main
from dynamix_byteps.launcher.launch import main as bpslaunch_main

REPO = Path(__file__).resolve().parent.parent
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
        from dynamix_byteps.tensorboard_scalars import ScalarWriter
        try:
            ScalarWriter({str(tmp_path)!r}).open()
        except MissingExtraError as error:
            assert isinstance(error, ImportError)
            print(error)
    """)
    assert done.returncode == 0, done.stderr
    assert "pip install 'dynamix-byteps[scheduler]'" in done.stdout


def test_without_tensorboard_a_log_dir_warns_and_trains_on(tmp_path):
    done = _run_blocked(f"""
        import warnings
        from dynamix_byteps import tensorboard_scalars
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            writer = tensorboard_scalars.open_writer(tensorboard_scalars.worker_logdir({str(tmp_path)!r}, 0))
        print(writer, [str(w.message) for w in caught])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None [")
    assert "pip install 'dynamix-byteps[scheduler]'" in done.stdout and "going on without" in done.stdout


# ---- extras ---------------------------------------------------------------------------------

def _extras() -> dict[str, list[str]]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _resolve(extras: dict[str, list[str]], name: str) -> set[str]:
    """The distributions extra ``name`` installs, its ``dynamix-byteps[...]`` references followed."""
    out = set()
    for requirement in extras[name]:
        own = re.fullmatch(r"dynamix-byteps\[([\w,-]+)\]", requirement)
        if own:
            out |= {d for part in own.group(1).split(",") for d in _resolve(extras, part)}
        else:
            out.add(re.split(r"[\[=<>~! ;]", requirement, maxsplit=1)[0].lower())
    return out


def _base_requirements() -> list[str]:
    """The string requirements of setup.py's ``install_requires`` (what a plain install pulls)."""
    call = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    listed = next(k.value for k in call.keywords if k.arg == "install_requires")
    return [re.split(r"[\[=<>~! ;]", e.value, maxsplit=1)[0].lower() for e in listed.elts if isinstance(e, ast.Constant)]


def test_a_plain_install_pulls_none_of_the_extras_libraries():
    extras = _extras()
    optional = set().union(*(_resolve(extras, name) for name in ("scheduler", "agent", "report", "tensorflow", "rl")))
    assert {"tensorboard", "matplotlib", "prometheus-client", "nvidia-ml-py", "ray", "onnxruntime"} <= optional
    assert "torch" in _base_requirements()
    assert optional.isdisjoint(_base_requirements())


def test_every_extra_the_code_names_exists_and_all_installs_every_part():
    extras = _extras()
    named = {m.group(1) for p in (REPO / "dynamix_byteps").rglob("*.py")
             for m in re.finditer(r"import_extra\([^,]+,\s*\"(\w+)\"", p.read_text())}
    assert named and named <= set(extras)
    assert {"scheduler", "agent", "report", "tensorflow", "rl", "all"} <= set(extras)
    parts = set().union(*(_resolve(extras, name) for name in extras if name not in ("all", "dev", "docs", "lint")))
    assert _resolve(extras, "all") == parts
    assert {"mkdocs", "ruff", "pytest"} <= _resolve(extras, "dev")
