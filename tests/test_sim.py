"""The training simulator, the agent's observation and its action ladder (no Ray, no torch)."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import make_policy
from dynamix_byteps.policy.base import ClusterState, WorkerState
from dynamix_byteps.policy.ppo.features import FEATURES, NUM_FEATURES, observation
from dynamix_byteps.policy.ppo.mdp import (
    KEEP,
    LADDER,
    RewardWeights,
    apply_actions,
    apply_ladder,
    check_ladder,
    keep_index,
    ladder_actions,
    ladder_factors,
)
from dynamix_byteps.policy.sim import (
    CommParams,
    SimParams,
    Simulator,
    StatParams,
    WorkerParams,
    from_scenario,
    reference,
)
from dynamix_byteps.policy.sim.env import DynamixSimEnv
from dynamix_byteps.policy.sim.evaluate import compare, run_episode
from dynamix_byteps.policy.sim.params import starting_at
from dynamix_byteps.policy.sim.randomise import randomised
from dynamix_byteps.scenarios import scenario

pytestmark = pytest.mark.timeout(120)
F = {name: i for i, name in enumerate(FEATURES)}


def job(name="straggler", workers=None):
    return from_scenario(scenario(name), workers=workers)


# ---- environment -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [4, 3])
def test_gymnasium_check_env_passes(workers):
    env = DynamixSimEnv({"scenarios": ["straggler", "interference"], "workers": workers})
    check_env(env, skip_render_check=True)
    assert env.observation_space.shape == (workers * NUM_FEATURES,)
    assert list(env.action_space.nvec) == [len(LADDER)] * workers


def test_env_episode_ends_at_the_target_and_is_reproducible():
    def episode(seed):
        env = DynamixSimEnv({"scenarios": ["two-speed"]})
        obs, _ = env.reset(seed=seed)
        trace = [obs]
        while True:
            obs, _, terminated, truncated, info = env.step(np.full(4, KEEP))
            trace.append(obs)
            if terminated or truncated:
                return np.array(trace), terminated, info

    a, terminated, info = episode(3)
    b, _, _ = episode(3)
    c, _, _ = episode(4)
    assert terminated and info["time_to_target_s"] > 0 and info["loss"] <= StatParams().target_loss
    assert np.array_equal(a, b) and not (a.shape == c.shape and np.array_equal(a, c))
    assert np.all(np.abs(a) <= 5.0) and a.dtype == np.float32


@pytest.mark.parametrize("config, needle", [({"scenarios": ["nope"]}, "unknown scenario"),
                                            ({"workers": 0}, "workers"), ({"bogus": 1}, "bogus"),
                                            ({"reward": {"speed": 1.0}}, "unknown reward weight")])
def test_env_rejects_bad_configuration(config, needle):
    with pytest.raises(ConfigurationError, match=needle):
        DynamixSimEnv(config)


# ---- parameters --------------------------------------------------------------------------------


def test_params_round_trip_through_json(tmp_path):
    params = randomised(job("interference", workers=6), np.random.default_rng(0))
    params = dataclasses.replace(params, workers=params.workers[:5] + (dataclasses.replace(
        params.workers[5], bandwidth_bytes_per_s=1e7),))
    params.to_json(tmp_path / "sim.json")
    assert SimParams.from_json(tmp_path / "sim.json") == params


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(bogus=1), "bogus"),
    (lambda d: d["workers"][0].update(speed=1), "speed"),
    (lambda d: d["stats"].update(target_loss=5.0), "target_loss"),
    (lambda d: d.update(initial_batch=[32]), "initial_batch"),
    (lambda d: d["workers"][0].update(samples_per_s=-1), "samples_per_s"),
    (lambda d: d["stats"].update(loss_tail=0), "loss_tail"),
])
def test_params_reject_bad_fields(mutate, needle):
    data = reference().to_dict()
    mutate(data)
    with pytest.raises(ConfigurationError, match=needle):
        SimParams.from_dict(data)


@pytest.mark.parametrize("field, value", [
    ("max_batch", None), ("max_batch", "x"), ("min_batch", []), ("dataset_size", None), ("dataset_size", {}),
    ("decision_interval", 2.5), ("decision_interval", True), ("max_decisions", "250"),
    ("initial_batch", ["x", 32, 32, 32]), ("initial_batch", [float("nan"), 32, 32, 32]),
    ("initial_batch", [32.9, 32, 32, 32]), ("node_metrics", "no"),
])
def test_a_job_field_of_another_type_is_refused_naming_it_and_the_file(tmp_path, field, value):
    """A hand-edited --sim-params file: these raised TypeError or ValueError from a comparison,
    an int() or numpy, with a traceback, or were truncated (32.9 trained as 32)."""
    data = reference().to_dict()
    data[field] = value
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigurationError, match=f"{path}: simulator parameter {field}"):
        SimParams.from_json(path)

@pytest.mark.parametrize("section, field, value, valid", [
    ("stats", "gap_free_ratio", 1e308, "[1e-06, 1e+06]"), ("stats", "noise_growth", 1e308, "[0, 10]"),
    ("stats", "noise_growth", 1e30, "[0, 10]"), ("stats", "measured_noise_growth", 1e30, "[0, 10] or null"),
    ("stats", "noise_scale", 1e308, "(0, 1e+12]"), ("comm", "model_bytes", 1e308, "[0, 1e+15]"),
    ("comm", "jitter", 1e30, "[0, 10]"), ("workers", "jitter", 1e30, "[0, 10]"),
    ("workers", "samples_per_s", 1e-300, "[1e-06, 1e+12]"), ("slowdowns", "factor", 1e308, "[1, 1e+06]"),
])
def test_an_absurd_number_is_refused_at_load_with_its_range_naming_the_file(tmp_path, section, field, value, valid):
    """Well-typed but absurd --sim-params values crashed `dynamix policy eval` mid-episode: OverflowError
    (noise_growth 1e30: x ** gamma), 'math domain error' (gap_free_ratio 1e308: log2(m / inf)), or
    'noise_scale=inf must be a finite number' once randomisation scaled 1e308."""
    data = reference().to_dict()
    if section == "workers":
        data["workers"][0][field] = value
    elif section == "slowdowns":
        data["workers"][0]["slowdowns"] = [{"factor": value, "start": 0.0, "end": 1.0}]
    else:
        data[section][field] = value
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigurationError) as refused:
        SimParams.from_json(path)
    assert str(refused.value) == f"{path}: simulator parameter {field}={value!r} must be a number in {valid}"


def test_a_job_at_the_upper_bounds_simulates_randomised_without_a_math_error():
    """The ranges keep the simulator's arithmetic finite (the losses and accuracies keep their order)."""
    data = reference().to_dict()
    ordered = {"initial_loss", "min_loss", "target_loss", "chance_accuracy", "max_accuracy"}
    for cls, values in ((StatParams, data["stats"]), (CommParams, data["comm"]), (WorkerParams, data["workers"][0])):
        for f in dataclasses.fields(cls):
            if "range" in f.metadata and f.name not in ordered:
                values[f.name] = f.metadata["range"][1]
    sim = Simulator(randomised(SimParams.from_dict(data), np.random.default_rng(0)), rng=np.random.default_rng(0))
    sim.reset()
    assert math.isfinite(sim.step([32] * 4).reward)


@pytest.mark.parametrize("data", [[1, 2], "x", None, 3])
def test_params_that_are_not_a_json_object_are_refused(data):
    with pytest.raises(ConfigurationError, match="must be a JSON object"):  # was a TypeError for a list
        SimParams.from_dict(data)


def test_scenarios_tile_to_more_workers():
    p = job("straggler", workers=8)
    slowed = [r for r, w in enumerate(p.workers) if w.slowdowns]
    assert slowed == [3, 7] and p.workers[3].slowdown_at(0.5) == 3.0
    net = job("network", workers=8)
    assert [w.bandwidth_bytes_per_s for w in net.workers].count(100e6 / 8) == 2
    inter = job("interference")
    assert inter.workers[1].slowdown_at(0.1) == 1.0 and inter.workers[1].slowdown_at(0.5) == 3.0


# ---- dynamics ----------------------------------------------------------------------------------


def test_step_time_and_push_pull_follow_the_model():
    params = dataclasses.replace(job("straggler"), workers=tuple(dataclasses.replace(w, jitter=0.0)
                                                                 for w in job("straggler").workers))
    params = dataclasses.replace(params, comm=dataclasses.replace(params.comm, jitter=0.0))
    sim = Simulator(params, rng=np.random.default_rng(0))
    state = sim.reset()
    w = params.workers[0]
    comm = params.comm.latency_s + 2 * params.comm.model_bytes / params.comm.bandwidth_bytes_per_s
    fast = w.fixed_s + 32 / w.samples_per_s
    assert [s.compute_s for s in state.workers] == pytest.approx([fast, fast, fast, 3 * fast])
    assert state.workers[3].push_pull_s == pytest.approx(comm)  # the straggler does not wait
    assert state.workers[0].push_pull_s == pytest.approx(comm + 2 * fast)
    assert sim.time_s == pytest.approx(params.decision_interval * (3 * fast + comm))
    assert state.workers[0].samples_per_s == pytest.approx(32 / fast)


def test_noise_scale_grows_as_the_loss_falls():
    sim = Simulator(reference(), rng=np.random.default_rng(0))
    s = StatParams()
    values = [sim.noise_scale(loss) for loss in np.linspace(s.initial_loss, s.target_loss, 6)]
    assert values[0] == pytest.approx(s.noise_scale) and all(b > a for a, b in itertools.pairwise(values))


def test_a_loss_tail_falls_fast_then_slowly_and_tends_to_the_exponential():
    s = StatParams()
    steps = np.array([0.0, 0.5, 1.0, 4.0]) * s.steps_scale
    exponential = s.remaining(steps)
    assert exponential == pytest.approx(np.exp(-steps / s.steps_scale))
    tail = dataclasses.replace(s, loss_tail=1.0).remaining(steps)
    assert tail[0] == 1.0 and tail[-1] == pytest.approx(1 / 5)  # (1 + 4)^-1: 10x the exponential's e^-4
    assert dataclasses.replace(s, loss_tail=1e6).remaining(steps) == pytest.approx(exponential, rel=1e-4)
    sims = [Simulator(dataclasses.replace(reference(), stats=stats), rng=np.random.default_rng(0))
            for stats in (s, dataclasses.replace(s, loss_tail=1.0))]
    for sim in sims:
        sim.reset()
        while not sim.done:
            sim.step(sim.batch)
    assert sims[1].time_s > 1.5 * sims[0].time_s  # the same job, slower to the target with the tail


def _schedule(params, early, late, seed=0):
    """Global batch × early until half way to the target, × late after; returns the simulator."""
    sim = Simulator(params, rng=np.random.default_rng(seed))
    sim.reset()
    while not sim.done:
        factor = early if sim.fraction() < 0.5 else late
        sim.step([int(b * factor) for b in params.initial_batch])
    return sim


def test_large_batches_cost_accuracy_late_but_not_early():
    params = reference()
    base, early_large, late_large = _schedule(params, 1, 1), _schedule(params, 4, 1), _schedule(params, 1, 4)
    assert base.gap == 0.0
    assert early_large.gap < 0.2 * late_large.gap
    assert late_large.accuracy() < early_large.accuracy() <= base.accuracy()
    assert early_large.time_to_target < base.time_to_target  # the reference job is communication-bound


def test_reward_terms_add_up_and_the_accuracy_term_comes_at_the_end():
    weights = RewardWeights()
    sim = Simulator(reference(), weights, np.random.default_rng(1))
    sim.reset()
    total_progress, total_accuracy = 0.0, 0.0
    while not sim.done:
        out = sim.step([32, 32, 32, 64])
        total_progress += out.terms["progress"]
        total_accuracy += out.terms["accuracy"]
        assert sim.done or out.terms["accuracy"] == 0.0
        assert out.reward == pytest.approx(sum(out.terms.values()))
    first_loss_drop = StatParams().initial_loss - sim.loss_history[0]  # the first interval ran before any decision
    assert total_progress == pytest.approx(1.0 - first_loss_drop / 1.9, abs=0.02)
    assert sim.gap > 0 and out.terms["batch_change"] == 0.0
    assert total_accuracy == pytest.approx(weights.accuracy * (sim.accuracy() - sim.target_accuracy()))


# ---- heuristics in the simulator ---------------------------------------------------------------


def test_heuristics_behave_as_designed_in_the_simulator():
    rows = {r["policy"]: r for r in compare({n: make_policy(n) for n in ("static", "proportional", "goodput")},
                                             [job("straggler")], episodes=2, seed=7)}
    static, prop, good = rows["static"], rows["proportional"], rows["goodput"]
    assert static["mean_global_batch"] == prop["mean_global_batch"] == 128  # neither changes the global batch
    assert prop["mean_time_to_target_s"] < 0.8 * static["mean_time_to_target_s"]  # balancing the straggler pays
    assert prop["mean_return"] > static["mean_return"]
    assert good["mean_global_batch"] > 128 and good["mean_gap"] > 0  # it grows the batch as B_noise grows


def test_goodput_grows_the_global_batch_as_training_progresses():
    result = run_episode(make_policy("goodput"), job("homogeneous"), seed=0)
    n = len(result.global_batches)
    assert np.mean(result.global_batches[-n // 4:]) > 1.5 * np.mean(result.global_batches[: n // 4])


# ---- observation -------------------------------------------------------------------------------


def _state(**overrides):
    workers = tuple(WorkerState(rank=r, batch_size=b, compute_s=c, push_pull_s=p, samples_per_s=b / c, min_batch=8,
                                max_batch=256, node={"cpu_util": 0.5, "rtt_s": 1e-3, "retransmits": 0})
                    for r, (b, c, p) in enumerate([(32, 0.1, 0.2), (32, 0.1, 0.2), (64, 0.3, 0.01)]))
    fields = {"step": 100, "workers": workers, "initial_batch_sizes": (32, 32, 32),
              "loss_history": (2.0, 1.8, 1.6, 1.5, 1.0), "grad_sq": 1.0, "trace_cov": 512.0, "dataset_size": 60000}
    fields.update(overrides)
    return ClusterState(**fields)


def test_observation_features_mean_what_they_say():
    obs = observation(_state())
    assert obs.shape == (3, NUM_FEATURES) and obs.dtype == np.float32
    assert obs[2, F["log2_batch"]] == pytest.approx(1.0) and obs[0, F["log2_batch"]] == 0.0
    assert obs[0, F["log2_batch_to_min"]] == pytest.approx(2.0) and obs[2, F["log2_batch_to_max"]] == pytest.approx(2.0)
    assert obs[2, F["log2_compute_to_max"]] == 0.0 and obs[0, F["log2_compute_to_max"]] == pytest.approx(math.log2(1 / 3))
    assert obs[0, F["wait_fraction"]] == pytest.approx(0.2 / 0.3)
    assert obs[0, F["log10_rtt_ms"]] == pytest.approx(0.0) and obs[0, F["node_known"]] == 1.0
    assert obs[0, F["log2_global_batch"]] == pytest.approx(math.log2(128 / 96))
    assert obs[0, F["log2_noise_to_batch"]] == pytest.approx(math.log2(512 / 128)) and obs[0, F["noise_known"]] == 1.0
    assert obs[0, F["log2_loss_ratio"]] == pytest.approx(math.log2(0.5))
    assert obs[0, F["loss_trend"]] == pytest.approx(10 * ((1.5 + 1.0) / 2 - (1.8 + 1.6) / 2) / 2.0)
    assert obs[0, F["comm_fraction"]] == pytest.approx(0.01 / 0.31)
    assert (obs[:, len(FEATURES) - 6:] == obs[0, len(FEATURES) - 6:]).all()  # global features on every row


def test_observation_tolerates_missing_and_odd_values():
    odd = tuple(dataclasses.replace(w, samples_per_s=float("nan"), compute_s=0.0, node={})
                for w in _state().workers)
    obs = observation(_state(workers=odd, grad_sq=None, loss_history=(float("nan"), float("inf")), initial_batch_sizes=()))
    assert np.isfinite(obs).all()
    assert (obs[:, F["node_known"]] == 0).all() and (obs[:, F["noise_known"]] == 0).all()
    assert (obs[:, F["log2_loss_ratio"]] == 0).all()
    assert observation(_state(workers=())).shape == (0, NUM_FEATURES)


# ---- actions -----------------------------------------------------------------------------------


def test_ladder_steps_respect_the_change_window_and_the_bounds():
    b = np.array([33, 33, 33, 33, 33, 8, 200])
    new = apply_ladder(b, np.array([0, 1, 2, 3, 4, 0, 4]), np.full(7, 8.0), np.array([1024] * 6 + [256.0]))
    assert new.tolist() == [17, 24, 33, 46, 66, 8, 256]  # ÷2 of 33 stays >= ceil(33/2)
    assert apply_actions(_state(), [KEEP, 4, 4]) == (32, 64, 128)
    with pytest.raises(ValueError, match="action indices"):
        apply_ladder(b, np.full(7, len(LADDER)), np.full(7, 1.0), np.full(7, np.inf))


def test_the_fine_ladder_reaches_sizes_between_the_coarse_rungs():
    fine = ladder_factors("fine")
    new = apply_ladder(np.array([64, 64, 16, 16]), np.array([3, 4, 1, 0]), np.full(4, 16.0), np.full(4, 512.0), fine)
    assert new.tolist() == [76, 90, 16, 16]  # ×1.18, ×1.4; the lower bound holds
    assert apply_actions(_state(), [3, 3, 3], fine) == (38, 38, 76)
    with pytest.raises(ConfigurationError, match="unknown action ladder 'odd'; known: coarse, fine, full"):
        ladder_factors("odd")


def test_ladder_actions_invert_the_ladder_and_keep_inside_the_dead_band():
    full = ladder_factors("full")
    b = np.array([64, 64, 64, 64, 64, 64, 20])
    low, high = np.full(7, 16.0), np.full(7, 512.0)
    wanted = np.array([32, 45, 54, 64, 76, 90, 8])
    actions = ladder_actions(b, wanted, low, high, full)
    assert actions.tolist() == [0, 1, 2, 3, 4, 5, 1]  # 8 is below the bound: 16 (÷1.4 of 20) is nearest
    assert apply_ladder(b, actions, low, high, full)[:6].tolist() == [32, 46, 54, 64, 76, 90]
    one = (b[:1], low[:1], high[:1])
    results = [apply_ladder(one[0], np.array([a]), *one[1:], full)[0] for a in range(len(full))]
    for target in (17.0, 40.0, 70.0, 100.0, 300.0):  # always the rung whose result is nearest
        got = apply_ladder(one[0], ladder_actions(one[0], np.array([target]), *one[1:], full), *one[1:], full)[0]
        assert abs(math.log(got / target)) == pytest.approx(min(abs(math.log(r / target)) for r in results))
    assert ladder_actions(b[:2], np.array([70, 59]), low[:2], high[:2], full, deadband=0.2).tolist() == [3, 3]
    assert ladder_actions(b[:2], np.array([80, 50]), low[:2], high[:2], full, deadband=0.2).tolist() == [4, 2]
    with pytest.raises(ValueError, match="must be equal 1-d shapes"):
        ladder_actions(b, wanted[:3], low, high, full)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        ladder_actions(b, np.zeros(7), low, high, full)


@pytest.mark.parametrize("factors", [[0.5, 1.0], [0.5, 0.7, 1.0, 1.4, 3.0], [0.5, 1.0, 0.7, 1.4, 2.0], [1.0],
                                     [0.5, 0.7, 1.1, 1.4, 2.0], "fine", None, [0.5, 0.7, 1.0, 1.4, float("nan")]])
def test_a_malformed_ladder_is_refused(factors):
    with pytest.raises(ConfigurationError, match="is not an action ladder"):
        check_ladder(factors)
    with pytest.raises(ConfigurationError, match="environment option ladder"):
        DynamixSimEnv({"ladder": factors or [1.0]})


def test_a_policy_runs_through_the_guardrails_on_many_workers():
    for workers in (8, 32):
        result = run_episode(make_policy("proportional"), job("two-speed", workers=workers), seed=1)
        assert result.time_to_target_s is not None and result.decisions > 0


def test_randomised_jobs_stay_valid_and_vary():
    base = job("network")
    draws = [randomised(base, np.random.default_rng(s)) for s in range(20)]
    assert len({d.comm.model_bytes for d in draws}) == 20
    assert {d.node_metrics for d in draws} == {True, False}
    assert all(d.workers[3].bandwidth_bytes_per_s == base.workers[3].bandwidth_bytes_per_s for d in draws)
    assert randomised(base, np.random.default_rng(5)) == randomised(base, np.random.default_rng(5))
    assert isinstance(draws[0].workers[0], WorkerParams)


def test_randomised_noise_laws_keep_the_fitted_growth_and_move_together():
    base = job("homogeneous")
    stats = dataclasses.replace(base.stats, noise_scale=80.0, noise_growth=2.5, measured_noise_scale=10.0,
                                measured_noise_growth=1.2)
    draws = [randomised(dataclasses.replace(base, stats=stats), np.random.default_rng(s)).stats for s in range(30)]
    assert all(0.7 * 2.5 <= d.noise_growth <= 1.3 * 2.5 for d in draws)
    assert min(d.noise_growth for d in draws) < 2.2 < max(d.noise_growth for d in draws)
    for d in draws:  # one draw scales both laws: the measured estimate stays tied to the true B_noise
        assert d.noise_scale / d.measured_noise_scale == pytest.approx(8.0)
        assert d.noise_growth / d.measured_noise_growth == pytest.approx(2.5 / 1.2)


def _references(params: SimParams) -> tuple[float, float]:
    """The job's gap-free global batch and the loss noise at a global batch of 1000."""
    m0 = sum(params.initial_batch)
    return params.stats.gap_free_ratio * m0, params.stats.loss_noise * math.sqrt(m0 / 1000)


def test_another_start_moves_only_the_start_not_the_jobs_gap_or_loss_noise():
    params = dataclasses.replace(job("straggler"), max_decisions=60)
    started = starting_at(params, (256, 128, 256, 64))
    assert started.initial_batch == (256, 128, 256, 64)
    assert _references(started) == pytest.approx(_references(params))
    runs = []
    for p in (params, started):
        sim = Simulator(p, rng=np.random.default_rng(3))
        sim.reset_state()  # reset() would train the first interval at the initial batches
        for _ in range(20):
            sim.step(np.array([128, 128, 128, 32]))
        runs.append((sim.fraction(), sim.accuracy()))
    assert runs[0] == pytest.approx(runs[1])  # the same batches train the same, whatever the start
    with pytest.raises(ConfigurationError, match="must lie within"):
        starting_at(params, (4096,) * 4)
    with pytest.raises(ConfigurationError, match="4 workers"):
        starting_at(params, (64,) * 3)


def test_randomised_starts_move_but_the_jobs_gap_and_loss_noise_stay():
    base = job("straggler")
    draws = [randomised(base, np.random.default_rng(s)) for s in range(20)]
    assert {d.initial_batch[0] for d in draws} == {16, 32, 64}
    for d in draws:
        assert _references(d) == pytest.approx(_references(base))


def test_the_scheduler_is_shown_the_measured_noise_law_and_progress_follows_the_other():
    stats = dataclasses.replace(StatParams(), noise_scale=800.0, measured_noise_scale=100.0, noise_scale_noise=0.0)
    sim = Simulator(dataclasses.replace(reference(), stats=stats), rng=np.random.default_rng(0))
    state = sim.reset()
    assert state.noise_scale == pytest.approx(sim.measured_noise_scale(sim.loss))
    assert sim.measured_noise_scale(sim.loss) == pytest.approx(sim.noise_scale(sim.loss) / 8)
    plain = Simulator(dataclasses.replace(reference(), stats=dataclasses.replace(stats, measured_noise_scale=None)),
                      rng=np.random.default_rng(0))
    assert plain.reset().noise_scale == pytest.approx(plain.noise_scale(plain.loss))  # no law of its own: the same


def test_a_seven_step_ladder_sizes_the_action_space_and_keeps_at_its_middle():
    full = ladder_factors("full")
    env = DynamixSimEnv({"ladder": list(full), "scenarios": ["straggler"]})
    assert list(env.action_space.nvec) == [7] * 4 and full[keep_index(len(full))] == 1.0
    env.reset(seed=0)
    sizes = env.sim.batch.copy()
    env.step(np.full(4, keep_index(len(full))))
    assert (env.sim.batch == sizes).all()
    env.step(np.array([0, 2, 4, 6]))
    assert env.sim.batch.tolist() == [16, 27, 38, 64]


# -- per-worker links under parameter servers ---------------------------------------------------

def _slow_link_job(engine: str):
    from dynamix_byteps.policy.sim.params import SimParams, WorkerParams

    workers = (WorkerParams(jitter=0.0),) * 2 + (WorkerParams(jitter=0.0, bandwidth_bytes_per_s=2.5e6),)
    return SimParams(workers=workers, initial_batch=(32,) * 3, engine=engine)


def test_under_ps_each_worker_moves_its_gradient_over_its_own_link():
    from dynamix_byteps.policy.sim.dynamics import Simulator

    job = _slow_link_job("ps")
    state = Simulator(job, rng=np.random.default_rng(0)).reset()
    assert state.engine == "ps"
    own = [job.comm.latency_s / 2 + job.comm.model_bytes / bw for bw in (1.25e8, 1.25e8, 2.5e6)]
    assert [w.push_s for w in state.workers] == pytest.approx(own, rel=0.2)  # comm jitter 5 %
    assert [w.pull_s for w in state.workers] == [w.push_s for w in state.workers]
    assert [w.exposed_comm_s for w in state.workers] == pytest.approx([2 * w.push_s for w in state.workers])
    ring = Simulator(_slow_link_job("ring"), rng=np.random.default_rng(0)).reset()
    assert ring.engine == "" and all(w.push_s is None and w.pull_s is None for w in ring.workers)


def test_a_smaller_batch_behind_the_slow_link_shortens_the_step_under_ps_only():
    from dynamix_byteps.policy.sim.dynamics import Simulator

    even, shifted = [32, 32, 32], [44, 44, 8]
    ps = Simulator(_slow_link_job("ps"))
    ring = Simulator(_slow_link_job("ring"))
    # ps: the slow link's worker starts its push earlier; the others' extra compute overlaps it
    assert ps.nominal_step_s(shifted) < ps.nominal_step_s(even)
    # ring: everyone waits for the slowest link after the slowest compute, now longer
    assert ring.nominal_step_s(shifted) > ring.nominal_step_s(even)
    # and the proportional policy, shown the simulated ps state, moves in that direction
    decision = make_policy("proportional").decide(ps.reset())
    assert decision.batch_sizes[2] < min(decision.batch_sizes[:2])


def test_the_engine_is_checked_and_survives_json(tmp_path):
    from dynamix_byteps.policy.sim.params import SimParams

    with pytest.raises(ConfigurationError, match="engine='tree'"):
        dataclasses.replace(_slow_link_job("ps"), engine="tree")
    path = tmp_path / "p.json"
    _slow_link_job("ps").to_json(path)
    assert SimParams.from_json(path) == _slow_link_job("ps")
