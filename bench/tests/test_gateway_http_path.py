"""bench/scenarios/http_path.py runs end to end: every request streams its tokens through the real HTTP front."""
from pdserve.bench.scenarios import http_path


def test_a_short_run_reports_ttft_and_no_errors(capsys):
    http_path.main(["--requests", "5", "--max-tokens", "4", "--prompt", "8"])
    out = capsys.readouterr().out
    assert "ttft_p50_ms=" in out and "server_cpu_ms_per_req=" in out and "errors=0 " in out, out
