"""Resuming training without losing work: the sampler position a checkpoint keeps, whatever
frontend trains on the sampler's batches."""

import pytest
import torch
from conftest import clean_env, run_bpslaunch

from dynamix_byteps.data.sampler import DynamicBatchSampler
from dynamix_byteps.launcher.elastic import RunReport, decide


@pytest.mark.timeout(15)
def test_a_checkpoint_of_the_ddp_wrapper_with_a_plain_optimizer_keeps_the_prefetched_batches(
        single_process_job, tmp_path):
    """With the DDP wrapper the optimizer is torch's: the checkpoint saved the sampler's own
    position, two steps ahead of training under a prefetching loader, and the resumed epoch
    silently skipped those batches (90 of 100 samples trained)."""
    bps = single_process_job
    torch.manual_seed(0)
    sampler = bps.DynamicBatchSampler(100, batch_size=5, seed=1)
    model = bps.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches, trained = iter(sampler), []
    prefetched = [next(batches), next(batches)]  # what a DataLoader with workers draws ahead
    for _ in range(4):
        prefetched.append(next(batches))
        indices = prefetched.pop(0)
        optimizer.zero_grad()
        model(torch.tensor(indices, dtype=torch.float32).unsqueeze(1)).sum().backward()
        optimizer.step()
        trained += indices
    path = tmp_path / "ckpt.pt"
    bps.save_checkpoint(path, model=model, optimizer=optimizer, sampler=sampler)

    with pytest.warns(UserWarning, match="replaces the one training has used"):  # a fresh process would not warn
        resumed = bps.DynamicBatchSampler(100, batch_size=5, seed=1)
    bps.load_checkpoint(path, sampler=resumed)
    rest = [i for batch in resumed for i in batch]
    assert sorted(trained + rest) == list(range(100))


@pytest.mark.timeout(15)
@pytest.mark.parametrize("damage", [{"base_batch_size": 0}, {"next_step": "3"}, {"gradient_noise": None}, "drop"])
def test_an_optimizer_state_dict_with_a_damaged_dynamix_part_is_refused_before_anything_loads(single_process_job,
                                                                                                damage):
    """DistributedOptimizer.state_dict() carries the lr_scaling base batch, step and noise statistics
    under "dynamix": a damaged one (a hand-edited or foreign file) loaded the torch part first and
    then raised a KeyError or TypeError, or took a base batch of 0, leaving the optimizer half-restored."""
    bps = single_process_job
    model = torch.nn.Linear(2, 1)
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         model.named_parameters())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        optimizer.step()
    saved = optimizer.state_dict()
    saved["param_groups"][0]["lr"] = 0.5
    if damage == "drop":
        del saved["dynamix"]["base_batch_size"]
    else:
        saved["dynamix"].update(damage)
    saved["state"][0]["momentum_buffer"] = torch.full((1, 2), 7.0)
    momentum, dynamix = optimizer.state[model.weight]["momentum_buffer"].clone(), optimizer.dynamix_state_dict()
    with pytest.raises(ValueError, match="'dynamix' part .* nothing was loaded"):
        optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], momentum)
    assert optimizer.dynamix_state_dict() == dynamix


@pytest.mark.timeout(15)
def test_a_checkpoint_written_before_the_optimizer_state_carried_its_dynamix_part_still_restores_it(
        single_process_job, tmp_path):
    """Files written before DistributedOptimizer.state_dict() carried the lr_scaling base batch, step
    and noise statistics keep them beside the optimizer's state, under the checkpoint's own "dynamix"."""
    from dynamix_byteps.torch import checkpoint

    bps = single_process_job
    model = torch.nn.Linear(2, 1)
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                         lr_scaling="linear")
    optimizer.set_local_batch_size(4)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        optimizer.step()
    path = tmp_path / "ckpt.pt"
    bps.save_checkpoint(path, model=model, optimizer=optimizer)
    state = torch.load(path, weights_only=True)
    state["dynamix"] = state["optimizer"].pop("dynamix")  # the older layout
    with open(path, "wb") as f:
        writer = checkpoint._DigestingWriter(f)
        torch.save(state, writer)
        writer.finish()

    fresh = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                     lr_scaling="linear")
    bps.load_checkpoint(path, model=model, optimizer=fresh)
    assert fresh.dynamix_state_dict() == optimizer.dynamix_state_dict()
    assert fresh.dynamix_state_dict()["base_batch_size"] == 4


# A worker that joins (leaves its rank in DYNAMIX_STARTED_DIR, as bps.init does) and then dies
# the way each run asks: run 0 loses rank 2 after the start; in run 1 rank 1 is killed between the
# restart and the rendezvous, which rank 0 then waits in; run 2 succeeds.
_KILLED_BEFORE_INIT_IN_RUN_1 = """
rank=$((DYNAMIX_RANK_OFFSET + BYTEPS_LOCAL_RANK))
if [ "$DYNAMIX_RESTART" = 1 ]; then [ "$rank" = 1 ] && kill -KILL $$; sleep 30; fi
touch "$DYNAMIX_STARTED_DIR/$rank"
if [ "$DYNAMIX_RESTART" = 0 ] && [ "$rank" = 2 ]; then kill -KILL $$; fi
if [ "$DYNAMIX_RESTART" = 2 ]; then exit 0; fi
sleep 30
"""


@pytest.mark.timeout(15)
def test_a_worker_killed_before_the_rendezvous_of_a_restarted_run_is_a_lost_worker(tmp_path):
    """Restarts are for lost workers; a run in which no worker got through bps.init was taken for an
    error in the command even when the same command had trained in the run before and a worker of
    this one was SIGKILLed (the OOM killer): the job ended with restarts left."""
    code, output = run_bpslaunch(["-n", 3, "--restart-on-failure", 2, "--checkpoint", tmp_path / "c.pt",
                                  "--grace-period", 2, "--", "sh", "-c", _KILLED_BEFORE_INIT_IN_RUN_1],
                                 timeout=12, env=clean_env())
    assert code == 0, output
    assert "restart 2 of 2 with 1 workers" in output and "failed before it started" not in output, output


def _run_report(node, run, code, failed, killed, started):
    return RunReport(node=node, run=run, code=code, failed=failed, failed_at=2.0 - node, killed=killed,
                     self_failed=[], workers=[2 * node, 2 * node + 1], started=started)


@pytest.mark.parametrize("run, killed, expected", [(1, [3], {"slots": [2, 1], "lost": [3]}), (0, [3], {"exit": 137}),
                                                   (1, [], {"exit": 137})])
def test_across_hosts_a_worker_killed_before_a_restarted_run_s_rendezvous_is_lost(run, killed, expected):
    reports = [_run_report(0, run, 143, 0, [], False), _run_report(1, run, 137, 3, killed, False)]
    decision = decide([2, 2], reports, restarts_left=1)
    assert {k: v for k, v in decision.items() if k != "reason"} == expected, decision


@pytest.mark.parametrize("bounds, resumed_size", [({"max_batch": 32}, 32), ({"min_batch": 80}, 80)])
def test_a_resumed_sampler_keeps_to_its_own_batch_bounds_as_with_another_worker_count(bounds, resumed_size):
    """A run resumed with a lower --max-batch (after an out-of-memory at the policy's 64, say) went
    on at the checkpoint's 64 with the same worker count, while another count was clamped."""
    saved = DynamicBatchSampler(1000, 64, num_replicas=2, rank=0)
    next(iter(saved))
    resumed = DynamicBatchSampler(1000, resumed_size, num_replicas=2, rank=0, **bounds)
    with pytest.warns(UserWarning, match=r"batch sizes \[64, 64\] are outside"):
        resumed.load_state_dict(saved.state_dict())
    assert resumed.schedule.at(1).batch_sizes == (resumed_size, resumed_size)
    assert len(next(iter(resumed))) == resumed_size


@pytest.mark.parametrize("next_epoch", [1, 0, None])
def test_a_loop_that_leaves_an_epoch_early_under_a_prefetching_loader_starts_the_epoch_set_next(next_epoch):
    """A loop that breaks after a few steps (a steps_per_epoch limit) leaves prefetched batches
    behind; the next pass drew them again even after set_epoch(1), so 'epoch 1' trained the rest
    of epoch 0 (80 of 100 samples, in epoch 0's order). The same epoch, or none set, goes on."""
    sampler = DynamicBatchSampler(100, 5, num_replicas=1, rank=0, seed=3)
    batches = iter(sampler)
    first = [next(batches) for _ in range(6)]  # 4 trained, 2 prefetched
    sampler.batch_plan.take_draws(4)
    if next_epoch is not None:
        sampler.set_epoch(next_epoch)
    rest = [i for batch in sampler for i in batch]
    if next_epoch == 1:
        assert sorted(rest) == list(range(100))
        assert sampler.schedule.next_open_step == 4 + 20  # the steps go on from the first untrained one
    else:
        assert sorted(rest + [i for batch in first[:4] for i in batch]) == list(range(100))
