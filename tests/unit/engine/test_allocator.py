"""engine/allocator.py: an engine executes itself again under jemalloc unless the operator chose otherwise, once."""
import os
import subprocess
import sys

import pytest

from pdserve.engine.allocator import JEMALLOC_CONF, exec_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_jemalloc_is_preloaded_with_large_blocks_kept():
    env = exec_env({"PATH": "/bin"}, found="libjemalloc.so.2")
    assert env["LD_PRELOAD"] == "libjemalloc.so.2" and env["MALLOC_CONF"] == JEMALLOC_CONF
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize("env", [{"PDSERVE_ALLOCATOR": "glibc"}, {"LD_PRELOAD": "libtcmalloc.so.4"},
                                 {"LD_PRELOAD": "libjemalloc.so.2"}])
def test_the_operators_choice_or_a_preload_already_in_stands(env):
    assert exec_env(env, found="libjemalloc.so.2") is None


def test_without_jemalloc_the_engine_goes_on_with_glibc():
    assert exec_env({}, found="") is None


def test_the_operators_malloc_conf_is_kept():
    assert exec_env({"MALLOC_CONF": "narenas:2"}, found="libjemalloc.so.2")["MALLOC_CONF"] == "narenas:2"


def test_an_unknown_allocator_is_refused_by_name():
    with pytest.raises(SystemExit, match="PDSERVE_ALLOCATOR='tcmalloc'"):
        exec_env({"PDSERVE_ALLOCATOR": "tcmalloc"}, found="libjemalloc.so.2")


CHILD = r"""
import os, sys
from pdserve.engine.allocator import use_jemalloc
use_jemalloc()
maps = open("/proc/self/maps").read()
print(os.getpid(), "jemalloc" in maps, os.environ.get("MALLOC_CONF", ""))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings from Linux's /proc")
def test_the_process_runs_on_under_jemalloc_with_its_own_pid():
    import ctypes.util
    if not ctypes.util.find_library("jemalloc"):
        pytest.skip("Debian's libjemalloc2 is not installed (make setup installs it)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "PDSERVE_ALLOCATOR")}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    pid, mapped, conf = out.split()
    assert int(pid) == proc.pid and mapped == "True" and conf == JEMALLOC_CONF, out
