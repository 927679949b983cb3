"""The ``byteps.tensorflow`` API on dynamix_byteps: change ``import byteps.tensorflow as bps`` to
``import dynamix_byteps.tensorflow as bps`` and the script runs unchanged (TensorFlow 2 with
Keras 3; eager and ``tf.function``).

What differs: each worker may have its own batch size, changed at run time
(``DynamicBatchSampler`` with ``dynamic_batch_dataset``, ``set_batch_sizes``);
``DistributedGradientTape`` and ``DistributedOptimizer`` weight each worker's gradient by its
batch, ``DistributedOptimizer`` also scales the learning rate with the global batch, and both
estimate the gradient noise scale and report to a ``bpslaunch --policy`` scheduler. The
default engine is gloo (CPU, no servers); ``bpslaunch --engine byteps`` runs BytePS's own
TensorFlow ops. Importing this module imports TensorFlow; ``dynamix_byteps`` and
``dynamix_byteps.torch`` never do.
"""

from dynamix_byteps import engine as _engine
from dynamix_byteps import shutdown as _shutdown
from dynamix_byteps import (
    is_initialized,
    local_rank,
    local_size,
    log_scalar,
    rank,
    size,
    step_statistics,
    untimed,
)
from dynamix_byteps.batching import (
    gradient_noise_scale,
    gradient_statistics,
    set_batch_sizes,
)
from dynamix_byteps.data.sampler import DynamicBatchSampler
from dynamix_byteps.tensorflow.data import dynamic_batch_dataset
from dynamix_byteps.tensorflow.gradients import (
    DistributedGradientTape,
    forget_tape_reducers,
)
from dynamix_byteps.tensorflow.keras.optimizer import DistributedOptimizer
from dynamix_byteps.tensorflow.ops import (
    Average,
    Sum,
    broadcast,
    broadcast_variables,
    push_pull,
)
from dynamix_byteps.tensorflow.reporting import report_loss
from dynamix_byteps.torch.compression import Compression


def init(lazy: bool = True) -> None:
    """Join the job described by the environment (set by ``bpslaunch``); idempotent.

    Blocks until every worker has joined. ``lazy`` exists for BytePS compatibility and is ignored.

    Raises:
        ConfigurationError: a ``DMLC_*``/``BYTEPS_*``/``DYNAMIX_*`` variable is invalid.
        EngineUnavailableError: the selected engine cannot be imported.
        CommunicationError: the rendezvous with the other workers failed.
    """
    del lazy
    _engine.start(framework="tensorflow")


def shutdown() -> None:
    """:func:`dynamix_byteps.shutdown`, after dropping this frontend's gradient-tape reducers."""
    forget_tape_reducers()
    _shutdown()


__all__ = [
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "DynamicBatchSampler",
    "Sum",
    "broadcast",
    "broadcast_variables",
    "dynamic_batch_dataset",
    "gradient_noise_scale",
    "gradient_statistics",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "log_scalar",
    "push_pull",
    "rank",
    "report_loss",
    "set_batch_sizes",
    "shutdown",
    "size",
    "step_statistics",
    "untimed",
]
