"""The policy network: one MLP shared by every worker, as an RLlib ``TorchRLModule``.

Imports torch and Ray RLlib: training and export only, never the scheduler. Importing it sets
``RLLIB_TEST_NO_TF_IMPORT=1`` (unless set) so RLlib does not load TensorFlow.

:class:`PolicyNet` (plain torch, the part exported to ONNX) maps observations of shape
``(B, N, F)`` to per-worker logits ``(B, N, A)``: each worker's row is embedded by the same MLP,
the embeddings are pooled over workers (mean and max, so the context does not depend on N), and
a head reads ``[own embedding, mean, max]``. No parameter depends on N, so a policy trained with
4 workers runs unchanged with 32 (the DYNAMIX paper's parameter sharing).

:class:`PerWorkerPPOModule` wraps it for RLlib PPO: RLlib's flat observation ``(B, N·F)`` is
reshaped to ``(B, N, F)``, the logits are flattened to ``(B, N·A)`` for a
``TorchMultiCategorical`` over N categoricals, and a separate value network (own embedding,
pooled) gives the state value. ``set_state`` loads strictly: a checkpoint whose keys or shapes
differ raises instead of silently keeping random weights (RLlib's own ``set_state`` uses
``strict=False``).
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
from dynamix_byteps.policy.ppo.mdp import LADDER, LADDER_LENGTHS, keep_index

__all__ = ["PerWorkerPPOModule", "PolicyNet"]


def _pooled(e: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, N, H) -> (B, 2H): mean and max over workers (those with ``mask`` (B, N) = 1, if given)."""
    if mask is None:
        return torch.cat([e.mean(dim=1), e.amax(dim=1)], dim=-1)
    m = mask.unsqueeze(-1)
    mean = (e * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return torch.cat([mean, e.masked_fill(m == 0, -2.0).amax(dim=1)], dim=-1)  # tanh embeddings are > -1


class PolicyNet(nn.Module):
    """Observation ``(B, N, F)`` float32 -> logits ``(B, N, A)`` float32 (module docstring)."""

    def __init__(self, num_features: int = NUM_FEATURES, num_actions: int = len(LADDER), hidden: int = 64):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(num_features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.Tanh(), nn.Linear(hidden, num_actions))
        nn.init.orthogonal_(self.head[-1].weight, gain=0.01)  # near-uniform initial policy
        nn.init.zeros_(self.head[-1].bias)

    def forward(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (B, N) float, 1 = worker present (training with several worker counts only;
        the exported graph has no mask)."""
        e = self.embed(obs)
        context = _pooled(e, mask).unsqueeze(1).expand(-1, e.shape[1], -1)
        return self.head(torch.cat([e, context], dim=-1))


class PerWorkerPPOModule(TorchRLModule, ValueFunctionAPI):
    """RLlib module around :class:`PolicyNet` (module docstring).

    ``model_config`` keys: ``hidden`` (default 64); ``padded`` (default False): observations
    carry a worker mask after the feature rows (:class:`~dynamix_byteps.policy.sim.env.DynamixSimEnv`
    with several worker counts); pooling skips absent workers and their logits are pinned to
    "keep" (log-probability 0, no entropy, no gradient). Any other key (e.g. ``dynamix`` metadata
    recorded by training) is kept and saved with the checkpoint.

    Raises:
        ConfigurationError: (setup) when the observation or action space does not fit the
            feature count or is not one ladder (of 3, 5, 7 or 9 steps) per worker.
    """

    def setup(self):
        hidden = int(self.model_config.get("hidden", 64))
        size = int(self.observation_space.shape[0])
        self.padded = bool(self.model_config.get("padded", False))
        row = NUM_FEATURES + 1 if self.padded else NUM_FEATURES
        if size % row:
            raise ConfigurationError(f"observation size {size} is not a multiple of {row} values per worker")
        self.num_workers = size // row
        nvec = [int(x) for x in self.action_space.nvec]
        if len(nvec) != self.num_workers or len(set(nvec)) != 1 or nvec[0] not in LADDER_LENGTHS:
            raise ConfigurationError(f"action space {nvec} is not {self.num_workers} × one ladder of "
                                     f"{LADDER_LENGTHS} steps")
        self.keep = keep_index(nvec[0])
        self.policy_net = PolicyNet(NUM_FEATURES, nvec[0], hidden)
        self.value_embed = nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.Tanh())
        self.value_head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.action_dist_cls = TorchMultiCategorical.get_partial_dist_cls(input_lens=nvec)

    def _rows(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feature rows (B, N, F) and the worker mask (B, N) (None unless padded)."""
        obs = batch[Columns.OBS]
        if not self.padded:
            return obs.reshape(obs.shape[0], -1, NUM_FEATURES), None
        split = self.num_workers * NUM_FEATURES
        return obs[:, :split].reshape(obs.shape[0], -1, NUM_FEATURES), obs[:, split:]

    def _forward(self, batch, **kwargs):
        rows, mask = self._rows(batch)
        logits = self.policy_net(rows, mask)
        if mask is not None:
            keep = torch.full_like(logits, -1e4)
            keep[..., self.keep] = 0.0
            logits = torch.where(mask.unsqueeze(-1) > 0, logits, keep)
        return {Columns.ACTION_DIST_INPUTS: logits.flatten(1)}

    def compute_values(self, batch, embeddings=None):
        rows, mask = self._rows(batch)
        return self.value_head(_pooled(self.value_embed(rows), mask)).squeeze(-1)

    def set_state(self, state) -> None:
        """Load every weight or raise ``ValueError`` naming the missing and unexpected keys."""
        missing, unexpected = self.load_state_dict(convert_to_torch_tensor(state), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"the policy state does not match the network: missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}; it was saved by a different network configuration"
            )
