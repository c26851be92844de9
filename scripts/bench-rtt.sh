#!/usr/bin/env bash
# One sync over a long link: 1 TCP stream vs 4 ([data] tcp_streams) vs
# "auto" (which the source's 4 cap), side by side, alternating. Two agents
# in two network namespaces joined by a veth pair whose both ends delay
# every packet (tc netem), so the round trip is RTT_MS. Needs root and a kernel with veth and sch_netem: bench.sh runs it
# inside the soft-RoCE VM (scripts/rxe-vm.sh), whose Debian kernel has both.
#
#   [PIECE=4MiB] [RMEM=BYTES] [LOSS=PERCENT] scripts/bench-rtt.sh KVSYNC_BIN [SIZE] [RUNS] [RTT_MS]
#
# Prints one Markdown table row:
# | RTT | snapshot | 1 stream | 4 streams | 4 / 1 | auto | auto / 4 |
set -euo pipefail
bin=$1
size=${2:-256MiB}
runs=${3:-3}
rtt=${4:-100}
# Pieces the streams take from their shared queue: 4 MiB gives a 128 MiB
# snapshot 32, enough for a stream that falls behind to be left fewer.
piece=${PIECE:-4MiB}
work=$(mktemp -d /tmp/kvsync-rtt.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    ip link del rtt-a 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# The replica's namespace, held by a process; its end of the veth pair.
unshare -n sleep infinity &
holder=$!
pids+=("$holder")
ns() { nsenter -t "$holder" -n "$@"; }
ip link add rtt-a type veth peer name rtt-b
ip link set rtt-b netns "$holder"
ip addr add 10.77.0.1/24 dev rtt-a
ip link set rtt-a up
ns ip addr add 10.77.0.2/24 dev rtt-b
ns ip link set rtt-b up
ns ip link set lo up
half=$((rtt / 2))
# LOSS=PERCENT drops that share of the packets each way: each stream backs
# off on its own losses, so streams fall behind each other.
loss=()
[ -n "${LOSS:-}" ] && loss=(loss "${LOSS}%")
tc qdisc add dev rtt-a root netem delay "${half}ms" "${loss[@]}" limit 100000
ns tc qdisc add dev rtt-b root netem delay "${half}ms" "${loss[@]}" limit 100000
# RMEM=BYTES caps the TCP receive buffer on both sides, so one stream's
# window (not the VM's emulated CPUs, which verify every byte) is what
# limits it: a long fat link scaled down to rates the VM can check.
if [ -n "${RMEM:-}" ]; then
    echo "4096 131072 $RMEM" > /proc/sys/net/ipv4/tcp_rmem
    ns sh -c "echo '4096 131072 $RMEM' > /proc/sys/net/ipv4/tcp_rmem"
fi

echo "kvsync-rtt-bench-token-0123456789" > "$work/token"
# agent NAME IP STREAMS [ns]: starts an agent; sets GRPC_<NAME>.
agent() {
    local name=$1 ip=$2 streams=$3
    mkdir -p "$work/$name"
    cat > "$work/$name.toml" <<EOF
node_id = "$name"
create_dirs = true
snapshot_dir = "$work/$name"
[grpc]
listen = "$ip:0"
plaintext = true
[data]
tcp_listen = "$ip:0"
tcp_streams = $streams
piece_size = "$piece"
[metrics]
listen = "127.0.0.1:0"
[auth]
token_file = "$work/token"
send_token_in_clear = true
[transport]
mode = "tcp"
[cache]
linger = "0s"
EOF
    shift 3
    KVSYNC_LOG=warn "$@" "$bin" agent --config "$work/$name.toml" > "$work/$name.out" 2> "$work/$name.log" &
    pids+=($!)
    for _ in $(seq 600); do
        grep -q ready "$work/$name.out" 2>/dev/null && break
        sleep 0.05
    done
    local grpc
    grpc=$(grep -o 'grpc=[^ ]*' "$work/$name.out" | cut -d= -f2)
    [ -n "$grpc" ] || { echo "agent $name did not start" >&2; cat "$work/$name.log" >&2; exit 1; }
    eval "GRPC_$name=$grpc"
}
agent source 10.77.0.1 4
agent one 10.77.0.2 1 nsenter -t "$holder" -n
agent four 10.77.0.2 4 nsenter -t "$holder" -n
agent auto 10.77.0.2 '"auto"' nsenter -t "$holder" -n
cli=("$bin" --token-file "$work/token")
"$bin" gen-snapshot --size "$size" --seq 3 "$work/source/s.kvr1" > /dev/null
for _ in $(seq 600); do
    "${cli[@]}" snapshots --agent "$GRPC_source" | grep -q s.kvr1 && break
    sleep 0.05
done
# secs REPLICA: one sync's seconds (the CLI reaches the replica in its namespace).
secs() {
    local json
    json=$(ns "${cli[@]}" sync --agent "$1" --source "$GRPC_source" --transport tcp --wait --json)
    echo "$json" | grep -q '"status":"succeeded"' || { echo "sync failed: $json" >&2; exit 1; }
    rm -f "$work"/one/s.kvr1* "$work"/four/s.kvr1* "$work"/auto/s.kvr1*
    echo "$json" | grep -o 'tcp_streams = auto: [0-9]* of [0-9]*' | sed 's/^/# /' >&2 || true
    echo "$json" | sed -E 's/.*"duration_ms":([0-9]+).*/\1/' | awk '{print $1 / 1000}'
}
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
one_s=(); four_s=(); auto_s=()
for _ in $(seq "$runs"); do
    one_s+=("$(secs "$GRPC_one")")
    four_s+=("$(secs "$GRPC_four")")
    auto_s+=("$(secs "$GRPC_auto")")
done
bytes=$(stat -c %s "$work/source/s.kvr1")
o=$(median "${one_s[@]}"); f=$(median "${four_s[@]}"); a=$(median "${auto_s[@]}")
mbps() { awk -v b="$bytes" -v s="$1" 'BEGIN {printf "%.0f", b / s / 1e6}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
echo "| ${rtt} ms | $size | $(mbps "$o") MB/s | $(mbps "$f") MB/s | $(ratio "$o" "$f") | $(mbps "$a") MB/s | $(ratio "$f" "$a") |"
echo "rtt bench runs: one ${one_s[*]}; four ${four_s[*]}; auto ${auto_s[*]}"
