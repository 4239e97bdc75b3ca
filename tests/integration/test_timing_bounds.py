"""The one timing inequality of the lease protocol (issue 9, hole 2): a page is held lock_delay after a failed
write's ack or its writer's liveness expiry, so lock_delay must cover the longest a posted write can still land
(Mooncake's explicit timeout + 1 ns/byte + slack). Services refuse to start when the numbers break it."""
import re
import subprocess
import sys

from pdserve import launcher
from pdserve.common.pki import issue


def tls_args(tls_dir, identity: str) -> list[str]:
    f = issue(str(tls_dir), identity)
    return ["--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca]


def test_broker_refuses_a_lock_delay_under_mooncakes_shortest_timeout(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "broker", "--port", "0", "--metrics-port", "0",
                        "--lock-delay", "3", *tls_args(tmp_path, "broker/b0")],
                       capture_output=True, text=True, timeout=60)
    err = r.stderr + r.stdout
    assert r.returncode != 0 and "PDSERVE_READY" not in r.stdout, err
    assert "--lock-delay 3.0s is under Mooncake's shortest transfer timeout (5s)" in err, err


def test_prefill_refuses_to_start_when_its_landing_bound_exceeds_the_brokers_lock_delay(tmp_path, model_dir):
    broker = launcher.start("broker", ["broker", "--port", "0", "--metrics-port", "0", "--lock-delay", "5.5",
                                       *tls_args(tmp_path, "broker/b0")])
    prefill = ["prefill", "--model", model_dir, "--port", "0", "--metrics-port", "0", "--pool-tokens", "4096",
               "--broker", broker.target, *tls_args(tmp_path, "prefill/p0")]
    try:
        # default slack 1 s: 5 s Mooncake timeout + 1 ns/byte of the 32 MiB write unit + 1 s > 5.5 s
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", *prefill], capture_output=True, text=True,
                           timeout=120)
        err = r.stderr + r.stdout
        assert r.returncode != 0 and "PDSERVE_READY" not in r.stdout, err
        # one line, the last, and nothing after it: no traceback of the event loop closing under the server
        assert "Traceback" not in err and "Event loop is closed" not in err, err
        last = r.stderr.strip().splitlines()[-1]
        m = re.fullmatch(r"prefill: refusing to start: a write this prefill posts may land up to ([0-9.]+)s after "
                         r"it was posted \(Mooncake timeout 5s \+ 1 ns/byte of the largest batch call \((\d+) bytes, "
                         r"--max-write-bytes\) \+ --landing-slack 1\.000s\), but the broker may free its page 5\.500s "
                         r"after .* \(lock_delay\): raise the broker's --lock-delay to at least ([0-9.]+), .*", last)
        assert m and 6.0 < float(m.group(1)) < 6.1 and m.group(1) == m.group(3), last
        assert m.group(1) == f"{5 + int(m.group(2)) * 1e-9 + 1.0:.3f}" and m.group(2) == str(32 << 20), last
        # the same prefill with less slack fits under the bound and serves
        ok = launcher.start("prefill", [*prefill, "--landing-slack", "0.3"])
        try:
            assert any(re.search(r"a posted write lands within 5\.[0-9]+s after it was posted \(.*\) <= broker "
                                 r"lock_delay 5\.500s", line) for line in ok.lines), "".join(ok.lines[-20:])
        finally:
            launcher.stop(ok)
    finally:
        launcher.stop(broker)


def test_up_ends_a_refused_start_with_one_line_and_no_traceback(tmp_path, model_dir):
    """A service of `pdserve up` that refuses to start (here prefill: its pool is under the context) stops the
    stack, and `up` ends with one line naming the service and its reason."""
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model", model_dir, "--free-ports",
                        "--prefill-pool-tokens", "1024", "--tls-dir", str(tmp_path / "tls")],
                       capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "pdserve is up" not in out, out
    assert "Traceback" not in out and "Event loop is closed" not in out, out
    assert r.stderr.strip().splitlines() == [
        "pdserve up: prefill0 exited with 1: prefill: KV pool holds 1024 tokens but the context length "
        "is 4096 (3072 short); refusing to start. Grow the pool, lower --context-length, or pass "
        "--allow-pool-smaller-than-context to serve with admission capped at the pool."], r.stderr
