"""The documentation: the MkDocs site builds with warnings as errors, its API pages are generated
from the docstrings, the README's and the docs' results tables match the JSON they are generated
from, the README stays short and its links resolve, and no docstring points outside the repository."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import readme_results  # noqa: E402

README_MAX_LINES = 250
OUTSIDE = re.compile(r"DESIGN\.md|\bresearch/|\.\./shared")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (make install installs it)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.timeout(360)
def test_site_builds_strictly_with_the_api_reference_generated(tmp_path):
    done = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    api = {page: (tmp_path / "site" / "api" / page / "index.html").read_text() for page in ("torch", "keras", "errors")}
    assert 'id="dynamix_byteps.torch.DistributedOptimizer"' in api["torch"]
    assert 'id="dynamix_byteps.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback"' in api["keras"]
    assert 'id="dynamix_byteps.errors.TensorMismatchError"' in api["errors"]
    assert (tmp_path / "site" / "img" / "time_to_accuracy_straggler.png").stat().st_size > 0


@pytest.mark.timeout(360)
def test_strict_build_fails_on_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: docs\nnav:\n  - Home: index.md\n")
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stdout + done.stderr


def test_generated_results_tables_match_the_json():
    assert readme_results.stale() == [], "run: python scripts/readme_results.py"


def test_a_hand_edited_results_table_is_stale(tmp_path):
    page = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    lines = text.splitlines(keepends=True)
    first_row = next(i for i, line in enumerate(lines) if line.startswith("<!-- results: time_to_accuracy")) + 3
    assert lines[first_row].startswith("| "), lines[first_row]
    lines[first_row] = lines[first_row].replace("| ", "| edited ", 1)  # a cell typed over by hand
    page.write_text("".join(lines))
    assert readme_results.stale([page]) == [page]
    assert readme_results.render(page.read_text()) == text


def test_a_marker_for_an_unknown_benchmark_or_file_is_an_error():
    with pytest.raises(readme_results.RenderError, match="unknown results kind 'nope'"):
        readme_results.render("<!-- results: nope ps_engine.json -->\n<!-- /results -->")
    with pytest.raises(readme_results.RenderError, match="absent.json does not exist"):
        readme_results.render("<!-- results: ps_engine absent.json -->\n<!-- /results -->")
    with pytest.raises(readme_results.RenderError, match="no '<!-- /results -->'"):
        readme_results.render("<!-- results: ps_engine ps_engine.json -->\n| old |\n")


def test_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (REPO / t).exists()]
    assert missing == []
    assert "make demo" in text and "make test" in text
    assert "CUDA path: checked on one GPU only" in text


def test_no_docstring_points_outside_the_repository():
    sources = [p for top in ("dynamix_byteps", "benchmarks", "scripts", "examples", "tests")
               for p in (REPO / top).rglob("*.py") if p != Path(__file__).resolve()]
    found = [f"{p.relative_to(REPO)}:{n}" for p in sources
             for n, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []
