"""The OpenAI-compatible HTTP front: same admission, same tokens as gRPC."""
import json
import urllib.error
import urllib.request

from tests.integration.helpers import prompt


def post(stack, body: dict):
    port = stack.procs["gateway"][0].http_port
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completion_matches_grpc_and_passes_oracle(stack, oracle):
    p = prompt(45, 900)
    status, body = post(stack, {"prompt": p, "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    out = json.loads(body)
    ids = out["choices"][0]["token_ids"]
    assert out["usage"] == {"prompt_tokens": 45, "completion_tokens": 7, "total_tokens": 52}
    assert out["choices"][0]["finish_reason"] == "length"
    oracle.check(p, ids)
    assert stack.generate(prompt_token_ids=p, max_tokens=7, ignore_eos=True)["token_ids"] == ids


def test_streaming_sse_carries_the_same_tokens(stack):
    p = prompt(30, 901)
    status, body = post(stack, {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert ids == stack.generate(prompt_token_ids=p, max_tokens=5, ignore_eos=True)["token_ids"]


def test_bad_input_is_http_400_with_reason(stack):
    status, body = post(stack, {"prompt": "", "max_tokens": 5})
    assert status == 400
    assert json.loads(body)["error"]["code"] == "invalid_value"  # an empty prompt is refused by the schema
    status, body = post(stack, {"prompt": "hi", "max_tokens": 5000})
    assert status == 400 and json.loads(body)["error"]["code"] == "context_exceeded"


def test_a_batch_of_prompts_gets_its_own_choices_each(stack):
    prompts = [prompt(11, 902), prompt(17, 903)]
    status, body = post(stack, {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    out = json.loads(body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, c in enumerate(out["choices"]):
        assert c["token_ids"] == stack.generate(prompt_token_ids=prompts[i // 2], max_tokens=4,
                                                ignore_eos=True)["token_ids"]
    assert out["usage"] == {"prompt_tokens": 28, "completion_tokens": 16, "total_tokens": 44}


def test_guidellm_body_streams_with_running_usage(stack):
    """The body guidellm sends (vLLM's continuous_usage_stats, stop null, ignore_eos): every chunk counts the
    tokens so far."""
    status, body = post(stack, {"model": "pdserve-tiny", "prompt": "the quick brown fox", "max_tokens": 5,
                                "stop": None, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200, body
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    ids = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 5 and counts[-1] == 5 and counts == sorted(counts) and events[-1]["choices"] == []
