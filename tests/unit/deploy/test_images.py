"""The images install exactly what `make setup` installs: every install step of both Dockerfiles and of the
Makefile is a call of deploy/install.sh (issue 10: one source of truth); the images run as non-root, carry no
model, and are tagged with pyproject's version, as the manifests reference them. Each image installs its own
variant (issue 21): what its install.sh call would hand pip, read by running that call with a stand-in pip, holds
the CUDA Mooncake build and the CUDA runtime it links in the CUDA image and the non-CUDA build in the CPU one."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

from .dockerfile import exec_form, installs, parse_dockerfile, script_call, simple_commands

ROOT = Path(__file__).resolve().parents[3]
VARIANTS = ("cpu", "cuda")
STEPS = {"apt", "python", "stubs", "native", "verify"}
# what each image's pip set must and must not hold (distribution names, as pyproject's extras spell them)
MOONCAKE = {"cpu": "mooncake-transfer-engine-non-cuda", "cuda": "mooncake-transfer-engine"}
CUDA_ONLY = {"nvidia-cuda-runtime-cu12"}


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


def install_calls(text: str) -> list[list[str]]:
    """Every deploy/install.sh call of a Dockerfile, sub-command first, in order."""
    _, stages = parse_dockerfile(text)
    return [call for stage in stages for run in stage.all("RUN") for words in simple_commands(run)
            if (call := script_call(words))]


def requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def pip_set(call: list[str], tmp_path: Path) -> dict[str, str]:
    """{name: requirement} that `deploy/install.sh python VENV VARIANT [EXTRAS]` hands pip: the call is run for real,
    in a venv whose pip only records its arguments; `-e .[EXTRAS]` stands for pyproject's dependencies and extras."""
    here = Path(tempfile.mkdtemp(dir=tmp_path))
    venv, log = here / "venv", here / "pip.log"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pip"):  # an existing bin/python: install.sh makes no venv
        (venv / "bin" / tool).write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
        (venv / "bin" / tool).chmod(0o755)
    out = subprocess.run([str(ROOT / "deploy/install.sh"), "python", str(venv), *call[2:]], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    project = pyproject()["project"]
    reqs = []
    for line in log.read_text().splitlines():
        words = [w for w in line.split()[1:] if not w.startswith("-") or w == "-e"]
        for i, w in enumerate(words):
            if w == "-e":
                continue
            if i and words[i - 1] == "-e":
                m = re.fullmatch(r"\.(?:\[(.*)\])?", w)
                assert m, f"install.sh installs {w!r} editable, not this checkout"
                reqs += project["dependencies"]
                for extra in filter(None, (m.group(1) or "").split(",")):
                    reqs += project["optional-dependencies"][extra]
            elif w != "pip":
                reqs.append(w)
    return {requirement_name(r): r for r in reqs}


def variant_problems(variant: str, text: str, tmp_path: Path) -> list[str]:
    """Every way the image of this variant would install, check or link for the other one; empty when none."""
    calls = install_calls(text)
    python = [c for c in calls if c[0] == "python"]
    if len(python) != 1:
        return [f"{len(python)} install.sh python calls, want 1"]
    problems = []
    got = pip_set(python[0], tmp_path)
    other = "cpu" if variant == "cuda" else "cuda"
    want = {MOONCAKE[variant]} | (CUDA_ONLY if variant == "cuda" else set())
    unwanted = {MOONCAKE[other]} | (CUDA_ONLY if variant == "cpu" else set())
    problems += [f"the {variant} image's pip set lacks {n}" for n in sorted(want - set(got))]
    problems += [f"the {variant} image's pip set holds {got[n]}" for n in sorted(unwanted & set(got))]
    for sub in ("apt", "verify"):
        named = [c for c in calls if c[0] == sub and (sub == "verify" or c[1] == "runtime")]
        variants = [c[2] if len(c) > 2 else "cpu" for c in named]  # apt's list defaults to cpu
        if variants != [variant]:
            problems.append(f"install.sh {sub}{' runtime' if sub == 'apt' else ''} for {variants}, want [{variant!r}]")
    # torch: the CPU index (a CPU build) in the CPU image, PyPI's CUDA build in the CUDA one
    args, stages = parse_dockerfile(text)
    index = {a.partition("=")[2] for st in stages for a in st.all("ARG") if a.startswith("TORCH_INDEX")}
    if (variant == "cpu") != (index == {"https://download.pytorch.org/whl/cpu"}):
        problems.append(f"torch from index {sorted(index)} in the {variant} image")
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_image_installs_its_own_variant(variant, tmp_path):
    text = (ROOT / "deploy/docker" / f"Dockerfile.{variant}").read_text()
    assert variant_problems(variant, text, tmp_path) == []
    got = pip_set(next(c for c in install_calls(text) if c[0] == "python"), tmp_path)
    pins = {requirement_name(r): r for r in pyproject()["project"]["optional-dependencies"][variant]}
    assert {n: got[n] for n in pins} == pins  # the extra's own pins, not some other version
    assert got["torch"] == torch_pin()


def test_the_cuda_image_of_before_is_refused_for_its_non_cuda_mooncake(tmp_path):
    # issue 21: the CUDA image ran `install.sh python ... cpu`, the non-CUDA Mooncake and no CUDA runtime
    text = (ROOT / "deploy/docker/Dockerfile.cuda").read_text()
    before = text.replace("/opt/pdserve/venv cuda\n", "/opt/pdserve/venv cpu\n", 1)
    assert before != text
    problems = variant_problems("cuda", before, tmp_path)
    assert "the cuda image's pip set lacks mooncake-transfer-engine" in problems
    assert "the cuda image's pip set lacks nvidia-cuda-runtime-cu12" in problems
    assert "the cuda image's pip set holds mooncake-transfer-engine-non-cuda==0.3.13.post1" in problems


def test_the_cpu_image_would_be_refused_with_the_cuda_build(tmp_path):
    text = (ROOT / "deploy/docker/Dockerfile.cpu").read_text()
    mutant = text.replace("/opt/pdserve/venv cpu\n", "/opt/pdserve/venv cuda\n", 1)
    assert mutant != text
    assert "the cpu image's pip set holds nvidia-cuda-runtime-cu12==12.9.79" in variant_problems("cpu", mutant, tmp_path)
    mutant = text.replace("install.sh verify /opt/pdserve/venv/bin/python cpu", "install.sh verify "
                          "/opt/pdserve/venv/bin/python cuda")
    assert variant_problems("cpu", mutant, tmp_path) == ["install.sh verify for ['cuda'], want ['cpu']"]


def test_the_apt_lists_add_what_mooncake_s_cuda_build_links():
    def packages(*args):
        out = subprocess.run([str(ROOT / "deploy/install.sh"), "packages", *args], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()
    # libmlx5.so.1 (ibverbs-providers): engine.so of mooncake-transfer-engine 0.3.13.post1 links it, the non-CUDA
    # build's does not (readelf -d of both wheels); `install.sh verify` proves it where the CUDA build is installed
    for kind in ("runtime", "dev"):
        assert packages(kind, "cuda") == packages(kind) + ["ibverbs-providers"] and packages(kind) == packages(kind, "cpu")
    assert packages("build", "cuda") == packages("build")


def test_the_native_kernel_is_left_loadable_by_the_image_s_user(tmp_path):
    # the images build it as root and serve as uid 10001; the build writes it 0600 (a temporary file renamed)
    name = f".stand-in-{os.getpid()}.so"
    built = ROOT / "services/engine/_native" / name
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nmkdir -p {built.parent} && touch {built} && chmod 600 {built}\n")
    python.chmod(0o755)
    try:
        out = subprocess.run([str(ROOT / "deploy/install.sh"), "native", str(python)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert built.stat().st_mode & 0o777 == 0o644
    finally:
        built.unlink(missing_ok=True)
