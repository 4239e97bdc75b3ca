"""Keeping a run's result in git (`make bench-commit`): the table and its summary, never the raw JSON.

A run writes bench/out/NAME.md (the tables) and bench/out/NAME.json (every request's figures, up to 13k
lines). What bench/results/ keeps per run is NAME.md as written and NAME.summary.json: every Markdown table of
NAME.md as {section, header, rows}, with the commit the run measured and the machine it ran on, so a later
run can be compared figure by figure without the raw file. Also runnable as
`python -m pdserve.bench.report.commit [--from DIR] [--to DIR]`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys

from ..harness.common import COMMITTED, RESULTS, ROOT, git_commit, machine

SUFFIX = ".summary.json"


def tables(markdown: str) -> list[dict]:
    """Every pipe table of a Markdown text, under the nearest heading above it: {section, header, rows}."""
    out, section, lines = [], "", markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif _is_row(line) and i + 1 < len(lines) and _is_rule(lines[i + 1].strip()):
            header, rows, i = _cells(line), [], i + 2
            while i < len(lines) and _is_row(lines[i].strip()):
                rows.append(_cells(lines[i].strip()))
                i += 1
            out.append({"section": section, "header": header, "rows": rows})
            continue
        i += 1
    return out


def _is_row(line: str) -> bool:
    return line.startswith("|") and line.endswith("|") and len(line) > 1


def _is_rule(line: str) -> bool:
    return _is_row(line) and set(line.replace("|", "").replace(" ", "")) <= set("-:") and "-" in line


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def summary(md_path: str, commit: str, host: dict, raw: dict | None = None) -> dict:
    with open(md_path) as f:
        text = f.read()
    found = tables(text)
    if not found:
        raise ValueError(f"{md_path}: no Markdown table in it: nothing to summarize")
    doc = {"name": os.path.basename(md_path)[:-3], "commit": commit, "machine": host,
           "written": datetime.datetime.now().isoformat(timespec="seconds"), "tables": found}
    for key in ("mode", "started", "elapsed_s", "errors"):  # the run's own facts, where its raw JSON has them
        if isinstance(raw, dict) and key in raw:
            doc[key] = raw[key]
    return doc


def keep(src: str = RESULTS, dst: str = COMMITTED) -> list[str]:
    """Copy each NAME.md of src to dst and write NAME.summary.json beside it; returns the paths written.

    The commit is the one the run recorded in its JSON (or in its own NAME-summary.json, which is kept inside
    the summary as "figures"); a run that recorded none is taken to have measured HEAD, and says so."""
    names = sorted(n[:-3] for n in os.listdir(src) if n.endswith(".md")) if os.path.isdir(src) else []
    if not names:
        raise SystemExit(f"make bench-commit: no results in {os.path.relpath(src, ROOT)}/: "
                         f"run make bench-quick or make bench first")
    head, host, written = git_commit(), machine(), []
    os.makedirs(dst, exist_ok=True)
    for name in names:
        raw, own = _load(os.path.join(src, name + ".json")), _load(os.path.join(src, name + "-summary.json"))
        recorded = next((d["commit"] for d in (raw, own) if isinstance(d, dict) and d.get("commit")), None)
        ran_on = next((d[k] for d in (raw, own) for k in ("host", "machine") if isinstance(d, dict)
                       and isinstance(d.get(k), dict)), {})
        doc = summary(os.path.join(src, name + ".md"), recorded or head, {**host, **ran_on}, raw)
        doc["commit_from"] = "the run's JSON" if recorded else "HEAD when kept (the run recorded none)"
        if own is not None:
            doc["figures"] = own
        shutil.copyfile(os.path.join(src, name + ".md"), os.path.join(dst, name + ".md"))
        write_summary(os.path.join(dst, name + SUFFIX), doc)
        written += [os.path.join(dst, name + ".md"), os.path.join(dst, name + SUFFIX)]
    return written


def write_summary(path: str, doc: dict) -> None:
    """JSON with one table row a line, so a diff of two kept runs reads row by row."""
    def value(k, v):
        if k != "tables":
            return json.dumps(v, ensure_ascii=False)
        return "[\n" + ",\n".join(
            "  {" + f'"section": {json.dumps(t["section"], ensure_ascii=False)}, '
            f'"header": {json.dumps(t["header"], ensure_ascii=False)}, "rows": [\n'
            + ",\n".join("   " + json.dumps(r, ensure_ascii=False) for r in t["rows"]) + "]}" for t in v) + "]"
    body = ",\n".join(f" {json.dumps(k)}: {value(k, v)}" for k, v in doc.items())
    with open(path, "w") as f:
        f.write("{\n" + body + "\n}\n")
    with open(path) as f:
        if json.load(f) != doc:  # the hand layout must say exactly what the document does
            raise AssertionError(f"{path}: written summary does not read back as the document")


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.report.commit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", default=RESULTS, help="where the run wrote (default bench/out)")
    ap.add_argument("--to", dest="dst", default=COMMITTED, help="where the kept results go (default bench/results)")
    args = ap.parse_args(argv)
    for p in keep(args.src, args.dst):
        print(f"kept {os.path.relpath(p, ROOT)}")
    print(f"now: git add {os.path.relpath(args.dst, ROOT)} && git commit -m '<what ran, on what>'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
