#!/usr/bin/env bash
# Runs the kvsync demo on this machine. Installs the system packages it needs
# first, when missing. Extra arguments go to `kvsync demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo run --locked --release --quiet -- demo "$@"
