"""Revocations survive a cut revocation stream, a blind decode stops, and leases end with their holder
(issue 9, holes 4 and 5). Decode reaches the broker through a TCP proxy that the tests partition for real."""
import socket
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.common.config import pages_needed
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import broker_pb2
from tests.integration.helpers import allocate, decode_stream, drained, generate_when_served, prefill, prompt, wait_for
from tests.integration.proxy import TcpProxy
from tests.integration.stack import Stack

# lock_delay 5.5 s: the least that covers Mooncake's shortest timeout (5 s) + 0.3 s slack, as prefill checks
LOCK_DELAY, MAX_BLIND, GRACE, RPC_TIMEOUT, READER_TTL = 5.5, 1.5, 2.0, 2.0, 6.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(model_dir):
    port = free_port()  # the broker's port must be known before decode starts, to put the proxy in front
    proxy = TcpProxy(port)
    s = Stack(model_dir, extra={
        "broker": ["--port", str(port), "--lock-delay", str(LOCK_DELAY), "--reader-ttl", str(READER_TTL),
                   "--reconcile-grace", str(GRACE), "--sweep-interval", "0.2"],
        "prefill": ["--landing-slack", "0.3"],
        # every request here is leased whole up front (a headroom past any of them): the revocation must reach
        # decode through the stream it cuts, not through a growth Extend the broker refuses for a revoked owner
        "decode": ["--broker", proxy.target, "--max-blind", str(MAX_BLIND), "--rpc-timeout", str(RPC_TIMEOUT),
                   "--headroom-pages", "256"]})
    s.proxy = proxy
    yield s
    s.close()
    proxy.close()


def state(stack):
    return stack.pool_states()[0]


def start_request(stack, n_prompt: int, max_tokens: int, seed: int):
    tokens = prompt(n_prompt, seed)
    rid, dest = allocate(stack, len(tokens), max_tokens)
    resp = prefill(stack, rid, tokens, dest, max_tokens)
    return tokens, rid, dest, iter(decode_stream(stack, rid, tokens, resp, max_tokens))


def timed_tokens(stream) -> tuple[list[tuple[float, int]], object]:
    got = []
    try:
        for r in stream:
            got.append((time.monotonic(), r.token_id))
    except grpc.RpcError as e:
        return got, from_rpc_error(e)
    return got, None


def test_revocation_sent_while_the_watch_is_cut_reaches_decode_on_resume(live, oracle):
    wait_for(lambda: drained(live), 15, "an idle pool")
    tokens, rid, dest, stream = start_request(live, 64, 2000, 11)
    got = [next(stream).token_id for _ in range(3)]
    live.proxy.partition()  # the broker's send of the revocation goes into a dead link
    live.broker.Revoke(broker_pb2.RevokeRequest(pool_id=dest.pool_id, owner=rid, reason="CUT_TEST"), timeout=5)
    time.sleep(MAX_BLIND / 3)
    live.proxy.heal()
    rest, err = timed_tokens(stream)
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED"), err
    assert "CUT_TEST" in err.message, err  # the revocation itself arrived (replayed), not only a re-check
    out = got + [t for _, t in rest]
    assert len(out) < 2000
    oracle.check(tokens, out)  # every token sent was computed from its own, still quarantined, pages
    wait_for(lambda: drained(live), LOCK_DELAY + 3, "the revoked pages to leave quarantine")


def test_a_watch_down_longer_than_the_bound_stops_running_requests(live, oracle):
    wait_for(lambda: drained(live), 15, "an idle pool")
    tokens, rid, dest, stream = start_request(live, 48, 3000, 12)
    first = [next(stream).token_id for _ in range(3)]
    cut = time.monotonic()
    live.proxy.partition()
    try:
        rest, err = timed_tokens(stream)
        ended = time.monotonic()
    finally:
        time.sleep(max(0.0, cut + 2 * MAX_BLIND - time.monotonic()))
        live.proxy.heal()
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "WATCH_BLIND"), err
    late = [t for when, t in rest if when > cut + MAX_BLIND + 1.0]  # 1 s: a step in flight and delivery
    assert late == [] and ended < cut + MAX_BLIND + 1.0, (len(late), ended - cut)
    oracle.check(tokens, first + [t for _, t in rest])
    # new requests are refused while blind, and served again once the stream is back
    p = prompt(40, 13)
    out = generate_when_served(live, p, 8, refused_code="UNAVAILABLE")
    assert "error" not in out, out
    oracle.check(p, out["token_ids"])
    wait_for(lambda: drained(live), READER_TTL + LOCK_DELAY + 3, "the failed request's pages to drain")


def test_a_lost_grant_reply_is_revoked_and_drains(live):
    wait_for(lambda: drained(live), 15, "an idle pool")
    live.arm("broker", "broker.lose_grant_reply")
    with pytest.raises(grpc.RpcError) as e:
        allocate(live, 100, 8)
    assert from_rpc_error(e.value).reason == "FAULT_LOST_REPLY"
    s = state(live)
    assert s.num_leased == pages_needed(100, 8, 16) and s.num_free == s.num_pages - s.num_leased - s.num_cached  # the grant happened
    took = wait_for(lambda: drained(live), GRACE + LOCK_DELAY + 3, "the unheld owner to be revoked and drained")
    assert took >= LOCK_DELAY  # through quarantine, never straight back to FREE


def test_a_failed_release_is_revoked_and_drains(live, oracle):
    wait_for(lambda: drained(live), 15, "an idle pool")
    live.arm("decode", "decode.fail_release")
    p = prompt(70, 14)
    out = live.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True)
    oracle.check(p, out["token_ids"])
    time.sleep(0.3)
    s = state(live)
    # the Release really did not reach the broker: its pages are still leased (its 4 full prompt pages, published
    # as cached, by a reader's share)
    assert (s.num_leased, s.num_shared_reads) == (pages_needed(70, 6, 16) - 70 // 16, 70 // 16)
    took = wait_for(lambda: drained(live), GRACE + LOCK_DELAY + 3, "the leaked owner to be revoked and drained")
    assert took >= LOCK_DELAY - 0.3  # through quarantine, never straight back to FREE


def test_decode_refuses_to_start_with_a_blind_bound_over_half_the_lock_delay(live, model_dir):
    t = live.tls("decode/decode9")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode", "--model", model_dir, "--port", "0",
                        "--metrics-port", "0", "--broker", live.procs["broker"][0].target,
                        "--tls-cert", t.cert_path, "--tls-key", t.key_path, "--tls-ca", t.ca_path,
                        "--max-blind", str(LOCK_DELAY / 2 + 0.5)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    err = r.stderr + r.stdout
    assert f"--max-blind {LOCK_DELAY / 2 + 0.5:g}s" in err and f"lock_delay {LOCK_DELAY:g}s" in err, err
    assert "PDSERVE_READY" not in r.stdout
