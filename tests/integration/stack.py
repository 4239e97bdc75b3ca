"""A real local stack (broker, prefill, decode, gateway processes on OS-picked ports) for tests."""
from __future__ import annotations

import os
import re
import tempfile
import urllib.request

from pdserve import launcher
from pdserve.client import build_request, generate
from pdserve.common.pki import files_for, issue
from pdserve.common.tls import TlsConfig, secure_channel
from pdserve.common.proto import (broker_pb2, broker_pb2_grpc, decode_pb2_grpc, faults_pb2, faults_pb2_grpc,
                                   gateway_pb2_grpc, prefill_pb2_grpc)


class Stack:
    def __init__(self, model_dir: str, **kw):
        self.log_dir = tempfile.mkdtemp(prefix="pdserve-stack-")
        self.env = kw.pop("env", {})
        env = {"PDSERVE_ENABLE_FAULTS": "1", **self.env}
        self.tls_dir = os.path.join(self.log_dir, "tls")
        self.procs = launcher.start_stack(model_dir, env=env, log_dir=self.log_dir, tls_dir=self.tls_dir, **kw)
        self._channels = []
        self._pool_ids: dict[int, str] = {}
        self.gateway = gateway_pb2_grpc.GatewayStub(self._ch(self.procs["gateway"][0].target, tls=None))
        self.broker = broker_pb2_grpc.BrokerStub(self._ch(self.procs["broker"][0].target)) \
            if len(self.procs["broker"]) == 1 else _Leading(self)
        self.prefills = [prefill_pb2_grpc.PrefillStub(self._ch(p.target)) for p in self.procs["prefill"]]
        self.decodes = [decode_pb2_grpc.DecodeStub(self._ch(p.target)) for p in self.procs["decode"]]
        self.pool_ids()  # remembered now, while each decode's registration line is still in its output

    def tls(self, identity: str = launcher.OPERATOR) -> TlsConfig:
        """Credentials signed by this stack's CA for any identity (made on first use; tests may name
        malformed ones to see them refused)."""
        files = files_for(self.tls_dir, identity)
        if not os.path.exists(files.cert):
            files = issue(self.tls_dir, identity)
        return TlsConfig(files.cert, files.key, files.ca)

    def _ch(self, target: str, tls: TlsConfig | None | str = launcher.OPERATOR):
        """A channel to target; internal services get mutual TLS as the operator unless told otherwise
        (pass tls=None only for the gateway's plaintext public API)."""
        if isinstance(tls, str):
            tls = self.tls(tls)
        ch = secure_channel(target, tls, [("grpc.max_receive_message_length", 64 << 20)], aio=False)
        self._channels.append(ch)
        return ch

    def generate(self, **kw) -> dict:
        return generate(self.gateway, build_request(**kw))

    def arm(self, service: str, name: str, count: int = 1, arg: str = "", index: int = 0) -> None:
        target = self.procs[service][index].target
        faults_pb2_grpc.FaultsStub(self._ch(target)).Arm(faults_pb2.ArmRequest(name=name, count=count, arg=arg))

    def clear_faults(self) -> None:
        for name in ("prefill", "decode", "broker"):
            for p in self.procs[name]:
                # wait_for_ready: a service that was just restarted may still be binding its port
                faults_pb2_grpc.FaultsStub(self._ch(p.target)).Clear(faults_pb2.ClearRequest(), timeout=30,
                                                                     wait_for_ready=True)

    def metrics(self, service: str, index: int = 0) -> str:
        port = self.procs[service][index].metrics_port
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    def metric(self, service: str, name: str, labels: dict | None = None, index: int = 0) -> float:
        """Value of one series; raises if absent (a counter must exist from start-up)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted((labels or {}).items()))
        total = None
        for line in self.metrics(service, index).splitlines():
            m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
            if all(f'{k}="{v}"' in got for k, v in (labels or {}).items()):
                total = (total or 0.0) + float(m.group(3))
        if total is None:
            raise KeyError(f"{name}{{{want}}} not exported by {service}")
        return total

    def pool_ids(self) -> list[str]:
        """Each decode's current pool id, as it logged it when it last registered (a move to another broker
        incarnation registers a new one). Remembered: a process keeps only its last 400 lines, so after a long
        run (the soak) the registration line is gone."""
        for i, p in enumerate(self.procs["decode"]):
            for line in p.lines:
                if m := re.search(r"pool (\S+) registered:", line):
                    self._pool_ids[i] = m.group(1)
        return [self._pool_ids[i] for i in range(len(self.procs["decode"])) if i in self._pool_ids]

    def pool_states(self) -> list:
        return [self.broker.GetPoolState(broker_pb2.GetPoolStateRequest(pool_id=pool_id), timeout=5)
                for pool_id in self.pool_ids()]

    def restart(self, service: str, index: int = 0, sig: int = 9) -> None:
        """Kills a service (SIGKILL by default) and starts it again on the same ports."""
        import os
        old = self.procs[service][index]
        try:
            os.killpg(old.popen.pid, sig)
        except ProcessLookupError:
            pass
        old.popen.wait(10)
        self.procs[service][index] = launcher.restart(old, {"PDSERVE_ENABLE_FAULTS": "1", **self.env},
                                                      log_path=f"{self.log_dir}/{old.name}.log")

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n" + "".join(p.lines[-60:]) for n, ps in self.procs.items() for p in ps)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        launcher.stop_stack(self.procs)


class _Leading:
    """The Broker stub of a stack with broker replicas: each call goes to whichever replica answers it, the leader
    (a standby refuses NOT_LEADER, a dead or paused one does not answer)."""

    def __init__(self, stack: Stack):
        self._stack = stack
        self._stubs: dict[str, object] = {}  # target -> stub (a restarted replica keeps its port)

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            import grpc

            from pdserve.common.errors import from_rpc_error
            last = None
            for p in self._stack.procs["broker"]:
                stub = self._stubs.get(p.target)
                if stub is None:
                    stub = self._stubs[p.target] = broker_pb2_grpc.BrokerStub(self._stack._ch(p.target))
                try:
                    return getattr(stub, method)(*args, **kwargs)
                except grpc.RpcError as e:
                    last = e
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or \
                            from_rpc_error(e).reason not in ("NOT_LEADER", "UNKNOWN"):
                        raise
            raise last
        return call
