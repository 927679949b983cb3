"""The output of ``bpslaunch``'s children, forwarded line by line with a ``[label] `` prefix.

A line ends at ``\\n`` or at ``\\r`` (kept, so progress bars update in place); a line longer than
64 KiB is forwarded in 64 KiB pieces, each prefixed and ended with a newline. Each line is written
whole (one lock for every child), raw to the child's log file when it has one.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from typing import IO, BinaryIO, Callable, ContextManager

__all__ = ["Output"]

_MAX_LINE = 64 * 1024  # longest piece of output forwarded at once; bounds the memory per pipe
_LINE_END = re.compile(rb"\r\n|\n|\r(?=.)", re.DOTALL)  # a final \r waits: a \n may follow


class Output:
    """Where the children's lines and the launcher's notes go.

    Args:
        stdout, stderr: binary streams that receive the prefixed lines; default the launcher's own
            ``sys.stdout.buffer`` / ``sys.stderr.buffer``.
        write_guard: returns a context manager held around each write to them (the console
            progress bar clears and redraws itself there); default none.
        on_child_bar: called once, at the first child line that ends in ``\\r`` (a child drawing
            its own progress bar in place, Keras's or tqdm's), so the console bar gives way; default none.

    ``lock`` is held for every write; hold it to close a log file no pump writes to any more.
    """

    def __init__(self, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 write_guard: Callable[[], ContextManager] = contextlib.nullcontext,
                 on_child_bar: Callable[[], None] | None = None):
        self.out = stdout if stdout is not None else _binary(sys.stdout)
        self.err = stderr if stderr is not None else _binary(sys.stderr)
        self.lock = threading.Lock()
        self._write_guard = write_guard
        self._on_child_bar = on_child_bar

    def note(self, message: str) -> None:
        """Print one ``bpslaunch: ...`` line on stderr, never inside a child's line."""
        self.write(self.err, f"bpslaunch: {message}\n".encode(), None, None)

    def write(self, sink: BinaryIO | None, line: bytes, prefix: bytes | None, log: BinaryIO | None) -> None:
        with self.lock:
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except (OSError, ValueError):
                    pass
            if sink is not None:
                if prefix is not None and line.endswith(b"\r") and self._on_child_bar is not None:
                    self._on_child_bar()  # two bars on one terminal line overwrite each other
                    self._on_child_bar = None
                if prefix is not None and not line.endswith((b"\n", b"\r")):
                    line += b"\n"  # a cut long line or a last one without newline: the next starts a line
                try:
                    with self._write_guard():
                        sink.write(line if prefix is None else prefix + line)
                        sink.flush()
                except (OSError, ValueError):
                    pass  # e.g. `bpslaunch ... | head`: keep draining so children never block

    def pump(self, pipe: IO[bytes], sink: BinaryIO, label: str, log: BinaryIO | None) -> None:
        """Forward ``pipe`` to ``sink`` (and ``log``) line by line until it closes."""
        prefix = f"[{label}] ".encode()
        rest = b""
        with pipe:
            for data in iter(lambda: pipe.read1(_MAX_LINE), b""):
                lines, rest = _split_lines(rest + data)
                for line in lines:
                    self.write(sink, line, prefix, log)
        if rest:
            self.write(sink, rest, prefix, log)


def _split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """Cut ``data`` into lines, each ending in ``\\n``, ``\\r\\n`` or ``\\r`` and at most
    ``_MAX_LINE`` bytes long; returns them and the unfinished rest (shorter than ``_MAX_LINE``)."""
    pieces: list[bytes] = []
    start = 0
    for match in _LINE_END.finditer(data):
        while match.end() - start > _MAX_LINE:
            pieces.append(data[start : start + _MAX_LINE])
            start += _MAX_LINE
        pieces.append(data[start : match.end()])
        start = match.end()
    while len(data) - start >= _MAX_LINE:
        pieces.append(data[start : start + _MAX_LINE])
        start += _MAX_LINE
    return pieces, data[start:]


def _binary(stream) -> BinaryIO | None:
    if stream is None:
        return None
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextSink(stream)


class _TextSink:
    """Adapter for a text-only stream (e.g. one replaced by a test harness)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, data: bytes) -> None:
        self._stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self._stream.flush()
