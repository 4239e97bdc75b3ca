"""A decode step that outlives its lease (issue 18, hole 2). The step thread stalls (fault decode.stall_step)
longer than lock_delay while decode's event loop keeps renewing; meanwhile the operator revokes one owner of the
batch, and new requests keep asking for pages. No page of the revoked owner may be granted again while the
stalled step can still write it (the old rule freed them lock_delay after the revocation, and the step then
wrote its token's K/V into another request's prompt page); every stream's tokens pass the oracle, no canary is
hit, and the pool drains."""
import threading
import time

import grpc

from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import broker_pb2, decode_pb2
from tests.chaos.attribution import Outcome, Record
from tests.chaos.conftest import CHAOS_EXTRA
from tests.integration.helpers import (allocate, collect, decode_stream, drained, generate_when_served, prefill, prompt,
                                       wait_for)

LOCK_DELAY = float(CHAOS_EXTRA["broker"][CHAOS_EXTRA["broker"].index("--lock-delay") + 1])
STALL_MS = int((LOCK_DELAY + 2.5) * 1000)

# each victim still runs when the stall is armed (the native decode step runs ~1 ms a token here: with 400, the
# first finished before it on 2 cores with one more busy process), and the three, leased as they generate, leave
# most of the chaos pool's 128 pages to the grants tried during the stall
VICTIM_TOKENS = 600


def test_no_page_is_granted_again_while_a_stalled_step_may_write_it(chaos, oracle):
    # an earlier schedule's broker restart may have moved decode to a new pool incarnation, served only after the
    # old broker's fence
    assert "error" not in generate_when_served(chaos, [7, 8, 9], 2, timeout=60)
    wait_for(lambda: drained(chaos), 20, "an idle pool")
    canaries = chaos.metric("decode", "pdserve_canary_hits_total")
    record = Record(chaos).start()
    ready = []
    for i in range(3):  # granted first on an idle pool: the lowest page ids, the next ones any grant would take
        tokens = prompt(40, 500 + i)
        rid, dest = allocate(chaos, len(tokens), VICTIM_TOKENS)
        ready.append((rid, dest, tokens, prefill(chaos, rid, tokens, dest, VICTIM_TOKENS)))
    # the three start decoding together, once all are prefilled: the first no longer runs alone meanwhile
    victims = [(rid, dest, tokens, iter(decode_stream(chaos, rid, tokens, resp, VICTIM_TOKENS)))
               for rid, dest, tokens, resp in ready]
    got = {rid: [next(stream).token_id for _ in range(5)] for rid, _, _, stream in victims}
    outcome = {}

    def read(rid, stream):
        outcome[rid] = (*collect(stream), time.monotonic())
    readers = [threading.Thread(target=read, args=(rid, stream)) for rid, _, _, stream in victims]
    for t in readers:
        t.start()
    chaos.arm("decode", "decode.stall_step", arg=str(STALL_MS))
    time.sleep(0.5)  # the next step is stalled in its thread now
    revoked, rdest = victims[0][0], victims[0][1]
    revoked_pages = {x.page for x in rdest.leases}
    revoked_at = time.monotonic()
    chaos.broker.Revoke(broker_pb2.RevokeRequest(pool_id=rdest.pool_id, owner=revoked, reason="STALL_TEST"),
                        timeout=5)
    record.revoked[revoked] = "the test's Revoke"
    grants, extra = [], []
    while revoked not in outcome and time.monotonic() - revoked_at < STALL_MS / 1000 + 10:
        # new requests keep asking for pages while the step is stalled; most give them back at once
        tokens = prompt(30, 900 + len(grants))
        try:
            rid, dest = allocate(chaos, len(tokens), 4)
        except grpc.RpcError as e:
            assert from_rpc_error(e).code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            time.sleep(0.2)
            continue
        grants.append((time.monotonic(), {x.page for x in dest.leases}))
        resp = prefill(chaos, rid, tokens, dest, 4)
        if len(extra) < 3:
            extra.append((tokens, iter(decode_stream(chaos, rid, tokens, resp, 4))))
        else:
            chaos.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=rid), timeout=5)
        time.sleep(0.2)
    for t in readers:
        t.join(60)
    rest, err, ended_at = outcome[revoked]
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED"), err
    assert ended_at - revoked_at >= LOCK_DELAY  # the stall really outlived lock_delay
    # the heart of it: while the stalled step could still write the revoked pages, nobody got them
    overlap = [(round(t - revoked_at, 2), pages & revoked_pages) for t, pages in grants
               if t < ended_at and pages & revoked_pages]
    assert overlap == [], overlap
    assert any(t - revoked_at > LOCK_DELAY for t, _ in grants), "no grant was tried past lock_delay"
    oracle.check(victims[0][2], got[revoked] + rest)
    for rid, _, tokens, _ in victims[1:]:
        rest, err, _ = outcome[rid]
        assert err is None and len(got[rid] + rest) == VICTIM_TOKENS, err
        oracle.check(tokens, got[rid] + rest)
    for tokens, stream in extra:
        out, err = collect(stream)
        assert err is None and len(out) == 4, err
        oracle.check(tokens, [*out])
    wait_for(lambda: drained(chaos), LOCK_DELAY + 10, "the revoked pages to leave quarantine")
    assert chaos.metric("decode", "pdserve_canary_hits_total") == canaries
    # the one DATA_LOSS is the revoked request's; the stall explains nothing (it changes no page), so the other
    # victims and the grants made during it end with no violation
    record.finish()
    rest, err, _ = outcome[revoked]
    _, unexplained = record.attribute([Outcome("revoked", victims[0][2], got[revoked] + rest,
                                               ("DATA_LOSS", err.reason, err.message), revoked)], "stalled step")
    assert not unexplained, unexplained
    assert {o for _, _, o, _ in record.violations} <= {revoked}, record.violations
