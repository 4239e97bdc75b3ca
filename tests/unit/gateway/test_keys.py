"""The API keys file (issue 20): `TENANT: KEY` lines, each key one tenant's; every refusal names the line and never
the key; a request's tenant is its key's, over gRPC and HTTP, and a wrong key is refused by both."""
import asyncio
import types

import grpc
import httpx
import pytest

from pdserve.common.errors import PdError
from pdserve.gateway.api_key import ApiKeyInterceptor
from pdserve.gateway.keys import ApiKeys, KeysFileError, parse_keys
from pdserve.gateway.openai.app import Envelope

GOOD = """# tenants of the test
acme: sk-acme-0001
acme : sk-acme-0002
globex:sk-globex-01:with-colon

"""


def test_a_file_maps_each_key_to_its_tenant(tmp_path):
    path = tmp_path / "keys"
    path.write_text(GOOD)
    keys = ApiKeys.from_file(str(path))
    assert keys.tenants == ["acme", "globex"]
    assert keys.tenant_of("Bearer sk-acme-0001") == "acme" and keys.tenant_of(b"Bearer sk-acme-0002") == "acme"
    assert keys.tenant_of("Bearer sk-globex-01:with-colon") == "globex"
    for wrong in ("Bearer sk-acme-0003", "Bearer sk-acme-000", "sk-acme-0001", "Bearer  sk-acme-0001", "", None):
        assert keys.tenant_of(wrong) is None, wrong


@pytest.mark.parametrize("text, message", [
    ("acme: sk-acme-0001\nglobex: sk-acme-0001\n", "keys:2: the key of tenant 'globex' is the key of line 1 "
                                                  "(tenant 'acme') again"),
    ("acme: sk-acme-0001\n\nacme: sk-acme-0001\n", "keys:3: the key of tenant 'acme' is the key of line 1"),
    ("acme sk-acme-0001\n", "keys:1: expected `TENANT: KEY`, found no ':'"),
    ("# c\n: sk-acme-0001\n", "keys:2: empty tenant"),
    ("acme:\n", "keys:1: empty key for tenant 'acme'"),
    ("acme:   \n", "keys:1: empty key for tenant 'acme'"),
    ("ac me: sk-acme-0001\n", "keys:1: tenant 'ac me' must be 1-64 characters"),
    ("acme: short\n", "keys:1: the key of tenant 'acme' must be 8-512 printable ASCII characters without spaces; "
                      "it has 5 characters"),
    ("acme: sk-acme 0001\n", "keys:1: the key of tenant 'acme' must be 8-512"),
    ("# only a comment\n\n", "keys: no keys"),
])
def test_a_bad_file_is_refused_with_its_line_and_without_the_key(text, message):
    with pytest.raises(KeysFileError) as e:
        parse_keys(text, "keys")
    assert message in str(e.value)
    assert "sk-acme" not in str(e.value)  # the key (or a near miss of one) never reaches a log


def test_an_unreadable_or_non_utf8_file_is_refused(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read the API keys file"):
        ApiKeys.from_file(str(tmp_path / "missing"))
    bad = tmp_path / "bin"
    bad.write_bytes(b"acme: sk-\xff\xfe-0001\n")
    with pytest.raises(KeysFileError, match=r"not UTF-8 \(byte 9\)"):
        ApiKeys.from_file(str(bad))


def test_the_gateway_refuses_to_start_on_a_bad_file_or_with_both_key_flags(tmp_path):
    from pdserve.gateway.openai.server import api_keys
    path = tmp_path / "keys"
    path.write_text("acme: sk-acme-0001\nbeta: sk-acme-0001\n")
    args = types.SimpleNamespace(api_keys_file=str(path), api_key=None)
    with pytest.raises(SystemExit, match="--api-keys-file .*keys:2: the key of tenant 'beta'"):
        api_keys(args)
    path.write_text(GOOD)
    assert api_keys(args).tenant_of("Bearer sk-acme-0001") == "acme"
    with pytest.raises(SystemExit, match="--api-key and --api-keys-file both given"):
        api_keys(types.SimpleNamespace(api_keys_file=str(path), api_key="sk-x-123456"))
    one = api_keys(types.SimpleNamespace(api_keys_file=None, api_key="sk-x-123456"))
    assert one.tenant_of("Bearer sk-x-123456") == "default"


KEYS = ApiKeys({"sk-acme-0001": "acme", "sk-globex-01": "globex"})


def _details(metadata):
    return types.SimpleNamespace(method="/pdserve.v1.Gateway/Generate", invocation_metadata=metadata)


class Ctx:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return None


def test_grpc_lets_each_key_in_with_its_tenant_and_refuses_a_wrong_one():
    from pdserve.gateway.servicer import GatewayServicer
    from pdserve.gateway.router import Router
    handler = grpc.unary_stream_rpc_method_handler(lambda r, c: None)
    icpt = ApiKeyInterceptor(KEYS)

    async def passes(metadata):
        async def cont(details):
            return handler
        return await icpt.intercept_service(cont, _details(metadata)) is handler

    seen = []

    class Probe(GatewayServicer):
        async def generate(self, request, deadline=None, tenant=None):
            seen.append(tenant)
            yield None

    svc = Probe(Router("prefill"), Router("decode"), None, None, keys=KEYS)

    async def tenant(metadata):
        async for _ in svc.Generate(None, Ctx(metadata)):
            pass

    async def main():
        assert await passes((("authorization", "Bearer sk-acme-0001"),))
        assert await passes((("authorization", "Bearer sk-globex-01"),))
        assert not await passes((("authorization", "Bearer sk-acme-0002"),))
        await tenant((("authorization", "Bearer sk-acme-0001"),))
        await tenant((("authorization", "Bearer sk-globex-01"),))
        with pytest.raises(PdError) as e:  # past a missing interceptor, the servicer still refuses
            await tenant((("authorization", "Bearer sk-acme-0002"),))
        assert (e.value.code, e.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "API_KEY")
    asyncio.run(main())
    assert seen == ["acme", "globex"]


def test_the_servicer_refuses_a_caller_whose_key_was_never_looked_up():
    from pdserve.gateway.router import Router
    from pdserve.gateway.servicer import GatewayServicer
    keyed = GatewayServicer(Router("prefill"), Router("decode"), None, None, keys=KEYS)
    with pytest.raises(PdError) as e:
        keyed.tenant_or_refuse(None)
    assert e.value.reason == "API_KEY"
    assert keyed.tenant_or_refuse("acme") == "acme"
    assert GatewayServicer(Router("prefill"), Router("decode"), None, None).tenant_or_refuse(None) == ""


async def _http(keys, headers):
    seen = {}

    async def app(scope, receive, send):
        seen["tenant"] = scope["state"]["tenant"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=Envelope(app, keys)), base_url="http://t") as c:
        r = await c.get("/v1/models", headers=headers)
    return r.status_code, r.json() if r.status_code != 200 else r.text, seen.get("tenant")


@pytest.mark.parametrize("headers, status, tenant", [
    ([("authorization", "Bearer sk-acme-0001")], 200, "acme"),
    ([("authorization", "Bearer sk-globex-01")], 200, "globex"),
    ([("authorization", "Bearer sk-globex-02")], 401, None),
    ([], 401, None),
    ([("authorization", "Bearer sk-acme-0001"), ("authorization", "Bearer sk-acme-0001")], 401, None),
])
def test_http_gives_the_route_the_key_s_tenant_and_refuses_a_wrong_key(headers, status, tenant):
    got_status, body, got_tenant = asyncio.run(_http(KEYS, headers))
    assert (got_status, got_tenant) == (status, tenant)
    if status == 401:
        assert body["error"]["code"] == "invalid_api_key"


def test_http_without_keys_is_the_one_tenant():
    assert asyncio.run(_http(None, [])) == (200, "ok", "")
