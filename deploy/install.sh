#!/usr/bin/env bash
# The one place that says how pdserve is installed: the Makefile (`make setup`) and both Dockerfiles
# (deploy/docker) call these sub-commands, so a host and an image get the same packages and pins.
#   install.sh apt runtime|dev|build [VARIANT]
#                                       Debian packages a bare Debian/Ubuntu lacks: runtime (what Mooncake's
#                                       engine.so needs even for tcp) or dev (runtime + python3-venv for the
#                                       virtualenv, gcc + libc6-dev for SPIN's verifier, SPIN, Prometheus's
#                                       binaries for its tests) or build (gcc for the kernel, an image's build
#                                       stage); VARIANT cpu (default), cuda or auto, as for `python`: Mooncake's
#                                       CUDA build links more; apt-get through sudo when not root
#   install.sh packages runtime|dev|build [VARIANT]
#                                       print that list (tests/unit/deploy checks it against a bare Debian)
#   install.sh python VENV VARIANT [EXTRAS]
#                                       virtualenv with torch and pdserve (editable, from this checkout);
#                                       VARIANT cpu|cuda|auto (auto: cuda where nvidia-smi exists);
#                                       EXTRAS e.g. test,bench (the image takes none)
#   install.sh stubs PYTHON             generate the gRPC stubs into services/v1 (imported as pdserve.v1)
#   install.sh native PYTHON            build the CPU decode attention kernel (services/engine/csrc) with the
#                                       host's C compiler into services/engine/_native
#   install.sh verify PYTHON VARIANT    check that the venv holds the variant's Mooncake build alone, that every
#                                       library its engine.so links resolves (but the CUDA driver, which a GPU
#                                       node supplies), and for cuda that torch is a CUDA build: an image that
#                                       could not transfer a page fails its build here
#   install.sh pins                     print the torch pin `python` installs first (pyproject's own)
set -euo pipefail
cd "$(dirname "$0")/.."

# runtime: Mooncake's engine.so links libibverbs, libnuma and libcurl even for tcp (librdmacm: its RDMA transport).
# dev: Debian's python3 has no ensurepip without python3-venv; formal/check.sh compiles SPIN's pan.c with gcc; the tests
# reset live TCP connections with iproute2's ss -K; the broker's election tests start etcd-server's /usr/bin/etcd (the
# broker itself needs only the Python client, a pip dependency)
# libjemalloc2: the engines' C allocator (services/engine/allocator.py)
RUNTIME_APT=(libibverbs1 librdmacm1 libnuma1 libcurl4 libjemalloc2)
DEV_APT=("${RUNTIME_APT[@]}" python3 python3-venv gcc libc6-dev spin prometheus iproute2 etcd-server)
# build: what an image's build stage needs to compile the CPU decode attention kernel (install.sh native)
BUILD_APT=(gcc libc6-dev)
# Mooncake's CUDA build (the cuda variant) links libmlx5.so.1 too, which the non-CUDA build does not
CUDA_APT=(ibverbs-providers)
# packages whose maintainer scripts start a daemon on a systemd host (package:unit); the tests need only their
# binaries
DAEMONS=(prometheus:prometheus etcd-server:etcd)
# where Debian looks for the policy that holds daemons back, and how a host shows it runs systemd (sd_booted);
# tests/unit/deploy/test_install_apt.py points both into a temporary folder
POLICY_RC=${PDSERVE_POLICY_RC:-/usr/sbin/policy-rc.d}
SYSTEMD_DIR=${PDSERVE_SYSTEMD_DIR:-/run/systemd/system}

# torch is installed on its own first, with the exact pin pyproject.toml declares (read, not repeated here)
torch_pin() {
  local pin
  pin=$(sed -n 's/^ *"\(torch==[^"]*\)",\{0,1\}$/\1/p' pyproject.toml | head -1)
  [ -n "$pin" ] || { echo "install.sh: no torch==VERSION pin in pyproject.toml" >&2; exit 1; }
  echo "$pin"
}

variant_of() {
  case "$1" in
    cpu|cuda) echo "$1" ;;
    # the CUDA build of Mooncake needs libcudart and libcuda; hosts without CUDA take the non-cuda build
    auto) if command -v nvidia-smi >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
    *) echo "install.sh: VARIANT must be cpu, cuda or auto, got '$1'" >&2; exit 2 ;;
  esac
}

apt_list() {
  local variant list
  variant=$(variant_of "${2:-cpu}")
  case "${1:-}" in
    runtime) list=("${RUNTIME_APT[@]}") ;;
    dev) list=("${DEV_APT[@]}") ;;
    build) echo "${BUILD_APT[@]}"; return ;;  # the kernel's compiler: the same for both variants
    *) echo "install.sh: runtime, dev or build, got '${1:-}'" >&2; exit 2 ;;
  esac
  if [ "$variant" = cuda ]; then list+=("${CUDA_APT[@]}"); fi
  echo "${list[@]}"
}

# root runs apt-get itself, anyone else through sudo (cmd_apt checks there is one and says so first)
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

cmd_apt() {
  local list pkgs missing=() p
  list=$(apt_list "${1:-}" "${2:-cpu}")
  read -r -a pkgs <<<"$list"
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || {
    echo "install.sh: ${#missing[@]} Debian packages missing (${missing[*]}) and no apt-get here" >&2; exit 1; }
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "install.sh: Debian packages missing: ${missing[*]}; not root (uid $(id -u)) and no sudo: as root, run" \
           "apt-get install --no-install-recommends ${missing[*]}" >&2; exit 1; }
    echo "install.sh: not root (uid $(id -u)): apt-get runs through sudo" >&2
  fi
  echo "installing Debian packages: ${missing[*]}"
  # policy-rc.d 101 keeps maintainer scripts from starting daemons (invoke-rc.d and deb-systemd-invoke obey it);
  # one that exists already (container images have one) is left as it is
  local policy=$POLICY_RC ours=""
  if [ ! -e "$policy" ]; then
    as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
    ours=1
    trap 'as_root rm -f '"$policy" EXIT
  fi
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >/dev/null
  if [ -n "$ours" ]; then as_root rm -f "$policy"; trap - EXIT; fi
  # a daemon we installed is not enabled at boot either (systemd hosts only; nothing runs it elsewhere)
  local d unit
  for d in "${DAEMONS[@]}"; do
    p=${d%%:*} unit=${d#*:}.service
    if [[ " ${missing[*]} " == *" $p "* ]] && [ -d "$SYSTEMD_DIR" ]; then
      as_root systemctl disable --now "$unit" >/dev/null || {
        echo "install.sh: could not stop and disable $unit, which package $p started: stop it yourself" >&2
        exit 1; }
    fi
  done
  # an image keeps no package lists; a host keeps its own
  if [ -f /.dockerenv ] || [ -n "${container:-}" ]; then as_root rm -rf /var/lib/apt/lists/*; fi
}

cmd_python() {
  local venv="${1:?install.sh python VENV VARIANT [EXTRAS]}" variant extras
  variant=$(variant_of "${2:?install.sh python VENV VARIANT [EXTRAS]}")
  extras="$variant${3:+,$3}"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "$(torch_pin)"
  "$venv/bin/pip" install -q -e ".[$extras]"
}

cmd_stubs() {
  local py="${1:?install.sh stubs PYTHON}"
  "$py" setup.py -q gen_stubs
}

cmd_native() {
  local py="${1:?install.sh native PYTHON}"
  "$py" -m pdserve.engine.native
  # the build leaves the library readable by its builder alone (it starts as a 0600 temporary file): an image builds
  # it as root and serves as uid 10001, which could not load it
  chmod -R a+rX services/engine/_native
}

cmd_verify() {
  local py="${1:?install.sh verify PYTHON VARIANT}" variant
  variant=$(variant_of "${2:?install.sh verify PYTHON VARIANT}")
  "$py" -m pdserve.kvtransfer.builds "$variant"
}

cmd_pins() {
  torch_pin
}

sub="${1:-}"
shift || true
case "$sub" in
  apt) cmd_apt "$@" ;;
  packages) apt_list "$@" ;;
  python) cmd_python "$@" ;;
  stubs) cmd_stubs "$@" ;;
  native) cmd_native "$@" ;;
  verify) cmd_verify "$@" ;;
  pins) cmd_pins "$@" ;;
  *) echo "usage: install.sh apt|packages runtime|dev|build [cpu|cuda|auto] | python VENV cpu|cuda|auto [EXTRAS]" \
          "| stubs PYTHON | native PYTHON | verify PYTHON cpu|cuda|auto | pins" >&2
     exit 2 ;;
esac
