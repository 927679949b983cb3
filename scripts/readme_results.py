"""Render the results tables of README.md and docs/*.md from the JSON in benchmarks/results/.

A generated table sits between two marker comments; everything between them is replaced:

    <!-- results: KIND FILE -->
    ...table...
    <!-- /results -->

``FILE`` is a file of ``benchmarks/results/`` and ``KIND`` the benchmark that wrote it:

* ``time_to_accuracy``: ``benchmarks/time_to_accuracy.py``'s own table (every target with its
  median and 90% interval, accuracy at the budget, AUC, the verdicts against the best static batch
  and the best heuristic, loaded runs); for a report of the benchmark's first schema, one row per
  configuration with the median time to its one target and every run's time, the ratio to the
  fastest median with a 90% bootstrap interval and its verdict (``tie`` while the interval holds 1;
  a configuration measured once gets no verdict), accuracy at the budget, samples/s, straggler
  efficiency and mean global batch;
* ``ddp_comparison``: ``benchmarks/ddp_comparison.py``'s markdown table of the file's runs;
* ``ps_engine``: ``benchmarks/ps_engine.py``'s markdown table;
* ``critical_batch``: ``benchmarks/critical_batch.py``'s table (samples to each target per global
  batch, their ratios to the reference batch beside the simulator's, the fitted critical batch);
* ``sim_calibration``: ``benchmarks/sim_calibration.py``'s table (samples to each training loss per
  global batch, recorded and simulated, as ratios to the reference batch);
* ``slow_link_sweep``: ``benchmarks/slow_link_sweep.py``'s table (step times per link rate, the ratio
  with its interval and verdict, the slow-link worker's batch and times, the link and CPU floors);
* ``policy_headroom``: ``benchmarks/policy_headroom.py``'s table (per profile, every policy's and
  the best schedules' seconds to the target, and the headroom);
* ``sim_scaling``: ``benchmarks/sim_scaling.py``'s cells (``table``) as policy x worker count:
  simulated seconds to the target loss and final accuracy proxy, in bold where the report marks a
  cell best (fastest, or within its ``tie`` of the fastest, among the policies within its
  ``accuracy_tolerance`` of the best accuracy); the static batches collapse into one row, the
  fastest static size per worker count.

    python scripts/readme_results.py            # rewrite the generated tables in place
    python scripts/readme_results.py --check    # exit 1 naming every file whose tables are stale

An unknown ``KIND``, a missing ``FILE`` or a marker without its end is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import critical_batch
import ddp_comparison
import policy_headroom
import ps_engine
import sim_calibration
import slow_link_sweep
import time_to_accuracy as time_to_accuracy_benchmark
from common import RESULTS, bootstrap_medians, interval90, markdown_table, verdict

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- results: *(\S+) +(\S+) *-->\n)(.*?)(<!-- /results -->)", re.S)
OPENING = re.compile(r"<!-- results:")


class RenderError(ValueError):
    """A marker names an unknown kind or a missing file, or has no end marker."""


def _seconds(value: float | None) -> float:
    return math.inf if value is None else value


def _ratio_interval(times: list[float], fastest: list[float]) -> list[float]:
    """90% interval of median(``times``) / median(``fastest``), the two resampled independently
    (runs of different configurations need not share seeds); ``inf``: a target never reached."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = bootstrap_medians(times, seed=1) / bootstrap_medians(fastest, seed=2)
    return interval90(np.where(np.isnan(ratios), 1.0, ratios), method="inverted_cdf")


def time_to_accuracy(report: dict) -> str:
    """The time-to-accuracy table of a ``benchmarks/time_to_accuracy.py`` report: the benchmark's own
    table for its current schema, else :func:`time_to_accuracy_schema1`."""
    if report.get("schema") == time_to_accuracy_benchmark.SCHEMA:
        return markdown_table(*time_to_accuracy_benchmark.tables(report, report["targets"]))
    return time_to_accuracy_schema1(report)


def time_to_accuracy_schema1(report: dict) -> str:
    """The table of a report the benchmark wrote before it kept every run (one target, ``rows`` with
    each configuration's per-run times): they cannot be converted, only shown as measured."""
    target = report["target_accuracy"]
    runs = {row["config"]: [_seconds(t) for t in row.get("time_to_target_runs_s", [row["time_to_target_s"]])]
            for row in report["rows"]}
    fastest = min(runs, key=lambda name: np.median(runs[name]))
    lines = []
    for row in report["rows"]:
        times = runs[row["config"]]
        median = float(np.median(times))
        spread = "" if len(times) == 1 else " (" + ", ".join("–" if t == math.inf else f"{t:.1f}" for t in times) + ")"
        cells = [row["config"], str(len(times)), ("–" if median == math.inf else f"{median:.1f} s") + spread]
        if row["config"] == fastest:
            cells += ["1.00", "reference"]
        elif median == math.inf:
            cells += ["–", "never reached"]
        else:
            low, high = _ratio_interval(times, runs[fastest])
            cells += [f"{median / np.median(runs[fastest]):.2f} [{low:.2f}, {high:.2f}]",
                      verdict([low, high]) if len(times) > 1 else "one run"]
        cells += [f"{row['accuracy_at_budget']:.3f}", f"{row['samples_per_s']:.0f}", f"{row['straggler_efficiency']:.2f}",
                  f"{row['mean_global_batch']:.0f}"]
        lines.append(cells)
    header = ["configuration", "runs", f"time to {target:.0%}: median (each run)", "ratio to fastest [90%]", "verdict",
              f"accuracy at {report['budget_s']:g} s", "samples/s", "straggler efficiency", "mean global batch"]
    return markdown_table(header, lines)


def ddp(report: dict) -> str:
    return ddp_comparison.markdown([row for run in report["runs"] for row in ddp_comparison.summarise(run)])


def sim_scaling(report: dict) -> str:
    """The policy x worker-count table of a ``benchmarks/sim_scaling.py`` report (``table``)."""
    workers = report["workers"]
    cells = {(c["policy"], c["workers"]): c for c in report["table"]}
    statics = sorted({c["policy"] for c in report["table"] if c["policy"].startswith("static")})
    policies = [name for name in dict.fromkeys(c["policy"] for c in report["table"]) if name not in statics]

    def text(cell: dict, suffix: str = "") -> str:
        seconds = "–" if cell["time_to_target_s"] is None else f"{cell['time_to_target_s']:.0f} s"
        return (f"**{seconds}**" if cell["best"] else seconds) + f", {100 * cell['accuracy']:.1f}%" + suffix

    lines = [[name] + [text(cells[name, n]) for n in workers] for name in policies]
    if statics:
        best = {n: min((cells[s, n] for s in statics), key=lambda c: _seconds(c["time_to_target_s"])) for n in workers}
        lines.append(["best static (b)"] + [text(best[n], f" ({best[n]['policy'].removeprefix('static')})")
                                            for n in workers])
    return markdown_table(["policy", *(f"N={n}" for n in workers)], lines)


RENDERERS = {"time_to_accuracy": time_to_accuracy, "ddp_comparison": ddp, "ps_engine": ps_engine.markdown,
             "sim_scaling": sim_scaling, "slow_link_sweep": slow_link_sweep.markdown,
             "critical_batch": critical_batch.markdown, "sim_calibration": sim_calibration.markdown,
             "policy_headroom": policy_headroom.markdown}


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every generated block rendered anew from ``results``; raises RenderError."""
    if len(OPENING.findall(text)) != len(BLOCK.findall(text)):
        raise RenderError("a '<!-- results: KIND FILE -->' marker has no '<!-- /results -->' after it")

    def block(match: re.Match) -> str:
        kind, name = match.group(2), match.group(3)
        if kind not in RENDERERS:
            raise RenderError(f"unknown results kind {kind!r}; known: {', '.join(RENDERERS)}")
        path = results / name
        if not path.is_file():
            raise RenderError(f"{path} does not exist (marker '{kind} {name}')")
        return match.group(1) + RENDERERS[kind](json.loads(path.read_text())) + "\n" + match.group(5)

    return BLOCK.sub(block, text)


def stale(pages: list[Path] = PAGES, results: Path = RESULTS) -> list[Path]:
    """The pages whose generated blocks differ from what ``results`` renders."""
    return [page for page in pages if render(page.read_text(), results) != page.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page's tables are stale")
    args = parser.parse_args(argv)
    try:
        if args.check:
            old = stale()
            for page in old:
                print(f"{page.relative_to(REPO)}: generated results are stale; run python scripts/readme_results.py")
            return 1 if old else 0
        for page in PAGES:
            text = page.read_text()
            new = render(text)
            if new != text:
                page.write_text(new)
                print(f"updated {page.relative_to(REPO)}")
    except RenderError as error:
        print(f"readme_results: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
