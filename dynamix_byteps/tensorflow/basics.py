"""``init`` and ``shutdown`` of the TensorFlow frontend, shared by ``dynamix_byteps.tensorflow``
and ``dynamix_byteps.tensorflow.keras`` (as BytePS's Keras module re-exports its TensorFlow ones)."""

from __future__ import annotations

from dynamix_byteps import engine as _engine
from dynamix_byteps import shutdown


def init(lazy: bool = True) -> None:
    """:func:`dynamix_byteps.init` with the engine's TensorFlow plugin (BytePS's ops under
    ``--engine byteps``); same arguments and errors."""
    del lazy
    _engine.start(framework="tensorflow")


__all__ = ["init", "shutdown"]
