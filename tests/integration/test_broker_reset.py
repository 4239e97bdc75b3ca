"""A network blip between decode and the broker is no alarm: streams that read shared prefix pages (and pages they
published themselves) go on through a reset of every TCP connection to the broker's port, each token passes the
oracle, and nothing is counted as a lease violation. Decode's revocation stream reconnects, and its re-check of
every running request's leases must pass what each holds, shares included."""
import threading
import time

import grpc

from pdserve.client import build_request
from pdserve.common.errors import from_rpc_error
from tests.integration.helpers import prompt, reset_connections, wait_for

PREFIX_TOKENS = 64  # 4 full pages of 16 tokens
NUM_STREAMS, MAX_TOKENS = 6, 2000


def violations(stack, service: str) -> float:
    return stack.metric(service, "pdserve_lease_violations_total")


class Streams:
    def __init__(self, stack, prompts: list[list[int]]):
        self.tokens = [[] for _ in prompts]
        self.errors: list[tuple[int, object]] = []
        self.threads = [threading.Thread(target=self._run, args=(stack, i, p), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, stack, i: int, ids: list[int]) -> None:
        call = stack.gateway.Generate(build_request(prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True),
                                      timeout=120)
        try:
            for r in call:
                self.tokens[i].extend(r.token_ids)
        except grpc.RpcError as e:
            self.errors.append((i, from_rpc_error(e)))

    def join(self) -> None:
        for t in self.threads:
            t.join(150)


def test_streams_reading_shared_pages_survive_a_reset_of_every_broker_connection(stack, oracle):
    shared = prompt(PREFIX_TOKENS, 2701)
    warm = stack.generate(prompt_token_ids=shared + prompt(5, 2702), max_tokens=2, ignore_eos=True)
    assert "error" not in warm, warm  # its 4 full prefix pages are published: the streams below share them
    prompts = [shared + prompt(20, 2710 + i) for i in range(NUM_STREAMS)]
    before = {s: violations(stack, s) for s in ("decode", "broker")}
    hits = stack.metric("decode", "pdserve_prefix_cache_lookup_pages_total", {"result": "hit"})
    current = stack.metric("decode", "pdserve_lease_rechecks_total", {"outcome": "current"})
    broker_port = stack.procs["broker"][0].port

    streams = Streams(stack, prompts)
    wait_for(lambda: all(len(t) >= 20 for t in streams.tokens) or streams.errors, 60, "every stream under way")
    assert not streams.errors, streams.errors
    num_reset = reset_connections(broker_port)
    # the reconnected revocation stream re-checks every running request; once they are counted, a second blip
    wait_for(lambda: stack.metric("decode", "pdserve_lease_rechecks_total", {"outcome": "current"})
             >= current + NUM_STREAMS or streams.errors, 30, "decode's re-check after the reset")
    progress = [len(t) for t in streams.tokens]
    num_reset += reset_connections(broker_port)
    streams.join()
    print(f"reset {num_reset} connections to the broker's port {broker_port}; tokens at the second reset: "
          f"{progress}; re-checks passed: "
          f"{stack.metric('decode', 'pdserve_lease_rechecks_total', {'outcome': 'current'}) - current:.0f}")

    assert not streams.errors, streams.errors
    assert num_reset >= 2, num_reset  # decode's channel at least, both times
    assert max(progress) < MAX_TOKENS, progress  # the second reset came while they still streamed
    assert [len(t) for t in streams.tokens] == [MAX_TOKENS] * NUM_STREAMS
    oracle.check_many(list(zip(prompts, streams.tokens)))
    # every stream read the 4 cached pages of the prefix
    assert stack.metric("decode", "pdserve_prefix_cache_lookup_pages_total",
                        {"result": "hit"}) - hits >= NUM_STREAMS * PREFIX_TOKENS // 16
    assert stack.metric("decode", "pdserve_lease_rechecks_total", {"outcome": "current"}) >= current + NUM_STREAMS
    assert stack.metric("decode", "pdserve_lease_rechecks_total", {"outcome": "not_current"}) == 0
    time.sleep(0.5)  # a violation is counted before the request's error reaches the client; none came
    assert {s: violations(stack, s) for s in ("decode", "broker")} == before
