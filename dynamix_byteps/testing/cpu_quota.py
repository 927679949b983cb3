"""CPU quotas for emulated hosts: one cgroup per host caps the cores its processes may use.

Processes on one machine share its cores, so a worker that waits on a slow link leaves its CPU to
the others, which separate hosts would not. A quota of ``q`` cores gives a host ``q`` × 100 ms of
CPU time in every 100-ms period, however many processes it runs (CFS bandwidth control, the
kernel's ``Documentation/scheduler/sched-bwc.rst``): cgroup v1's ``cpu.cfs_quota_us`` under
``/sys/fs/cgroup/cpu``, or cgroup v2's ``cpu.max`` where the ``cpu`` controller is enabled.

A process joins a quota when it starts (:meth:`CpuQuota.command` wraps its argv so that it moves
itself before it runs anything), and its children inherit it. :meth:`CpuQuota.close` removes the
cgroup once its processes have ended; :func:`cleanup_stale` removes those its caller calls stale
(the test bed names them like its namespaces, after their owner's pid).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

__all__ = ["PERIOD_US", "CpuQuota", "available", "cleanup_stale"]

PERIOD_US = 100_000
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_ENTER = 'echo $$ > "$0" && exec "$@"'  # sh -c: move this shell into the cgroup, then become argv


@cache
def _root() -> tuple[Path, str] | None:
    """(the cgroup directory quotas are made in, "v1" or "v2"), or None."""
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1, "v1"
    try:
        enabled = (_V2 / "cgroup.subtree_control").read_text().split()
    except OSError:
        return None
    return (_V2, "v2") if "cpu" in enabled else None


def available() -> str | None:
    """None when CPU quotas can be made here, else the reason (for ``pytest.skip`` or an error)."""
    if os.geteuid() != 0:
        return "CPU quotas need root: they create cgroups"
    if _root() is None:
        return ("no cgroup cpu controller: neither cgroup v1's /sys/fs/cgroup/cpu nor cgroup v2 with "
                "'cpu' in /sys/fs/cgroup/cgroup.subtree_control")
    return None


class CpuQuota:
    """A cgroup whose processes together use at most ``cores`` CPUs.

    Args:
        name: the cgroup's name, one path component.
        cores: CPUs, > 0 (0.5: half of one core's time; 1.5: one and a half cores).

    Raises:
        ValueError: an empty name or one with ``/``, or ``cores`` not > 0.
        OSError: the cgroup cannot be made (see :func:`available`).
    """

    def __init__(self, name: str, cores: float):
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"CPU quota name {name!r} must be one path component")
        if not 0 < cores < float("inf"):
            raise ValueError(f"a CPU quota needs cores > 0, not {cores}")
        reason = available()
        if reason is not None:
            raise OSError(reason)
        root, version = _root()
        self.cores = cores
        self.path = root / name
        self.path.mkdir()
        quota = max(1000, round(cores * PERIOD_US))  # the kernel's minimum is 1 ms
        if version == "v1":
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run so that it joins this cgroup before it starts."""
        return ["sh", "-c", _ENTER, str(self.path / "cgroup.procs"), *argv]

    def close(self, wait_s: float = 5.0) -> bool:
        """Remove the cgroup, waiting up to ``wait_s`` seconds for its processes to finish exiting;
        False when it still holds some then (it is left in place for :func:`cleanup_stale`)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


def cleanup_stale(stale: Callable[[str], bool]) -> list[str]:
    """Remove the empty cgroups of the quota root whose name ``stale`` accepts; their names."""
    root = _root()
    if root is None:
        return []
    removed = []
    for entry in root[0].iterdir():
        if entry.is_dir() and stale(entry.name):
            try:
                entry.rmdir()
            except OSError:
                continue
            removed.append(entry.name)
    return removed
