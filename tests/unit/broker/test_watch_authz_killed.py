"""The revocation stream behind the real authorisation interceptor (issue 18, point 8: a mutation pass over
authz.py found that no test failed when streaming handlers ran without the caller check)."""
import asyncio

import grpc
import pytest

from pdserve.broker.lease_table import LeaseTable
from pdserve.common.errors import from_rpc_error
from pdserve.common.pki import make_pki
from pdserve.common.proto import broker_pb2 as pb, common_pb2
from pdserve.common.tls import TlsConfig

from .test_servicer import IDS, OWNER, POOL, REGION, auth_denials, serving_tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    files = make_pki(str(tmp_path_factory.mktemp("pki")), IDS)
    return {i: TlsConfig(f.cert, f.key, f.ca) for i, f in files.items()}


def test_only_a_pools_own_decode_may_watch_its_revocations_and_write_done_notices(pki):
    """A pool's stream carries every write-done notice of its requests, each with the request's first token and
    prompt digest, and every revocation: another decode or a prefill watching it would read other tenants' output
    and learn which owners to aim at."""
    async def main():
        async with serving_tls(pki, LeaseTable(epoch=5)) as stubs:
            d0, p0 = stubs["decode/d0"], stubs["prefill/p0"]
            await d0.RegisterPool(pb.RegisterPoolRequest(pool_id=POOL, num_pages=4, region=REGION))
            leases = (await d0.Grant(pb.GrantRequest(pool_id=POOL, owner=OWNER, num_pages=1, epoch=5))).leases
            write = dict(pool_id=POOL, owner=OWNER, epoch=5, leases=leases, writer_id="prefill/p0/w")
            await p0.BeginWrite(pb.BeginWriteRequest(**write, max_landing_ms=1000))
            await p0.EndWrite(pb.EndWriteRequest(**write, success=True, first_token=321, prompt_digest=b"d" * 16,
                                                 coverage=common_pb2.Coverage(num_tokens=8, num_pages=1,
                                                                              checksums=[7])))
            own = d0.WatchRevocations(pb.WatchRevocationsRequest(pool_id=POOL))
            notice = await asyncio.wait_for(own.read(), 5)
            own.cancel()
            denied = auth_denials("WatchRevocations")
            refusals, leaked = [], []
            for who in ("decode/d1", "prefill/p0"):
                call = stubs[who].WatchRevocations(pb.WatchRevocationsRequest(pool_id=POOL))
                try:
                    leaked.append(await asyncio.wait_for(call.read(), 5))
                except grpc.aio.AioRpcError as e:
                    refusals.append(from_rpc_error(e))
                call.cancel()
            return notice, refusals, leaked, auth_denials("WatchRevocations") - denied
    notice, refusals, leaked, denials = asyncio.run(main())
    assert notice.write_done and notice.first_token == 321  # what the pool's own decode reads on
    assert leaked == [], f"another caller read the pool's stream: {leaked}"
    assert [(e.code, e.reason) for e in refusals] == [(grpc.StatusCode.PERMISSION_DENIED, "NOT_OWN_RESOURCE"),
                                                      (grpc.StatusCode.PERMISSION_DENIED, "ROLE_NOT_ALLOWED")]
    assert "pool_id" in refusals[0].message and repr(POOL) in refusals[0].message
    assert denials == 1  # the NOT_OWN_RESOURCE one (the role refusal has its own series)

