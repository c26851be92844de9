#!/usr/bin/env bash
# A/B of two kvsync binaries: full syncs of one snapshot between two agents
# of each, alternating A and B, cold cache (linger 0s), over TCP or
# (TRANSPORT=rdma) the emulated RDMA fabric, with TLS=1 under TLS (a CA and
# certificate from bench-pki.sh). Prints each run, the medians, B/A,
# and the CPU time each agent used per sync.
#
#   scripts/bench-ab.sh OLD_BIN NEW_BIN        # e.g. a worktree's build vs this one
#   RUNS=15 SIZE=1GiB AB_DIR=/dev/shm B_CONFIG='[data]\npiece_size = "64MiB"\n' scripts/bench-ab.sh A B
#   TRANSPORT=rdma scripts/bench-ab.sh A B
#   TLS=1 scripts/bench-ab.sh A B
#   CONFIG='[data]\ntcp_streams = 4\n' scripts/bench-ab.sh A B    # both agents of both
set -euo pipefail
A=$(realpath "$1") B=$(realpath "$2")
runs=${RUNS:-9} size=${SIZE:-1GiB} transport=${TRANSPORT:-tcp}
work=$(mktemp -d "${AB_DIR:-${TMPDIR:-/tmp}}/kvsync-ab.XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
printf '[cache]\nlinger = "0s"\n%b' "${CONFIG:-}" > "$work/a.toml"
[ "$transport" = rdma ] &&
    printf '[data]\nrdma_port = 0\n[transport]\nmode = "auto"\nrdma_provider = "emulated"\n' >> "$work/a.toml"
cli=()
if [ "${TLS:-0}" = 1 ]; then
    pki=$work/pki
    bash "$(dirname "$0")/bench-pki.sh" "$pki" >> "$work/a.toml"
    cli=(--tls-ca "$pki/ca.pem")
fi
{ cat "$work/a.toml"; printf "${B_CONFIG:-}"; } > "$work/b.toml"
# start BIN CONFIG NAME: prints the agent's gRPC address.
start() {
    mkdir -p "$work/$3"
    KVSYNC_LOG=warn "$1" agent --config "$2" --node-id "$3" --snapshot-dir "$work/$3" \
        --grpc-listen 127.0.0.1:0 --data-listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
        > "$work/$3.out" 2> "$work/$3.log" &
    echo $! > "$work/$3.pid"
    for _ in $(seq 400); do grep -q ready "$work/$3.out" 2>/dev/null && break; sleep 0.05; done
    grep -o 'grpc=[^ ]*' "$work/$3.out" | cut -d= -f2
}
asrc=$(start "$A" "$work/a.toml" asrc); adst=$(start "$A" "$work/a.toml" adst)
bsrc=$(start "$B" "$work/b.toml" bsrc); bdst=$(start "$B" "$work/b.toml" bdst)
for n in asrc adst bsrc bdst; do pids+=("$(cat "$work/$n.pid")"); done
"$B" gen-snapshot --size "$size" --seq 7 "$work/asrc/s.kvr1" > /dev/null
cp "$work/asrc/s.kvr1" "$work/bsrc/s.kvr1"
bytes=$(stat -c %s "$work/asrc/s.kvr1")
for g in "$asrc" "$bsrc"; do
    for _ in $(seq 600); do "$B" "${cli[@]}" snapshots --agent "$g" | grep -q s.kvr1 && break; sleep 0.05; done
done
# one BIN REPLICA SOURCE: one sync's milliseconds.
one() {
    rm -f "$work"/adst/s.kvr1* "$work"/bdst/s.kvr1*
    "$1" "${cli[@]}" sync --agent "$2" --source "$3" --transport "$transport" --wait --json |
        sed -E 's/.*"duration_ms":([0-9]+).*/\1/'
}
ticks() { awk '{print $14 + $15}' "/proc/$(cat "$work/$1.pid")/stat"; }
declare -A t0
for n in asrc adst bsrc bdst; do t0[$n]=$(ticks "$n"); done
a=(); b=()
for _ in $(seq "$runs"); do
    a+=("$(one "$A" "$adst" "$asrc")")
    b+=("$(one "$B" "$bdst" "$bsrc")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{x[NR]=$1} END {print x[int((NR+1)/2)]}'; }
ma=$(median "${a[@]}"); mb=$(median "${b[@]}")
echo "A: ${a[*]} ms (median $ma, $(awk -v b="$bytes" -v s="$ma" 'BEGIN {printf "%.0f", b / s / 1000}') MB/s)"
echo "B: ${b[*]} ms (median $mb, $(awk -v b="$bytes" -v s="$mb" 'BEGIN {printf "%.0f", b / s / 1000}') MB/s)"
echo "B/A (median time): $(awk -v a="$ma" -v b="$mb" 'BEGIN {printf "%.3f", b / a}')"
for n in asrc adst bsrc bdst; do
    echo "$n CPU per sync: $(awk -v a="$(ticks "$n")" -v b="${t0[$n]}" -v r="$runs" 'BEGIN {printf "%.2f s", (a - b) / r / 100}')"
done
