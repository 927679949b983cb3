"""benchmarks/time_to_accuracy.py: its statistics and verdict rule on synthetic runs, and a --quick
run end to end (slow, in CI)."""

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "time_to_accuracy.py"
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))

import readme_results
from common import LoadSampler, paired_ratio_interval
from time_to_accuracy import (
    STYLES,
    accuracy_area,
    configurations,
    example_command,
    experiment,
    main,
    parse_args,
    ppo_policies,
    read_report,
    straggler_efficiency,
    style,
    summarise,
    tables,
    time_to_target,
)

from dynamix_byteps.policy.ppo.library import policy_dir


def test_time_to_target_interpolates_between_evaluations_and_starts_at_chance():
    curve = [{"train_s": 10.0, "test_accuracy": 0.5}, {"train_s": 20.0, "test_accuracy": 0.7}]
    assert time_to_target(curve, 0.6) == pytest.approx(15.0)
    assert time_to_target(curve, 0.3) == pytest.approx(5.0)  # from (0 s, 0.1)
    assert time_to_target(curve, 0.7) == pytest.approx(20.0)
    assert time_to_target(curve, 0.71) is None
    assert time_to_target([], 0.5) is None


def test_accuracy_area_is_normalised_by_the_budget_holds_the_last_value_and_cuts_at_the_budget():
    curve = [{"train_s": 10.0, "test_accuracy": 0.5}, {"train_s": 20.0, "test_accuracy": 0.7}]
    assert accuracy_area(curve, 30.0) == pytest.approx((3.0 + 6.0 + 7.0) / 30)  # (0.1+0.5)/2*10, ..., 0.7*10
    assert accuracy_area(curve, 15.0) == pytest.approx((3.0 + 2.75) / 15)  # 0.6 at 15 s
    assert accuracy_area([], 10.0) == pytest.approx(0.1)


def test_straggler_efficiency_is_achieved_over_summed_compute_throughput():
    # 1 of 4 workers 3x slower, uniform batch, no communication: 4/(3 + 1/3) / 3... = 0.4
    result = {"samples_per_s": 4 * 100 / 3,
              "worker_statistics": [{"samples_per_s": 100.0}] * 3 + [{"samples_per_s": 100 / 3}]}
    assert straggler_efficiency(result) == pytest.approx(0.4)
    assert math.isnan(straggler_efficiency({"samples_per_s": 1.0, "worker_statistics": []}))


def _run(config, seed, to_90, final=None, loaded=False, to_50=20.0):
    """A run whose accuracy reaches 0.5 at to_90/2 s and 0.9 at to_90 s, then ``final`` (0.92) at
    100 s; with to_90 None, 0.5 at ``to_50`` s and ``final`` (0.85) at 100 s."""
    if to_90 is None:
        final = final or 0.85
        curve = [{"train_s": to_50, "test_accuracy": 0.5}, {"train_s": 100.0, "test_accuracy": final}]
    else:
        final = final or 0.92
        curve = [{"train_s": to_90 / 2, "test_accuracy": 0.5}, {"train_s": to_90, "test_accuracy": 0.9},
                 {"train_s": 100.0, "test_accuracy": final}]
    return {"config": config, "seed": seed, "curve": curve, "test_accuracy": final, "samples_per_s": 1000.0,
            "samples": 64000, "steps": 250, "worker_statistics": [{"samples_per_s": 400.0}] * 4,
            "load": {"loaded": loaded}}


def _runs(times: dict[str, list]) -> list[dict]:
    return [_run(config, 42 + i, t) for config, ts in times.items() for i, t in enumerate(ts)]


def test_verdict_rule_ahead_tie_behind_against_the_best_static_and_the_best_heuristic():
    runs = _runs({"static64": [60, 62, 64, 61, 63], "static128": [70, 72, 74, 71, 73],
                  "proportional": [30, 32, 34, 31, 33],  # median 32: the best heuristic
                  "goodput": [29, 35, 33, 30, 36],  # faster at two seeds, slower at three: tie
                  "ppo": [20, 21, 22, 23, 24]})  # faster at every seed: ahead
    summary = summarise(runs, [0.5, 0.9], 100.0)
    assert summary["verdict"] == {
        "best_static": {"reference": "static64", "target": 0.9, "metric": "time to 90%"},
        "best_heuristic": {"reference": "proportional", "target": 0.9, "metric": "time to 90%"},
        "ppo": None}  # no labelled candidate beside it
    rows = {row["config"]: row for row in summary["rows"]}
    heuristic = {name: row["vs_best_heuristic"]["verdict"] for name, row in rows.items()}
    assert heuristic == {"static64": "behind", "static128": "behind", "proportional": "ref", "goodput": "tie",
                         "ppo": "ahead"}
    static = {name: row["vs_best_static"]["verdict"] for name, row in rows.items()}
    assert static == {"static64": "ref", "static128": "behind", "proportional": "ahead", "goodput": "ahead",
                      "ppo": "ahead"}
    ppo = rows["ppo"]["vs_best_heuristic"]
    assert ppo["ratio"] == pytest.approx(22 / 32) and ppo["ci90"][1] < 1 and ppo["seeds"] == [42, 43, 44, 45, 46]
    cell = rows["ppo"]["time_to_target_s"]["0.9"]
    assert cell["median"] == pytest.approx(22) and cell["ci90"][0] <= 22 <= cell["ci90"][1]
    assert cell["runs"] == pytest.approx([20, 21, 22, 23, 24])
    assert rows["ppo"]["accuracy_at_budget"]["median"] == pytest.approx(0.92)


def test_each_reference_is_judged_at_the_highest_target_its_candidates_reach_and_needs_two_seeds():
    runs = _runs({"static64": [60, None, None], "proportional": [30, 32, 34]})
    runs += [_run("static128", 42 + i, None, to_50=40.0) for i in range(3)]
    summary = summarise(runs, [0.5, 0.9], 100.0)
    # no static batch's median run reaches 0.9; static64 reaches 50% first (30, 20, 20 s; static128 at 40 s)
    assert summary["verdict"]["best_static"] == {"reference": "static64", "target": 0.5, "metric": "time to 50%"}
    assert summary["verdict"]["best_heuristic"]["target"] == 0.9
    rows = {row["config"]: row for row in summary["rows"]}
    assert rows["static64"]["vs_best_heuristic"]["verdict"] == "behind"  # never reaching 90% counts as slower
    assert rows["static128"]["vs_best_heuristic"]["ratio"] == math.inf
    one_seed = _runs({"static64": [60], "proportional": [30, 32]})
    row = summarise(one_seed, [0.5, 0.9], 100.0)["rows"][1]
    assert row["vs_best_static"]["verdict"] == "n/a" and row["vs_best_static"]["ratio"] is None


def test_without_a_common_target_the_verdict_compares_the_area_under_the_curve():
    runs = [_run("static64", 42 + i, None, final=0.80) for i in range(3)] + \
           [_run("goodput", 42 + i, None, final=0.85 + 0.01 * i) for i in range(3)]
    summary = summarise(runs, [0.9], 100.0)
    assert summary["verdict"]["best_static"] == {"reference": "static64", "target": None, "metric": "AUC"}
    goodput = summary["rows"][1]["vs_best_static"]
    assert goodput["ratio"] > 1 and goodput["verdict"] == "ahead"  # higher AUC is better


def test_a_target_never_reached_counts_as_slower_than_any_time():
    inf = math.inf
    assert paired_ratio_interval([inf, inf, inf], [10.0, 11.0, 12.0])[0] == inf  # behind
    assert paired_ratio_interval([10.0, 11.0, 12.0], [inf, inf, inf])[1] == 0.0  # ahead
    assert paired_ratio_interval([inf, inf], [inf, inf]) == [1.0, 1.0]  # neither reaches it: a tie
    with pytest.raises(ValueError, match="equal length"):
        paired_ratio_interval([1.0], [1.0, 2.0])


def test_load_beyond_the_runs_own_share_is_other_work():
    sampler = LoadSampler(share=4.0, tail=4.0)  # the previous run's share still in the average
    sampler.samples = [(t, 4.0 + 1.5) for t in range(0, 60, 2)]
    assert sampler.other_load() == pytest.approx(1.5)
    quiet = LoadSampler(share=4.0)  # after an idle machine the 1-minute average climbs towards 4
    quiet.samples = [(t, quiet.expected(t)) for t in range(0, 60, 2)]
    assert quiet.other_load() == pytest.approx(0.0, abs=1e-9) and quiet.expected(60.0) == pytest.approx(4 * (1 - math.exp(-1)))
    with LoadSampler(share=1.0, every_s=0.01) as live:
        pass
    assert live.samples and live.samples[0][0] >= 0.0


def test_every_configuration_has_one_fixed_style():
    names = configurations({"ppo": "any"}, 10)
    assert set(names) <= set(STYLES)
    assert len(set(STYLES.values())) == len(STYLES)
    labelled = [*STYLES, "ppo-a", "ppo-b"]
    extra = [style(n, labelled) for n in ("ppo-a", "ppo-b")]
    assert extra[0] != extra[1] and not set(extra) & set(STYLES.values())


def test_a_labelled_ppo_policy_runs_beside_the_shipped_one_in_one_table(tmp_path):
    kept = tmp_path / "kept"
    shutil.copytree(policy_dir("small-cnn-sgd-any-start"), kept)
    args = parse_args(["--ppo-policy", "ppo:small-cnn-sgd", "--ppo-policy", f"any-start={kept}",
                       "--configs", "goodput,ppo,ppo-any-start", "--out", str(tmp_path / "t.json")])
    assert list(args.configs) == ["goodput", "ppo", "ppo-any-start"]
    assert args.configs["ppo"]["launch"][:2] == ["--policy", "ppo:small-cnn-sgd"]
    assert args.configs["ppo-any-start"]["launch"][:4] == ["--policy", "ppo", "--policy-path", str(kept)]
    odd = tmp_path / "lr=0.1"  # a directory whose name holds '=': no label
    shutil.copytree(kept, odd)
    assert ppo_policies([str(odd), f"b={odd}"]) == {"ppo": str(odd), "ppo-b": str(odd)}
    runs = _runs({"ppo-any-start": [50, 51], "goodput": [60, 61], "ppo": [55, 56]})
    summary = summarise(runs, [0.9], 150.0)
    rows = {row["config"]: row for row in summary["rows"]}
    assert list(rows) == ["goodput", "ppo", "ppo-any-start"]
    assert summary["verdict"]["ppo"]["reference"] == "ppo"
    assert rows["ppo-any-start"]["vs_ppo"]["verdict"] == "ahead" and rows["ppo"]["vs_ppo"]["verdict"] == "ref"
    header, _ = tables(summary, [0.9])
    assert "vs ppo on time to 90%" in header
    alone = summarise(_runs({"goodput": [60, 61], "ppo": [55, 56]}), [0.9], 150.0)
    assert alone["verdict"]["ppo"] is None and "vs_ppo" not in alone["rows"][1]


@pytest.mark.parametrize("flags, message", [
    (["--ppo-policy", "small-cnn-sgd", "--ppo-policy", "small-cnn-sgd"], "give each policy after the first a label"),
    (["--ppo-policy", "Bad Label=small-cnn-sgd"], "the label 'Bad Label'"),
    (["--ppo-policy", "x=no-such-policy"], "'no-such-policy' is neither a policy directory"),
])
def test_a_wrong_ppo_policy_flag_is_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [("x=", "'' is neither a policy directory"),
                                           ("x={empty}", "features.json is missing"),
                                           ("{empty}", "features.json is missing")])
def test_a_ppo_policy_directory_without_a_policy_is_refused_before_any_run(tmp_path, spec, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ppo-policy", spec.format(empty=tmp_path), "--out", str(tmp_path / "t.json")])
    assert message in capsys.readouterr().err


def test_each_framework_runs_its_own_example_for_the_budget(tmp_path):
    torch_args = parse_args(["--model", "resnet8", "--budget", "90", "--out", str(tmp_path / "t.json")])
    command = example_command(torch_args, 64, 43, tmp_path / "r.json")
    assert command[1].endswith("torch_fashion_mnist.py") and command[command.index("--model") + 1] == "resnet8"
    tf_args = parse_args(["--framework", "tensorflow", "--budget", "90", "--out", str(tmp_path / "t.json")])
    command = example_command(tf_args, 32, 42, tmp_path / "r.json")
    assert command[1].endswith("tf_fashion_mnist.py") and "--fit" in command and "--model" not in command
    for flag, value in (("--batch-size", "32"), ("--seed", "42"), ("--time-budget", "90.0"), ("--eval-every", "4.0"),
                        ("--eval-subset", "2000"), ("--output", str(tmp_path / "r.json"))):
        assert command[command.index(flag) + 1] == value, flag


def test_a_warmup_reaches_every_configurations_example_and_is_part_of_the_experiment(tmp_path, capsys):
    plain = parse_args(["--out", str(tmp_path / "t.json")])
    warm = parse_args(["--warmup-steps", "100", "--out", str(tmp_path / "t.json")])
    assert "--warmup-steps" not in example_command(plain, 64, 42, tmp_path / "r.json")
    command = example_command(warm, 256, 42, tmp_path / "r.json")
    assert command[command.index("--warmup-steps") + 1] == "100"
    assert (experiment(plain)["warmup_steps"], experiment(warm)["warmup_steps"]) == (0, 100)
    with pytest.raises(SystemExit) as stop:
        parse_args(["--framework", "tensorflow", "--warmup-steps", "10"])
    assert stop.value.code == 2 and "no --warmup-steps" in capsys.readouterr().err


def test_a_large_start_warmup_leaves_the_default_batch_without_one(tmp_path, capsys):
    scoped = parse_args(["--policy-start", "256", "--warmup-steps", "100", "--warmup-scope", "large-start",
                         "--ppo-policy", "small-cnn-sgd", "--out", str(tmp_path / "t.json")])
    for name, warmed in (("static64", False), ("static32", False), ("static128", True), ("goodput", True),
                         ("ppo", True)):
        command = example_command(scoped, scoped.configs[name]["batch"], 42, tmp_path / "r.json")
        assert ("--warmup-steps" in command) == warmed, name
    assert experiment(scoped)["warmup_scope"] == "large-start"
    every = parse_args(["--warmup-steps", "100", "--out", str(tmp_path / "t.json")])
    assert "--warmup-steps" in example_command(every, 64, 42, tmp_path / "r.json")
    with pytest.raises(SystemExit) as stop:
        parse_args(["--warmup-scope", "large-start"])
    assert stop.value.code == 2 and "add --warmup-steps" in capsys.readouterr().err


def test_fp16_compression_runs_the_example_with_fp16_pushpull_and_is_part_of_the_experiment(tmp_path, capsys):
    plain = parse_args(["--out", str(tmp_path / "t.json")])
    fp16 = parse_args(["--compression", "fp16", "--out", str(tmp_path / "t.json")])
    assert "--fp16-pushpull" not in example_command(plain, 64, 42, tmp_path / "r.json")
    assert "--fp16-pushpull" in example_command(fp16, 64, 42, tmp_path / "r.json")
    assert (experiment(plain)["compression"], experiment(fp16)["compression"]) == ("none", "fp16")
    with pytest.raises(SystemExit) as stop:
        parse_args(["--framework", "tensorflow", "--compression", "fp16"])
    assert stop.value.code == 2 and "no --fp16-pushpull" in capsys.readouterr().err


def test_the_dynamic_policies_start_from_policy_start_and_it_is_part_of_the_experiment(tmp_path, capsys):
    started = parse_args(["--policy-start", "256", "--ppo-policy", "small-cnn-sgd", "--out", str(tmp_path / "t.json")])
    assert {name: c["batch"] for name, c in started.configs.items() if not name.startswith("static")} == \
        {"proportional": 256, "goodput": 256, "ppo": 256}
    assert started.configs["static64"]["batch"] == 64
    assert experiment(started)["policy_start"] == 256
    assert experiment(parse_args(["--out", str(tmp_path / "t.json")]))["policy_start"] == 64
    with pytest.raises(SystemExit) as stop:
        parse_args(["--policy-start", "8"])
    assert stop.value.code == 2 and "policy start 8 must be between 16 and 512" in capsys.readouterr().err


def test_split_host_cpus_needs_emulated_hosts_and_is_part_of_the_experiment(tmp_path, capsys):
    split = parse_args(["--scenario", "network", "--host-cpus", "split", "--out", str(tmp_path / "t.json")])
    assert experiment(split)["host_cpus"] == "split"
    assert experiment(parse_args(["--out", str(tmp_path / "t.json")]))["host_cpus"] == "shared"
    with pytest.raises(SystemExit) as stop:
        parse_args(["--scenario", "straggler", "--host-cpus", "split"])
    assert stop.value.code == 2 and "has no emulated hosts" in capsys.readouterr().err


def test_the_tensorflow_example_has_no_resnet8(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--framework", "tensorflow", "--model", "resnet8"])
    assert stop.value.code == 2 and "trains the CNN only" in capsys.readouterr().err


def test_an_old_schema_report_is_named_as_such(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"benchmark": "time_to_accuracy", "scenario": "straggler", "rows": []}))
    with pytest.raises(ValueError, match="old schema"):
        read_report(old)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--table-only", "--out", str(old)], capture_output=True,
                          text=True, check=False, timeout=120)
    assert proc.returncode == 2 and "old schema" in proc.stderr and "rerun" in proc.stderr


def test_a_report_from_before_a_later_experiment_key_is_read_with_that_keys_old_value(tmp_path, capsys):
    stored = json.loads((REPO / "benchmarks" / "results" / "time_to_accuracy_straggler.json").read_text())
    stored.pop("warmup_steps", None)  # written before the example had a warm-up
    before = tmp_path / "before.json"
    before.write_text(json.dumps(stored))
    assert main(["--table-only", "--out", str(before)]) == 0
    rewritten = json.loads(before.read_text())
    assert (rewritten["warmup_steps"], rewritten["warmup_scope"]) == (0, "all")
    del stored["engine"]
    before.write_text(json.dumps(stored))
    with pytest.raises(SystemExit) as stop:
        parse_args(["--table-only", "--out", str(before)])
    assert stop.value.code == 2 and f"{before} lacks engine" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_benchmark_fills_every_column_and_the_table_comes_back_from_the_json(tmp_path):
    """A --quick run trimmed to its CI core: one static batch and one policy (the scheduler's
    decision path), two seeds each, round-robin, 10 s of training (4 workers start up in ~30 s more),
    evaluated every 2 s on 500 test images; targets low enough that a loaded machine reaches them."""
    out = tmp_path / "tta.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--scenario", "straggler", "--configs", "static32,proportional",
         "--budget", "10", "--eval-every", "2", "--targets", "0.2,0.3", "--allow-load", "--runs-dir", str(tmp_path / "runs"),
         "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == 2 and report["complete"] and report["quick"] and report["budget_s"] == 10.0
    assert report["framework"] == "torch" and report["model"] == "cnn"
    assert [(r["config"], r["seed"]) for r in report["runs"]] == [
        ("static32", 42), ("proportional", 42), ("static32", 43), ("proportional", 43)]  # round-robin
    for run in report["runs"]:
        assert set(run["times_to_target_s"]) == {"0.2", "0.3"} and run["curve"]
        assert run["load"]["samples"] and run["load"]["share"] == 4
        # one folder per report, so a ring and a ps experiment of one scenario never overwrite each other's logs
        assert Path(run["run_dir"]) == tmp_path / "runs" / "tta" / run["config"] / f"seed{run['seed']}"
    assert [r["config"] for r in report["rows"]] == ["static32", "proportional"]
    for row in report["rows"]:
        for target in ("0.2", "0.3"):
            cell = row["time_to_target_s"][target]
            assert cell["median"] is not None and None not in cell["ci90"], (row["config"], target)
        assert None not in row["accuracy_at_budget"]["ci90"] and 0 < row["auc"]["median"] < 1
        assert row["vs_best_static"]["verdict"] in ("ahead", "tie", "behind", "ref")
        assert row["vs_best_heuristic"]["verdict"] in ("ahead", "tie", "behind", "ref")
        assert 0.0 < row["straggler_efficiency"] <= 1.05
    assert report["rows"][1]["vs_best_static"]["ci90"] is not None  # proportional against static32
    assert out.with_suffix(".png").stat().st_size > 0
    assert "vs best static (static32)" in proc.stdout and "loaded runs" in proc.stdout
    assert "| vs best static (static32) on time to" in readme_results.time_to_accuracy(report)  # the README's table
    again = subprocess.run([sys.executable, str(SCRIPT), "--table-only", "--out", str(out), "--targets", "0.25"],
                           check=False, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "time to 25% s [90%]" in again.stdout and json.loads(out.read_text())["targets"] == [0.25]
    other = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--append", "--budget", "20", "--eval-every", "2",
                            "--configs",
                            "goodput", "--out", str(out)], check=False, capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "budget_s 10.0 there, 20.0 now" in other.stderr


def test_the_ppo_configuration_names_its_policy_by_source_and_hash(tmp_path):
    from dynamix_byteps.policy.ppo import library

    shipped = library.library_root() / "small-cnn-sgd" / "policy.onnx"
    policy = configurations({"ppo": "small-cnn-sgd"}, 10)["ppo"]["policy"]
    assert policy == {"source": "small-cnn-sgd", "sha256": hashlib.sha256(shipped.read_bytes()).hexdigest()}
    (tmp_path / "policy.onnx").write_bytes(b"onnx")
    assert configurations({"ppo": str(tmp_path)}, 10)["ppo"]["policy"]["sha256"] == hashlib.sha256(b"onnx").hexdigest()


def test_a_policy_directory_a_report_ran_is_kept_beside_it_and_serves_from_there(tmp_path):
    import shutil

    from common import keep_policy, policy_identity

    from dynamix_byteps.policy.ppo import library
    from dynamix_byteps.policy.ppo.policy_format import read_metadata

    scratch = tmp_path / "scratch"
    shutil.copytree(library.library_root() / "small-cnn-sgd", scratch)
    identity = policy_identity(str(scratch))
    kept = keep_policy(identity, tmp_path / "results")
    shutil.rmtree(scratch)  # the scratch directory goes; the report's copy stays
    copy = Path(kept["kept"])
    assert copy == tmp_path / "results" / "policies" / identity["sha256"][:12]
    assert {p.name for p in copy.iterdir()} == {"policy.onnx", "features.json", "policy.json"}  # a library entry
    assert read_metadata(copy)[0] == copy and policy_identity(str(copy))["sha256"] == identity["sha256"]
    assert keep_policy({**identity, "source": str(copy)}, tmp_path / "results")["kept"] == str(copy)  # reused
    assert keep_policy(policy_identity("small-cnn-sgd"), tmp_path / "results") == policy_identity("small-cnn-sgd")
    assert keep_policy(None, tmp_path / "results") is None


def test_a_policy_directory_that_cannot_be_served_is_refused_before_any_run(tmp_path, capsys):
    (tmp_path / "policy.onnx").write_bytes(b"onnx")  # no features.json
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exit_:
        main(["--ppo-policy", str(tmp_path), "--configs", "ppo", "--out", str(out)])
    assert exit_.value.code == 2
    assert "features.json is missing" in capsys.readouterr().err and not out.exists()


def test_two_benchmarks_keeping_one_policy_at_once_both_end_with_one_whole_copy(tmp_path, monkeypatch):
    import shutil

    import common
    from common import keep_policy, policy_identity

    from dynamix_byteps.policy.ppo import library

    source = library.library_root() / "small-cnn-sgd"
    identity = policy_identity(str(source))
    kept = tmp_path / "policies" / identity["sha256"][:12]
    copy2 = shutil.copy2

    def the_other_benchmark_finishes_first(src, dst):
        if not kept.exists():
            shutil.copytree(source, kept)
        return copy2(src, dst)

    monkeypatch.setattr(common.shutil, "copy2", the_other_benchmark_finishes_first)
    assert keep_policy({**identity, "source": str(source)}, tmp_path)["kept"] == str(kept)
    assert sorted(p.name for p in (tmp_path / "policies").iterdir()) == [kept.name]  # no staging left
