#!/usr/bin/env bash
# The one place that says how pdserve is installed: the Makefile (`make setup`) and both Dockerfiles
# (deploy/docker) call these sub-commands, so a host and an image get the same packages and pins.
#   install.sh apt runtime|dev          Debian packages: runtime (what Mooncake needs even for tcp) or dev
#                                       (runtime + SPIN for the formal model + Prometheus for its tests)
#   install.sh python VENV VARIANT [EXTRAS]
#                                       virtualenv with torch and pdserve (editable, from this checkout);
#                                       VARIANT cpu|cuda|auto (auto: cuda where nvidia-smi exists);
#                                       EXTRAS e.g. test,bench (the image takes none)
#   install.sh stubs PYTHON             generate the gRPC stubs into services/v1 (imported as pdserve.v1)
#   install.sh pins                     print the torch pin `python` installs first (pyproject's own)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNTIME_APT=(libibverbs1 librdmacm1 libnuma1)
DEV_APT=("${RUNTIME_APT[@]}" spin prometheus)

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

cmd_apt() {
  local pkgs
  case "${1:-}" in
    runtime) pkgs=("${RUNTIME_APT[@]}") ;;
    dev) pkgs=("${DEV_APT[@]}") ;;
    *) echo "install.sh apt: runtime or dev, got '${1:-}'" >&2; exit 2 ;;
  esac
  local missing=() p
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # an image keeps no package lists; a host keeps its own
  if [ -f /.dockerenv ] || [ -n "${container:-}" ]; then rm -rf /var/lib/apt/lists/*; fi
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

cmd_pins() {
  torch_pin
}

sub="${1:-}"
shift || true
case "$sub" in
  apt) cmd_apt "$@" ;;
  python) cmd_python "$@" ;;
  stubs) cmd_stubs "$@" ;;
  pins) cmd_pins "$@" ;;
  *) echo "usage: install.sh apt runtime|dev | python VENV cpu|cuda|auto [EXTRAS] | stubs PYTHON | pins" >&2
     exit 2 ;;
esac
