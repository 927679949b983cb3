"""Named cluster scenarios: who is slow, when, and behind which link.

The scenarios live in ``scenarios.toml`` next to this module (or a file of the same schema given
by path); ``benchmarks/time_to_accuracy.py`` turns one into ``bpslaunch --slowdown`` flags and
network namespaces, and the training simulator into per-worker speeds. Windows are fractions of
a run's budget, so one scenario means the same for a 1-minute CI run, a 10-minute benchmark and
a simulated episode.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from dynamix_byteps.env import MAX_WORKERS
from dynamix_byteps.errors import ConfigurationError

__all__ = ["DEFAULT_SCENARIOS", "Link", "Scenario", "Slowdown", "load_scenarios", "scenario"]

#: The scenario file shipped with the package.
DEFAULT_SCENARIOS = Path(__file__).with_name("scenarios.toml")


@dataclass(frozen=True)
class Slowdown:
    """Worker ``rank`` computes ``factor`` times slower during ``[start, end)`` (fractions of the budget)."""

    rank: int
    factor: float
    start: float = 0.0
    end: float = 1.0

    def factor_at(self, fraction: float) -> float:
        """The slowdown factor at ``fraction`` (0–1) of the budget: ``factor`` inside the window, else 1."""
        return self.factor if self.start <= fraction < self.end else 1.0

    def launch_flag(self, budget_s: float) -> str:
        """``bpslaunch --slowdown`` value for a run of ``budget_s`` seconds: ``RANK=FACTOR[@START-END]``."""
        if self.start <= 0.0 and self.end >= 1.0:
            return f"{self.rank}={self.factor:g}"
        return f"{self.rank}={self.factor:g}@{self.start * budget_s:g}-{self.end * budget_s:g}"


@dataclass(frozen=True)
class Link:
    """Worker ``rank`` reaches its peers through a link limited to ``rate_mbit`` Mbit/s."""

    rank: int
    rate_mbit: float


@dataclass(frozen=True)
class Scenario:
    """A named cluster: ``workers`` workers, some slowed down, some behind slow links."""

    name: str
    workers: int
    description: str = ""
    slowdowns: tuple[Slowdown, ...] = ()
    links: tuple[Link, ...] = ()

    def host_layout(self) -> tuple[list[int], dict[int, float]]:
        """Emulated hosts for :class:`dynamix_byteps.testing.netns.Testbed`: ``(slots, rates_mbit)``.

        The ranks without a link share host 0 (the root namespace); each rank behind a link gets
        a host of its own, in rank order, whose link runs at that rate. ``network`` (rank 3 of 4
        behind a link) gives ``([3, 1], {1: rate})``; a scenario without links gives one host.

        Raises:
            ConfigurationError: rank 0 is behind a link, or a rank behind a link is followed by
                one without (bpslaunch numbers ranks in host order, so linked ranks come last).
        """
        rates = {link.rank: link.rate_mbit for link in self.links}
        first = min(rates, default=self.workers)
        if first == 0 or any(rank not in rates for rank in range(first, self.workers)):
            raise ConfigurationError(f"scenario {self.name!r}: the ranks behind links must be the highest ones and "
                                     f"not rank 0 (host 0 holds ranks 0..k-1), got links on {sorted(rates)}")
        slots = [first] + [1] * (self.workers - first)
        return slots, {host: rates[first + host - 1] for host in range(1, len(slots))}

    def speed_factors(self, fraction: float) -> tuple[float, ...]:
        """Per-rank compute slowdown factor (>= 1) at ``fraction`` of the budget."""
        factors = [1.0] * self.workers
        for s in self.slowdowns:
            factors[s.rank] *= s.factor_at(fraction)
        return tuple(factors)


def load_scenarios(path: str | Path | None = None) -> dict[str, Scenario]:
    """Read every scenario of a TOML file (default: :data:`DEFAULT_SCENARIOS`), by name.

    Raises:
        ConfigurationError: the file is missing or not TOML, or a scenario has a bad field
            (the message names the scenario and the field).
    """
    path = Path(path) if path is not None else DEFAULT_SCENARIOS
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigurationError(f"cannot read scenario file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigurationError(f"scenario file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigurationError(f"scenario file {path} is not valid TOML: {error}") from None
    return {name: _parse(name, table) for name, table in raw.items()}


def scenario(name: str, path: str | Path | None = None) -> Scenario:
    """The scenario called ``name``; raises :class:`ConfigurationError` listing the known names."""
    scenarios = load_scenarios(path)
    if name not in scenarios:
        raise ConfigurationError(f"unknown scenario {name!r}; choose one of {', '.join(scenarios)}")
    return scenarios[name]


def _parse(name: str, table) -> Scenario:
    def bad(field: str, why: str) -> ConfigurationError:
        return ConfigurationError(f"scenario {name!r}: {field} {why}")

    if not isinstance(table, dict):
        raise bad("entry", "must be a table")
    unknown = set(table) - {"description", "workers", "slowdown", "links"}
    if unknown:
        raise bad(", ".join(sorted(unknown)), "is not a scenario field (description, workers, slowdown, links)")
    workers = table.get("workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise bad("workers", f"must be an integer in 1..{MAX_WORKERS}, not {workers!r}")

    def fields_of(entry, field: str, allowed: set[str]) -> None:
        unknown = set(entry) - allowed if isinstance(entry, dict) else set()
        if unknown:
            raise bad(field, f"has unknown key(s) {', '.join(sorted(unknown))} (allowed: {', '.join(sorted(allowed))})")

    def rank_of(entry, field: str) -> int:
        rank = entry.get("rank") if isinstance(entry, dict) else None
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < workers:
            raise bad(field, f"needs a rank in 0..{workers - 1}, got {entry!r}")
        return rank

    def number(entry, key: str, field: str, default=None) -> float:
        value = entry.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(field, f"needs a number {key}, got {entry!r}")
        return float(value)

    slowdowns = []
    for entry in table.get("slowdown", []):
        fields_of(entry, "slowdown", {"rank", "factor", "start", "end"})
        s = Slowdown(rank_of(entry, "slowdown"), number(entry, "factor", "slowdown"),
                     number(entry, "start", "slowdown", 0.0), number(entry, "end", "slowdown", 1.0))
        if not 1.0 <= s.factor <= 1000.0 or not 0.0 <= s.start < s.end <= 1.0:
            raise bad("slowdown", f"needs 1 <= factor <= 1000 and 0 <= start < end <= 1, got {entry!r}")
        if any(other.rank == s.rank for other in slowdowns):
            raise bad("slowdown", f"has rank {s.rank} twice; one slowdown (and window) per rank")
        slowdowns.append(s)
    links = []
    for entry in table.get("links", []):
        fields_of(entry, "links", {"rank", "rate_mbit"})
        link = Link(rank_of(entry, "links"), number(entry, "rate_mbit", "links"))
        if link.rate_mbit <= 0:
            raise bad("links", f"needs rate_mbit > 0, got {entry!r}")
        if any(other.rank == link.rank for other in links):
            raise bad("links", f"has rank {link.rank} twice; one link per rank")
        links.append(link)
    return Scenario(name, workers, str(table.get("description", "")), tuple(slowdowns), tuple(links))
