#!/usr/bin/env bash
# Fuzzes kvsync's decoders (BLK3 tokens and MRINFO, TCP framing, KVR1,
# RDB head/aux fields/LZF/CRC, piece manifests, resume journals; the
# stream's sessions over TCP and rings, the GETACK scanner, a primary's
# replies to the stream's follower, and a log directory's segment,
# history and upstreams files) with cargo-fuzz for a bounded time each.
#
#   scripts/fuzz.sh                 # every target, FUZZ_SECONDS (60) each
#   FUZZ_SECONDS=600 scripts/fuzz.sh rdb
#
# A crash is copied into fuzz/regressions/<target>/; commit it with the fix:
# the test suite (tests/fuzz_regressions.rs) replays every kept input.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz > /dev/null || cargo install cargo-fuzz --locked

targets=${*:-$(cargo +nightly fuzz list --fuzz-dir fuzz)}

# fuzz/seeds/<target> holds valid inputs for the fuzzer to mutate (the first
# byte of a kvr1 or rdb input picks the update size); new finds go to
# fuzz/corpus/<target>, which is kept in the repository once minimised
# (cargo +nightly fuzz cmin --fuzz-dir fuzz <target> fuzz/corpus/<target>),
# so the next run starts where the last one ended.
status=0
for t in $targets; do
    mkdir -p "fuzz/corpus/$t" "fuzz/regressions/$t" "fuzz/seeds/$t"
    echo "== $t (${seconds}s)"
    if ! cargo +nightly fuzz run --fuzz-dir fuzz "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" "fuzz/regressions/$t" \
        -- -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048; then
        status=1
        for a in fuzz/artifacts/"$t"/*; do
            [ -f "$a" ] || continue
            cp "$a" "fuzz/regressions/$t/"
            echo "kept $a in fuzz/regressions/$t/ (replayed by tests/fuzz_regressions.rs)"
        done
    fi
done
exit $status
