"""The decision-log record: round trip, lines of older logs, and the strict and lenient readers."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from dynamix_byteps.control.decision_record import (
    SCHEMA_VERSION,
    DecisionLogError,
    DecisionRecord,
    DecisionRecordError,
    parse_decision_lenient,
    read_decisions,
    read_decisions_lenient,
)

# A line written before the record carried schema_version (a 2-worker cut of a goodput run).
OLDER_LINE = (
    '{"time":1796161695.3631055,"decision":1,"step":20,"policy":"goodput","action":"keep","version":0,'
    '"previous_version":0,"effective_step":10,"batch_sizes_before":[64,64],"batch_sizes":[64,64],"lr_scale":1.0,'
    '"reason":"goodput: global batch 256 → 256, keeping current sizes","predicted_gain":0.0,'
    '"terms":{"noise_scale":18.098882661895843},"clamped_ranks":[],"error":null,'
    '"state":{"workers":{"rank":[0,1],"batch_size":[64,64],"compute_s":[0.1346,0.1516],'
    '"push_pull_s":[0.0329,0.0269],"samples_per_s":[478.75,453.24],"min_batch":[16,16],"max_batch":[512,512]},'
    '"initial_batch_sizes":[64,64],"noise_scale":18.098882661895843,"dataset_size":60000},'
    '"reward":{"throughput_samples_per_s":1411.28,"step_time_s":0.1813,"loss":1.8098,"loss_change":null},'
    '"timing":{"policy_s":0.0054,"decision_s":0.0055}}'
)


def _record(decision: int = 3) -> DecisionRecord:
    return DecisionRecord(
        time=1.5, decision=decision, step=10 * decision, policy="proportional", action="change", version=2,
        previous_version=1, effective_step=12 * decision, batch_sizes_before=[32, 32], batch_sizes=[24, 40],
        lr_scale=1.0, reason="faster rank 1", predicted_gain=0.1, terms={"shares": [0.4, 0.6]}, clamped_ranks=[0],
        error=None, state={"workers": {"rank": [0, 1]}}, reward={"loss": None}, timing={"policy_s": 0.001},
    )


def test_round_trip_keeps_every_field():
    record = _record()
    line = record.to_json()
    assert "\n" not in line
    assert json.loads(line)["schema_version"] == SCHEMA_VERSION
    assert DecisionRecord.from_json(line) == record
    assert DecisionRecord.from_dict(record.to_dict()) == record


def test_a_line_of_an_older_log_reads_as_version_0():
    record = DecisionRecord.from_json(OLDER_LINE)
    assert record.schema_version == 0 and not record.extra
    assert (record.decision, record.step, record.policy, record.batch_sizes) == (1, 20, "goodput", [64, 64])
    assert record.state["workers"]["compute_s"] == [0.1346, 0.1516]
    assert record.reward["step_time_s"] == 0.1813


def test_missing_fields_take_defaults_and_unknown_keys_survive_a_round_trip():
    record = DecisionRecord.from_json('{"step": 4, "from_the_future": {"x": 1}}')
    assert (record.step, record.decision, record.terms, record.batch_sizes) == (4, None, {}, [])
    assert record.extra == {"from_the_future": {"x": 1}}
    assert json.loads(record.to_json())["from_the_future"] == {"x": 1}


@pytest.mark.parametrize("line, why", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"decision": 9}', "field 'step' is missing"),
    ('{"step": "x"}', "field 'step' is 'x', not an integer in [0, 2**62)"),
    ('{"step": 1, "lr_scale": NaN}', "non-finite number NaN"),
    ('{"step": 1, "lr_scale": 1e400}', "non-finite number 1e400"),
])
def test_a_line_that_is_not_a_record_is_refused(line, why):
    with pytest.raises(DecisionRecordError) as error:
        DecisionRecord.from_json(line)
    assert why in str(error.value)


# Lines of the wrong type or out of range in one field, and bytes that are not UTF-8: (line, why).
MALFORMED_LINES = [
    (b'{"time": "zzz", "step": 20, "batch_sizes": [8, 8]}',
     "field 'time' is 'zzz', not a number of seconds since the Unix epoch or null"),
    (b'{"time": 1.5, "step": 7, "batch_sizes": ["a", null]}', "field 'batch_sizes' is ['a', None], not a list of integers"),
    (b'{"time": 1.5, "step": 7, "batch_sizes": [8, 8], "batch_sizes_before": [0, 8]}', "field 'batch_sizes_before' is [0, 8]"),
    (b'{"time": 1.5, "step": 7, "batch_sizes": [8, 8.5]}', "field 'batch_sizes' is [8, 8.5]"),
    (b'{"time": -1, "step": 7, "batch_sizes": [8, 8]}', "field 'time' is -1"),
    (b'{"time": 1.5, "step": 7, "decision": true, "batch_sizes": [8, 8]}', "field 'decision' is True, not an integer"),
    (b'{"time": 1.5, "step": 7, "version": -1, "batch_sizes": [8, 8]}', "field 'version' is -1"),
    (b'{"time": 1.5, "step": 7, "policy": 3, "batch_sizes": [8, 8]}', "field 'policy' is 3, not a string or null"),
    (b'{"time": 1.5, "step": 7, "lr_scale": 0, "batch_sizes": [8, 8]}', "field 'lr_scale' is 0, not a number > 0"),
    (b'{"time": 1.5, "step": 7, "clamped_ranks": [-1], "batch_sizes": [8, 8]}', "field 'clamped_ranks' is [-1]"),
    (b'{"time": 1.5, "step": 7, "terms": [1], "batch_sizes": [8, 8]}', "field 'terms' is [1], not an object"),
    (b'{"time": 1.5, "step": 7, "reward": "x", "batch_sizes": [8, 8]}', "field 'reward' is 'x', not an object"),
    (b'{"time": 1.5, "step": 7, "reward": {"loss": "low"}, "batch_sizes": [8, 8]}', "field 'reward' is {'loss': 'low'}"),
    (b'{"time": 1.5, "step": 7, "timing": {"policy_s": []}, "batch_sizes": [8, 8]}', "field 'timing' is {'policy_s': []}"),
    (b'\xbd\xff{"step": 7}\x00\x9c', "not UTF-8 text (byte 0xbd at offset 0)"),
]


def test_the_schema_covers_every_field():
    from dynamix_byteps.control.decision_record import FIELDS

    assert set(FIELDS) == {f.name for f in dataclasses.fields(DecisionRecord)} - {"extra"}


@pytest.mark.parametrize("line, why", MALFORMED_LINES)
def test_a_field_of_the_wrong_type_or_range_or_bytes_that_are_not_utf8_are_refused(line, why):
    with pytest.raises(DecisionRecordError) as error:
        DecisionRecord.from_json(line)
    assert why in str(error.value)


def _write(path, lines, *, final_newline=True):
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""))
    return path


def test_strict_reader_names_the_malformed_line(tmp_path):
    log = _write(tmp_path / "decisions.jsonl", [OLDER_LINE, _record(2).to_json(), "", '{"step": "x"}'])
    with pytest.raises(DecisionLogError, match=r"decisions.jsonl line 4 is not a decision record \(field 'step' is 'x', "
                                               r"not an integer in \[0, 2\*\*62\)\); see the docs") as error:
        list(read_decisions(log, hint="; see the docs"))
    assert isinstance(error.value, ValueError)


def test_strict_reader_numbers_lines_and_leaves_out_a_torn_last_line(tmp_path):
    lines = [OLDER_LINE, "", _record(2).to_json(), _record(3).to_json()[:30]]
    log = _write(tmp_path / "decisions.jsonl", lines, final_newline=False)
    assert [(n, r.decision) for n, r in read_decisions(log)] == [(1, 1), (3, 2)]
    _write(log, lines)  # the same line complete with its newline is damage, not a crash
    with pytest.raises(DecisionLogError, match="line 4 is not a decision record"):
        list(read_decisions(log))


def test_lenient_reader_skips_malformed_lines_with_a_warning_naming_them(tmp_path, caplog):
    log = _write(tmp_path / "decisions.jsonl", [OLDER_LINE, "{not json", _record(2).to_json(), "5"])
    with caplog.at_level(logging.WARNING):
        records = read_decisions_lenient(log)
    assert [r.decision for r in records] == [1, 2]
    assert "line 2 is not a decision record (invalid JSON" in caplog.text
    assert "line 4 is not a decision record (a JSON int, not an object)" in caplog.text


def _write_bytes(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


@pytest.mark.parametrize("line, why", MALFORMED_LINES)
def test_both_readers_judge_a_malformed_field_or_undecodable_line_as_damage_naming_it(tmp_path, caplog, line, why):
    log = _write_bytes(tmp_path / "decisions.jsonl", [OLDER_LINE.encode(), line, _record(2).to_json().encode()])
    with pytest.raises(DecisionLogError) as error:
        list(read_decisions(log))
    assert f"decisions.jsonl line 2 is not a decision record ({why}" in str(error.value)
    with caplog.at_level(logging.WARNING):
        records = read_decisions_lenient(log)
    assert [r.decision for r in records] == [1, 2]
    assert f"skipping a malformed line in {log}: line 2 is not a decision record ({why}" in caplog.text


def test_a_file_of_random_bytes_is_damage_not_a_decode_error(tmp_path, caplog):
    log = tmp_path / "decisions.jsonl"
    log.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(DecisionLogError, match=r"line 1 is not a decision record \(not UTF-8 text \(byte 0x80"):
        list(read_decisions(log))
    with caplog.at_level(logging.WARNING):
        assert read_decisions_lenient(log) == []
    assert "line 1 is not a decision record (not UTF-8 text" in caplog.text


def test_the_fine_tuners_tail_skips_an_undecodable_line(tmp_path, caplog):
    from dynamix_byteps.policy.ppo.finetune import DecisionTail

    log = _write_bytes(tmp_path / "decisions.jsonl", [_record(1).to_json().encode(), b"\xbd{}", _record(2).to_json().encode()])
    with caplog.at_level(logging.WARNING):
        assert [r.decision for r in DecisionTail(log).read()] == [1, 2]
    assert "line 2 is not a decision record (not UTF-8 text" in caplog.text
    assert parse_decision_lenient(b"\xbd{}", log, 2) is None
