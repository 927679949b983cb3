"""One standalone scheduler serving several jobs one after the other (``dynamix scheduler`` under
torchrun, docs/porting.md): a new job starts from its own batch sizes, never from the previous
job's assignment, while the same job's workers coming back keep the assignment in force.

A real scheduler on 127.0.0.1 and real stubs; workers register at their first report boundary
(step K, as a worker's SchedulerClient does), never at step 0.
"""

from __future__ import annotations

import pytest
from test_scheduler import K, ScriptedPolicy, info, report, running, stub_for

from dynamix_byteps.control.cluster import MAX_STEP

WORLD = 2


class Steered(ScriptedPolicy):
    """Answers ``sizes`` while set, else keeps the sizes in force; remembers every state."""

    def __init__(self, sizes=None):
        super().__init__(lambda s: self.sizes if self.sizes is not None else s.batch_sizes)
        self.sizes = sizes


def register(stub, rank, step, batch, lo=1, hi=0):
    return stub.Register(info(rank, WORLD, batch=batch, lo=lo, hi=hi, step=step)).assignment


def interval(stub, step, batches, slow_rank=None):
    """Every rank reports the interval ending at ``step``, rank 0 last; rank 0's answer (the one
    the job applies: rank 0 broadcasts it)."""
    answers = {}
    for r in reversed(range(WORLD)):
        compute = 0.1 * (8 if r == slow_rank else 1)
        answers[r] = stub.ReportMetrics(report(r, step, batch=batches[r], compute=compute))
    return answers[0]


def job_one(stub, policy, batch=32, intervals=6):
    """The tester's first job: 32 per worker, rank 1 slow, moved to [63, 1] by the policy."""
    register(stub, 0, K, batch)
    register(stub, 1, K, batch)
    sizes = [batch] * WORLD
    for i in range(2, intervals + 2):
        answer = interval(stub, i * K, sizes, slow_rank=1)
        sizes = list(answer.batch_sizes)
    assert sizes == [63, 1] and len(policy.states) == intervals
    return sizes


@pytest.mark.timeout(60)
def test_reports_forged_at_step_2_to_the_53_from_every_rank_do_not_stop_the_decisions():
    policy = ScriptedPolicy()
    with running(policy) as server, stub_for(server) as (stub, _, _channel):
        register(stub, 0, K, 32)
        register(stub, 1, K, 32)
        interval(stub, 2 * K, [32, 32])
        interval(stub, MAX_STEP, [32, 32])  # decided at 2**53: the next decision was due at 2**53 + K
        for step in (3 * K, 4 * K, 5 * K):
            interval(stub, step, [32, 32])
        assert [s.step for s in policy.states] == [2 * K, MAX_STEP, 3 * K, 4 * K, 5 * K]

