"""save_checkpoint is a checked collective: rank 0 calling it alone raises on every rank
instead of waiting in a barrier until the engine's timeout (real workers on loopback)."""

import pytest
from multiworker import run_workers


@pytest.mark.timeout(90)
def test_save_checkpoint_on_rank_0_alone_raises_on_every_rank(tmp_path):
    # DYNAMIX_TIMEOUT is 60 s in run_workers; a hang would end in CommunicationError, not a mismatch.
    results = run_workers(2, "checkpoint_cases:rank0_only_save", str(tmp_path), timeout=80)
    for rank, result in enumerate(results):
        assert "ok" in result, f"rank {rank}: {result}"
        error = result["ok"]["error"]
        assert error and "save_checkpoint" in error and "rank 1: next" in error, (rank, error)
        assert result["ok"]["after"] == [2.0, 2.0]
    assert not results[0]["ok"]["written"]
