#!/usr/bin/env bash
# Runs the kvsync demo on this machine. Installs the system packages it needs
# first, when missing. Extra arguments go to `kvsync demo`. KVSYNC_BIN=path
# runs that kvsync binary instead of building a release one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${KVSYNC_BIN:-}" ]; then
    exec "$KVSYNC_BIN" demo "$@"
fi
bash scripts/deps.sh
cargo run --locked --release --quiet -- demo "$@"
