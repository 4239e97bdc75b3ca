"""--served-model-name (issue 21, point 2), as vLLM documents it: a request may name any of the names, /v1/models lists
them all, responses report the first; without the flag the name is --model as given for a hub id, else the
checkpoint directory's name. Stub backends, as test_prefix_scope.py."""
import asyncio
import json

import httpx
import pytest

from pdserve.common.hub import ModelRef
from pdserve.gateway.main import served_names
from pdserve.gateway.openai.app import Front, create_app
from pdserve.gateway.openai.server import Limits
from tests.unit.gateway.test_prefix_scope import PROMPT, _gateway

NAMES = ["meta-llama/Llama-3.1-8B-Instruct", "llama-8b"]


async def _call(front, method, path, body=None):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(front, None)), base_url="http://t") as c:
        return await c.request(method, path, json=body)


def _complete(front, model, stream=False):
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True, "stream": stream}
    if model is not None:
        body["model"] = model
    return asyncio.run(_call(front, "POST", "/v1/completions", body))


def test_models_lists_every_name_with_the_context():
    gw, _, _ = _gateway()
    r = asyncio.run(_call(Front(gw, NAMES, Limits()), "GET", "/v1/models"))
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == NAMES
    assert all(m["object"] == "model" and m["owned_by"] == "pdserve" and m["max_model_len"] == 4096 for m in data)


@pytest.mark.parametrize("asked", [NAMES[0], NAMES[1], None])
def test_any_name_is_served_and_the_response_reports_the_first(asked):
    gw, (decode,), _ = _gateway()
    r = _complete(Front(gw, NAMES, Limits()), asked)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == NAMES[0] and r.json()["choices"][0]["token_ids"] == [65, 66]
    assert len(decode.requests) == 1


def test_a_stream_reports_the_first_name_in_every_chunk():
    gw, _, _ = _gateway()
    r = _complete(Front(gw, NAMES, Limits()), NAMES[1], stream=True)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {NAMES[0]}


def test_another_name_is_404_naming_every_served_one_before_any_backend_is_asked():
    gw, (decode,), (prefill,) = _gateway()
    r = _complete(Front(gw, NAMES, Limits()), "Llama-3.1-8B-Instruct")  # the directory's name is not served
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == ("the model `Llama-3.1-8B-Instruct` does not exist; this server serves "
                              "`meta-llama/Llama-3.1-8B-Instruct`, `llama-8b`")
    assert decode.requests == [] and prefill.requests == []


def test_the_default_name_is_the_id_or_the_directory_s_name(tmp_path):
    snap = "/cache/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0123abcd"
    assert served_names(None, ModelRef(NAMES[0], snap, NAMES[0])) == (NAMES[0],)
    assert served_names(None, ModelRef("models/pdserve-tiny/", "models/pdserve-tiny/")) == ("pdserve-tiny",)
    assert served_names(NAMES, ModelRef(NAMES[0], snap, NAMES[0])) == tuple(NAMES)


@pytest.mark.parametrize("given, message", [
    (["a", " "], "gateway: --served-model-name: name 2 of 2 is empty"),
    (["a", "b", "a"], "gateway: --served-model-name: a given more than once"),
])
def test_an_empty_or_repeated_name_is_refused(given, message):
    with pytest.raises(SystemExit) as e:
        served_names(given, ModelRef("m", "m"))
    assert str(e.value) == message


def test_a_single_string_is_not_taken_for_its_letters():
    with pytest.raises(TypeError, match="non-empty sequence of names"):
        Front(None, "llama", Limits())
