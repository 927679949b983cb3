"""``dynamix sim fit`` on damaged or unusual decision logs: a clear answer, never a traceback."""

import json

import pytest
from test_sim_fit import _record

from dynamix_byteps.cli import main
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.sim.fit import fit_run, load_log


def _lines(count=6, n=2, compute=(0.1, 0.2)):
    return [_record(d, [32] * n, list(compute), [320.0] * n) for d in range(1, count + 1)]


def test_the_partial_last_line_of_a_killed_run_is_left_out(tmp_path):
    lines = _lines()
    (tmp_path / "decisions.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])  # killed mid-write
    assert len(load_log(tmp_path).steps) == 5
    (tmp_path / "decisions.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40] + "\n")
    with pytest.raises(ConfigurationError, match="line 6 is not a decision record"):  # a complete bad line is damage
        load_log(tmp_path)


def test_a_rank_without_compute_time_is_named(tmp_path, capsys):
    (tmp_path / "decisions.jsonl").write_text("\n".join(_lines(compute=(0.1, 0.0))) + "\n")
    assert main(["sim", "fit", str(tmp_path)]) == 2
    assert "without a compute time > 0 of rank(s) [1]" in capsys.readouterr().err


@pytest.mark.parametrize("path, value", [
    (("state", "workers", "batch_size", 0), 1e400), (("state", "workers", "loss"), 2.0),
    (("state", "workers", "node"), 3), (("state", "workers", "min_batch"), True), (("step",), 10**30),
    (("state", "workers", "compute_s", 0), 1e308), (("state", "initial_batch_sizes"), [{}]),
])
def test_malformed_values_are_a_usage_error(tmp_path, capsys, path, value):
    records = [json.loads(line) for line in _lines()]
    for record in records:
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    (tmp_path / "decisions.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["sim", "fit", str(tmp_path), "--out", str(tmp_path / "p.json")]) in (0, 2)  # no exception
    assert "Traceback" not in capsys.readouterr().err


def test_out_naming_a_directory_is_a_usage_error_and_leaves_nothing(tmp_path, capsys):
    (tmp_path / "decisions.jsonl").write_text("\n".join(_lines()) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    assert main(["sim", "fit", str(tmp_path), "--out", str(out)]) == 2
    assert "argument --out" in capsys.readouterr().err
    with pytest.raises(IsADirectoryError):
        fit_run(tmp_path).to_json(out)  # the replace fails: the temporary file goes too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decisions.jsonl", "out"]


def test_losses_below_zero_are_left_out_of_the_loss_model(tmp_path):
    records = [json.loads(line) for line in _lines(count=8)]
    for i, record in enumerate(records):
        record["state"]["workers"]["loss"] = [1.0 - 0.3 * i] * 2  # 1.0 ... -1.1
    (tmp_path / "decisions.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert fit_run(tmp_path).stats.min_loss >= 0  # was: "simulator parameter min_loss=-0.55 must be ... >= 0"


def test_a_folder_without_permission_is_a_usage_error(tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "decisions.jsonl").write_text("\n".join(_lines()) + "\n")
    command = [sys.executable, "-m", "dynamix_byteps.cli", "sim", "fit", str(locked / "decisions.jsonl")]
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root's file capabilities")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                   "--inh-caps=-dac_override,-dac_read_search", *command]
    locked.chmod(0)
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    finally:
        locked.chmod(0o755)
    assert done.returncode == 2, done.stderr  # was 1, a bare "[Errno 13]" from Path.is_dir
    assert "argument RUN_DIR: cannot read" in done.stderr and "Traceback" not in done.stderr
