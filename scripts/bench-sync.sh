#!/usr/bin/env bash
# Benchmark: full sync over TCP between two agents on loopback vs a plain
# single-stream TCP copy of the same file (examples/plain_copy.rs), and vs
# the same sync over the emulated RDMA fabric, measured alternately in the
# same run; plus peak RSS of a replica during a sync and of a source serving
# 4 replicas at once. Prints markdown table rows.
# Usage: [BENCH_DIR=/dev/shm] scripts/bench-sync.sh [SIZE=1GiB] [RUNS=5]
# (BENCH_DIR on tmpfs takes the disk out of the comparison.)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1GiB}
runs=${2:-5}
bash scripts/deps.sh
cargo build --locked --release --quiet
cargo build --locked --release --quiet --example plain_copy
bin=$PWD/target/release/kvsync
copy=$PWD/target/release/examples/plain_copy
work=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/kvsync-bench.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# Agents can use the emulated RDMA fabric; syncs choose with --transport.
cat >"$work/agent.toml" <<EOF
[data]
rdma_port = 0
[transport]
mode = "auto"
rdma_provider = "emulated"
EOF

# start_agent NAME -> sets GRPC_<NAME> and PID_<NAME>
start_agent() {
    local name=$1
    mkdir -p "$work/$name"
    KVSYNC_LOG=warn "$bin" agent --config "$work/agent.toml" --node-id "$name" --snapshot-dir "$work/$name" \
        --grpc-listen 127.0.0.1:0 --data-listen 127.0.0.1:0 --metrics-listen "" \
        >"$work/$name.out" 2>"$work/$name.log" &
    local pid=$!
    pids+=("$pid")
    for _ in $(seq 200); do
        grep -q "ready" "$work/$name.out" 2>/dev/null && break
        sleep 0.05
    done
    local grpc
    grpc=$(grep -o 'grpc=[^ ]*' "$work/$name.out" | cut -d= -f2)
    [ -n "$grpc" ] || { echo "agent $name did not start" >&2; cat "$work/$name.log" >&2; exit 1; }
    eval "GRPC_$name=$grpc; PID_$name=$pid"
}
hwm_kib() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

start_agent source
start_agent replica
"$bin" gen-snapshot --size "$size" --seq 7 "$work/source/bench.kvr1" >/dev/null
bytes=$(stat -c %s "$work/source/bench.kvr1")
for _ in $(seq 400); do
    "$bin" snapshots --agent "$GRPC_source" | grep -q bench.kvr1 && break
    sleep 0.05
done

# sync_secs TRANSPORT: one sync's duration in seconds (checks the transport).
sync_secs() {
    local out
    out=$("$bin" sync --agent "$GRPC_replica" --source "$GRPC_source" --transport "$1" --wait --json)
    echo "$out" | grep -q '"status":"succeeded"' || { echo "sync failed: $out" >&2; exit 1; }
    echo "$out" | grep -q "\"transport\":\"$1\"" || { echo "sync did not use $1: $out" >&2; exit 1; }
    echo "$out" | sed -E 's/.*"duration_ms":([0-9]+).*/\1/' | awk '{print $1/1000}'
}
sync_s=(); copy_s=(); emu_s=()
for _ in $(seq "$runs"); do
    sync_s+=("$(sync_secs tcp)")
    rm -f "$work/copy.out"
    copy_s+=("$("$copy" "$work/source/bench.kvr1" "$work/copy.out" | cut -d' ' -f1)")
    rm -f "$work/copy.out"
    emu_s+=("$(sync_secs rdma)")
done
s=$(median "${sync_s[@]}"); c=$(median "${copy_s[@]}"); e=$(median "${emu_s[@]}")
replica_rss=$(hwm_kib "$PID_replica")
cores=$(nproc); mem=$(free -g | awk '/Mem:/ {print $2}')
awk -v b="$bytes" -v s="$s" -v c="$c" -v n="$runs" -v k="$cores" -v m="$mem" 'BEGIN {
    printf "| full sync %d MiB over TCP | %.0f MB/s | plain copy %.0f MB/s | %.2f | median of %d, %d cores, %d GiB |\n",
        b/1048576, b/s/1e6, b/c/1e6, c/s, n, k, m }'
awk -v b="$bytes" -v s="$s" -v e="$e" -v n="$runs" 'BEGIN {
    printf "| full sync %d MiB over the EMULATED rdma fabric | %.0f MB/s | TCP path %.0f MB/s | %.2f | median of %d; an emulation over TCP, not a fast path |\n",
        b/1048576, b/e/1e6, b/s/1e6, s/e, n }'
echo "| replica agent peak RSS during the syncs | $((replica_rss / 1024)) MiB | | | VmHWM |"

# Fan-out: a fresh source serves 4 replicas at once.
start_agent fan
cp "$work/source/bench.kvr1" "$work/fan/bench.kvr1"
for _ in $(seq 400); do
    "$bin" snapshots --agent "$GRPC_fan" | grep -q bench.kvr1 && break
    sleep 0.05
done
fan_jobs=()
for i in 1 2 3 4; do
    start_agent "r$i"
    eval "g=\$GRPC_r$i"
    "$bin" sync --agent "$g" --source "$GRPC_fan" --wait --json >"$work/fan-$i.json" &
    fan_jobs+=($!)
done
for j in "${fan_jobs[@]}"; do wait "$j"; done
grep -L '"status":"succeeded"' "$work"/fan-*.json | while read -r f; do echo "fan-out sync failed: $(cat "$f")" >&2; done
echo "| source agent peak RSS serving 4 replicas of $((bytes / 1048576)) MiB | $(( $(hwm_kib "$PID_fan") / 1024 )) MiB | | | VmHWM |"
