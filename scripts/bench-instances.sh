#!/usr/bin/env bash
# Many KV instances on one host: N instances of SIZE each seeded at once,
# by one agent pair serving all N (`[[instance]]` tables) and by N separate
# agent pairs (one instance each), alternating, on loopback over TCP.
# Prints one markdown row per mode: median wall time from the first
# StartFullSync to the last sync's end, and the agents' total peak RSS
# (VmHWM of every agent process of the run, summed), then the ratios.
#
#   scripts/bench-instances.sh BIN [N] [SIZE] [RUNS]
#   e.g. scripts/bench-instances.sh target/release/kvsync 8 256MiB 5
set -euo pipefail
bin=$(realpath "$1")
n=${2:-8}
size=${3:-256MiB}
runs=${4:-5}
work=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/kvsync-instances.XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

for i in $(seq "$n"); do
    mkdir -p "$work/src/i$i"
    "$bin" gen-snapshot --size "$size" --seq "$i" "$work/src/i$i/s.kvr1" > /dev/null
done

agent_head() {
    printf 'node_id = "%s"\ncreate_dirs = true\n[grpc]\nlisten = "127.0.0.1:0"\n[data]\ntcp_listen = "127.0.0.1:0"\nrdma_port = 0\n[metrics]\nlisten = ""\n[transport]\nmode = "tcp"\n[sync]\nmax_incoming_syncs = %s\nmax_outgoing_syncs = %s\n' "$1" "$n" "$n"
}
instance() { # NAME DIR
    printf '\n[[instance]]\nname = "%s"\nsnapshot_dir = "%s"\n' "$1" "$2"
}

# start NAME CONFIG: starts an agent, records its pid; sets ADDR to its
# gRPC address.
started=()
start() {
    KVSYNC_LOG=warn "$bin" agent --config "$2" > "$work/$1.out" 2> "$work/$1.log" &
    local pid=$!
    pids+=("$pid")
    started+=("$pid")
    for _ in $(seq 600); do
        grep -q "ready" "$work/$1.out" 2>/dev/null && break
        sleep 0.05
    done
    ADDR=$(grep -o 'grpc=[^ ]*' "$work/$1.out" | cut -d= -f2)
}

# stop_all: stops the agents started since the last call; sets KIB to
# their summed peak RSS (VmHWM).
stop_all() {
    KIB=0
    for p in "${started[@]}"; do
        KIB=$((KIB + $(awk '/VmHWM/ {print $2}' "/proc/$p/status")))
        kill "$p"
    done
    for p in "${started[@]}"; do wait "$p" 2>/dev/null || true; done
    started=()
}

# sync_all SOURCE... : one sync per instance at once (pairs of replica
# address, source address, instance name on stdin); waits for all.
sync_all() {
    local jobs=()
    while read -r replica source name; do
        "$bin" sync --agent "$replica" --source "$source" ${name:+--instance "$name"} \
            --transport tcp --wait --json > "$work/sync-$RANDOM.json" &
        jobs+=($!)
    done
    local failed=0
    for j in "${jobs[@]}"; do wait "$j" || failed=1; done
    return $failed
}

now() { date +%s.%N; }

one_pair() {
    rm -rf "$work/dst"
    { agent_head src; for i in $(seq "$n"); do instance "i$i" "$work/src/i$i"; done; } > "$work/src.toml"
    { agent_head dst; for i in $(seq "$n"); do mkdir -p "$work/dst/i$i"; instance "i$i" "$work/dst/i$i"; done; } > "$work/dst.toml"
    local s r t0 t1
    start src "$work/src.toml"
    s=$ADDR
    start dst "$work/dst.toml"
    r=$ADDR
    # Both agents offer every snapshot before the clock starts.
    for i in $(seq "$n"); do
        until "$bin" snapshots --agent "$s" --instance "i$i" --json | grep -q '"seq"'; do sleep 0.05; done
    done
    t0=$(now)
    for i in $(seq "$n"); do echo "$r $s i$i"; done | sync_all
    t1=$(now)
    stop_all
    RESULT="$(echo "$t1 - $t0" | bc) $KIB"
}

separate_pairs() {
    rm -rf "$work/dst"
    local lines=() s r t0 t1
    for i in $(seq "$n"); do
        mkdir -p "$work/dst/i$i"
        { agent_head "src$i"; instance default "$work/src/i$i"; } > "$work/src$i.toml"
        { agent_head "dst$i"; instance default "$work/dst/i$i"; } > "$work/dst$i.toml"
        start "src$i" "$work/src$i.toml"
        s=$ADDR
        start "dst$i" "$work/dst$i.toml"
        r=$ADDR
        until "$bin" snapshots --agent "$s" --json | grep -q '"seq"'; do sleep 0.05; done
        lines+=("$r $s")
    done
    t0=$(now)
    printf '%s\n' "${lines[@]}" | sync_all
    t1=$(now)
    stop_all
    RESULT="$(echo "$t1 - $t0" | bc) $KIB"
}

median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

: > "$work/one"
: > "$work/sep"
for _ in $(seq "$runs"); do
    one_pair
    echo "$RESULT" >> "$work/one"
    separate_pairs
    echo "$RESULT" >> "$work/sep"
done
t_one=$(cut -d' ' -f1 "$work/one" | median)
t_sep=$(cut -d' ' -f1 "$work/sep" | median)
m_one=$(cut -d' ' -f2 "$work/one" | median)
m_sep=$(cut -d' ' -f2 "$work/sep" | median)
echo "| mode ($n instances × $size, TCP, loopback) | wall time (median of $runs) | agents' peak RSS, summed |"
echo "|---|---|---|"
printf '| one agent pair, %s instances each | %.2f s | %.0f MiB |\n' "$n" "$t_one" "$(echo "$m_one / 1024" | bc -l)"
printf '| %s agent pairs, one instance each | %.2f s | %.0f MiB |\n' "$n" "$t_sep" "$(echo "$m_sep / 1024" | bc -l)"
printf '| one pair / %s pairs | %.2f | %.2f |\n' "$n" "$(echo "$t_one / $t_sep" | bc -l)" "$(echo "$m_one / $m_sep" | bc -l)"
