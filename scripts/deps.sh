#!/usr/bin/env bash
# Installs the Debian packages kvsync needs to build and test, when missing.
# Usage: scripts/deps.sh [extra-package ...]
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run repeatedly.
set -euo pipefail

packages=(pkg-config libclang-dev clang libibverbs-dev librdmacm-dev "$@")
# One install at a time (tests run in parallel, and apt holds a lock of its
# own that a second install would fail on): a caller that waited finds what
# the first installed.
exec 7>"${TMPDIR:-/tmp}/kvsync-deps.lock"
flock 7
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
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
