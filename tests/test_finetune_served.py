"""``bpslaunch --fine-tune`` reusing a --log-dir: the served copy must be of the same policy."""

import pytest

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.finetune_cli import prepare_served
from dynamix_byteps.policy.ppo.library import library_root


def test_a_run_dir_serving_another_policy_is_refused(tmp_path):
    first, other = library_root() / "small-cnn-sgd", library_root() / "small-cnn-adam"
    served = prepare_served(first, tmp_path)
    assert prepare_served(first, tmp_path) == served  # a restarted job goes on with its copy
    with pytest.raises(ConfigurationError, match="another policy"):
        prepare_served(other, tmp_path)  # was: silently served first's copy (and its generations)
