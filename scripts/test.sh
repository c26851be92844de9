#!/usr/bin/env bash
# Runs kvsync's whole test suite (what CI runs). Installs the system packages
# it needs first, when missing, and ends with one summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
# real Redis and Valkey servers (Valkey 8 from the release's backports) and
# Redis Sentinel for the failover tests;
# network namespaces; systemd-analyze for the unit test; bc for the Redis
# seeding demo that tests/scripts.rs runs
bash scripts/deps.sh redis-server redis-sentinel valkey-server/backports valkey-tools/backports iproute2 systemd bc
log=$(mktemp)
export KVSYNC_SKIP_LOG KVSYNC_VM_LOG
KVSYNC_SKIP_LOG=$(mktemp)
KVSYNC_VM_LOG=$(mktemp)   # the soft-RoCE VM runs, in order, with their sections' seconds
trap 'rm -f "$log" "$KVSYNC_SKIP_LOG" "$KVSYNC_VM_LOG"' EXIT
# One clean build: incremental caches only cost disk here (they took ~4 GB).
export CARGO_INCREMENTAL=0
cargo fmt --check                         # one formatting
cargo clippy --locked --all-targets --all-features --quiet -- -D warnings -D clippy::undocumented_unsafe_blocks
cargo build --locked --examples --quiet   # benchmark helpers must build too
set +e
# The fault tests need the test-only fault hooks (off in release builds).
cargo test --locked --features faults --tests 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ -s "$KVSYNC_VM_LOG" ]; then
    echo "soft-RoCE VM runs, one at a time:"
    sed 's/^/  /' "$KVSYNC_VM_LOG"
fi
# Tests that could not run here (tests/SKIPS.md), by name.
skipped=$(wc -l < "$KVSYNC_SKIP_LOG")
if [ "$skipped" -gt 0 ]; then
    echo "skipped here:"
    sed 's/^/  /' "$KVSYNC_SKIP_LOG"
fi
# One line for the whole run: the sum over every test binary; a test that
# skipped counts as skipped, not passed.
sed -nE 's/^test result: .* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/p' "$log" |
    awk -v s="$skipped" '{p += $1; f += $2; i += $3} END {printf "%d passed, %d failed, %d skipped\n", p - s, f, i + s}'
exit "$rc"
