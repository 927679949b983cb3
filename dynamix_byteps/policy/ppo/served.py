"""The copy of a trained policy that online fine-tuning publishes into and the scheduler serves.

``bpslaunch --policy ppo --fine-tune`` serves ``RUN/policy`` (:func:`prepare_served`), never the
trained directory itself; ``dynamix policy finetune`` publishes its generations there
(:mod:`.publish`). No torch or Ray: the launcher calls it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.policy_format import FEATURES_FILE, POLICY_FILE, REEXPORT, read_metadata
from dynamix_byteps.policy.ppo.publish import Generation, read_manifest

__all__ = ["SERVED_DIR", "prepare_served", "served_metadata"]

#: Where ``bpslaunch --fine-tune`` keeps the policy the scheduler serves, inside the run directory.
SERVED_DIR = "policy"


def prepare_served(source: Path, run_dir: Path) -> Path:
    """Copy the policy files of ``source`` to ``run_dir/policy`` (kept if already there: a
    restarted job goes on from its newest generation); return that directory. The trained
    policy itself is never modified.

    Raises:
        ConfigurationError: ``source`` is not a policy directory, or ``run_dir/policy`` holds a
            copy of another policy (a reused --log-dir) or one that cannot be served (a damaged
            file, in it or in the generation its manifest names).
    """
    served = Path(run_dir) / SERVED_DIR
    directory, _ = read_metadata(source)
    if (served / FEATURES_FILE).is_file():
        if (served / FEATURES_FILE).read_bytes() != (directory / FEATURES_FILE).read_bytes():
            raise ConfigurationError(f"{served} holds the fine-tuning of another policy than {directory}; give this "
                                     f"job a new --log-dir, or remove {served} to start again from {directory}")
        _check_kept_copy(served, directory)
    else:
        staging = served.with_name(f".{SERVED_DIR}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in (POLICY_FILE, FEATURES_FILE):
            shutil.copy2(directory / name, staging / name)
        shutil.rmtree(served, ignore_errors=True)
        staging.rename(served)
    return served


def served_metadata(root, *, fix: str | None = REEXPORT) -> tuple[Generation, Path, dict]:
    """``(manifest, directory, features.json content)`` of the generation the served policy
    directory ``root`` serves (``root`` itself, generation 0, without a manifest).

    Raises:
        ConfigurationError: the manifest cannot be read or names a directory outside ``root``, or
            that directory does not pass :func:`read_metadata` (whose messages end with ``fix``).
    """
    manifest = read_manifest(root)
    directory, meta = read_metadata(manifest.path(root), fix=fix)
    return manifest, directory, meta


def _check_kept_copy(served: Path, source: Path) -> None:
    """Refuse a copy kept from an earlier run whose served generation does not pass
    :func:`read_metadata`: the scheduler would refuse it with a fix ("re-export the policy") that
    does not apply to a copy, after the job has started."""
    try:
        served_metadata(served, fix=None)
    except ConfigurationError as error:
        raise ConfigurationError(f"{served}, the fine-tuned copy of {source} an earlier run of this --log-dir left, "
                                 f"cannot be served: {error}. Remove {served} to start again from {source}, or give "
                                 "this job a new --log-dir") from None
