"""Builds tests/unit/deploy/debian-bookworm-minbase.txt, the package set of a bare Debian bookworm (what
`debootstrap --variant=minbase` installs: every `Priority: required` package of the archive, closed under
Depends and Pre-Depends, the first alternative that is a real package taken, as debootstrap does, and a
virtual one resolved to a required provider where there is one). Run by hand
when the target release changes, from apt's own index (`apt-get update` first):

    /usr/lib/apt/apt-helper cat-file /var/lib/apt/lists/*_debian_dists_bookworm_main_binary-amd64_Packages.lz4 \
        | python tests/unit/deploy/bare_debian.py "$(grep -m1 ^Date: /var/lib/apt/lists/*_bookworm_InRelease)" \
        > tests/unit/deploy/debian-bookworm-minbase.txt
"""
from __future__ import annotations

import re
import sys


def stanzas(text: str) -> list[dict[str, str]]:
    out = []
    for block in text.split("\n\n"):
        fields, key = {}, None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" in fields:
            out.append(fields)
    return out


def minbase(text: str) -> set[str]:
    packages = {s["Package"]: s for s in stanzas(text)}
    providers: dict[str, str] = {}  # a virtual package's provider, a required one first (mawk gives awk)
    for name, s in sorted(packages.items(), key=lambda kv: (kv[1].get("Priority") != "required", kv[0])):
        for virtual in re.split(r"\s*,\s*", s.get("Provides", "")):
            providers.setdefault(virtual.split(" ")[0], name)
    todo = [n for n, s in packages.items() if s.get("Priority") == "required"]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        deps = ", ".join(packages[name].get(f, "") for f in ("Pre-Depends", "Depends"))
        for group in filter(None, (g.strip() for g in deps.split(","))):
            alts = [re.split(r"[\s(:]", a.strip())[0] for a in group.split("|")]
            real = [a for a in alts if a in packages]
            todo.append(real[0] if real else providers[alts[0]])
    return seen


if __name__ == "__main__":
    names = sorted(minbase(sys.stdin.read()))
    print("# Debian bookworm (amd64) minbase: every Priority: required package of the archive, closed under")
    print("# Depends and Pre-Depends (tests/unit/deploy/bare_debian.py says how it was built); one per line")
    print(f"# from apt's bookworm main amd64 index, Release {' '.join(sys.argv[1:]) or 'date not given'}")
    print("\n".join(names))
