"""CPU quotas of emulated hosts (dynamix_byteps.testing.cpu_quota through netns.Testbed's ``cpus``).

Needs root, the network test bed and a cgroup cpu controller: skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynamix_byteps.testing import cpu_quota, netns

REASON = netns.available() or cpu_quota.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU quotas unavailable: {REASON}")

# Spins for 2 s of wall time, then prints the CPU seconds it got.
SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 2: pass\nprint(time.process_time())"


def cpu_seconds(bed: netns.Testbed, host: int) -> float:
    proc = bed.popen(host, [sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    return float(out)


@pytest.mark.timeout(120)
def test_a_host_with_a_quota_gets_its_share_of_a_core_and_its_cgroup_goes_with_the_bed():
    with netns.Testbed(2, cpus={1: 0.25}) as bed:
        quota = bed._quotas[1].path
        assert quota.is_dir()
        limited = cpu_seconds(bed, 1)
    assert limited <= 0.25 * 2 * 1.4, limited  # CFS enforces it per 100-ms period; unlimited: ~2 s
    assert not quota.exists()


def test_bad_cpu_counts_are_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="cores > 0"):
        netns.Testbed(2, cpus={1: 0})
    with pytest.raises(ValueError, match="index in 0..1"):
        netns.Testbed(2, cpus={2: 0.5})


@pytest.mark.timeout(60)
def test_the_quota_of_a_dead_owner_is_removed_by_the_next_bed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = cpu_quota.CpuQuota(f"dxtb_abc123_{int(dead.stdout)}_h1", 0.5)
    assert stale.path.is_dir()
    assert stale.path.name in netns.cleanup_stale()
    assert not stale.path.exists()
