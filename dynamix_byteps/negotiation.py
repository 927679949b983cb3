"""Agreeing on a collective round before any data moves.

Engines match collectives by issue order, so a worker that submits a different name, shape or
dtype would make gloo abort the process (size mismatch) or sum unrelated bytes (dtype
mismatch). Before a round, every worker therefore exchanges a fingerprint of what it is about
to submit, together with up to :data:`PAYLOAD_WIDTH` integers of payload (the optimizer sends
its local batch size and squared gradient norm). The exchange has a fixed width, so it cannot
itself mismatch. When fingerprints differ, every
worker raises :class:`TensorMismatchError` naming what each rank submitted.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Iterable

import numpy as np

from dynamix_byteps.engine import Engine
from dynamix_byteps.errors import TensorMismatchError

_FINGERPRINT_MASK = (1 << 62) - 1
PAYLOAD_WIDTH = 2

round_lock = threading.RLock()
"""Held from a round's negotiation until its collectives are issued, so that rounds started
from several threads of one worker cannot interleave (which gloo would answer with an abort)."""


def describe(name: str, tensor) -> str:
    """``name dtype[shape]``, e.g. ``'Gradient.fc.weight float32[10, 128]'``."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{name} {dtype}{list(tensor.shape)}"


def fingerprint(descriptions: Iterable[str]) -> int:
    """A 62-bit digest (BLAKE2b) of an ordered sequence of descriptions."""
    digest = hashlib.blake2b(digest_size=8)
    for text in descriptions:
        digest.update(text.encode())
        digest.update(b"\0")
    return int.from_bytes(digest.digest(), "little") & _FINGERPRINT_MASK


def negotiate(engine: Engine, what: str, description: str, *payload: int) -> np.ndarray:
    """Check that every worker is about to run the same round, and share a few integers each.

    Args:
        engine: the running engine; every worker must call ``negotiate`` at the same point.
        what: the operation, for the error message (e.g. ``"push_pull"``).
        description: everything that must match across workers (names, dtypes, shapes, mode).
        payload: up to :data:`PAYLOAD_WIDTH` int64 values this worker shares (missing ones are 0).

    Returns:
        int64 array of shape ``(size, PAYLOAD_WIDTH)``: row r is rank r's payload.

    Raises:
        TensorMismatchError: on every worker, when any description differs.
    """
    if len(payload) > PAYLOAD_WIDTH:
        raise ValueError(f"negotiate carries at most {PAYLOAD_WIDTH} payload values, got {len(payload)}")
    padded = list(payload) + [0] * (PAYLOAD_WIDTH - len(payload))
    table = engine.exchange([fingerprint([description]), *padded], what=what)
    if np.all(table[:, 0] == table[0, 0]):
        return table[:, 1:]
    descriptions = gather_text(engine, description)
    lines = "\n".join(f"  rank {rank}: {text}" for rank, text in enumerate(descriptions))
    raise TensorMismatchError(
        f"workers submitted different tensors to the same {what} round; every worker must issue "
        f"the same collectives with the same names, shapes and dtypes in the same order:\n{lines}"
    )


_MAX_TEXT_BYTES = 2000


def gather_text(engine: Engine, text: str) -> list[str]:
    """Every worker's ``text`` (its first 2000 bytes), in rank order; a collective."""
    data = text.encode()[:_MAX_TEXT_BYTES]
    lengths = engine.exchange([len(data)])[:, 0]
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    table = engine.exchange(padded.tolist())
    return [bytes(row[:n].astype(np.uint8)).decode(errors="replace") for row, n in zip(table, lengths)]
