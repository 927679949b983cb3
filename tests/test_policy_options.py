"""``dynamix scheduler --policy-option KEY=VALUE``: boolean options reach the policy as booleans."""

import pytest

from dynamix_byteps.cli import UsageError, build_parser, build_policy


def _goodput(value):
    args = build_parser().parse_args(["scheduler", "--policy", "goodput", "--policy-option", f"scale_down={value}"])
    return build_policy(args.policy, dict(args.policy_option), max_change=2.0, hysteresis=0.05).policy


@pytest.mark.parametrize("value, expected", [("false", False), ("False", False), ("0", False), ("true", True)])
def test_scale_down_false_is_false(value, expected):
    assert _goodput(value).scale_down == expected


def test_a_scale_down_that_is_not_a_boolean_is_a_usage_error():
    with pytest.raises(UsageError, match="scale_down must be true or false"):
        _goodput("no")


@pytest.mark.parametrize("name", ["nope", "../../etc", "/tmp"])
def test_a_library_name_given_as_an_option_is_looked_up_in_the_library(name):
    args = build_parser().parse_args(["scheduler", "--policy", "ppo", "--policy-option", f"name={name}"])
    with pytest.raises(UsageError, match="in the policy library"):  # was: make_policy() got multiple values for 'name'
        build_policy(args.policy, dict(args.policy_option), max_change=2.0, hysteresis=0.05)
