"""Which Mooncake build is installed and whether it can load (issue 21, point 1): `install.sh verify` refuses the
wrong build for a variant and names every library engine.so links that the loader does not find, but the CUDA
driver, which a GPU node supplies; the CUDA runtime the CUDA build links is loaded from its wheel by path first,
which satisfies engine.so's NEEDED entry by soname (shown here on two small libraries built for the test)."""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from pdserve.kvtransfer import builds

ROOT = Path(__file__).resolve().parents[3]


def test_the_non_cuda_build_here_loads_and_is_not_the_cuda_one(capsys):
    assert builds.installed() == {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
    assert builds.problems("cpu") == []
    assert builds.problems("cuda") == ["the cuda variant needs mooncake-transfer-engine alone (pyproject's `cuda` "
                                       "extra); installed: mooncake-transfer-engine-non-cuda 0.3.13.post1"]
    assert builds.main(["cpu"]) == 0
    assert capsys.readouterr().out == ("verify cpu: mooncake-transfer-engine-non-cuda 0.3.13.post1; every library "
                                       "engine.so links resolves\n")
    assert builds.load_cuda_runtime() is None  # nothing to load for the non-CUDA build


@pytest.mark.parametrize("variant, rc", [("cpu", 0), ("cuda", 1), ("auto", 0)])
def test_install_sh_verify_runs_it_for_the_variant(variant, rc):
    out = subprocess.run([str(ROOT / "deploy/install.sh"), "verify", str(ROOT / ".venv/bin/python"), variant],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == rc, out.stderr
    if rc:
        assert "verify cuda: the cuda variant needs mooncake-transfer-engine alone" in out.stderr
        assert "verify cuda: torch 2.13.0+cpu is a CPU build" in out.stderr


def _cuda_build(monkeypatch, tmp_path, missing: list[str], runtime: bool = True):
    cudart = tmp_path / "libcudart.so.12"
    if runtime:
        cudart.write_bytes(b"")
    monkeypatch.setattr(builds, "installed", lambda: {"mooncake-transfer-engine": "0.3.13.post1"})
    monkeypatch.setattr(builds, "engine_library", lambda dist: "/venv/mooncake/engine.so")
    monkeypatch.setattr(builds, "cuda_runtime_path", lambda: str(cudart))
    seen = []
    monkeypatch.setattr(builds, "unresolved", lambda lib, preload=None: seen.append(preload) or missing)
    return seen, str(cudart)


def test_the_cuda_build_may_lack_only_the_driver_and_is_checked_with_its_runtime_loaded(monkeypatch, tmp_path):
    seen, cudart = _cuda_build(monkeypatch, tmp_path, ["libcuda.so.1"])
    assert builds.problems("cuda") == [] and seen == [cudart]
    _cuda_build(monkeypatch, tmp_path, ["libcuda.so.1", "libmlx5.so.1", "libcudart.so.12"])
    assert builds.problems("cuda") == ["/venv/mooncake/engine.so links 2 libraries the loader does not find: "
                                       "libmlx5.so.1 (Debian's ibverbs-providers), libcudart.so.12 (the "
                                       "nvidia-cuda-runtime-cu12 wheel)"]
    assert builds.problems("cpu")[0].startswith("the cpu variant needs mooncake-transfer-engine-non-cuda alone")


def test_the_cuda_build_without_its_runtime_wheel_is_refused(monkeypatch, tmp_path):
    _cuda_build(monkeypatch, tmp_path, [], runtime=False)
    assert builds.problems("cuda") == [f"Mooncake's CUDA build links libcudart.so.12 and nvidia-cuda-runtime-cu12 "
                                       f"is not installed (pyproject's `cuda` extra pins it): no "
                                       f"{tmp_path / 'libcudart.so.12'}"]


def test_ldd_s_missing_libraries_are_read_off_its_output():
    text = ("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibcudart.so.12 => /v/nvidia/cuda_runtime/lib/libcudart.so.12 (0x7f)\n"
            "\tlibcuda.so.1 => not found\n\tlibmlx5.so.1 => not found\n\tlibc.so.6 => /lib/libc.so.6 (0x7f)\n")
    assert builds.parse_ldd(text) == ["libcuda.so.1", "libmlx5.so.1"]


def _cc(tmp_path, name: str, source: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True, timeout=60)
    return out


def test_both_builds_at_once_are_refused(monkeypatch):
    both = {"mooncake-transfer-engine": "0.3.13.post1", "mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
    monkeypatch.setattr(builds, "installed", lambda: both)
    for variant in ("cpu", "cuda"):  # one import package: whichever installed last would be the one imported
        assert builds.problems(variant) == [f"the {variant} variant needs {builds.BUILDS[variant]} alone (pyproject's "
                                            f"`{variant}` extra); installed: mooncake-transfer-engine 0.3.13.post1, "
                                            "mooncake-transfer-engine-non-cuda 0.3.13.post1"]


def test_a_library_loaded_by_path_first_satisfies_a_needed_entry_by_soname(tmp_path, monkeypatch):
    # as libcudart.so.12 in its wheel's folder, which is on no loader path, and engine.so that links it
    (tmp_path / "wheel").mkdir()
    runtime = _cc(tmp_path / "wheel", "libpdtest.so.7", "int pdtest_runtime(void) { return 7; }\n",
                  "-Wl,-soname,libpdtest.so.7")
    engine = _cc(tmp_path, "engine.so", "int pdtest_runtime(void);\nint engine(void) { return pdtest_runtime(); }\n",
                 f"-L{tmp_path / 'wheel'}", "-l:libpdtest.so.7")
    assert builds.unresolved(str(engine)) == ["libpdtest.so.7"]
    with pytest.raises(OSError, match="libpdtest.so.7"):
        ctypes.CDLL(str(engine))
    assert builds.unresolved(str(engine), preload=str(runtime)) == []
    monkeypatch.setattr(builds, "installed", lambda: {"mooncake-transfer-engine": "0.3.13.post1"})
    monkeypatch.setattr(builds, "cuda_runtime_path", lambda: str(runtime))
    assert builds.load_cuda_runtime() == str(runtime)
    assert ctypes.CDLL(str(engine)).engine() == 7


def test_the_transfer_engine_loads_the_runtime_before_it_imports_mooncake():
    # a fresh process: mooncake.engine is imported for the first time by TransferEngine
    code = """
import sys
from pdserve.kvtransfer import engine
calls = []
engine.load_cuda_runtime = lambda: calls.append("mooncake.engine" in sys.modules)
e = engine.TransferEngine("127.0.0.1")
print(calls, "mooncake.engine" in sys.modules)
"""
    out = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[False] True" in out.stdout.splitlines()


def test_a_missing_driver_is_named_as_the_driver_not_as_debian_libraries():
    """The CUDA image started on a host without the NVIDIA driver fails to load engine.so on libcuda.so.1 (seen
    running the built image on this CPU host): the hint says so instead of listing Debian packages."""
    from pdserve.kvtransfer.engine import mooncake_import_hint
    driver = mooncake_import_hint(ImportError("libcuda.so.1: cannot open shared object file: No such file or directory"))
    assert "NVIDIA driver" in driver and "cpu extra" in driver and "libibverbs1" not in driver
    debian = mooncake_import_hint(ImportError("libibverbs.so.1: cannot open shared object file"))
    assert "libibverbs1 librdmacm1 libnuma1" in debian and "NVIDIA" not in debian
