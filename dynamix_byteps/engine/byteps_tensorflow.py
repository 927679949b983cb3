"""Optional engine on real BytePS's TensorFlow plugin (``byteps.tensorflow``), for GPU clusters.

Chosen for ``dynamix_byteps.tensorflow`` jobs started with ``bpslaunch --engine byteps``;
imported lazily. The engine's buffers stay ``torch.Tensor`` s (the currency of every engine);
each round crosses to a TensorFlow tensor through DLPack (no copy), runs BytePS's push_pull op
(a sum, keyed by name) and copies the sum back into the buffer.

BytePS's public ``push_pull`` names its key after the graph tensor, which an eager tensor lacks,
so the engine calls the keyed op ``_push_pull(tensor, scope, name)`` that ``push_pull`` itself
uses; names are made valid TensorFlow op names. The op returns when the sum is complete, so
rounds finish on issue and are timed around the call.
"""

from __future__ import annotations

import re

from dynamix_byteps.engine.base import Handle
from dynamix_byteps.engine.byteps import BytePSEngine
from dynamix_byteps.errors import CommunicationError, EngineUnavailableError


def _import_byteps_tensorflow():
    try:
        import byteps.tensorflow as byteps_tensorflow
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the byteps engine needs BytePS with its TensorFlow plugin, which failed to import ({exc}). "
            "It requires CUDA and NCCL: build it on a GPU machine (docker/Dockerfile.gpu), "
            "or run with the embedded default engine: --engine gloo / DYNAMIX_ENGINE=gloo"
        ) from exc
    return byteps_tensorflow


def op_name(name: str) -> str:
    """``name`` with every character TensorFlow refuses in an op name replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name).lstrip("_./-") or "tensor"


class _Finished(Handle):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class BytePSTensorFlowEngine(BytePSEngine):
    """``byteps.tensorflow`` push_pull through its scheduler and servers (``DMLC_*`` set by bpslaunch)."""

    @staticmethod
    def _import_plugin():
        return _import_byteps_tensorflow()

    def all_reduce_async(self, tensor, name: str) -> Handle:
        import tensorflow as tf
        import torch

        span = self.timing.start(name, tensor.numel() * tensor.element_size())
        try:
            summed = self._bps._push_pull(tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor)),
                                          scope="", name=op_name(name))
            tensor.copy_(torch.from_dlpack(summed))
        except tf.errors.OpError as exc:
            raise CommunicationError(f"BytePS push_pull of {name!r} failed: {exc.message}") from exc
        span.end()
        return _Finished()
