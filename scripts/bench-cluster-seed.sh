#!/usr/bin/env bash
# A new replica node for one shard of a cluster, two ways in one run:
#   1. kvsync: the shard primary's RDB (saved by BGSAVE beforehand, as a
#      primary's own save schedule would) sent by the source agent beside
#      it to the replica's agent, whose `redis` handoff writes the new
#      node's nodes.conf, starts it, and joins it by CLUSTER MEET after a
#      partial resync;
#   2. the cluster's own way: an empty node, CLUSTER MEET, CLUSTER
#      REPLICATE: the primary forks and full-syncs it.
# The cluster: three shard primaries on loopback (a third of the slots
# each) and a replica of the first (so that it has a backlog, as any shard
# with a replica does). The first shard holds KEYS keys of SIZE bytes in
# one hash tag (DEBUG POPULATE; keys in slots the shard owns).
# Each time runs from the request (`kvsync sync`; CLUSTER REPLICATE) until
# the new node is listed as the primary's replica and holds its offset.
# Prints what each cost the primary (forks, copy-on-write, full and partial
# syncs) and a markdown row: server | dataset | kvsync | CLUSTER REPLICATE |
# ratio | primary forks (kvsync / REPLICATE) | copy-on-write | cores.
# With GAP=MiB, the primary writes that much after the save into a
# backlog of 1 MiB, so that it no longer holds the RDB's offset: both
# agents keep a stream log (the source's following the primary, started
# before the save; the replica's following the source's), and the replica's
# agent feeds the node the gap before the MEET. CLUSTER REPLICATE is timed
# on the same primary afterwards.
# Usage: scripts/bench-cluster-seed.sh [KEYS=1000000] [SIZE=100]
#        (BENCHMARKS.md: 10000000 100; SERVER=valkey for Valkey 8;
#        GAP=200 for the gap through the agent)
# KVSYNC_BIN=path uses that kvsync binary instead of building a release one.
# Everything it starts (servers, agents) is stopped when it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/servers.sh
keys=${1:-1000000}
size=${2:-100}
srv=${SERVER:-redis}
gap_mib=${GAP:-0}
case "$srv" in
    redis) bash scripts/deps.sh redis-server bc ;;
    valkey) bash scripts/deps.sh valkey-server/backports valkey-tools/backports bc ;;
    *) echo "SERVER must be redis or valkey, not $srv" >&2; exit 2 ;;
esac
server_bin=$srv-server cli=$srv-cli
if [ -n "${KVSYNC_BIN:-}" ]; then
    bin=$KVSYNC_BIN
else
    cargo build --locked --release --quiet
    bin=$PWD/target/release/kvsync
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvsync-cluster.XXXXXX")
cleanup() {
    stop_servers "$work"
    [ -f "$work/agents" ] && xargs -r kill <"$work/agents" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# Ports below the ephemeral range; each node's bus port is its port + 10000.
low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
base=$((10000 + RANDOM % (low - 20010)))
P0=$base P1=$((base + 1)) P2=$((base + 2)) R=$((base + 3)) K=$((base + 4)) C=$((base + 5)) F=$((base + 6))
cluster_args() { # PORT DIR: sets args to a cluster node's arguments
    args=(--port "$1" --bind 127.0.0.1 --dir "$2" --dbfilename dump.rdb --save "" --appendonly no
        --cluster-enabled yes --cluster-config-file nodes.conf --cluster-allow-replica-migration no
        --repl-backlog-size 1gb --repl-diskless-sync yes --repl-diskless-sync-delay 0
        --daemonize yes --pidfile "$2/redis.pid" --logfile "$2/redis.log")
}
node() { # NAME PORT [ARGS...]: a daemonized cluster node in $work/NAME
    local name=$1 port=$2; shift 2
    mkdir -p "$work/$name"
    cluster_args "$port" "$work/$name"
    $server_bin "${args[@]}" "$@"
    for _ in $(seq 200); do $cli -p "$port" ping >/dev/null 2>&1 && return; sleep 0.05; done
    echo "$name did not start on port $port:" >&2; tail -5 "$work/$name/redis.log" >&2; exit 1
}
field() { $cli -p "$1" info "$2" | tr -d '\r' | awk -F: -v k="$3" '$1 == k {print $2}'; }
now() { date +%s.%N; }
id_of() { $cli -p "$1" cluster myid; }
until_true() { # WHAT COMMAND...: polls COMMAND every 10 ms, at most 1 h
    local what=$1; shift
    for _ in $(seq 360000); do "$@" && return; sleep 0.01; done
    echo "timed out waiting for $what" >&2; exit 1
}
cluster_ok() { $cli -p "$1" cluster info | grep -q cluster_state:ok; }
replica_of_primary() { # PORT: the primary lists the node on PORT as its replica, at its offset
    local id; id=$(id_of "$1")
    $cli -p $P0 cluster nodes | grep "^$id " | grep -q "slave[a-z,]* $(id_of $P0)" &&
        [ "$(field "$1" replication master_link_status)" = up ] &&
        [ "$(field "$1" replication slave_repl_offset)" -ge "$(field $P0 replication master_repl_offset)" ]
}
stats() { echo "sync_full=$(field $P0 stats sync_full) sync_partial_ok=$(field $P0 stats sync_partial_ok) total_forks=$(field $P0 stats total_forks)"; }

echo "== a $srv cluster: three shards, a replica of the first; $keys keys of $size bytes in the first"
node shard0 $P0 --enable-debug-command yes
node shard1 $P1
node shard2 $P2
$cli -p $P0 cluster addslotsrange 0 5460 >/dev/null
$cli -p $P1 cluster addslotsrange 5461 10922 >/dev/null
$cli -p $P2 cluster addslotsrange 10923 16383 >/dev/null
for i in 0 1 2; do $cli -p $((base + i)) cluster set-config-epoch $((i + 1)) >/dev/null; done
$cli -p $P0 cluster meet 127.0.0.1 $P1 >/dev/null
$cli -p $P0 cluster meet 127.0.0.1 $P2 >/dev/null
# DEBUG POPULATE blocks the primary longer than the node timeout: its
# replica must not take over meanwhile.
node replica0 $R --cluster-replica-no-failover yes
$cli -p $R cluster meet 127.0.0.1 $P0 >/dev/null
until_true "the replica to know the first shard" sh -c "$cli -p $R cluster nodes | grep -q $(id_of $P0)"
$cli -p $R cluster replicate "$(id_of $P0)" >/dev/null
until_true "the cluster" sh -c "$cli -p $P0 cluster info | grep -q cluster_state:ok && $cli -p $P1 cluster info | grep -q cluster_state:ok && $cli -p $P2 cluster info | grep -q cluster_state:ok"
until_true "the first replica's link" sh -c "$cli -p $R info replication | grep -q master_link_status:up"
tag=$(for t in $(seq 0 99); do [ "$($cli -p $P0 cluster keyslot "{t$t}")" -le 5460 ] && { echo "{t$t}"; break; }; done)
$cli -p $P0 debug populate "$keys" "${tag}key" "$size" >/dev/null
follows() { "$bin" status --agent "$1" | grep -q ": following"; }
src_stream='' dst_stream=''
if [ "$gap_mib" -gt 0 ]; then
    # The source's log starts with a full resync of the primary (its one
    # fork for the log, before the save and the timed runs).
    src_stream="[stream]
dir = \"$work/source-log\""
fi
src=$(agent source "node_id = \"source\"
create_dirs = true
snapshot_dir = \"$work/shard0\"
snapshot_format = \"redis-rdb\"
$agent_listen
[redis]
primary_addr = \"127.0.0.1:$P0\"
$src_stream")
[ "$gap_mib" -gt 0 ] && until_true "the source's log to follow the primary" follows "$src"
for _ in $(seq 600); do
    [ "$($cli -p $P0 bgsave)" = "Background saving started" ] && break
    sleep 0.05
done
until_true "BGSAVE" sh -c "$cli -p $P0 info persistence | grep -q rdb_bgsave_in_progress:0"
for i in $(seq 100); do $cli -p $P0 set "${tag}after:$i" "written after the save" >/dev/null; done
dataset_mib=$(( $(field $P0 memory used_memory) / 1048576 ))
rdb_mib=$(( $(stat -c %s "$work/shard0/dump.rdb") / 1048576 ))
echo "dataset: used_memory $dataset_mib MiB; RDB $rdb_mib MiB; $("$bin" verify "$work/shard0/dump.rdb")"

# The replica agent's feed, at a fixed port (the gap path needs one).
[ "$gap_mib" -gt 0 ] && dst_stream="seed_listen = \"127.0.0.1:$F\"
[stream]
dir = \"$work/replica-log\"
upstream = \"$src\""
mkdir -p "$work/replica-agent" "$work/kvsync-node"
cluster_args $K "$work/kvsync-node"
start=$(for a in $server_bin "${args[@]}"; do printf '"%s", ' "$a"; done)
dst=$(agent replica "node_id = \"replica\"
create_dirs = true
snapshot_dir = \"$work/replica-agent\"
snapshot_format = \"redis-rdb\"
$agent_listen
[handoff]
mode = \"redis\"
timeout = \"1h\"
[redis]
server_addr = \"127.0.0.1:$K\"
dir = \"$work/kvsync-node\"
dbfilename = \"dump.rdb\"
primary = \"127.0.0.1:$P0\"
start = [${start%, }]
$dst_stream")
for _ in $(seq 400); do "$bin" snapshots --agent "$src" 2>/dev/null | grep -q dump.rdb && break; sleep 0.05; done
if [ "$gap_mib" -gt 0 ]; then
    until_true "the replica's log to follow the source's" follows "$dst"
    $cli -p $P0 config set repl-backlog-size 1mb >/dev/null
    echo "== the primary writes $gap_mib MiB after the save (1000-byte values, backlog 1 MiB)"
    awk -v t="${tag}gap:" -v n=$((gap_mib * 1024)) 'BEGIN {
        v = sprintf("%1000s", ""); gsub(/ /, "g", v)
        for (i = 0; i < n; i++) { k = t i; printf "*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1000\r\n%s\r\n", length(k), k, v } }' |
        $cli -p $P0 --pipe >/dev/null
    seq_m=$("$bin" verify "$work/shard0/dump.rdb" | grep -o '(M) [0-9]*' | cut -d' ' -f2 || true)
    echo "primary backlog now starts at $(field $P0 replication repl_backlog_first_byte_offset) (RDB offset ${seq_m:-?})"
    logged() { "$bin" status --agent "$dst" | grep -q "offsets [0-9]*\.\.$(field $P0 replication master_repl_offset) "; }
    until_true "the replica's log to hold the primary's writes" logged
fi
sleep 2.5 # the source's backlog guard measures the write rate over [redis] rate_window (2 s)

echo "== kvsync: the new node seeded from the primary's RDB (primary before: $(stats))"
forks0=$(field $P0 stats total_forks)
t0=$(now)
if ! "$bin" sync --agent "$dst" --source "$src" --wait --json >"$work/sync.json"; then
    echo "the kvsync seeding failed:" >&2; cat "$work/sync.json" >&2; exit 1
fi
grep -o '"handoff": *"[^"]*"' "$work/sync.json"
until_true "the kvsync-seeded node to join" replica_of_primary $K
t1=$(now)
echo "primary after: $(stats)"
seed_s=$(echo "$t1 - $t0" | bc)
seed_forks=$(( $(field $P0 stats total_forks) - forks0 ))

echo "== CLUSTER REPLICATE: an empty node (primary before: $(stats))"
node copy $C
forks0=$(field $P0 stats total_forks)
t0=$(now)
$cli -p $C cluster meet 127.0.0.1 $P0 >/dev/null
until_true "the empty node to know the primary" sh -c "$cli -p $C cluster nodes | grep -q $(id_of $P0)"
$cli -p $C cluster replicate "$(id_of $P0)" >/dev/null
until_true "the CLUSTER REPLICATE node to sync" replica_of_primary $C
t1=$(now)
echo "primary after: $(stats); rdb_last_cow_size=$(field $P0 persistence rdb_last_cow_size)"
full_s=$(echo "$t1 - $t0" | bc)
full_forks=$(( $(field $P0 stats total_forks) - forks0 ))
cow_mib=$(( $(field $P0 persistence rdb_last_cow_size) / 1048576 ))
echo "== keys: primary $($cli -p $P0 dbsize), kvsync-seeded $($cli -p $K dbsize), CLUSTER REPLICATE $($cli -p $C dbsize); cluster_state: $(cluster_ok $K && echo ok) / $(cluster_ok $C && echo ok)"
awk -v srv="$srv" -v s="$seed_s" -v f="$full_s" -v k="$keys" -v z="$size" -v r="$rdb_mib" -v m="$dataset_mib" \
    -v c="$(nproc)" -v sf="$seed_forks" -v ff="$full_forks" -v cow="$cow_mib" \
    -v g="$([ "$gap_mib" -gt 0 ] && echo ", a gap of $gap_mib MiB past a 1 MiB backlog")" 'BEGIN {
    printf "| %s | %d keys x %d B (used_memory %d MiB, RDB %d MiB)%s | %.2f s | %.2f s | %.2f | %d / %d | 0 / %d MiB | %d cores |\n",
        srv, k, z, m, r, g, s, f, s/f, sf, ff, cow, c }'
