"""The policy network: one MLP shared by every worker, as an RLlib ``TorchRLModule``.

Imports torch and Ray RLlib: training and export only, never the scheduler. Importing it sets
``RLLIB_TEST_NO_TF_IMPORT=1`` (unless set) so RLlib does not load TensorFlow.

:class:`PolicyNet` (plain torch, the part exported to ONNX) maps observations of shape
``(B, N, F)`` to per-worker logits ``(B, N, A)``: each worker's row is embedded by the same MLP,
the embeddings are pooled over workers (mean and max, so the context does not depend on N), and
a head reads ``[own embedding, mean, max]``. No parameter depends on N, so a policy trained with
4 workers runs unchanged with 32 (research/rllib.md §6, the DYNAMIX paper's parameter sharing).

:class:`PerWorkerPPOModule` wraps it for RLlib PPO: RLlib's flat observation ``(B, N·F)`` is
reshaped to ``(B, N, F)``, the logits are flattened to ``(B, N·A)`` for a
``TorchMultiCategorical`` over N categoricals, and a separate value network (own embedding,
pooled) gives the state value. ``set_state`` loads strictly: a checkpoint whose keys or shapes
differ raises instead of silently keeping random weights (RLlib's own ``set_state`` uses
``strict=False``; research/rllib.md §5).
"""

from __future__ import annotations

import logging
import os

# Torch only: RLlib would otherwise import TensorFlow when it is installed (~10 s, ~500 MB).
os.environ.setdefault("RLLIB_TEST_NO_TF_IMPORT", "1")
logging.getLogger("ray.rllib.utils.framework").setLevel(logging.ERROR)

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchMultiCategorical
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule
from ray.rllib.utils.torch_utils import convert_to_torch_tensor
from torch import nn

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.features import NUM_FEATURES
from dynamix_byteps.policy.ppo.mdp import LADDER

__all__ = ["PerWorkerPPOModule", "PolicyNet"]


def _pooled(e: torch.Tensor) -> torch.Tensor:
    """(B, N, H) -> (B, 2H): mean and max over workers."""
    return torch.cat([e.mean(dim=1), e.amax(dim=1)], dim=-1)


class PolicyNet(nn.Module):
    """Observation ``(B, N, F)`` float32 -> logits ``(B, N, A)`` float32 (module docstring)."""

    def __init__(self, num_features: int = NUM_FEATURES, num_actions: int = len(LADDER), hidden: int = 64):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(num_features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.Tanh(), nn.Linear(hidden, num_actions))
        nn.init.orthogonal_(self.head[-1].weight, gain=0.01)  # near-uniform initial policy
        nn.init.zeros_(self.head[-1].bias)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        e = self.embed(obs)
        context = _pooled(e).unsqueeze(1).expand(-1, e.shape[1], -1)
        return self.head(torch.cat([e, context], dim=-1))


class PerWorkerPPOModule(TorchRLModule, ValueFunctionAPI):
    """RLlib module around :class:`PolicyNet` (module docstring).

    ``model_config`` keys: ``hidden`` (default 64); any other key (e.g. ``dynamix`` metadata
    recorded by training) is kept and saved with the checkpoint.

    Raises:
        ConfigurationError: (setup) when the observation or action space does not fit the
            feature count and the ladder of this version.
    """

    def setup(self):
        hidden = int(self.model_config.get("hidden", 64))
        size = int(self.observation_space.shape[0])
        if size % NUM_FEATURES:
            raise ConfigurationError(f"observation size {size} is not a multiple of {NUM_FEATURES} features")
        self.num_workers = size // NUM_FEATURES
        nvec = [int(x) for x in self.action_space.nvec]
        if nvec != [len(LADDER)] * self.num_workers:
            raise ConfigurationError(f"action space {nvec} is not {self.num_workers} × {len(LADDER)} ladder steps")
        self.policy_net = PolicyNet(NUM_FEATURES, len(LADDER), hidden)
        self.value_embed = nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.Tanh())
        self.value_head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.action_dist_cls = TorchMultiCategorical.get_partial_dist_cls(input_lens=nvec)

    def _rows(self, batch) -> torch.Tensor:
        obs = batch[Columns.OBS]
        return obs.reshape(obs.shape[0], -1, NUM_FEATURES)

    def _forward(self, batch, **kwargs):
        logits = self.policy_net(self._rows(batch))
        return {Columns.ACTION_DIST_INPUTS: logits.flatten(1)}

    def compute_values(self, batch, embeddings=None):
        return self.value_head(_pooled(self.value_embed(self._rows(batch)))).squeeze(-1)

    def set_state(self, state) -> None:
        """Load every weight or raise ``ValueError`` naming the missing and unexpected keys."""
        missing, unexpected = self.load_state_dict(convert_to_torch_tensor(state), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"the policy state does not match the network: missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}; it was saved by a different network configuration"
            )
