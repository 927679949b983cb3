"""Damaged policy directories and checkpoints, as a user's disk or hand edit leaves them: each is
refused with an error naming the file, never a traceback (``dynamix policy eval | export``,
``--policy-path``, the library listing)."""

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import clean_env, kill_tree, wait_until

from dynamix_byteps.cli import main
from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy import make_policy
from dynamix_byteps.policy.ppo import library
from dynamix_byteps.policy.ppo.mdp import RewardWeights

pytest.importorskip("onnxruntime")

NOT_UTF8 = b'\xff\xfe{"format": 1}'


@pytest.fixture
def policy_copy(tmp_path):
    """A copy of a library policy (policy.onnx + features.json) to damage."""
    copy = tmp_path / "p"
    shutil.copytree(library.library_root() / "small-cnn-sgd", copy)
    return copy


def test_a_features_json_that_is_not_utf8_is_refused_naming_it(policy_copy):
    """It raised UnicodeDecodeError with a traceback from --policy-path, the scheduler and eval."""
    (policy_copy / "features.json").write_bytes(NOT_UTF8)
    with pytest.raises(ConfigurationError, match=f"cannot read {policy_copy / 'features.json'}: 'utf-8' codec"):
        make_policy("ppo", path=policy_copy)


@pytest.mark.timeout(60)
def test_a_file_given_as_policy_path_is_named_with_what_a_policy_directory_holds(policy_copy, tmp_path):
    """`bpslaunch --policy ppo --policy-path FILE` said "<FILE's folder>/features.json is missing: <FILE's
    folder> is not a policy directory", naming a folder the user never gave. A policy's own
    policy.onnx still names its directory (the scheduler's help shows path=policy.onnx)."""
    given = tmp_path / "notes.txt"
    given.write_text("not a policy")
    done = subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", "-n", "2", "--policy", "ppo",
                           "--policy-path", str(given), "--", "true"],
                          capture_output=True, text=True, timeout=30, check=False, env=clean_env())
    assert done.returncode == 2, done.stderr
    assert (f"--policy-path: policy path {given} is a file, not a policy directory; pass the directory holding "
            "policy.onnx and features.json") in done.stderr, done.stderr
    assert make_policy("ppo", path=policy_copy / "policy.onnx").directory == policy_copy


def test_a_library_policy_json_that_is_not_utf8_is_listed_as_unreadable(tmp_path, monkeypatch, capsys):
    shutil.copytree(library.library_root() / "small-cnn-sgd", tmp_path / "damaged")
    (tmp_path / "damaged" / library.INFO_FILE).write_bytes(NOT_UTF8)
    monkeypatch.setattr(library, "library_root", lambda: tmp_path)
    assert "cannot read policy.json" in library.entries()["damaged"]["error"]
    assert main(["policy", "list"]) == 0
    assert "1 policies in" in capsys.readouterr().out


@pytest.mark.parametrize("training, needle", [
    ("x", "its 'training' section must be a JSON object"),
    ({"reward": "x"}, "reward weights must be an object of name: number, not str"),
    ({"reward": [1, 2]}, "reward weights must be an object of name: number, not list"),
    ({"reward": {"progress": "a"}}, "reward weight progress='a' must be a finite number >= 0"),
    ({"reward": {"progress": None}}, "reward weight progress=None must be a finite number >= 0"),
])
def test_eval_refuses_a_malformed_training_reward_naming_the_file(policy_copy, capsys, training, needle):
    """`dynamix policy eval` raised AttributeError or ValueError with a traceback."""
    features = policy_copy / "features.json"
    features.write_text(json.dumps(json.loads(features.read_text()) | {"training": training}))
    assert main(["policy", "eval", str(policy_copy), "--scenario", "straggler", "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert str(features) in err and needle in err, err


def test_reward_weights_from_a_dict_keep_numbers_as_floats_and_default_without_one():
    assert RewardWeights.from_dict({"progress": 2}).progress == 2.0
    assert isinstance(RewardWeights.from_dict({"progress": 2}).progress, float)
    assert RewardWeights.from_dict(None) == RewardWeights()


@pytest.fixture
def damaged_checkpoint(tmp_path):
    """A small RLlib checkpoint of the policy module whose weights file was cut short (a copy
    interrupted, a full disk)."""
    pytest.importorskip("ray")
    import gymnasium as gym
    import numpy as np
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from dynamix_byteps.policy.ppo.features import NUM_FEATURES
    from dynamix_byteps.policy.ppo.mdp import LADDER
    from dynamix_byteps.policy.ppo.module import PerWorkerPPOModule

    checkpoint = tmp_path / "checkpoint"
    RLModuleSpec(module_class=PerWorkerPPOModule,
                 observation_space=gym.spaces.Box(-np.inf, np.inf, (2 * NUM_FEATURES,), np.float32),
                 action_space=gym.spaces.MultiDiscrete([len(LADDER)] * 2),
                 model_config={"hidden": 8}).build().save_to_path(str(checkpoint))
    weights = checkpoint / "module_state.pkl"
    weights.write_bytes(weights.read_bytes()[:1000])
    return checkpoint


@pytest.mark.timeout(120)
def test_export_refuses_a_damaged_checkpoint_naming_it(damaged_checkpoint, tmp_path, capsys):
    """It raised _pickle.UnpicklingError with a traceback."""
    assert main(["policy", "export", str(damaged_checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"cannot load {damaged_checkpoint}: a file of it is damaged (UnpicklingError" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_train_refuses_a_damaged_init_checkpoint_before_starting_ray(damaged_checkpoint, tmp_path, capsys):
    """It started Ray, built the algorithm (~15 s) and then raised UnpicklingError with a traceback."""
    import ray

    out = tmp_path / "out"
    assert main(["policy", "train", "--scenario", "straggler", "--out", str(out), "--iterations", "1", "--quiet",
                 "--init", str(damaged_checkpoint)]) == 2
    assert "a file of it is damaged" in capsys.readouterr().err
    assert not ray.is_initialized() and not out.exists()


IN_RAY_SESSION = """
import time
from dynamix_byteps.policy.ppo.train import ray_session
with ray_session():
    print("ready", flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_sigterm_during_training_stops_ray_and_removes_its_directory():
    """`dynamix policy train` killed by SIGTERM (a job scheduler, `timeout`) dumped Ray's stack
    trace and aborted (SIGABRT, a core file where enabled), leaving its /tmp/dynamix-ray-* folder."""
    pytest.importorskip("ray")
    scratch = Path(tempfile.mkdtemp(prefix="dxs", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    job = subprocess.Popen([sys.executable, "-c", IN_RAY_SESSION], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True, env=clean_env(TMPDIR=str(scratch)))
    try:
        assert job.stdout.readline().strip() == "ready"
        assert wait_until(lambda: list(scratch.glob("dynamix-ray-*/session_*")), timeout=30)
        time.sleep(1)  # Ray's handlers are in place once ray.init has returned
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
        assert job.returncode == 128 + signal.SIGTERM, output
        assert "SIGTERM received" not in output, output
        assert not list(scratch.glob("dynamix-ray-*"))
    finally:
        kill_tree(job)
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.timeout(150)
def test_a_sigkilled_training_leaves_none_of_ray_s_processes_nor_its_directory():
    """`dynamix policy train` SIGKILLed (the OOM killer, `kill -9`) left Ray's dashboard and runtime-env
    agents running ~65 s (Ray ties only the processes it starts itself to the trainer; the agents, the
    raylet's, wait on the dead GCS before they exit) and its /tmp/dynamix-ray-* folder for good."""
    pytest.importorskip("ray")
    scratch = Path(tempfile.mkdtemp(prefix="dxk", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    job = subprocess.Popen([sys.executable, "-m", "dynamix_byteps", "policy", "train", "--scenario", "straggler",
                            "--iterations", "1000", "--out", str(scratch / "out"), "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env=clean_env(TMPDIR=str(scratch)))
    started = []
    try:
        trainer = psutil.Process(job.pid)
        # Ray took over 60 s to start its workers at a load of 19 (other tests and helpers on 2 cores)
        assert wait_until(lambda: "ray::IDLE" in {p.name() for p in trainer.children(recursive=True)}, timeout=110)
        time.sleep(1)  # the raylet has started its agents and workers
        started = trainer.children(recursive=True)
        job.kill()
        job.wait()
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, [p.name() for p in alive]
        assert wait_until(lambda: not list(scratch.glob("dynamix-*")), timeout=5), list(scratch.iterdir())
    finally:
        kill_tree(job)
        for process in started:
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.timeout(180)
def test_a_training_stopped_before_its_export_leaves_no_earlier_policy_beside_its_checkpoint(policy_copy, monkeypatch):
    """Trained into the folder of an earlier policy and stopped (Ctrl-C, SIGTERM, an ExportError)
    between saving its checkpoint and exporting, the folder held the new checkpoint beside the old
    policy.onnx and features.json, which the scheduler served and `bpslaunch --fine-tune` took for
    the checkpoint's own (it then published the checkpoint's other weights as generation 1)."""
    pytest.importorskip("ray")
    from dynamix_byteps.policy.ppo import export
    from dynamix_byteps.policy.ppo.policy_format import read_metadata
    from dynamix_byteps.policy.ppo.train import train

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "export_module", stopped)
    with pytest.raises(KeyboardInterrupt):
        train(policy_copy, ["straggler"], iterations=1, randomise=False, progress=False,
              train_batch_size_per_learner=64, minibatch_size=64, num_epochs=1)
    assert (policy_copy / "checkpoint" / "rllib_checkpoint.json").is_file()
    with pytest.raises(ConfigurationError, match="features.json is missing"):
        read_metadata(policy_copy)
    assert not list(policy_copy.glob(".checkpoint.*"))


@pytest.mark.timeout(120)
def test_an_interrupt_during_ray_s_shutdown_still_removes_its_directory(monkeypatch):
    """Ctrl-C at the end of a training lands in ray.shutdown (seconds long), which skipped the
    removal of /tmp/dynamix-ray-* after it."""
    ray = pytest.importorskip("ray")
    from dynamix_byteps.policy.ppo.train import ray_session

    scratch = Path(tempfile.mkdtemp(prefix="dxs", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    shutdown = ray.shutdown

    def interrupted(*args, **kwargs):
        shutdown(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "shutdown", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt), ray_session():
            assert list(scratch.glob("dynamix-ray-*"))
        assert not list(scratch.glob("dynamix-ray-*"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize("damaged, content", [("policy.onnx", b"\x08\x07"), ("manifest.json", b"{bad")])
def test_a_damaged_fine_tuned_copy_kept_in_the_log_dir_is_refused_before_the_job_starts(tmp_path, damaged, content):
    """bpslaunch --fine-tune reusing a --log-dir keeps RUN/policy; damaged, it was taken as it was,
    the scheduler then refused it after start with 'did not become ready' and advice, re-export
    the policy, that does not apply to the copy."""
    from dynamix_byteps.policy.ppo.served import prepare_served

    source = library.library_root() / "small-cnn-sgd"
    served = prepare_served(source, tmp_path)
    (served / damaged).write_bytes(content)
    with pytest.raises(ConfigurationError, match=f"{served}, the fine-tuned copy .* cannot be served: .*"
                                                 f"Remove {served} to start again from {source}") as error:
        prepare_served(source, tmp_path)
    assert "re-export" not in str(error.value)  # said so for a damaged policy.onnx: no advice for a copy


@pytest.mark.parametrize("spec", ["progress", "progress="])
def test_a_reward_flag_without_its_number_is_named_as_such(tmp_path, capsys, spec):
    """`--reward progress` said 'reward weight progress=nan must be a finite number >= 0', a
    value the user never gave."""
    assert main(["policy", "train", "--scenario", "straggler", "--out", str(tmp_path / "p"), "--reward", spec]) == 2
    err = capsys.readouterr().err
    assert f"argument --reward: {spec!r} is not KEY=NUMBER" in err and "nan" not in err, err
    assert not (tmp_path / "p").exists()
