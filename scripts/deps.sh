#!/usr/bin/env bash
# Installs the Debian packages kvsync needs to build and test, when missing.
# Usage: scripts/deps.sh [extra-package ...]
# Run by scripts/test.sh, the demos, the benchmarks and the VM harness; safe to
# run repeatedly and side by side.
set -euo pipefail

packages=(pkg-config libclang-dev clang libibverbs-dev librdmacm-dev "$@")
missing_packages() {
    missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
}
missing_packages
[ ${#missing[@]} -gt 0 ] || exit 0
# One install at a time (tests run in parallel, and apt's own lock fails a
# second install): the lock is this script file itself, so no lock file is
# left anywhere; a caller that waited finds what the first installed.
exec 7<"${BASH_SOURCE[0]}"
flock 7
missing_packages
[ ${#missing[@]} -gt 0 ] || exit 0
echo "kvsync: installing missing system packages: ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "kvsync: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "kvsync: installed ${missing[*]}" >&2
