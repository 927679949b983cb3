"""The static policy: the job's starting allocation, unchanged (the baseline every other beats)."""

from __future__ import annotations

from dynamix_byteps.policy.base import ClusterState, Decision, Policy

__all__ = ["StaticPolicy"]


class StaticPolicy(Policy):
    """Always answers ``state.initial_batch_sizes`` with ``predicted_gain = 0``.

    It makes no prediction, so :class:`~dynamix_byteps.policy.guardrails.Guarded` skips its
    hysteresis rule for it (``reports_gain = False``). If the initial allocation does not have one
    entry per worker (the cluster was resized), the current sizes are kept.
    """

    name = "static"
    reports_gain = False

    def decide(self, state: ClusterState) -> Decision:
        initial = tuple(int(b) for b in state.initial_batch_sizes)
        if len(initial) != len(state.workers):
            return Decision(
                state.batch_sizes,
                f"static: initial allocation has {len(initial)} entries for {len(state.workers)} "
                "workers; keeping current sizes",
            )
        return Decision(initial, "static: initial allocation", 0.0, {"global_batch": sum(initial)})
