"""What the chat body turns into before any generation: chat_template_kwargs (add_generation_prompt honoured as
vLLM does, never given twice to the template), logit_bias keys, response_format's grammar."""
import json

import pytest

from pdserve.common.admission import MAX_LOGIT_BIAS
from pdserve.gateway.openai.errors import ApiError
from pdserve.gateway.openai.chat import template_args
from pdserve.gateway.openai.generation import build, logit_bias_of
from pdserve.gateway.openai.schema import ChatRequest

MSGS = [{"role": "user", "content": "hi"}]


def body(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": MSGS, **kw})


def test_chat_template_kwargs_win_over_the_body_and_never_reach_the_template_twice():
    assert template_args(body()) == (True, {})
    assert template_args(body(chat_template_kwargs={"add_generation_prompt": False, "enable_thinking": True})) == \
        (False, {"enable_thinking": True})
    assert template_args(body(add_generation_prompt=False)) == (False, {})
    for kwargs, words in [({"add_generation_prompt": "no"}, "must be a boolean"),
                          ({"messages": [], "tools": []}, "may not set messages, tools")]:
        with pytest.raises(ApiError, match=words) as e:
            template_args(body(chat_template_kwargs=kwargs))
        assert e.value.status == 400


def test_logit_bias_keys_are_token_ids():
    assert logit_bias_of(body(logit_bias={"5": -100, "17": 2.5, "0": 1, "511": 2}), 512) == \
        {5: -100.0, 17: 2.5, 0: 1.0, 511: 2.0}
    # what str.isdigit() or int() would take, or take wrongly: none is a token id
    for key, words in [("-1", "not a token id"), ("x", "not a token id"), ("1.5", "not a token id"),
                       (" 1", "not a token id"), ("1_0", "not a token id"), ("+1", "not a token id"),
                       ("07", "not a token id"), ("", "not a token id"), ("\u00b2", "not a token id"),
                       ("\u0663", "not a token id"), ("\uff11", "not a token id"),
                       ("512", "outside the vocabulary [0, 512)"), (str(2**31), "outside the vocabulary [0, 512)"),
                       ("1" * 5000, "outside the vocabulary [0, 512)")]:
        with pytest.raises(ApiError) as e:
            logit_bias_of(body(logit_bias={key: 1}), 512)
        err = e.value
        assert err.status == 400 and err.param == "logit_bias" and words in err.message, (key, err.message)
        assert repr(key[:20]) in err.message and len(err.message) < 200, err.message  # named, truncated


def test_too_many_logit_bias_entries_are_refused_by_their_count():
    bias = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(ApiError, match=f"{MAX_LOGIT_BIAS + 1} logit_bias entries; at most {MAX_LOGIT_BIAS}"):
        logit_bias_of(body(logit_bias=bias), 2 * MAX_LOGIT_BIAS)
    del bias["0"]
    assert len(logit_bias_of(body(logit_bias=bias), 2 * MAX_LOGIT_BIAS)) == MAX_LOGIT_BIAS


def test_the_grammar_and_options_reach_the_generate_request():
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}}
    b = body(response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema}},
             logit_bias={"9": 3}, min_p=0.25, min_tokens=2)
    req = build(b, [1, 2], 8, 0, None, None, logit_bias_of(b, 512))
    assert json.loads(req.json_schema) == schema and not req.json_object
    assert dict(req.logit_bias) == {9: 3.0} and req.min_p == 0.25 and req.min_tokens == 2
    assert build(body(response_format={"type": "json_object"}), [1], 8, 0, None, None, {}).json_object
    plain = build(body(response_format={"type": "text"}), [1], 8, 0, None, None, {})
    assert plain.json_schema == "" and not plain.json_object and not plain.HasField("min_p")
    forced = build(b, [1], 8, 0, None, None, {}, ('{"type": "boolean"}', False))
    assert forced.json_schema == '{"type": "boolean"}'
