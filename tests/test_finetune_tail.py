"""The fine-tuning trainer's reader of the decision log keeps only decision records."""

import json

from dynamix_byteps.policy.ppo.finetune import DecisionTail


def test_lines_that_are_not_decision_records_are_skipped(tmp_path, caplog):
    log = tmp_path / "decisions.jsonl"
    good = [{"decision": d, "step": 2 * d, "reward": {"loss": 1.0}} for d in (1, 2)]
    log.write_text("\n".join([json.dumps(good[0]), "5", "[1, 2]", '{"decision": 9}', '{"step": "x"}',
                              "{not json", json.dumps(good[1]), '{"step": 3']))
    tail = DecisionTail(log)
    assert tail.read() == good  # the partial last line waits; the others would crash the trainer's step
    assert caplog.text.count("skipping a malformed line") == 5
