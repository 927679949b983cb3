"""One line of the scheduler's decision log (``decisions.jsonl``): its schema and its readers.

The scheduler writes one :class:`DecisionRecord` per decision, "keep" included, as one JSON
object per line. ``dynamix sim fit`` reads a finished log with :func:`read_decisions` (strict:
a damaged line is an error naming the line); the PPO fine-tuner follows a growing log with
:func:`parse_decision_lenient` (a damaged line is skipped with a warning naming it).

Versions of the schema (``schema_version``):

* 0: lines written before the field existed; any of the fields below may be missing and take
  their defaults.
* 1: every field present.

Lines of either version read alike; keys this version does not know are kept in ``extra`` and
written back, so a newer line survives a round trip through an older reader. A known field of the
wrong type or out of its range (:data:`FIELDS`), and a line that is not UTF-8, make the line
damaged, whichever reader reads it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamix_byteps.env import MAX_BATCH
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.regular_files import read_regular

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class DecisionRecordError(ValueError):
    """A line that is not a decision record; the message says why, without the line number."""


class DecisionLogError(ConfigurationError):
    """A damaged line in a decision log read strictly; the message names the file and the line."""


@dataclass(frozen=True, kw_only=True)
class DecisionRecord:
    """One decision of the scheduler.

    ``state`` (the cluster state the policy saw; ``state["workers"]`` is columnar: one list per
    field, index = rank), ``reward`` (``throughput_samples_per_s``, ``step_time_s``, ``loss``,
    ``loss_change``), ``terms`` (the policy's own numbers) and ``timing`` (``policy_s``,
    ``decision_s``) stay JSON objects: their content is the policy's and the cluster state's,
    and grows with them. A number that JSON cannot hold (NaN, ±inf) is written as null.
    """

    schema_version: int = SCHEMA_VERSION
    time: float | None = None
    decision: int | None = None
    step: int
    policy: str | None = None
    action: str | None = None
    version: int | None = None
    previous_version: int | None = None
    effective_step: int | None = None
    batch_sizes_before: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    lr_scale: float | None = None
    reason: str | None = None
    predicted_gain: float | None = None
    terms: dict = field(default_factory=dict)
    clamped_ranks: list[int] = field(default_factory=list)
    error: str | None = None
    state: dict = field(default_factory=dict)
    reward: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the line: the fields in declaration order, then ``extra``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        """One line of JSON, without the newline.

        Raises:
            ValueError: a NaN or infinite float; TypeError: a value JSON cannot hold.
        """
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> DecisionRecord:
        """A record from a decoded JSON line; a line without ``schema_version`` is version 0.

        Raises:
            DecisionRecordError: not an object, ``step`` missing, or a field of :data:`FIELDS`
                of the wrong type or out of its range (the message names the field).
        """
        if not isinstance(data, dict):
            raise DecisionRecordError(f"a JSON {type(data).__name__}, not an object")
        if "step" not in data:
            raise DecisionRecordError("field 'step' is missing")
        for name, (valid, expected) in FIELDS.items():
            if name in data and not valid(data[name]):
                raise DecisionRecordError(f"field {name!r} is {reprlib.repr(data[name])}, not {expected}")
        values = {k: v for k, v in data.items() if k in FIELDS}
        values.setdefault("schema_version", 0)
        return cls(**values, extra={k: v for k, v in data.items() if k not in FIELDS})

    @classmethod
    def from_json(cls, line: str | bytes) -> DecisionRecord:
        """A record from one line of the log.

        Raises:
            DecisionRecordError: bytes that are not UTF-8, invalid JSON, a non-finite
                number (NaN, Infinity, 1e400), or what :meth:`from_dict` refuses.
        """
        if isinstance(line, bytes):
            try:
                line = line.decode()
            except UnicodeDecodeError as error:
                raise DecisionRecordError(f"not UTF-8 text (byte {error.object[error.start]:#04x} at "
                                          f"offset {error.start})") from None
        try:
            data = json.loads(line, parse_constant=_refuse_non_finite, parse_float=_finite_float)
        except json.JSONDecodeError as error:
            raise DecisionRecordError(f"invalid JSON: {error.msg}") from None
        except RecursionError:
            raise DecisionRecordError("invalid JSON: nested too deeply") from None
        return cls.from_dict(data)


def _integer(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _number(low: float = -math.inf, *, above: bool = False) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      and (v > low if above else v >= low))


def _optional(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or valid(v)


def _list_of(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(valid(x) for x in v)


def _object_with(numbers: tuple[str, ...] = ()) -> Callable[[Any], bool]:
    """A JSON object whose members ``numbers``, where present, are finite numbers or null."""
    number = _optional(_number())
    return lambda v: isinstance(v, dict) and all(number(v[k]) for k in numbers if k in v)


_COUNT = _integer(0, 2**62 - 1)  # steps, decision indices, assignment versions
_TEXT = _optional(lambda v: isinstance(v, str))

#: Each known field of a line: (the test its value passes, what the test asks for, for messages).
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "schema_version": (_COUNT, "an integer >= 0"),
    "time": (_optional(_number(0)), "a number of seconds since the Unix epoch or null"),
    "decision": (_optional(_COUNT), "an integer >= 0 or null"),
    "step": (_COUNT, "an integer in [0, 2**62)"),
    "policy": (_TEXT, "a string or null"),
    "action": (_TEXT, "a string or null"),
    "version": (_optional(_COUNT), "an integer >= 0 or null"),
    "previous_version": (_optional(_COUNT), "an integer >= 0 or null"),
    "effective_step": (_optional(_COUNT), "an integer >= 0 or null"),
    "batch_sizes_before": (_list_of(_integer(1, MAX_BATCH)), f"a list of integers in [1, {MAX_BATCH}]"),
    "batch_sizes": (_list_of(_integer(1, MAX_BATCH)), f"a list of integers in [1, {MAX_BATCH}]"),
    "lr_scale": (_optional(_number(0, above=True)), "a number > 0 or null"),
    "reason": (_TEXT, "a string or null"),
    "predicted_gain": (_optional(_number()), "a number or null"),
    "terms": (_object_with(), "an object"),
    "clamped_ranks": (_list_of(_COUNT), "a list of integers >= 0"),
    "error": (_TEXT, "a string or null"),
    "state": (_object_with(), "an object"),
    "reward": (_object_with(("throughput_samples_per_s", "step_time_s", "loss", "loss_change")),
               "an object whose throughput_samples_per_s, step_time_s, loss and loss_change are numbers or null"),
    "timing": (_object_with(("policy_s", "decision_s")), "an object whose policy_s and decision_s are numbers or null"),
}


def _refuse_non_finite(name: str):
    raise DecisionRecordError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DecisionRecordError(f"non-finite number {text}")
    return value


def read_decisions(path: str | Path, *, hint: str = "") -> Iterator[tuple[int, DecisionRecord]]:
    """``(line number, record)`` for each line of a decision log, strictly: a line that is not a
    decision record raises. Blank lines are passed over, and so is a last line without its
    newline that is not valid JSON: the line a writer killed mid-write left (bytes that are not
    UTF-8 are damage wherever they are: the scheduler writes ASCII).

    Raises:
        OSError: the file cannot be read.
        DecisionLogError: "``path`` line N is not a decision record (why)", then ``hint``.
    """
    path = Path(path)
    data = read_regular(path)
    lines = data.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, DecisionRecord.from_json(line)
        except DecisionRecordError as error:
            if number == len(lines) and not data.endswith(b"\n") and str(error).startswith("invalid JSON"):
                return
            raise DecisionLogError(f"{path} line {number} is not a decision record ({error}){hint}") from None


def parse_decision_lenient(line: str | bytes, path: str | Path, number: int) -> DecisionRecord | None:
    """The record of line ``number`` of ``path``, or None after a warning naming the line."""
    try:
        return DecisionRecord.from_json(line)
    except DecisionRecordError as error:
        log.warning("skipping a malformed line in %s: line %d is not a decision record (%s)", path, number, error)
        return None


def read_decisions_lenient(path: str | Path) -> list[DecisionRecord]:
    """Every decision record of a log; lines that are not are skipped with a warning naming them.

    Raises:
        OSError: the file cannot be read.
    """
    lines = read_regular(path).splitlines()
    records = (parse_decision_lenient(line, path, n) for n, line in enumerate(lines, 1) if line.strip())
    return [r for r in records if r is not None]


def newest_at_each_step(items: list, step: Callable[[Any], int] = operator.attrgetter("step")) -> list:
    """``items`` (in the order they were written) without those that a later item at the same or
    an earlier ``step`` supersedes, so that the steps increase: a run restarted from a checkpoint,
    or a run dir that holds an earlier run too, goes back to earlier steps (TensorBoard purges the
    events such a restart orphaned the same way)."""
    kept = []
    for item in items:
        while kept and step(kept[-1]) >= step(item):
            kept.pop()
        kept.append(item)
    return kept

