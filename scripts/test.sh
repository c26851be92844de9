#!/usr/bin/env bash
# Runs kvsync's whole test suite (what CI runs). Installs the system packages
# it needs first, when missing, and ends with one summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh redis-server iproute2   # real Redis servers; network namespaces
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo fmt --check                         # one formatting
cargo clippy --locked --all-targets --all-features --quiet -- -D warnings -D clippy::undocumented_unsafe_blocks
cargo build --locked --examples --quiet   # benchmark helpers must build too
set +e
# The fault tests need the test-only fault hooks (off in release builds).
cargo test --locked --features faults --tests 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
# One line for the whole run: the sum over every test binary.
sed -nE 's/^test result: .* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/p' "$log" |
    awk '{p += $1; f += $2; i += $3} END {printf "%d passed, %d failed, %d skipped\n", p, f, i}'
exit "$rc"
