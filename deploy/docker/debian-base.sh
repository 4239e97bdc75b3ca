#!/usr/bin/env bash
# A base image for deploy/docker/Dockerfile.* built from Debian's own archive, for hosts that reach a Debian mirror
# but no container registry (the images' default base, python:3.11.14-slim-bookworm, is pulled from Docker Hub):
# debootstrap's minbase of bookworm with Debian's Python 3.11, its venv module and the CA certificates, imported
# as one layer. Run as root (debootstrap needs it), then build with it:
#
#   deploy/docker/debian-base.sh                  # -> localhost/debian-python:3.11-bookworm
#   make image BASE=localhost/debian-python:3.11-bookworm [VARIANT=cuda]
#
# DEBIAN_MIRROR overrides the mirror (default: the first URI of the host's apt sources, else deb.debian.org);
# CONTAINER_ENGINE picks podman or docker, as `make image` does.
set -euo pipefail

tag="${1:-localhost/debian-python:3.11-bookworm}"
engine="${CONTAINER_ENGINE:-$(command -v podman || command -v docker || true)}"
[ -n "$engine" ] || { echo "debian-base.sh: no container engine: install podman or docker" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debian-base.sh: no debootstrap: apt-get install debootstrap" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debian-base.sh: debootstrap needs root" >&2; exit 1; }

mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror=$(grep -hs -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | head -n1 || true)
  [ -n "$mirror" ] || mirror=$(grep -hs -m1 -E '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -n1 || true)
  mirror="${mirror:-http://deb.debian.org/debian}"
fi

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
echo "debian-base.sh: debootstrap bookworm (minbase + python3 python3-venv ca-certificates) from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >&2
# the images install their own packages with apt-get: leave it pointing at the same mirror, with no cached lists
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" > "$root/etc/apt/sources.list"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/tmp/* "$root"/var/log/*.log
tar -C "$root" --numeric-owner -c . |
  "$engine" import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["/bin/bash"]' - "$tag"
"$engine" run --rm --entrypoint python3 "$tag" -c 'import sys, venv, ssl; assert sys.version_info[:2] == (3, 11), sys.version' \
  2>/dev/null || echo "debian-base.sh: imported $tag (not run: $engine run is not allowed here)" >&2
echo "$tag"
