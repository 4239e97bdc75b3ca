"""--transfer-port fixes the ports decode's Mooncake engine listens on (issue 10: a NetworkPolicy must name
them): the session decode hands out, and the sockets the process really holds, are on that port and the next."""
from __future__ import annotations

import random
import socket

import pytest

from pdserve import launcher
from pdserve.common.proto import decode_pb2
from tests.integration.helpers import allocate, prompt
from tests.integration.procnet import listening_ports
from tests.integration.stack import Stack


def free_run(n: int) -> int:
    """A port P with P .. P + n - 1 free, outside Mooncake's default range (15000-17000, other stacks on this
    host draw from it) and outside the ephemeral range Mooncake refuses."""
    for _ in range(200):
        port = random.randrange(20000, 32000, n)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("0.0.0.0", port + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return port
    raise RuntimeError(f"no {n} free consecutive ports in 20000-32000")


@pytest.fixture(scope="module")
def pinned(model_dir):
    port = free_run(4)  # decode on port and port + 1, prefill on port + 2 and port + 3
    s = Stack(model_dir, extra={"decode": ["--transfer-port", str(port)],
                                "prefill": ["--transfer-port", str(port + 2)]})
    yield s, port
    s.close()


def test_engines_listen_on_the_given_port_and_the_next_only(pinned):
    stack, port = pinned
    decode, prefill = stack.procs["decode"][0], stack.procs["prefill"][0]
    # nothing else: Mooncake opens no third, random port (prefill reaches decode on exactly these)
    assert listening_ports(decode.popen.pid) == {decode.port, decode.metrics_port, port, port + 1}
    assert listening_ports(prefill.popen.pid) == {prefill.port, prefill.metrics_port, port + 2, port + 3}


def test_session_names_the_given_port(pinned, oracle):
    stack, port = pinned
    rid, dest = allocate(stack, 20, 4)
    host, _, session_port = dest.transfer_session.rpartition(":")
    assert host == "127.0.0.1" and int(session_port) in (port, port + 1), dest.transfer_session
    # given back: an allocation nobody decodes would hold decode's drain at the end of the module
    stack.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=rid), timeout=10)
    p = prompt(33, 777)
    out = stack.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True)
    assert "error" not in out, out
    oracle.check(p, out["token_ids"])  # prefill wrote this request's KV through those ports


def test_a_port_mooncake_would_ignore_is_refused_at_start(model_dir):
    # 40000 lies in the range Mooncake silently replaces with random ports
    with pytest.raises(RuntimeError) as e:
        launcher.start("decode", ["decode", "--port", "0", "--metrics-port", "0", "--insecure", "--allow-unsafe",
                                  "insecure", "--model", model_dir, "--transfer-port", "40000"], timeout=60)
    assert "--transfer-port 40000" in str(e.value) and "32768-60999" in str(e.value)
