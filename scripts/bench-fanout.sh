#!/usr/bin/env bash
# Fan-out benchmark on a network that is the bottleneck: one network
# namespace per agent (the origin and N replicas) on one bridge, each
# host's egress limited with tc. Seeds N replicas with one snapshot three
# ways — one replica alone, a star (N syncs from the origin at once), a
# relay tree of degree DEGREE (default 2; `kvsync fanout`) — and prints one markdown table
# row per mode: wall time, ratio to the single replica, bytes the origin
# sent. Needs root (namespaces, tc); prints why when it cannot run.
#
#   scripts/bench-fanout.sh BIN [REPLICAS] [SIZE] [RATE]
#   e.g. scripts/bench-fanout.sh target/release/kvsync 8 512MiB 400mbit
#        DEGREE=3 scripts/bench-fanout.sh target/release/kvsync 8 512MiB 400mbit
set -euo pipefail
bin=$(realpath "$1")
n=${2:-8}
size=${3:-512MiB}
rate=${4:-400mbit}
degree=${DEGREE:-2}
if [ "$(id -u)" != 0 ] || ! ip netns add "kvf-probe-$$" 2>/dev/null; then
    echo "| (not run: network namespaces and tc need root) | | | |"
    exit 0
fi
ip netns del "kvf-probe-$$"
bash "$(dirname "$0")/deps.sh" iproute2 curl
work=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/kvsync-fanout.XXXXXX")
br="kvfbr$$"
ns() { echo "kvf$$-$1"; }
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for i in $(seq 0 "$n"); do ip netns del "$(ns "$i")" 2>/dev/null || true; done
    ip link del "$br" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# The network: a bridge in this namespace (10.78.0.254, for the CLI), one
# host per agent on it (10.78.0.1 the origin, .2… the replicas).
ip link add "$br" type bridge
ip addr add 10.78.0.254/24 dev "$br"
ip link set "$br" up
for i in $(seq 0 "$n"); do
    h=$(ns "$i")
    ip netns add "$h"
    ip link add "kvf$$h$i" type veth peer name "kvf$$b$i"
    ip link set "kvf$$h$i" netns "$h"
    ip -n "$h" link set "kvf$$h$i" name eth0
    ip -n "$h" addr add "10.78.0.$((i + 1))/24" dev eth0
    ip -n "$h" link set eth0 up
    ip -n "$h" link set lo up
    ip link set "kvf$$b$i" master "$br"
    ip link set "kvf$$b$i" up
    # What this host can send.
    ip netns exec "$h" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
done

token="kvsync-bench-token-0123456789"
echo "$token" > "$work/tokens"
cat > "$work/agent.toml" <<CONF
[grpc]
plaintext = true
[auth]
token_file = "$work/tokens"
send_token_in_clear = true
[transport]
mode = "tcp"
[cache]
linger = "0s"
CONF
if [ -n "${FANOUT_PIECE:-}" ]; then printf '[data]\npiece_size = "%s"\n' "$FANOUT_PIECE" >> "$work/agent.toml"; fi
cli=("$bin" --token-file "$work/tokens")

# start_agent I: agent I in its namespace; sets ADDR[I] (gRPC), MET[I].
declare -a ADDR MET
start_agent() {
    local i=$1 ip="10.78.0.$(($1 + 1))"
    mkdir -p "$work/a$i"
    KVSYNC_LOG=warn ip netns exec "$(ns "$i")" "$bin" agent --config "$work/agent.toml" \
        --node-id "a$i" --snapshot-dir "$work/a$i" --grpc-listen "$ip:0" \
        --data-listen "$ip:0" --metrics-listen "$ip:0" > "$work/a$i.out" 2> "$work/a$i.log" &
    pids+=($!)
    for _ in $(seq 400); do
        grep -q ready "$work/a$i.out" 2>/dev/null && break
        sleep 0.05
    done
    ADDR[i]=$(grep -o 'grpc=[^ ]*' "$work/a$i.out" | cut -d= -f2)
    MET[i]=$(grep -o 'metrics=[^ ]*' "$work/a$i.out" | cut -d= -f2)
    [ -n "${ADDR[i]}" ] || { echo "agent $i did not start" >&2; cat "$work/a$i.log" >&2; exit 1; }
}
for i in $(seq 0 "$n"); do start_agent "$i"; done
sent() {
    curl -s "http://${MET[0]}/metrics" |
        awk '$1 ~ /^kvsync_fullsync_bytes_total\{/ && $1 ~ /role="source"/ {s += $2} END {printf "%.0f", s}'
}
now() { date +%s.%N; }
clean_replicas() {
    for i in $(seq 1 "$n"); do rm -rf "${work:?}/a$i"/s.kvr1* "$work/a$i"/.kvsync-*; done
}

"$bin" gen-snapshot --size "$size" --seq 11 "$work/a0/s.kvr1" > /dev/null
bytes=$(stat -c %s "$work/a0/s.kvr1")
for _ in $(seq 1200); do
    "${cli[@]}" snapshots --agent "${ADDR[0]}" | grep -q s.kvr1 && break
    sleep 0.05
done

# One replica alone.
before=$(sent); t0=$(now)
json=$("${cli[@]}" sync --agent "${ADDR[1]}" --source "${ADDR[0]}" --transport tcp --wait --json)
t1=$(now)
echo "$json" | grep -q '"status":"succeeded"' || { echo "single sync failed: $json" >&2; exit 1; }
single=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
single_sent=$(( $(sent) - before ))

# A star: every replica from the origin at once.
clean_replicas
before=$(sent); t0=$(now)
jobs_=()
for i in $(seq 1 "$n"); do
    "${cli[@]}" sync --agent "${ADDR[i]}" --source "${ADDR[0]}" --transport tcp --wait --json > "$work/star-$i.json" &
    jobs_+=($!)
done
for j in "${jobs_[@]}"; do wait "$j"; done
t1=$(now)
if grep -L '"status":"succeeded"' "$work"/star-*.json | grep -q .; then
    echo "star sync failed" >&2; cat "$work"/star-*.json >&2; exit 1
fi
star=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
star_sent=$(( $(sent) - before ))

# A relay tree of degree $degree.
clean_replicas
replicas=()
for i in $(seq 1 "$n"); do replicas+=(--replica "${ADDR[i]}"); done
t0=$(now)
json=$("${cli[@]}" fanout --source "${ADDR[0]}" "${replicas[@]}" --degree "$degree" --transport tcp --wait --json)
t1=$(now)
echo "$json" | grep -q "\"succeeded\":$n" || { echo "fan-out failed: $json" >&2; exit 1; }
tree=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
tree_sent=$(echo "$json" | sed -E 's/.*"origin_bytes_sent":([0-9]+).*/\1/')
for i in $(seq 1 "$n"); do cmp -s "$work/a0/s.kvr1" "$work/a$i/s.kvr1" || { echo "replica $i differs" >&2; exit 1; }; done

row() { # mode seconds sent
    awk -v m="$1" -v s="$2" -v one="$single" -v b="$3" -v size="$bytes" \
        'BEGIN {printf "| %s | %.1f s | %.2f | %.1f × the snapshot |\n", m, s, s / one, b / size}'
}
row "1 replica alone" "$single" "$single_sent"
row "$n replicas, star" "$star" "$star_sent"
row "$n replicas, relay tree of degree $degree" "$tree" "$tree_sent"
awk -v t="$tree" -v one="$single" -v s="$star" \
    -v d="$degree" 'BEGIN {printf "| tree / single = %.2f (target ≤ 1.6 at degree 2; %d is the floor at degree %d); tree / star = %.2f (target ≤ 0.35) | | | |\n", t / one, d, d, t / s}'
