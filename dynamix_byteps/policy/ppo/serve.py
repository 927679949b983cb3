"""The scheduler's ``ppo`` policy: a trained network served by ONNX Runtime (no Ray, no torch).

A policy directory (written by ``dynamix policy train`` or ``dynamix policy export``) holds

* ``policy.onnx``: input ``obs`` float32 ``(batch, workers, F)``, output ``logits`` float32
  ``(batch, workers, A)``; both leading axes are dynamic, so one file serves any N;
* ``features.json``: format and version, the observation spec
  (:func:`dynamix_byteps.policy.ppo.features.spec`), the action ladder, the reward weights it
  was trained with, the ONNX file's SHA-256 and parameter count, and training metadata.

:class:`PPOPolicy` checks all of it at load (a wrong feature version, ladder, hash or graph
signature is a :class:`~dynamix_byteps.errors.ConfigurationError` naming the fix), then per
decision computes :func:`~dynamix_byteps.policy.ppo.features.observation`, runs the graph on one
intra-op thread and applies the greedy ladder step per worker
(:func:`~dynamix_byteps.policy.ppo.mdp.apply_actions`). It makes no step-time prediction, so the
guardrails skip their hysteresis for it (``reports_gain = False``): the learned "keep" action
and the batch-change cost in its reward play that role. Bounds, the ×2 limit and the fallback on
divergence apply as for every policy (:class:`~dynamix_byteps.policy.guardrails.Guarded`).

Online fine-tuning (:mod:`.finetune`) publishes new generations into the directory
(:mod:`.publish`); :class:`PPOPolicy` notices them with one ``stat`` per decision, loads them
beside the network in force and swaps a reference, and names the deciding generation in every
decision's ``terms``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dynamix_byteps.errors import ConfigurationError
from dynamix_byteps.policy.base import ClusterState, Decision, Policy, integer_option
from dynamix_byteps.policy.ppo.features import NUM_FEATURES, observation
from dynamix_byteps.policy.ppo.mdp import apply_actions
from dynamix_byteps.policy.ppo.policy_format import INPUT, OUTPUT, POLICY_FILE, policy_directory, read_metadata
from dynamix_byteps.policy.ppo.publish import MANIFEST, read_manifest

__all__ = ["PPOPolicy"]

RL_EXTRA = "pip install 'dynamix-byteps[rl]'"
log = logging.getLogger("dynamix_byteps.policy.ppo")


class PPOPolicy(Policy):
    """The ONNX-served DYNAMIX agent (module docstring).

    Args:
        path: a policy directory (or its ``policy.onnx`` / ``features.json``); when it holds a
            ``manifest.json`` (:mod:`.publish`), the generation that names is served, and newer
            ones are swapped in as they are published (:meth:`refresh`, every decision).
        explore: draw each worker's ladder step from softmax(logits) instead of the greedy one
            (online fine-tuning: the logged ``logp`` is then the behaviour policy's); ``true`` /
            ``false`` strings are accepted (``--policy-option explore=true``).
        seed: seeds the draws of ``explore``, a whole number >= 0.
        name: instead of ``path``, a policy of the packaged library (:mod:`.library`, ``ppo:NAME``).

    A job whose worker count lies outside the range the policy was trained on gets one warning
    (:meth:`check_job_size`); the policy is served anyway.

    Raises:
        ValueError: ``seed`` is not a whole number >= 0 (``1.7`` is refused, not truncated).
        ConfigurationError: the directory is not a valid policy for this version (see
            :func:`read_metadata`), an unknown or unusable library ``name`` (the message lists
            the library), or onnxruntime is not installed (names ``pip install
            'dynamix-byteps[rl]'``).
    """

    name = "ppo"
    reports_gain = False

    def __init__(self, *, path=None, explore=False, seed=None, name=None):
        seed = None if seed is None else integer_option("seed", seed, 0)
        label = None
        if name is not None:  # ppo:NAME, a policy of the packaged library
            if path is not None:
                raise ConfigurationError("policy 'ppo' takes a library name (ppo:NAME) or a path, not both")
            from dynamix_byteps.policy.ppo.library import policy_dir

            path = policy_dir(name)
            label = f"ppo:{name}"
        if path is None or str(path) == "":
            raise ConfigurationError("policy 'ppo' needs a trained policy: --policy ppo:NAME from the library "
                                     "(`dynamix policy list`), --policy-path DIR (bpslaunch) or --policy-option path=DIR "
                                     "(dynamix scheduler); train one with `dynamix policy train`")
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise ConfigurationError(f"policy 'ppo' needs onnxruntime: {RL_EXTRA}") from None
        self.explore = _flag(explore, "explore")
        self._rng = np.random.default_rng(seed)
        self.root = policy_directory(path)
        self.label = label or str(self.root)  # how warnings name the policy
        self._sizes_warned: set[int] = set()
        self._stamp = _stamp(self.root / MANIFEST)
        self._swapper: threading.Thread | None = None
        manifest = read_manifest(self.root)
        self._live = _load(manifest.number, manifest.path(self.root))
        self._last = None

    # The generation in force; a decision reads ``_live`` once, a swap replaces it in one assignment.
    generation = property(lambda self: self._live.generation)
    directory = property(lambda self: self._live.directory)
    metadata = property(lambda self: self._live.metadata)
    session = property(lambda self: self._live.session)

    def refresh(self, wait: bool = False) -> None:
        """Start loading a newly published generation (:mod:`.publish`) beside the one in force.

        Costs one ``stat`` of ``manifest.json`` when nothing changed. A new generation is loaded
        and checked on a background thread, then swapped in by one reference assignment; a
        manifest, ONNX or ``features.json`` that does not load keeps the generation in force and
        logs a warning. ``wait`` joins the loading thread (tests, tools).
        """
        stamp = _stamp(self.root / MANIFEST)
        if stamp != self._stamp and (self._swapper is None or not self._swapper.is_alive()):
            self._stamp = stamp
            self._swapper = threading.Thread(target=self._swap, name="dynamix-ppo-swap", daemon=True)
            self._swapper.start()
        if wait and self._swapper is not None:
            self._swapper.join()

    def _swap(self) -> None:
        live = self._live
        try:
            manifest = read_manifest(self.root)
            if manifest.number == live.generation:
                return
            self._live = _load(manifest.number, manifest.path(self.root))
        except Exception as error:  # noqa: BLE001 - a bad publication must never break a decision
            log.warning("ppo: keeping policy generation %d, the published one does not load: %s", live.generation, error)
            return
        log.info("ppo: now serving policy generation %d from %s", self._live.generation, self._live.directory)

    def check_job_size(self, num_workers: int) -> None:
        """Log one warning (once per count) when a job of ``num_workers`` workers lies outside the
        range of worker counts the policy was trained on (``features.json``'s ``training.workers``):
        it names the policy, both counts, and what to use instead. Nothing for a count within the
        range, or a policy that does not record its counts. Never raises: the policy may still work."""
        trained = trained_worker_counts(self.metadata)
        if not trained or trained[0] <= num_workers <= trained[-1] or num_workers in self._sizes_warned:
            return
        self._sizes_warned.add(num_workers)
        log.warning("ppo: policy %s was trained on %s simulated workers, this job has %d: it is served anyway, "
                    "but its decisions for %d workers were never trained and may move the batch sizes far from "
                    "what suits the job. Use a heuristic instead (--policy proportional), or fit and train a "
                    "policy for this job: `dynamix sim fit RUN_DIR`, then `dynamix policy train --scenario "
                    "homogeneous --sim-params RUN_DIR/sim_params.json --workers %d` (docs/ppo.md, Fitted to your job)",
                    self.label, ", ".join(map(str, trained)), num_workers, num_workers, num_workers)

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Network output for observations ``(B, N, F)`` float32: logits ``(B, N, A)``, A the ladder's length."""
        live = self._live
        obs = np.ascontiguousarray(obs, dtype=np.float32)
        out = live.session.run([OUTPUT], {INPUT: obs})[0]
        self._last = (live.generation, obs, out, live.ladder)
        return out

    def actions(self, state: ClusterState) -> np.ndarray:
        """Ladder index per worker, int64 ``(N,)``: greedy, or drawn from softmax(logits) with ``explore``."""
        logits = self.logits(observation(state)[None])[0]
        if not self.explore:
            return logits.argmax(axis=-1)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        u = self._rng.random((len(p), 1)) * p.sum(-1, keepdims=True)
        return np.minimum((np.cumsum(p, -1) < u).sum(-1), p.shape[-1] - 1).astype(np.int64)

    def decide(self, state: ClusterState) -> Decision:
        """The ladder step per worker; ``terms`` record what online fine-tuning needs
        (:mod:`.finetune`): ``generation``, the observation ``obs`` (N, F), ``logits`` (N, A) and
        ``logp``, the log-probability of the chosen actions under softmax(logits) (sum over workers)."""
        self.refresh()
        if not state.workers:
            return Decision((), "ppo: no workers")
        self.check_job_size(len(state.workers))
        actions = self.actions(state)
        generation, obs, raw, ladder = self._last
        logits = raw[0].astype(np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        sizes = apply_actions(state, actions, ladder)
        changed = sum(a != b for a, b in zip(sizes, state.batch_sizes))
        reason = f"ppo: {changed} of {len(sizes)} batch sizes changed, global batch {state.global_batch} → {sum(sizes)}"
        terms = {"actions": actions.tolist(), "factors": [ladder[a] for a in actions], "global_batch": sum(sizes),
                 "generation": generation, "explore": self.explore,
                 "obs": obs[0].tolist(), "logits": raw[0].tolist(),  # the float32 values, exactly
                 "logp": float(log_softmax[np.arange(len(actions)), actions].sum())}
        return Decision(sizes, reason, 0.0, terms)


class _Live(NamedTuple):
    generation: int
    directory: Path
    metadata: dict
    session: object
    ladder: tuple[float, ...]


def _load(generation: int, directory: Path) -> _Live:
    """Open and check one generation's files (:func:`read_metadata`, graph signature)."""
    import onnxruntime as ort

    directory, metadata = read_metadata(directory)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(directory / POLICY_FILE), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ConfigurationError(f"ONNX Runtime cannot load {directory / POLICY_FILE}: {error}") from None
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if [i.name for i in inputs] != [INPUT] or OUTPUT not in [o.name for o in outputs] \
            or inputs[0].shape[-1] != NUM_FEATURES:
        raise ConfigurationError(f"{directory / POLICY_FILE} does not take '{INPUT}' (batch, workers, "
                                 f"{NUM_FEATURES}) and give '{OUTPUT}'; re-export the policy")
    # One probe inference: a graph with the right signature can still answer the wrong shape,
    # which would fail every later decision instead of this load.
    probe = np.zeros((1, 3, NUM_FEATURES), dtype=np.float32)
    try:
        shape = np.shape(session.run([OUTPUT], {INPUT: probe})[0])
    except Exception as error:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ConfigurationError(f"{directory / POLICY_FILE} fails on a (1, 3, {NUM_FEATURES}) input: {error}") from None
    ladder = tuple(metadata["actions"]["ladder"])  # checked by read_metadata
    if shape != (1, 3, len(ladder)):
        raise ConfigurationError(f"{directory / POLICY_FILE} answers {OUTPUT} of shape {shape} for 3 workers, "
                                 f"not (1, 3, {len(ladder)}) for its {len(ladder)}-step ladder; re-export the policy")
    return _Live(int(generation), directory, metadata, session, ladder)


def trained_worker_counts(metadata: dict) -> tuple[int, ...]:
    """The worker counts a policy was trained on, ascending, from its ``features.json`` content
    (``training.workers``: one count or a list of them); ``()`` when it records none or the record
    is not that shape (any entry that is not a whole number >= 1 makes it unreadable: a count
    dropped silently would narrow the range)."""
    training = metadata.get("training")
    counts = training.get("workers") if isinstance(training, dict) else None
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
        return ()
    return tuple(sorted(counts))


def _stamp(path: Path):
    """What changes when ``path`` is replaced or rewritten (None while it does not exist)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigurationError(f"policy option {name}={value!r} must be true or false")
