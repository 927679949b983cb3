"""argparse ``type=`` converters for numbers in a range, shared by ``bpslaunch`` and ``dynamix``."""

from __future__ import annotations

import argparse
import math


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
