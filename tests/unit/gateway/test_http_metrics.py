"""The OpenAI front's answers counted (issue 21): pdserve_http_requests_total{route, status} moves by one per request
on its route template and status, the Envelope's own refusals included; a made-up path is route `other` and never a
series of its own; /health answers 503 naming the role while a role has no backend. In-process, over stub backends
(test_resubmit.py's), through httpx's ASGI transport."""
import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY

from pdserve.common.metrics import HTTP_ROUTES, HTTP_STATUSES, init_metrics
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.keys import ApiKeys
from pdserve.gateway.openai.app import Front, create_app
from pdserve.gateway.openai.http_metrics import CountRequests, RouteLabels
from pdserve.gateway.openai.server import Limits
from pdserve.gateway.router import DRAINING, Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer
from tests.unit.gateway.test_resubmit import Decode, Prefill

KEYS = ApiKeys({"sk-acme-0001": "acme"})
NAME = "pdserve_http_requests_total"


def counts() -> dict[tuple[str, str], float]:
    """Every series of the counter, by (route, status)."""
    return {(s.labels["route"], s.labels["status"]): s.value for m in REGISTRY.collect() if m.name == "pdserve_http_requests"
            for s in m.samples if s.name == NAME}


def moved(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _gateway(decodes: int = 1, keys=None, tokens: int = 8):
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    decode = [Backend(f"dc{i}", Decode([([65 + j for j in range(2)], None, None)] * tokens), info)
              for i in range(decodes)]
    return GatewayServicer(Router("prefill", [Backend("pf", Prefill(), info)]), Router("decode", decode),
                           ByteTokenizer(512), Capacity("m", 4096, 512, 16, 100, 4096), keys=keys)


def exchange(gw, requests: list[tuple[str, str, dict | None]], key: str | None = None) -> list[httpx.Response]:
    app = create_app(Front(gw, ["m"], Limits()), KEYS if key is not None else None)

    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.request(method, path, json=body, headers=headers) for method, path, body in requests]
    return asyncio.run(main())


def test_each_answer_moves_its_route_and_status_by_one():
    before = counts()
    out = exchange(_gateway(), [
        ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}),
        ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}),
        ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "bogus": 1}),
        ("POST", "/v1/chat/completions", {"model": "another", "messages": [{"role": "user", "content": "hi"}]}),
        ("GET", "/v1/completions", None),
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
    ])
    assert [r.status_code for r in out] == [200, 200, 400, 404, 405, 200, 200], [r.text for r in out]
    assert moved(before, counts()) == {("/v1/completions", "200"): 2, ("/v1/completions", "400"): 1,
                                       ("/v1/chat/completions", "404"): 1, ("/v1/completions", "405"): 1,
                                       ("/v1/models", "200"): 1, ("/health", "200"): 1}


def test_the_envelope_s_own_refusals_are_counted_on_the_route_they_were_for():
    before = counts()
    out = exchange(_gateway(keys=KEYS), [
        ("POST", "/v1/completions", {"prompt": [5], "max_tokens": 1}),  # no key
        ("GET", "/v1/models", None),
        ("GET", "/health", None),  # open without a key
    ], key="")
    assert [r.status_code for r in out] == [401, 401, 200]
    assert moved(before, counts()) == {("/v1/completions", "401"): 1, ("/v1/models", "401"): 1, ("/health", "200"): 1}
    before = counts()
    assert exchange(_gateway(keys=KEYS), [("GET", "/v1/models", None)], key="sk-acme-0001")[0].status_code == 200
    assert moved(before, counts()) == {("/v1/models", "200"): 1}


def test_made_up_paths_are_one_series_whatever_the_client_sends():
    before = counts()
    paths = [f"/v1/{i}/x%20y?q={i}" for i in range(40)] + ["/", "/v1", "/v1/completions/", "/HEALTH"]
    out = exchange(_gateway(), [("GET", p, None) for p in paths])
    assert [r.status_code for r in out] == [404] * (len(paths) - 2) + [307, 404]  # Starlette: the slash is dropped
    assert moved(before, counts()) == {("other", "404"): len(paths) - 1, ("other", "307"): 1}
    assert {route for route, _ in counts()} == set(HTTP_ROUTES)


def test_every_route_and_common_status_exists_from_start_up():
    """The gateway's init_metrics, before any backend (and so before the HTTP server) is up."""
    init_metrics("gateway")
    want = {(r, s) for r in HTTP_ROUTES for s in HTTP_STATUSES}
    assert want <= set(counts())


def test_the_route_labels_are_the_app_s_own_routes():
    """HTTP_ROUTES (made at start-up, before the app exists) names exactly the routes the app serves, and `other`."""
    app = create_app(Front(_gateway(), ["m"], Limits()), None)
    assert set(app.routes.templates) | {"other"} == set(HTTP_ROUTES)


def test_a_templated_route_is_counted_by_its_template():
    app = FastAPI()

    @app.get("/v1/models/{model}")
    async def one(model: str):
        return {"id": model}
    routes = RouteLabels(app.routes)
    assert routes.of("/v1/models/abc") == routes.of("/v1/models/x-y") == "/v1/models/{model}"
    assert routes.of("/v1/models/a/b") == "other"
    before = counts()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=CountRequests(app, routes)),
                                     base_url="http://t") as c:
            return [(await c.get(f"/v1/models/m{i}")).status_code for i in range(3)]
    assert asyncio.run(main()) == [200] * 3
    assert moved(before, counts()) == {("/v1/models/{model}", "200"): 3}


@pytest.mark.parametrize("exc, status", [(asyncio.CancelledError(), "499"), (RuntimeError("bug"), "500")])
def test_an_answer_that_never_began_counts_as_the_client_leaving_or_a_failure(exc, status):
    async def app(scope, receive, send):
        raise exc

    async def sink(msg):
        pass
    counted = CountRequests(app, RouteLabels([]))
    before = counts()
    with pytest.raises(type(exc)):
        asyncio.run(counted({"type": "http", "path": "/v1/completions"}, None, sink))
    assert moved(before, counts()) == {("other", status): 1}


def test_health_is_503_naming_the_role_while_it_has_no_backend_and_200_again_after():
    gw = _gateway()
    assert exchange(gw, [("GET", "/health", None)])[0].json() == {"status": "ok"}
    decode = gw.decodes.all[0]
    for state, word in ((DRAINING, "draining"), ("unreachable", "unreachable")):
        decode.state = state
        r = exchange(gw, [("GET", "/health", None)])[0]
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        err = r.json()["error"]
        assert err["code"] == "no_backend"
        assert f"no decode instance takes work: 1 known, 1 {word}" in err["message"]
    gw.decodes.all.clear()
    r = exchange(gw, [("GET", "/health", None)])[0]
    assert r.status_code == 503 and "no decode instance takes work: 0 known" in r.json()["error"]["message"]
    gw.prefills.all[0].state = DRAINING
    assert "no prefill instance" in exchange(gw, [("GET", "/health", None)])[0].json()["error"]["message"]
    gw.prefills.all[0].state = "ready"
    gw.decodes.all.append(decode)
    decode.state = "ready"
    assert exchange(gw, [("GET", "/health", None)])[0].status_code == 200


def test_health_is_503_while_the_gateway_drains():
    gw = _gateway()
    gw.draining = True
    r = exchange(gw, [("GET", "/health", None)])[0]
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
