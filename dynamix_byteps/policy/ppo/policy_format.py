"""The policy directory format, shared by the server (:mod:`.serve`), the exporter, the library and
the fine-tuner: file names, format version, the ONNX graph's input/output names, and the check
that a directory holds a policy this version can serve (no onnxruntime needed).

``policy.onnx`` takes ``obs`` float32 ``(batch, workers, F)`` and gives ``logits`` float32
``(batch, workers, A)``; ``features.json`` records the format and version, the observation spec,
the action ladder and the ONNX file's SHA-256 (see :mod:`.serve`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.features import check_spec
from dynamix_byteps.policy.ppo.mdp import RewardWeights, check_ladder, keep_index

__all__ = ["FEATURES_FILE", "FORMAT", "FORMAT_VERSION", "INPUT", "OUTPUT", "POLICY_FILE", "REEXPORT", "TRAINING_FILE",
           "policy_directory", "read_metadata", "sha256", "trained_reward"]

POLICY_FILE = "policy.onnx"
FEATURES_FILE = "features.json"
TRAINING_FILE = "training.json"  # written by `dynamix policy train`: its settings and returns per iteration
FORMAT = "dynamix-ppo-policy"
FORMAT_VERSION = 1
INPUT = "obs"
OUTPUT = "logits"
#: The fix for a policy directory whose files are damaged or of another export (:func:`read_metadata`'s default).
REEXPORT = "re-export the policy with `dynamix policy export CHECKPOINT --out DIR`"


def sha256(path: Path) -> str:
    """Hex SHA-256 of the file at ``path`` (the ONNX file's fingerprint in ``features.json``)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def policy_directory(path) -> Path:
    """The policy directory ``path`` names: the directory itself, or its ``policy.onnx`` or ``features.json``.

    Raises:
        ConfigurationError: it does not exist, or is another file (the message names ``path``).
    """
    path = Path(path)
    if path.is_file() and path.name in (POLICY_FILE, FEATURES_FILE):
        return path.parent
    if path.is_dir():
        return path
    problem = "is a file, not a policy directory" if path.exists() else "does not exist"
    raise ConfigurationError(f"policy path {path} {problem}; pass the directory holding {POLICY_FILE} and "
                             f"{FEATURES_FILE} that `dynamix policy train --out DIR` or `dynamix policy export --out DIR` "
                             "wrote")


def read_metadata(path, *, fix: str | None = REEXPORT) -> tuple[Path, dict]:
    """``(directory, features.json content)`` of a policy directory, validated against this code.

    Args:
        fix: what the message about a damaged or foreign file ends with; None for nothing (a
            caller that knows the directory is no export, e.g. a copy, gives its own fix).

    Raises:
        ConfigurationError: missing files, another format or version, a feature spec this
            version does not compute, a malformed action ladder (:func:`~.mdp.check_ladder`), or
            an ONNX file whose hash differs from the record.
    """
    directory = policy_directory(path)
    meta_path = directory / FEATURES_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise ConfigurationError(f"{meta_path} is missing: {directory} is not a policy directory "
                                 "(expected policy.onnx and features.json from `dynamix policy export`)") from None
    except (OSError, ValueError) as error:  # ValueError: not JSON, or bytes that are not UTF-8
        raise ConfigurationError(f"cannot read {meta_path}: {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigurationError(f"{meta_path} is not a {FORMAT} v{FORMAT_VERSION} file{_advice(fix)}")
    check_spec(_section(meta, "observation", meta_path, fix), str(meta_path))
    actions = _section(meta, "actions", meta_path, fix)
    ladder = check_ladder(actions.get("ladder"), f"{meta_path}: the policy's action ladder")
    if actions.get("keep") != keep_index(len(ladder)):
        raise ConfigurationError(f"{meta_path}: the policy keeps a batch with action {actions.get('keep')!r}, this "
                                 f"version with {keep_index(len(ladder))} (the ladder's middle); retrain it")
    onnx_path = directory / POLICY_FILE
    if not onnx_path.is_file():
        raise ConfigurationError(f"{onnx_path} is {'not a file' if onnx_path.exists() else 'missing'}{_advice(fix)}")
    recorded = _section(meta, "onnx", meta_path, fix).get("sha256")
    if recorded != sha256(onnx_path):
        raise ConfigurationError(f"{onnx_path} does not match the SHA-256 recorded in {meta_path} (a partial copy or a "
                                 f"file from another export){_advice(fix)}")
    return directory, meta


def trained_reward(directory: Path, meta: dict) -> RewardWeights:
    """The reward weights the policy in ``directory`` was trained with (``meta``, its
    ``features.json`` content, section ``training``, entry ``reward``); the defaults when it
    records none.

    Raises:
        ConfigurationError: the ``training`` section or its ``reward`` is malformed (the message
            names the file).
    """
    meta_path = Path(directory) / FEATURES_FILE
    training = _section(meta, "training", meta_path)
    try:
        return RewardWeights.from_dict(training.get("reward"))
    except ConfigurationError as error:
        raise ConfigurationError(f"{meta_path}: its training reward: {error}; {REEXPORT}") from None


def _section(meta: dict, name: str, meta_path: Path, fix: str | None = REEXPORT) -> dict:
    """``meta[name]``, ``{}`` when absent (the checks that follow name what it lacks)."""
    section = meta.get(name) or {}
    if not isinstance(section, dict):
        raise ConfigurationError(f"{meta_path}: its {name!r} section must be a JSON object, not "
                                 f"{type(section).__name__}{_advice(fix)}")
    return section


def _advice(fix: str | None) -> str:
    return f"; {fix}" if fix else ""
