"""Online fine-tuning: hot swap of published generations, rollback, and the trainer's update.

One module-scoped fixture builds an untrained (seeded) policy directory: an RLlib checkpoint of
the per-worker module plus its exported ONNX (no Ray instance, no training). Decision logs come
from the real scheduler code path in-process (:class:`SchedulerServer` fed with reports).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import kill_tree

from dynamix_byteps.control import dynamix_pb2
from dynamix_byteps.control.decision_record import DecisionRecord
from dynamix_byteps.control.scheduler import DECISION_LOG, SchedulerServer
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import Guarded
from dynamix_byteps.policy.ppo.finetune import DecisionTail
from dynamix_byteps.policy.ppo.library import library_root
from dynamix_byteps.policy.ppo.policy_format import FEATURES_FILE, POLICY_FILE, sha256
from dynamix_byteps.policy.ppo.publish import (
    MANIFEST,
    generation_dir,
    publish,
    read_manifest,
)
from dynamix_byteps.policy.ppo.serve import PPOPolicy
from dynamix_byteps.policy.ppo.served import prepare_served

pytest.importorskip("ray.rllib")

WORKERS = 4
K = 2


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """An untrained policy directory: ``checkpoint/`` (RLlib module) + ``policy.onnx`` + ``features.json``."""
    import gymnasium as gym
    import torch
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from dynamix_byteps.policy.ppo.export import (
        MODULE_SUBDIR,
        export_module,
        load_module,
    )
    from dynamix_byteps.policy.ppo.features import CLIP, NUM_FEATURES
    from dynamix_byteps.policy.ppo.mdp import LADDER, RewardWeights
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("finetune") / "policy"
    spec = RLModuleSpec(module_class=PerWorkerPPOModule,
                        observation_space=gym.spaces.Box(-CLIP, CLIP, (WORKERS * NUM_FEATURES,), np.float32),
                        action_space=gym.spaces.MultiDiscrete([len(LADDER)] * WORKERS),
                        model_config={"hidden": 16, "dynamix": {"reward": RewardWeights().to_dict()}})
    spec.build().save_to_path(str((out / "checkpoint" / MODULE_SUBDIR).resolve()))
    export_module(load_module(out / "checkpoint"), out)
    return out


def served_copy(policy_dir, tmp_path):
    """What ``bpslaunch --fine-tune`` serves: a copy of the policy's files (no checkpoint)."""
    served = tmp_path / "served"
    served.mkdir()
    for name in (POLICY_FILE, FEATURES_FILE):
        shutil.copy(policy_dir / name, served / name)
    return served


def perturbed_generation(served, generation, scale=0.5, seed=1):
    """Publish generation ``generation``: the served ONNX with every weight perturbed (onnx + numpy only)."""
    import onnx
    from onnx import numpy_helper

    source = read_manifest(served).path(served)
    model = onnx.load(str(source / POLICY_FILE))
    rng = np.random.default_rng(seed)
    for init in model.graph.initializer:
        w = numpy_helper.to_array(init)
        init.CopyFrom(numpy_helper.from_array((w + scale * rng.standard_normal(w.shape)).astype(w.dtype), init.name))
    target = generation_dir(served, generation)
    target.mkdir(parents=True)
    onnx.save(model, str(target / POLICY_FILE))
    meta = json.loads((source / FEATURES_FILE).read_text())
    meta["onnx"]["sha256"] = sha256(target / POLICY_FILE)
    (target / FEATURES_FILE).write_text(json.dumps(meta))
    publish(served, generation, target)
    return target


def narrowed_generation(served, generation):
    """Publish ``generation``: the served ONNX with its logits cut to 3 actions (right signature, wrong answer)."""
    import onnx
    from onnx import helper, numpy_helper

    target = perturbed_generation(served, generation, scale=0.0)
    model = onnx.load(str(target / POLICY_FILE))
    out = model.graph.output[0]
    for node in model.graph.node:
        node.output[:] = ["raw" if o == out.name else o for o in node.output]
    for name, value in (("starts", 0), ("ends", 3), ("axes", 2)):
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name))
    model.graph.node.append(helper.make_node("Slice", ["raw", "starts", "ends", "axes"], [out.name]))
    out.type.tensor_type.shape.dim[-1].dim_value = 3
    onnx.save(model, str(target / POLICY_FILE))
    meta = json.loads((target / FEATURES_FILE).read_text())
    meta["onnx"]["sha256"] = sha256(target / POLICY_FILE)
    (target / FEATURES_FILE).write_text(json.dumps(meta))
    return target


def info(rank, batch=32):
    return dynamix_pb2.WorkerInfo(rank=rank, world_size=WORKERS, host="127.0.0.1", engine="gloo", min_batch=4,
                                  max_batch=512, batch_size=batch, dataset_size=60000)


class FakeJob:
    """Four workers (rank 3 three times slower) reporting to a real in-process scheduler.

    The loss falls faster with a larger global batch, and when ``collapse`` returns True for the
    generation that decided last, it rises instead (a synthetic reward collapse).
    """

    def __init__(self, policy, run_dir, collapse=lambda generation: False):
        self.policy = policy
        self.server = SchedulerServer(Guarded(policy), num_workers=WORKERS, decision_interval=K, run_dir=run_dir)
        self.sizes = [32] * WORKERS
        for r in range(WORKERS):
            self.server.register(info(r))
        self.step, self.loss, self.collapse = 0, 2.5, collapse
        self.log = run_dir / DECISION_LOG

    def decisions(self, count):
        """Run ``count`` decision intervals; return once the scheduler has logged them all."""
        for _ in range(count):
            self.step += K
            last = None
            for r, b in enumerate(self.sizes):
                compute = b / (400.0 if r < 3 else 133.0)
                last = self.server.report(dynamix_pb2.Report(
                    rank=r, step=self.step, local_batch_size=b, compute_s=compute, push_pull_s=0.02,
                    samples_per_s=b / compute, loss=self.loss, grad_sq=2.0, trace_cov=200.0))
            self.sizes = list(last.batch_sizes)
            gain = 0.02 * sum(self.sizes) / (sum(self.sizes) + 256)
            self.loss *= 1.5 if self.collapse(self.policy.generation) else 1 - gain
        deadline = time.monotonic() + 30
        while self.log.read_bytes().count(b"\n") < self.step // K:  # written off the RPC path; whole lines only
            assert time.monotonic() < deadline, "the scheduler did not log its decisions"
            time.sleep(0.01)

    def close(self):
        self.server.stop(grace=None)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / DECISION_LOG).read_text().splitlines()]


# ---- hot swap ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hot_swap_picks_up_a_new_generation_and_the_next_decision_uses_it(policy_dir, tmp_path):
    served = served_copy(policy_dir, tmp_path)
    policy = PPOPolicy(path=served)
    job = FakeJob(policy, tmp_path / "run")
    try:
        job.decisions(2)
        before = policy.logits(np.zeros((1, WORKERS, 16), np.float32))
        perturbed_generation(served, 1)
        policy.refresh(wait=True)
        assert policy.generation == 1 and policy.directory == generation_dir(served, 1).resolve()
        assert not np.allclose(policy.logits(np.zeros((1, WORKERS, 16), np.float32)), before)
        job.decisions(1)
    finally:
        job.close()
    logged = records(tmp_path / "run")
    assert [r["terms"]["generation"] for r in logged] == [0, 0, 1]
    last = logged[-1]["terms"]
    assert np.asarray(last["obs"]).shape == (WORKERS, 16) and np.asarray(last["logits"]).shape == (WORKERS, 5)
    logits = np.asarray(last["logits"])
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert last["logp"] == pytest.approx(log_softmax[np.arange(WORKERS), last["actions"]].sum(), abs=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["corrupt onnx", "bad manifest", "missing directory", "wrong output shape",
                                    "directory outside"])
def test_a_bad_publication_is_ignored_with_a_warning(policy_dir, tmp_path, caplog, damage):
    served = served_copy(policy_dir, tmp_path)
    policy = PPOPolicy(path=served)
    state_obs = np.zeros((1, WORKERS, 16), np.float32)
    before = policy.logits(state_obs)
    if damage == "corrupt onnx":
        target = perturbed_generation(served, 1)
        (target / POLICY_FILE).write_bytes(b"not an onnx file")  # the recorded hash no longer matches either
    elif damage == "bad manifest":
        (served / MANIFEST).write_text("{half a manif")
    elif damage == "wrong output shape":
        narrowed_generation(served, 1)
    elif damage == "directory outside":
        # A loadable policy, but outside the served directory: never followed (was: loaded from anywhere).
        (tmp_path / "elsewhere").mkdir()
        elsewhere = served_copy(policy_dir, tmp_path / "elsewhere")
        (served / MANIFEST).write_text(json.dumps({"format": "dynamix-ppo-manifest", "generation": 3,
                                                   "directory": str(perturbed_generation(elsewhere, 1))}))
    else:
        (served / MANIFEST).write_text(json.dumps({"format": "dynamix-ppo-manifest", "generation": 3,
                                                   "directory": "generations/000003"}))
    with caplog.at_level(logging.WARNING, logger="dynamix_byteps.policy.ppo"):
        policy.refresh(wait=True)
    assert policy.generation == 0
    assert any("keeping policy generation 0" in r.getMessage() for r in caplog.records)
    assert np.array_equal(policy.logits(state_obs), before)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynamix_byteps.policy.ppo"):
        policy.refresh(wait=True)  # the same bad file is not retried every decision
    assert not caplog.records


# ---- the trainer -----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_trainer_updates_publishes_a_checked_onnx_and_the_scheduler_swaps_it(policy_dir, tmp_path):
    import onnx
    from onnx import numpy_helper

    from dynamix_byteps.policy.ppo.finetune import EVENTS, FineTuner

    served = served_copy(policy_dir, tmp_path)
    run = tmp_path / "run"
    policy = PPOPolicy(path=served, explore="true", seed=0)
    job = FakeJob(policy, run)
    tuner = FineTuner(run, served, checkpoint=policy_dir / "checkpoint", every=12, window=4, lr=3e-3)
    try:
        job.decisions(13)  # 12 transitions of generation 0
        events = tuner.step()
        assert [e["event"] for e in events] == ["publish"] and events[0]["generation"] == 1
        assert events[0]["transitions"] == 12 and events[0]["from_generation"] == 0
        policy.refresh(wait=True)
        assert policy.generation == 1
        job.decisions(6)
    finally:
        job.close()
    new = generation_dir(served, 1)
    old_w = [numpy_helper.to_array(t) for t in onnx.load(str(served / POLICY_FILE)).graph.initializer]
    new_w = [numpy_helper.to_array(t) for t in onnx.load(str(new / POLICY_FILE)).graph.initializer]
    assert len(old_w) == len(new_w) and any(not np.allclose(a, b) for a, b in zip(old_w, new_w))
    meta = json.loads((new / FEATURES_FILE).read_text())
    assert meta["onnx"]["sha256"] == sha256(new / POLICY_FILE)  # export_module's parity/weight checks passed
    assert meta["training"]["fine_tune"]["decisions"] == [1, 12]
    assert [r["terms"]["generation"] for r in records(run)][-6:] == [1] * 6
    events = tuner.step()  # 5 transitions of generation 1 >= window 4, no collapse: accepted
    assert [e["event"] for e in events] == ["accept"] and tuner.good[0] == 1
    assert [json.loads(x)["event"] for x in (run / EVENTS).read_text().splitlines()] == ["publish", "accept"]
    resumed = FineTuner(run, served, checkpoint=policy_dir / "checkpoint", every=12)  # a restarted trainer
    assert resumed.generation == 1
    mine, theirs = tuner.module.state_dict(), resumed.module.state_dict()
    assert all(np.array_equal(mine[k].numpy(), theirs[k].numpy()) for k in mine)


@pytest.mark.timeout(180)
def test_an_update_makes_the_rewarded_action_more_likely(policy_dir, tmp_path):
    """Transitions (one-step episodes, so no credit assignment through an untrained value function)
    whose reward is 1 when worker 0 keeps its batch: after one update 'keep' is likelier for it."""
    from dynamix_byteps.policy.ppo.finetune import FineTuner, Transition
    from dynamix_byteps.policy.ppo.mdp import KEEP

    served = served_copy(policy_dir, tmp_path)
    tuner = FineTuner(tmp_path / "run", served, checkpoint=policy_dir / "checkpoint", every=64, lr=3e-3, epochs=8)
    behaviour = PPOPolicy(path=served)
    rng = np.random.default_rng(0)
    obs = rng.uniform(-1, 1, (65, WORKERS, 16)).astype(np.float32)
    logits = behaviour.logits(obs).astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    batch = []
    for i in range(64):
        actions = np.array([rng.choice(len(row), p=row) for row in p[i]])
        batch.append(Transition(position=2 * i, decision=2 * i, generation=0, obs=obs[i].ravel(),
                                next_obs=obs[i + 1].ravel(), actions=actions, logits=logits[i].ravel().astype(np.float32),
                                logp=float(np.log(p[i, np.arange(WORKERS), actions]).sum()),
                                reward=float(actions[0] == KEEP)))
    assert tuner.update(batch)["generation"] == 1

    def keep_probability(directory):
        out = PPOPolicy(path=directory).logits(obs[:64])[:, 0]
        q = np.exp(out - out.max(-1, keepdims=True))
        return float((q[:, KEEP] / q.sum(-1)).mean())

    before, after = keep_probability(policy_dir), keep_probability(generation_dir(served, 1))
    assert after > before + 0.03, (before, after)


@pytest.mark.timeout(180)
def test_reward_collapse_rolls_back_to_the_previous_generation(policy_dir, tmp_path):
    from dynamix_byteps.policy.ppo.finetune import FineTuner

    served = served_copy(policy_dir, tmp_path)
    run = tmp_path / "run"
    policy = PPOPolicy(path=served)
    job = FakeJob(policy, run, collapse=lambda generation: generation == 1)
    tuner = FineTuner(run, served, checkpoint=policy_dir / "checkpoint", every=8, window=4)
    try:
        job.decisions(9)
        assert [e["event"] for e in tuner.step()] == ["publish"]
        policy.refresh(wait=True)
        job.decisions(6)  # the loss now rises under generation 1
        events = tuner.step()
        assert [e["event"] for e in events] == ["rollback"]
        rollback = events[0]
        assert rollback["rollback_of"] == 1 and rollback["restored"] == 0 and rollback["generation"] == 2
        assert rollback["window_mean"] < rollback["threshold"]
        manifest = read_manifest(served)
        assert manifest.number == 2 and manifest["rollback_of"] == 1 and manifest.path(served) == served.resolve()
        policy.refresh(wait=True)
        assert policy.generation == 2 and policy.directory == served.resolve()
        job.decisions(2)  # the loss falls again, so the guardrails hand back to the network
    finally:
        job.close()
    assert records(run)[-1]["terms"]["generation"] == 2
    # the learner is back on generation 0's weights
    import torch

    from dynamix_byteps.policy.ppo.export import load_module
    base = load_module(policy_dir / "checkpoint").state_dict()
    assert all(torch.equal(base[k], v) for k, v in tuner.module.state_dict().items())


# ---- bpslaunch --fine-tune -----------------------------------------------------------------------


def processes_naming(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (read from /proc; nothing is signalled)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.timeout(240)
def test_bpslaunch_fine_tune_runs_the_trainer_and_reaps_it(policy_dir, tmp_path):
    log_dir = tmp_path / "log"
    job = subprocess.Popen([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--policy", "ppo",
                            "--policy-path", str(policy_dir), "--fine-tune", "--monitor", "off", "--log-dir",
                            str(log_dir), "--", sys.executable, "-c", "import time; time.sleep(300)"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "fine-tuning" not in ((log_dir / "finetune.log").read_text() if (log_dir / "finetune.log").exists() else ""):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.poll() is not None else "no trainer"
            time.sleep(0.5)
        trainers = [pid for pid in processes_naming(str(log_dir)) if b"policy\x00finetune\x00" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(trainers) == 1
        served = log_dir / "policy"
        assert (served / POLICY_FILE).is_file() and not (policy_dir / "generations").exists()
        scheduler = [pid for pid in processes_naming(str(log_dir)) if b"cli\x00scheduler\x00" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert scheduler and f"path={served}".encode() in Path(f"/proc/{scheduler[0]}/cmdline").read_bytes()
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=60)
        deadline = time.monotonic() + 20
        while processes_naming(str(log_dir)):
            assert time.monotonic() < deadline, f"left behind: {processes_naming(str(log_dir))}"
            time.sleep(0.2)
    finally:
        kill_tree(job)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["--fine-tune"], "--fine-tune needs --policy"),
    (["--policy", "static", "--fine-tune"], "--fine-tune needs --policy ppo"),
])
def test_bpslaunch_refuses_fine_tune_without_a_ppo_policy(args, needle):
    result = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", *args, "--", "true"],
                            check=False, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2 and needle in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_a_checkpoint_with_another_ladder_than_the_served_policy_is_refused(policy_dir, tmp_path):
    """Its generations would size batches with rungs the served policy never chose."""
    from dynamix_byteps.policy.ppo.finetune import FineTuner
    from dynamix_byteps.policy.ppo.mdp import LADDERS

    served = served_copy(policy_dir, tmp_path)
    meta = json.loads((served / FEATURES_FILE).read_text())
    meta["actions"]["ladder"] = list(LADDERS["fine"])  # same length as the checkpoint's coarse ladder
    (served / FEATURES_FILE).write_text(json.dumps(meta))
    with pytest.raises(ConfigurationError, match="action ladder .* is not the served policy's"):
        FineTuner(tmp_path / "run", served, checkpoint=policy_dir / "checkpoint")


@pytest.mark.timeout(60)
def test_bpslaunch_refuses_fine_tune_of_a_policy_without_checkpoint(policy_dir, tmp_path):
    served = served_copy(policy_dir, tmp_path)
    result = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--policy", "ppo",
                             "--policy-path", str(served), "--fine-tune", "--log-dir", str(tmp_path / "run"),
                             "--", "true"], check=False, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2 and "no RLlib checkpoint" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_bpslaunch_refuses_fine_tune_without_a_log_dir(policy_dir):
    # The generations would be published into the job's temporary folder and deleted with it.
    result = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--policy", "ppo",
                             "--policy-path", str(policy_dir), "--fine-tune", "--", "true"],
                            check=False, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2 and "--fine-tune needs --log-dir" in result.stderr, result.stderr


# ---- the decision-log reader -----------------------------------------------------------------
# The fine-tuning trainer's reader of the decision log keeps only decision records.


def test_lines_that_are_not_decision_records_are_skipped(tmp_path, caplog):
    log = tmp_path / "decisions.jsonl"
    good = [{"decision": d, "step": 2 * d, "reward": {"loss": 1.0}} for d in (1, 2)]
    log.write_text("\n".join([json.dumps(good[0]), "5", "[1, 2]", '{"decision": 9}', '{"step": "x"}',
                              "{not json", json.dumps(good[1]), '{"step": 3']))
    tail = DecisionTail(log)
    # the partial last line waits; the others would crash the trainer's step
    assert tail.read() == [DecisionRecord.from_dict(g) for g in good]
    assert caplog.text.count("skipping a malformed line") == 5


def _decision(index, step, loss, sizes, *, settling=False):
    if settling:
        terms = {"guard": {"settling": [0]}}
    else:
        terms = {"obs": [[0.0] * 3] * 2, "logits": [0.0] * 10, "logp": -1.0, "actions": [2, 2], "generation": 0}
    return DecisionRecord(decision=index, step=step, batch_sizes_before=sizes, batch_sizes=sizes, terms=terms,
                          reward={"loss": loss, "step_time_s": 0.1})


def test_a_transition_spans_the_settling_waits_after_a_decision():
    from dynamix_byteps.policy.ppo.finetune import transitions
    from dynamix_byteps.policy.ppo.mdp import RewardWeights

    log = [_decision(1, 10, 2.0, [32, 32]), _decision(2, 20, 1.9, [32, 32], settling=True),
           _decision(3, 30, 1.5, [32, 32]), _decision(4, 40, 1.4, [32, 32]),
           _decision(6, 60, 1.0, [32, 32])]  # decision 5 is missing: no transition from 4
    found = transitions(log, RewardWeights(), first_loss=2.0, ref_interval_s=1.0)
    assert [(t.decision, t.position) for t in found] == [(1, 0), (3, 1)]
    from_waits = transitions(log[:1] + log[2:3], RewardWeights(), first_loss=2.0, ref_interval_s=1.0)
    assert from_waits == []  # without the wait line the indices 1 → 3 have a gap
    assert found[0].reward > found[1].reward  # 2.0 → 1.5 over both intervals, against 1.5 → 1.4


# ---- reusing a --log-dir ---------------------------------------------------------------------
# ``bpslaunch --fine-tune`` reusing a --log-dir: the served copy must be of the same policy.


def test_a_run_dir_serving_another_policy_is_refused(tmp_path):
    first, other = library_root() / "small-cnn-sgd", library_root() / "small-cnn-adam"
    served = prepare_served(first, tmp_path)
    assert prepare_served(first, tmp_path) == served  # a restarted job goes on with its copy
    with pytest.raises(ConfigurationError, match="another policy"):
        prepare_served(other, tmp_path)  # was: silently served first's copy (and its generations)


# ---- a policy trained on several worker counts -----------------------------------------------
# Online fine-tuning of a policy trained on several worker counts (``policy train --workers 4,8``).
#
# Such a checkpoint's module is ``padded`` (its training observations carry a worker mask); a real
# job's decisions do not, so the trainer's learner must read them unpadded, or every update fails.


@pytest.fixture(scope="module")
def padded_policy_dir(tmp_path_factory):
    """An untrained padded policy (as ``--workers 4,8`` trains): checkpoint/ + policy.onnx + features.json."""
    import gymnasium as gym
    import numpy as np
    import torch
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from dynamix_byteps.policy.ppo.export import (
        MODULE_SUBDIR,
        export_module,
        load_module,
    )
    from dynamix_byteps.policy.ppo.features import CLIP, NUM_FEATURES
    from dynamix_byteps.policy.ppo.mdp import LADDER, RewardWeights
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("finetune-padded") / "policy"
    largest = 2 * WORKERS
    spec = RLModuleSpec(module_class=PerWorkerPPOModule,
                        observation_space=gym.spaces.Box(-CLIP, CLIP, (largest * (NUM_FEATURES + 1),), np.float32),
                        action_space=gym.spaces.MultiDiscrete([len(LADDER)] * largest),
                        model_config={"hidden": 16, "padded": True,
                                      "dynamix": {"reward": RewardWeights().to_dict()}})
    spec.build().save_to_path(str((out / "checkpoint" / MODULE_SUBDIR).resolve()))
    export_module(load_module(out / "checkpoint"), out)
    return out


@pytest.mark.timeout(180)
def test_a_policy_trained_on_several_worker_counts_is_fine_tuned(padded_policy_dir, tmp_path):
    from dynamix_byteps.policy.ppo.finetune import FineTuner

    served = served_copy(padded_policy_dir, tmp_path)
    run = tmp_path / "run"
    job = FakeJob(PPOPolicy(path=served, explore="true", seed=0), run)
    tuner = FineTuner(run, served, checkpoint=padded_policy_dir / "checkpoint", every=8, window=2)
    try:
        job.decisions(9)  # 8 transitions of generation 0
        events = tuner.step()
    finally:
        job.close()
    assert [e["event"] for e in events] == ["publish"], events  # was "failed": observation size not a multiple of F+1
    assert (generation_dir(served, 1) / "policy.onnx").is_file()
