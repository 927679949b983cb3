"""Policy generations: how online fine-tuning publishes a new network and the scheduler finds it.

numpy-free and torch-free: :class:`~dynamix_byteps.policy.ppo.serve.PPOPolicy` (the scheduler)
reads manifests, :mod:`.finetune` (the trainer) writes them.

A served policy directory ``DIR`` may hold, beside its own ``policy.onnx`` + ``features.json``
(generation 0)::

    DIR/manifest.json                 {"format": "dynamix-ppo-manifest", "generation": G,
                                       "directory": "generations/000007", ...}
    DIR/generations/000007/           policy.onnx + features.json of one published network

``manifest.json`` names the generation to serve; without it ``DIR`` itself is generation 0.
Generations only grow: a rollback is a *new* generation whose ``directory`` is an older one's
(and whose ``rollback_of`` names the bad one), so a reader only has to notice that the number
changed. A generation's files are written and fsynced before the manifest that names it, and
the manifest is replaced atomically (:func:`dynamix_byteps.atomic.write_atomic`: a temporary
file, fsync, ``os.replace``, fsync of the directory), so a reader sees either the old or the new
manifest, never a half-written one, and the files it names are complete.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.errors import ConfigurationError

__all__ = ["GENERATIONS", "MANIFEST", "MANIFEST_FORMAT", "Generation", "generation_dir", "publish", "read_manifest"]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dynamix-ppo-manifest"
GENERATIONS = "generations"


class Generation(dict):
    """One manifest: ``generation`` (int >= 0), ``directory`` (relative to the served dir) and
    optional ``parent``, ``rollback_of``, ``reason``, ``time`` (Unix seconds)."""

    @property
    def number(self) -> int:
        return int(self["generation"])

    def path(self, root: Path) -> Path:
        """The generation's directory; it must lie inside ``root``.

        Raises:
            ConfigurationError: ``directory`` is absolute or leaves ``root`` (``..``).
        """
        base = Path(root).resolve()
        path = (base / self["directory"]).resolve()
        if path != base and base not in path.parents:
            raise ConfigurationError(f"{Path(root) / MANIFEST} names directory {self['directory']!r} outside "
                                     f"{root}: a manifest may only point into its own served directory")
        return path


def generation_dir(root, generation: int) -> Path:
    """Where generation ``generation`` of ``root`` keeps its files (``root/generations/NNNNNN``)."""
    return Path(root) / GENERATIONS / f"{int(generation):06d}"


def read_manifest(root) -> Generation:
    """The manifest of served directory ``root``; generation 0 = ``root`` itself when there is none.

    Raises:
        ConfigurationError: the manifest exists but is not valid JSON of this format (a reader
            should keep what it serves and retry later).
    """
    path = Path(root) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Generation(generation=0, directory=".")
    except (OSError, ValueError) as error:
        raise ConfigurationError(f"cannot read {path}: {error}") from None
    if not (isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT
            and isinstance(data.get("generation"), int) and data["generation"] >= 0
            and isinstance(data.get("directory"), str)):
        raise ConfigurationError(f"{path} is not a {MANIFEST_FORMAT} file")
    return Generation(data)


def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def publish(root, generation: int, directory, **fields) -> Generation:
    """Make ``generation`` (files already complete in ``directory``) the one ``root`` serves.

    Args:
        root: the served policy directory.
        generation: the new number; must exceed the current manifest's.
        directory: the generation's files (``policy.onnx`` + ``features.json``), inside ``root``.
        fields: recorded in the manifest (``parent``, ``rollback_of``, ``reason``, ...).

    Returns:
        The manifest written.

    Raises:
        ValueError: ``generation`` does not exceed the current one, or ``directory`` is outside ``root``.
    """
    root = Path(root)
    current = read_manifest(root).number
    if generation <= current:
        raise ValueError(f"generation {generation} must exceed the published generation {current}")
    directory = Path(directory).resolve()
    relative = os.path.relpath(directory, root.resolve())
    if relative.startswith(".."):
        raise ValueError(f"{directory} is not inside the served directory {root}")
    _fsync_tree(directory)
    manifest = Generation(format=MANIFEST_FORMAT, generation=int(generation), directory=relative,
                          time=time.time(), **fields)
    write_atomic(root / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
