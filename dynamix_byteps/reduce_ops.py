"""The reduction names of BytePS's TensorFlow frontend and of Horovod (``Average``, ``Sum``,
``Adasum``) and the checks of the ``op=`` and ``gradient_predivide_factor=`` arguments that
BytePS's and Horovod's optimizers take, shared by the PyTorch and TensorFlow frontends.

Gradients are always the batch-weighted mean over the workers, so an optimizer accepts only
``op=Average``, and ``gradient_predivide_factor`` (Horovod's split of that mean into a division
before the sum and one after it) cannot change the result.
"""

from __future__ import annotations

import math
import numbers

Average = "Average"
Sum = "Sum"
Adasum = "Adasum"  # BytePS's and Horovod's name; no reduction here implements it


def check_gradient_op(op: str) -> None:
    """Raise ValueError unless ``op`` is ``Average``: gradients are always averaged over the workers.

    BytePS's ``DistributedOptimizer`` and ``DistributedGradientTape`` take ``op`` too, average
    whatever it says and refuse ``Adasum``; here ``Sum`` is refused as well instead of being ignored.
    """
    if op != Average:
        raise ValueError(f"op={op!r}: gradients are always averaged over the workers, weighted by their batch "
                         "sizes; pass op=bps.Average or leave op out")


def check_gradient_predivide_factor(factor: float) -> None:
    """Raise ValueError unless ``factor`` is a finite real number > 0.

    Horovod divides the gradients by ``factor`` before the sum and multiplies the sum by
    ``factor / size`` after it; the average is the same for every valid factor, so it is
    accepted and has no effect.
    """
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {factor!r} (it splits the "
                         "average into a division before and after the sum; the average stays the same)")


def missing_name(module: str, name: str, horovod_hints: dict[str, str]) -> AttributeError:
    """The AttributeError of a frontend module's ``__getattr__``: for a Horovod name a port renames
    or drops (``horovod_hints``: what to write instead), it says what to write; no alias is added."""
    hint = horovod_hints.get(name)
    return AttributeError(f"module {module!r} has no attribute {name!r}" + (
        "" if hint is None else f" (Horovod's hvd.{name}): {hint}; see docs/porting.md, From Horovod"))


# What a TensorFlow or Keras script ported from Horovod writes instead of these names.
TENSORFLOW_HOROVOD_HINTS = {
    "allreduce": "use push_pull(tensor, name=...), BytePS's name for it (it averages too)",
    **{name: "there is none in dynamix_byteps.tensorflow" for name in ("allgather", "alltoall", "barrier", "join")},
}
