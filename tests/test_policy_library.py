"""The packaged policy library (``--policy ppo:NAME``) and training over several worker counts."""

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dynamix_byteps.cli import main
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import make_policy
from dynamix_byteps.policy.ppo import library
from dynamix_byteps.policy.ppo.features import NUM_FEATURES
from dynamix_byteps.policy.ppo.mdp import KEEP
from dynamix_byteps.policy.sim import Simulator, from_scenario
from dynamix_byteps.policy.sim.env import DynamixSimEnv
from dynamix_byteps.scenarios import scenario

pytest.importorskip("onnxruntime")

REQUIRED = ("small-cnn-sgd", "small-cnn-adam", "resnet8-sgd")


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
