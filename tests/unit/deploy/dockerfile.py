"""Reads Dockerfiles, shell lines and `make -n` output into the commands they run, for tests/unit/deploy."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

# a command that installs software; every one must be a call of deploy/install.sh instead
INSTALLERS = {"apt-get", "apt", "dpkg", "pip", "pip3", "conda", "mamba", "uv", "poetry", "easy_install", "apk",
              "yum", "dnf", "microdnf", "curl", "wget"}
INSTALL_SCRIPT = "deploy/install.sh"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(ARGs before the first FROM, stages), continuation lines joined and comments dropped."""
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        kw, _, args = line.partition(" ")
        kw, args = kw.upper(), args.strip()
        if kw == "FROM":
            parts = args.split()
            stages.append(Stage(parts[0], parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else ""))
        elif not stages:
            if kw == "ARG":
                k, _, v = args.partition("=")
                global_args[k] = v
        else:
            stages[-1].instructions.append((kw, args))
    return global_args, stages


def simple_commands(shell: str) -> list[list[str]]:
    """Each simple command of a shell line as words, leading VAR=value assignments dropped."""
    out = []
    for part in re.split(r"&&|\|\||;|\|", shell):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def exec_form(args: str) -> list[str] | None:
    return json.loads(args) if args.startswith("[") else None


def installs(words: list[str]) -> bool:
    """Whether a command installs software by itself (rather than through deploy/install.sh)."""
    prog = words[0].rsplit("/", 1)[-1]
    if prog in INSTALLERS:
        return True
    # python -m pip / python -m venv / python -m ensurepip
    return prog.startswith("python") and "-m" in words and words[words.index("-m") + 1:][:1] in (
        ["pip"], ["venv"], ["ensurepip"])


def script_call(words: list[str]) -> list[str] | None:
    """The arguments of a deploy/install.sh call (the sub-command first), else None."""
    for i, w in enumerate(words):
        if w.endswith(INSTALL_SCRIPT):
            return words[i + 1:]
        if i == 0 and w not in ("bash", "sh", "env", "sudo"):
            return None
    return None
