"""The gateway's API keys file (issue 20): each key is one tenant's, over gRPC and HTTP alike; another key gets
nothing; a bad file stops the gateway at start-up with its line. The prefix scope each tenant's requests get is
tests/unit/gateway/test_prefix_scope.py's (read off the outgoing Run and Prefill requests)."""
import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve import launcher
from pdserve.common.errors import from_rpc_error
from tests.integration.drain_util import gateway_over
from tests.integration.helpers import prompt
from tests.integration.test_grpc_api_key import stream

KEYS = {"acme": "sk-acme-key-0001", "globex": "sk-globex-key-01"}


@pytest.fixture(scope="module")
def tenants(stack, model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("# two tenants\n" + "".join(f"{t}: {k}\n" for t, k in KEYS.items()))
    proc = gateway_over(stack, model_dir, stack.procs["prefill"], stack.procs["decode"], http=True,
                        extra=("--api-keys-file", str(path)))
    yield proc
    launcher.stop(proc)


def _http(gw, p, key, salt=None):
    body = {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(f"http://127.0.0.1:{gw.http_port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_tenant_s_key_is_served_over_grpc_and_http_and_another_key_is_refused(tenants, oracle):
    p = prompt(40, 2001)
    for tenant, key in KEYS.items():
        tokens, e = stream(tenants.stub, p, (("authorization", f"Bearer {key}"),))
        assert e is None, (tenant, from_rpc_error(e))
        oracle.check(p, tokens, use_hf=False)
        status, body = _http(tenants, p, key, salt=f"salt-{tenant}")
        assert status == 200 and body["choices"][0]["token_ids"] == tokens, (tenant, body)
    tokens, e = stream(tenants.stub, p, (("authorization", "Bearer sk-acme-key-0002"),))
    assert tokens == [] and from_rpc_error(e).code == grpc.StatusCode.UNAUTHENTICATED
    status, body = _http(tenants, p, "sk-acme-key-0002")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _http(tenants, p, KEYS["acme"], salt="x" * 257)
    assert status == 400 and "cache_salt is 257 bytes; at most 256" in body["error"]["message"]


def test_a_bad_keys_file_stops_the_gateway_with_its_line_and_not_the_key(model_dir, tmp_path):
    path = tmp_path / "keys"
    path.write_text("acme: sk-acme-key-0001\nglobex: sk-acme-key-0001\n")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "gateway", "--model", model_dir, "--port", "0",
                        "--http-port", "0", "--metrics-port", "0", "--prefill", "127.0.0.1:1", "--decode",
                        "127.0.0.1:1", "--insecure", "--allow-unsafe", "insecure", "--api-keys-file", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "PDSERVE_READY" not in r.stdout
    assert f"{path}:2: the key of tenant 'globex' is the key of line 1 (tenant 'acme') again" in r.stderr, r.stderr
    assert "sk-acme" not in r.stderr + r.stdout and "Traceback" not in r.stderr
