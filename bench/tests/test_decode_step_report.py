"""Reading decode_step's JSON rows and judging the batch 16 × context 1024 row against 2× its floor."""
import json

import pytest

from pdserve.bench.report.targets import decode_step_targets
from pdserve.bench.scenarios.decode_step import read_rows


def _row(batch, context, step_ms, floor_ms):
    return {"batch": batch, "context": context, "step_ms": step_ms, "floor_ms": floor_ms, "ratio": step_ms / floor_ms}


def test_read_rows_takes_a_list_or_rows_and_refuses_missing_keys(tmp_path):
    rows = [_row(1, 128, 2.0, 1.0), _row(16, 1024, 9.0, 4.0)]
    for doc in (rows, {"rows": rows, "bandwidth_gb_s": 12.5}):
        (tmp_path / "a.json").write_text(json.dumps(doc))
        assert read_rows(str(tmp_path / "a.json")) == rows
    for bad in ([], {"table": "x"}, [{"batch": 16, "context": 1024, "step_ms": 9.0}]):
        (tmp_path / "b.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            read_rows(str(tmp_path / "b.json"))


def test_decode_step_target_verdicts():
    def verdict(ds):
        [row] = decode_step_targets({"decode_step": ds})
        return row[1], row[2]

    assert verdict({"rows": [_row(16, 1024, 7.9, 4.0)]}) == ("1.98× (7.90 ms vs floor 4.00 ms)", "**met**")
    assert verdict({"rows": [_row(16, 1024, 8.4, 4.0), _row(1, 1024, 1.0, 1.0)]})[1] == "**missed**"
    measured, v = verdict({"rows": [_row(16, 512, 1.0, 1.0)]})
    assert "no batch 16 × context 1024 row" in measured and v == "not measured"
    assert verdict({"absent": "bench/scenarios/decode_step.py is not in this tree"})[1] == "not measured"
    assert verdict({})[1] == "not measured"
