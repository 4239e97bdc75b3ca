"""The official `openai` client against the gateway (issue 11, acceptance 1): completions and chat, JSON and
streaming, stop, n, logprobs, seed, include_usage; checked against an independent path (transformers for the
chat template and the log-softmax, gRPC Generate and unstopped runs for the text)."""
import json
import os
import signal
import socket
import time

import openai
import pytest
import torch

from tests.integration.drain_util import openai_gateway
from tests.integration.helpers import prompt, wait_for, wait_no_leases, with_template

KEY = "sk-test-pdserve"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def chat_dir(model_dir, tmp_path_factory):
    """The tiny checkpoint with a ChatML template."""
    return with_template(model_dir, tmp_path_factory.mktemp("chat-model"), CHATML)


@pytest.fixture(scope="module")
def gw(stack, chat_dir):
    with openai_gateway(stack, chat_dir, KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(gw):
    return gw.client


@pytest.fixture(scope="module")
def model(client):
    (m,) = client.models.list().data
    assert m.owned_by == "pdserve" and m.max_model_len == 4096 and m.created > 0
    return m.id


def greedy(**kw):
    return {"temperature": 0, "extra_body": {"ignore_eos": True}, **kw}


def test_greedy_streaming_equals_json_and_grpc(client, model, stack):
    p = prompt(20, 1200)
    out = client.completions.create(model=model, prompt=p, max_tokens=9, **greedy())
    (choice,) = out.choices
    assert out.usage.prompt_tokens == 20 and out.usage.completion_tokens == 9 and choice.finish_reason == "length"
    ref = stack.generate(prompt_token_ids=p, max_tokens=9, ignore_eos=True)
    assert choice.text == ref["text"] and choice.token_ids == ref["token_ids"]
    chunks = list(client.completions.create(model=model, prompt=p, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert len({c.id for c in chunks}) == 1 and all(c.created and c.model == model for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == 20


@pytest.fixture(scope="module")
def chat_ids(chat_dir) -> list[int]:
    """CHAT's prompt as transformers renders and encodes it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_dir)
    return tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_chat_prompt_is_transformers_apply_chat_template(client, model, chat_ids):
    ids = chat_ids
    out = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=8, **greedy())
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.role == "assistant"
    ref = client.completions.create(model=model, prompt=ids, max_tokens=8, **greedy())
    assert out.choices[0].message.content == ref.choices[0].text and out.choices[0].finish_reason == "length"
    stream = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **greedy()))
    assert stream[0].choices[0].delta.role == "assistant" and stream[-1].usage.total_tokens == len(ids) + 8
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.choices[0].text


def test_stop_ends_the_text_before_the_stop_string(client, model):
    p = prompt(12, 1201)
    full = client.completions.create(model=model, prompt=p, max_tokens=16, **greedy()).choices[0].text
    k = next(i for i in range(2, len(full) - 1) if full[i:i + 2].isalpha() and full.index(full[i:i + 2]) == i)
    stop = full[k:k + 2]
    for stream in (False, True):
        out = client.completions.create(model=model, prompt=p, max_tokens=16, stop=[stop], stream=stream,
                                        **greedy())
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == full[:k], (stop, full)
        assert chunks[-1].choices[0].finish_reason == "stop"
    ids = client.completions.create(model=model, prompt=p, max_tokens=16, **greedy()).choices[0].token_ids
    j = next(i for i in range(2, len(ids)) if ids.index(ids[i]) == i)
    out = client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [ids[j]]}).choices[0]
    # the stop token's text is not returned; whether its id is listed is the engine's choice
    assert out.token_ids in (ids[:j], ids[:j + 1]) and out.finish_reason == "stop"


def test_top_k_1_samples_the_greedy_text(client, model):
    p = prompt(14, 1206)
    want = client.completions.create(model=model, prompt=p, max_tokens=10, **greedy()).choices[0].text
    got = client.completions.create(model=model, prompt=p, max_tokens=10, temperature=1.5, seed=3,
                                    extra_body={"ignore_eos": True, "top_k": 1})
    assert got.choices[0].text == want


def test_n2_with_a_seed_is_seed_plus_i(client, model):
    kw = {"model": model, "prompt": "Once upon", "max_tokens": 8, "temperature": 1.0,
          "extra_body": {"ignore_eos": True}}
    two = client.completions.create(n=2, seed=77, **kw)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 16
    for i, c in enumerate(two.choices):
        assert c.text == client.completions.create(seed=77 + i, **kw).choices[0].text
    chat = client.chat.completions.create(model=model, messages=CHAT, n=2, seed=5, max_tokens=6, temperature=1.0,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12
    again = client.chat.completions.create(model=model, messages=CHAT, seed=6, max_tokens=6, temperature=1.0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[1].message.content


def close(got: list[float], want: torch.Tensor) -> bool:
    return len(got) == len(want) and all(abs(g - float(w)) < 2e-3 for g, w in zip(got, want))


def test_logprobs_are_the_log_softmax_of_transformers(client, model, oracle, chat_ids):
    p = prompt(10, 1202)
    out = client.completions.create(model=model, prompt=p, max_tokens=5, logprobs=3, echo=True, **greedy())
    (c,) = out.choices
    seq = p + c.token_ids
    ref = torch.log_softmax(oracle.hf_logits(seq), dim=-1)  # row i: the distribution of token i + 1
    lp = c.logprobs
    assert len(lp.tokens) == len(seq) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(seq)):
        want = ref[pos - 1]
        assert close([lp.token_logprobs[pos]], want[seq[pos]:seq[pos] + 1]), pos
        # keyed by token text, so two ids with the same text (a partial UTF-8 byte is U+FFFD) share one key
        top, best = sorted(lp.top_logprobs[pos].values(), reverse=True), want.topk(3).values
        assert 0 < len(top) <= 3 and all(any(abs(t - float(b)) < 2e-3 for b in best) for t in top), pos
        assert len(top) < 3 or close(top, best), pos
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2,
                                          **greedy())
    gen = client.completions.create(model=model, prompt=chat_ids, max_tokens=4, **greedy()).choices[0].token_ids
    ref = torch.log_softmax(oracle.hf_logits(chat_ids + gen), dim=-1)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for j, e in enumerate(content):
        want = ref[len(chat_ids) - 1 + j]
        assert close([e.logprob], want[gen[j]:gen[j] + 1]) and close([t.logprob for t in e.top_logprobs],
                                                                      want.topk(2).values), j
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token


def test_request_ids_and_errors_the_client_understands(client, model, gw):
    raw = client.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().choices[0].text is not None
    made = {client.models.with_raw_response.list().headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(r.startswith("req-") for r in made)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"best_of": 3, "suffix": "x"})
    assert "best_of" in e.value.message and "suffix" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
    s = socket.create_connection(("127.0.0.1", gw.http_port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert s.makefile("rb").read().startswith(b"HTTP/1.1 200")  # /health needs no key


def test_data_loss_is_not_retried(client, model, stack):
    stack.arm("prefill", "prefill.bit_flip", arg="2")  # once: a retry would succeed and hide the error
    retrying = client.with_options(max_retries=3)
    with pytest.raises(openai.InternalServerError) as e:
        retrying.completions.create(model=model, prompt=prompt(100, 1203), max_tokens=3, **greedy())
    assert e.value.response.headers["x-should-retry"] == "false" and e.value.code == "checksum"
    stack.clear_faults()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_generation(stack, gw, stream):
    def cancelled():
        return stack_metric(gw, 'pdserve_requests_total{code="CANCELLED"}')
    assert all(st.num_leased == 0 for st in wait_no_leases(stack, timeout=30))  # leases seen below are ours
    before = cancelled()
    # no token before the write: the request cannot end by itself before the gateway learns that its client left,
    # however slowly a loaded machine lets it notice
    stack.arm("prefill", "prefill.delay_before_write", arg="8000")
    body = json.dumps({"prompt": prompt(8, 1204), "max_tokens": 3000, "ignore_eos": True, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", gw.http_port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
              b"\r\n\r\n" + body)
    while all(st.num_leased == 0 for st in stack.pool_states()):
        time.sleep(0.02)  # until decode holds its pages: the request is under way
    s.close()
    closed = time.monotonic()
    # what the test is about: the gateway ends the generation as cancelled (counted when its call ends)
    wait_for(lambda: cancelled() == before + 1, 30, "the gateway counting the generation CANCELLED")
    noticed = time.monotonic() - closed
    assert all(st.num_leased == 0 for st in wait_no_leases(stack, timeout=20)), "".join(gw.lines[-15:])
    assert cancelled() == before + 1, "".join(gw.lines[-15:])
    print(f"the gateway counted the cancellation {noticed:.2f}s after the client closed its socket")
    stack.clear_faults()


def stack_metric(proc, series: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " "))


def test_the_clients_read_timeout_is_the_deadline_of_a_json_request(stack, gw, model):
    """The official client sends its read timeout (x-stainless-read-timeout); a JSON answer it would stop
    waiting for ends at that deadline with 504 and gives its pages back, instead of running on."""
    import urllib.error
    import urllib.request
    stack.arm("prefill", "prefill.delay_before_write", arg="4000")
    body = json.dumps({"model": model, "prompt": prompt(20, 1205), "max_tokens": 4, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{gw.http_port}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", "x-stainless-read-timeout": "1"})
    with pytest.raises(urllib.error.HTTPError) as e:  # without the deadline: 200 once the delay is over
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 504 and err["code"] == "deadline_exceeded", err
    assert all(st.num_leased == 0 for st in wait_no_leases(stack, timeout=20)), stack.pool_states()
    stack.clear_faults()
    bad = urllib.request.Request(req.full_url, data=body, headers={**req.headers, "X-stainless-read-timeout": "soon"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=30)
    assert e.value.code == 400 and "x-stainless-read-timeout" in json.loads(e.value.read())["error"]["message"]


def test_zz_drain_finishes_http_streams_and_refuses_new_requests(client, model, gw):
    """Last in this module: it stops the module's gateway."""
    stream = client.completions.create(model=model, prompt=prompt(6, 1205), max_tokens=150, stream=True,
                                       **greedy())
    chunks = [next(iter(stream))]
    os.killpg(gw.popen.pid, signal.SIGTERM)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "draining"
    assert float(e.value.response.headers["retry-after"]) > 0
    chunks += list(stream)
    assert sum(len(c.choices[0].token_ids) for c in chunks) == 150
    assert chunks[-1].choices[0].finish_reason == "length"
    assert gw.popen.wait(60) == 0, "".join(gw.lines[-20:])
