"""The "change one import" promise: every public name of BytePS 0.2.5's PyTorch and TensorFlow
frontends exists in the matching ``dynamix_byteps`` module and takes the same arguments.

The lists below are written by hand from BytePS's source (``byteps/torch/__init__.py``,
``byteps/torch/ops.py``, ``byteps/torch/parallel/distributed.py``, ``byteps/torch/compression.py``,
``byteps/common/__init__.py``, ``byteps/tensorflow/__init__.py``, ``byteps/tensorflow/ops.py``,
``byteps/tensorflow/keras/__init__.py``, ``byteps/tensorflow/keras/callbacks.py``,
``byteps/_keras/``) at tag v0.2.5 and at its last 0.2.5 release, v0.2.5.post20 (its
``__version__`` is still 0.2.5); where they differ the later one, a superset (``prefix`` of the
torch broadcasts, ``DistributedDataParallel.no_sync``, ``get_pushpull_speed``), is listed. Modules
BytePS only imports (``torch``, ``os``, ``keras``, ``K``, ...) are not API and are left out, and so
is ``byteps.keras``, the frontend for the standalone Keras 2 package.

A signature is compatible when every BytePS parameter is there, by the same name and at the same
position, a BytePS default is kept (the same value), and whatever follows is optional.

Horovod's names that a script ported from Horovod passes and BytePS has no name for (``HOROVOD``)
are checked the same way; where BytePS has a name for the same thing (``push_pull`` for
``allreduce``), no Horovod alias is added.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect

import pytest
from multiworker import ok, run_workers

P = inspect.Parameter


def function(signature: str) -> tuple:
    return ("function", signature)


def cls(signature: str | None, **methods: str) -> tuple:
    """A class: its constructor's signature (None: not checked) and ``method=signature`` pairs."""
    return ("class", signature, methods)


def constant(value) -> tuple:
    return ("constant", value)


def namespace(*attributes: str) -> tuple:
    return ("namespace", attributes)


MODULE = ("module",)

ROOT = "()"  # size(), rank(), ...: no arguments
BASICS = {"init": function("(lazy=True)"), "shutdown": function(ROOT), "size": function(ROOT),
          "local_size": function(ROOT), "rank": function(ROOT), "local_rank": function(ROOT)}
COMPRESSION = namespace("none", "fp16")
COMPRESSOR_METHODS = {"compress": "(tensor)", "decompress": "(tensor, ctx)"}

# byteps module -> (dynamix module, the module whose names a default like Compression.none means, names)
BYTEPS = {
    "byteps.torch": ("dynamix_byteps.torch", "dynamix_byteps.torch", {
        **BASICS,
        "Compression": COMPRESSION,
        "push_pull": function("(tensor, average=True, name=None, version=0, priority=0, "
                              "compression=Compression.none)"),
        "poll": function("(handle)"),
        "synchronize": function("(handle)"),
        "declare": function("(name)"),
        "DistributedOptimizer": function("(optimizer, named_parameters=None, compression=Compression.none, "
                                         "backward_passes_per_step=1)"),
        "broadcast_parameters": function("(params, root_rank, prefix='Parameter.')"),
        "broadcast_optimizer_state": function("(optimizer, root_rank, prefix='Parameter.')"),
        "broadcast_object": function("(obj, root_rank=0, name=None)"),
    }),
    "byteps.torch.parallel": ("dynamix_byteps.torch.parallel", "dynamix_byteps.torch", {
        "DistributedDataParallel": cls("(module, device_ids=None, broadcast_buffers=True, "
                                       "compression=Compression.none)",
                                       no_sync="(self)", synchronize="(self)", forward="(self, *inputs, **kwargs)"),
    }),
    "byteps.torch.compression": ("dynamix_byteps.torch.compression", "dynamix_byteps.torch", {
        "Compressor": cls(None, **COMPRESSOR_METHODS),
        "NoneCompressor": cls(None, **COMPRESSOR_METHODS),
        "FP16Compressor": cls(None, **COMPRESSOR_METHODS),
        "Compression": COMPRESSION,
    }),
    "byteps.tensorflow": ("dynamix_byteps.tensorflow", "dynamix_byteps.tensorflow", {
        **BASICS,
        "Compression": COMPRESSION,
        "Average": constant("Average"),
        "Sum": constant("Sum"),
        "Adasum": constant("Adasum"),
        "push_pull": function("(tensor, scope='', average=None, device_dense='', device_sparse='', "
                              "compression=Compression.none, op=None, enable_async=False)"),
        "broadcast": function("(tensor, root_rank, scope='', name=None, is_variable=True)"),
        "broadcast_global_variables": function("(root_rank)"),
        "broadcast_variables": function("(variables, root_rank, scope='')"),
        "DistributedOptimizer": function("(optimizer, name=None, use_locking=False, device_dense='', "
                                         "device_sparse='', compression=Compression.none, sparse_as_dense=False, "
                                         "backward_passes_per_step=1, op=Average)"),
        "DistributedGradientTape": function("(gradtape, device_dense='', device_sparse='', "
                                            "compression=Compression.none, sparse_as_dense=False, op=Average)"),
    }),
    "byteps.tensorflow.keras": ("dynamix_byteps.tensorflow.keras", "dynamix_byteps.tensorflow", {
        **BASICS,
        "Compression": COMPRESSION,
        "callbacks": MODULE,
        "DistributedOptimizer": function("(optimizer, name=None, device_dense='', device_sparse='', "
                                         "compression=Compression.none, sparse_as_dense=False)"),
        "broadcast_global_variables": function("(root_rank)"),
        "push_pull": function("(value, name=None, average=True)"),
        "broadcast": function("(value, root_rank, name=None)"),
        "load_model": function("(filepath, custom_optimizers=None, custom_objects=None, "
                               "compression=Compression.none)"),
    }),
    "byteps.tensorflow.keras.callbacks": ("dynamix_byteps.tensorflow.keras.callbacks", "dynamix_byteps.tensorflow", {
        "BroadcastGlobalVariablesCallback": cls("(root_rank, device='')"),
        "MetricAverageCallback": cls("(device='')"),
        "LearningRateScheduleCallback": cls("(multiplier, start_epoch=0, end_epoch=None, staircase=True, "
                                            "momentum_correction=True, steps_per_epoch=None, initial_lr=None)"),
        "LearningRateWarmupCallback": cls("(warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, "
                                          "verbose=0, initial_lr=None)"),
    }),
}

# Methods of the objects BytePS's factories return (checked on real instances).
TORCH_OPTIMIZER_METHODS = {"synchronize": "(self)", "skip_synchronize": "(self)",
                           "set_backward_passes_per_step": "(self, passes)", "step": "(self, closure=None)"}
TAPE_METHODS = {"gradient": "(self, target, sources, output_gradients=None)"}

ELASTIC = ("BytePS core's in-process elastic training (leave and rejoin with a new worker count); "
           "here elasticity is bpslaunch --restart-on-failure, which restarts the workers from the last checkpoint")
DELIBERATELY_ABSENT = {
    ("byteps.torch", "byteps_push_pull"): "BytePS's own optimizer's alias of push_pull_async_inplace, which "
                                          "dynamix_byteps.torch exports under that name",
    ("byteps.torch", "suspend"): ELASTIC,
    ("byteps.torch", "resume"): ELASTIC,
    ("byteps.torch.cross_barrier", "CrossBarrier"): "cross-iteration scheduling by the priorities of BytePS's own "
                                                    "core scheduler, which the gloo engine does not have",
    ("byteps.tensorflow", "suspend"): ELASTIC,
    ("byteps.tensorflow", "resume"): ELASTIC,
    ("byteps.tensorflow", "get_pushpull_speed"): "reads the 10-second throughput monitor of BytePS's C++ core; "
                                                 "push_pull time per step is in bps.step_statistics() and "
                                                 "TensorBoard",
    ("byteps.tensorflow", "BroadcastGlobalVariablesHook"): "a tf.estimator SessionRunHook; BytePS defines it only "
                                                           "when tf.estimator or tf.train.SessionRunHook exists, "
                                                           "and TensorFlow 2.16+ has neither",
    ("byteps.tensorflow", "handle_average_backwards_compatibility"): "BytePS's internal helper for push_pull's "
                                                                     "average/op arguments",
}

CASES = [(byteps_module, name) for byteps_module, (_, _, names) in BYTEPS.items() for name in names]

# Horovod's names that a script ported from Horovod (``hvd`` -> ``bps``) passes and BytePS has no
# name for, from horovod/torch/__init__.py, horovod/torch/optimizer.py, horovod/tensorflow/__init__.py
# and horovod/tensorflow/keras/__init__.py. The optimizers' other Horovod arguments (num_groups,
# groups, sparse_as_dense on torch, process_set, scale_local_gradients) are not taken. Horovod's
# Average, Sum and Adasum are integers; here every frontend has BytePS's TensorFlow strings.
OPS = {"Average": constant("Average"), "Sum": constant("Sum"), "Adasum": constant("Adasum")}
HOROVOD = {
    "horovod.torch": ("dynamix_byteps.torch", "dynamix_byteps.torch", {
        **OPS,
        "DistributedOptimizer": function("(optimizer, named_parameters=None, compression=Compression.none, "
                                         "backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0)"),
    }),
    "horovod.tensorflow": ("dynamix_byteps.tensorflow", "dynamix_byteps.tensorflow", {
        **OPS,
        "DistributedOptimizer": function("(optimizer, name=None, use_locking=False, device_dense='', "
                                         "device_sparse='', compression=Compression.none, sparse_as_dense=False, "
                                         "backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, "
                                         "average_aggregated_gradients=False)"),
    }),
    "horovod.tensorflow.keras": ("dynamix_byteps.tensorflow.keras", "dynamix_byteps.tensorflow", {
        "Average": OPS["Average"],
        "Sum": OPS["Sum"],
        "DistributedOptimizer": function("(optimizer, name=None, device_dense='', device_sparse='', "
                                         "compression=Compression.none, sparse_as_dense=False, "
                                         "gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1, "
                                         "average_aggregated_gradients=False)"),
    }),
}
HOROVOD_CASES = [(horovod_module, name) for horovod_module, (_, _, names) in HOROVOD.items() for name in names]
# Horovod names with a BytePS name for the same thing: a port renames them (the README says how), and
# no alias is added.
HOROVOD_RENAMED = {("horovod.torch", "allreduce"): "push_pull", ("horovod.torch", "allreduce_"): "push_pull_inplace",
                   ("horovod.torch", "allreduce_async"): "push_pull_async",
                   ("horovod.torch", "allreduce_async_"): "push_pull_async_inplace",
                   ("horovod.tensorflow", "allreduce"): "push_pull"}


REQUIRED = object()  # a BytePS parameter without a default


class _Unresolved:
    def __init__(self, path: str):
        self.path = path

    def __repr__(self) -> str:
        return f"<{self.path}: missing>"


def _default(node: ast.expr, defaults_from):
    if isinstance(node, ast.Constant):
        return node.value
    value = defaults_from
    for part in ast.unparse(node).split("."):
        if not hasattr(value, part):
            return _Unresolved(ast.unparse(node))
        value = getattr(value, part)
    return value


def _expected(signature: str, defaults_from) -> tuple[list[tuple[str, object]], bool, bool]:
    args = ast.parse(f"def f{signature}: pass").body[0].args
    defaults = [REQUIRED] * (len(args.args) - len(args.defaults)) + [_default(d, defaults_from) for d in args.defaults]
    return [(a.arg, d) for a, d in zip(args.args, defaults)], args.vararg is not None, args.kwarg is not None


def signature_problems(obj, signature: str, defaults_from) -> list[str]:
    """Why a call written for BytePS's ``signature`` could fail on ``obj``; [] when none."""
    expected, varargs, varkw = _expected(signature, defaults_from)
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError) as exc:
        return [f"no signature: {exc}"]
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    problems = []
    for index, (name, default) in enumerate(expected):
        if index >= len(positional):
            problems.append(f"parameter {name!r} (position {index}) is missing")
            continue
        ours = positional[index]
        if ours.name != name or ours.kind is P.POSITIONAL_ONLY:
            problems.append(f"position {index} is {ours.name!r}; BytePS has {name!r}")
        elif default is not REQUIRED and ours.default is P.empty:
            problems.append(f"{name!r} is required; BytePS defaults it to {default!r}")
        elif default is not REQUIRED and not (ours.default is default or (type(ours.default) is type(default)
                                                                            and ours.default == default)):
            problems.append(f"{name!r} defaults to {ours.default!r}; BytePS to {default!r}")
    extra = [p for p in params if p not in positional[:len(expected)]]
    problems += [f"extra parameter {p.name!r} has no default" for p in extra
                 if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.default is P.empty]
    if varargs and not any(p.kind is P.VAR_POSITIONAL for p in params):
        problems.append("takes no *args; BytePS does")
    if varkw and not any(p.kind is P.VAR_KEYWORD for p in params):
        problems.append("takes no **kwargs; BytePS does")
    return problems


def methods_problems(kind: type, methods: dict[str, str], defaults_from) -> list[str]:
    problems = []
    for method, signature in methods.items():
        if not callable(getattr(kind, method, None)):
            problems.append(f"method {method} is missing")
        else:
            problems += [f"{method}: {p}" for p in signature_problems(getattr(kind, method), signature, defaults_from)]
    return problems


def entry_problems(module, name: str, spec: tuple, defaults_from) -> list[str]:
    if not hasattr(module, name):
        return ["missing"]
    obj = getattr(module, name)
    problems = []
    if getattr(module, "__all__", None) is not None and name not in module.__all__:
        problems.append("not in __all__, so `from ... import *` loses it")
    kind = spec[0]
    if kind == "function":
        problems += ([] if callable(obj) else ["not callable"]) + signature_problems(obj, spec[1], defaults_from)
    elif kind == "class":
        if not inspect.isclass(obj):
            return problems + [f"not a class but {type(obj).__name__}"]
        if spec[1] is not None:
            problems += signature_problems(obj, spec[1], defaults_from)
        problems += methods_problems(obj, spec[2], defaults_from)
    elif kind == "constant":
        if obj != spec[1]:
            problems.append(f"is {obj!r}; BytePS's is {spec[1]!r}")
    elif kind == "namespace":
        problems += [f"has no attribute {a!r}" for a in spec[1] if not hasattr(obj, a)]
    elif not inspect.ismodule(obj):
        problems.append(f"not a module but {type(obj).__name__}")
    return problems


NAME_CASES = [("BytePS", BYTEPS, case) for case in CASES] + [("Horovod", HOROVOD, case) for case in HOROVOD_CASES]


@pytest.mark.parametrize("library,table,case", NAME_CASES, ids=[f"{m}.{n}" for _, _, (m, n) in NAME_CASES])
def test_byteps_or_horovod_name_exists_with_compatible_arguments(library, table, case):
    their_module, name = case
    ours, defaults_module, names = table[their_module]
    if "tensorflow" in ours:
        pytest.importorskip("tensorflow")
    module = importlib.import_module(ours)
    problems = entry_problems(module, name, names[name], importlib.import_module(defaults_module))
    assert problems == [], f"{ours}.{name} ({library} {their_module}.{name}): " + "; ".join(problems)


def test_horovod_names_are_added_only_where_byteps_has_none():
    for horovod_module, (ours, _, names) in HOROVOD.items():
        byteps_names = BYTEPS[horovod_module.replace("horovod", "byteps")][2]
        for name in set(names) & set(byteps_names):  # a name both have: BytePS's value, or its arguments first
            mine, theirs = names[name], byteps_names[name]
            assert mine == theirs or (mine[0] == theirs[0] == "function"
                                      and mine[1].startswith(theirs[1][:-1] + ", ")), f"{horovod_module}.{name}"
    for (horovod_module, name), byteps_name in HOROVOD_RENAMED.items():
        ours = BYTEPS[horovod_module.replace("horovod", "byteps")][0]
        if "tensorflow" not in ours or importlib.util.find_spec("tensorflow") is not None:
            module = importlib.import_module(ours)
            assert hasattr(module, byteps_name) and not hasattr(module, name), f"{ours}.{name}: use {byteps_name}"


def test_a_horovod_name_without_alias_says_what_to_write_instead():
    import dynamix_byteps.torch as hvd  # a Horovod script whose import alone changed

    expected = {"allreduce": r"use push_pull\(tensor, name=\.\.\.\)", "allreduce_async_": "use push_pull_async_inplace",
                "allgather": r"torch\.distributed\.all_gather\(outputs, tensor\)", "barrier": r"torch\.distributed\.barrier",
                "join": "every worker must run the same number of steps"}
    for name, hint in expected.items():
        with pytest.raises(AttributeError, match=rf"no attribute '{name}' \(Horovod's hvd\.{name}\): .*{hint}.*From Horovod"):
            getattr(hvd, name)
    with pytest.raises(AttributeError, match=r"no attribute 'allreduce_everything'$"):
        hvd.allreduce_everything
    if importlib.util.find_spec("tensorflow") is not None:
        for module in ("dynamix_byteps.tensorflow", "dynamix_byteps.tensorflow.keras"):
            tf_hvd = importlib.import_module(module)
            with pytest.raises(AttributeError, match=r"'allreduce' \(Horovod's hvd\.allreduce\): use push_pull\(tensor"):
                tf_hvd.allreduce
            with pytest.raises(AttributeError, match=r"'barrier' \(Horovod's hvd\.barrier\): there is none"):
                tf_hvd.barrier
            assert not hasattr(tf_hvd, "allreduce")
        keras_hvd = importlib.import_module("dynamix_byteps.tensorflow.keras")  # import horovod.tensorflow.keras as hvd
        for name in ("DynamicBatchSampler", "dynamic_batch_dataset", "set_batch_sizes", "report_loss", "is_initialized"):
            with pytest.raises(AttributeError, match=rf"no attribute '{name}': it is in dynamix_byteps\.tensorflow "
                                                     rf"\(import dynamix_byteps\.tensorflow as bps, then bps\.{name}\)"):
                getattr(keras_hvd, name)


def test_warmup_without_steps_per_epoch_says_to_give_them_to_the_callback_not_to_fit():
    # A Horovod Keras script on dynamic_batch_dataset (whose length is unknown, and which fit must get without
    # steps_per_epoch) warmed up once per epoch: with warmup_epochs=1 the first epoch ran at the full rate.
    pytest.importorskip("tensorflow")
    import keras

    from dynamix_byteps.tensorflow.keras.callbacks import LearningRateWarmupCallback

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for warmup_epochs, first in [(1, "initial_lr, no warm-up at all"), (3, r"more than initial_lr / size\(\)")]:
        callback = LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=warmup_epochs)
        callback.set_model(model)
        callback.set_params({"epochs": 2, "steps": None})
        with pytest.warns(UserWarning, match=rf"the first epoch already runs at {first}; pass LearningRateWarmupCallback"
                                             r"\(\.\.\., steps_per_epoch=N\).*not model\.fit's steps_per_epoch"):
            callback.on_train_begin()


def test_warmup_ends_at_initial_lr_when_an_epoch_runs_more_steps_than_steps_per_epoch(monkeypatch):
    # dynamic_batch_dataset's epoch of 6000 samples at a global batch of 128 runs 47 steps; a warm-up given
    # steps_per_epoch=6000 // 128 = 46 went on to 0.0204 for initial_lr=0.02, and stayed there.
    pytest.importorskip("tensorflow")
    import types

    import keras

    from dynamix_byteps.tensorflow.keras import callbacks

    monkeypatch.setattr(callbacks._engine, "current", lambda: types.SimpleNamespace(size=2))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9), loss="mse")
    callback = callbacks.LearningRateWarmupCallback(initial_lr=0.02, warmup_epochs=1, steps_per_epoch=46)
    callback.set_model(model)
    callback.set_params({"epochs": 2, "steps": None})
    callback.on_train_begin()
    rates = []
    for epoch in range(2):
        callback.on_epoch_begin(epoch)
        for batch in range(47):
            callback.on_train_batch_begin(batch)
            rates.append(float(model.optimizer.learning_rate.numpy()))
    assert rates[0] == pytest.approx(0.02 / 2 * (1 + 1 / 46), rel=1e-6)
    assert max(rates) == pytest.approx(0.02, rel=1e-6) and rates[-1] == pytest.approx(0.02, rel=1e-6)


@pytest.mark.timeout(200)
def test_horovods_rank0_resume_recipe_is_told_to_load_on_every_worker(tmp_path):
    # Horovod's Keras examples resume with hvd.load_model on rank 0 and a fresh model elsewhere; here the
    # variables are matched by name and a loaded model's lack the model's prefix, so fit's start fails.
    pytest.importorskip("tensorflow")
    messages = ok(run_workers(2, "tf_parity_cases:rank0_resume", str(tmp_path), timeout=180))
    for message in messages:
        assert message.startswith("TensorMismatchError") and "sequential/" in message
        assert "load the checkpoint on every worker" in message and "bps_keras.load_model(path)" in message


def test_torch_optimizer_refuses_other_ops_and_predivide_factors():
    import torch

    import dynamix_byteps.torch as bps

    def wrap(**arguments):
        return bps.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), **arguments)

    for op in (bps.Sum, bps.Adasum):
        with pytest.raises(ValueError, match=f"op='{op}': gradients are always averaged"):
            wrap(op=op)
    for factor in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="gradient_predivide_factor must be a finite number > 0"):
            wrap(gradient_predivide_factor=factor)


@pytest.mark.timeout(120)
def test_torch_optimizer_averages_with_horovods_op_and_predivide_factor():
    results = ok(run_workers(2, "parity_cases:horovod_optimizer_step", timeout=100))
    mean = [(a + b) / 2 for a, b in zip(results[0]["local"], results[1]["local"])]
    assert results[0]["local"] != results[1]["local"]
    for result in results:
        assert result["reduced"] == pytest.approx(mean, rel=1e-6)


def test_deliberately_absent_names_are_absent():
    for (byteps_module, name), reason in DELIBERATELY_ABSENT.items():
        ours, _, names = BYTEPS.get(byteps_module, (None, None, {}))
        assert name not in names and reason
        if ours is not None and ("tensorflow" not in ours or importlib.util.find_spec("tensorflow") is not None):
            assert not hasattr(importlib.import_module(ours), name), f"{ours}.{name} exists now: list it in BYTEPS"


def test_the_check_finds_what_a_byteps_script_would_trip_on():
    def keyword_renamed(tensor, avg=True): ...
    def required_extra(tensor, average=True, name=None, extra=None, *, must): ...
    def default_changed(tensor, average=False): ...
    def moved(average=True, tensor=None): ...
    spec = "(tensor, average=True)"
    assert signature_problems(keyword_renamed, spec, None) == ["position 1 is 'avg'; BytePS has 'average'"]
    assert signature_problems(required_extra, spec, None) == ["extra parameter 'must' has no default"]
    assert signature_problems(default_changed, spec, None) == ["'average' defaults to False; BytePS to True"]
    assert len(signature_problems(moved, spec, None)) == 2
    assert signature_problems(lambda tensor, average=1: None, spec, None) == ["'average' defaults to 1; BytePS to True"]
    assert signature_problems(lambda *inputs: None, "(*inputs, **kwargs)", None) == ["takes no **kwargs; BytePS does"]


def test_distributed_gradient_tape_has_byteps_methods():
    tf = pytest.importorskip("tensorflow")
    import dynamix_byteps.tensorflow as bps

    tape = bps.DistributedGradientTape(tf.GradientTape())
    assert methods_problems(type(tape), TAPE_METHODS, bps) == []


def test_invalid_assignment_error_is_exported_by_every_frontend():
    import dynamix_byteps
    import dynamix_byteps.assignment
    import dynamix_byteps.torch

    frontends = [dynamix_byteps, dynamix_byteps.torch]
    if importlib.util.find_spec("tensorflow") is not None:
        frontends.append(importlib.import_module("dynamix_byteps.tensorflow"))
    for frontend in frontends:
        assert frontend.InvalidAssignmentError is dynamix_byteps.assignment.InvalidAssignmentError
        assert "InvalidAssignmentError" in frontend.__all__
    assert issubclass(dynamix_byteps.InvalidAssignmentError, dynamix_byteps.ConfigurationError)


@pytest.mark.timeout(120)
def test_torch_broadcast_forms_and_optimizer_methods():
    results = ok(run_workers(2, "parity_cases:torch_checks", timeout=100))
    assert [r["optimizer_methods"] for r in results] == [[], []]
    root = results[1]
    for form, digests in root["forms"].items():
        for rank, result in enumerate(results):
            mine = result["forms"][form]
            assert mine["after"]["parameters"] == digests["before"]["parameters"], f"{form}: rank {rank}"
            expected_buffers = digests["before"] if form == "state_dict" else mine["before"]
            assert mine["after"]["buffers"] == expected_buffers["buffers"], f"{form}: rank {rank}'s buffers"
        assert results[0]["forms"][form]["before"] != digests["before"], "the ranks started equal"
    assert [r["lr"] for r in results] == [pytest.approx(0.2)] * 2
    assert results[0]["momentum"] == root["momentum"]
    for result in results:
        assert "not a single tensor" in result["errors"]["tensor"]
        assert "entry 0 is a str" in result["errors"]["names"]
        assert "got int" in result["errors"]["number"]


@pytest.mark.timeout(120)
def test_ddp_with_device_ids_leaves_a_cpu_model_on_the_cpu():
    results = ok(run_workers(2, "parity_cases:ddp_with_device_ids_on_cpu", timeout=100))
    assert [r["devices"] for r in results] == [["cpu"], ["cpu"]]
    assert [r["device_ids"] for r in results] == [[0], [1]]
    assert results[0]["parameters"] == results[1]["parameters"]


@pytest.mark.timeout(300)
def test_tensorflow_and_keras_additions(tmp_path):
    pytest.importorskip("tensorflow")
    results = ok(run_workers(2, "tf_parity_cases:all_checks", str(tmp_path), timeout=280))
    for rank, result in enumerate(results):
        functions = result["keras_functions"]
        assert functions["push_pull_sum"] == [2.0, 2.0]
        assert functions["push_pull_mean"] == 0.5 and functions["push_pull_default_name"] == 2.0
        assert functions["broadcast"] == [10, 11, 12]
        assert all(functions["same_functions"])

        refusals = result["refusals"]
        assert refusals["bpps"].startswith("ValueError") and "backward_passes_per_step=2" in refusals["bpps"]
        assert refusals["optimizer_sum"].startswith("ValueError") and "op='Sum'" in refusals["optimizer_sum"]
        assert refusals["tape_adasum"].startswith("ValueError") and "op='Adasum'" in refusals["tape_adasum"]
        assert refusals["push_pull_adasum"].startswith("ValueError") and "Adasum" in refusals["push_pull_adasum"]
        assert refusals["v1_optimizer"].startswith("TypeError") and "Keras 3 optimizer" in refusals["v1_optimizer"]
        assert refusals["eager_global_variables"].startswith("RuntimeError")
        assert "broadcast_variables" in refusals["eager_global_variables"]

        assert result["graph_global_variables"] == [[10.0, 11.0, 12.0], 1.0]

        loaded = result["loaded_model"]
        assert loaded["uncompiled_optimizer"] == "None"
        for label, expected_class in [("builtin", "SGD"), ("custom", "MySGD")]:
            assert loaded[label]["wrapped"] and loaded[label]["class"] == expected_class
            assert loaded[label]["iterations"] == 2, "the saved optimizer state (2 steps) was not kept"
            assert loaded[label]["saved_velocity"] > 0
            assert loaded[label]["loaded_velocity"] == pytest.approx(loaded[label]["saved_velocity"], rel=1e-6)
    assert results[0]["positional_optimizer"] == pytest.approx(results[1]["positional_optimizer"], rel=1e-6)
    assert results[0]["loaded_model"]["weights"] == pytest.approx(results[1]["loaded_model"]["weights"], rel=1e-6)
    _check_learning_rates(results[0]["lr_callbacks"], size=2)


@pytest.mark.timeout(180)
def test_keras_optimizer_takes_horovods_arguments():
    pytest.importorskip("tensorflow")
    (result,) = ok(run_workers(1, "tf_parity_cases:horovod_keras_optimizer", timeout=160))
    weights = result["weights"]
    assert weights["horovod_keras"] == pytest.approx(weights["plain"], rel=1e-6)
    assert weights["horovod_tf"] == pytest.approx(weights["plain"], rel=1e-6)
    assert result["more_passes"].startswith("ValueError: backward_passes_per_step=2 is not supported")
    assert "batches that many times larger" in result["more_passes"]
    # Horovod's LearningRateWarmupCallback(initial_lr) takes its rate first, BytePS's its warm-up epochs
    warned = result["warmup_warnings"]
    assert len(warned["horovod_warmup"]) == 1 and "initial_lr=0.02" in warned["horovod_warmup"][0]
    assert warned["byteps_warmup"] == warned["named_warmup"] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("suffix", ["h5", "keras"])
def test_load_model_keeps_the_optimizer_state(tmp_path, suffix):
    pytest.importorskip("tensorflow")
    (result,) = ok(run_workers(1, "tf_parity_cases:resumed_optimizer_state", str(tmp_path), suffix, timeout=160))
    assert result["wrapped"]
    assert result["saved"][0] == 4, "iterations"
    assert len(result["saved"]) > 2, "no momentum saved"
    assert result["loaded"] == pytest.approx(result["saved"], rel=1e-6)
    assert [w for w in result["warnings"] if "Skipping variable loading" in w] == []
    assert result["iterations_after_resuming"] == 8


def _check_learning_rates(result: dict, size: int, initial: float = 0.1, warmup: int = 2, steps: int = 4):
    rows = result["known"]["rows"]
    assert len(rows) == 3 * steps and result["known"]["warnings"] == []
    for index, (batch, rate, velocity_before, velocity_after) in enumerate(rows):
        epoch = index // steps
        progress = epoch + (batch + 1) / steps  # epochs done at the end of this batch
        expected = initial / size * (1 + progress * (size - 1) / warmup) if epoch < warmup else initial * 0.1
        assert rate == pytest.approx(expected, rel=1e-6), f"epoch {epoch} batch {batch}"
        if index:  # momentum correction: the velocity follows the rate's change before the step
            previous = rows[index - 1]
            assert velocity_before == pytest.approx(previous[3] * rate / previous[1], rel=1e-4)
    assert result["known"]["lr_log"] == pytest.approx([rows[steps - 1][1], initial, initial * 0.1], rel=1e-6)

    per_epoch = result["unknown"]
    assert per_epoch["warnings"], "no warning that the rate changes once per epoch"
    for epoch, expected in enumerate([initial / size * (1 + (size - 1) / warmup), initial, initial * 0.1]):
        rates = [row[1] for row in per_epoch["rows"][epoch * steps:(epoch + 1) * steps]]
        assert rates == pytest.approx([expected] * steps, rel=1e-6), f"epoch {epoch}"
    assert result["schedule_refused"].startswith("ValueError") and "LearningRateSchedule" in result["schedule_refused"]
