"""Optional dependencies, installed by the package's extras rather than by every worker.

A plain ``pip install dynamix-byteps`` is what a training worker needs. The libraries below are
imported only where used, through :func:`import_extra`, so a missing one fails with the command
that installs it:

* ``scheduler``: ``tensorboard`` (scalars under ``--log-dir``) and ``prometheus-client``
  (the scheduler's ``--metrics-port``)
* ``report``: ``matplotlib`` and ``tensorboard`` (``dynamix report``)
* ``agent``: ``nvidia-ml-py`` (the node agent's GPU readings)
* ``all``: every one of them (and ``tensorflow`` and ``rl``)
"""

from __future__ import annotations

import importlib
from types import ModuleType

from dynamix_byteps.errors import DynamixError


class MissingExtraError(DynamixError, ImportError):
    """An optional library is not installed; the message names the extra that installs it."""


def import_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` naming ``extra`` when its top-level
    package is missing. ``purpose`` completes "... needs <package>" in the message.

    An ImportError raised inside an installed library is not relabelled: it is a broken install,
    not a missing extra.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        package = module.partition(".")[0]
        if error.name != package:
            raise
        raise MissingExtraError(
            f"{purpose} needs {package}, which is not installed: pip install 'dynamix-byteps[{extra}]'"
        ) from error
