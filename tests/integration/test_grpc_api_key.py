"""The gateway's API key guards its public gRPC port as it guards HTTP (issue 18, hole 7): a Generate without the
key, or with another one, gets UNAUTHENTICATED API_KEY and not one token; with it, the tokens HTTP gives; health
and reflection stay open; `pdserve generate` sends PDSERVE_API_KEY or --api-key."""
import json
import os
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import launcher
from pdserve.client import build_request
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import gateway_pb2
from tests.integration.drain_util import gateway_over
from tests.integration.helpers import prompt

KEY = "sk-grpc-key-7"
REFUSED_METADATA = {
    "no key": (),
    "wrong key": (("authorization", "Bearer sk-grpc-key-8"),),
    "key without Bearer": (("authorization", KEY),),
    "the key twice": (("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")),
}


@pytest.fixture(scope="module")
def keyed(stack, model_dir):
    proc = gateway_over(stack, model_dir, stack.procs["prefill"], stack.procs["decode"], http=True,
                        extra=("--api-key", KEY))
    yield proc
    launcher.stop(proc)


def stream(stub, p: list[int], metadata, max_tokens: int = 6) -> tuple[list[int], grpc.RpcError | None]:
    tokens: list[int] = []
    try:
        for r in stub.Generate(build_request(prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True),
                               timeout=60, metadata=metadata):
            tokens.extend(r.token_ids)
    except grpc.RpcError as e:
        return tokens, e
    return tokens, None


def http_tokens(gw, p: list[int], max_tokens: int) -> list[int]:
    req = urllib.request.Request(f"http://127.0.0.1:{gw.http_port}/v1/completions",
                                 data=json.dumps({"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


@pytest.mark.parametrize("case", sorted(REFUSED_METADATA))
def test_generate_without_the_key_is_refused_before_any_token(keyed, case):
    tokens, e = stream(keyed.stub, prompt(20, 1800), REFUSED_METADATA[case])
    assert e is not None and tokens == [], (case, tokens)
    err = from_rpc_error(e)
    assert (err.code, err.reason) == (grpc.StatusCode.UNAUTHENTICATED, "API_KEY"), (case, err)
    assert "authorization: Bearer KEY" in err.message, err.message
    with pytest.raises(grpc.RpcError) as info:
        keyed.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10, metadata=REFUSED_METADATA[case])
    assert from_rpc_error(info.value).reason == "API_KEY"


def test_with_the_key_grpc_streams_the_tokens_http_gives(keyed, stack, oracle):
    p = prompt(37, 1801)
    tokens, e = stream(keyed.stub, p, (("authorization", f"Bearer {KEY}"),), max_tokens=8)
    assert e is None, from_rpc_error(e)
    assert len(tokens) == 8 and tokens == http_tokens(keyed, p, 8)
    oracle.check(p, tokens, use_hf=False)
    info = keyed.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10,
                                   metadata=(("authorization", f"Bearer {KEY}"),))
    assert info.context_length == 4096


def test_health_and_reflection_need_no_key(keyed):
    with grpc.insecure_channel(keyed.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "pdserve.v1.Gateway" in names, names


def cli_generate(keyed, p: list[int], env_key: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    if env_key is not None:
        env["PDSERVE_API_KEY"] = env_key
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--gateway", keyed.target,
                           "--prompt-token-ids", ",".join(map(str, p)), "--max-tokens", "5", "--ignore-eos",
                           *extra], capture_output=True, text=True, env=env, timeout=120)


def test_pdserve_generate_sends_the_key_from_the_environment_or_the_flag(keyed):
    p = prompt(25, 1802)
    want = http_tokens(keyed, p, 5)
    for env_key, extra in ((KEY, ()), (None, ("--api-key", KEY))):
        r = cli_generate(keyed, p, env_key, "--json", *extra)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == want, r.stdout


def test_pdserve_generate_without_the_key_fails_with_one_clear_line(keyed):
    r = cli_generate(keyed, prompt(25, 1803), None)
    assert r.returncode == 2 and r.stdout.strip() == "", (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: UNAUTHENTICATED API_KEY: missing or wrong API key"), lines
    assert "no API key given: set PDSERVE_API_KEY or pass --api-key" in lines[0], lines
    r = cli_generate(keyed, prompt(25, 1803), "sk-not-it")
    assert r.returncode == 2 and "UNAUTHENTICATED API_KEY" in r.stderr and "the key given was refused" in r.stderr
