"""``load_module`` and ``export_module`` (behind ``dynamix policy export``): a checkpoint path relative to the
working directory loads (RLlib alone reads ``ck`` as a URI with no scheme and refuses it), the export records
the policy's ladder and writes nothing in the policy folder but its two files."""

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("ray")


def small_module(workers: int = 2, steps: int | None = None, **model_config):
    """An untrained PerWorkerPPOModule (hidden 8) for ``workers`` workers choosing among ``steps``
    actions (default: the coarse ladder's)."""
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from dynamix_byteps.policy.ppo.features import NUM_FEATURES
    from dynamix_byteps.policy.ppo.mdp import LADDER
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    return RLModuleSpec(module_class=PerWorkerPPOModule,
                        observation_space=gym.spaces.Box(-np.inf, np.inf, (workers * NUM_FEATURES,), np.float32),
                        action_space=gym.spaces.MultiDiscrete([steps or len(LADDER)] * workers),
                        model_config={"hidden": 8, **model_config}).build()


@pytest.mark.timeout(120)
def test_a_relative_checkpoint_path_loads(tmp_path, monkeypatch):
    from dynamix_byteps.policy.ppo.export import load_module
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    workers = 2
    saved = small_module(workers)
    saved.save_to_path(str(tmp_path / "ck"))
    monkeypatch.chdir(tmp_path)
    loaded = load_module("ck")
    assert isinstance(loaded, PerWorkerPPOModule) and loaded.num_workers == workers
    for name, value in saved.policy_net.state_dict().items():
        assert np.array_equal(loaded.policy_net.state_dict()[name].numpy(), value.numpy()), name


@pytest.mark.timeout(120)
def test_the_export_records_the_ladder_the_policy_was_trained_with(tmp_path):
    from dynamix_byteps.policy import make_policy
    from dynamix_byteps.policy.base import ClusterState, WorkerState
    from dynamix_byteps.policy.ppo.export import ExportError, export_module
    from dynamix_byteps.policy.ppo.mdp import LADDER, ladder_factors

    def exported(name, config, steps=5):
        return make_policy("ppo", path=export_module(small_module(steps=steps, **config), tmp_path / name))

    fine = exported("fine", {"dynamix": {"ladder": list(ladder_factors("fine"))}})
    assert fine.metadata["actions"]["ladder"] == list(ladder_factors("fine"))
    assert exported("old", {}).metadata["actions"]["ladder"] == list(LADDER)  # trained before ladders had names
    full = exported("full", {"dynamix": {"ladder": list(ladder_factors("full"))}}, steps=7)
    assert full.metadata["actions"]["keep"] == 3
    state = ClusterState(step=10, initial_batch_sizes=(64, 64), workers=tuple(
        WorkerState(rank=r, batch_size=64, compute_s=0.1, push_pull_s=0.02, samples_per_s=640.0) for r in range(2)))
    decision = full.decide(state)
    assert len(decision.terms["logits"][0]) == 7 and set(decision.terms["factors"]) <= set(ladder_factors("full"))
    with pytest.raises(ExportError, match="chooses among 7 actions but records a 5-step ladder"):
        exported("mismatch", {"dynamix": {"ladder": list(LADDER)}}, steps=7)
    assert not (tmp_path / "mismatch" / "features.json").exists()


@pytest.mark.timeout(120)
def test_the_export_builds_its_graph_outside_the_policy_folder(tmp_path, monkeypatch):
    """The ONNX graph was built in OUT/.policy.onnx.<pid>.build and removed in a ``finally``, which a
    SIGTERM to `dynamix policy export` (or to `policy train` while it exports) skips: the process
    ended with the file left in the policy folder for good. What the folder holds the moment the
    graph is built is what such a SIGTERM leaves."""
    import torch

    from dynamix_byteps.policy.ppo.export import export_module

    out = tmp_path / "out"
    build = torch.onnx.export
    while_building = []

    def observed(*args, **kwargs):
        build(*args, **kwargs)
        while_building.extend(p.name for p in out.iterdir())

    monkeypatch.setattr(torch.onnx, "export", observed)
    export_module(small_module(), out)
    assert while_building == []
    assert sorted(p.name for p in out.iterdir()) == ["features.json", "policy.onnx"]
