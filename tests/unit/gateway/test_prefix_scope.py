"""The prefix scope the gateway puts a request in (issue 20), read off the RunRequest and PrefillRequest it actually
sends: scope_key(tenant, cache_salt, --prefix-cache-scope), with the prompt's ids for decode to compute the chain
from; `global` shared across tenants, cache_salt separating in both; `--prefix-cache off` sends today's messages
exactly; a resubmission after a preemption keeps the scope. Stub backends, as test_resubmit.py."""
import asyncio
from types import SimpleNamespace

import grpc
import httpx
import pytest

from pdserve.common.errors import PdError
from pdserve.common.prefix import scope_key
from pdserve.common.proto import common_pb2, decode_pb2, gateway_pb2
from pdserve.common.wire import prompt_digest
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.keys import ApiKeys
from pdserve.gateway.openai.app import Front, create_app
from pdserve.gateway.openai.server import Limits
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.scope import Scoping
from pdserve.gateway.servicer import Capacity, GatewayServicer
from tests.unit.gateway.test_resubmit import Decode, Prefill

PROMPT = list(range(40, 80))  # 40 tokens: 2 full pages of 16 before the last token's page


def _gateway(scoping=Scoping(), script=None, keys=None, backends=1):
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    decodes = [Decode(script or [([65, 66], None, None)] * 8) for _ in range(backends)]
    prefills = [Prefill() for _ in range(backends)]
    gw = GatewayServicer(Router("prefill", [Backend(f"pf{i}", p, info) for i, p in enumerate(prefills)]),
                         Router("decode", [Backend(f"dc{i}", d, info) for i, d in enumerate(decodes)]),
                         ByteTokenizer(512), Capacity("m", 4096, 512, 16, 100, 4096), keys=keys, scoping=scoping)
    return gw, decodes, prefills


def _run(gw, tenant, salt="", **kw):
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=2, ignore_eos=True, cache_salt=salt, **kw)

    async def main():
        return [m async for m in gw.generate(req, None, tenant)]
    return asyncio.run(main())


def _sent(scoping, tenant, salt=""):
    gw, (decode,), (prefill,) = _gateway(scoping)
    got = _run(gw, tenant, salt)
    assert [t for m in got for t in m.token_ids] == [65, 66]
    (run,), (pre,) = decode.requests, prefill.requests
    assert run.prefix_scope == pre.prefix_scope
    return run, pre


def test_the_scope_is_the_tenant_s_and_the_salt_s_and_decode_gets_the_ids_to_chain():
    run, pre = _sent(Scoping(), "acme", "s1")
    assert run.prefix_scope == scope_key("acme", "s1", "tenant") and len(run.prefix_scope) == 16
    assert list(run.prompt_token_ids) == PROMPT and run.prompt_digest == prompt_digest(PROMPT)
    assert list(pre.token_ids) == PROMPT
    # without keys every caller is of the tenant '': one shared scope
    assert _sent(Scoping(), "")[0].prefix_scope == scope_key("", "", "tenant")


def test_tenants_never_share_a_scope_unless_global_and_salts_always_separate():
    tenant = {(t, s): _sent(Scoping(True, "tenant"), t, s)[0].prefix_scope
              for t in ("acme", "globex") for s in ("", "s1")}
    glob = {(t, s): _sent(Scoping(True, "global"), t, s)[0].prefix_scope
            for t in ("acme", "globex") for s in ("", "s1")}
    assert len(set(tenant.values())) == 4  # every (tenant, salt) its own
    assert glob[("acme", "")] == glob[("globex", "")] and glob[("acme", "s1")] == glob[("globex", "s1")]
    assert glob[("acme", "")] != glob[("acme", "s1")]
    assert not set(glob.values()) & set(tenant.values())


def test_cache_off_sends_the_messages_of_before_prefix_reuse_exactly():
    run, pre = _sent(Scoping(enabled=False), "acme", "s1")
    want = decode_pb2.RunRequest(request_id=run.request_id, num_prompt_tokens=len(PROMPT), sampling=run.sampling,
                                 prompt_digest=prompt_digest(PROMPT))
    assert run == want and run.SerializeToString() == want.SerializeToString()
    assert pre.prefix_scope == b"" and not pre.HasField("prompt_logprobs") and list(pre.token_ids) == PROMPT
    # the repetition penalty still sends the ids, as before
    gw, (decode,), (prefill,) = _gateway(Scoping(enabled=False))
    _run(gw, "acme", repetition_penalty=1.3)
    assert list(decode.requests[0].prompt_token_ids) == PROMPT and decode.requests[0].prefix_scope == b""


@pytest.mark.parametrize("salt, n", [("x" * 257, 257), ("é" * 129, 258)])  # bytes, not characters
def test_a_cache_salt_over_256_bytes_is_refused_before_any_backend_is_asked(salt, n):
    for scoping in (Scoping(), Scoping(enabled=False)):
        gw, (decode,), (prefill,) = _gateway(scoping)
        with pytest.raises(PdError) as e:
            _run(gw, "acme", salt)
        assert (e.value.code, e.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_CACHE_SALT")
        assert e.value.message == f"cache_salt is {n} bytes; at most 256"
        assert decode.requests == [] and prefill.requests == []
    assert _sent(Scoping(), "acme", "é" * 128)[0].prefix_scope == scope_key("acme", "é" * 128)


def test_a_resubmission_after_a_preemption_keeps_the_scope():
    gw, (decode,), (prefill,) = _gateway(script=[([65, 66, 67], 3, None), ([68, 69], None, None)])
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=5, ignore_eos=True, cache_salt="s1")

    async def main():
        return [m async for m in gw.generate(req, None, "acme")]
    got = asyncio.run(main())
    assert [t for m in got for t in m.token_ids] == [65, 66, 67, 68, 69]
    want = scope_key("acme", "s1")
    assert [r.prefix_scope for r in decode.requests] == [want, want]
    assert [r.prefix_scope for r in prefill.requests] == [want, want]
    assert list(decode.requests[1].prompt_token_ids) == PROMPT + [65, 66, 67]


def test_the_same_prefix_goes_back_to_the_backends_that_hold_it_and_another_tenant_s_does_not_follow():
    gw, decodes, prefills = _gateway(backends=2)
    _run(gw, "acme")
    first = [i for i, d in enumerate(decodes) if d.requests]
    assert len(first) == 1
    for _ in range(3):  # by load alone these would alternate
        _run(gw, "acme")
    assert len(decodes[first[0]].requests) == 4 and len(prefills[first[0]].requests) == 4
    _run(gw, "globex")  # the same tokens, another scope: no affinity, the least loaded (the other one)
    assert len(decodes[1 - first[0]].requests) == 1


KEYS = ApiKeys({"sk-acme-0001": "acme", "sk-globex-01": "globex"})


async def _post(gw, path, body, key):
    front = Front(gw, ["m"], Limits())
    app = create_app(front, KEYS)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("key, tenant", [("sk-acme-0001", "acme"), ("sk-globex-01", "globex")])
def test_http_cache_salt_and_the_key_s_tenant_make_the_scope(key, tenant):
    gw, (decode,), (prefill,) = _gateway(keys=KEYS)
    r = asyncio.run(_post(gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "cache_salt": "s1",
                                                  "ignore_eos": True}, key))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [65, 66]
    assert decode.requests[0].prefix_scope == scope_key(tenant, "s1") == prefill.requests[0].prefix_scope


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": PROMPT}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("salt, message", [("x" * 257, "cache_salt is 257 bytes; at most 256"),
                                           ("", "cache_salt must be a non-empty string if given"),
                                           (7, "cache_salt: Input should be a valid string")])
def test_http_refuses_a_bad_cache_salt_on_both_routes_with_the_number(path, extra, salt, message):
    gw, (decode,), _ = _gateway(keys=KEYS)
    r = asyncio.run(_post(gw, path, {**extra, "max_tokens": 2, "cache_salt": salt}, "sk-acme-0001"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == "cache_salt"
    assert decode.requests == []


def test_http_refuses_a_wrong_key_before_any_backend_is_asked():
    gw, (decode,), _ = _gateway(keys=KEYS)
    r = asyncio.run(_post(gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, "sk-acme-0002"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert decode.requests == []
