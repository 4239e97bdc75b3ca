"""The short critical path (issue 12) on the default stack: per request exactly one decode Run stream and one
Prefill call, at the broker one Grant, one BeginWrite and one EndWrite and no Validate (the write-done notice
stands for it); a full decode pool makes requests wait in decode's queue, and they complete with the reference's
tokens once pages are given back; a write of another prompt under a Run's leases is refused."""
import concurrent.futures
import secrets
import time

import grpc
import pytest

from pdserve.common.config import pages_up_front
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import common_pb2, decode_pb2
from pdserve.common.wire import prompt_digest
from tests.integration.helpers import allocate, prefill, prompt, sampling, wait_no_leases

METHODS = {"broker": ("Grant", "BeginWrite", "EndWrite", "Validate"), "decode": ("Run", "Allocate", "Decode"),
           "prefill": ("Prefill",)}


def _calls(stack) -> dict:
    out = {}
    for service, names in METHODS.items():
        text = stack.metrics(service)
        for name in names:
            prefix = f'pdserve_rpc_seconds_count{{method="{name}"}} '
            out[name] = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
    return out


def test_each_request_costs_one_run_one_prefill_and_grant_begin_end_at_the_broker(stack, oracle):
    before = _calls(stack)
    prompts = [prompt(40 + 13 * i, 500 + i) for i in range(3)]
    outs = [stack.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True) for p in prompts]
    assert all("error" not in o for o in outs), outs
    after = _calls(stack)
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"Grant": 3, "BeginWrite": 3, "EndWrite": 3, "Validate": 0, "Run": 3, "Allocate": 0,
                     "Decode": 0, "Prefill": 3}, delta
    oracle.check_many([(p, o["token_ids"]) for p, o in zip(prompts, outs)])


def test_a_full_pool_queues_requests_in_decode_until_pages_come_back(stack, oracle):
    info = stack.decodes[0].GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    per = pages_up_front(4064, 32, info.page_size)  # 254 prompt pages + the headroom: 256 (pages on demand)
    held = [allocate(stack, 4064, 32)[0] for _ in range(info.free_pages // per)]  # the old path holds pages
    assert info.free_pages % per < pages_up_front(30, 8, info.page_size)  # so the three below must wait
    prompts = [prompt(30, 600 + i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(stack.generate, prompt_token_ids=p, max_tokens=8, ignore_eos=True) for p in prompts]
        until = time.monotonic() + 30
        depth = 0
        while time.monotonic() < until and depth < len(held) + 3:
            depth = stack.decodes[0].GetInfo(common_pb2.GetInfoRequest(), timeout=10).queue_depth
            time.sleep(0.05)
        done_early = [f for f in futs if f.done()]
        for rid in held:
            stack.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=rid), timeout=10)
        outs = [f.result(timeout=120) for f in futs]
    assert depth == len(held) + 3 and not done_early, (depth, len(held))  # all three waited in decode's queue
    assert all("error" not in o for o in outs), outs
    oracle.check_many([(p, o["token_ids"]) for p, o in zip(prompts, outs)])
    assert all(s.num_leased == 0 for s in wait_no_leases(stack))


def test_a_run_refuses_the_write_of_another_prompt_under_its_leases(stack):
    """A replayed or hostile Prefill that reaches BeginWrite first writes another prompt's KV with its own matching
    tags and checksums; the broker's notice carries that prompt's digest, and decode refuses it (the formal model's
    notice_without_prompt). The real Prefill then finds the lease already written."""
    mine, other = prompt(40, 700), prompt(40, 701)
    rid = secrets.token_bytes(16)
    run = stack.decodes[0].Run(decode_pb2.RunRequest(request_id=rid, num_prompt_tokens=len(mine),
                                                     sampling=sampling(4), prompt_digest=prompt_digest(mine)),
                               timeout=60)
    dest = next(run).destination
    before = stack.metric("decode", "pdserve_lease_violations_total", {"reason": "PROMPT_MISMATCH"})
    prefill(stack, rid, other, dest, 4)  # the hostile write: served, its EndWrite sends the notice
    with pytest.raises(grpc.RpcError) as e:
        next(run)
    err = from_rpc_error(e.value)
    assert (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "PROMPT_MISMATCH"), err
    assert stack.metric("decode", "pdserve_lease_violations_total", {"reason": "PROMPT_MISMATCH"}) == before + 1
    with pytest.raises(grpc.RpcError) as e:
        prefill(stack, rid, mine, dest, 4)
    # decode may have released the request already: then the broker says so (OWNER_RELEASED)
    assert from_rpc_error(e.value).reason in ("LEASE_ALREADY_WRITTEN", "LEASE_NOT_CURRENT", "OWNER_RELEASED")
    assert all(s.num_leased == 0 for s in wait_no_leases(stack))
