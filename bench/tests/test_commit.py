"""Keeping a result: the table and a summary of its figures with the commit and machine, never the raw JSON."""
import json

from pdserve.bench.report import commit

MD = """# pdserve bench — quick run

Some prose | with a pipe that is no table.

## Latency and throughput

| preset | prompt | system | TTFT p50 ms |
|---|---|---|---|
| tiny | 128 | co-located | 20.4 |
| tiny | 128 | pdserve | 47.6 |

*note* below the table.

## Decode step

| batch | context | step / floor |
|:---|---:|---|
| 16 | 1024 | 2.5× |
"""


def test_tables_are_read_with_their_section_and_every_cell():
    found = commit.tables(MD)
    assert found == [
        {"section": "Latency and throughput", "header": ["preset", "prompt", "system", "TTFT p50 ms"],
         "rows": [["tiny", "128", "co-located", "20.4"], ["tiny", "128", "pdserve", "47.6"]]},
        {"section": "Decode step", "header": ["batch", "context", "step / floor"], "rows": [["16", "1024", "2.5×"]]},
    ]


def test_keep_copies_the_table_and_writes_its_summary_but_not_the_raw_json(tmp_path, monkeypatch):
    src, dst = tmp_path / "out", tmp_path / "results"
    src.mkdir()
    (src / "bench-quick.md").write_text(MD)
    (src / "bench-quick.json").write_text(json.dumps({"mode": "quick", "runs": [{"ttft": [0.1] * 1000}],
                                                      "host": {"cpus": 2, "machine": "x86_64"}}))
    monkeypatch.setattr(commit, "git_commit", lambda path=None: "abc123")
    written = commit.keep(str(src), str(dst))
    assert sorted(p.name for p in dst.iterdir()) == ["bench-quick.md", "bench-quick.summary.json"]
    assert sorted(written) == sorted(str(dst / n) for n in ("bench-quick.md", "bench-quick.summary.json"))
    assert (dst / "bench-quick.md").read_text() == MD
    doc = json.loads((dst / "bench-quick.summary.json").read_text())
    assert doc["commit"] == "abc123" and doc["mode"] == "quick" and doc["machine"]["cpus"] == 2
    assert doc["commit_from"].startswith("HEAD")
    assert doc["tables"][0]["rows"][1] == ["tiny", "128", "pdserve", "47.6"]
    assert "runs" not in doc


def test_the_commit_the_run_recorded_wins_over_head_and_its_own_summary_is_kept(tmp_path, monkeypatch):
    src, dst = tmp_path / "out", tmp_path / "results"
    src.mkdir()
    (src / "versus-quick.md").write_text(MD)
    (src / "versus-quick.json").write_text(json.dumps({"mode": "quick", "commit": "f00d", "cells": [1] * 100}))
    (src / "versus-quick-summary.json").write_text(json.dumps({"commit": "f00d", "machine": {"cpus": 2, "cpu": "X"},
                                                               "cells": [{"ratio": 1.1}]}))
    monkeypatch.setattr(commit, "git_commit", lambda path=None: "abc123")
    commit.keep(str(src), str(dst))
    assert sorted(p.name for p in dst.iterdir()) == ["versus-quick.md", "versus-quick.summary.json"]
    doc = json.loads((dst / "versus-quick.summary.json").read_text())
    assert (doc["commit"], doc["commit_from"]) == ("f00d", "the run's JSON")
    assert doc["figures"]["cells"] == [{"ratio": 1.1}] and doc["machine"]["cpu"] == "X"


def test_a_table_less_report_is_refused(tmp_path):
    (tmp_path / "x.md").write_text("# nothing measured\n")
    try:
        commit.summary(str(tmp_path / "x.md"), "abc", {})
    except ValueError as e:
        assert "no Markdown table" in str(e)
    else:
        raise AssertionError("a report without tables was summarized")


def test_the_commit_is_heads_and_says_when_the_tree_differs():
    sha = commit.git_commit()  # the harness's, as report.commit imports it
    assert len(sha.split("-")[0]) == 40 and int(sha.split("-")[0], 16) >= 0
