"""``byteps.tensorflow.DistributedOptimizer``: BytePS's TensorFlow-level arguments in front of the
Keras 3 wrapper (:func:`dynamix_byteps.tensorflow.keras.DistributedOptimizer`)."""

from __future__ import annotations

import keras

from dynamix_byteps.reduce_ops import Average
from dynamix_byteps.tensorflow.keras import optimizer as _keras_optimizer
from dynamix_byteps.torch.compression import Compression, Compressor


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: str = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, lr_scaling: str | None = None,
                         base_batch_size: int | None = None, batch_plan=None) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that every update first averages the gradients over all workers,
    weighted by each worker's local batch size; see
    :func:`dynamix_byteps.tensorflow.keras.DistributedOptimizer`, which this calls.

    Args:
        optimizer: as for the Keras ``DistributedOptimizer``.
        name: as for the Keras ``DistributedOptimizer``.
        device_dense: as for the Keras ``DistributedOptimizer``.
        device_sparse: as for the Keras ``DistributedOptimizer``.
        compression: as for the Keras ``DistributedOptimizer``.
        sparse_as_dense: as for the Keras ``DistributedOptimizer``.
        backward_passes_per_step: as for the Keras ``DistributedOptimizer``: must be 1, as in
            BytePS with a Keras optimizer.
        op: as for the Keras ``DistributedOptimizer``: must be ``Average`` (BytePS refused
            ``Adasum`` too).
        gradient_predivide_factor: as for the Keras ``DistributedOptimizer`` (Horovod's).
        average_aggregated_gradients: as for the Keras ``DistributedOptimizer`` (Horovod's).
        lr_scaling: as for the Keras ``DistributedOptimizer``.
        base_batch_size: as for the Keras ``DistributedOptimizer``.
        batch_plan: as for the Keras ``DistributedOptimizer``.
        use_locking: accepted for BytePS compatibility (it applies to TensorFlow 1 optimizers).

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer (TensorFlow 1 ``tf.compat.v1.train``
            optimizers are not supported: use the ``keras.optimizers`` one), or ``batch_plan`` is
            not a ``BatchPlan``.
        ValueError: as the Keras ``DistributedOptimizer``.
    """
    del use_locking
    return _keras_optimizer.DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, lr_scaling=lr_scaling,
        base_batch_size=base_batch_size, batch_plan=batch_plan)
