"""Damaged policy directories and checkpoints, as a user's disk or hand edit leaves them: each is
refused with an error naming the file, never a traceback (``dynamix policy eval | export``,
``--policy-path``, the library listing)."""

import json
import shutil

import pytest

from dynamix_byteps.cli import main
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import make_policy
from dynamix_byteps.policy.ppo import library
from dynamix_byteps.policy.ppo.mdp import RewardWeights

pytest.importorskip("onnxruntime")

NOT_UTF8 = b'\xff\xfe{"format": 1}'


@pytest.fixture
def policy_copy(tmp_path):
    """A copy of a library policy (policy.onnx + features.json) to damage."""
    copy = tmp_path / "p"
    shutil.copytree(library.library_root() / "small-cnn-sgd", copy)
    return copy


def test_a_features_json_that_is_not_utf8_is_refused_naming_it(policy_copy):
    """It raised UnicodeDecodeError with a traceback from --policy-path, the scheduler and eval."""
    (policy_copy / "features.json").write_bytes(NOT_UTF8)
    with pytest.raises(ConfigurationError, match=f"cannot read {policy_copy / 'features.json'}: 'utf-8' codec"):
        make_policy("ppo", path=policy_copy)


def test_a_library_policy_json_that_is_not_utf8_is_listed_as_unreadable(tmp_path, monkeypatch, capsys):
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "damaged")
    (tmp_path / "damaged" / library.INFO_FILE).write_bytes(NOT_UTF8)
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    assert "cannot read policy.json" in library.entries()["damaged"]["error"]
    assert main(["policy", "list"]) == 0
    assert "1 policies in" in capsys.readouterr().out


@pytest.mark.parametrize("training, needle", [
    ("x", "its 'training' section must be a JSON object"),
    ({"reward": "x"}, "reward weights must be an object of name: number, not str"),
    ({"reward": [1, 2]}, "reward weights must be an object of name: number, not list"),
    ({"reward": {"progress": "a"}}, "reward weight progress='a' must be a finite number >= 0"),
    ({"reward": {"progress": None}}, "reward weight progress=None must be a finite number >= 0"),
])
def test_eval_refuses_a_malformed_training_reward_naming_the_file(policy_copy, capsys, training, needle):
    """`dynamix policy eval` raised AttributeError or ValueError with a traceback."""
    features = policy_copy / "features.json"
    features.write_text(json.dumps(json.loads(features.read_text()) | {"training": training}))
    assert main(["policy", "eval", str(policy_copy), "--scenario", "straggler", "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert str(features) in err and needle in err, err


def test_reward_weights_from_a_dict_keep_numbers_as_floats_and_default_without_one():
    assert RewardWeights.from_dict({"progress": 2}).progress == 2.0
    assert isinstance(RewardWeights.from_dict({"progress": 2}).progress, float)
    assert RewardWeights.from_dict(None) == RewardWeights()
