"""A write reported failed that still lands (issue 9, hole 1): Mooncake's batch call returns failure while
other tasks of the batch still run, and a timeout flushes nothing. The fault transfer.fail_then_land makes the
real Mooncake path report failure at once and post the write later, reading the source pages as they are then.
Neither the destination pages nor prefill's source pages may be used again before the bound."""
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import common_pb2, decode_pb2
from tests.chaos.test_failures import LOCK_DELAY, state
from tests.integration.helpers import allocate, drained, prefill, prompt, wait_for


def landing_bound(chaos) -> float:
    """The bound prefill 0 announced at start-up (and the broker checked against lock_delay)."""
    for line in chaos.procs["prefill"][0].lines:
        if m := re.search(r"a posted write lands within ([0-9.]+)s", line):
            return float(m.group(1))
    raise AssertionError("prefill 0 did not log its landing bound")


def free_source_pages(chaos) -> int:
    return chaos.prefills[0].GetInfo(common_pb2.GetInfoRequest(), timeout=5).free_pages


@pytest.mark.parametrize("when", ["200ms", "just-under-the-bound"])
def test_write_reported_failed_then_landing_late_reaches_nobody_else(chaos, oracle, when):
    wait_for(lambda: drained(chaos), 15, "an idle pool")
    bound = landing_bound(chaos)
    assert bound <= LOCK_DELAY
    delay_ms = 200 if when == "200ms" else int((bound - 0.4) * 1000)
    all_source = free_source_pages(chaos)
    tokens = prompt(100, 81)
    rid, dest = allocate(chaos, len(tokens), 4)
    n_prompt = -(-len(tokens) // 16)
    mine = {lease.page for lease in dest.leases[:n_prompt]}
    chaos.arm("prefill", "transfer.fail_then_land", arg=str(delay_ms), index=0)
    sent = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        prefill(chaos, rid, tokens, dest, 4, p=0)
    failed = time.monotonic()
    err = from_rpc_error(info.value)
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED"), err
    # the failed write's destination is still being written as far as the broker knows, and once decode lets go
    # the pages wait in quarantine: nothing can be granted onto them
    assert state(chaos).num_writing == len(mine)
    chaos.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=rid), timeout=5)
    assert state(chaos).num_quarantined == len(mine)
    # the source pages the late write reads are out of reuse too
    assert free_source_pages(chaos) == all_source - n_prompt
    # meanwhile the stack keeps serving from other pages, on the same prefill process as well
    held_seen, source_seen = [], []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            s = state(chaos)
            held_seen.append((time.monotonic(), s.num_quarantined))
            source_seen.append((time.monotonic(), free_source_pages(chaos)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompts = [prompt(40 + 7 * i, 90 + i) for i in range(6)]
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: chaos.generate(prompt_token_ids=p, max_tokens=8, ignore_eos=True),
                                 prompts))
        wait_for(lambda: drained(chaos), LOCK_DELAY + 5, "the held pages to leave quarantine")
        drained_at = time.monotonic()
        wait_for(lambda: free_source_pages(chaos) == all_source, bound + 5, "prefill's source pages to return")
        source_back = time.monotonic()
    finally:
        stop.set()
        watcher.join()
    for p, out in zip(prompts, outs):
        assert out.get("error") is None, out
        oracle.check(p, out["token_ids"])
    # not one sample showed the held pages free before lock_delay after the failed write's ack (sent after
    # `sent`), nor the source pages back before the landing bound after the write's call returned
    assert drained_at - sent >= LOCK_DELAY
    assert all(q == len(mine) for t, q in held_seen if t < sent + LOCK_DELAY - 0.1)
    assert source_back - sent >= bound
    assert all(f <= all_source - n_prompt for t, f in source_seen if t < sent + bound - 0.1)
    # after the bound, the pages are usable again and serve correct output
    p = prompt(100, 99)
    out = chaos.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True)
    oracle.check(p, out["token_ids"])
    assert failed - sent < 5  # the failure was reported at once, long before the write landed
