"""`pdserve check` agrees with the services (issue 19, acceptance): the very command line a service is given, run
through `pdserve check --lock-delay <the broker's> ...`, predicts what it does: a service whose flags check accepts
starts and serves readiness; one whose flags it refuses exits non-zero with the line check printed."""
import re
import subprocess
import sys

import pytest

from pdserve import cli, launcher
from pdserve.common.pki import issue

LOCK_DELAY = "5.5"


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tls = tmp_path_factory.mktemp("tls")
    b = launcher.start("broker", ["broker", "--port", "0", "--metrics-port", "0", "--lock-delay", LOCK_DELAY,
                                  *_tls(tls, "broker/b0")])
    yield b, tls
    launcher.stop(b)


def _tls(tls_dir, identity: str) -> list[str]:
    f = issue(str(tls_dir), identity)
    return ["--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca]


def _check(argv: list[str], capsys) -> tuple[int, str | None]:
    """`pdserve check --lock-delay LOCK_DELAY ARGV...`, in this process (the services below run as their own)."""
    capsys.readouterr()
    rc = cli.main(["check", "--lock-delay", LOCK_DELAY, *argv])
    out = capsys.readouterr().out
    refusal = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("  exits with:")),
                   None)
    assert (refusal is None) == (rc == 0), out
    return rc, refusal


def _argv(broker, model_dir, service: str, flags: list[str]) -> list[str]:
    b, tls = broker
    return [service, "--model", model_dir, "--port", "0", "--metrics-port", "0", "--broker", b.target,
            *_tls(tls, f"{service}/{service}0"), *flags]


def test_a_prefill_whose_flags_check_accepts_starts(broker, model_dir, capsys):
    """Against this broker's lock_delay of 5.5 s, less landing slack fits (5.334 s) where the default does not
    (below); test_incident_scale.py starts a whole stack check accepted, with the default lock_delay."""
    argv = _argv(broker, model_dir, "prefill", ["--landing-slack", "0.3"])
    assert _check(argv, capsys) == (0, None)
    launcher.stop(launcher.start("prefill", argv))  # raises unless it reaches its ready line


def _own_last_line(stderr: str) -> str:
    """The service's last line; Mooncake's own log (glog: I1201 12:00:00.000 ...) may follow a refusal that came
    after its engine started."""
    lines = [line for line in stderr.strip().splitlines() if not re.match(r"[IWEF]\d{4} \d\d:", line)]
    return lines[-1]


REFUSED = [
    ("prefill", [], "a write this prefill posts may land up to 6.034s after it was posted"),
    ("prefill", ["--pool-tokens", "1024", "--landing-slack", "0.3"], "KV pool holds 1024 tokens"),
    ("decode", ["--max-blind", "2.8"], "--max-blind 2.8s must be > 0 and <= half the broker's lock_delay 5.5s"),
]


def test_services_whose_flags_check_refuses_exit_with_the_line_check_printed(broker, model_dir, capsys):
    argvs = [_argv(broker, model_dir, service, flags) for service, flags, _ in REFUSED]
    refusals = []
    for argv, (_, _, want) in zip(argvs, REFUSED):
        rc, refusal = _check(argv, capsys)
        assert rc == 1 and want in refusal, refusal
        refusals.append(refusal)
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in argvs]  # side by side
    for p, refusal in zip(procs, refusals):
        out, err = p.communicate(timeout=180)
        assert p.returncode != 0 and "PDSERVE_READY" not in out and "Traceback" not in err, err
        assert _own_last_line(err) == refusal
