"""Start-up capacity check (DESIGN §4): a pool smaller than the context window refuses to start."""
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import launcher
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import common_pb2, decode_pb2_grpc


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_pool_smaller_than_context_exits_nonzero_with_numbers(model_dir, service):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", service, "--model", model_dir, "--port", "0",
                        "--metrics-port", "0", "--pool-tokens", "1024", "--broker", "127.0.0.1:1",
                        "--insecure", "--allow-unsafe", "insecure"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    err = r.stderr + r.stdout
    assert "1024" in err and "4096" in err and "--allow-pool-smaller-than-context" in err, err
    assert "PDSERVE_READY" not in r.stdout


def test_gateway_without_a_tokenizer_exits_at_once_naming_the_file(model_dir, tmp_path):
    """Before it looks for any backend (there is none here): no silent fallback to bytes."""
    for name in os.listdir(model_dir):
        if name != "tokenizer.json":
            os.symlink(os.path.join(model_dir, name), tmp_path / name)
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "gateway", "--model", str(tmp_path), "--port", "0",
                        "--http-port", "0", "--metrics-port", "0", "--prefill", "127.0.0.1:1", "--decode",
                        "127.0.0.1:1", "--insecure", "--allow-unsafe", "insecure"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"no tokenizer at {tmp_path}/tokenizer.json" in r.stderr and "--byte-tokenizer" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "PDSERVE_READY" not in r.stdout


def test_decode_is_not_serving_until_its_pool_is_registered(model_dir):
    """With no broker to register with, decode stays NOT_SERVING."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "decode", "--model", model_dir,
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


def _health(port: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "health", "--host", "127.0.0.1", "--port", str(port),
                           "--insecure", "--timeout", "1", *flags], capture_output=True, text=True, timeout=60)


def test_health_answers_while_the_model_loads_and_sigterm_then_exits(tmp_path):
    """The checkpoint's config.json is a FIFO nobody writes: the model load blocks for good. The server answers
    health NOT_SERVING meanwhile (`--live` passes, plain health fails), calls get UNAVAILABLE STARTING, and
    SIGTERM ends the process at once with 0, although the load never returns."""
    model = tmp_path / "blocked-model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "decode", "--model", str(model), "--metrics-port",
                             "0", "--broker", "127.0.0.1:1", "--port", str(port), "--insecure", "--allow-unsafe",
                             "insecure"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while (live := _health(port, "--live")).returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None, (live.stderr, proc.poll())
            time.sleep(0.2)
        assert live.stdout.strip() == "NOT_SERVING", live.stdout
        ready = _health(port)
        assert ready.returncode == 1 and ready.stdout.strip() == "NOT_SERVING", (ready.stdout, ready.stderr)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                decode_pb2_grpc.DecodeStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=5)
        err = from_rpc_error(e.value)
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "STARTING"), err
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(30)
        took = time.monotonic() - t0
        out = proc.stdout.read()
        assert rc == 0 and "stopped during start-up" in out, (rc, out[-2000:])
        assert took < 10, took
        assert "PDSERVE_READY" not in out
    finally:
        launcher.stop(launcher.Proc("decode", [], proc))
    gone = _health(port, "--live")
    assert gone.returncode == 1, gone.stdout
