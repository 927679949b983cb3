"""Tests for dynamix_byteps.scaling.lr_scaling (framework-neutral, no timing asserts)."""

from __future__ import annotations

import math

import pytest

from dynamix_byteps.scaling.gradient_noise import GradientNoiseScale, gain
from dynamix_byteps.scaling.lr_scaling import (
    RULES,
    AdamScale,
    AdaScale,
    LinearScaling,
    LRScaling,
    NoScaling,
    SqrtScaling,
    get_rule,
    optimizer_family_of,
)

BATCHES = [(32, 32), (64, 32), (1000, 128), (96, 256), (7, 3), (4096, 1)]


def _noise_with(grad_sq, trace_cov):
    """A GradientNoiseScale whose smoothed terms are exactly (grad_sq, trace_cov)."""
    gns = GradientNoiseScale(smoothing=0.9)
    sizes = [4, 12]
    local = [grad_sq + trace_cov / b for b in sizes]
    assert gns.update(local, sizes, grad_sq + trace_cov / sum(sizes))
    assert gns.grad_sq == pytest.approx(grad_sq, rel=1e-9)
    assert gns.trace_cov == pytest.approx(trace_cov, rel=1e-9)
    return gns


@pytest.mark.parametrize("big, base", BATCHES)
def test_static_rules_are_exact(big, base):
    noise = _noise_with(1.0, 500.0)  # must be ignored by these rules
    assert get_rule("none").factor(big, base, noise) == 1.0
    assert get_rule("linear").factor(big, base, noise) == big / base
    assert get_rule("sqrt").factor(big, base, noise) == math.sqrt(big / base)
    assert get_rule("linear").factor(big, base) == big / base


def test_registry_names_and_classes():
    assert list(RULES) == ["none", "linear", "sqrt", "adascale", "adamscale"]
    for name, cls in [("none", NoScaling), ("linear", LinearScaling), ("sqrt", SqrtScaling),
                      ("adascale", AdaScale), ("adamscale", AdamScale), ("  AdaScale ", AdaScale)]:
        rule = get_rule(name)
        assert type(rule) is cls and isinstance(rule, LRScaling)
    assert [get_rule(n).uses_noise for n in RULES] == [False, False, False, True, True]
    rule = LinearScaling()
    assert get_rule(rule) is rule


def test_bad_rule_name_lists_choices():
    with pytest.raises(ValueError) as info:
        get_rule("cubic")
    message = str(info.value)
    assert "cubic" in message
    for name in RULES:
        assert name in message


def test_bad_optimizer_family_lists_choices():
    with pytest.raises(ValueError, match="sgd.*adam"):
        get_rule("adascale", optimizer_family="lamb")


def test_adam_family_turns_adascale_into_adamscale_only():
    assert type(get_rule("adascale", "adam")) is AdamScale
    assert type(get_rule("adascale", "sgd")) is AdaScale
    assert type(get_rule("adascale")) is AdaScale
    for name in ("none", "linear", "sqrt", "adamscale"):
        assert type(get_rule(name, "adam")) is type(get_rule(name))


@pytest.mark.parametrize("mu2, trace, big, base", [(1.0, 200.0, 512, 32), (0.02, 3.0, 64, 16),
                                                   (4.0, 1.0, 1024, 8), (1.0, 200.0, 16, 32)])
def test_adascale_and_adamscale_match_their_formulas(mu2, trace, big, base):
    noise = _noise_with(mu2, trace)
    s = big / base
    var = trace / base
    r = (var + mu2) / (var / s + mu2)
    assert get_rule("adascale").factor(big, base, noise) == pytest.approx(r, rel=1e-9)
    assert get_rule("adascale", "adam").factor(big, base, noise) == pytest.approx(
        math.sqrt(r), rel=1e-9)
    assert r == pytest.approx(gain(s, noise.grad_sq, noise.trace_cov, base))


def test_adascale_limits():
    big, base = 256, 32
    no_noise = _noise_with(1.0, 0.0)
    all_noise = _noise_with(0.0, 100.0)
    assert get_rule("adascale").factor(big, base, no_noise) == pytest.approx(1.0)
    assert get_rule("adascale").factor(big, base, all_noise) == pytest.approx(8.0)
    assert get_rule("adamscale").factor(big, base, all_noise) == pytest.approx(math.sqrt(8.0))


def test_adaptive_rules_return_one_before_any_estimate():
    empty = GradientNoiseScale()
    empty.update([1.0], [32], 1.0)  # degenerate: still no estimate
    for name in ("adascale", "adamscale"):
        assert get_rule(name).factor(1024, 32, None) == 1.0
        assert get_rule(name).factor(1024, 32, empty) == 1.0


@pytest.mark.parametrize("big, base", [(0, 32), (-8, 32), (32, 0), (float("nan"), 32),
                                       (32, float("inf"))])
def test_factor_rejects_bad_batches(big, base):
    for name in RULES:
        with pytest.raises(ValueError, match="batch"):
            get_rule(name).factor(big, base)


def test_optimizer_family_of_uses_class_names():
    Adam = type("Adam", (), {})
    AdamW = type("AdamW", (Adam,), {})
    MyAdam = type("MyAdam", (Adam,), {})
    SGD = type("SGD", (), {})
    assert optimizer_family_of(Adam()) == "adam"
    assert optimizer_family_of(AdamW()) == "adam"
    assert optimizer_family_of(MyAdam()) == "adam"
    assert optimizer_family_of(SGD()) == "sgd"
    assert optimizer_family_of(object()) == "sgd"
