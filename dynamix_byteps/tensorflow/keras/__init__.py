"""The ``byteps.tensorflow.keras`` API on dynamix_byteps for Keras 3 (TensorFlow backend).

``import dynamix_byteps.tensorflow.keras as bps_keras`` gives ``DistributedOptimizer``,
Horovod's ``Average`` and ``Sum`` (for its ``op=``),
``broadcast_global_variables``, ``push_pull``, ``broadcast``, ``load_model``, the TensorFlow
frontend's ``init``, ``shutdown``, ``size``, ``local_size``, ``rank``, ``local_rank`` and
``Compression``, and ``callbacks`` (``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback``, ``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``,
and ``BatchSizeCallback``, which applies batch-size assignments).
"""

from dynamix_byteps import local_rank, local_size, rank, size
from dynamix_byteps.reduce_ops import TENSORFLOW_HOROVOD_HINTS, Average, Sum, missing_name
from dynamix_byteps.tensorflow.basics import init, shutdown
from dynamix_byteps.tensorflow.keras import callbacks
from dynamix_byteps.tensorflow.keras.callbacks import broadcast_global_variables
from dynamix_byteps.tensorflow.keras.functions import broadcast, load_model, push_pull
from dynamix_byteps.tensorflow.keras.optimizer import DistributedOptimizer
from dynamix_byteps.torch.compression import Compression

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "broadcast",
    "broadcast_global_variables",
    "callbacks",
    "init",
    "load_model",
    "local_rank",
    "local_size",
    "push_pull",
    "rank",
    "shutdown",
    "size",
]


def __getattr__(name: str):
    # Horovod's hvd.allreduce is push_pull here, with no alias: say so instead of a bare AttributeError.
    import dynamix_byteps.tensorflow as frontend

    if name in frontend.__all__:  # a port that imported only this module as hvd, e.g. hvd.DynamicBatchSampler
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: it is in dynamix_byteps.tensorflow "
                             f"(import dynamix_byteps.tensorflow as bps, then bps.{name}); see docs/tensorflow.md")
    raise missing_name(__name__, name, TENSORFLOW_HOROVOD_HINTS)
