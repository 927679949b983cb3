"""What every benchmark script shares: the machine it ran on, the ns/call table, the JSON file."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """Where the figures come from: CPUs, load, Python and platform."""
    return {"cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
            "python": sys.version.split()[0], "platform": platform.platform()}


def print_ns_table(results: list[dict]) -> None:
    """Rows with ``case``, ``ns_per_call_median`` and ``ns_per_call_min``."""
    width = max(len(r["case"]) for r in results)
    print(f"{'case':<{width}}  {'median ns/call':>14}  {'min ns/call':>11}")
    for r in results:
        print(f"{r['case']:<{width}}  {r['ns_per_call_median']:>14.1f}  {r['ns_per_call_min']:>11.1f}")


def write_report(out: Path, report: dict) -> None:
    """Write ``report`` plus :func:`machine` as indented JSON to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**report, "machine": machine()}, indent=2) + "\n")
    print(f"wrote {out}")
