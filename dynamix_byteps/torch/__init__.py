"""The ``byteps.torch`` API on dynamix_byteps: change ``import byteps.torch as bps`` to
``import dynamix_byteps.torch as bps`` and the script runs unchanged.

What differs: each worker may have its own batch size, changed at run time
(``DynamicBatchSampler``, ``set_batch_sizes``); ``DistributedOptimizer`` weights each worker's
gradient by its batch, scales the learning rate with the global batch and estimates the
gradient noise scale; the default engine is gloo (CPU, no servers).
"""

from dynamix_byteps import (
    init,
    is_initialized,
    local_rank,
    local_size,
    log_scalar,
    rank,
    shutdown,
    size,
    step_statistics,
    untimed,
)
from dynamix_byteps.batch_plan import gradient_noise_scale, gradient_statistics, set_batch_sizes
from dynamix_byteps.control.step_monitor import report_loss
from dynamix_byteps.errors import (
    CommunicationError,
    ConfigurationError,
    GradientReductionError,
    InvalidAssignmentError,
    TensorMismatchError,
)
from dynamix_byteps.reduce_ops import Adasum, Average, Sum, missing_name
from dynamix_byteps.torch.checkpoint import load_checkpoint, save_checkpoint
from dynamix_byteps.torch.compression import Compression
from dynamix_byteps.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from dynamix_byteps.torch.ops import (
    declare,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    synchronize,
)
from dynamix_byteps.torch.optimizer import DistributedOptimizer
from dynamix_byteps.torch.parallel import DistributedDataParallel
from dynamix_byteps.torch.sampler import DynamicBatchSampler

__all__ = [
    "Adasum",
    "Average",
    "CommunicationError",
    "Compression",
    "ConfigurationError",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicBatchSampler",
    "GradientReductionError",
    "InvalidAssignmentError",
    "Sum",
    "TensorMismatchError",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "declare",
    "gradient_noise_scale",
    "gradient_statistics",
    "init",
    "is_initialized",
    "load_checkpoint",
    "local_rank",
    "local_size",
    "log_scalar",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_inplace",
    "rank",
    "report_loss",
    "save_checkpoint",
    "set_batch_sizes",
    "shutdown",
    "size",
    "step_statistics",
    "synchronize",
    "untimed",
]


# Horovod's names that a port renames or drops (docs/porting.md, "From Horovod"). None gets an alias
# (``push_pull`` is BytePS's name for ``allreduce``), but a script that changed only its import is
# told what to write instead of getting a bare AttributeError, often after a whole epoch of training.
_TORCH_DISTRIBUTED = "bps.init() sets up torch.distributed's default process group, so use "
_HOROVOD_NAMES = {
    "allreduce": "use push_pull(tensor, name=...), BytePS's name for it (it averages too; op=Sum is average=False)",
    "allreduce_": "use push_pull_inplace(tensor, name=...), BytePS's name for it",
    "allreduce_async": "use push_pull_async(tensor, name=...), BytePS's name for it",
    "allreduce_async_": "use push_pull_async_inplace(tensor, name=...), BytePS's name for it",
    "allgather": _TORCH_DISTRIBUTED + "torch.distributed.all_gather(outputs, tensor)",
    "allgather_object": _TORCH_DISTRIBUTED + "torch.distributed.all_gather_object(outputs, obj)",
    "broadcast": _TORCH_DISTRIBUTED + "torch.distributed.broadcast(tensor, src=root_rank), or broadcast_parameters "
                 "and broadcast_object",
    "barrier": _TORCH_DISTRIBUTED + "torch.distributed.barrier()",
    "join": "there is none: every worker must run the same number of steps, which a DynamicBatchSampler keeps equal",
}


def __getattr__(name: str):
    raise missing_name(__name__, name, _HOROVOD_NAMES)
