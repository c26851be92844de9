#!/usr/bin/env bash
# Benchmark: `kvsync verify` throughput on a KVR1 file from page cache, as a
# ratio to a plain sequential read (dd, same 1 MiB reads) of the same file,
# measured interleaved in the same run. Prints a markdown table row.
# Usage: scripts/bench-verify.sh [SIZE=1GiB] [RUNS=5]
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1GiB}
runs=${2:-5}
bash scripts/deps.sh
cargo build --locked --release --quiet
bin=target/release/kvsync
work=$(mktemp -d "${TMPDIR:-/tmp}/kvsync-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
file=$work/bench.kvr1
$bin gen-snapshot --size "$size" --seq 1 "$file" >/dev/null
bytes=$(stat -c %s "$file")
cat "$file" >/dev/null   # warm the page cache

now() { date +%s%N; }
read_ns=(); verify_ns=()
for _ in $(seq "$runs"); do
    t0=$(now); dd if="$file" of=/dev/null bs=1M status=none; t1=$(now)
    $bin verify "$file" >/dev/null; t2=$(now)
    read_ns+=($((t1 - t0))); verify_ns+=($((t2 - t1)))
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
r=$(median "${read_ns[@]}"); v=$(median "${verify_ns[@]}")
awk -v b="$bytes" -v r="$r" -v v="$v" -v n="$runs" -v c="$(nproc)" -v m="$(free -g | awk '/Mem:/ {print $2}')" 'BEGIN {
    printf "| %d MiB | %.0f MB/s | %.0f MB/s | %.2f | median of %d, %d cores, %d GiB |\n",
        b / 1048576, b / r * 1000, b / v * 1000, r / v, n, c, m }'
