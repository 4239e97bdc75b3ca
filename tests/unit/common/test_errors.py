"""Retry info round trip: a PdError's retry delay travels as google.rpc.RetryInfo through a real gRPC server (the
services' ErrorInterceptor) back into a PdError, and out over HTTP as Retry-After that the official client obeys."""
import asyncio

import grpc
import httpx2
import openai
import pytest

from pdserve.common.errors import PdError, from_rpc_error
from pdserve.common.server import ErrorInterceptor
from pdserve.gateway.openai.errors import ApiError

METHOD = "/pdserve.test.Echo/Fail"


async def _round_trip(err: PdError) -> PdError:
    async def fail(request, context):
        raise err

    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pdserve.test.Echo", {
        "Fail": grpc.unary_unary_rpc_method_handler(fail)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(METHOD)(b"", timeout=10)
        return from_rpc_error(e.value)
    finally:
        await server.stop(None)


@pytest.mark.parametrize("delay", [2.25, 0.0004, 0.0, 61.5, None])
def test_retry_delay_survives_a_real_grpc_call(delay):
    sent = PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "PREFILL_QUEUE_FULL", "64 prompts wait (limit 64)", delay)
    got = asyncio.run(_round_trip(sent))
    assert (got.code, got.reason, got.message) == (sent.code, sent.reason, sent.message)
    assert got.retry_after_s == (None if delay is None else pytest.approx(delay, abs=1e-9))
    assert got.prefixed("prefill p0").retry_after_s == got.retry_after_s  # kept when the gateway re-raises it


def test_a_retry_delay_must_be_a_finite_non_negative_number():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="retry_after_s"):
            PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", "x", bad)


def _client_wait(e: ApiError) -> float:
    """How long the official client waits before its first retry of this response."""
    r = e.response()
    response = httpx2.Response(r.status_code, headers=dict(r.headers), content=r.body)
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1")
    assert client._should_retry(response)
    return client._calculate_retry_timeout(client.max_retries, openai._models.FinalRequestOptions(
        method="post", url="/x"), response.headers)


@pytest.mark.parametrize("code, reason, delay, header", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", 2.25, "3"),    # rounded up
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "PREFILL_QUEUE_FULL", 0.2, "1"),  # at least a second
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_TIMEOUT", 7.0, "7"),
    (grpc.StatusCode.UNAVAILABLE, "DRAINING", None, "1"),  # no estimate: one second
])
def test_http_retry_after_is_the_estimate_in_whole_seconds(code, reason, delay, header):
    e = ApiError.from_pd(PdError(code, reason, "busy", delay))
    assert e.status in (429, 503) and e.headers["Retry-After"] == header
    assert _client_wait(e) == float(header)


def test_a_final_error_carries_no_retry_after_even_with_a_delay():
    e = ApiError.from_pd(PdError(grpc.StatusCode.INVALID_ARGUMENT, "CONTEXT_EXCEEDED", "too long", 3.0))
    assert e.status == 400 and "Retry-After" not in e.headers
