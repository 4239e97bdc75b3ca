"""Which pdserve errors the official openai client retries, decided by the client's own `_should_retry` on the
response the gateway sends: only the transient ones (overload, unavailable, draining)."""
import grpc
import httpx2
import openai
import pytest

from pdserve.common.errors import PdError
from pdserve.gateway.openai.errors import ApiError

TRANSIENT = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
             grpc.StatusCode.DEADLINE_EXCEEDED: 504}
FINAL = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.DATA_LOSS: 500,
         grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500}


def should_retry(e: ApiError) -> bool:
    r = e.response()
    response = httpx2.Response(r.status_code, headers=dict(r.headers), content=r.body)
    return openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1")._should_retry(response)


@pytest.mark.parametrize("code, status, retried", [(c, s, True) for c, s in TRANSIENT.items()] +
                         [(c, s, False) for c, s in FINAL.items()])
def test_the_client_retries_only_transient_errors(code, status, retried):
    e = ApiError.from_pd(PdError(code, "SOME_REASON", "what happened, with 3 numbers"))
    assert e.status == status and should_retry(e) is retried
    body = e.body()["error"]
    assert body["code"] == "some_reason" and "3 numbers" in body["message"] and body["param"] is None
    assert body["type"] == ("server_error" if status >= 500 else "rate_limit_error" if status == 429
                            else "invalid_request_error")
    if status in (429, 503):
        assert float(e.response().headers["retry-after"]) > 0


def test_a_full_admission_queue_is_a_429():
    e = ApiError.from_pd(PdError(grpc.StatusCode.INVALID_ARGUMENT, "OVERLOADED", "256 requests wait (limit 256)"))
    assert e.status == 429 and should_retry(e) and e.body()["error"]["code"] == "overloaded"


def test_size_and_time_refusals_close_the_connection():
    assert ApiError(413, "body_too_large", "too big").response().headers["connection"] == "close"
    assert "connection" not in ApiError(400, "invalid_value", "bad").response().headers
