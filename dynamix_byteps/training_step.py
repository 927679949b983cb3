"""The step path every frontend shares: which batches a step trained on, and where a step ends.

Each frontend object (torch's ``DistributedOptimizer`` and ``DistributedDataParallel``,
TensorFlow's Keras ``DistributedOptimizer`` and ``DistributedGradientTape``) owns one
:class:`TrainingStep`, which holds its three parts and nothing global:

- the :class:`~dynamix_byteps.aggregation.GradientAggregator` (the reduction and its statistics),
- the :class:`~dynamix_byteps.control.step_monitor.StepMonitor` (timing, scheduler reports, the
  decision boundary), built here, not by the aggregator,
- the :class:`~dynamix_byteps.batch_plan.BatchPlan` the step's batch sizes come from: the one
  the frontend was handed (``batch_plan=sampler.batch_plan``), else the process's default plan
  (the newest sampler's), looked up at every step.

Every frontend ends a step at the same point, :meth:`TrainingStep.end`, called as soon as the
step's gradient reduction has completed: the learning-rate factor of the step is fixed and the
monitor is handed the step (torch: in ``synchronize``, which ``step()`` calls, or at the end of
backward for ``DistributedDataParallel``; TensorFlow: right after the reduction inside
``apply``/``gradient()``), before the optimizer's update is applied.
"""

from __future__ import annotations

from dynamix_byteps import batch_plan as _batch_plan
from dynamix_byteps import tensorboard_scalars
from dynamix_byteps.aggregation import UNSET, GradientAggregator, SamplerPosition
from dynamix_byteps.control.step_monitor import StepMonitor
from dynamix_byteps.scaling.gradient_noise import GradientNoiseScale


class TrainingStep:
    """The aggregator, step monitor and batch plan of one frontend object.

    Args:
        aggregator: the frontend's :class:`GradientAggregator`; its ``before_send`` becomes the
            monitor's straggler emulation.
        optimizer_family: ``"sgd"`` or ``"adam"``, for the scheduler.
        batch_plan: the :class:`~dynamix_byteps.batch_plan.BatchPlan` to train on; None: the
            process's default plan at each step.

    Attributes:
        aggregator: as given.
        monitor: the :class:`StepMonitor` this frontend owns.
        next_step: the global step after the last one taken from the plan (None before one).
        trained_position: the sampler step, epoch, settings and rank the last
            :meth:`take_samples` drew (its last batch's), a
            :class:`~dynamix_byteps.aggregation.SamplerPosition` the round's trailer checks on
            every worker; None when it drew none (no sampler feeds the frontend).

    Raises:
        TypeError: ``batch_plan`` is not a ``BatchPlan`` (e.g. the sampler itself was passed).
    """

    def __init__(self, aggregator: GradientAggregator, optimizer_family: str,
                 batch_plan: _batch_plan.BatchPlan | None = None):
        self._given = _batch_plan.checked(batch_plan)
        engine = aggregator.engine
        self.aggregator = aggregator
        self.monitor = StepMonitor(engine, engine.env, optimizer_family, tensorboard_scalars.worker_writer())
        aggregator.before_send = self.monitor.stretch
        self.next_step: int | None = None
        self.trained_position: SamplerPosition | None = None
        self._plan: _batch_plan.BatchPlan | None = None
        self.plan()

    def plan(self) -> _batch_plan.BatchPlan:
        """The plan this step trains on; the monitor and noise statistics are attached to it when
        it changes (the default plan of a frontend given none changes with each new sampler)."""
        plan = self._given if self._given is not None else _batch_plan.default()
        if plan is not self._plan:
            plan.attach(self.monitor, self.aggregator.gradient_noise)
            self._plan = plan
        return plan

    def take_samples(self, declared: int = UNSET, passes: int = 1) -> int:
        """This step's local sample count: ``declared`` if set, else the sum of the next
        ``passes`` batches the sampler handed out, else :data:`~dynamix_byteps.aggregation.UNSET`.
        Consumes those draws from the plan either way.

        Raises:
            ConfigurationError: another frontend takes this plan's draws in turn with this one
                (:meth:`~dynamix_byteps.batch_plan.BatchPlan.take_draws`).
        """
        plan = self.plan()
        drawn = plan.take_draws(passes, as_default=self._given is None, taker=self)
        # trained_position() is the newest taken draw's (epoch, samples): drawn[-1]'s epoch.
        self.trained_position = (SamplerPosition(drawn[-1][0], plan.trained_position()[0], plan.sampler_settings,
                                                 plan.sampler_rank)
                                 if drawn and plan.sampler_settings is not None else None)
        if drawn:
            self.next_step = drawn[-1][0] + 1
        if declared != UNSET:
            return declared
        return sum(samples for _, samples in drawn) if drawn else UNSET

    def end(self, samples: int) -> float:
        """End the step whose reduction just completed, weighted by this worker's ``samples``
        (:data:`~dynamix_byteps.aggregation.UNSET`: none known): fix the learning-rate factor and
        hand the step to the monitor (timing, reports, the assignment boundary, a collective at
        every ``decision_interval``-th step). Returns the learning-rate factor of the step."""
        aggregator = self.aggregator
        lr_scale = aggregator.update_lr_scale()
        self.monitor.after_step(None if samples == UNSET else samples, aggregator.gradient_noise, lr_scale,
                                self.next_step, aggregator.wait_s, self._plan, aggregator.wait_ns)
        return lr_scale

    def state_dict(self) -> dict:
        """What a checkpoint needs: base batch, noise statistics, next step."""
        return {**self.aggregator.state_dict(), "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; checked first, so a bad ``state`` changes nothing.

        Raises:
            ValueError: ``state`` lacks a part or holds one of the wrong type or range.
        """
        check_state_dict(state)
        self.aggregator.load_state_dict(state)
        self.next_step = state["next_step"]


def check_state_dict(state) -> None:
    """Raise ValueError, naming the part, unless ``state`` is a :meth:`TrainingStep.state_dict`:
    ``base_batch_size`` an integer >= 1 and ``next_step`` one >= 0 (each None before the first
    step), ``gradient_noise`` the noise statistics' state."""
    try:
        base, step = state["base_batch_size"], state["next_step"]
        GradientNoiseScale().load_state_dict(state["gradient_noise"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{type(error).__name__}: {error}") from None
    for name, value, low in (("base_batch_size", base, 1), ("next_step", step, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name}={value!r} is not an integer >= {low}")
