"""The ``byteps.torch`` API on dynamix_byteps: change ``import byteps.torch as bps`` to
``import dynamix_byteps.torch as bps`` and the script runs unchanged.

What differs: ``DistributedOptimizer`` weights each worker's gradient by its local batch size
(``optimizer.set_local_batch_size(n)``), and the default engine is gloo (CPU, no servers).
"""

from dynamix_byteps import init, is_initialized, local_rank, local_size, rank, shutdown, size
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

__all__ = [
    "Compression",
    "DistributedOptimizer",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "declare",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_inplace",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]
