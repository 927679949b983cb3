"""The packaged policy library (``--policy ppo:NAME``) and training over several worker counts."""

import json
import logging
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dynamix_byteps.argtypes import key_value
from dynamix_byteps.cli import main
from dynamix_byteps.cli.scheduler import build_policy
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.policy import make_policy
from dynamix_byteps.policy.ppo import library
from dynamix_byteps.policy.ppo.features import NUM_FEATURES
from dynamix_byteps.policy.ppo.mdp import KEEP
from dynamix_byteps.policy.sim import Simulator, from_scenario
from dynamix_byteps.policy.sim.env import DynamixSimEnv
from dynamix_byteps.scenarios import scenario

pytest.importorskip("onnxruntime")

REQUIRED = ("small-cnn-sgd", "small-cnn-sgd-any-start", "small-cnn-adam", "resnet8-sgd")


def recorded_states(workers, count=40):
    """ClusterStates of a simulated straggler job under its initial allocation."""
    sim = Simulator(from_scenario(scenario("straggler"), workers=workers), rng=np.random.default_rng(workers))
    states = [sim.reset()]
    while len(states) < count and not sim.done:
        sim.step(sim.batch)
        states.append(sim.cluster_state())
    return states


def test_the_library_ships_the_required_policies_as_package_data():
    known = library.entries()
    assert set(REQUIRED) <= set(known), known
    for name in REQUIRED:
        info = known[name]
        assert info["name"] == name and info["model"] in name and info["optimizer"] in name
        assert {"feature_version", "scenarios", "workers", "profile", "training"} <= set(info)
        assert (library.library_root() / name / "sim_params.json").is_file()


@pytest.mark.parametrize("name", REQUIRED)
def test_a_library_policy_loads_and_chooses_valid_actions(name):
    policy = make_policy(f"ppo:{name}")
    assert policy.directory == library.library_root() / name
    for workers in (4, 16):
        for state in recorded_states(workers):
            actions = policy.actions(state)
            steps = len(policy.metadata["actions"]["ladder"])
            assert actions.shape == (workers,) and ((0 <= actions) & (actions < steps)).all()
            sizes = policy.decide(state).batch_sizes
            assert all(max(8, (b + 1) // 2) <= s <= min(1024, 2 * b) for s, b in zip(sizes, state.batch_sizes))


def test_an_unknown_name_lists_the_library():
    with pytest.raises(ConfigurationError, match="no policy 'nope'") as caught:
        make_policy("ppo:nope")
    assert all(name in str(caught.value) for name in REQUIRED)
    with pytest.raises(ConfigurationError, match="only ppo takes :NAME"):
        make_policy("static:small-cnn-sgd")


@pytest.mark.parametrize("option, why", [("seed=1.7", "seed must be a whole number >= 0, got 1.7"),
                                         ("seed=-1", "seed must be >= 0, got -1")])
def test_a_seed_that_is_not_a_whole_number_from_0_is_refused_by_name(option, why):
    # 1.7 was truncated to 1; -1 failed in numpy with "expected non-negative integer"
    with pytest.raises(UsageError, match=f"invalid options for policy 'ppo': {why}"):
        build_policy("ppo:small-cnn-sgd", dict([key_value(option)]), max_change=2.0, hysteresis=0.05)
    assert build_policy("ppo:small-cnn-sgd", dict([key_value("seed=7")]), max_change=2.0, hysteresis=0.05)


def test_an_incompatible_library_entry_is_refused_with_the_library_listed(tmp_path, monkeypatch):
    for name in ("small-cnn-sgd", "broken"):
        shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / name)
    features = tmp_path / "broken" / "features.json"
    meta = json.loads(features.read_text())
    meta["observation"]["feature_version"] += 1
    features.write_text(json.dumps(meta))
    (tmp_path / "gone").mkdir()
    shutil.copy(tmp_path / "small-cnn-sgd" / "policy.json", tmp_path / "gone")  # no policy.onnx
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    with pytest.raises(ConfigurationError, match="feature_version") as caught:
        make_policy("ppo:broken")
    assert "library policies: broken" in str(caught.value) and "small-cnn-sgd" in str(caught.value)
    with pytest.raises(ConfigurationError, match="features.json is missing"):
        make_policy("ppo:gone")
    assert make_policy("ppo:small-cnn-sgd").directory == tmp_path / "small-cnn-sgd"


@pytest.mark.parametrize("replace, message", [("missing", "policy.onnx is missing"),
                                              ("directory", "policy.onnx is not a file")])
def test_a_policy_directory_without_its_onnx_file_says_which_way_it_is_wrong(tmp_path, replace, message):
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "p")
    (tmp_path / "p" / "policy.onnx").unlink()
    if replace == "directory":
        (tmp_path / "p" / "policy.onnx").mkdir()
    with pytest.raises(ConfigurationError, match=message):
        make_policy("ppo", path=tmp_path / "p")


@pytest.mark.parametrize("section, value", [("observation", float("nan")), ("actions", "x"), ("actions", -1),
                                            ("onnx", True), ("onnx", ["policy.onnx"])])
def test_a_features_json_section_that_is_no_object_is_refused_naming_it(tmp_path, section, value):
    """A hand-edited or damaged features.json raised AttributeError ('str' object has no attribute
    'get') from --policy-path and `dynamix policy eval`."""
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "p")
    features = tmp_path / "p" / "features.json"
    features.write_text(json.dumps(json.loads(features.read_text()) | {section: value}))
    with pytest.raises(ConfigurationError, match=f"{features}: its {section!r} section must be a JSON object"):
        make_policy("ppo", path=tmp_path / "p")

def test_a_policy_is_served_with_the_ladder_it_records(tmp_path):
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "p")
    features = tmp_path / "p" / "features.json"
    meta = json.loads(features.read_text())
    gentler = [math.sqrt(f) for f in meta["actions"]["ladder"]]  # as many steps, keep still in the middle
    meta["actions"]["ladder"] = gentler
    features.write_text(json.dumps(meta))
    policy = make_policy("ppo", path=tmp_path / "p")
    state = recorded_states(4)[-1]
    decision = policy.decide(state)
    assert decision.terms["factors"] == [gentler[a] for a in decision.terms["actions"]]
    for before, after, factor in zip(state.batch_sizes, decision.batch_sizes, decision.terms["factors"]):
        assert after == max(round(before * factor), state.workers[0].min_batch or 1)
    meta["actions"]["ladder"] = [0.5, 1.0]
    features.write_text(json.dumps(meta))
    with pytest.raises(ConfigurationError, match="features.json: the policy's action ladder"):
        make_policy("ppo", path=tmp_path / "p")


@pytest.mark.timeout(120)
def test_policy_list_and_bpslaunch_name_the_library():
    listing = subprocess.run([sys.executable, "-m", "dynamix_byteps.cli", "policy", "list"],
                             capture_output=True, text=True, timeout=100, check=True).stdout
    assert all(name in listing for name in REQUIRED) and "usable" in listing
    bad = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--policy", "ppo:nope", "--", "true"],
                         capture_output=True, text=True, timeout=100, check=False)
    assert bad.returncode == 2 and "no policy 'nope'" in bad.stderr and "small-cnn-sgd" in bad.stderr, bad.stderr


@pytest.mark.timeout(300)
def test_policy_eval_takes_a_library_name_and_refuses_an_unknown_one(tmp_path):
    cli = [sys.executable, "-m", "dynamix_byteps.cli", "policy", "eval"]
    result = subprocess.run([*cli, "small-cnn-sgd", "--scenario", "straggler", "--episodes", "1", "--json",
                             str(tmp_path / "eval.json")], capture_output=True, text=True, timeout=250, check=False)
    assert result.returncode == 0, result.stderr
    assert [r["policy"] for r in json.loads((tmp_path / "eval.json").read_text())["rows"]][0] == "ppo"
    for name in ("nope", "ppo:nope"):
        bad = subprocess.run([*cli, name, "--scenario", "straggler"], capture_output=True, text=True, timeout=100,
                             check=False)
        assert bad.returncode == 2 and "no policy 'nope'" in bad.stderr and "small-cnn-sgd" in bad.stderr, bad.stderr
    empty = subprocess.run([*cli, "", "--scenario", "straggler"], capture_output=True, text=True, timeout=100, check=False)
    assert empty.returncode == 2 and "give a policy directory or a library policy's name" in empty.stderr, empty.stderr


# ---- several worker counts -----------------------------------------------------------------------


def test_a_padded_environment_draws_its_worker_counts_and_masks_the_rest():
    env = DynamixSimEnv({"scenarios": ["straggler", "two-speed"], "workers": [4, 8]})
    assert env.padded and env.observation_space.shape == (8 * (NUM_FEATURES + 1),)
    seen = set()
    for seed in range(12):
        obs, info = env.reset(seed=seed)
        n = info["workers"]
        seen.add(n)
        np.testing.assert_array_equal(obs[8 * NUM_FEATURES:], [1.0] * n + [0.0] * (8 - n))
        assert not obs[n * NUM_FEATURES: 8 * NUM_FEATURES].any()
        obs, *_ = env.step(env.action_space.sample())
        assert len(env.sim.batch) == n
    assert seen == {4, 8}
    again = DynamixSimEnv({"scenarios": ["straggler", "two-speed"], "workers": [4, 8]})
    np.testing.assert_array_equal(again.reset(seed=5)[0], env.reset(seed=5)[0])


def test_the_padded_module_ignores_absent_workers_and_pins_them_to_keep():
    pytest.importorskip("ray")
    import gymnasium as gym
    import torch
    from ray.rllib.core.columns import Columns

    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    env = DynamixSimEnv({"scenarios": ["straggler"], "workers": [4, 8]})
    module = PerWorkerPPOModule(observation_space=env.observation_space, action_space=env.action_space,
                                model_config={"hidden": 16, "padded": True})
    obs, info = env.reset(seed=0)
    n = info["workers"]
    padded = torch.as_tensor(obs)[None]
    noisy = padded.clone()
    noisy[0, n * NUM_FEATURES: 8 * NUM_FEATURES] = 3.0  # values in absent rows must not matter
    with torch.no_grad():
        logits = [module.forward_inference({Columns.OBS: x})[Columns.ACTION_DIST_INPUTS].reshape(8, -1) for x in (padded, noisy)]
        values = [module.compute_values({Columns.OBS: x}) for x in (padded, noisy)]
        served = module.policy_net(torch.as_tensor(obs[: n * NUM_FEATURES]).reshape(1, n, NUM_FEATURES))[0]
    torch.testing.assert_close(logits[0], logits[1])
    torch.testing.assert_close(values[0], values[1])
    torch.testing.assert_close(logits[0][:n], served)  # what the exported network computes for n workers
    assert (logits[0][n:].argmax(-1) == KEEP).all() and (logits[0][n:].max(-1).values - logits[0][n:].sort(-1).values[:, -2] > 1e3).all()
    assert isinstance(env.action_space, gym.spaces.MultiDiscrete)


# ---- a damaged library entry -----------------------------------------------------------------
# ``dynamix policy list`` with a damaged ``policy.json`` in (a copy of) the library: listed, no traceback.


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"text"', '{"workers": 8}', '{"scenarios": [1]}',
                                     '{"model": 5}', "{oops"])
def test_a_damaged_policy_json_is_listed_as_unreadable(tmp_path, monkeypatch, capsys, content):
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "damaged")
    (tmp_path / "damaged" / library.INFO_FILE).write_text(content)
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    assert "error" in library.entries()["damaged"]
    assert main(["policy", "list"]) == 0
    assert "1 policies in" in capsys.readouterr().out


def test_the_listing_keeps_its_columns_for_a_name_longer_than_the_header(tmp_path, monkeypatch, capsys):
    for name in ("short", "a-policy-name-of-thirty-chars"):
        shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / name)
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    assert main(["policy", "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    column = header.index("model")
    listed = [row for row in rows if row.split()[0] in ("short", "a-policy-name-of-thirty-chars")]
    assert len(listed) == 2 and all(row.index("small-cnn") == column for row in listed), [header, *rows]


# ---- training on fitted profiles, one scenario held aside -------------------------------------


@pytest.mark.parametrize("entry", ["small-cnn-sgd", "small-cnn-sgd-any-start"])
def test_the_library_policy_names_its_profiles_and_the_held_aside_scenario_it_never_saw(entry):
    """The training record of a policy trained on fitted profiles: the profiles it was trained on
    and the scenario kept aside for evaluation, which is none of them (by name, and by its slowdown
    pattern)."""
    from dynamix_byteps.policy.ppo.mixture import load_profiles

    info = library.entries()[entry]
    training = info["training"]
    held_out = training["held_out"]
    assert held_out, "the training record names no scenario held aside"
    for name in held_out:
        assert "for evaluation only" in scenario(name).description
    trained = {p["scenario"] for p in training["profiles"]}
    assert trained >= {"homogeneous", "straggler", "two-speed", "interference"}
    assert not trained & set(held_out) and not set(info["scenarios"]) & set(held_out)
    profiles, shipped_held_out = load_profiles(library.library_root() / entry / "profiles.json")
    assert shipped_held_out == held_out and {p.scenario for p in profiles} == trained
    for name in held_out:
        pattern = {(s.rank, s.factor, s.start, s.end) for s in scenario(name).slowdowns}
        for p in profiles:
            windows = {(r, w.factor, w.start, w.end) for r, worker in enumerate(p.params.workers) for w in worker.slowdowns}
            assert not pattern <= windows, f"profile {p.name} holds {name}'s slowdowns"


def _fitted(theta=(800.0, 820.0, 300.0, 790.0)):
    from dataclasses import replace

    from dynamix_byteps.policy.sim.params import WorkerParams, reference

    return replace(reference(4), workers=tuple(WorkerParams(fixed_s=0.01 * (r + 1), samples_per_s=t, jitter=0.3 if r == 2 else 0.05)
                                               for r, t in enumerate(theta)))


def test_a_windowed_slowdown_is_put_back_on_the_undisturbed_speed_and_a_whole_run_one_is_kept():
    from dynamix_byteps.policy.ppo.mixture import profile_from_fit

    fitted = _fitted()
    straggler = profile_from_fit(fitted, scenario("straggler"))  # rank 3 3x slower all along: in the fit already
    assert straggler.params.workers == fitted.workers and straggler.scenario == "straggler"
    interference = profile_from_fit(fitted, scenario("interference"))  # rank 1 slowed 3x in [0.33, 0.67)
    w = interference.params.workers
    assert w[0] == fitted.workers[0] and w[2] == fitted.workers[2] and w[3] == fitted.workers[3]
    # the median-throughput rank of the undisturbed 0, 2, 3 (300, 790, 800 samples/s) is rank 3
    assert (w[1].samples_per_s, w[1].fixed_s, w[1].jitter) == (790.0, fitted.workers[3].fixed_s, 0.05)
    assert [(s.factor, s.start, s.end) for s in w[1].slowdowns] == [(3.0, 0.33, 0.67)]
    with pytest.raises(ConfigurationError, match="2 workers"):
        profile_from_fit(_fitted((1.0, 2.0)), scenario("straggler"))


def test_perturbed_profiles_stay_near_the_fit_and_the_mixture_draws_every_profile():
    from dynamix_byteps.policy.ppo.mixture import (
        PERTURBATION,
        START_FACTORS,
        WORKER_SPREAD,
        MixtureSimEnv,
        perturbed,
        profile_from_fit,
    )

    fitted = _fitted()
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = perturbed(fitted, rng)
        ratio = np.array([w.samples_per_s for w in p.workers]) / [w.samples_per_s for w in fitted.workers]
        assert ((1 / (PERTURBATION * WORKER_SPREAD) <= ratio) & (ratio <= PERTURBATION * WORKER_SPREAD)).all()
        assert ratio.max() / ratio.min() <= WORKER_SPREAD ** 2 + 1e-9  # the straggler stays a straggler
        assert 1 / PERTURBATION <= p.comm.bandwidth_bytes_per_s / fitted.comm.bandwidth_bytes_per_s <= PERTURBATION
        assert 1 / PERTURBATION <= p.stats.steps_scale / fitted.stats.steps_scale <= PERTURBATION
        assert p.initial_batch[0] / fitted.initial_batch[0] in START_FACTORS
        m0, fitted_m0 = sum(p.initial_batch), sum(fitted.initial_batch)  # another start, the same job:
        assert p.stats.gap_free_ratio * m0 == pytest.approx(fitted.stats.gap_free_ratio * fitted_m0)
        assert p.stats.loss_noise * math.sqrt(m0) == pytest.approx(fitted.stats.loss_noise * math.sqrt(fitted_m0))
    profiles = [profile_from_fit(fitted, scenario(n)) for n in ("straggler", "interference")]
    env = MixtureSimEnv({"profiles": [p.params.to_dict() for p in profiles], "workers": [4, 8]})
    seen = set()
    for seed in range(16):
        _, info = env.reset(seed=seed)
        seen.add((info["scenario"], info["workers"]))
        assert env.sim.params.workers[2].samples_per_s < 0.6 * env.sim.params.workers[0].samples_per_s  # the fit's straggler
        env.step(env.action_space.sample())
    assert seen == {(s, n) for s in ("straggler", "interference") for n in (4, 8)}


def test_a_profile_fitted_to_a_held_out_scenario_is_refused(tmp_path):
    from dynamix_byteps.policy.ppo.mixture import load_profiles, profile_from_fit, write_profiles

    path = tmp_path / "profiles.json"
    write_profiles(path, [profile_from_fit(_fitted(), scenario("straggler"))], ["straggler"])
    with pytest.raises(ConfigurationError, match=r"\['straggler'\] were fitted to a scenario held out"):
        load_profiles(path)
    result = subprocess.run([sys.executable, "-m", "dynamix_byteps.cli", "policy", "train", "--profiles", str(path),
                             "--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 2 and "held out" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "dynamix_byteps.cli", "policy", "train", "--out", str(tmp_path / "p")],
                            capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 2 and "either --scenario" in result.stderr, result.stderr
    assert not (tmp_path / "p").exists()


@pytest.mark.timeout(900)
def test_training_on_profiles_records_them_and_the_scenario_held_aside(tmp_path):
    pytest.importorskip("ray")
    from dynamix_byteps.policy.ppo.mixture import profile_from_fit
    from dynamix_byteps.policy.ppo.policy_format import read_metadata
    from dynamix_byteps.policy.ppo.train import train

    profiles = [profile_from_fit(_fitted(), scenario(n), source=f"test fit of {n}") for n in ("straggler", "interference")]
    with pytest.raises(ConfigurationError, match="held out"):
        train(tmp_path / "no", [], profiles=profiles, held_out=["interference"], progress=False)
    assert not (tmp_path / "no").exists()
    train(tmp_path / "p", [], iterations=1, train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1,
          workers=[4, 8], progress=False, profiles=profiles, held_out=["swapping-stragglers"])
    record = read_metadata(tmp_path / "p")[1]["training"]
    assert record["profiles"] == [{"name": n, "scenario": n, "source": f"test fit of {n}"} for n in ("straggler", "interference")]
    assert record["held_out"] == ["swapping-stragglers"] and record["scenarios"] == ["interference", "straggler"]


def _job_size_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "dynamix_byteps.policy.ppo" and r.levelno == logging.WARNING and "simulated workers" in r.getMessage()]


def test_the_scheduler_warns_at_start_when_the_job_has_fewer_workers_than_the_policy_was_trained_on(caplog):
    caplog.set_level(logging.WARNING, logger="dynamix_byteps.policy.ppo")
    build_policy("ppo:small-cnn-sgd", {}, max_change=2.0, hysteresis=0.05, num_workers=4)
    assert _job_size_warnings(caplog) == []
    build_policy("ppo:small-cnn-sgd", {}, max_change=2.0, hysteresis=0.05, num_workers=2)
    [warning] = _job_size_warnings(caplog)
    for part in ("policy ppo:small-cnn-sgd", "trained on 4, 8, 16, 32 simulated workers", "this job has 2",
                 "--policy proportional", "dynamix sim fit", "dynamix policy train", "--workers 2"):
        assert part in warning, warning


@pytest.mark.parametrize("workers, warned", [(2, 1), (4, 0), (16, 0)])
def test_a_policy_without_the_jobs_size_in_advance_warns_once_at_its_first_decision(caplog, workers, warned):
    policy = make_policy("ppo:small-cnn-sgd")
    caplog.set_level(logging.WARNING, logger="dynamix_byteps.policy.ppo")
    for state in recorded_states(workers, count=5):
        policy.decide(state)
    assert len(_job_size_warnings(caplog)) == warned, caplog.text


@pytest.mark.parametrize("training", ["x", ["a"], {"workers": [4.0, 8]}, {"workers": "4"}, {"workers": [0, 8]},
                                      {"workers": []}, {"workers": True}, None])
def test_worker_counts_recorded_in_another_shape_are_unreadable_not_a_crash(training):
    # a "training" string crashed the scheduler at start (AttributeError), [4.0, 8] read as "trained on 8"
    from dynamix_byteps.policy.ppo.serve import trained_worker_counts

    assert trained_worker_counts({"training": training}) == ()
    assert trained_worker_counts({"training": {"workers": [8, 4]}}) == (4, 8)
    assert trained_worker_counts({"training": {"workers": 16}}) == (16,)
