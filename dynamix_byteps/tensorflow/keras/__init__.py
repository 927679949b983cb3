"""The ``byteps.tensorflow.keras`` API on dynamix_byteps for Keras 3 (TensorFlow backend).

``import dynamix_byteps.tensorflow.keras as bps_keras`` gives ``DistributedOptimizer``,
``broadcast_global_variables`` and ``callbacks`` (``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback``, and ``BatchSizeCallback``, which applies batch-size assignments).
"""

from dynamix_byteps.tensorflow.keras import callbacks
from dynamix_byteps.tensorflow.keras.callbacks import broadcast_global_variables
from dynamix_byteps.tensorflow.keras.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "broadcast_global_variables", "callbacks"]
