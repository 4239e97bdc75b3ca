"""A gateway whose public APIs would listen beyond loopback with no API key refuses to start, in one line naming the
risk (every caller could generate, and all would share one prefix-cache scope); with --allow-unauthenticated it
starts, serves, and says so once. The stack's own gateway (127.0.0.1, no key) is the loopback case every other test
runs on. The check itself: tests/unit/gateway/test_exposure.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import grpc
import pytest

from pdserve import launcher
from pdserve.common.pki import files_for
from pdserve.common.proto import gateway_pb2_grpc
from tests.conftest import ROOT
from tests.integration.helpers import prompt
from tests.integration.test_grpc_api_key import stream

WARNING = "UNAUTHENTICATED (--allow-unauthenticated)"


def gateway_args(stack, model_dir: str, host: str, http_port: str) -> list[str]:
    """The command line an operator would give, over the stack's prefill and decode."""
    f = files_for(stack.tls_dir, "gateway/gateway0")
    return ["gateway", "--host", host, "--port", "0", "--http-port", http_port, "--metrics-port", "0",
            "--model", model_dir, "--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca,
            "--prefill", stack.procs["prefill"][0].target, "--decode", stack.procs["decode"][0].target]


def no_key_env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}, "PYTHONPATH": ROOT}


@pytest.mark.parametrize("host,at,http_port", [("0.0.0.0", "0.0.0.0", "0"), ("::", "[::]", "-1")])
def test_no_key_beyond_loopback_exits_with_one_line_naming_the_risk(stack, model_dir, host, at, http_port):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", *gateway_args(stack, model_dir, host, http_port)],
                       env=no_key_env(), capture_output=True, text=True, timeout=120)
    print(f"rc {r.returncode}, stderr: {r.stderr.strip()}")
    assert r.returncode != 0 and "PDSERVE_READY" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("gateway: refusing to start: ") and f"gRPC API on {at}:0" in line
    assert ("HTTP API on" in line) == (http_port != "-1")
    assert "no API key" in line and "one prefix-cache scope" in line and "--allow-unauthenticated" in line


@pytest.fixture(scope="module")
def open_gateway(stack, model_dir):
    proc = launcher.start("gateway-open", [*gateway_args(stack, model_dir, "0.0.0.0", "0"), "--allow-unauthenticated"])
    proc.stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(proc.target))
    yield proc
    launcher.stop(proc)


def test_with_allow_unauthenticated_it_starts_serves_health_and_warns_once(open_gateway, oracle):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "health", "--host", "127.0.0.1", "--port",
                          str(open_gateway.port), "--insecure"], env=no_key_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "SERVING", (out.stdout, out.stderr)
    with urllib.request.urlopen(f"http://127.0.0.1:{open_gateway.http_port}/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    p = prompt(24, 2701)
    tokens, e = stream(open_gateway.stub, p, ())  # no key: open, as the flag says
    assert e is None and len(tokens) == 6
    oracle.check(p, tokens)
    warnings = [line for line in open_gateway.lines if WARNING in line]
    assert len(warnings) == 1 and "gRPC API on 0.0.0.0:" in warnings[0], warnings
