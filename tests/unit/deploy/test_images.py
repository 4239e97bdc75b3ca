"""The images install exactly what `make setup` installs: every install step of both Dockerfiles and of the
Makefile is a call of deploy/install.sh (issue 10: one source of truth); the images run as non-root, carry no
model, and are tagged with pyproject's version, as the manifests reference them."""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from .dockerfile import exec_form, installs, parse_dockerfile, script_call, simple_commands

ROOT = Path(__file__).resolve().parents[3]
VARIANTS = ("cpu", "cuda")
STEPS = {"apt", "python", "stubs"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def version() -> str:
    return pyproject()["project"]["version"]


def torch_pin() -> str:
    pins = [d for d in pyproject()["project"]["dependencies"] if re.match(r"torch\s*==", d)]
    assert len(pins) == 1, pins
    return pins[0].replace(" ", "")


def dockerfile_problems(text: str) -> list[str]:
    """Every way the Dockerfile breaks the rules above; empty when it keeps them."""
    problems = []
    _, stages = parse_dockerfile(text)
    steps = set()
    for stage in stages:
        for run in stage.all("RUN"):
            for words in simple_commands(run):
                call = script_call(words)
                if call is not None:
                    steps.add(call[0] if call else "")
                elif installs(words):
                    problems.append(f"installs outside deploy/install.sh: {' '.join(words)}")
        for src in stage.all("COPY") + stage.all("ADD"):
            if re.search(r"(^|[\s/\"])models?\b|\.safetensors|\.gguf|\.bin\b", src) and "--from=" not in src:
                problems.append(f"copies a model: {src}")
            if re.match(r"^(--\S+\s+)*\.\s", src):
                problems.append(f"copies the whole context (models/ may be in it): {src}")
    if steps != STEPS:
        problems.append(f"install.sh steps {sorted(steps)}, want {sorted(STEPS)}")
    final = stages[-1]
    users = final.all("USER")
    uid = users[-1].split(":")[0] if users else "0"
    if uid != "10001":
        problems.append(f"final stage runs as user {uid!r}, want the numeric uid 10001")
    build = [s for s in stages if any(a.startswith("deploy/install.sh stubs") or "install.sh stubs" in a
                                      for a in s.all("RUN"))]
    if not build:
        problems.append("no stage generates the gRPC stubs")
    if exec_form(final.all("ENTRYPOINT")[-1] if final.all("ENTRYPOINT") else "[]") != ["pdserve"]:
        problems.append(f"entrypoint {final.all('ENTRYPOINT')}, want [\"pdserve\"]")
    if len(stages) < 2:
        problems.append(f"{len(stages)} stage(s): the image must be multi-stage")
    for arg_text in (pin for s in stages for kw, pin in s.instructions if kw in ("RUN", "ARG", "ENV")):
        for pin in re.findall(r"torch==[\w.+]+", arg_text):
            if pin != torch_pin():
                problems.append(f"{pin} differs from pyproject's {torch_pin()}")
    return problems


def base_images(text: str) -> list[str]:
    args, stages = parse_dockerfile(text)
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), s.base) for s in stages]


@pytest.mark.parametrize("variant", VARIANTS)
def test_dockerfile_installs_only_through_the_script(variant):
    text = (ROOT / "deploy/docker" / f"Dockerfile.{variant}").read_text()
    assert dockerfile_problems(text) == []
    for image in base_images(text):
        # a pinned patch release of Python 3.11 on Debian bookworm, never a floating tag
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", image), image


def make_dry_run(*targets: str, **variables: str) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(["make", "-n", "-B", *targets, *(f"{k}={v}" for k, v in variables.items())], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [w for line in out.stdout.splitlines() for w in simple_commands(line)]


def makefile_problems(commands: list[list[str]]) -> list[str]:
    problems, steps = [], set()
    for words in commands:
        call = script_call(words)
        if call is not None:
            steps.add(call[0] if call else "")
        elif installs(words):
            problems.append(f"installs outside deploy/install.sh: {' '.join(words)}")
    if steps != STEPS:
        problems.append(f"install.sh steps {sorted(steps)}, want {sorted(STEPS)}")
    return problems


def test_make_setup_installs_only_through_the_same_script(tmp_path):
    # -B with a venv and model that do not exist: every step a fresh machine runs is printed
    commands = make_dry_run("setup", "formal", VENV=str(tmp_path / "venv"), MODEL=str(tmp_path / "model"))
    assert makefile_problems(commands) == []


def test_one_torch_pin():
    out = subprocess.run([str(ROOT / "deploy/install.sh"), "pins"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [torch_pin()]
    for path in [ROOT / "Makefile", *(ROOT / "deploy/docker").glob("Dockerfile.*")]:
        assert set(re.findall(r"torch==[\w.+]+", path.read_text())) <= {torch_pin()}, path


def dockerignore_problems(text: str) -> list[str]:
    rules = [r.strip() for r in text.splitlines() if r.strip() and not r.startswith("#")]
    problems = [] if rules[:1] == ["*"] else ["the context is not an allow-list (first rule is not '*')"]
    problems += [f"re-admits {r}" for r in rules if r.startswith("!") and re.search(r"models?|\.venv|gen\b", r)]
    return problems


def test_build_context_holds_no_model_or_venv():
    assert dockerignore_problems((ROOT / ".dockerignore").read_text()) == []


def kustomize_image_problems(root: Path, want_version: str) -> list[str]:
    problems = []
    for kfile in sorted(root.rglob("kustomization.yaml")):
        for image in (yaml.safe_load(kfile.read_text()) or {}).get("images") or []:
            if "pdserve" not in (image.get("newName") or image.get("name", "")):
                continue
            tag = str(image.get("newTag", ""))
            if tag not in {f"{want_version}-{v}" for v in VARIANTS}:
                problems.append(f"{kfile.relative_to(root)}: {image.get('name')} tag {tag!r}, want "
                                f"{want_version}-cpu or {want_version}-cuda")
    return problems


def test_manifest_image_tags_follow_pyproject():
    assert kustomize_image_problems(ROOT / "deploy/k8s", version()) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_make_image_builds_the_versioned_tag(tmp_path, variant):
    # a stand-in engine that records its arguments: no daemon runs here (issue 10)
    log = tmp_path / "calls"
    engine = tmp_path / "engine"
    engine.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    engine.chmod(0o755)
    out = subprocess.run(["make", "image", f"VARIANT={variant}", f"CONTAINER_ENGINE={engine}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert log.read_text().splitlines() == [
        "info", f"build -f deploy/docker/Dockerfile.{variant} -t pdserve:{version()}-{variant} ."]


def test_make_image_without_a_running_engine_says_so(tmp_path):
    engine = tmp_path / "docker"
    engine.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    engine.chmod(0o755)
    out = subprocess.run(["make", "image", f"CONTAINER_ENGINE={engine}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "no engine answers" in out.stderr and str(engine) in out.stderr
