"""A TCP proxy that adds a fixed one-way delay: added latency for the test bed without netem.

Every chunk read from one side is written to the other ``delay_s`` seconds after it arrived
(in order, both directions), so a round trip through the proxy takes ``2 * delay_s`` longer than
a direct one. Half-closes are forwarded after the same delay; a reset or error on one side
closes both. Bandwidth is not limited (see ``Testbed``'s tbf for that); at most
``QUEUE_CHUNKS`` chunks of ``CHUNK_BYTES`` wait per direction, then reading pauses.

In front of the scheduler of a test-bed job (its workers and agents dial ``H0:P``; the scheduler
listens on loopback with ``--bind 127.0.0.1``)::

    proxy = start(bed, 0, listen=(bed.hosts[0].address, P), target=("127.0.0.1", P), delay_s=0.05)
    run_job(bed, slots, command, ["--policy", "static", "--scheduler-port", str(P), "--bind", "127.0.0.1"])

In-process (a context manager; ``proxy.address`` is where it listens)::

    with DelayProxy(("127.0.0.1", 8000), delay_s=0.02) as proxy: ...

As a program: ``python -m dynamix_byteps.testing.delay_proxy --listen H:P --target H:P --delay-ms D``
prints ``listening H:P`` once it accepts connections and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
from typing import Self

from dynamix_byteps.argtypes import float_in

__all__ = ["CHUNK_BYTES", "QUEUE_CHUNKS", "DelayProxy", "main", "start"]

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 256  # per direction: at most 16 MiB in flight inside the proxy
START_TIMEOUT_S = 30.0


async def _together(*coroutines) -> None:
    """Run ``coroutines`` concurrently until all end; the first to raise cancels the others, then re-raises."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it was read; EOF is forwarded too."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def receive() -> None:
        while data := await reader.read(CHUNK_BYTES):
            await queue.put((loop.time() + delay_s, data))
        await queue.put((loop.time() + delay_s, b""))

    async def send() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await _together(receive(), send())


async def _serve_one(target: tuple[str, int], delay_s: float, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(*target)
    except OSError:
        client_writer.close()
        return
    try:
        await _together(_forward(client_reader, server_writer, delay_s), _forward(server_reader, client_writer, delay_s))
    except (OSError, asyncio.CancelledError):
        pass  # a reset on one side closes both; so does close() (asyncio's stream callback dislikes a cancelled task)
    finally:
        for writer in (client_writer, server_writer):
            writer.close()


class DelayProxy:
    """Forwards TCP connections from ``listen`` to ``target`` with ``delay_s`` added each way.

    Runs an asyncio loop on a daemon thread between ``__enter__`` and :meth:`close`.

    Args:
        target: ``(host, port)`` every accepted connection is forwarded to.
        delay_s: added one-way delay, seconds (>= 0).
        listen: ``(host, port)`` to accept on; port 0 picks a free one (see :attr:`address`).

    Raises:
        ValueError: a negative ``delay_s``.
        OSError: on entry, when ``listen`` cannot be bound.
    """

    def __init__(self, target: tuple[str, int], delay_s: float, listen: tuple[str, int] = ("127.0.0.1", 0)):
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0 seconds, not {delay_s}")
        self.target, self.delay_s, self.listen = target, delay_s, listen
        self.address: tuple[str, int] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Self:
        self._server = self._loop.run_until_complete(asyncio.start_server(
            lambda r, w: _serve_one(self.target, self.delay_s, r, w), *self.listen, reuse_address=True))
        self.address = self._server.sockets[0].getsockname()[:2]
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, drop open connections, stop the thread. Safe to call twice."""
        if self._thread is None:
            return

        async def shutdown() -> None:
            self._server.close()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None
        self._loop.close()


def start(bed, host: int, listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> subprocess.Popen:
    """Run the proxy program on test-bed host ``host`` (``bed.popen``); returns once it listens.

    Stop it with :func:`~.netns.stop`; ``bed.close()`` stops it too.

    Raises:
        TestbedError: it exited or did not listen within ``START_TIMEOUT_S`` (its output is in the message).
    """
    from dynamix_byteps.testing.netns import TestbedError, stop

    proc = bed.popen(host, [sys.executable, "-m", "dynamix_byteps.testing.delay_proxy", "--listen",
                            f"{listen[0]}:{listen[1]}", "--target", f"{target[0]}:{target[1]}",
                            "--delay-ms", repr(delay_s * 1000)],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(START_TIMEOUT_S, stop, args=(proc, 1.0))
    timer.start()
    try:
        line = proc.stdout.readline()
    finally:
        timer.cancel()
    if not line.startswith("listening "):
        stop(proc, 1.0)
        raise TestbedError(f"delay proxy on host {host} did not start: {line}{proc.stdout.read()}")
    return proc


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamix_byteps.testing.delay_proxy",
                                     description="Forward TCP from --listen to --target, adding --delay-ms each way.")
    parser.add_argument("--listen", type=_address, required=True, metavar="HOST:PORT", help="accept here (port 0: any)")
    parser.add_argument("--target", type=_address, required=True, metavar="HOST:PORT", help="forward to here")
    parser.add_argument("--delay-ms", type=float_in(0.0, 60_000.0, unit=" ms"), required=True, metavar="MS",
                        help="added one-way delay in milliseconds, 0..60000")
    args = parser.parse_args(argv)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        proxy = DelayProxy(args.target, args.delay_ms / 1000, args.listen).__enter__()
    except OSError as error:
        print(f"cannot listen on {args.listen[0]}:{args.listen[1]}: {error.strerror}", file=sys.stderr)
        return 1
    with contextlib.closing(proxy):
        print(f"listening {proxy.address[0]}:{proxy.address[1]}", flush=True)
        stopped.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
