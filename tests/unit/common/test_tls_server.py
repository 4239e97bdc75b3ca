"""The broker servicer behind a real mutual-TLS port with the authorisation interceptor, in one process."""
import asyncio
import contextlib

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from pdserve.broker.lease_table import LeaseTable
from pdserve.broker.servicer import BrokerServicer
from pdserve.common.authz import AuthInterceptor
from pdserve.common.errors import from_rpc_error
from pdserve.common.pki import make_pki
from pdserve.common.proto import broker_pb2 as pb, broker_pb2_grpc
from pdserve.common.server import ErrorInterceptor
from pdserve.common.tls import TlsConfig, secure_channel

IDS = ["broker/b0", "decode/d0", "decode/d1", "prefill/p0", "operator/o"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    files = make_pki(str(tmp_path_factory.mktemp("pki")), IDS)
    return {i: TlsConfig(f.cert, f.key, f.ca) for i, f in files.items()}


class Spy(BrokerServicer):
    """Counts handler entries: a refused call must not reach the servicer at all."""
    calls = 0

    async def Grant(self, request, context):
        Spy.calls += 1
        return await super().Grant(request, context)


@contextlib.asynccontextmanager
async def broker(pki):
    server = grpc.aio.server(interceptors=[AuthInterceptor("broker-test", ["pdserve.v1.Broker"]),
                                           ErrorInterceptor()])
    broker_pb2_grpc.add_BrokerServicer_to_server(Spy(LeaseTable(), registry=CollectorRegistry()), server)
    port = server.add_secure_port("127.0.0.1:0", pki["broker/b0"].server_credentials())
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def denials(method: str, reason: str) -> float:
    return REGISTRY.get_sample_value("pdserve_auth_denials_total",
                                     {"service": "broker-test", "method": method, "reason": reason})


def test_roles_and_pools_over_a_real_tls_port(pki):
    asyncio.run(_roles_and_pools(pki))


async def _roles_and_pools(pki):
    async with broker(pki) as target:
        async with secure_channel(target, pki["decode/d0"]) as ch:
            d0 = broker_pb2_grpc.BrokerStub(ch)
            region = pb.PoolRegion(transfer_session="127.0.0.1:9", data_base=0x1000, tag_base=0x2000)
            epoch = (await d0.RegisterPool(pb.RegisterPoolRequest(pool_id="decode/d0/a", num_pages=4,
                                                                  region=region))).epoch
            before = Spy.calls
            granted = await d0.Grant(pb.GrantRequest(pool_id="decode/d0/a", owner=b"r" * 16, num_pages=2, epoch=epoch))
            assert [lease.page for lease in granted.leases] and Spy.calls == before + 1
        assert denials("Grant", "NOT_OWN_RESOURCE") == 0 and denials("Grant", "ROLE_NOT_ALLOWED") == 0
        async with secure_channel(target, pki["decode/d1"]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await broker_pb2_grpc.BrokerStub(ch).Grant(pb.GrantRequest(pool_id="decode/d0/a", owner=b"s" * 16,
                                                                           num_pages=1, epoch=epoch))
        err = from_rpc_error(e.value)
        assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_OWN_RESOURCE"), err
        assert "decode/d1" in err.message and "decode/d0/a" in err.message
        assert Spy.calls == before + 1 and denials("Grant", "NOT_OWN_RESOURCE") == 1
        async with secure_channel(target, pki["prefill/p0"]) as ch:
            for call in (broker_pb2_grpc.BrokerStub(ch).Grant(pb.GrantRequest(pool_id="decode/d0/a", num_pages=1)),
                         broker_pb2_grpc.BrokerStub(ch).Revoke(pb.RevokeRequest(pool_id="decode/d0/a"))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert from_rpc_error(e.value).reason == "ROLE_NOT_ALLOWED"
        assert Spy.calls == before + 1
        assert denials("Grant", "ROLE_NOT_ALLOWED") == 1 and denials("Revoke", "ROLE_NOT_ALLOWED") == 1
        async with secure_channel(target, pki["operator/o"]) as ch:
            state = await broker_pb2_grpc.BrokerStub(ch).GetPoolState(pb.GetPoolStateRequest(pool_id="decode/d0/a"))
        assert (state.num_leased, state.num_free) == (2, 2)  # the refused grants took nothing


def test_a_client_without_a_certificate_fails_the_handshake(pki):
    asyncio.run(_no_certificate(pki))


async def _no_certificate(pki):
    async with broker(pki) as target:
        creds = grpc.ssl_channel_credentials(root_certificates=pki["operator/o"].ca)  # trusts the CA, shows no cert
        before = Spy.calls
        async with grpc.aio.secure_channel(target, creds) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await broker_pb2_grpc.BrokerStub(ch).Grant(pb.GrantRequest(pool_id="decode/d0/a", num_pages=1),
                                                           timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await broker_pb2_grpc.BrokerStub(ch).Grant(pb.GrantRequest(pool_id="decode/d0/a", num_pages=1),
                                                           timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert Spy.calls == before
