"""PromQL that the deploy files carry (dashboard panels, autoscaling triggers): every query must parse (promtool) and
name only metrics the services export."""
from __future__ import annotations

import os
import re
import subprocess

import yaml

from tests.conftest import ROOT


def exported_metrics() -> set[str]:
    names = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "services")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    names |= set(re.findall(r'"(pdserve_[a-z_]+)"', f.read()))
    return names


def check_queries(queries: list[tuple[str, str]], tmp_path) -> None:
    """queries: (where, expr). Fails naming the place of an unknown metric, or with promtool's own words."""
    known = exported_metrics() | {"up"}
    rules = []
    for i, (where, expr) in enumerate(queries):
        for m in re.findall(r"\b(pdserve_[a-z_]+?)(?:_bucket|_sum|_count)?\b(?=\{)", expr):
            assert m in known, f"{where}: {m} is not exported by services/"
        rules.append({"record": f"query:q{i}", "expr": expr})
    (tmp_path / "q.yml").write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(tmp_path / "q.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
