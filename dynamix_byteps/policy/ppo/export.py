"""RLlib checkpoint -> ``policy.onnx`` + ``features.json`` (the files :class:`PPOPolicy` serves).

Imports torch and Ray RLlib (``pip install 'dynamix-byteps[rl]'``). The export is checked
before it is published: ONNX Runtime must reproduce the torch network's logits (1e-4) and
greedy actions on probe observations with several worker counts, and the graph must hold
exactly the network's parameter count. Files are written to a temporary name and renamed, the
ONNX file first, so a reader never sees a ``features.json`` whose hash names a missing file.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch

from dynamix_byteps.atomic import write_atomic
from dynamix_byteps.errors import ConfigurationError, DynamixError
from dynamix_byteps.policy.ppo.features import NUM_FEATURES, spec
from dynamix_byteps.policy.ppo.mdp import LADDER, keep_index
from dynamix_byteps.policy.ppo.module import (
    PerWorkerPPOModule,  # first: keeps TensorFlow out of RLlib
)
from dynamix_byteps.policy.ppo.policy_format import (
    FEATURES_FILE,
    FORMAT,
    FORMAT_VERSION,
    INPUT,
    OUTPUT,
    POLICY_FILE,
    sha256,
)

__all__ = ["MODULE_SUBDIR", "ExportError", "export_module", "greedy_actions", "load_module", "module_dir", "module_ladder"]

#: Where ``Algorithm.save_to_path`` puts the policy module inside a checkpoint.
MODULE_SUBDIR = Path("learner_group", "learner", "rl_module", "default_policy")
OPSET = 17
PROBE_WORKERS = (1, 4, 13)


class ExportError(DynamixError, RuntimeError):
    """The exported ONNX graph does not reproduce the network."""


def module_dir(checkpoint) -> Path:
    """The RLModule directory of ``checkpoint`` (an algorithm checkpoint or the module dir itself).

    Raises:
        ConfigurationError: neither layout is found.
    """
    path = Path(checkpoint)
    for candidate in (path / MODULE_SUBDIR, path / "checkpoint" / MODULE_SUBDIR, path):
        if (candidate / "class_and_ctor_args.pkl").is_file():
            return candidate
    raise ConfigurationError(f"{path} is not an RLlib checkpoint of a dynamix policy (no {MODULE_SUBDIR}); "
                             "pass DIR/checkpoint from `dynamix policy train --out DIR`")


def load_module(checkpoint):
    """The trained :class:`~dynamix_byteps.policy.ppo.module.PerWorkerPPOModule`, every weight loaded.

    Loading goes through the module's strict ``set_state``, so a checkpoint of another network
    configuration raises instead of leaving random weights.

    Raises:
        ConfigurationError: not a checkpoint of this module class, its weights do not match, or
            one of its pickle files is truncated or damaged.
    """
    from ray.rllib.core.rl_module.rl_module import RLModule

    path = module_dir(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # RLlib's own RLModuleConfig notice
        try:
            module = RLModule.from_checkpoint(str(path.resolve()))  # RLlib reads a relative path as a URI
        except ValueError as error:
            raise ConfigurationError(f"cannot load {path}: {error}") from None
        except (pickle.UnpicklingError, EOFError) as error:  # a file of it truncated or overwritten
            raise ConfigurationError(f"cannot load {path}: a file of it is damaged ({type(error).__name__}: {error}); "
                                     "copy the checkpoint again, or train anew") from None
    if not isinstance(module, PerWorkerPPOModule):
        raise ConfigurationError(f"{path} holds a {type(module).__name__}, not a dynamix PerWorkerPPOModule")
    module.eval()
    return module


def greedy_actions(module, obs: np.ndarray) -> np.ndarray:
    """RLlib's own greedy actions: ``forward_inference`` + the inference distribution's mode.

    Args:
        obs: flat observations ``(B, N·F)`` float32, as the environment produces them.

    Returns:
        int64 ``(B, N)`` ladder indices.
    """
    from ray.rllib.core.columns import Columns

    with torch.no_grad():
        out = module.forward_inference({Columns.OBS: torch.as_tensor(obs, dtype=torch.float32)})
        dist = module.get_inference_action_dist_cls().from_logits(out[Columns.ACTION_DIST_INPUTS])
        return dist.to_deterministic().sample().numpy().astype(np.int64)


def _verify(net: torch.nn.Module, onnx_bytes: bytes) -> int:
    """Check ORT against torch on probes; return the graph's parameter count."""
    import onnx
    import onnxruntime as ort

    model = onnx.load_from_string(onnx_bytes)
    onnx.checker.check_model(model)
    graph_params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    torch_params = sum(p.numel() for p in net.parameters())
    if graph_params != torch_params:
        raise ExportError(f"the ONNX graph holds {graph_params} parameters, the network {torch_params}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for n in PROBE_WORKERS:
        obs = rng.uniform(-3, 3, (8, n, NUM_FEATURES)).astype(np.float32)
        with torch.no_grad():
            expected = net(torch.from_numpy(obs)).numpy()
        got = session.run([OUTPUT], {INPUT: obs})[0]
        if got.shape != expected.shape or not np.allclose(got, expected, atol=1e-4, rtol=1e-4):
            raise ExportError(f"ONNX Runtime and torch disagree on {n}-worker probes "
                              f"(max |Δ| {np.abs(got - expected).max():.3g})")
        if not (got.argmax(-1) == expected.argmax(-1)).all():
            raise ExportError(f"ONNX Runtime and torch choose different actions on {n}-worker probes")
    return graph_params


def module_ladder(module) -> tuple[float, ...]:
    """The action ladder ``dynamix policy train`` recorded in ``module``'s ``model_config``; the
    default :data:`~.mdp.LADDER` for a module trained before ladders were recorded."""
    return tuple(float(f) for f in module.model_config.get("dynamix", {}).get("ladder") or LADDER)


def export_module(module, out_dir, extra: dict | None = None) -> Path:
    """Write ``policy.onnx`` and ``features.json`` for ``module`` into ``out_dir``; return ``out_dir``.

    Args:
        module: a :class:`PerWorkerPPOModule` (e.g. from :func:`load_module`).
        extra: more metadata for ``features.json`` (merged into its ``training`` section).

    Raises:
        ExportError: the ONNX graph does not reproduce the network (see the module docstring), or
            the ladder recorded in the module's ``model_config`` does not fit its action count.
    """
    import ray

    config = dict(module.model_config)
    ladder = module_ladder(module)
    if len(ladder) != int(module.action_space.nvec[0]):
        raise ExportError(f"the module chooses among {int(module.action_space.nvec[0])} actions but records a "
                          f"{len(ladder)}-step ladder {list(ladder)}; it was not built by `dynamix policy train`")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    net = module.policy_net.eval()
    example = torch.zeros(1, 4, NUM_FEATURES)
    # In memory: a build file in ``out`` was left there by a process killed (SIGTERM) while exporting
    graph = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(net, (example,), graph, input_names=[INPUT], output_names=[OUTPUT],
                          dynamic_axes={INPUT: {0: "batch", 1: "workers"}, OUTPUT: {0: "batch", 1: "workers"}},
                          opset_version=OPSET, dynamo=False)
    onnx_bytes = graph.getvalue()
    params = _verify(net, onnx_bytes)
    write_atomic(out / POLICY_FILE, onnx_bytes)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "observation": spec(),
        "actions": {"ladder": list(ladder), "keep": keep_index(len(ladder)),
                    "rule": "dynamix_byteps.policy.ppo.mdp.apply_ladder: round(b*factor), within [b/2, 2b] and the bounds"},
        "onnx": {"file": POLICY_FILE, "sha256": sha256(out / POLICY_FILE), "input": INPUT, "output": OUTPUT,
                 "opset": OPSET, "parameters": params},
        "network": {"hidden": int(config.get("hidden", 64)), "class": "dynamix_byteps.policy.ppo.module.PolicyNet"},
        "training": {**config.get("dynamix", {}), **(extra or {}), "ray": ray.__version__, "torch": torch.__version__},
    }
    write_atomic(out / FEATURES_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    return out
