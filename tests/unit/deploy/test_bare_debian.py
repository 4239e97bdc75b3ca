"""`make run` and `make test` on a bare Debian: everything they need that a minbase system lacks is in
deploy/install.sh's list (issue 11). The needs are resolved at test time from the files make uses: Mooncake's
engine.so's libraries (readelf + ldd + dpkg -S), the compiler and headers formal/check.sh builds pan.c with,
SPIN, Prometheus's binaries; the bare set is vendored (debian-bookworm-minbase.txt, built by bare_debian.py)."""
from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MINBASE = Path(__file__).with_name("debian-bookworm-minbase.txt")


def bare_set() -> set[str]:
    return {line.strip() for line in MINBASE.read_text().splitlines() if line.strip() and not line.startswith("#")}


def install_list(kind: str) -> set[str]:
    out = subprocess.run([str(ROOT / "deploy/install.sh"), "packages", kind], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@functools.cache
def owner(path: str) -> str:
    """The Debian package that installed path (`dpkg -S`, architecture qualifier dropped)."""
    out = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:  # /lib is a link to /usr/lib on a merged-/usr system; dpkg knows one of the two
        alt = path[4:] if path.startswith("/usr/") else "/usr" + path
        out = subprocess.run(["dpkg", "-S", alt], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"no Debian package owns {path}: {out.stderr.strip()}"
    return out.stdout.split(":")[0].strip()


@functools.cache
def mooncake_needs() -> dict[str, str]:
    """{library: package} for every library engine.so links that its wheel does not bundle."""
    engine = importlib.util.find_spec("mooncake.engine").origin
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", subprocess.run(["readelf", "-d", engine], capture_output=True,
                                                                text=True, check=True).stdout)
    resolved = dict(re.findall(r"^\s*(\S+) => (/\S+)", subprocess.run(["ldd", engine], capture_output=True,
                                                                      text=True, check=True).stdout, re.M))
    site = str(Path(engine).parents[1])
    needs = {}
    for lib in needed:
        path = resolved.get(lib)
        if lib.startswith("ld-linux"):
            continue  # the loader itself (libc6)
        assert path, f"engine.so needs {lib} and ldd finds none: {resolved}"
        if not path.startswith(site):
            needs[lib] = owner(path)
    return needs


def make_needs() -> dict[str, str]:
    """{what: package} for everything `make run` / `make test` takes from Debian."""
    check_sh = (ROOT / "formal/check.sh").read_text()
    assert "cc=${CC:-gcc}" in check_sh and "pan.c" in check_sh  # the compiler the formal check uses
    assert "python3 -m venv" in (ROOT / "deploy/install.sh").read_text()  # the venv install.sh makes
    needs = {
        # Debian's python3 lacks ensurepip, which `python3 -m venv` runs: it is python3-venv
        "python3": "python3", "python3 -m venv": "python3-venv",
        "gcc": owner("/usr/bin/gcc"), "<stdio.h> for pan.c": owner("/usr/include/stdio.h"),
        "spin": owner("/usr/bin/spin"), "promtool": owner("/usr/bin/promtool"),
        "prometheus": owner("/usr/bin/prometheus"),
    }
    return {**needs, **{f"Mooncake's {lib}": pkg for lib, pkg in mooncake_needs().items()}}


def test_the_bare_set_is_a_bare_system():
    bare = bare_set()
    assert {"dpkg", "apt", "bash", "coreutils", "libc6", "libstdc++6"} <= bare
    # what a bare system lacks and pdserve needs: if the vendored set had any of these it would prove nothing
    assert not bare & {"python3", "python3-venv", "gcc", "libc6-dev", "libcurl4", "libibverbs1", "spin"}


def test_mooncake_links_what_install_sh_knows_of():
    needs = mooncake_needs()
    assert {"libibverbs.so.1", "libnuma.so.1", "libcurl.so.4"} <= set(needs), needs  # the check resolves real libraries


def test_everything_make_needs_is_bare_or_installed():
    listed, bare = install_list("dev"), bare_set()
    missing = {what: pkg for what, pkg in make_needs().items() if pkg not in bare | listed}
    assert missing == {}, f"install.sh apt dev does not install {sorted(set(missing.values()))}: {missing}"


def test_runtime_list_covers_mooncake():
    listed, bare = install_list("runtime"), bare_set()
    assert {lib: pkg for lib, pkg in mooncake_needs().items() if pkg not in bare | listed} == {}
    assert listed <= install_list("dev")


def test_unknown_list_is_refused():
    out = subprocess.run([str(ROOT / "deploy/install.sh"), "apt", "everything"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "runtime, dev or build, got 'everything'" in out.stderr


def test_the_venv_is_made_after_the_debian_packages(tmp_path):
    # asked for the venv alone, make still installs the Debian packages (python3-venv) first
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    apt = [i for i, x in enumerate(lines) if "install.sh apt dev" in x]
    python = [i for i, x in enumerate(lines) if "install.sh python" in x]
    assert apt and python and apt[0] < python[0], lines
