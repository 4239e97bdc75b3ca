"""Broker replacement (issue 10): a second broker started while the first still runs cannot grant or accept a
write on the first one's pool; once decode moves to it (through a TCP proxy retargeted like a Service whose
endpoint changed), the first refuses the old pool, decode serves only after the fence the first announced, and
the first forgets the old pool (pages and metric series) after its quarantine."""
import socket
import time

import grpc

from pdserve import launcher
from pdserve.common.pki import make_pki
from pdserve.common.proto import broker_pb2, broker_pb2_grpc
from tests.integration.helpers import refusal, allocate, generate_when_served, prompt
from tests.integration.proxy import TcpProxy
from tests.integration.stack import Stack

LOCK_DELAY, READER_TTL, MAX_TTL = 5.5, 3.0, 5.0  # max ttl: decode renews its reader with a 5 s ttl
FENCE = READER_TTL + MAX_TTL + LOCK_DELAY
BROKER = ["--lock-delay", str(LOCK_DELAY), "--reader-ttl", str(READER_TTL), "--max-ttl", str(MAX_TTL),
          "--writer-ttl", "2.0", "--sweep-interval", "0.2", "--reconcile-grace", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_brokers_never_both_accept_writes_and_the_old_pool_is_forgotten(model_dir, oracle):
    port = free_port()
    proxy = TcpProxy(port)
    via = ["--broker", proxy.target]
    stack = Stack(model_dir, extra={"broker": ["--port", str(port), *BROKER],
                                    "prefill": ["--writer-ttl", "2.0", "--landing-slack", "0.3", *via],
                                    "decode": ["--max-blind", "2.0", "--rpc-timeout", "3", *via]})
    broker2 = None
    try:
        p = prompt(40, 21)
        out = generate_when_served(stack, p, 6)
        assert "error" not in out, (out, stack.logs()[-3000:])
        oracle.check(p, out["token_ids"])
        old_pool = stack.pool_ids()[0]
        ident = make_pki(stack.tls_dir, ["broker/broker1"])["broker/broker1"]
        broker2 = launcher.start("broker2", ["broker", "--port", "0", "--metrics-port", "0", "--tls-cert", ident.cert,
                                             "--tls-key", ident.key, "--tls-ca", ident.ca, *BROKER],
                                 log_path=f"{stack.log_dir}/broker2.log")
        # broker 2 runs beside broker 1: it grants nothing on broker 1's pool and accepts no write of its leases
        rid, dest = allocate(stack, 40, 6)
        on2 = {who: broker_pb2_grpc.BrokerStub(stack._ch(broker2.target, who))
               for who in ("prefill/prefill0", "decode/decode0")}
        on1 = {who: broker_pb2_grpc.BrokerStub(stack._ch(stack.procs["broker"][0].target, who))
               for who in ("prefill/prefill0", "decode/decode0")}
        begin = broker_pb2.BeginWriteRequest(pool_id=old_pool, owner=rid, epoch=dest.epoch, leases=dest.leases,
                                             writer_id=f"prefill/prefill0/{rid.hex()}", max_landing_ms=5000)
        grant = broker_pb2.GrantRequest(pool_id=old_pool, owner=b"g" * 16, num_pages=1, epoch=dest.epoch)
        assert refusal(lambda: on2["prefill/prefill0"].BeginWrite(begin, timeout=5))[1] == "EPOCH_MISMATCH"
        assert refusal(lambda: on2["decode/decode0"].Grant(grant, timeout=5))[1] == "EPOCH_MISMATCH"
        assert refusal(lambda: on2["prefill/prefill0"].Grant(grant, timeout=5))[0] == grpc.StatusCode.PERMISSION_DENIED
        # the pool moves: decode (and prefill) now reach broker 2
        moved = time.monotonic()
        proxy.retarget(broker2.port)
        time.sleep(READER_TTL + 0.6)  # broker 1 no longer hears decode: the old pool is fenced there
        assert refusal(lambda: on1["prefill/prefill0"].BeginWrite(begin, timeout=5)) == \
            (grpc.StatusCode.UNAVAILABLE, "POOL_FENCED")
        assert refusal(lambda: on1["decode/decode0"].Grant(grant, timeout=5)) == \
            (grpc.StatusCode.UNAVAILABLE, "POOL_FENCED")
        # decode serves again only from its new incarnation on broker 2, after the fence since its last contact
        q = prompt(50, 22)
        out = generate_when_served(stack, q, 6, timeout=FENCE + 15, refused_code="UNAVAILABLE")
        served = time.monotonic()
        assert "error" not in out, out
        oracle.check(q, out["token_ids"])
        assert served - moved >= FENCE - 1.0, served - moved  # last contact <= 0.5 s + one RPC before the move
        new_pool = stack.pool_ids()[0]
        assert new_pool != old_pool and new_pool.rsplit("-", 1)[0] == old_pool.rsplit("-", 1)[0]
        state2 = broker_pb2_grpc.BrokerStub(stack._ch(broker2.target)).GetPoolState(
            broker_pb2.GetPoolStateRequest(pool_id=new_pool), timeout=5)
        assert state2.num_pages > 0
        # broker 1 forgets the old pool after its quarantine: state and kv_pages series gone
        deadline = time.monotonic() + LOCK_DELAY + MAX_TTL + 10
        while True:
            try:
                stack.broker.GetPoolState(broker_pb2.GetPoolStateRequest(pool_id=old_pool), timeout=5)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
                break
            assert time.monotonic() < deadline, "broker 1 still holds the old pool"
            time.sleep(0.2)
        assert old_pool not in stack.metrics("broker")
        assert f'pool="{new_pool}"' in launcher_metrics(broker2)
    finally:
        if broker2 is not None:
            launcher.stop(broker2)
        stack.close()
        proxy.close()


def launcher_metrics(proc) -> str:
    import urllib.request
    return urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
