"""GatewayServicer.generate when decode hands a request back (preempted: its pool ran dry; drained: still running at
the end of its drain timeout): the gateway resubmits prompt + the tokens streamed so far through prefill, with
max_tokens what is left, and the client's stream goes on with no token twice and none missing; a drained one goes
to another decode, never back. A hand-back whose count disagrees with what the client has, one past
--max-resubmissions, or a drained one with no other decode, ends the stream with an error instead. Stub backends (a
unit test of the gateway alone); the whole stack's are tests/integration/test_pages_on_demand.py and
test_drain_hand_back.py."""
import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.common.errors import PdError, to_status
from pdserve.common.proto import common_pb2, decode_pb2, gateway_pb2, prefill_pb2
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer

PROMPT = [5, 6, 7]


def _handed_back(tokens_streamed: int, reason: str) -> grpc.aio.AioRpcError:
    status = to_status(PdError(grpc.StatusCode.UNAVAILABLE, reason, "the KV pool ran dry or decode drains",
                               metadata={"tokens_streamed": str(tokens_streamed)}))
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
                                details=status.details)


class Run:
    """Decode's Run stream: the destination, then `tokens` (the first from the prefill's notice), then the end
    or a hand-back (a preemption unless reason says otherwise)."""

    def __init__(self, tokens: list[int], preempt_after: int | None, said: int | None, reason: str = "PREEMPTED"):
        self.events = [decode_pb2.RunEvent(destination=common_pb2.Destination(pool_id="p"))]
        for i, t in enumerate(tokens):
            finish = common_pb2.FINISH_REASON_LENGTH if preempt_after is None and i == len(tokens) - 1 else 0
            self.events.append(decode_pb2.RunEvent(token=decode_pb2.DecodeResponse(token_id=t, finish_reason=finish)))
        self.error = None if preempt_after is None else _handed_back(preempt_after if said is None else said, reason)

    async def read(self):
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise self.error
        return grpc.aio.EOF

    def cancel(self):
        pass


class Decode:
    def __init__(self, script):
        self.script, self.requests = list(script), []

    def Run(self, req, timeout):
        self.requests.append(req)
        return Run(*self.script.pop(0))


class Prefill:
    def __init__(self):
        self.requests = []

    async def Prefill(self, req, timeout):
        self.requests.append(req)
        return prefill_pb2.PrefillResponse()


def _generate(script, max_resubmissions: int = 3, max_tokens: int = 7, others: tuple = (), **fields):
    """others: further decodes (Decode, queue depth), each looking busier than the first: the load choice is
    always the first one unless it is excluded."""
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    decode, prefill = Decode(script), Prefill()
    decodes = [Backend("dc", decode, info)] + [Backend(f"dc{i + 1}", d, SimpleNamespace(free_pages=100, queue_depth=q))
                                               for i, (d, q) in enumerate(others)]
    gw = GatewayServicer(Router("prefill", [Backend("pf", prefill, info)]),
                         Router("decode", decodes), ByteTokenizer(512),
                         Capacity("m", 4096, 512, 16, 100, 4096), max_resubmissions=max_resubmissions)
    gw.grammars = SimpleNamespace(start=lambda spec: object())  # every grammar compiles (prefill and decode check)
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True, **fields)
    got = []

    async def main():
        async for m in gw.generate(req):
            got.append(m)
    try:
        asyncio.run(main())
        err = None
    except PdError as e:
        err = e
    return got, err, decode, prefill


def test_a_preempted_stream_goes_on_from_prompt_plus_its_tokens_without_a_gap_or_a_repeat():
    # decode streams 3 tokens and is preempted; the resubmission's first token is the 4th, prefill's own
    got, err, decode, prefill = _generate([([65, 66, 67], 3, None), ([68, 69, 70, 71], None, None)])
    assert err is None
    assert [t for m in got for t in m.token_ids] == [65, 66, 67, 68, 69, 70, 71]
    assert "".join(m.text for m in got) == "ABCDEFG" and got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [list(r.token_ids) for r in prefill.requests] == [PROMPT, PROMPT + [65, 66, 67]]
    assert [r.sampling.max_tokens for r in decode.requests] == [7, 4]
    assert [r.num_prompt_tokens for r in decode.requests] == [3, 6]
    assert decode.requests[0].request_id != decode.requests[1].request_id  # a new request, new leases
    assert got[0].request_id and not any(m.request_id for m in got[1:])  # one stream to the client


def test_a_preemption_whose_count_disagrees_with_the_stream_ends_it():
    got, err, _, prefill = _generate([([65, 66, 67], 3, 2), ([68], None, None)])
    assert err.code == grpc.StatusCode.INTERNAL and err.reason == "PREEMPTED_MISMATCH"
    assert "after 2 tokens" in err.message and "streamed 3 of this submission" in err.message
    assert len(prefill.requests) == 1 and len(got) == 3


@pytest.mark.parametrize("limit", [0, 1])
def test_past_max_resubmissions_the_client_gets_the_preemption(limit):
    script = [([65 + 2 * i, 66 + 2 * i], 2, None) for i in range(limit + 1)]  # decode counts per submission
    got, err, _, prefill = _generate(script, max_resubmissions=limit, max_tokens=20)
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "PREEMPTED"
    assert f"limit --max-resubmissions {limit}" in err.message
    assert len(prefill.requests) == limit + 1 and [t for m in got for t in m.token_ids] == \
        list(range(65, 65 + 2 * (limit + 1)))


def test_decode_counts_each_submission_on_its_own():
    """The second preemption's tokens_streamed counts what that submission streamed (2), not the whole stream (4)."""
    got, err, decode, prefill = _generate([([65, 66], 2, None), ([67, 68], 2, None), ([69, 70, 71], None, None)])
    assert err is None and [t for m in got for t in m.token_ids] == list(range(65, 72))
    assert [list(r.token_ids) for r in prefill.requests] == [PROMPT, PROMPT + [65, 66], PROMPT + [65, 66, 67, 68]]
    assert [r.sampling.max_tokens for r in decode.requests] == [7, 5, 3]


def test_each_resubmission_tells_decode_how_often_the_request_was_handed_back():
    """Decode's preemption policy spares the requests handed back most (growth.py): the gateway counts for it."""
    got, err, decode, _ = _generate([([65, 66], 2, None), ([67], 1, None), ([68, 69, 70, 71], None, None)])
    assert err is None and [t for m in got for t in m.token_ids] == list(range(65, 72))
    assert [r.handed_back for r in decode.requests] == [0, 1, 2]


def test_a_constrained_resubmission_carries_its_output_so_far_to_the_grammar():
    """Prefill and decode start the grammar afresh: they are told the tokens it must consume first, and min_tokens
    counts what was streamed before."""
    got, err, decode, prefill = _generate([([65, 66], 2, None), ([67, 68], 2, None), ([69, 70, 71], None, None)],
                                          json_object=True, min_tokens=5)
    assert err is None and [t for m in got for t in m.token_ids] == list(range(65, 72))
    for reqs in (decode.requests, prefill.requests):
        assert [list(r.sampling.grammar_prefix) for r in reqs] == [[], [65, 66], [65, 66, 67, 68]]
        assert [r.sampling.min_tokens for r in reqs] == [5, 3, 1] and all(r.sampling.json_object for r in reqs)
    _, _, plain, _ = _generate([([65, 66], 2, None), ([67], None, None)], max_tokens=3)
    assert [list(r.sampling.grammar_prefix) for r in plain.requests] == [[], []]  # unconstrained: nothing to replay



def _resubmissions(outcome: str) -> float:
    return REGISTRY.get_sample_value("pdserve_resubmissions_total", {"outcome": outcome}) or 0.0


def test_a_drained_stream_goes_on_at_another_decode_never_back_at_the_draining_one():
    """decode dc hands the request back DRAINED after 3 tokens: though the load choice is still dc (dc1 looks
    busier, and the gateway's poll may not have seen dc drain yet), the resubmission runs on dc1, and the
    client's stream goes on there without a gap or a repeat."""
    other = Decode([([68, 69, 70, 71], None, None)])
    before = _resubmissions("resubmitted")
    got, err, decode, prefill = _generate([([65, 66, 67], 3, None, "DRAINED")], others=[(other, 5)])
    assert err is None, err
    assert [t for m in got for t in m.token_ids] == [65, 66, 67, 68, 69, 70, 71]
    assert len(decode.requests) == 1 and len(other.requests) == 1
    assert [list(r.token_ids) for r in prefill.requests] == [PROMPT, PROMPT + [65, 66, 67]]
    assert other.requests[0].sampling.max_tokens == 4 and other.requests[0].num_prompt_tokens == 6
    assert _resubmissions("resubmitted") == before + 1


def test_a_drained_stream_with_no_other_decode_ends_unavailable_saying_so():
    before = _resubmissions("gave_up"), _resubmissions("resubmitted")
    got, err, decode, prefill = _generate([([65, 66, 67], 3, None, "DRAINED")])
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "DRAINED", err
    assert "not resubmitted after 3 tokens: no other decode instance takes work" in err.message, err.message
    assert [t for m in got for t in m.token_ids] == [65, 66, 67]
    assert len(decode.requests) == 1 and len(prefill.requests) == 1
    assert (_resubmissions("gave_up"), _resubmissions("resubmitted")) == (before[0] + 1, before[1])


def test_a_drained_count_that_disagrees_with_the_stream_ends_it():
    other = Decode([([68], None, None)])
    got, err, _, prefill = _generate([([65, 66, 67], 3, 4, "DRAINED")], others=[(other, 5)])
    assert err.code == grpc.StatusCode.INTERNAL and err.reason == "DRAINED_MISMATCH", err
    assert "after 4 tokens" in err.message and not other.requests and len(prefill.requests) == 1
