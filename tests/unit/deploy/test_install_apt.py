"""deploy/install.sh apt on a bare machine, with apt-get, dpkg, id, sudo and systemctl replaced by recorders on
PATH (nothing is installed): root runs apt-get itself; anyone else goes through sudo and says so, or stops with
the command to run when there is no sudo; the daemons of prometheus and etcd-server are held back during the install
(policy-rc.d exit 101) and disabled after on a systemd host."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
REAL = ("bash", "sh", "env", "dirname", "sed", "head", "cat", "tail", "chmod")
FAKES = {
    "id": 'echo "$FAKE_UID"',
    "dpkg": 'case " $FAKE_INSTALLED " in *" $2 "*) exit 0;; *) exit 1;; esac',
    # what the daemon policy says while apt-get runs: the maintainer scripts consult it then
    "apt-get": 'echo "apt-get $* [policy: $(tail -n1 "$PDSERVE_POLICY_RC" 2>/dev/null || echo none)]" >> "$LOG"',
    "systemctl": 'echo "systemctl $*" >> "$LOG"',
    "sudo": 'echo "sudo $1" >> "$LOG"; exec "$@"',
    # removes only inside the test's folder: as a container, the script clears apt's lists after installing
    "rm": 'echo "rm $*" >> "$LOG"; for a; do case "$a" in "$TMP_ROOT"/*) /bin/rm -f "$a";; esac; done',
}


def dev_packages() -> list[str]:
    return subprocess.run([str(ROOT / "deploy/install.sh"), "packages", "dev"], capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture
def machine(tmp_path):
    """run(uid, installed, sudo, systemd) -> (completed process, log lines, policy path)."""
    def run(uid: int, installed: tuple[str, ...] = (), sudo: bool = True, systemd: bool = True):
        bin_dir = tmp_path / "bin"
        shutil.rmtree(bin_dir, ignore_errors=True)
        bin_dir.mkdir()
        for tool in REAL:
            os.symlink(shutil.which(tool), bin_dir / tool)
        for name, body in FAKES.items():
            if name != "sudo" or sudo:
                (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
                (bin_dir / name).chmod(0o755)
        log = tmp_path / "log"
        log.write_text("")
        (tmp_path / "systemd").mkdir(exist_ok=True)
        env = {"PATH": str(bin_dir), "LOG": str(log), "TMP_ROOT": str(tmp_path), "FAKE_UID": str(uid),
               "FAKE_INSTALLED": " ".join(installed),
               "PDSERVE_POLICY_RC": str(tmp_path / "policy-rc.d"),
               "PDSERVE_SYSTEMD_DIR": str(tmp_path / ("systemd" if systemd else "no-systemd"))}
        out = subprocess.run([str(ROOT / "deploy/install.sh"), "apt", "dev"], env=env, capture_output=True,
                             text=True, timeout=60)
        return out, [x for x in log.read_text().splitlines() if not x.startswith("rm")], tmp_path / "policy-rc.d"
    return run


def test_root_installs_what_is_missing_with_daemons_held_back(machine):
    out, log, policy = machine(0, installed=("libnuma1",))
    assert out.returncode == 0, out.stderr
    assert "sudo" not in out.stderr and not [x for x in log if x.startswith("sudo")]
    missing = [p for p in dev_packages() if p != "libnuma1"]
    assert log == ["apt-get update -qq [policy: exit 101]",
                   f"apt-get install -y -qq --no-install-recommends {' '.join(missing)} [policy: exit 101]",
                   "systemctl disable --now prometheus.service", "systemctl disable --now etcd.service"]
    assert not policy.exists()  # ours, removed after the install (by the fake rm: inside tmp_path only)


def test_non_root_goes_through_sudo_and_says_so(machine):
    out, log, _ = machine(1000)
    assert out.returncode == 0, out.stderr
    assert "not root (uid 1000): apt-get runs through sudo" in out.stderr
    direct = [x for x in log if x.startswith(("apt-get", "systemctl"))]
    via_sudo = [x for x in log if x.startswith("sudo")]
    assert len(direct) == 4 and len(via_sudo) >= len(direct)  # policy write, 2 apt-get, removal, 2 systemctl


def test_non_root_without_sudo_stops_with_the_command(machine):
    out, log, _ = machine(1000, sudo=False)
    assert out.returncode == 1 and log == []
    assert "not root (uid 1000) and no sudo" in out.stderr
    assert f"apt-get install --no-install-recommends {' '.join(dev_packages())}" in out.stderr


def test_an_existing_policy_and_the_daemons_are_left_alone(machine, tmp_path):
    (tmp_path / "policy-rc.d").write_text("#!/bin/sh\nexit 0\n")
    out, log, policy = machine(0, installed=("prometheus", "etcd-server"), systemd=True)
    assert out.returncode == 0, out.stderr
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"  # the host's own, untouched
    assert not [x for x in log if x.startswith("systemctl")]  # both were there before: their daemons are the host's


def test_no_systemd_no_systemctl_and_nothing_missing_nothing_run(machine):
    out, log, _ = machine(0, systemd=False)
    assert out.returncode == 0 and not [x for x in log if x.startswith("systemctl")]
    out, log, _ = machine(1000, installed=tuple(dev_packages()), sudo=False)
    assert out.returncode == 0 and log == [] and out.stderr == ""
