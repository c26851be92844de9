#!/usr/bin/env bash
# Runs kvsync's whole test suite (what CI runs). Installs the system packages
# it needs first, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo test --locked --all-targets
