"""Online fine-tuning of a policy trained on several worker counts (``policy train --workers 4,8``).

Such a checkpoint's module is ``padded`` (its training observations carry a worker mask); a real
job's decisions do not, so the trainer's learner must read them unpadded, or every update fails.
"""

from __future__ import annotations

import pytest
from test_finetune import WORKERS, FakeJob, served_copy

from dynamix_byteps.policy.ppo.publish import generation_dir
from dynamix_byteps.policy.ppo.serve import PPOPolicy

pytest.importorskip("ray.rllib")


@pytest.fixture(scope="module")
def padded_policy_dir(tmp_path_factory):
    """An untrained padded policy (as ``--workers 4,8`` trains): checkpoint/ + policy.onnx + features.json."""
    import gymnasium as gym
    import numpy as np
    import torch
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from dynamix_byteps.policy.ppo.export import (
        MODULE_SUBDIR,
        export_module,
        load_module,
    )
    from dynamix_byteps.policy.ppo.features import CLIP, NUM_FEATURES
    from dynamix_byteps.policy.ppo.mdp import LADDER, RewardWeights
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("finetune-padded") / "policy"
    largest = 2 * WORKERS
    spec = RLModuleSpec(module_class=PerWorkerPPOModule,
                        observation_space=gym.spaces.Box(-CLIP, CLIP, (largest * (NUM_FEATURES + 1),), np.float32),
                        action_space=gym.spaces.MultiDiscrete([len(LADDER)] * largest),
                        model_config={"hidden": 16, "padded": True,
                                      "dynamix": {"reward": RewardWeights().to_dict()}})
    spec.build().save_to_path(str((out / "checkpoint" / MODULE_SUBDIR).resolve()))
    export_module(load_module(out / "checkpoint"), out)
    return out


@pytest.mark.timeout(180)
def test_a_policy_trained_on_several_worker_counts_is_fine_tuned(padded_policy_dir, tmp_path):
    from dynamix_byteps.policy.ppo.finetune import FineTuner

    served = served_copy(padded_policy_dir, tmp_path)
    run = tmp_path / "run"
    job = FakeJob(PPOPolicy(path=served, explore="true", seed=0), run)
    tuner = FineTuner(run, served, checkpoint=padded_policy_dir / "checkpoint", every=8, window=2)
    try:
        job.decisions(9)  # 8 transitions of generation 0
        events = tuner.step()
    finally:
        job.close()
    assert [e["event"] for e in events] == ["publish"], events  # was "failed": observation size not a multiple of F+1
    assert (generation_dir(served, 1) / "policy.onnx").is_file()
