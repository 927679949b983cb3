"""Hostile reports to the restart rendezvous: values no launcher sends are refused by node 0's
gRPC service with the field named (not counted), and :func:`decide` never turns one into a
negative slot count or an exit status that reads as success."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from dynamix_byteps.control.security import TOKEN_METADATA_KEY, open_channel
from dynamix_byteps.launcher import rendezvous
from dynamix_byteps.launcher.elastic import decide
from dynamix_byteps.launcher.rendezvous import RendezvousServer, RunReport, decision_message, end_round

TOKEN = "secret"


def report(node=1, **fields):
    base = dict(node=node, run=0, code=137, failed=2, failed_at=1.5, killed=[2], workers=[2, 3])
    return RunReport(**{**base, **fields})


BAD = [
    ({"killed": [2, 2, 2]}, "killed [2, 2, 2] lists a rank twice"),
    ({"workers": [2, 2]}, "workers [2, 2] lists a rank twice"),
    ({"killed": [7]}, "killed [7] names a rank that is not one of workers [2, 3]"),
    ({"self_failed": [9]}, "self_failed [9] names a rank that is not one of workers [2, 3]"),
    ({"failed": 99}, "failed 99 is not one of workers [2, 3]"),
    ({"code": 256}, "exit_code 256 is no exit status (0..255)"),
    ({"code": -1}, "exit_code -1 is no exit status (0..255)"),
    ({"code": 2**31 - 1}, "exit_code 2147483647 is no exit status (0..255)"),
    ({"failed_at": float("nan")}, "failed_at nan is not a time"),
    ({"failed_at": float("inf")}, "failed_at inf is not a time"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields, why", BAD)
def test_node_0_refuses_a_report_no_launcher_sends_naming_the_field_and_does_not_count_it(fields, why):
    with RendezvousServer("127.0.0.1", 0, TOKEN) as server:
        answer = end_round(("127.0.0.1", server.port), report(**fields), TOKEN, timeout_s=5)
        assert answer == {"exit": fields.get("code", 137), "reason": "node 0 refused the report: malformed report of "
                          f"node 1: {why} (INVALID_ARGUMENT)"}, answer
        assert server.collect(0, 1, timeout_s=0.2) == {}


@pytest.mark.parametrize("fields, why", BAD + [({"workers": [2, 3, 4, 5], "killed": [2, 3, 4, 5]},
                                                "workers [2, 3, 4, 5] of a host with 2 slot(s)")])
def test_decide_ends_the_job_on_a_malformed_report_instead_of_a_negative_slot_or_a_masked_exit(fields, why):
    host0 = RunReport(node=0, run=0, code=1, failed=0, failed_at=2.0, self_failed=[0], workers=[0, 1])
    decision = decide([2, 2], [host0, report(**fields)], restarts_left=3)
    assert decision == {"exit": 1, "reason": f"host 1's report of run 0 is malformed ({why}); not restarting"}
    decision_message(decision)  # a decision every host can be sent


def test_a_well_formed_report_still_restarts():
    host0 = RunReport(node=0, run=0, code=1, failed=0, failed_at=2.0, self_failed=[0], workers=[0, 1])
    assert decide([2, 2], [host0, report()], restarts_left=3) == {"slots": [2, 1], "lost": [2]}


@pytest.mark.timeout(60)
def test_clients_that_never_send_their_request_with_a_wrong_token_are_refused_without_holding_a_thread():
    """Each opens EndRound (headers, then nothing): the refusal used to wait for the request on a
    handler thread, so 2·hosts + 4 of them starved node 0 and a real host's report was never taken."""
    stalled, codes, stallers = threading.Event(), [], []

    def never_sends(port):
        def nothing():
            stalled.wait(30)
            yield from ()
        with open_channel(f"127.0.0.1:{port}") as channel:
            try:
                channel.stream_unary(f"/{rendezvous.SERVICE}/EndRound")(
                    nothing(), timeout=30, metadata=((TOKEN_METADATA_KEY, "wrong"),))
            except grpc.RpcError as error:
                codes.append(error.code())

    with RendezvousServer("127.0.0.1", 0, TOKEN, hosts=2) as server:
        try:
            stallers = [threading.Thread(target=never_sends, args=(server.port,)) for _ in range(2 * 2 + 4 + 4)]
            for thread in stallers:
                thread.start()
            started = time.monotonic()
            while len(codes) < len(stallers) and time.monotonic() - started < 10:
                time.sleep(0.05)
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(stallers)
            answer = {}
            host = threading.Thread(target=lambda: answer.update(
                end_round(("127.0.0.1", server.port), report(), TOKEN, timeout_s=10)))
            host.start()
            assert server.collect(0, 1, timeout_s=10) == {1: report()}
            server.answer(0, {"exit": 0, "reason": "done"})
            host.join(10)
            assert answer == {"exit": 0, "reason": "done"}
        finally:
            stalled.set()
            for thread in stallers:
                thread.join(10)
