"""The DYNAMIX agent: a PPO policy over per-worker batch-size ladder steps.

* :mod:`.features`: the observation, one row per worker, from a ``ClusterState`` (numpy);
* :mod:`.mdp`: action ladder, how actions become batch sizes, reward weights (numpy);
* :mod:`.serve`: :class:`PPOPolicy`, the ONNX Runtime policy the scheduler runs (numpy + onnxruntime);
* :mod:`.publish`: policy generations (``manifest.json``) the scheduler hot-swaps (stdlib);
* :mod:`.module`: the shared per-worker network as an RLlib module (torch + Ray);
* :mod:`.train`: RLlib PPO training in the simulator (torch + Ray);
* :mod:`.export`: checkpoint -> ``policy.onnx`` + ``features.json`` (torch + Ray + onnx);
* :mod:`.finetune`: online fine-tuning from the decision log (torch + Ray; ``dynamix policy finetune``).

Only the first four are imported by the scheduler; nothing here imports torch or Ray.
"""

from dynamix_byteps.policy.ppo.serve import PPOPolicy

__all__ = ["PPOPolicy"]
