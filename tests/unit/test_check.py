"""`pdserve check` (issue 19, point 5): for the flags a service is given, the refusal it would exit with, from the
same functions the service runs at start-up, and the sizes it would run with, without allocating anything."""
import asyncio
import json
import subprocess
import sys

import pytest

from pdserve import check, cli
from pdserve.broker.main import check_bounds
from pdserve.common.capacity import CapacityError, check_pool_capacity
from pdserve.common.proto import broker_pb2
from pdserve.decode.watch import blind_bound_error
from pdserve.prefill.writelease import TimingBoundError, WriteLeases

MIB = 1 << 20


def run(argv: list[str], capsys) -> tuple[int, list[str]]:
    rc = cli.main(["check", *argv])
    return rc, capsys.readouterr().out.splitlines()


def exits_with(lines: list[str], service: str) -> str | None:
    """The refusal check names for one service, or None when it starts."""
    block = lines[lines.index(next(l for l in lines if l.startswith(f"{service}: "))):]
    for line in block[1:]:
        if not line.startswith("  "):
            return None
        if line.startswith("  exits with:"):
            return line.split(":", 1)[1].strip()
    return None


def test_the_incidents_pool_is_refused_naming_both_numbers_as_prefill_refuses(model_dir, capsys):
    rc, lines = run(["--model", model_dir, "--context-length", "1048576", "--prefill-pool-tokens", "681280",
                     "--decode-pool-tokens", "2097152", "--kv-dtype", "bfloat16"], capsys)
    assert rc == 1 and lines[-1] == "check: prefill would refuse to start", lines
    with pytest.raises(CapacityError) as e:  # what the service raises with the same numbers
        check_pool_capacity("prefill", "prefill-0", 681280, 1048576, False)
    assert exits_with(lines, "prefill") == str(e.value)
    assert "681280 tokens" in str(e.value) and "1048576 (367296 short)" in str(e.value)
    assert exits_with(lines, "decode") is None and exits_with(lines, "broker") is None
    assert "  context:       1048576 tokens; pool/context 0.650" in lines
    assert "  KV per token:  2048 bytes (4 layers x 2 x 4 KV heads x 32 x 2 bytes of bfloat16)" in lines


def test_the_decode_pool_short_of_the_context_is_refused(model_dir, capsys):
    rc, lines = run(["--model", model_dir, "--decode-pool-tokens", "2048"], capsys)
    with pytest.raises(CapacityError) as e:
        check_pool_capacity("decode", "decode/any/pool", 2048, 4096, False)
    assert rc == 1 and exits_with(lines, "decode") == str(e.value) and exits_with(lines, "prefill") is None


def test_pools_twice_the_context_start_with_the_default_lock_delay(model_dir, capsys):
    rc, lines = run(["--model", model_dir, "--context-length", "1048576", "--prefill-pool-tokens", "2097152",
                     "--decode-pool-tokens", "2097152", "--kv-dtype", "bfloat16"], capsys)
    assert rc == 0 and lines[-1] == "check: every service would start", lines
    assert "  pool:          2097152 tokens = 131072 pages of 16, 4294967296 bytes" in lines
    # 5 s + 1 ns x 32 MiB + 1 s, not 5 s + 1 ns x 4 GiB + 1 s = 10.295 s > 10 s as the pool's bytes gave
    assert any(l.startswith("  landing bound: 6.034s from a post") and l.endswith("<= broker lock_delay 10.000s")
               for l in lines), lines


def test_a_landing_bound_over_lock_delay_is_refused_as_prefill_refuses_it(model_dir, capsys):
    rc, lines = run(["--lock-delay", "6", "prefill", "--model", model_dir, "--max-write-bytes", str(64 * MIB)], capsys)
    plan = check.prefill_plan(cli.build_parser(["prefill"]).parse_args(
        ["prefill", "--model", model_dir, "--max-write-bytes", str(64 * MIB)]), check.read_model_config(model_dir))

    class Broker:
        def KeepAlive(self, request, timeout=None):
            async def answer():
                return broker_pb2.KeepAliveResponse(lock_delay_ms=6000)
            return answer()

    with pytest.raises(TimingBoundError) as e:  # the service's own start-up check, against a broker of 6 s
        asyncio.run(WriteLeases(Broker(), "prefill/p0/1", plan.max_landing_s,
                                landing_terms=plan.landing_terms).check_bounds())
    assert rc == 1 and exits_with(lines, "prefill") == f"prefill: refusing to start: {e.value}"
    assert "may land up to 6.067s after it was posted" in str(e.value) and "at least 6.068" in str(e.value)
    assert "(67108864 bytes, --max-write-bytes)" in str(e.value)


def test_a_page_over_the_write_unit_is_refused(model_dir, capsys):
    rc, lines = run(["--model", model_dir, "--max-write-bytes", "65535"], capsys)
    assert rc == 1 and exits_with(lines, "prefill") == (
        "prefill: refusing to start: one KV page (16 tokens x 4096 bytes = 65536 bytes) does not fit in "
        "--max-write-bytes 65535: raise it to at least 65536 or lower --page-size")


def test_a_blind_bound_over_half_the_lock_delay_is_refused_as_decode_refuses_it(model_dir, capsys):
    rc, lines = run(["--lock-delay", "5", "decode", "--model", model_dir, "--max-blind", "2.6"], capsys)
    assert rc == 1 and exits_with(lines, "decode") == f"decode refuses to start: {blind_bound_error(2.6, 5000)}"
    assert "--max-blind 2.6s must be > 0 and <= half the broker's lock_delay 5s" in exits_with(lines, "decode")


def test_the_brokers_own_refusal(capsys):
    rc, lines = run(["broker", "--lock-delay", "3"], capsys)
    args = cli.build_parser(["broker"]).parse_args(["broker", "--lock-delay", "3"])
    with pytest.raises(SystemExit) as e:
        check_bounds(args)
    assert rc == 1 and exits_with(lines, "broker") == str(e.value)
    assert "--lock-delay 3.0s is under Mooncake's shortest transfer timeout (5s)" in str(e.value)


def test_an_unsafe_switch_without_its_opt_in_is_refused_first(model_dir, capsys):
    rc, lines = run(["prefill", "--model", model_dir, "--no-transfer-checksum", "--pool-tokens", "16"], capsys)
    assert rc == 1 and exits_with(lines, "prefill").startswith(
        "prefill: refusing to start: --no-transfer-checksum removes the page checksum")
    assert any(l.startswith("  also:          prefill: KV pool holds 16 tokens") for l in lines), lines


def test_a_config_the_engine_cannot_serve_is_refused_as_the_service_prints_it(tmp_path, model_dir, capsys):
    raw = json.load(open(f"{model_dir}/config.json"))
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    rc, lines = run(["--model", str(tmp_path / "config.json")], capsys)  # only a config.json, no weights
    refusal = exits_with(lines, "prefill")
    assert rc == 1 and refusal.startswith(f"pdserve prefill: {tmp_path}/config.json: ") and "yarn" in refusal, lines
    assert exits_with(lines, "decode").startswith(f"pdserve decode: {tmp_path}/config.json: ")


def test_a_stack_flag_before_a_service_name_is_refused(model_dir, capsys):
    rc = cli.main(["check", "--prefill-pool-tokens", "16", "prefill", "--model", model_dir])
    assert rc == 2 and "--prefill-pool-tokens is a stack flag" in capsys.readouterr().err


def test_check_allocates_nothing(model_dir):
    """8 GiB of float32 KV in each pool: the check's own process peaks far under one pool."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a child of a big pytest process would report
    # its parent's peak; VmHWM belongs to the new address space
    code = ("import re, sys; from pdserve import cli; rc = cli.main(sys.argv[1:]); "
            "print('peak_kib', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "check", "--model", model_dir, "--prefill-pool-tokens", "2097152",
                        "--decode-pool-tokens", "2097152"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "8589934592 bytes" in r.stdout, r.stdout + r.stderr
    peak_kib = int(r.stdout.split("peak_kib ")[1])
    assert peak_kib < 1 << 20, peak_kib


def test_a_hugging_face_id_is_checked_from_its_cached_snapshot_down_to_the_tensors_dtype(tmp_path, monkeypatch,
                                                                                            capsys):
    # issue 21: --model as a hub id; a config.json without torch_dtype sends `auto` to the tensors' own dtype, so
    # the id must reach the weight files too, not only config.json
    from pdserve.engine.make_model import make_model
    snap = tmp_path / "hub" / "models--acme--tiny-bf16" / "snapshots" / "abc123"
    make_model(str(snap), "tiny", 0, dtype="bfloat16")
    config = json.loads((snap / "config.json").read_text())
    config.pop("torch_dtype", None), config.pop("dtype", None)
    (snap / "config.json").write_text(json.dumps(config))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    by_id = run(["prefill", "--model", "acme/tiny-bf16", "--pool-tokens", "8192"], capsys)
    by_path = run(["prefill", "--model", str(snap), "--pool-tokens", "8192"], capsys)
    assert by_id == by_path and by_id[0] == 0
    assert "  KV per token:  2048 bytes (4 layers x 2 x 4 KV heads x 32 x 2 bytes of bfloat16)" in by_id[1]
    rc, lines = run(["decode", "--model", "acme/absent"], capsys)
    assert rc == 1 and exits_with(lines, "decode").startswith("pdserve decode: --model acme/absent: no local directory")
    assert f"the Hugging Face hub cache {tmp_path / 'hub'} (HF_HUB_CACHE, else HF_HOME/hub) has no models--acme--absent/" \
        in exits_with(lines, "decode")
