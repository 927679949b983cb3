"""argparse ``type=`` converters for numbers in a range and output paths, shared by ``bpslaunch`` and ``dynamix``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


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


def output_path(kind: str, example: str = "out"):
    """Parse a path the command will write: ``kind`` ``"file"`` or ``"dir"`` (created with its parents);
    ``example`` is the file name the message suggests for a file path that is a directory.

    Refused at parse time, so that the command exits 2 naming the flag before it starts anything:
    a file path that is an existing directory, a directory path that is an existing non-directory,
    and a path under an existing non-directory (``x.json/out``), which would only fail later with
    a bare ``OSError`` naming no flag."""
    if kind not in ("file", "dir"):
        raise ValueError(f"output_path kind must be 'file' or 'dir', not {kind!r}")

    def parse(text: str) -> Path:
        path = Path(text)
        if kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a directory; give the path of a file in it, e.g. {path / example}")
        if kind == "dir" and path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file; give a directory (it is created if missing)")
        for parent in path.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a directory; give a path "
                                                     "under a directory")
                break
        return path
    return parse
