#!/usr/bin/env bash
# The long soak: 8 replicas syncing from one source for ROUNDS rounds of a
# SIZE snapshot that changes between rounds; checks byte-identical installs,
# descriptors and RSS back at their baseline, and an empty cache.
# Usage: scripts/soak.sh [ROUNDS=10] [SIZE=256MiB]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
KVSYNC_SOAK_ROUNDS=${1:-10} KVSYNC_SOAK_SIZE=${2:-256MiB} \
    cargo test --locked --release --test soak -- --nocapture
