"""The helper processes of a ``bpslaunch`` job (services, in :class:`ChildSpec` terms): the scheduler
and its policy fine-tuner, the node agent, the summation servers of ``--engine ps``, and BytePS's
own server or scheduler in environment mode. Each is built from a :class:`LaunchConfig`."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from dynamix_byteps.control.security import grpc_address, is_loopback
from dynamix_byteps.engine.ps_rendezvous import STOPPED_BY_A_WORKER
from dynamix_byteps.errors import ConfigurationError, UsageError
from dynamix_byteps.launcher.config import LaunchConfig
from dynamix_byteps.launcher.supervisor import ChildSpec
from dynamix_byteps.launcher.topology import LOCAL_HOST, check_port_free, free_port

__all__ = ["agent_spec", "byteps_role_spec", "ps_server_spec", "require_byteps", "scheduler_specs"]


def require_byteps(role: str) -> None:
    """Raises ConfigurationError, naming the fix, when this Python cannot import ``byteps``."""
    if importlib.util.find_spec("byteps") is None:
        raise ConfigurationError(
            f"the byteps engine needs the byteps package for the {role} role, and {sys.executable} cannot import it. "
            "BytePS requires CUDA and NCCL: install it on a GPU machine (see docker/ for the GPU image), "
            "or use the embedded default engine: --engine gloo / DYNAMIX_ENGINE=gloo"
        )


_GUARDRAIL_FLAGS = ("max_change", "hysteresis")  # bpslaunch flags passed on to the scheduler as they are


def _log(config: LaunchConfig, name: str) -> Path | None:
    return None if config.log_dir is None else config.log_dir / name


def scheduler_specs(config: LaunchConfig, env: Mapping[str, str], hosts: list[str], node_rank: int,
                    total: int) -> tuple[list[ChildSpec], str | None]:
    """The scheduler's ChildSpec (on node 0 only, with its fine-tuner) and the ``host:port`` every
    worker reports to; ``([], None)`` without ``--policy``. Raises UsageError for flags that do not fit."""
    if config.policy is None:
        for flag in ("policy_path", "fine_tune", "scheduler_port", "bind", "tls_cert", "tls_key", "tls_ca",
                     *_GUARDRAIL_FLAGS):
            if getattr(config, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} needs --policy")
        if config.policy_option:
            raise UsageError("--policy-option needs --policy")
        return [], None
    _check_policy(config)
    multi_host = len(hosts) > 1
    if multi_host and config.scheduler_port is None:
        raise UsageError("--hosts with --policy needs --scheduler-port: the workers on every host must find it")
    if multi_host and not env.get("DYNAMIX_TOKEN"):
        raise UsageError("a multi-host job's scheduler listens beyond loopback: set DYNAMIX_TOKEN to a shared "
                         "secret on every host")
    bind = (config.bind or (hosts[0] if multi_host else LOCAL_HOST)).strip("[]")
    if bind.count(":") == 1:
        raise UsageError(f"--bind {config.bind}: give an address without a port; the port is --scheduler-port")
    if node_rank == 0 and not is_loopback(bind) and not env.get("DYNAMIX_TOKEN"):
        raise UsageError(f"--bind {bind}: a scheduler listening beyond loopback needs a shared secret; set "
                         "DYNAMIX_TOKEN, or bind 127.0.0.1")
    if node_rank == 0:
        check_port_free(config.scheduler_port or 0, bind, "--scheduler-port")
    port = config.scheduler_port if config.scheduler_port is not None else free_port()
    address = grpc_address(hosts[0] if multi_host else _dial(bind), port)
    if node_rank != 0:
        return [], address
    if config.tls_ca is not None and config.tls_cert is None:
        raise UsageError("--tls-ca on node 0 needs --tls-cert and --tls-key: its scheduler must serve TLS")
    ready = config.run_dir / f".scheduler-{os.getpid()}.port"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "dynamix_byteps.cli", "scheduler", "--port", str(port), "--port-file", str(ready),
            "--bind", bind, "--policy", config.policy, "--num-workers", str(total),
            "--decision-interval", str(config.decision_interval), "--run-dir", str(config.run_dir)]
    trainer = []
    if config.fine_tune is not None:
        trainer.append(_fine_tune_spec(config, env, argv))
    elif config.policy_path is not None:
        argv += ["--policy-option", f"path={config.policy_path}"]
    for key, value in config.policy_option:
        argv += ["--policy-option", f"{key}={value}"]
    for flag in _GUARDRAIL_FLAGS:
        if getattr(config, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", repr(getattr(config, flag))]
    if config.tls_cert is not None:
        argv += ["--tls-cert", str(config.tls_cert), "--tls-key", str(config.tls_key)]
    spec = ChildSpec(label="scheduler", argv=argv, env=dict(env, PYTHONUNBUFFERED="1"),
                     log_path=_log(config, "scheduler.log"), service=True, ready_file=ready)
    return [spec, *trainer], address


def _dial(bind: str) -> str:
    """The address this host's workers reach a scheduler listening on ``bind`` at."""
    return {"0.0.0.0": LOCAL_HOST, "::": "::1"}.get(bind, bind)


def _check_policy(config: LaunchConfig) -> None:
    """``--policy ppo`` needs a readable ``--policy-path``, ``ppo:NAME`` a policy of the library."""
    if config.policy.startswith("ppo:"):
        if config.policy_path is not None:
            raise UsageError(f"--policy {config.policy} is a library policy; drop --policy-path, or use --policy ppo "
                             "--policy-path DIR")
        from dynamix_byteps.policy.ppo.library import policy_dir

        try:
            policy_dir(config.policy[len("ppo:"):])
        except ConfigurationError as error:
            raise UsageError(f"--policy: {error}") from None
    elif config.policy == "ppo":
        if config.policy_path is None:
            raise UsageError("--policy ppo needs --policy-path DIR (a policy directory written by "
                             "`dynamix policy train --out DIR` or `dynamix policy export`)")
        from dynamix_byteps.policy.ppo.policy_format import read_metadata

        try:
            read_metadata(config.policy_path)
        except ConfigurationError as error:
            raise UsageError(f"--policy-path: {error}") from None
    elif config.policy_path is not None:
        raise UsageError(f"--policy-path is for --policy ppo, not --policy {config.policy}")
    if config.policy_option:
        _check_policy_options(config)


def _check_policy_options(config: LaunchConfig) -> None:
    """``--policy-option``s the policy takes, never ``path`` (``--policy-path``) or, under
    ``--fine-tune``, ``explore`` (the trainer sets both): the policy is built once here, so that a
    wrong option stops the launch before any process starts."""
    keys = [key for key, _ in config.policy_option]
    for key in {"path", *(["explore"] if config.fine_tune is not None else [])} & set(keys):
        raise UsageError(f"--policy-option {key}=...: " + ("use --policy-path DIR" if key == "path"
                                                          else "--fine-tune sets explore itself"))
    if len(set(keys)) != len(keys):
        raise UsageError(f"--policy-option: {sorted({k for k in keys if keys.count(k) > 1})} given more than once")
    from dynamix_byteps.policy import make_policy

    options = dict(config.policy_option)
    if config.policy_path is not None:
        options["path"] = str(config.policy_path)
    try:
        make_policy(config.policy, **options)
    except ConfigurationError as error:
        raise UsageError(f"--policy-option: {error}") from None


def _fine_tune_spec(config: LaunchConfig, env: Mapping[str, str], scheduler_argv: list[str]) -> ChildSpec:
    """--fine-tune: the trainer service (``dynamix policy finetune``, see
    :func:`dynamix_byteps.cli.policy.trainer_argv`); points the scheduler at the copy of the policy
    it publishes into, with exploration on."""
    if config.policy != "ppo":
        raise UsageError(f"--fine-tune needs --policy ppo --policy-path DIR (a directory from `dynamix policy train` "
                         f"with its RLlib checkpoint), not --policy {config.policy}")
    if config.log_dir is None:
        raise UsageError("--fine-tune needs --log-dir DIR: the policy generations it trains are published there "
                         "(without it they would be deleted with the job's temporary folder)")
    from dynamix_byteps.cli.policy import trainer_argv

    try:
        argv, served = trainer_argv(config.policy_path, config.run_dir, every=config.fine_tune)
    except ConfigurationError as error:
        raise UsageError(f"--fine-tune: {error}") from None
    scheduler_argv += ["--policy-option", f"path={served}", "--policy-option", "explore=true"]
    return ChildSpec(label="finetune", argv=argv, env=dict(env, PYTHONUNBUFFERED="1"),
                     log_path=config.log_dir / "finetune.log", service=True)


def agent_spec(config: LaunchConfig, env: Mapping[str, str], scheduler: str, node_rank: int) -> ChildSpec:
    """This host's node agent (``dynamix agent``), reporting to ``scheduler``; the workers start once it is ready.
    It logs to ``agent.log`` on node 0 and ``agent-<node_rank>.log`` on the others, so that hosts sharing
    one ``--log-dir`` keep each its own log."""
    ready = config.run_dir / f".agent-{os.getpid()}.ready"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "dynamix_byteps.cli", "agent", "--job", config.job_id, "--scheduler", scheduler,
            "--monitor", config.monitor, "--ready-file", str(ready)]
    if config.tls_ca is not None:
        argv += ["--tls-ca", str(config.tls_ca)]
    return ChildSpec(label="agent", argv=argv, env=dict(env, PYTHONUNBUFFERED="1"), log_path=_log(config, "agent.log" if node_rank == 0 else f"agent-{node_rank}.log"),
                     service=True, ready_file=ready)


def ps_server_spec(config: LaunchConfig, env: Mapping[str, str], index: int, *, servers: int, workers: int,
                   addr: str, port: int, service: bool = True) -> ChildSpec:
    """Summation server ``index`` of ``servers`` for ``workers`` worker processes, its rendezvous
    (hosted by server 0) at ``addr:port`` (``python -m dynamix_byteps.engine.ps_server``). As a
    ``service`` it starts before the workers, the job fails when it does, and it is stopped once
    every worker has exited; else (BytePS environment mode) it is the launcher's only child."""
    argv = [sys.executable, "-m", "dynamix_byteps.engine.ps_server", "--server-id", str(index),
            "--num-servers", str(servers), "--num-workers", str(workers), "--addr", addr, "--port", str(port)]
    if config.timeout is not None:
        argv += ["--timeout", repr(config.timeout)]
    return ChildSpec(label=f"server{index}", argv=argv, env=dict(env, DMLC_ROLE="server", PYTHONUNBUFFERED="1"),
                     log_path=_log(config, f"server-{index}.log"), service=service, ends_with_workers=service,
                     essential=service, stopped_code=STOPPED_BY_A_WORKER if service else None)


def byteps_role_spec(config: LaunchConfig, env: Mapping[str, str], role: str) -> ChildSpec:
    """BytePS's own ``server`` or ``scheduler`` (environment mode, ``--engine byteps``)."""
    child_env = dict(env, PYTHONUNBUFFERED="1")
    if config.port is not None:
        child_env["DMLC_PS_ROOT_PORT"] = str(config.port)
    require_byteps(role)
    # As BytePS does: importing byteps.server starts the server (or scheduler) and blocks.
    return ChildSpec(label=role, argv=[sys.executable, "-c", "import byteps.server"], env=child_env,
                     log_path=_log(config, f"{role}.log"))
