"""Start-up capacity check (DESIGN §4): a pool smaller than the context window refuses to start."""
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import launcher


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_pool_smaller_than_context_exits_nonzero_with_numbers(model_dir, service):
    r = subprocess.run([sys.executable, "-m", "services.cli", service, "--model", model_dir, "--port", "0",
                        "--metrics-port", "0", "--pool-tokens", "1024", "--broker", "127.0.0.1:1",
                        "--insecure", "--allow-unsafe", "insecure"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    err = r.stderr + r.stdout
    assert "1024" in err and "4096" in err and "--allow-pool-smaller-than-context" in err, err
    assert "PDSERVE_READY" not in r.stdout


def test_decode_is_not_serving_until_its_pool_is_registered(model_dir):
    """With no broker to register with, decode stays NOT_SERVING."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "decode", "--model", model_dir,
                             "--metrics-port", "0", "--broker", "127.0.0.1:1", "--port", str(port),
                             "--insecure", "--allow-unsafe", "insecure"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            status = None
            for _ in range(200):
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    break
                except grpc.RpcError:
                    time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        launcher.stop(launcher.Proc("decode", [], proc))
