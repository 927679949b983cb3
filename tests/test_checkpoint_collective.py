"""save_checkpoint is a checked collective: rank 0 calling it alone, or failing to write, raises
on every rank instead of waiting in a barrier until the engine's timeout (real workers on
loopback)."""

import pytest
from multiworker import ok, run_workers


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


@pytest.mark.timeout(200)
def test_a_save_that_fails_on_rank_0_raises_on_every_rank_at_once(tmp_path):
    # With a bare barrier after the write, rank 1 waited there for the whole DYNAMIX_TIMEOUT (120 s).
    results = run_workers(2, "checkpoint_cases:rank0_save_fails", str(tmp_path), timeout=180,
                          env={"DYNAMIX_TIMEOUT": "120"})
    rank0, rank1 = ok(results)
    for label, reason in (("unpicklable extra", "pickle"), ("path under a file", "FileExistsError")):
        own, told = rank0["cases"][label], rank1["cases"][label]
        assert own["error"] and own["error"]["type"] != "CommunicationError", own
        assert told["error"]["type"] == "CommunicationError", told
        assert f"rank 0 could not write {told['path']}" in told["error"]["message"], told
        assert reason in told["error"]["message"] and reason in f"{own['error']['type']}: {own['error']['message']}"
        assert max(own["seconds"], told["seconds"]) < 30, (own, told)
    assert rank0["after"] == rank1["after"] == [2.0, 2.0]
    assert not list(tmp_path.glob("**/*ckpt.pt*")), "nothing may be written"
