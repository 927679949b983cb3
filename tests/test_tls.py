"""Control-plane security: the shared token and optional TLS of the scheduler's gRPC server.

A real scheduler on 127.0.0.1 and real gRPC clients; the CA and certificates are throwaway ones
made with the ``openssl`` CLI (the ``cryptography`` package is not in the dev extra).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from dynamix_byteps.cli.scheduler import build_policy
from dynamix_byteps.control import dynamix_pb2, dynamix_pb2_grpc
from dynamix_byteps.control.client import SchedulerClient
from dynamix_byteps.control.scheduler import DECISION_LOG, SchedulerServer
from dynamix_byteps.control.security import TOKEN_METADATA_KEY, open_channel
from dynamix_byteps.errors import ConfigurationError

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "scripts" / "control_worker.py"
TOKEN = "s3cret-for-tls-tests"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> dict[str, Path]:
    """A self-signed CA and a server certificate it signed for 127.0.0.1/localhost, as PEM files."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", f"/CN={name}", cwd=directory)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=directory)
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "1", "-extfile", "san.cnf", cwd=directory)
    return {"ca": directory / "ca.pem", "cert": directory / "server.pem", "key": directory / "server.key"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    return {"good": make_ca(base / "good", "dynamix-test-ca"), "foreign": make_ca(base / "foreign", "other-ca")}


@contextmanager
def tls_scheduler(pki, **kwargs):
    policy = build_policy("static", {}, max_change=2.0, hysteresis=0.05)
    server = SchedulerServer(policy, num_workers=1, decision_interval=2, token=TOKEN,
                             tls_cert=pki["good"]["cert"], tls_key=pki["good"]["key"], **kwargs)
    try:
        server.start()
        yield server
    finally:
        server.stop(grace=None)


def info() -> dynamix_pb2.WorkerInfo:
    return dynamix_pb2.WorkerInfo(rank=0, world_size=1, host="127.0.0.1", engine="gloo", min_batch=8,
                                  max_batch=128, batch_size=32, dataset_size=60000, step=0)


def register(address: str, ca: Path | None, token: str | None) -> grpc.StatusCode:
    metadata = ((TOKEN_METADATA_KEY, token),) if token else None
    with open_channel(address, ca) as channel:
        try:
            dynamix_pb2_grpc.SchedulerStub(channel).Register(info(), timeout=5, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_a_tls_client_with_the_right_ca_and_token_is_served(pki):
    with tls_scheduler(pki) as server:
        assert server.tls
        assert register(f"127.0.0.1:{server.port}", pki["good"]["ca"], TOKEN) == grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_a_plaintext_client_against_a_tls_scheduler_is_refused(pki):
    with tls_scheduler(pki) as server:
        assert register(f"127.0.0.1:{server.port}", None, TOKEN) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(60)
def test_a_client_trusting_another_ca_is_refused(pki):
    with tls_scheduler(pki) as server:
        assert register(f"127.0.0.1:{server.port}", pki["foreign"]["ca"], TOKEN) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_a_missing_or_wrong_token_is_refused_over_tls(pki, token):
    with tls_scheduler(pki) as server:
        assert register(f"127.0.0.1:{server.port}", pki["good"]["ca"], token) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.timeout(60)
def test_the_worker_client_gets_assignments_over_tls(pki):
    with tls_scheduler(pki) as server:
        client = SchedulerClient(f"127.0.0.1:{server.port}", TOKEN, info, tls_ca=str(pki["good"]["ca"]))
        try:
            deadline = time.monotonic() + 20
            while client.latest() is None:
                client.submit(dynamix_pb2.Report(rank=0, step=2, local_batch_size=32, compute_s=0.1,
                                                  push_pull_s=0.01, samples_per_s=300.0))
                assert time.monotonic() < deadline, "no assignment over TLS"
                time.sleep(0.2)
            assert list(client.latest().batch_sizes) == [32]
        finally:
            client.close()


def test_half_a_tls_configuration_or_a_bad_file_is_a_configuration_error(pki, tmp_path):
    policy = build_policy("static", {}, max_change=2.0, hysteresis=0.05)
    with pytest.raises(ConfigurationError, match="--tls-key"):
        SchedulerServer(policy, tls_cert=pki["good"]["cert"])
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigurationError, match="not a PEM file"):
        SchedulerServer(policy, tls_cert=tmp_path / "junk.pem", tls_key=pki["good"]["key"])
    with pytest.raises(ConfigurationError, match="cannot read"):
        open_channel("127.0.0.1:1", tmp_path / "missing.pem")


def _bpslaunch(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamix_byteps.launcher", *map(str, args)], check=False, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "{cert}"], "--tls-key"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}"], "--tls-ca"),
    (["--tls-ca", "/nonexistent/ca.pem", "--tls-cert", "{cert}", "--tls-key", "{key}"], "cannot read"),
    (["--tls-ca", "{ca}"], "--tls-cert"),
])
def test_bpslaunch_refuses_incomplete_tls_flags(pki, flags, message):
    paths = {k: str(v) for k, v in pki["good"].items()}
    proc = _bpslaunch("-n", "1", "--policy", "static", *[f.format(**paths) for f in flags], "--", "true")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


@pytest.mark.timeout(180)
def test_bpslaunch_runs_a_job_whose_scheduler_and_agent_speak_tls(pki, tmp_path):
    good = pki["good"]
    proc = _bpslaunch("-n", "2", "--policy", "static", "--decision-interval", "2", "--monitor", "proc",
                      "--tls-cert", good["cert"], "--tls-key", good["key"], "--tls-ca", good["ca"],
                      "--log-dir", tmp_path, "--", sys.executable, WORKER, tmp_path, 12, 16, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tls=on" in (tmp_path / "scheduler.log").read_text()
    decisions = [json.loads(line) for line in (tmp_path / DECISION_LOG).read_text().splitlines()]
    assert decisions, "the workers never reached the TLS scheduler"
    assert "refused" not in (tmp_path / "worker-0.log").read_text() + (tmp_path / "agent.log").read_text()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["127.0.0.1:{port}", "dns:///127.0.0.1:{port}", "ipv4:127.0.0.1:{port}"])
def test_a_worker_client_trusting_another_ca_logs_one_tls_error(pki, caplog, target):
    with tls_scheduler(pki) as server:
        client = SchedulerClient(target.format(port=server.port), TOKEN, info, tls_ca=str(pki["foreign"]["ca"]))
        try:
            start = time.monotonic()
            # Several failed reports: the error must still be logged only once.
            while time.monotonic() < start + 3 or not caplog.records:
                client.submit(dynamix_pb2.Report(rank=0, step=2, local_batch_size=32, compute_s=0.1,
                                                  push_pull_s=0.01, samples_per_s=300.0))
                assert time.monotonic() < start + 20, "no log record of the failing handshake"
                time.sleep(0.2)
        finally:
            client.close()
    records = [r for r in caplog.records if r.name == "dynamix_byteps.control.client"]
    assert [r.levelname for r in records] == ["ERROR"], [r.getMessage() for r in records]
    assert "TLS handshake" in records[0].getMessage() and "--tls-ca" in records[0].getMessage()
    assert records[0].getMessage().endswith("the certificate names 127.0.0.1")  # not dns:///127.0.0.1
    assert client.latest() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cert, key, ca, message", [
    ("good.cert", "foreign.key", "good.ca", "not a pair"),
    ("good.key", "good.cert", "good.ca", "not a pair"),
    ("good.cert", "good.key", "foreign.ca", "does not verify"),
    ("good.cert", "good.key", "good.key", "holds no certificate"),
])
def test_bpslaunch_refuses_a_mismatched_key_or_ca(pki, cert, key, ca, message):
    def path(spec):
        which, kind = spec.split(".")
        return pki[which][kind]

    proc = _bpslaunch("-n", "1", "--policy", "static", "--tls-cert", path(cert), "--tls-key", path(key),
                      "--tls-ca", path(ca), "--", "true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "--tls-" in proc.stderr


@pytest.mark.timeout(60)
def test_a_scheduler_with_a_key_of_another_certificate_says_so(pki):
    policy = build_policy("static", {}, max_change=2.0, hysteresis=0.05)
    with pytest.raises(ConfigurationError, match="not a pair.*--tls-key"):
        SchedulerServer(policy, tls_cert=pki["good"]["cert"], tls_key=pki["foreign"]["key"])
