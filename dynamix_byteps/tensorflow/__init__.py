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
from dynamix_byteps.batch_plan import (
    gradient_noise_scale,
    gradient_statistics,
    set_batch_sizes,
)
from dynamix_byteps.data.sampler import DynamicBatchSampler
from dynamix_byteps.errors import InvalidAssignmentError
from dynamix_byteps.reduce_ops import TENSORFLOW_HOROVOD_HINTS, Adasum, Average, Sum, missing_name
from dynamix_byteps.tensorflow.basics import init, shutdown
from dynamix_byteps.tensorflow.data import dynamic_batch_dataset
from dynamix_byteps.tensorflow.gradients import DistributedGradientTape
from dynamix_byteps.tensorflow.ops import (
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    push_pull,
)
from dynamix_byteps.tensorflow.optimizer import DistributedOptimizer
from dynamix_byteps.tensorflow.reporting import report_loss
from dynamix_byteps.torch.compression import Compression

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "DynamicBatchSampler",
    "InvalidAssignmentError",
    "Sum",
    "broadcast",
    "broadcast_global_variables",
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


def __getattr__(name: str):
    # Horovod's hvd.allreduce is push_pull here, with no alias: say so instead of a bare AttributeError.
    raise missing_name(__name__, name, TENSORFLOW_HOROVOD_HINTS)
