#!/usr/bin/env bash
# Seeds a Redis replica with kvsync on one machine, then (as a benchmark)
# compares it with Redis's own full sync of an empty replica, same run:
#   1. a primary (with a replication backlog) holding KEYS keys of SIZE bytes,
#      saved with BGSAVE, then written to some more;
#   2. a source agent watching the primary's dir, a replica agent with the
#      `redis` handoff, and a replica server: `kvsync sync` seeds it and it
#      continues with a partial resync;
#   3. an empty server started with `replicaof`: Redis's own full sync.
# Prints the time until each replica is up with master_link_status:up, and
# what each cost the primary (forks, copy-on-write, sync_full/partial), and
# a markdown row: dataset | kvsync seeding | Redis full sync | ratio |
# primary forks (kvsync / Redis) | primary copy-on-write (kvsync / Redis).
# Usage: scripts/redis-seed-demo.sh [KEYS=100000] [SIZE=100]
#        (1 GB dataset: scripts/redis-seed-demo.sh 10000000 100)
# Under write load: WRITE_RATE=<bytes/s> runs a writer (examples/redis_writer,
# 1 KiB values) against the primary from just before the kvsync seeding to
# the end, through both seedings; BACKLOG (default 256mb) sets the primary's repl-backlog-size,
# and the source agent may grow it ([redis] grow_backlog).
# AVAILABILITY=1 also measures what a client polling each replica sees
# (examples/redis_poller: seconds of errors such as -LOADING, or no
# connection) during the `redis` seeding, Redis's full sync, and a third
# seeding with `redis-replicate` of a server already replicating the primary
# with repl-diskless-load swapdb; a second markdown row: dataset | redis |
# redis-replicate + swapdb | Redis full sync | cores.
# SERVER=valkey runs Valkey (8.0, from Debian's backports) instead of Redis,
# and times a third full sync in the same run: Valkey's dual-channel
# replication (both ends dual-channel-replication-enabled, diskless sync,
# delay 0), with its forks and copy-on-write; its row adds: dual-channel
# full sync | ratio | forks | copy-on-write.
# HANDOFF=redis-replicate seeds the replica's running server over the
# replication protocol (it loads the RDB while the rest still arrives)
# instead of restarting it on the installed file (the default, `redis`).
# REPL_LOAD=<disabled|on-empty-db|swapdb> sets repl-diskless-load on every
# empty replica the run times (kvsync's, the full syncs'), alike.
# The source agent runs as a service would, up before it is asked: the timed
# seeding starts once it has run a `[redis] rate_window` (2 s) and a meter
# reading, so its backlog guard knows the primary's write rate without
# waiting. COLD_AGENT=1 times it right after the agents start instead.
# KVSYNC_BIN=path uses that kvsync binary instead of building a release one.
# SERVER_TLS=1 (with HANDOFF=redis-replicate) puts every replication link
# over TLS: each server gets a TLS port (port+1000) with tls-auth-clients
# and tls-replication, which the full syncs' replicas, the agents and the
# seeded server use.
# Everything it starts (servers, agents) is stopped when it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/servers.sh
keys=${1:-100000}
size=${2:-100}
srv=${SERVER:-redis}
case "$srv" in
    redis) bash scripts/deps.sh redis-server bc ;;
    valkey) bash scripts/deps.sh valkey-server/backports valkey-tools/backports bc ;;
    *) echo "SERVER must be redis or valkey, not $srv" >&2; exit 2 ;;
esac
server_bin=$srv-server cli=$srv-cli
write_rate=${WRITE_RATE:-0}
backlog=${BACKLOG:-256mb}
handoff=${HANDOFF:-redis}
case "$handoff" in
    redis | redis-replicate) ;;
    *) echo "HANDOFF must be redis or redis-replicate, not $handoff" >&2; exit 2 ;;
esac
load_args=()
[ -n "${REPL_LOAD:-}" ] && load_args=(--repl-diskless-load "$REPL_LOAD")
if [ -n "${KVSYNC_BIN:-}" ]; then
    bin=$KVSYNC_BIN
else
    cargo build --locked --release --quiet
    bin=$PWD/target/release/kvsync
fi
if [ "$write_rate" != 0 ]; then
    cargo build --locked --release --quiet --example redis_writer
fi
availability=${AVAILABILITY:-0}
if [ "$availability" = 1 ]; then
    cargo build --locked --release --quiet --example redis_poller
fi
if [ -n "${SERVER_TLS:-}" ] && [ "$handoff" = redis ]; then
    echo "SERVER_TLS=1 needs HANDOFF=redis-replicate (the redis handoff's start command has no TLS port)" >&2
    exit 2
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvsync-redis.XXXXXX")
server_tls_setup "$work/tls"
cleanup() {
    stop_servers "$work"
    # Agents start inside $(agent ...) subshells, which `jobs` cannot see:
    # each records its pid in $work/agents.
    [ -f "$work/agents" ] && xargs -r kill <"$work/agents" 2>/dev/null || true
    jobs -p | xargs -r kill 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# redis-server cannot listen on port 0: ports below the kernel's ephemeral
# range, so that no client connection (redis-cli's) already holds one.
low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
base=$((10000 + RANDOM % (low - 10004)))
P=$base; A=$((base + 1)); B=$((base + 2)); H=$((base + 3))
server() { # NAME PORT [ARGS...]: a daemonized server in $work/NAME
    local name=$1 port=$2; shift 2
    mkdir -p "$work/$name"
    $server_bin --port "$port" --bind 127.0.0.1 --dir "$work/$name" --save "" --appendonly no \
        --daemonize yes --pidfile "$work/$name/redis.pid" --logfile "$work/$name/redis.log" $(tls_args "$port") "$@"
    for _ in $(seq 200); do $cli -p "$port" ping >/dev/null 2>&1 && return; sleep 0.05; done
    echo "redis $name did not start on port $port:" >&2; tail -5 "$work/$name/redis.log" >&2; exit 1
}
field() { $cli -p "$1" info "$2" | tr -d '\r' | awk -F: -v k="$3" '$1 == k {print $2}'; }
wait_link() { # PORT: until master_link_status:up
    for _ in $(seq 36000); do [ "$(field "$1" replication master_link_status)" = up ] && return; sleep 0.01; done
    echo "replica on $1 never linked" >&2; exit 1
}
now() { date +%s.%N; }
poll() { # PORT: a client polling the server on PORT, until unpoll PORT
    [ "$availability" = 1 ] || return 0
    target/release/examples/redis_poller "127.0.0.1:$1" key:1 "$work/stop.$1" >"$work/poll.$1" &
    echo $! >"$work/poller.$1"
}
unpoll() { # PORT: stops its poller; prints the seconds it saw the server unavailable
    [ "$availability" = 1 ] || return 0
    touch "$work/stop.$1"
    wait "$(cat "$work/poller.$1")"
    sed -E 's/.*unavailable_s=([0-9.]+).*/\1/' "$work/poll.$1"
}

echo "== primary: $keys keys of $size bytes"
# Diskless sync without delay: the server's own full sync starts at once
# (fair timing).
server primary $P --repl-backlog-size "$backlog" --repl-diskless-sync yes --repl-diskless-sync-delay 0 --enable-debug-command yes
server helper $H --replicaof 127.0.0.1 "$(kv_port $P)"   # a replica once: the backlog exists
wait_link $H
$cli -p $H shutdown nosave >/dev/null 2>&1 || true
$cli -p $P debug populate "$keys" key "$size" >/dev/null
# The fork that served the helper may still be running: BGSAVE is refused
# until it is reaped.
for _ in $(seq 600); do
    [ "$($cli -p $P bgsave)" = "Background saving started" ] && break
    sleep 0.05
done
while [ "$(field $P persistence rdb_bgsave_in_progress)" != 0 ]; do sleep 0.05; done
[ "$(field $P persistence rdb_last_bgsave_status)" = ok ] && [ -f "$work/primary/dump.rdb" ] ||
    { echo "the primary's BGSAVE failed" >&2; exit 1; }
for i in $(seq 100); do $cli -p $P set "after:$i" "written after the save" >/dev/null; done
dataset_mib=$(( $(field $P memory used_memory) / 1048576 ))
echo "dataset: used_memory $dataset_mib MiB; RDB: $(stat -c %s "$work/primary/dump.rdb") bytes; $("$bin" verify "$work/primary/dump.rdb")"

src_up=$(now)
src=$(agent source "node_id = \"source\"
create_dirs = true
snapshot_dir = \"$work/primary\"
snapshot_format = \"redis-rdb\"
$agent_listen
[redis]
primary_addr = \"127.0.0.1:$(kv_port $P)\"
$redis_tls
grow_backlog = true")
mkdir -p "$work/replica-agent" "$work/a"
if [ "$handoff" = redis ]; then
    redis_section="[redis]
server_addr = \"127.0.0.1:$A\"
dir = \"$work/a\"
dbfilename = \"dump.rdb\"
primary = \"127.0.0.1:$P\"
start = [\"$server_bin\", \"--port\", \"$A\", \"--bind\", \"127.0.0.1\", \"--dir\", \"{dir}\", \"--dbfilename\", \"{dbfilename}\", \"--replicaof\", \"{primary_host}\", \"{primary_port}\", \"--appendonly\", \"no\", \"--save\", \"\", \"--daemonize\", \"yes\", \"--pidfile\", \"$work/a/redis.pid\", \"--logfile\", \"$work/a/redis.log\"]"
else
    redis_section="[redis]
server_addr = \"127.0.0.1:$(kv_port $A)\"
primary = \"127.0.0.1:$(kv_port $P)\"
$redis_tls"
fi
dst=$(agent replica "node_id = \"replica\"
create_dirs = true
snapshot_dir = \"$work/replica-agent\"
snapshot_format = \"redis-rdb\"
$agent_listen
[handoff]
mode = \"$handoff\"
timeout = \"1h\"
$redis_section")
server a $A "${load_args[@]}"   # the replica's server, standalone until seeded
for _ in $(seq 400); do "$bin" snapshots --agent "$src" | grep -q dump.rdb && break; sleep 0.05; done

load=""
if [ "$write_rate" != 0 ]; then
    target/release/examples/redis_writer "127.0.0.1:$P" "$write_rate" 1024 &
    load=", writer $((write_rate / 1048576)) MiB/s, backlog $backlog"
fi
[ "$handoff" = redis ] || load="$load, $handoff"
[ -n "${REPL_LOAD:-}" ] && load="$load, repl-diskless-load $REPL_LOAD"
stats() { echo "sync_full=$(field $P stats sync_full) sync_partial_ok=$(field $P stats sync_partial_ok) total_forks=$(field $P stats total_forks)"; }
echo "== kvsync seeding, $handoff handoff${REPL_LOAD:+, repl-diskless-load $REPL_LOAD} (primary before: $(stats))"
forks0=$(field $P stats total_forks)
poll $A
if [ -z "${COLD_AGENT:-}" ]; then
    warm=$(echo "2.5 - ($(now) - $src_up)" | bc)
    [ "${warm#-}" = "$warm" ] && sleep "$warm"
fi
t0=$(now)
"$bin" sync --agent "$dst" --source "$src" --wait --json
t1=$(now)
down_redis=$(unpoll $A)
echo "primary after: $(stats); repl-backlog-size $($cli -p $P config get repl-backlog-size | tail -1)"
seed_s=$(echo "$t1 - $t0" | bc)
seed_forks=$(( $(field $P stats total_forks) - forks0 ))

echo "== $srv's own full sync of an empty replica (primary before: $(stats))"
forks0=$(field $P stats total_forks)
server b $B "${load_args[@]}"
poll $B
t0=$(now)
$cli -p $B replicaof 127.0.0.1 "$(kv_port $P)" >/dev/null
wait_link $B
t1=$(now)
down_full=$(unpoll $B)
echo "primary after: $(stats); rdb_last_cow_size=$(field $P persistence rdb_last_cow_size)"
full_s=$(echo "$t1 - $t0" | bc)
full_forks=$(( $(field $P stats total_forks) - forks0 ))
cow_mib=$(( $(field $P persistence rdb_last_cow_size) / 1048576 ))

dual=""
if [ "$srv" = valkey ]; then
    echo "== Valkey dual-channel full sync of an empty replica (primary before: $(stats))"
    $cli -p $P config set dual-channel-replication-enabled yes >/dev/null
    forks0=$(field $P stats total_forks)
    D=$((base + 5))
    server d $D --dual-channel-replication-enabled yes "${load_args[@]}"
    t0=$(now)
    $cli -p $D replicaof 127.0.0.1 "$(kv_port $P)" >/dev/null
    wait_link $D
    t1=$(now)
    $cli -p $P config set dual-channel-replication-enabled no >/dev/null
    echo "primary after: $(stats); rdb_last_cow_size=$(field $P persistence rdb_last_cow_size); replica keys $($cli -p $D dbsize)"
    dual_s=$(echo "$t1 - $t0" | bc)
    dual_forks=$(( $(field $P stats total_forks) - forks0 ))
    dual_cow=$(( $(field $P persistence rdb_last_cow_size) / 1048576 ))
    dual=$(awk -v s="$seed_s" -v d="$dual_s" -v f="$dual_forks" -v c="$dual_cow" \
        'BEGIN { printf " %.2f s | %.2f | %d | %d MiB |", d, s/d, f, c }')
fi

echo "== keys: primary $($cli -p $P dbsize), kvsync-seeded $($cli -p $A dbsize), full-synced $($cli -p $B dbsize)"
rdb_mib=$(( $(stat -c %s "$work/primary/dump.rdb") / 1048576 ))
awk -v s="$seed_s" -v f="$full_s" -v k="$keys" -v z="$size" -v r="$rdb_mib" -v m="$dataset_mib" -v c="$(nproc)" \
    -v sf="$seed_forks" -v ff="$full_forks" -v cow="$cow_mib" -v load="$load" -v dual="$dual" 'BEGIN {
    printf "| %d keys x %d B (used_memory %d MiB, RDB %d MiB)%s | %.2f s | %.2f s | %.2f | %d / %d | 0 / %d MiB | %d cores |%s\n",
        k, z, m, r, load, s, f, s/f, sf, ff, cow, c, dual }'

[ "$availability" = 1 ] || exit 0
echo "== redis-replicate of a replica of the primary (repl-diskless-load swapdb)"
C=$((base + 4))
server c $C --repl-diskless-load swapdb --replicaof 127.0.0.1 $P
wait_link $C
mkdir -p "$work/replica2-agent"
dst2=$(agent replica2 "node_id = \"replica2\"
create_dirs = true
snapshot_dir = \"$work/replica2-agent\"
snapshot_format = \"redis-rdb\"
$agent_listen
[handoff]
mode = \"redis-replicate\"
timeout = \"1h\"
[redis]
server_addr = \"127.0.0.1:$C\"
primary = \"127.0.0.1:$P\"")
echo "primary before: $(stats)"
poll $C
"$bin" sync --agent "$dst2" --source "$src" --wait --json
down_replicate=$(unpoll $C)
echo "primary after: $(stats)"
awk -v k="$keys" -v z="$size" -v m="$dataset_mib" -v load="$load" -v c="$(nproc)" \
    -v a="$down_redis" -v b="$down_replicate" -v f="$down_full" 'BEGIN {
    printf "| %d keys x %d B (used_memory %d MiB)%s | %.2f s | %.2f s | %.2f s | %d cores |\n", k, z, m, load, a, b, f, c }'
