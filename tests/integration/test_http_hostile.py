"""Hostile HTTP against the gateway (issue 11, acceptance 2), over raw sockets: every bad request gets a 4xx
with an OpenAI error object, or its connection is closed (size and time limits); /health keeps answering and a
good request afterwards still gets the right tokens. Token ids written oddly and JSON nested 100,000 deep are 400s
that say what was wrong, and no request of this file is answered 500 (the gateway's own count, at the end)."""
import json
import socket

import pytest

from pdserve import launcher
from pdserve.gateway.openai.body import MAX_JSON_DEPTH
from tests.integration.drain_util import gateway_over
from tests.integration.helpers import prompt

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"


def exchange(port: int, data: bytes, timeout: float = 30) -> tuple[int | None, dict | None]:
    """Sends data, reads until the server closes; (status, JSON body), or (None, None) for a connection the
    server closed (or reset) without an answer."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = b""
    try:
        try:
            s.sendall(data)
        except OSError:
            pass  # closed while we sent (a size limit): whatever came back is read below
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    if not out:
        return None, None
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = b"".join(body.split(b"\r\n")[1::2])
    return status, json.loads(body)


def post(port: int, body: bytes, extra: bytes = b"",
         path: bytes = b"/v1/completions") -> tuple[int | None, dict | None]:
    head = HEAD.replace(b"/v1/completions", path, 1)
    return exchange(port, head + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def is_error(status, body, want: int, code: str | None = None, param: str | None = None) -> bool:
    err = (body or {}).get("error", {})
    return (status == want and set(err) == {"message", "type", "param", "code"} and bool(err["message"])
            and (code is None or err["code"] == code) and (param is None or err["param"] == param))


def health(port: int) -> int | None:
    return exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=10)[0]


def good_request_works(stack, port: int) -> None:
    p = prompt(15, 1300)
    status, out = post(port, json.dumps({"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode())
    assert status == 200, out
    want = stack.generate(prompt_token_ids=p, max_tokens=4, ignore_eos=True)["token_ids"]
    assert out["choices"][0]["token_ids"] == want


def answered_500(stack) -> float:
    return stack.metric("gateway", "pdserve_http_requests_total", {"status": "500"})


@pytest.fixture(scope="module")
def port(stack):
    return stack.procs["gateway"][0].http_port


@pytest.fixture(scope="module", autouse=True)
def first_500s(stack) -> float:
    """The gateway's count of 500 answers before this file's first request."""
    return answered_500(stack)


@pytest.mark.parametrize("body, code, param", [
    (b'{"prompt": "hi", "max_tokens": ', "invalid_json", None),
    (b'[{"prompt": "hi"}]', "invalid_json", None),
    (b'"hi"', "invalid_json", None),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', "invalid_json", None),
    (b'{"prompt": "hi", "max_tokens": 1e999}', "invalid_value", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "invalid_json", None),
    (b'{"prompt": "hi", "max_tokens": -3}', "invalid_value", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "5"}', "invalid_value", "max_tokens"),
    (b'{"prompt": [5, 600], "max_tokens": 3}', "token_out_of_vocab", None),
    (b'{"prompt": [5, 1099511627776], "max_tokens": 3}', "invalid_value", "prompt.1"),
    (b'{"prompt": [[5], [-1]], "max_tokens": 3}', "invalid_value", "prompt.1.0"),
    (b'{"prompt": "\xff\xfe hi", "max_tokens": 3}', "invalid_utf8", None),
    (b'{"prompt": "hi", "max_tokens": 3, "suffix": "!"}', "unsupported_field", "suffix"),
    (b'{"prompt": "hi", "max_tokens": 3, "logit_bias": {"5": 101}}', "invalid_value", "logit_bias.5"),
    (b'{"prompt": "hi", "max_tokens": 3, "logit_bias": {"x5": 1}}', "invalid_value", "logit_bias"),
    (b'{"prompt": "hi", "max_tokens": 3, "response_format": {"type": "json_schema"}}', "invalid_value",
     "response_format"),
    (b'{"prompt": ["a", "b", "c", "d", "e"], "n": 16, "max_tokens": 3}', "too_many_choices", "n"),
])
def test_malformed_bodies_get_400_with_an_error_object(port, body, code, param):
    status, out = post(port, body)
    assert is_error(status, out, 400, code, param), (status, out)


ODD_KEYS = ["\u00b2", "1" * 5000, "\u0663", "\u0661\u0662", "\uff11", "-1", " 1", "1 ", "+1", "1_0", "07", "",
            "512", str(2**31)]


@pytest.mark.parametrize("key", ODD_KEYS, ids=lambda k: ascii(k[:8]))
def test_a_logit_bias_key_that_is_no_token_id_gets_400_naming_it(stack, port, key):
    """ASCII digits only, within the vocabulary (512): what str.isdigit() or int() would take ("²", "٣", a 5,000-digit
    number, a sign, a space) is refused, and the message quotes the key, cut short."""
    for raw in (json.dumps({"prompt": "hi", "max_tokens": 3, "logit_bias": {key: 1}}).encode(),
                json.dumps({"prompt": "hi", "max_tokens": 3, "logit_bias": {key: 1}}, ensure_ascii=False).encode()):
        status, out = post(port, raw)
        assert is_error(status, out, 400, "invalid_value", "logit_bias"), (status, out)
        message = out["error"]["message"]
        assert message.startswith(f"logit_bias key {key[:20]!r}") and len(message) < 200, message
        reason = "outside the vocabulary [0, 512)" if key.isascii() and key.isdigit() and key[0] != "0" else \
            "is not a token id"
        assert reason in message, message


DEEP = 100_000
SCHEMA_AT = b'{"prompt": "hi", "max_tokens": 3, "response_format": {"type": "json_schema", "json_schema": ' \
            b'{"name": "x", "schema": %s}}}'


@pytest.mark.parametrize("body, depth", [
    (b"[" * DEEP + b"]" * DEEP, DEEP),
    (b'{"a":' * DEEP + b"1" + b"}" * DEEP, DEEP),
    (b"[" * DEEP, DEEP),  # never closed
    (SCHEMA_AT % (b'{"a":' * DEEP + b"1" + b"}" * DEEP), DEEP + 3),  # inside a field that takes any JSON
], ids=["arrays", "objects", "unclosed", "in_a_schema"])
def test_a_body_nested_100000_deep_gets_400_with_its_depth(stack, port, body, depth):
    status, out = post(port, body)
    assert is_error(status, out, 400, "json_too_deep"), (status, out)
    assert out["error"]["message"] == f"the body nests arrays and objects {depth} levels deep; the limit is " \
                                      f"{MAX_JSON_DEPTH}"
    good_request_works(stack, port)


def test_tool_call_arguments_nested_100000_deep_get_400(stack, port):
    """Earlier calls' arguments are JSON inside a JSON string, parsed for the chat template."""
    args = "[" * DEEP + "]" * DEEP
    body = json.dumps({"max_tokens": 3, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode()
    status, out = post(port, body, path=b"/v1/chat/completions")
    assert is_error(status, out, 400, "json_too_deep", "messages.1.tool_calls.0.function.arguments"), (status, out)
    assert f"{DEEP} levels deep" in out["error"]["message"]


def test_a_content_length_of_5000_digits_is_refused(stack, port):
    status, out = exchange(port, HEAD + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n{}")
    assert status is None or (status in (400, 413) and is_error(status, out, status)), (status, out)
    assert health(port) == 200


def test_oversized_and_chunked_bodies(stack, port):
    status, out = exchange(port, HEAD + b"Content-Length: 100000000000\r\n\r\n" + b'{"prompt": ')
    assert is_error(status, out, 413, "body_too_large"), (status, out)
    p = prompt(9, 1301)
    body = json.dumps({"prompt": p, "max_tokens": 3, "temperature": 0, "ignore_eos": True}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    status, out = exchange(port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n")
    assert status == 200, out  # a chunked body is read, not taken as empty
    want = stack.generate(prompt_token_ids=p, max_tokens=3, ignore_eos=True)["token_ids"]
    assert out["choices"][0]["token_ids"] == want
    big = b"x" * (1 << 20)
    status, out = exchange(port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(big), big) * 5)
    assert status is None or is_error(status, out, 413, "body_too_large"), (status, out)
    good_request_works(stack, port)


def test_a_2mib_header_is_refused(stack, port):
    status, out = exchange(port, HEAD + b"X-Big: " + b"a" * (2 << 20) + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert status is None or is_error(status, out, 400, "bad_http_request"), (status, out)
    assert health(port) == 200
    good_request_works(stack, port)


def test_300_idle_connections_leave_health_answering(stack, port):
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
    try:
        assert health(port) == 200
        good_request_works(stack, port)
    finally:
        for s in idle:
            s.close()


@pytest.fixture(scope="module")
def tight(stack, model_dir):
    """A gateway with short time limits and room for 8 connections."""
    proc = gateway_over(stack, model_dir, stack.procs["prefill"], stack.procs["decode"], http=True, extra=(
        "--http-header-timeout", "1", "--http-body-timeout", "1", "--http-max-connections", "8"))
    yield proc.http_port
    launcher.stop(proc)


def closed_by_server(s: socket.socket) -> bytes:
    """What the server sent before closing s (the socket's own timeout bounds the wait)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_slow_heads_and_bodies_are_cut_off(tight):
    loris = socket.create_connection(("127.0.0.1", tight), timeout=20)
    loris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the head
    slow = socket.create_connection(("127.0.0.1", tight), timeout=20)
    slow.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')  # 11 of 100 bytes
    assert closed_by_server(loris) == b""
    head, _, body = closed_by_server(slow).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and is_error(408, json.loads(body), 408, "body_timeout"), head
    assert health(tight) == 200


def test_connections_over_the_limit_are_closed(stack, tight):
    held = [socket.create_connection(("127.0.0.1", tight), timeout=20) for _ in range(8)]
    try:
        assert health(tight) is None  # the ninth connection is closed at once
        for s in held:
            assert closed_by_server(s) == b""  # idle past the head timeout
        assert health(tight) == 200
        good_request_works(stack, tight)
    finally:
        for s in held:
            s.close()


def test_no_request_of_this_file_was_answered_500(stack, first_500s):
    """Last in the file: every hostile request above got its 4xx (or a closed connection), none a 500."""
    assert answered_500(stack) == first_500s
