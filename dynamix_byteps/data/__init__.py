"""Data for dynamix_byteps: offline dataset loaders (numpy only, no framework imports).

``load_fashion_mnist(split, root=None)`` and ``load_mnist(split, root=None)`` return
``(images, labels)`` as ``np.uint8 (N, 28, 28)`` and ``np.int64 (N,)``; see
:mod:`dynamix_byteps.data.datasets` for where they look and what they raise.
``add_dataset_arguments(parser)`` adds a training script's ``--data-dir`` and ``--limit-train``.
"""

from dynamix_byteps.data.datasets import add_dataset_arguments, load_fashion_mnist, load_mnist

__all__ = ["add_dataset_arguments", "load_fashion_mnist", "load_mnist"]
