"""Every running sequence makes progress (issue 18, hole 6): 80 concurrent streams on the default stack, whose
decode steps at most --max-batch 64 of them at a time. The old loop stepped the first 64 until they finished;
the other 16 waited (24.6 s between two tokens, measured in review). Now the batch rotates: no stream waits more
than 5 s between two tokens after its first, nor (whatever the machine's speed) while more than a few batches'
worth of tokens went to the others, and every stream's tokens pass the oracle. The streams are read by one event
loop (one channel per stream, as 80 clients would have), so a token's time is when it arrived, not when a client
thread next got the GIL among 80."""
import asyncio
import bisect
import time

import grpc

from pdserve.client import build_request
from pdserve.common.proto import gateway_pb2_grpc
from tests.integration.helpers import prompt

NUM_STREAMS, MAX_TOKENS, MAX_BATCH = 80, 100, 64
PASSED_BOUND = 5000  # tokens to the others during one wait (see the test)
assert PASSED_BOUND < MAX_BATCH * (MAX_TOKENS - 1)  # what the old loop let pass: the bound still tells it apart


async def _stream(target: str, p: list[int], out: dict, start: asyncio.Event) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await channel.channel_ready()
        times, ids = [], []
        await start.wait()
        try:
            async for r in stub.Generate(build_request(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True),
                                         timeout=300):
                now = time.monotonic()
                for tok in r.token_ids:
                    ids.append(tok)
                    times.append(now)
            out["error"] = None
        except grpc.RpcError as e:
            out["error"] = (e.code(), e.details())
        out["ids"], out["times"] = ids, times


async def _all(target: str, prompts: list[list[int]], outs: list[dict]) -> None:
    start = asyncio.Event()
    tasks = [asyncio.ensure_future(_stream(target, p, o, start)) for p, o in zip(prompts, outs)]
    await asyncio.sleep(0.5)  # every channel connected before the first request goes out
    start.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 300)


def test_80_streams_each_get_a_token_every_few_seconds(stack, oracle):
    target = stack.procs["gateway"][0].target
    prompts = [prompt(8 + i % 5, 7000 + i) for i in range(NUM_STREAMS)]
    outs = [{} for _ in prompts]
    asyncio.run(_all(target, prompts, outs))
    assert all(o.get("error") is None for o in outs), [o.get("error") for o in outs if o.get("error")][:3]
    assert all(len(o["ids"]) == MAX_TOKENS for o in outs)
    gaps = [max(b - a for a, b in zip(o["times"], o["times"][1:])) for o in outs]
    worst = max(range(NUM_STREAMS), key=lambda i: gaps[i])
    assert gaps[worst] <= 5.0, f"stream {worst} waited {gaps[worst]:.1f}s between two tokens (median of the " \
                               f"streams' worst gaps {sorted(gaps)[NUM_STREAMS // 2]:.2f}s)"
    # tokens the others got while one stream waited, whatever the machine's speed. The old loop let the first 64
    # streams run to their end before the other 16 had their second token: 64 x 99 = 6,336 tokens passed. A
    # rotating batch lets a few steps pass: on a quiet machine up to ~400 for the second token (its wait also covers
    # verification and a place at the back of the order while the other 79 arrive) and ~200 for a later one. The
    # count is taken where the tokens arrive, after the gateway and this client's one event loop, and a busy CPU
    # bunches deliveries: with two more busy processes on 2 cores, 183-3,148 and 81-2,778 passed over runs of the
    # same code while the worst gap stayed under 1 s. So the bound is what tells the old loop apart (5,000 < 6,336),
    # and the 5 s gap above is the promise to the client; the printed counts show how close a run came
    every = sorted(t for o in outs for t in o["times"])
    all_started = max(o["times"][0] for o in outs)

    def passed(waits) -> int:
        return max(bisect.bisect_left(every, b) - bisect.bisect_right(every, a) for a, b in waits)
    gaps_after = [list(zip(o["times"], o["times"][1:])) for o in outs]
    joining = passed(g[0] for g in gaps_after)
    rotating = passed((a, b) for g in gaps_after for a, b in g[1:] if a >= all_started)
    print(f"tokens passed while a stream waited: for its second {joining}, for a later one {rotating}; "
          f"worst gap {gaps[worst]:.2f}s")
    assert joining <= PASSED_BOUND, f"{joining} tokens went to other streams while one waited for its second"
    assert rotating <= PASSED_BOUND, f"{rotating} tokens went to other streams while one waited for its next, " \
                                     f"every stream running"
    oracle.check_many([(p, o["ids"]) for p, o in zip(prompts, outs)])
