"""Every command line in the rendered manifests (service args, init containers, probe commands) is accepted
by the real `pdserve` parser in services/cli.py, so a flag renamed in the code fails here and not in a
cluster. The parser is the one `pdserve` runs: only the function each sub-command would call is replaced by
a recorder, so nothing starts."""
from __future__ import annotations

import contextlib
import io

import pytest

from pdserve import cli
from tests.deploy.render import OVERLAYS, containers, render, workloads

POD_IP = "10.1.2.3"


def command_lines(overlay: str):
    """(where, argv after `pdserve`) for every pdserve invocation in the overlay."""
    for w in workloads(render(overlay)):
        name = w["metadata"]["name"]
        for c in containers(w) + containers(w, init=True):
            assert c["command"] == ["pdserve"], (name, c["name"], c["command"])
            # the kubelet expands $(VAR) from the container's env before exec
            yield f"{name}/{c['name']}", [a.replace("$(POD_IP)", POD_IP) for a in c["args"]]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c:
                    cmd = c[kind]["exec"]["command"]
                    assert cmd[0] == "pdserve", (name, kind, cmd)
                    yield f"{name}/{c['name']}/{kind}", cmd[1:]


def parse(monkeypatch, argv: list[str]):
    """Runs the real `pdserve` entry point with argv; returns (parsed namespace, argparse's complaint)."""
    seen = []

    def record(args):
        seen.append(args)
        return 0

    for name in cli.SERVICES:
        monkeypatch.setattr(f"pdserve.{name}.main.main", record)
    monkeypatch.setattr(cli, "_health", record)
    monkeypatch.setattr("pdserve.check.main", record)
    monkeypatch.setattr("pdserve.engine.make_model.make_model", lambda *a: seen.append(a) or "")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    except SystemExit as e:
        return None, f"exit {e.code}: {err.getvalue().strip().splitlines()[-1]}"
    assert rc == 0 and len(seen) == 1
    return seen[0], ""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_line_in_the_manifests_parses(overlay, monkeypatch):
    refused = {}
    for where, argv in command_lines(overlay):
        ns, complaint = parse(monkeypatch, argv)
        if complaint:
            refused[where] = complaint
    assert refused == {}


def test_parsed_values_are_the_ones_the_manifests_mean(monkeypatch):
    lines = dict(command_lines("cpu"))
    decode, _ = parse(monkeypatch, lines["pdserve-decode/decode"])
    assert decode.host == POD_IP and decode.broker == "pdserve-broker:50052" and decode.transfer_port == 15000
    assert decode.tls_cert == "/etc/pdserve/tls/tls.crt" and decode.drain_timeout == 25
    live, _ = parse(monkeypatch, lines["pdserve-decode/decode/livenessProbe"])
    assert live.live is True and live.port == 50054
    ready, _ = parse(monkeypatch, lines["pdserve-decode/decode/readinessProbe"])
    assert ready.live is False and ready.tls_role == "decode"
    model = parse(monkeypatch, lines["pdserve-decode/make-model"])[0]
    # dtype None: the manifests name no dtype, so make_model writes the preset's own (float32 for tiny)
    assert model == ("/models/pdserve-tiny", "tiny", 0, "llama", None)


def test_a_flag_the_code_does_not_know_is_refused(monkeypatch):
    ns, complaint = parse(monkeypatch, ["broker", "--host", "0.0.0.0", "--no-such-flag", "1"])
    assert ns is None and "--no-such-flag" in complaint
