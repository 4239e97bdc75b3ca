"""The gateway's keys Secret as an operator makes it: a keys file of random keys, one `TENANT: KEY` a line, turned into
a Secret by the `kubectl create secret` command docs/kubernetes.md shows (run by the real kubectl, client side), so a
guide that names another Secret or key than the manifests mount fails the pods that read it."""
from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess

import yaml

from tests.conftest import ROOT
from tests.deploy.render import kubectl

GUIDE = os.path.join(ROOT, "docs", "kubernetes.md")


def guide_command() -> list[str]:
    """The guide's first `kubectl ... create secret generic` line, as words."""
    with open(GUIDE) as f:
        found = re.search(r"^\s*kubectl .*create secret generic .*$", f.read(), re.M)
    assert found, f"{GUIDE} shows no `kubectl create secret generic` for the API keys"
    return shlex.split(found.group(0))


def make_secret(folder: str, tenants: list[str]) -> tuple[dict, dict[str, str]]:
    """(the Secret object, {tenant: key}); the keys file is written to folder/keys, where the guide's command reads
    it (its --from-file=KEY=./keys)."""
    keys = {t: secrets.token_hex(32) for t in tenants}  # `openssl rand -hex 32`, as the guide makes them
    with open(os.path.join(folder, "keys"), "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
        f.write("".join(f"{t}: {k}\n" for t, k in keys.items()))
    words = guide_command()
    out = subprocess.run([kubectl(), *words[1:], "--dry-run=client", "-o", "yaml"], cwd=folder, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(words)} failed ({out.returncode}): {out.stderr}"
    secret = yaml.safe_load(out.stdout)
    assert secret["kind"] == "Secret", secret
    return secret, keys
