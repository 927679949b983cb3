"""The signals that ask ``bpslaunch`` to stop (SIGINT, SIGTERM, SIGHUP), counted instead of acted on.

While :meth:`StopSignals.caught` is active, each of them adds one to a count instead of taking its
default action (KeyboardInterrupt, or death without clean-up), so that the launcher decides what a
signal means where it is: while a run is supervised (:mod:`.supervisor`), between two runs of an
elastic job, while the hosts agree on the next run (:mod:`.elastic`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """``count`` of the stop signals this process got while :meth:`caught` was active; ``first``, the
    number of the first of them (None before one came)."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.count = 0

    def received(self) -> bool:
        """Whether a stop signal has come."""
        return self.first is not None

    def _on_signal(self, signum: int, frame) -> None:
        if self.first is None:
            self.first = signum
        self.count += 1

    @contextlib.contextmanager
    def caught(self) -> Iterator[StopSignals]:
        """Count the stop signals while the block runs, then restore the handlers found. Only the main
        thread can install handlers: from another thread, nothing is installed and nothing counted."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
