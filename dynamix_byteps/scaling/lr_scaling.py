"""Learning-rate scaling rules for a global batch that changes at run time.

Framework-neutral: plain floats, no torch or TensorFlow import. A rule maps the current global
batch ``B`` (samples, the sum of the per-worker batches in force), the base batch ``B0`` (the
batch the user's learning rate was tuned for) and, for the adaptive rules, the
:class:`~dynamix_byteps.scaling.gradient_noise.GradientNoiseScale` state to a factor. The torch
frontend multiplies each parameter group's ``lr`` by the factor for the duration of one
``optimizer.step()`` and restores it afterwards, so user LR schedulers keep working on top.

Rules (``S = B/B0``):

=============  ============================  =================================================
name           factor                        source
=============  ============================  =================================================
``none``       1                             —
``linear``     S                             Goyal et al., "Accurate, Large Minibatch SGD",
                                             arXiv 1706.02677 (2017), §2.1
``sqrt``       √S                            Krizhevsky, "One weird trick", arXiv 1404.5997
                                             (2014); Hoffer et al., "Train longer, generalize
                                             better", arXiv 1705.08741 (2017)
``adascale``   r = (σ²+μ²)/(σ²/S+μ²)         Johnson et al., "AdaScale SGD", ICML 2020,
                                             arXiv 2007.05105 (see
                                             :func:`~dynamix_byteps.scaling.gradient_noise.gain`)
``adamscale``  √r                            AdaptDL's AdamScale (below)
=============  ============================  =================================================

AdamScale, exactly as AdaptDL does it (petuum/adaptdl at commit 542e123, Jan 2023; PR #95):
``adaptdl/torch/scaling_rules.py`` class ``AdamScale(AdaScale)`` returns the AdaScale gain raised
to ``power=0.5``. The gain there comes from ``AdamGradientNoiseScale``
(``adaptdl/torch/gradient_noise_scale.py``), which measures the squared norms of the
*Adam-preconditioned* gradient ``g / (sqrt(v_t / (1 − β2^t)) + eps)`` (identity preconditioner
during Adam's first 5 steps) and resets Adam's step counter when the scale changes.
``adaptdl/torch/parallel.py`` picks AdamScale automatically for ``torch.optim.Adam``/``AdamW``
(but, because it tests the *argument* ``scaling_rule``, the auto-selected AdamScale is paired
with the plain, unpreconditioned noise scale). This module applies the square root to whatever
noise statistics it is given; whether they are preconditioned is the caller's choice.
AdaptDL computes one gain per parameter group; this module computes one for the whole model.

Before the first gradient-noise estimate (``noise`` is None or has no valid step) the adaptive
rules return 1.0, i.e. the base learning rate: the safe choice, and what AdaptDL's initial state
(``sqr_avg = 1``, ``var_avg = 0``) also yields.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from dynamix_byteps.scaling.gradient_noise import GradientNoiseScale, gain

__all__ = [
    "LRScaling",
    "NoScaling",
    "LinearScaling",
    "SqrtScaling",
    "AdaScale",
    "AdamScale",
    "RULES",
    "OPTIMIZER_FAMILIES",
    "get_rule",
    "optimizer_family_of",
]

#: Optimizer families understood by :func:`get_rule`.
OPTIMIZER_FAMILIES = ("sgd", "adam")

# Optimizer class names (anywhere in the MRO) that AdaptDL treats as Adam-type.
_ADAM_CLASS_NAMES = frozenset({"Adam", "AdamW"})


def _scale(global_batch: float, base_batch: float) -> float:
    global_batch, base_batch = float(global_batch), float(base_batch)
    if not (math.isfinite(global_batch) and global_batch > 0):
        raise ValueError(f"global_batch must be finite and > 0 samples, got {global_batch!r}")
    if not (math.isfinite(base_batch) and base_batch > 0):
        raise ValueError(f"base_batch must be finite and > 0 samples, got {base_batch!r}")
    return global_batch / base_batch


class LRScaling:
    """A learning-rate scaling rule.

    Attributes:
        name: the registry name.
        uses_noise: True if :meth:`factor` reads the gradient-noise statistics (the caller can
            skip collecting them otherwise).
    """

    name: ClassVar[str] = ""
    uses_noise: ClassVar[bool] = False

    def factor(
        self,
        global_batch: float,
        base_batch: float,
        noise: GradientNoiseScale | None = None,
    ) -> float:
        """LR multiplier for a step at global batch ``global_batch`` (samples).

        Args:
            global_batch: ``B``, the sum of the local batch sizes in force; finite, > 0.
            base_batch: ``B0``, the batch the base learning rate was tuned for; finite, > 0.
            noise: gradient-noise state; read only by the adaptive rules.

        Returns:
            A positive Python float.

        Raises:
            ValueError: ``global_batch`` or ``base_batch`` is not finite and > 0.
        """
        return self._factor(_scale(global_batch, base_batch), float(base_batch), noise)

    def _factor(self, scale: float, base_batch: float, noise: GradientNoiseScale | None) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoScaling(LRScaling):
    """Factor 1: the learning rate ignores the batch size."""

    name = "none"

    def _factor(self, scale, base_batch, noise):
        return 1.0


class LinearScaling(LRScaling):
    """Factor ``S = B/B0`` (Goyal et al. 2017, arXiv 1706.02677, linear scaling rule)."""

    name = "linear"

    def _factor(self, scale, base_batch, noise):
        return scale


class SqrtScaling(LRScaling):
    """Factor ``√(B/B0)`` (Krizhevsky 2014, arXiv 1404.5997; Hoffer et al. 2017, 1705.08741)."""

    name = "sqrt"

    def _factor(self, scale, base_batch, noise):
        return math.sqrt(scale)


class AdaScale(LRScaling):
    """AdaScale gain ``r = (σ²+μ²)/(σ²/S+μ²)`` (Johnson et al., ICML 2020, arXiv 2007.05105).

    ``μ² = |G|²`` and ``σ² = tr(Σ)/B0`` come from the smoothed gradient-noise estimates; see
    :func:`~dynamix_byteps.scaling.gradient_noise.gain` for clipping. Returns 1.0 while ``noise``
    is None or has no valid estimate yet.
    """

    name = "adascale"
    uses_noise = True

    def _factor(self, scale, base_batch, noise):
        if noise is None or noise.steps == 0:
            return 1.0
        return gain(scale, noise.grad_sq, noise.trace_cov, base_batch)


class AdamScale(AdaScale):
    """AdaptDL's AdamScale for Adam/AdamW: ``√r``, the square root of the AdaScale gain.

    See the module docstring for exactly what AdaptDL does. 1.0 before any estimate.
    """

    name = "adamscale"
    power: ClassVar[float] = 0.5

    def _factor(self, scale, base_batch, noise):
        return super()._factor(scale, base_batch, noise) ** self.power


#: Registry of rule names to classes.
RULES: dict[str, type[LRScaling]] = {
    cls.name: cls for cls in (NoScaling, LinearScaling, SqrtScaling, AdaScale, AdamScale)
}


def get_rule(name: str | LRScaling, optimizer_family: str | None = None) -> LRScaling:
    """Return the rule called ``name`` (case-insensitive).

    Args:
        name: one of :data:`RULES` (``none``, ``linear``, ``sqrt``, ``adascale``,
            ``adamscale``), or an :class:`LRScaling` instance, returned as is.
        optimizer_family: None or ``"sgd"``: the rule as named; ``"adam"``: ``adascale`` becomes
            :class:`AdamScale` (as AdaptDL does for Adam/AdamW); other rules are unchanged.

    Raises:
        ValueError: unknown rule name or optimizer family; the message lists the valid choices.
    """
    if isinstance(name, LRScaling):
        return name
    if optimizer_family is not None and optimizer_family not in OPTIMIZER_FAMILIES:
        raise ValueError(
            f"unknown optimizer family {optimizer_family!r}; "
            f"valid choices: {', '.join(OPTIMIZER_FAMILIES)} (or None)"
        )
    key = str(name).strip().lower()
    if key not in RULES:
        raise ValueError(
            f"unknown learning-rate scaling rule {name!r}; valid choices: {', '.join(RULES)}"
        )
    if key == AdaScale.name and optimizer_family == "adam":
        key = AdamScale.name
    return RULES[key]()


def optimizer_family_of(optimizer: Any) -> str:
    """``"adam"`` if ``optimizer``'s class (or a base class) is named ``Adam`` or ``AdamW``
    (what AdaptDL auto-detects), else ``"sgd"``. Looks only at class names; imports nothing."""
    names = {cls.__name__ for cls in type(optimizer).__mro__}
    return "adam" if names & _ADAM_CLASS_NAMES else "sgd"
