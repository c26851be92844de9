#!/usr/bin/env bash
# A Sentinel failover with 4 replicas, kvsync vs plain replication, on one
# host, in one run (bench.sh section 9c). The same three redis-sentinel
# processes watch both primaries (masters "direct" and "kvsync"):
#   direct: a primary and 4 replica servers (`replicaof`);
#   kvsync: a primary and its agent; replica A replicates from the primary
#     (the server Sentinel may promote) and its agent's log follows the
#     primary's agent; replicas B, C, D are fed through agents of their own
#     (`redis-stream`), seeded with `kvsync sync`. Every agent follows the
#     Sentinels.
# A run builds both setups afresh, starts a writer at RATE bytes/s on each
# primary, then fails each over as planned (the primary's writes paused,
# `SENTINEL FAILOVER`, the pause lifted once every Sentinel names the new
# primary; the writer goes on at the old primary until it is made a
# replica), one setup after the other, alternating which goes first. The
# fed servers' agents re-seed them (`reseed = true`) when their logs went
# past the promotion point. Measured from the SENTINEL FAILOVER call: the seconds until every
# server other than the old primary, and until all four (the old primary
# included, which Sentinel converts after it sees it, and kvsync's agent
# at once), is on the new primary's history (its master_replid) and holds
# a write made there after the promotion; and the full syncs the failover caused (sync_full
# of every server, and every whole RDB an agent's feed sent its server).
# Prints a markdown table, medians of RUNS.
# The primaries ping their replicas every PING seconds (3600: not within a
# run, so the planned failover is clean, as Redis's own FAILOVER makes it;
# Redis pings even under CLIENT PAUSE WRITE, and a ping that falls between
# the promotion and the old primary's re-attach is a write past the
# promotion point for every replica that gets it: PING=10, Redis's
# default, shows that case in the runs where it happens).
# Usage: scripts/bench-failover.sh KVSYNC_BIN [RUNS]   Knobs: KEEP=1 RATE=1048576 PING=3600
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/servers.sh
bin=$1
runs=${2:-${RUNS:-3}}
rate=${RATE:-1048576}
ping=${PING:-3600}
bash scripts/deps.sh redis-server redis-tools redis-sentinel
cargo build --locked --release --quiet --example redis_writer
examples=$PWD/target/release/examples
top=$(mktemp -d "${TMPDIR:-/tmp}/kvsync-failover.XXXXXX")
work=$top
stop_all() {
    stop_servers "$work"
    [ -f "$work/pids" ] && xargs -r kill <"$work/pids" 2>/dev/null || true
    wait 2>/dev/null || true
}
cleanup() {
    stop_all
    if [ -n "${KEEP:-}" ]; then echo "kept $top" >&2; else rm -rf "$top"; fi
}
trap cleanup EXIT

low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
port=$((10000 + RANDOM % (low - 12000)))
take_port() { port=$((port + 1)); printf -v "$1" %s "$port"; }
server() { # NAME PORT [ARGS...]: a daemonized redis-server in $work/NAME
    local name=$1 p=$2; shift 2
    mkdir -p "$work/$name"
    redis-server --port "$p" --bind 127.0.0.1 --dir "$work/$name" --save "" --appendonly no \
        --repl-diskless-sync yes --repl-diskless-sync-delay 0 --enable-debug-command yes \
        --daemonize yes --pidfile "$work/$name/redis.pid" --logfile "$work/$name/redis.log" "$@"
    for _ in $(seq 200); do rcli "$p" ping >/dev/null 2>&1 && return; sleep 0.05; done
    echo "redis $name did not start on port $p" >&2; exit 1
}
rcli() { local p=$1; shift; redis-cli -p "$p" "$@"; }
field() { rcli "$1" info "$2" | tr -d '\r' | awk -F: -v k="$3" '$1 == k {print $2}'; }
now() { date +%s.%N; }
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
agent() { # NAME GRPC_PORT CONFIG: started, once ready
    local name=$1
    mkdir -p "$work/$name-snaps"
    printf 'node_id = "%s"\ncreate_dirs = true\nsnapshot_dir = "%s"\nsnapshot_format = "redis-rdb"\n[grpc]\nlisten = "127.0.0.1:%s"\n[data]\ntcp_listen = "127.0.0.1:0"\nrdma_port = 0\n[metrics]\nlisten = "127.0.0.1:0"\n%s\n' \
        "$name" "$work/$name-snaps" "$2" "$3" >"$work/$name.toml"
    KVSYNC_LOG=info "$bin" agent --config "$work/$name.toml" >"$work/$name.out" 2>"$work/$name.log" &
    echo $! >>"$work/pids"
    for _ in $(seq 200); do grep -q ready "$work/$name.out" 2>/dev/null && return; sleep 0.05; done
    echo "agent $name did not start" >&2; cat "$work/$name.log" >&2; exit 1
}
following() { # AGENT_ADDR: until its log follows its source
    for _ in $(seq 600); do
        "$bin" status --agent "$1" --json | grep -q '"state":"following' && return
        sleep 0.05
    done
    echo "agent $1 never followed its source" >&2; exit 1
}

# The Sentinels, once, for both setups' masters.
take_port S1; take_port S2; take_port S3
sentinels="\"127.0.0.1:$S1\", \"127.0.0.1:$S2\", \"127.0.0.1:$S3\""
start_sentinels() { # PRIMARY_DIRECT PRIMARY_KVSYNC
    local s
    for s in "$S1" "$S2" "$S3"; do
        mkdir -p "$work/sentinel-$s"
        printf 'port %s\nbind 127.0.0.1\ndir %s\nlogfile %s\ndaemonize yes\npidfile %s\n' \
            "$s" "$work/sentinel-$s" "$work/sentinel-$s/sentinel.log" "$work/sentinel-$s/redis.pid" >"$work/sentinel-$s/sentinel.conf"
        for m in direct:$1 kvsync:$2; do
            printf 'sentinel monitor %s 127.0.0.1 %s 2\nsentinel down-after-milliseconds %s 5000\nsentinel failover-timeout %s 60000\nsentinel parallel-syncs %s 4\n' \
                "${m%%:*}" "${m#*:}" "${m%%:*}" "${m%%:*}" "${m%%:*}" >>"$work/sentinel-$s/sentinel.conf"
        done
        redis-sentinel "$work/sentinel-$s/sentinel.conf"
    done
}
# ready MASTER N: until every Sentinel knows the others and N healthy replicas.
ready() {
    for _ in $(seq 1200); do
        local ok=1 s
        for s in "$S1" "$S2" "$S3"; do
            [ "$(rcli "$s" sentinel master "$1" | awk 'p {print; exit} $0 == "num-other-sentinels" {p=1}')" = 2 ] || ok=0
            [ "$(rcli "$s" sentinel replicas "$1" | grep -cx 'slave')" -ge "$2" ] || ok=0
        done
        [ $ok = 1 ] && return
        sleep 0.1
    done
    echo "the Sentinels never got ready for $1" >&2; exit 1
}
master_of() { rcli "$S1" sentinel get-master-addr-by-name "$1" | tail -1; }

# build: both setups, seeded; sets the ports of their servers.
build() {
    take_port PD; take_port PK; take_port AK; take_port GS; take_port GA
    server direct-p "$PD" --repl-ping-replica-period "$ping"
    server kvsync-p "$PK" --repl-ping-replica-period "$ping"
    for p in "$PD" "$PK"; do rcli "$p" debug populate 100000 key 100 >/dev/null; done
    direct=("$PD"); kvsync=("$PK")
    for i in 1 2 3 4; do take_port r; server "direct-r$i" "$r" --replicaof 127.0.0.1 "$PD"; direct+=("$r"); done
    local follow="sentinels = [$sentinels]
master_name = \"kvsync\""
    agent src "$GS" "[redis]
primary_addr = \"127.0.0.1:$PK\"
[stream]
dir = \"$work/src-log\"
$follow
peers = [\"127.0.0.1:$GA\"]"
    following "127.0.0.1:$GS"
    server kvsync-a "$AK" --replicaof 127.0.0.1 "$PK"; kvsync+=("$AK")
    agent a "$GA" "[redis]
server_addr = \"127.0.0.1:$AK\"
primary = \"127.0.0.1:$PK\"
[handoff]
mode = \"redis-replicate\"
[stream]
dir = \"$work/a-log\"
upstream = \"127.0.0.1:$GS\"
$follow
peers = [\"127.0.0.1:$GS\"]"
    following "127.0.0.1:$GA"
    for _ in $(seq 600); do "$bin" snapshots --agent "127.0.0.1:$GS" | grep -q 'stream-' && break; sleep 0.05; done
    for n in b c d; do
        take_port r; take_port g
        server "kvsync-$n" "$r"; kvsync+=("$r")
        agent "$n" "$g" "[redis]
server_addr = \"127.0.0.1:$r\"
[handoff]
mode = \"redis-stream\"
timeout = \"600s\"
[stream]
dir = \"$work/$n-log\"
upstream = \"127.0.0.1:$GS\"
reseed = true
$follow
peers = [\"127.0.0.1:$GS\", \"127.0.0.1:$GA\"]"
        following "127.0.0.1:$g"
        "$bin" sync --agent "127.0.0.1:$g" --source "127.0.0.1:$GS" --wait >/dev/null
    done
    start_sentinels "$PD" "$PK"
    ready direct 4
    ready kvsync 1
}

full_syncs() { # SETUP SERVER_PORTS...: sync_full summed, plus the feeds' whole RDBs
    local setup=$1 n=0 p; shift
    for p in "$@"; do n=$((n + $(field "$p" stats sync_full))); done
    [ "$setup" = kvsync ] && n=$((n + $(cat "$work"/[bcd].log | grep -c 'sent its server the RDB' || true)))
    echo "$n"
}

# failover SETUP: prints "<s until the 3 others> <s until all 4> <full syncs>".
failover() {
    local name=$1; shift
    local ports=("$@") old=$1 before
    before=$(full_syncs "$name" "${ports[@]}")
    "$examples/redis_writer" "127.0.0.1:$old" "$rate" 100 >/dev/null 2>&1 &
    local writer=$!
    sleep 2  # the writer's load before the failover, not a wait for a state
    rcli "$old" client pause 60000 write >/dev/null
    local t0 others="" all="" new marker p
    t0=$(now)
    rcli "$S2" sentinel failover "$name" >/dev/null
    for _ in $(seq 12000); do
        new=$(master_of "$name")
        [ "$new" != "$old" ] && [ "$(field "$new" replication role)" = master ] && break
        sleep 0.01
    done
    # The pause ends once every Sentinel names the new primary; the old
    # primary's writes go on from then (its clients do not know yet)
    # until it is made a replica.
    for _ in $(seq 12000); do
        [ "$(rcli "$S1" sentinel get-master-addr-by-name "$name" | tail -1)" = "$new" ] && \
        [ "$(rcli "$S2" sentinel get-master-addr-by-name "$name" | tail -1)" = "$new" ] && \
        [ "$(rcli "$S3" sentinel get-master-addr-by-name "$name" | tail -1)" = "$new" ] && break
        sleep 0.01
    done
    rcli "$old" client unpause >/dev/null
    rcli "$new" set "failover-marker" "$t0" >/dev/null
    marker=$(field "$new" replication master_repl_offset)
    local id
    id=$(field "$new" replication master_replid)
    for _ in $(seq 12000); do
        local behind=0 old_behind=0
        for p in "${ports[@]}"; do
            [ "$p" = "$new" ] && continue
            # On the new primary's history (a server fed by its agent
            # replicates from the agent, not from the primary) and past
            # the write made there.
            if [ "$(field "$p" replication master_replid)" != "$id" ] || \
               [ "$(field "$p" replication master_repl_offset)" -lt "$marker" ]; then
                if [ "$p" = "$old" ]; then old_behind=1; else behind=1; fi
            fi
        done
        [ -z "$others" ] && [ $behind = 0 ] && others=$(awk -v a="$t0" -v b="$(now)" 'BEGIN {printf "%.2f", b - a}')
        [ -n "$others" ] && [ $old_behind = 0 ] && { all=$(awk -v a="$t0" -v b="$(now)" 'BEGIN {printf "%.2f", b - a}'); break; }
        sleep 0.01
    done
    [ -n "$all" ] || { echo "$name: the replicas never all followed the new primary" >&2; exit 1; }
    kill "$writer" 2>/dev/null || true; wait "$writer" 2>/dev/null || true
    echo "$others $all $(( $(full_syncs "$name" "${ports[@]}") - before ))"
}

declare -A t_others t_all fulls
for run in $(seq "$runs"); do
    work=$top/run-$run
    mkdir -p "$work"
    build
    order="direct kvsync"; [ $((run % 2)) = 0 ] && order="kvsync direct"
    for setup in $order; do
        if [ $setup = direct ]; then line=$(failover direct "${direct[@]}"); else line=$(failover kvsync "${kvsync[@]}"); fi
        echo "run $run $setup: $line (s to the 3 others, s to all 4, full syncs)" >&2
        read -r o a f <<<"$line"
        t_others[$setup]+="$o "; t_all[$setup]+="$a "; fulls[$setup]+="$f "
    done
    stop_all
done

echo "#### A planned Sentinel failover with 4 replicas (writes paused, \`SENTINEL FAILOVER\`), a writer at $rate bytes/s before it, median of $runs runs"
echo ""
echo "| replication | s until the 3 other replicas hold a write of the new primary | s until all 4 (the old primary too) | full syncs it caused |"
echo "|---|---|---|---|"
for setup in direct kvsync; do
    label="plain Redis replication, 4 replicas"
    [ $setup = kvsync ] && label="kvsync: 1 replica Sentinel may promote, 3 fed through agents"
    echo "| $label | $(median ${t_others[$setup]}) | $(median ${t_all[$setup]}) | $(median ${fulls[$setup]}) (runs: ${fulls[$setup]% }) |"
done
echo ""
echo "kvsync / plain, all 4: $(awk -v a="$(median ${t_all[kvsync]})" -v b="$(median ${t_all[direct]})" 'BEGIN {printf "%.2f", a / b}')."
