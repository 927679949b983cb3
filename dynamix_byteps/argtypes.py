"""argparse ``type=`` converters for numbers in a range, addresses and output paths, shared by ``bpslaunch``
and ``dynamix``, and the address rule the workers apply to ``DYNAMIX_SCHEDULER``."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
MAX_PORT = 65535
ADDRESS_FORM = ("HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:50051 or [::1]:50051, or a gRPC target "
                "dns:///HOST:PORT, ipv4:IP:PORT or ipv6:[IP]:PORT")
GRPC_SCHEMES = ("dns", "ipv4", "ipv6")  # the schemes of a gRPC target that dials TCP
TCP_LESS_SCHEMES = ("unix", "unix-abstract", "vsock")


def int_in(low: int, high: int | None = None, what: str = "value"):
    """Parse an integer in ``[low, high]`` (``high`` None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{what} {value} must be {bound}")
        return value
    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False, unit: str = ""):
    """Parse a finite number ``>= low`` (``> low`` when ``low_open``) and ``<= high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {bound}{unit}")
        return value
    return parse


def argument_type(check: Callable[[str], T]) -> Callable[[str], T]:
    """``check`` as an argparse ``type=``: its ``ValueError`` becomes the argument's error message
    (argparse itself would print only ``invalid check value``)."""
    def parse(text: str) -> T:
        try:
            return check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse


def dial_address(text: str) -> str:
    """``text`` when it is an address a client can connect to: ``HOST:PORT`` (``HOST`` a name, an IPv4
    address, or an IPv6 address in brackets: ``[::1]:50051``; ``PORT`` in 1..65535), or a gRPC target
    of one such address: ``dns:///HOST:PORT`` (``dns://DNS_SERVER:PORT/HOST:PORT`` to ask that server),
    ``ipv4:IP:PORT`` or ``ipv6:[IP]:PORT``.

    Raises:
        ValueError: any other text (``unix:`` targets too: the scheduler listens on TCP only); the
            message quotes it and gives the valid forms.
    """
    why = _target_problem(text)
    if why is not None:
        raise ValueError(f"{text!r} is not {ADDRESS_FORM} ({why})")
    return text


def dial_host(address: str) -> str:
    """The host of an address :func:`dial_address` accepts, as a TLS certificate of the server must
    name it: ``ps0`` for ``dns:///ps0:50051``, ``::1`` for ``[::1]:50051``."""
    return _split_target(address)[2].rpartition(":")[0].strip("[]")


def _split_target(text: str) -> tuple[str, str, str]:
    """``(scheme, dns_server, host_port)`` of ``text``: its gRPC scheme in lower case (``""`` for
    none), the DNS server of ``dns://DNS_SERVER/`` (``""`` for none) and the rest."""
    scheme, sep, rest = text.partition(":")
    if not sep or scheme.lower() not in GRPC_SCHEMES + TCP_LESS_SCHEMES:
        return "", "", text
    server = ""
    if scheme.lower() == "dns" and rest.startswith("//"):
        server, _, rest = rest[2:].partition("/")
    return scheme.lower(), server, rest


def _target_problem(text: str) -> str | None:
    """Why ``text`` is not an address :func:`dial_address` accepts; None when it is."""
    scheme, server, host_port = _split_target(text)
    host = host_port.rpartition(":")[0]
    if scheme in TCP_LESS_SCHEMES:
        return f"a {scheme}: target; the scheduler listens on TCP only"
    if server and (why := _host_port_problem(server)):
        return f"the DNS server {server!r}: {why}"
    if scheme in ("ipv4", "ipv6") and "," in host_port:
        return f"{scheme}: lists several addresses; give the scheduler's one"
    if why := _host_port_problem(host_port):
        return why
    if scheme == "ipv4" and ip_version(host) != 4:
        return f"{host!r} is not an IPv4 address"
    if scheme == "ipv6" and not host.startswith("["):
        return f"{host!r} is not an IPv6 address in brackets"
    return None


def _host_port_problem(text: str) -> str | None:
    """Why ``text`` is not ``HOST:PORT`` (a host name, an IPv4 address or ``[IPv6]``); None when it is."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        return "no :PORT at its end"
    if not 1 <= int(port) <= MAX_PORT:
        return f"port {int(port)} is outside 1..{MAX_PORT}"
    if not host:
        return "no host before the port"
    return host_problem(host)


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a host name, an IPv4 address or an IPv6 address in brackets (``[::1]``); None when
    it is."""
    if host.startswith("[") and host.endswith("]"):
        return None if ip_version(host[1:-1]) == 6 else f"{host} is not an IPv6 address in brackets"
    if ip_version(host) == 6:
        return "an IPv6 address goes in brackets"
    if not is_host_name(host):
        return f"{host!r} is not a host name"
    return None


def is_host_name(text: str) -> bool:
    """Whether ``text`` may be a host name or an IPv4 address: not empty, and nothing a URL's host cannot hold
    (a resolver refuses the rest)."""
    return bool(text) and not any(c.isspace() or c in ":[]/@?#" for c in text)


def ip_version(text: str) -> int | None:
    """4 or 6 when ``text`` is an IPv4 or IPv6 address (``fe80::1%eth0`` too), else None."""
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None


def url_host(host: str) -> str:
    """``host`` as the host of a URL (``tcp://HOST:PORT``) writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ip_version(host) == 6 else host


host_port = argument_type(dial_address)


def key_value(text: str) -> tuple[str, object]:
    """Parse ``KEY=VALUE`` (``KEY`` an identifier); VALUE becomes a bool (``true``/``false``, any
    case), an int or a float where it reads as one, else stays text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for convert in (int, float):
        try:
            return key, convert(raw)
        except ValueError:
            pass
    return key, raw


def output_path(kind: str, example: str = "out", *, appends: tuple[str, ...] = ()):
    """Parse a path the command will write: ``kind`` ``"file"`` or ``"dir"`` (created with its parents);
    ``example`` is the file name the message suggests for a file path that is a directory; ``appends``
    (``"dir"`` only) the entries in the directory that the command only appends to or writes in
    when they exist (e.g. ``decisions.jsonl``; a directory's name ends in ``/``), so that it needs to
    create nothing there. An entry, or a folder on its way, that exists as the other kind (a folder
    where the command appends to a file, a file where it writes in a folder) or cannot be written is
    refused naming it.

    A symlink is followed, as ``open`` and :func:`~dynamix_byteps.atomic.atomic_write` follow it: the
    checks apply to where it leads. Refused at parse time, so that the command exits 2 naming the
    flag before it starts anything: a file path that is an existing directory, a directory path that
    is an existing non-directory, a path under an existing non-directory (``x.json/out``), and a
    path whose nearest existing directory nothing can be created in (not writable, read-only,
    ``/proc``), which would only fail later with a bare ``OSError`` naming no flag, unless it is the
    directory itself and every entry of ``appends`` in it exists and is writable. To tell whether
    something can be created, the parse creates and removes an empty directory ``.dynamix-probe-*``
    there."""
    if kind not in ("file", "dir"):
        raise ValueError(f"output_path kind must be 'file' or 'dir', not {kind!r}")

    def parse(text: str) -> Path:
        path = Path(text)
        target = Path(os.path.realpath(path))
        shown = text if target == Path(os.path.abspath(path)) else f"{text} (which leads to {target})"
        if kind == "file" and target.is_dir():
            raise argparse.ArgumentTypeError(f"{shown} is a directory; give the path of a file in it, e.g. {path / example}")
        if kind == "dir" and target.exists() and not target.is_dir():
            raise argparse.ArgumentTypeError(f"{shown} is a file; give a directory (it is created if missing)")
        folder = _nearest_existing(target if kind == "dir" else target.parent)
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{shown}: {folder} is a file, not a directory; give a path under a directory")
        if folder == target:
            for entry in appends:
                if problem := run_dir_entry_problem(target, entry):
                    raise argparse.ArgumentTypeError(f"{shown}: {problem}")
        if not (folder == target and appends and all(os.access(target / entry, os.W_OK) for entry in appends)):
            _probe_creating(shown, folder)
        return path
    return parse


def run_dir_entry_problem(directory: Path, entry: str) -> str | None:
    """Why the command cannot append to or write in ``directory/entry`` (a directory's ``entry`` ends
    in ``/``; ``"tensorboard/scheduler/"``), or None: the entry or a folder on its way exists as the
    other kind, or the entry (or the folder it would be created in, below ``directory``) cannot be
    written. ``directory`` itself is the caller's to check."""
    parts = Path(entry).parts
    path = directory
    for depth, part in enumerate(parts, 1):
        if not (path / part).exists():
            return _not_writable(path) if depth > 1 else None
        path = path / part
        wants_folder = depth < len(parts) or entry.endswith("/")
        if path.is_dir() != wants_folder:
            what = ("a file, where the command writes in a folder" if wants_folder else
                    "a directory, where the command appends to a file")
            return f"{path} is {what}; move it away or give another directory"
    return _not_writable(path)


def _not_writable(path: Path) -> str | None:
    return None if os.access(path, os.W_OK) else f"{path} is not writable; make it writable or give another directory"


def _probe_creating(shown: str, folder: Path) -> None:
    """Create and remove an empty directory in ``folder``; ArgumentTypeError naming ``shown`` when either fails."""
    try:
        probe = tempfile.mkdtemp(prefix=".dynamix-probe-", dir=folder)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{shown}: cannot create anything in {folder} ({error.strerror}); "
                                         "give a path in a directory you can write") from None
    try:
        os.rmdir(probe)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{shown}: the empty directory {probe} that this check created cannot be "
                                         f"removed ({error.strerror}); remove it and run again") from None


def _nearest_existing(path: Path) -> Path:
    """``path`` (made absolute) or its closest ancestor that exists."""
    path = path.absolute()
    return next(p for p in (path, *path.parents) if p.exists())
