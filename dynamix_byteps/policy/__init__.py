"""Batch-size policies: what the scheduler asks every decision interval.

``make_policy(name, **options)`` builds one by the name ``--policy`` accepts:

* ``static``: the initial allocation, unchanged.
* ``proportional``: keep the global batch, ``b_i ∝`` measured throughput (LB-BSP, SoCC'20).
* ``goodput``: the global batch maximising throughput × statistical efficiency, split
  proportionally (Pollux, OSDI'21).
* ``ppo``: the DYNAMIX agent, a trained network served by ONNX Runtime; needs ``path=DIR``
  (a directory from ``dynamix policy train`` / ``export``), or ``ppo:NAME`` names a policy of
  the packaged library (:mod:`.ppo.library`, ``dynamix policy list``); see :mod:`.ppo`.

Wrap any of them in :class:`Guarded` for bounds, maximum change, hysteresis and the fallback on
divergence: ``Guarded(make_policy("proportional"), max_change=2.0)``.
"""

from __future__ import annotations

import inspect

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.base import ClusterState, Decision, Policy, WorkerState
from dynamix_byteps.policy.goodput import GoodputPolicy
from dynamix_byteps.policy.guardrails import Guarded
from dynamix_byteps.policy.ppo import PPOPolicy
from dynamix_byteps.policy.proportional import ProportionalPolicy
from dynamix_byteps.policy.static import StaticPolicy

__all__ = [
    "POLICIES",
    "ClusterState",
    "Decision",
    "GoodputPolicy",
    "Guarded",
    "PPOPolicy",
    "Policy",
    "ProportionalPolicy",
    "StaticPolicy",
    "WorkerState",
    "make_policy",
    "option_names",
]

#: Policies ``make_policy`` can build, by name.
POLICIES: dict[str, type[Policy]] = {
    StaticPolicy.name: StaticPolicy,
    ProportionalPolicy.name: ProportionalPolicy,
    GoodputPolicy.name: GoodputPolicy,
    PPOPolicy.name: PPOPolicy,
}


def make_policy(name: str, /, **options) -> Policy:
    """Build the policy called ``name`` with its keyword ``options``.

    Raises:
        ConfigurationError: (a ``ValueError``) for an unknown name, for options the policy does
            not accept, or a policy that cannot load (``ppo`` without a valid ``path``, ``ppo:NAME``
            with a name the library lacks or cannot serve: the message lists the library).
    """
    key, _, variant = str(name).strip().partition(":")
    key = key.lower()
    if variant:  # ppo:NAME, a policy of the packaged library
        if key != PPOPolicy.name:
            raise ConfigurationError(f"policy {name!r}: only ppo takes :NAME (a library policy), e.g. ppo:small-cnn-sgd")
        if "name" in options:
            raise ConfigurationError(f"policy {name!r} names its library policy already; drop the name option")
        options = {**options, "name": variant}
    cls = POLICIES.get(key)
    if cls is None:
        raise ConfigurationError(
            f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        )
    takes = option_names(cls)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ConfigurationError(f"policy {key!r} has no option {', '.join(unknown)}; "
                                 f"its options: {', '.join(takes) or 'none'}")
    try:
        return cls(**options)
    except ConfigurationError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigurationError(f"invalid options for policy {key!r}: {exc}") from exc


def option_names(cls: type[Policy]) -> list[str]:
    """The keyword options policy class ``cls`` takes, in its signature's order."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
