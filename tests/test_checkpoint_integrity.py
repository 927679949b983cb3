"""load_checkpoint refuses damaged, truncated, foreign, newer and mismatched files, and paths
it cannot open, with a ConfigurationError that names the file, and changes nothing: the model,
optimizer and sampler keep their state (compared as state_dicts before and after), also when
it is refused for another optimizer class or parameter order, or fails half-way; and
save_checkpoint to a symlink replaces the link's target. One real worker."""

import pytest
from multiworker import run_workers


def _ok(results):
    (result,) = results
    assert "ok" in result, f"raised {result.get('error')}: {result.get('traceback')}"
    return result["ok"]


@pytest.mark.timeout(120)
def test_every_damaged_or_mismatched_checkpoint_is_refused_and_changes_nothing(tmp_path):
    result = _ok(run_workers(1, "checkpoint_integrity_cases:refused_loads", str(tmp_path), timeout=110))
    assert result["changed"], "the state must differ from the file's, or 'unchanged' proves nothing"
    assert result["good_restores"], "the intact file must load and restore the saved state"
    cases = result["cases"]
    regions = {label.removeprefix("flip ").split(":")[0].split(" @")[0] for label in cases if label.startswith("flip")}
    assert {"header", "tensor data", "sampler", "digest"} <= regions
    assert sum(label.startswith("truncated") for label in cases) >= 6
    problems = []
    for label, case in cases.items():
        error = case["error"]
        if error is None:
            problems.append(f"{label}: loaded without error")
        elif not error["configuration_error"]:
            problems.append(f"{label}: {error['type']}: {error['message']}")
        elif case["path"] not in error["message"]:
            problems.append(f"{label}: the message does not name the file: {error['message']}")
        if not case["unchanged"]:
            problems.append(f"{label}: model, optimizer or sampler changed")
    assert not problems, "\n".join(problems)
    assert "newer dynamix_byteps (format 99" in cases["newer format"]["error"]["message"]
    assert "upgrade" in cases["newer format"]["error"]["message"]
    assert "empty" in cases["truncated to 0 of " + label_length(cases)]["error"]["message"]
    assert "corrupted" in next(c for k, c in cases.items() if k.startswith("flip tensor data"))["error"]["message"]
    for label in ("negative format", "format 0"):
        assert "versions start at 1" in cases[label]["error"]["message"], cases[label]
    assert "(a directory, not a regular file)" in cases["a directory"]["error"]["message"]
    assert "Too many levels of symbolic links" in cases["a symlink loop"]["error"]["message"]


def label_length(cases) -> str:
    """The full length in the truncation labels ('truncated to N of LEN bytes')."""
    return next(label for label in cases if label.startswith("truncated to 0 of ")).removeprefix("truncated to 0 of ")


@pytest.mark.timeout(90)
def test_a_format_1_checkpoint_loads_and_its_damage_is_caught_by_the_zip_crcs(tmp_path):
    result = _ok(run_workers(1, "checkpoint_integrity_cases:legacy_format_1", str(tmp_path), timeout=80))
    assert result["extra"] == {"note": "old"}
    assert result["damaged_error"] and "does not match its CRC" in result["damaged_error"]


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_optimizer_class_or_parameter_order_is_refused_and_changes_nothing(tmp_path):
    result = _ok(run_workers(1, "checkpoint_integrity_cases:optimizer_mismatches", str(tmp_path), timeout=110))
    refused = result["refused"]
    assert len(refused) == 6
    problems = []
    for label, case in refused.items():
        error = case["error"]
        if error is None:
            problems.append(f"{label}: loaded without error")
        elif not error["configuration_error"] or case["path"] not in error["message"]:
            problems.append(f"{label}: {error['type']}: {error['message']}")
        if not case["unchanged"]:
            problems.append(f"{label}: the model or the optimizer changed")
        if case["step_error"]:
            problems.append(f"{label}: the optimizer cannot step after the load: {case['step_error']}")
    assert not problems, "\n".join(problems)
    assert result["recorded"] == {"optimizer_class": "SGD", "optimizer_shapes": [[8, 6], [8], [3, 8], [3]]}
    for target in ("Adam, wrapped", "Adam, plain"):
        message = refused[f"current file into {target}"]["error"]["message"]
        assert "optimizer of class SGD, this one's class is Adam" in message, message
        # a file without the class: the checks pass, torch's load fails half-way and is undone
        assert "KeyError" in refused[f"older file into {target}"]["error"]["message"]
    assert "parameter 0 had shape [8, 6], this optimizer's has [3]" in (
        refused["current file into parameters in reverse order"]["error"]["message"])
    assert "'momentum_buffer' of shape [8, 6] for parameter 0 of shape [3]" in (
        refused["older file into parameters in reverse order"]["error"]["message"])
    for label, case in result["loaded"].items():
        assert case["error"] is None and not case["unchanged"] and case["step_error"] is None, (label, case)


@pytest.mark.timeout(90)
def test_save_checkpoint_to_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    result = _ok(run_workers(1, "checkpoint_integrity_cases:save_through_symlink", str(tmp_path), timeout=80))
    assert result["link_is_symlink"]
    assert result["target_extra"] == {"note": "new"}
    assert result["files"] == ["run", "run/ckpt.pt", "shared", "shared/ckpt.pt"], "a temporary file was left behind"
