"""`pdserve up --ha` as a user runs it: a local etcd and two broker replicas; a kill -9 of the leading one while a
long answer streams: the answer completes token for token, the dead replica is started again on its ports (as a
standby), and the stack still serves; Ctrl-C (SIGTERM here) stops everything it started, etcd included."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from pdserve.client import build_request, generate
from pdserve.common.proto import gateway_pb2_grpc
from tests.integration.helpers import prompt
from tests.integration.test_lifeline import ROOT, children
from tests.integration.test_up_serving_flags import free_port, until_up

READY = re.compile(r"\[(broker\d*)\] PDSERVE_READY service=broker port=(\d+) metrics_port=(\d+)")


def leads(metrics_port: int) -> bool:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    except OSError:
        return False
    return re.search(r"^pdserve_broker_leader 1\.0$", text, re.M) is not None


def test_up_ha_keeps_a_stream_through_a_broker_kill_and_restarts_the_replica(model_dir, oracle, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    env.update(PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "pdserve.cli", "up", "--ha", "--model", model_dir,
                             "--free-ports", "--http-port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        assert until_up(proc, seen) is not None, "".join(seen[-60:])
        threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True).start()
        brokers = {m.group(1): int(m.group(3)) for line in seen if (m := READY.search(line))}
        assert len(brokers) == 2, "".join(seen[-60:])
        kids = children(proc.pid)
        assert sum(cmd.startswith("/usr/bin/etcd ") for cmd in kids.values()) == 1, kids
        leader = next(name for name, metrics in brokers.items() if leads(metrics))
        pid = int(re.findall(rf"\[{leader}\] .*election \S+-(\d+): leads, term", "".join(seen))[-1])
        gateway = int(re.search(r"gateway gRPC 127\.0\.0\.1:(\d+)", "".join(seen)).group(1))
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{gateway}"))
        p = prompt(30, 101)
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(generate(stub, build_request(
            prompt_token_ids=p, max_tokens=1500, ignore_eos=True))))
        t.start()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        t.join(180)
        assert "error" not in answer[0], ("".join(seen[-80:]), answer)
        oracle.check(p, answer[0]["token_ids"])
        assert re.search(r"handed over from term \d+ to term \d+: 1 running requests go on", "".join(seen)), \
            "".join(seen[-80:])
        deadline = time.monotonic() + 60
        while not any(f"{leader} exited with" in line for line in seen) or \
                sum(" broker " in cmd for cmd in children(proc.pid).values()) < 2:
            assert time.monotonic() < deadline, "".join(seen[-60:])
            time.sleep(0.2)
        q = prompt(20, 102)
        out = generate(stub, build_request(prompt_token_ids=q, max_tokens=4, ignore_eos=True))
        assert "error" not in out, out
        oracle.check(q, out["token_ids"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert children(proc.pid) == {}
