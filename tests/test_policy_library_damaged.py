"""``dynamix policy list`` with a damaged ``policy.json`` in (a copy of) the library: listed, no traceback."""

import shutil

import pytest

from dynamix_byteps.cli import main
from dynamix_byteps.policy.ppo import library


@pytest.mark.parametrize("content", ["[1, 2]", "null", '"text"', '{"workers": 8}', '{"scenarios": [1]}',
                                     '{"model": 5}', "{oops"])
def test_a_damaged_policy_json_is_listed_as_unreadable(tmp_path, monkeypatch, capsys, content):
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "damaged")
    (tmp_path / "damaged" / library.INFO_FILE).write_text(content)
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    assert "error" in library.entries()["damaged"]
    assert main(["policy", "list"]) == 0
    assert "1 policies in" in capsys.readouterr().out
