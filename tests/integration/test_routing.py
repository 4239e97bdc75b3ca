"""Routing over several prefill and decode instances: load spreads, every response is still correct, and a
gateway that discovers its backends (file: and dns:) follows a decode added while traffic runs and a decode
removed, without a restart."""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import launcher
from pdserve.client import build_request, generate
from pdserve.common.pki import make_pki
from pdserve.common.proto import gateway_pb2_grpc
from tests.integration.helpers import prompt, wait_no_leases
from tests.integration.stack import Stack

@pytest.fixture(scope="module")
def wide(model_dir):
    s = Stack(model_dir, num_prefill=2, num_decode=2, prefill_pool_tokens=4096, decode_pool_tokens=4096)
    yield s
    s.close()


def test_requests_spread_over_two_prefills_and_two_decodes(wide, oracle):
    jobs = [prompt(20 + 37 * i, 500 + i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: wide.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True), jobs))
    for p, out in zip(jobs, outs):
        assert "error" not in out, out
        oracle.check(p, out["token_ids"])
    for svc in ("prefill", "decode"):
        served = [wide.metric(svc, "pdserve_rpc_seconds_count", {"method": "Prefill" if svc == "prefill" else "Run"},
                              index=i) for i in range(2)]
        assert all(n >= 1 for n in served), (svc, served)
        assert sum(served) == 16
    states = wait_no_leases(wide)
    assert len(states) == 2 and all(s.num_leased == 0 for s in states)


MAX_TOKENS = 8


def _served(stack, i: int, method: str) -> float:
    try:
        return stack.metric("decode", "pdserve_rpc_seconds_count", {"method": method}, index=i)
    except KeyError:  # the per-method series appears with its first call
        return 0.0


def _decodes_served(stack, method: str = "Run") -> list[float]:
    return [_served(stack, i, method) for i in range(len(stack.procs["decode"]))]


def _wait(what: str, cond, stack, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{stack.logs()}"
        time.sleep(0.1)


def _write(path: str, targets: list[str]) -> None:
    # a rename, so the gateway never reads half a file
    with open(path + ".tmp", "w") as f:
        f.write("# decode instances\n" + "".join(f"{t}\n" for t in targets))
    os.replace(path + ".tmp", path)


def _start_decode(stack, i: int) -> launcher.Proc:
    """One more decode like decode0, with its own identity, on OS-picked ports."""
    args = list(stack.procs["decode"][0].args)
    f = make_pki(stack.tls_dir, [f"decode/decode{i}"])[f"decode/decode{i}"]
    for flag, value in (("--port", "0"), ("--metrics-port", "0"), ("--tls-cert", f.cert), ("--tls-key", f.key)):
        args[args.index(flag) + 1] = value
    return launcher.start(f"decode{i}", args, {"PDSERVE_ENABLE_FAULTS": "1"}, log_path=f"{stack.log_dir}/decode{i}.log")


@pytest.fixture(scope="module")
def discovering(wide, model_dir):
    """The same instances behind a gateway that discovers them (it replaces the static one)."""
    s = wide
    launcher.stop(s.procs["gateway"][0])  # replaced by one that discovers its backends
    s.decode_file = os.path.join(s.log_dir, "decodes.txt")
    prefill_file = os.path.join(s.log_dir, "prefills.txt")
    _write(s.decode_file, [p.target for p in s.procs["decode"]])
    _write(prefill_file, [s.procs["prefill"][0].target])
    f = make_pki(s.tls_dir, ["gateway/discovering"])["gateway/discovering"]
    # prefill1 through a real name lookup: dialled by address, its certificate must name pdserve-prefill
    s.procs["gateway"][0] = launcher.start("gateway", [
        "gateway", "--port", "0", "--metrics-port", "0", "--http-port", "-1", "--model", model_dir,
        "--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca,
        "--prefill-discovery", f"file:{prefill_file}",
        "--prefill-discovery", f"dns:localhost:{s.procs['prefill'][1].port}",
        "--decode-discovery", f"file:{s.decode_file}",
        "--discovery-interval", "0.2", "--load-interval", "0.2"],
        {"PDSERVE_ENABLE_FAULTS": "1"}, log_path=f"{s.log_dir}/gateway.log")
    s.gateway = gateway_pb2_grpc.GatewayStub(s._ch(s.procs["gateway"][0].target, tls=None))
    return s


def test_decode_added_under_traffic_takes_work_and_a_removed_one_stops(discovering, oracle):
    s = discovering
    base = _decodes_served(s) + [0.0]  # what the static gateway sent; decode2 does not run yet
    prefill_base = [s.metric("prefill", "pdserve_rpc_seconds_count", {"method": "Prefill"}, index=i) for i in range(2)]
    gw_pid = s.procs["gateway"][0].popen.pid
    results, errors = [], []
    stop = threading.Event()
    seq = iter(range(10_000))

    def one() -> None:
        n = next(seq)
        p = prompt(24 + (5 * n) % 90, 900 + n)
        out = generate(s.gateway, build_request(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True))
        (errors if "error" in out else results).append((p, out))

    def traffic() -> None:
        while not stop.wait(0.2):
            one()

    # a burst first: every instance gets a share, the load-aware choice spreads it
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: one(), range(12)))
    assert not errors, errors
    before = [n - b for n, b in zip(_decodes_served(s), base)]
    prefills = [s.metric("prefill", "pdserve_rpc_seconds_count", {"method": "Prefill"}, index=i) - b
                for i, b in enumerate(prefill_base)]
    assert all(n >= 1 for n in before) and all(n >= 1 for n in prefills), (before, prefills)

    s.procs["decode"].append(_start_decode(s, 2))  # loaded first: the traffic is for its joining, not its start
    workers = [threading.Thread(target=traffic) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        _write(s.decode_file, [p.target for p in s.procs["decode"]])
        _wait("decode2 to serve a request", lambda: _decodes_served(s)[2] >= 2, s)
        assert s.procs["gateway"][0].popen.pid == gw_pid and s.procs["gateway"][0].alive()

        # decode0 leaves the file while streams run: once the gateway has seen it, it gets nothing new
        _write(s.decode_file, [p.target for p in s.procs["decode"][1:]])
        _wait("the gateway to retire decode0", lambda: s.metric(
            "gateway", "pdserve_gateway_backends", {"role": "decode", "state": "retiring"}) == 1, s)
        # new work is a Run stream (counted when it ends); one picked just before the retirement has ended a second
        # later
        time.sleep(1.0)
        gone = _decodes_served(s)[0]
        rest = sum(_decodes_served(s)[1:])
        _wait("six more requests on the others", lambda: sum(_decodes_served(s)[1:]) >= rest + 6, s)
        assert _decodes_served(s)[0] == gone, "decode0 took new work after it left discovery"
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors, errors[:3]
    oracle.check_many([(p, out["token_ids"]) for p, out in results])
    served = [n - b for n, b in zip(_decodes_served(s), base)]
    assert all(n >= 1 for n in served) and sum(served) == len(results), (served, len(results))
    assert s.metric("gateway", "pdserve_gateway_backends", {"role": "decode", "state": "ready"}) == 2
    assert s.metric("gateway", "pdserve_gateway_backends", {"role": "prefill", "state": "ready"}) == 2
    assert s.metric("gateway", "pdserve_gateway_backends", {"role": "prefill", "state": "refused"}) == 0
    states = wait_no_leases(s)
    assert len(states) == 3 and all(st.num_leased == 0 for st in states), states
    print(f"scale-out: {len(results)} requests, decode shares {served}")
