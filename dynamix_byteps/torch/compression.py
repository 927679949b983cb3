"""Gradient compression applied around push_pull, with BytePS's ``Compression`` names."""

from __future__ import annotations

import torch


class Compressor:
    """Turns a tensor into what crosses the wire and back; ``compress`` returns ``(tensor, ctx)``."""

    name = "none"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor


NoneCompressor = Compressor  # BytePS's name for the identity compressor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); other dtypes pass unchanged.

    float16 covers about ±65504 with 11 significant bits: sums of large gradients can
    overflow, and precision is lost below ~1e-3 relative.
    """

    name = "fp16"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as in ``byteps.torch``."""

    none = Compressor
    fp16 = FP16Compressor
