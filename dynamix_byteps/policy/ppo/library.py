"""The policy library: trained PPO policies shipped inside the package, chosen with ``--policy ppo:NAME``.

Each entry is a directory ``dynamix_byteps/policy/library/<name>/`` (package data, read through
:mod:`importlib.resources`) holding what ``dynamix policy train`` writes for serving,
``policy.onnx`` and ``features.json`` (see :mod:`.serve`), plus

* ``policy.json`` (:data:`INFO_FILE`): ``model`` (family, e.g. ``small-cnn``), ``optimizer``,
  ``description``, ``scenarios`` and ``workers`` trained on, ``feature_version``, ``profile``
  (how the simulator parameters were obtained) and ``training`` (iterations, seconds, seed,
  ``profiles`` and ``held_out``);
* ``sim_params.json``: the :class:`~dynamix_byteps.policy.sim.params.SimParams` it was trained on,
  or, for a policy trained on several fitted profiles, the homogeneous one (the job the
  scenarios of the benchmarks shape);
* ``profiles.json`` (optional): the profiles it was trained on and the scenarios held aside for
  evaluation (:mod:`.mixture`; ``policy.json``'s ``training`` names both).

Entries differ by the simulator parameters, i.e. the model's compute/communication profile and
the optimiser's statistical behaviour; pick the one closest to your job, or train your own
(``dynamix sim fit RUN_DIR`` then ``dynamix policy train --sim-params``) and pass
``--policy ppo --policy-path DIR``. No Ray or torch: the scheduler imports this.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.ppo.policy_format import read_metadata

__all__ = ["INFO_FILE", "entries", "library_root", "policy_dir", "resolve"]

INFO_FILE = "policy.json"
_TEXT = ("model", "optimizer", "description")  # policy.json fields that are strings


def library_root() -> Path:
    """The library directory inside the installed package."""
    return Path(str(resources.files("dynamix_byteps.policy").joinpath("library")))


def entries() -> dict[str, dict]:
    """``name -> policy.json content`` of every library entry (sorted by name; ``{}`` if none).

    An entry whose ``policy.json`` cannot be read, or is not an object with string ``model``,
    ``optimizer``, ``description`` and lists ``workers``, ``scenarios``, maps to ``{"error": "..."}``.
    """
    root = library_root()
    out = {}
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if not (d / INFO_FILE).is_file() and not (d / "policy.onnx").is_file():
            continue
        try:
            info = json.loads((d / INFO_FILE).read_text())
        except (OSError, ValueError) as error:  # ValueError: not JSON, or bytes that are not UTF-8
            info = {"error": f"cannot read {INFO_FILE}: {error}"}
        if not (isinstance(info, dict) and all(isinstance(info.get(k, ""), str) for k in _TEXT)
                and isinstance(info.get("workers", []), list) and isinstance(info.get("scenarios", []), list)
                and all(isinstance(x, str) for x in info.get("scenarios", []))):
            info = {"error": f"{INFO_FILE} is not an object of the library's format"}
        out[d.name] = info
    return out


def _listing(known: dict[str, dict]) -> str:
    if not known:
        return "the library of this installation is empty"
    return "library policies: " + ", ".join(
        f"{n} ({i.get('model', '?')}/{i.get('optimizer', '?')})" if "error" not in i else f"{n} (unreadable)"
        for n, i in known.items())


def policy_dir(name: str) -> Path:
    """The directory of library policy ``name``, checked as :func:`.policy_format.read_metadata` checks it.

    Raises:
        ConfigurationError: an unknown name, or an entry that is incomplete or incompatible with
            this version (another feature version, a missing or altered ONNX file); the message
            lists the library (``dynamix policy list``).
    """
    known = entries()
    name = str(name).strip()
    if name not in known:
        raise ConfigurationError(f"no policy {name!r} in the policy library; {_listing(known)} "
                                 "(`dynamix policy list`), or use a policy directory written by `dynamix policy train --out DIR`")
    directory = library_root() / name
    try:
        read_metadata(directory)
    except ConfigurationError as error:
        raise ConfigurationError(f"library policy {name!r} cannot be used: {error}. {_listing(known)}") from None
    return directory


def resolve(source: str) -> Path:
    """The policy directory ``source`` names: ``ppo:NAME`` or ``NAME`` of the library
    (:func:`policy_dir`), or a directory written by ``dynamix policy train --out DIR`` (text that
    exists, or holds a path separator), checked as :func:`.policy_format.read_metadata` checks it.

    Raises:
        ConfigurationError: an empty ``source``, an unknown name (the message lists the library),
            or a directory that is not a policy this version can serve.
    """
    text = str(source).strip()
    if not text:
        raise ConfigurationError("give a policy directory or a library policy's name (`dynamix policy list`)")
    if text.startswith("ppo:"):  # bpslaunch's spelling of a library policy
        return policy_dir(text[len("ppo:"):])
    path = Path(text)
    if path.exists() or len(path.parts) > 1:
        return read_metadata(path)[0]
    return policy_dir(text)
