#!/usr/bin/env bash
# Installs the Debian packages kvsync needs to build and test, when missing.
# Usage: scripts/deps.sh [extra-package ...]
# A package named NAME/backports comes from the release's backports suite
# (valkey-server/backports: Valkey 8 on Debian 12); the suite is added to
# apt's sources, from the mirror the system already uses, for that install
# only: afterwards the suite is removed again, so that later installs resolve
# as on the plain release (with backports listed, apt refuses Debian 12's
# qemu-system-x86 next to a backported qemu-utils, and the backported qemu
# does not run the soft-RoCE VM).
# Run by scripts/test.sh, the demos, the benchmarks and the VM harness; safe to
# run repeatedly and side by side.
set -euo pipefail

packages=(pkg-config libclang-dev clang libibverbs-dev librdmacm-dev "$@")
missing_packages() {
    missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "${p%/backports}" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
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
. /etc/os-release
plain=() backports=()
for p in "${missing[@]}"; do
    case "$p" in
        */backports) backports+=("${p%/backports}") ;;
        *) plain+=("$p") ;;
    esac
done
suite="$VERSION_CODENAME-backports"
added=""
if [ ${#backports[@]} -gt 0 ] && ! grep -rqs "$suite" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    # The mirror that serves the release's own suite.
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v c="$VERSION_CODENAME" '
        /^URIs:/ { u = $2 }
        /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == c) { print u; exit } }')
    [ -n "$mirror" ] || mirror=$(awk -v c="$VERSION_CODENAME" '$1 == "deb" && $3 == c {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
    [ -n "$mirror" ] || { echo "kvsync: no Debian mirror in apt's sources to add $suite from" >&2; exit 1; }
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$mirror" "$suite" | $sudo tee /etc/apt/sources.list.d/kvsync-backports.sources >/dev/null
    added=/etc/apt/sources.list.d/kvsync-backports.sources
    trap '$sudo rm -f "$added"' EXIT
fi
$sudo apt-get update -qq
[ ${#plain[@]} -eq 0 ] || $sudo apt-get install -y -qq --no-install-recommends "${plain[@]}" >/dev/null
[ ${#backports[@]} -eq 0 ] || $sudo apt-get install -y -qq --no-install-recommends -t "$suite" "${backports[@]}" >/dev/null
if [ -n "$added" ]; then
    $sudo rm -f "$added"
    $sudo apt-get update -qq
fi
echo "kvsync: installed ${missing[*]}" >&2
