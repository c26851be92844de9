#!/usr/bin/env bash
# The replication stream through kvsync vs Redis's own replication, on one
# host, in one run (bench.sh section 9). Two setups side by side, each with
# its own primary:
#   direct: a primary and a replica server (`replicaof`);
#   kvsync: a primary, its agent following it into a stream log (ack =
#     "replicas", so WAIT counts a replica server), and a replica agent
#     following that log into its own and feeding its server from it
#     (`redis-stream`), seeded with `kvsync sync`.
# Measured, runs alternating between the setups, medians of RUNS:
#   1. WAIT 1 round trip (examples/wait_latency: SET + WAIT 1 on one
#      connection) for LAT_SECS while examples/redis_writer writes RATE
#      bytes/s to the same primary: P50, P99, P99.9.
#   2. redis-benchmark -t set -P 16 (BENCH_N requests, 100-byte values)
#      against the primary: its rate, the most bytes the replica server was
#      behind the primary (sampled every 50 ms) and how long it took to
#      catch up after the benchmark.
#   3. Catch-up: the replica side stopped (the direct replica server; the
#      replica agent) for AWAY seconds while the primary takes CATCHUP_MB
#      of SETs of 1000-byte values, then resumed: the time until the
#      replica server holds the primary's offset; and each agent's CPU
#      seconds per GB of stream meanwhile. A third row, a two-tier tree: a
#      leaf agent following the replica agent, the relay stopped, the time
#      until the leaf's server holds the primary's offset.
#   4. Egress with 8 replica servers: the bytes the primary sent to its
#      replicas, and the bytes the primary's host sent on (the primary plus
#      its agent), per byte of stream: direct (8 replicas of the primary)
#      vs kvsync (a `fanout --stream` tree of degree 2 over 8 replica
#      agents, each feeding its server).
# Prints markdown tables. Usage: scripts/bench-stream.sh KVSYNC_BIN [RUNS]
# Knobs: KEEP=1 (keep the servers' and agents' files) RATE=1048576 LAT_SECS=10 BENCH_N=1000000 PART_SECS=60
#        SERVER=redis|valkey PARTS="1 2 3 4 5" (which measurements)
#        CATCHUP_MB=200 AWAY=20 (part 3)
#        PERF=DIR (parts 1 and 2: `perf record -g` of both agents during each
#        kvsync run, into DIR/{src,rep}-{wait,set}-RUN.data)
#        SERVER_TLS=1 (every replication link over TLS: each server gets a TLS
#        port, port+1000, with tls-auth-clients and tls-replication; the
#        direct replica, the agents' [redis] and the fed servers use it; the
#        load still comes in on the plain port)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/servers.sh
bin=$1
runs=${2:-${RUNS:-3}}
rate=${RATE:-1048576}
lat_secs=${LAT_SECS:-10}
bench_n=${BENCH_N:-1000000}
srv=${SERVER:-redis}
parts=" ${PARTS:-1 2 3 4 5} "
part() { [[ "$parts" == *" $1 "* ]]; }
case "$srv" in
    redis) bash scripts/deps.sh redis-server redis-tools ;;
    valkey) bash scripts/deps.sh valkey-server/backports valkey-tools/backports ;;
    *) echo "SERVER must be redis or valkey, not $srv" >&2; exit 2 ;;
esac
server_bin=$srv-server cli=$srv-cli benchmark=$srv-benchmark
cargo build --locked --release --quiet --example wait_latency --example redis_writer
examples=$PWD/target/release/examples
work=$(mktemp -d "${TMPDIR:-/tmp}/kvsync-stream.XXXXXX")
cleanup() {
    stop_servers "$work"
    [ -f "$work/pids" ] && xargs -r kill <"$work/pids" 2>/dev/null || true
    wait 2>/dev/null || true
    if [ -n "${KEEP:-}" ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

# redis-server cannot listen on port 0: ports below the ephemeral range.
low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
port=$((10000 + RANDOM % (low - 10100)))
take_port() { port=$((port + 1)); printf -v "$1" %s "$port"; }  # VAR: the next port into VAR
# Part 5 runs servers and agents in network namespaces: `host` is the
# namespace the next server or agent starts in (empty: this one), and
# each server's port remembers its namespace.
host=""
declare -A ns_of
in_host() { # NS CMD...: CMD in namespace NS (empty: here)
    local ns=$1; shift
    if [ -n "$ns" ]; then ip netns exec "$ns" "$@"; else "$@"; fi
}
server() { # NAME PORT [ARGS...]: a daemonized server in $work/NAME, on `host`
    local name=$1 p=$2; shift 2
    mkdir -p "$work/$name"
    ns_of[$p]=$host
    in_host "$host" $server_bin --port "$p" --bind 127.0.0.1 --dir "$work/$name" --save "" --appendonly no \
        --repl-diskless-sync yes --repl-diskless-sync-delay 0 --enable-debug-command yes \
        --daemonize yes --pidfile "$work/$name/redis.pid" --logfile "$work/$name/redis.log" \
        $(tls_args "$p") "$@"
    for _ in $(seq 200); do rcli "$p" ping >/dev/null 2>&1 && return; sleep 0.05; done
    echo "$srv $name did not start on port $p" >&2; exit 1
}
rcli() { local p=$1; shift; in_host "${ns_of[$p]:-}" $cli -p "$p" "$@"; }
server_tls_setup "$work/tls"
field() { rcli "$1" info "$2" | tr -d '\r' | awk -F: -v k="$3" '$1 == k {print $2}'; }
offset() { field "$1" replication master_repl_offset; }
# caught_up PRIMARY REPLICA: until the replica server has the primary's offset.
caught_up() {
    for _ in $(seq 6000); do [ "$(offset "$2")" = "$(offset "$1")" ] && return; sleep 0.01; done
    echo "the replica on $2 never caught up with $1" >&2; exit 1
}
agent() { # NAME CONFIG: prints the agent's gRPC and metrics addresses once ready
    local name=$1
    printf '%s\n' "$2" >"$work/$name.toml"
    # Started directly (not through a function) so that $! is the agent.
    if [ -n "$host" ]; then
        KVSYNC_LOG=warn ip netns exec "$host" "$bin" agent --config "$work/$name.toml" >"$work/$name.out" 2>"$work/$name.log" &
    else
        KVSYNC_LOG=warn "$bin" agent --config "$work/$name.toml" >"$work/$name.out" 2>"$work/$name.log" &
    fi
    echo $! >>"$work/pids"
    echo $! >"$work/$name.pid"
    for _ in $(seq 200); do grep -q ready "$work/$name.out" 2>/dev/null && break; sleep 0.05; done
    local grpc
    grpc=$(grep -o 'grpc=[^ ]*' "$work/$name.out" | cut -d= -f2)
    [ -n "$grpc" ] || { echo "agent $name did not start" >&2; cat "$work/$name.log" >&2; exit 1; }
    echo "$grpc $(grep -o 'metrics=[^ ]*' "$work/$name.out" | cut -d= -f2)"
}
listen='[grpc]
listen = "127.0.0.1:0"
[data]
tcp_listen = "127.0.0.1:0"
rdma_port = 0
[metrics]
listen = "127.0.0.1:0"'
metric() { in_host "$host" curl -s "http://$1/metrics" | awk -v m="$2" '$1 == m {print $2}'; }
# The CLI, on `host` (part 5: the replica's, which reaches both).
cli_on() { in_host "$host" "$bin" "$@"; }
# following AGENT: until the agent's stream log follows its source.
following() {
    for _ in $(seq 600); do
        cli_on status --agent "$1" --json | grep -q '"state":"following' && return
        sleep 0.05
    done
    echo "agent $1 never followed its source" >&2
    tail -n 5 "$work"/*.log >&2
    exit 1
}
# primary_agent NAME PRIMARY_PORT [ACK]: the agent following that primary,
# acknowledging what ACK says (default "replicas").
primary_agent() {
    mkdir -p "$work/$1-snaps" "$work/$1-log"
    agent "$1" "node_id = \"$1\"
snapshot_dir = \"$work/$1-snaps\"
snapshot_format = \"redis-rdb\"
$listen
[redis]
primary_addr = \"127.0.0.1:$(kv_port "$2")\"
$redis_tls
[stream]
dir = \"$work/$1-log\"
ack = \"${3:-replicas}\""
}
# feeding_agent NAME UPSTREAM SERVER_PORT: a replica agent feeding that server.
feeding_agent() {
    mkdir -p "$work/$1-snaps" "$work/$1-log"
    agent "$1" "node_id = \"$1\"
snapshot_dir = \"$work/$1-snaps\"
snapshot_format = \"redis-rdb\"
$listen
[stream]
dir = \"$work/$1-log\"
upstream = \"$2\"
[handoff]
mode = \"redis-stream\"
timeout = \"600s\"
[redis]
server_addr = \"127.0.0.1:$(kv_port "$3")\"
$redis_tls"
}
# offered AGENT: until the agent offers its full resync's RDB.
offered() {
    for _ in $(seq 600); do cli_on snapshots --agent "$1" | grep -q 'stream-' && return; sleep 0.05; done
    echo "agent $1 offered no RDB" >&2; exit 1
}
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m() { median ${1}; }  # the median of a space-separated list
now() { date +%s.%N; }
# PERF=DIR: `perf record -g` of both agents from profile_start NAME until
# profile_stop, into DIR/src-NAME.data and DIR/rep-NAME.data.
profiled=()
profile_start() {
    [ -n "${PERF:-}" ] || return 0
    mkdir -p "$PERF"
    for a in src rep; do
        perf record -q -F 999 -g -o "$PERF/$a-$1.data" -p "$(cat "$work/$a.pid")" 2>/dev/null &
        profiled+=($!)
    done
}
profile_stop() {
    for pp in "${profiled[@]}"; do kill -INT "$pp"; wait "$pp" 2>/dev/null || true; done
    profiled=()
}

# The two setups, each primary with 100k keys first.
take_port PD; take_port RD; take_port PK; take_port RK
server direct-p "$PD"
server kvsync-p "$PK"
for p in "$PD" "$PK"; do rcli "$p" debug populate 100000 key 100 >/dev/null; done
server direct-r "$RD" --replicaof 127.0.0.1 "$(kv_port "$PD")"
read -r SRC SRC_METRICS < <(primary_agent src "$PK")
following "$SRC"
offered "$SRC"
server kvsync-r "$RK"
read -r REP _ < <(feeding_agent rep "$SRC" "$RK")
following "$REP"
cli_on sync --agent "$REP" --source "$SRC" --wait >/dev/null
caught_up "$PD" "$RD"
caught_up "$PK" "$RK"
echo "setups ready: direct $PD -> $RD; kvsync $PK -> agents -> $RK" >&2
declare -A primary_of=([direct]=$PD [kvsync]=$PK) replica_of=([direct]=$RD [kvsync]=$RK)
tls_note=${SERVER_TLS:+, every replication link over TLS}
declare -A path_name=([direct]="direct $srv replication$tls_note" [kvsync]="through kvsync (TCP, two agents$tls_note)")

# 1. WAIT latency under a steady writer.
if part 1; then
declare -A p50 p99 p999
for setup in direct kvsync; do p50[$setup]=""; p99[$setup]=""; p999[$setup]=""; done
for run in $(seq "$runs"); do
    for setup in direct kvsync; do
        p=${primary_of[$setup]}
        "$examples/redis_writer" "127.0.0.1:$p" "$rate" 100 >/dev/null &
        writer=$!
        [ "$setup" = kvsync ] && profile_start "wait-$run"
        line=$("$examples/wait_latency" "127.0.0.1:$p" "$lat_secs")
        profile_stop
        kill "$writer"; wait "$writer" 2>/dev/null || true
        echo "latency run $run $setup: $line" >&2
        p50[$setup]+="$(echo "$line" | sed -E 's/.*p50_ms=([0-9.]+).*/\1/') "
        p99[$setup]+="$(echo "$line" | sed -E 's/.*p99_ms=([0-9.]+).*/\1/') "
        p999[$setup]+="$(echo "$line" | sed -E 's/.*p999_ms=([0-9.]+).*/\1/') "
    done
done
echo "#### WAIT 1 round trip (kvsync: ack = \"replicas\"), a writer at $rate bytes/s of 100-byte values, $lat_secs s a run, median of $runs alternating runs"
echo ""
echo "| path | P50 | P99 | P99.9 |"
echo "|---|---|---|---|"
for setup in direct kvsync; do
    echo "| ${path_name[$setup]} | $(m "${p50[$setup]}") ms | $(m "${p99[$setup]}") ms | $(m "${p999[$setup]}") ms |"
done
echo ""
echo "kvsync - direct, P50: $(awk -v a="$(m "${p50[kvsync]}")" -v b="$(m "${p50[direct]}")" 'BEGIN {printf "%+.3f ms", a - b}'); kvsync / direct, P99.9: $(awk -v a="$(m "${p999[kvsync]}")" -v b="$(m "${p999[direct]}")" 'BEGIN {printf "%.2f", a / b}')."
echo ""

fi

# 2. Sustained throughput: how far the replica server falls behind.
if part 2; then
declare -A rps behind catchup
for setup in direct kvsync; do rps[$setup]=""; behind[$setup]=""; catchup[$setup]=""; done
for run in $(seq "$runs"); do
    for setup in direct kvsync; do
        p=${primary_of[$setup]} r=${replica_of[$setup]}
        [ "$setup" = kvsync ] && profile_start "set-$run"
        $benchmark -p "$p" -t set -P 16 -n "$bench_n" -r 100000 -d 100 -q >"$work/bench.out" 2>/dev/null &
        b=$!
        most=0
        while kill -0 "$b" 2>/dev/null; do
            lag=$(( $(offset "$p") - $(offset "$r") ))
            [ "$lag" -gt "$most" ] && most=$lag
            sleep 0.05
        done
        wait "$b"
        profile_stop
        t0=$(now)
        caught_up "$p" "$r"
        t1=$(now)
        got=$(tr '\r' '\n' <"$work/bench.out" | grep -o 'SET: [0-9.]* requests per second' | tail -1 | awk '{print $2}')
        echo "throughput run $run $setup: $got req/s, most behind $most bytes, caught up in $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}') s" >&2
        rps[$setup]+="$got "
        behind[$setup]+="$most "
        catchup[$setup]+="$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}') "
    done
done
echo "#### \`$benchmark -t set -P 16 -n $bench_n -d 100\` against the primary, median of $runs alternating runs"
echo ""
echo "| path | SET rate | most bytes the replica server was behind | caught up after the benchmark |"
echo "|---|---|---|---|"
for setup in direct kvsync; do
    echo "| ${path_name[$setup]} | $(m "${rps[$setup]}") req/s | $(m "${behind[$setup]}") | $(m "${catchup[$setup]}") s |"
done
echo ""

fi

# 3. Catch-up: the replica side stopped (SIGSTOP: the direct replica
# server; the replica agent) while the primary takes CATCHUP_MB of SETs of
# 1000-byte values, left stopped AWAY seconds in all, then resumed: the
# time until the replica server holds the primary's offset. The direct
# primary keeps its stopped replica whatever its output buffer holds, so
# both setups carry the same bytes without a full resync.
if part 3; then
catchup_mb=${CATCHUP_MB:-200}
away=${AWAY:-20}
rcli "$PD" config set client-output-buffer-limit "replica 0 0 0" >/dev/null
# The two-tier tree: a leaf agent following the replica agent (the relay)
# and feeding a server of its own. Its row stops the relay: the relay
# catches up from the primary's agent while the leaf catches up from it.
take_port RL
server kvsync-l "$RL"
read -r LEAF _ < <(feeding_agent leaf "$REP" "$RL")
following "$LEAF"
cli_on sync --agent "$LEAF" --source "$REP" --wait >/dev/null
caught_up "$PK" "$RL"
primary_of[tree]=$PK replica_of[tree]=$RL path_name[tree]="through kvsync, two tiers (the relay stopped)"
declare -A stopped_pid=([direct]=$(cat "$work/direct-r/redis.pid") [kvsync]=$(cat "$work/rep.pid") [tree]=$(cat "$work/rep.pid"))
declare -A back rate_mb
for setup in direct kvsync tree; do back[$setup]=""; rate_mb[$setup]=""; done
cpu_src="" cpu_rep=""
ticks() { awk '{print $14 + $15}' "/proc/$(cat "$work/$1.pid")/stat"; }  # AGENT: its user + system CPU ticks
per_gb() { awk -v t="$1" -v hz="$(getconf CLK_TCK)" -v o="$2" 'BEGIN {printf "%.2f", t / hz / (o / 1e9)}'; }
for run in $(seq "$runs"); do
    for setup in direct kvsync tree; do
        p=${primary_of[$setup]} r=${replica_of[$setup]}
        caught_up "$p" "$r"
        # The one-tier row as before the tree: the leaf out of it.
        [ "$setup" = kvsync ] && kill -STOP "$(cat "$work/leaf.pid")"
        o0=$(offset "$p")
        src0=$(ticks src) rep0=$(ticks rep)
        kill -STOP "${stopped_pid[$setup]}"
        t_stop=$(now)
        $benchmark -p "$p" -t set -P 16 -n "$((catchup_mb * 1000))" -r 1000000 -d 1000 -q >/dev/null 2>&1
        left=$(awk -v a="$t_stop" -v b="$(now)" -v w="$away" 'BEGIN {l = w - (b - a); print (l > 0 ? l : 0)}')
        sleep "$left"   # the time away, the thing varied
        kill -CONT "${stopped_pid[$setup]}"
        t0=$(now)
        caught_up "$p" "$r"
        t1=$(now)
        secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}')
        mb=$(awk -v o="$(( $(offset "$p") - o0 ))" -v s="$secs" 'BEGIN {printf "%.0f", o / 1e6 / (s > 0.01 ? s : 0.01)}')
        echo "catch-up run $run $setup: $(( ($(offset "$p") - o0) / 1000000 )) MB away ${away} s, caught up in $secs s ($mb MB/s)" >&2
        if [ "$setup" = kvsync ]; then
            moved=$(( $(offset "$p") - o0 ))
            cpu_src+="$(per_gb $(( $(ticks src) - src0 )) "$moved") "
            cpu_rep+="$(per_gb $(( $(ticks rep) - rep0 )) "$moved") "
            echo "catch-up run $run: CPU s per GB of stream, primary's agent $(per_gb $(( $(ticks src) - src0 )) "$moved"), replica agent $(per_gb $(( $(ticks rep) - rep0 )) "$moved")" >&2
        fi
        [ "$setup" = kvsync ] && kill -CONT "$(cat "$work/leaf.pid")"
        back[$setup]+="$secs "
        rate_mb[$setup]+="$mb "
    done
done
echo "#### Catch-up: the replica side stopped ${away} s while the primary takes ${catchup_mb} MB of SETs (1000-byte values), median of $runs alternating runs"
echo ""
echo "| path | caught up after it resumed | MB/s |"
echo "|---|---|---|"
for setup in direct kvsync tree; do
    echo "| ${path_name[$setup]} | $(m "${back[$setup]}") s | $(m "${rate_mb[$setup]}") |"
done
echo ""
for setup in kvsync tree; do
    echo "${path_name[$setup]} / direct: $(awk -v a="$(m "${back[$setup]}")" -v b="$(m "${back[direct]}")" 'BEGIN {printf "%.1f", a / (b > 0.01 ? b : 0.01)}')."
done
echo ""
echo "CPU seconds per GB of stream (logging it while the replica side was away, then the catch-up): the primary's agent $(m "$cpu_src"), the replica agent $(m "$cpu_rep")."
echo ""
kill "$(cat "$work/leaf.pid")"

fi

# 4. Egress with 8 replica servers: the first replica of each setup leaves
# (the direct one becomes a primary of its own, the replica agent stops).
if part 4; then
rcli "$RD" replicaof no one >/dev/null
kill "$(cat "$work/rep.pid")"
declare -A rports
for i in $(seq 8); do
    take_port rp
    server "direct-r$i" "$rp" --replicaof 127.0.0.1 "$PD"
    rports[direct]+="$rp "
done
replicas=()
for i in $(seq 8); do
    take_port rp
    server "kvsync-r$i" "$rp"
    rports[kvsync]+="$rp "
    read -r grpc _ < <(feeding_agent "rep$i" "$SRC" "$rp")
    following "$grpc"
    replicas+=(--replica "$grpc")
done
cli_on fanout --source "$SRC" --degree 2 --stream "${replicas[@]}" --wait --json >"$work/fanout.out" 2>&1 ||
    { echo "the stream fan-out failed:" >&2; cat "$work/fanout.out" >&2; exit 1; }
# egress PRIMARY: the primary's replication output bytes so far.
egress() { field "$1" stats total_net_repl_output_bytes; }
source_bytes() { metric "$SRC_METRICS" 'kvsync_stream_bytes_total{kv_instance="default",role="source"}' | cut -d. -f1; }
declare -A stream_bytes primary_out host_out
for setup in direct kvsync; do
    p=${primary_of[$setup]}
    for r in ${rports[$setup]}; do caught_up "$p" "$r"; done
    o0=$(offset "$p"); e0=$(egress "$p"); s0=$(source_bytes)
    timeout 10 "$examples/redis_writer" "127.0.0.1:$p" "$((4 * rate))" 100 >/dev/null || true
    for r in ${rports[$setup]}; do caught_up "$p" "$r"; done
    o1=$(offset "$p"); e1=$(egress "$p"); s1=$(source_bytes)
    stream_bytes[$setup]=$((o1 - o0))
    primary_out[$setup]=$((e1 - e0))
    # The primary's host: the primary itself (direct), or its agent, which
    # is all that leaves the host (kvsync: the primary sends to its agent on
    # loopback).
    host_out[$setup]=$([ "$setup" = kvsync ] && echo $((s1 - s0)) || echo $((e1 - e0)))
done
echo "#### 8 replica servers: what the primary's host sends per byte of stream (a writer at $((4 * rate)) bytes/s for 10 s)"
echo ""
echo "| path | the primary's replication output / stream | the primary's host to other hosts / stream |"
echo "|---|---|---|"
for setup in direct kvsync; do
    name=$([ "$setup" = direct ] && echo "direct: 8 replicas of the primary" || echo "kvsync: its agent, a tree of degree 2 over 8 replica agents")
    echo "| $name | $(awk -v a="${primary_out[$setup]}" -v b="${stream_bytes[$setup]}" 'BEGIN {printf "%.2f", a / b}') | $(awk -v a="${host_out[$setup]}" -v b="${stream_bytes[$setup]}" 'BEGIN {printf "%.2f", a / b}') |"
done
echo ""

fi

# 5. A partition between the replica's host and the primary's.
part 5 || exit 0
part_secs=${PART_SECS:-60}
echo "#### A ${part_secs} s partition between the replica's host and the primary's (network namespaces), the primary writing 5 × its 1 MB backlog meanwhile, median of $runs runs (both setups cut by the same link)"
echo ""
if [ "$(id -u)" != 0 ]; then
    echo "Skipped: network namespaces need root."
    exit 0
fi
ns_a=kvs-a-$$ ns_b=kvs-b-$$
trap 'cleanup; ip netns del "$ns_a" 2>/dev/null || true; ip netns del "$ns_b" 2>/dev/null || true' EXIT
ip netns add "$ns_a"
ip netns add "$ns_b"
ip link add "kvsa$$" type veth peer name "kvsb$$"
ip link set "kvsa$$" netns "$ns_a"
ip link set "kvsb$$" netns "$ns_b"
ip -n "$ns_a" addr add 10.99.0.1/24 dev "kvsa$$"
ip -n "$ns_b" addr add 10.99.0.2/24 dev "kvsb$$"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "kvsa$$" up
ip -n "$ns_b" link set "kvsb$$" up
# Agents reachable from the other host: gRPC in plaintext with a bearer token.
echo "kvsync-bench-token-0123456789" >"$work/token"
export KVSYNC_TOKEN_FILE=$work/token
ns_listen() { # IP
    printf '[grpc]\nlisten = "%s:0"\nplaintext = true\n[data]\ntcp_listen = "%s:0"\nrdma_port = 0\n[metrics]\nlisten = "127.0.0.1:0"\n[auth]\ntoken_file = "%s"\nsend_token_in_clear = true' "$1" "$1" "$work/token"
}
host=$ns_a
take_port PD2; take_port PK2; take_port RD2; take_port RK2
# The same repl-timeout on both primaries: a cut link is dropped after 30 s.
# (Its own namespace: no password, so protected mode is off for the replica.)
server part-direct-p "$PD2" --repl-backlog-size 1mb --repl-timeout 30 --bind 127.0.0.1 10.99.0.1 --protected-mode no
server part-kvsync-p "$PK2" --repl-backlog-size 1mb --repl-timeout 30
for p in "$PD2" "$PK2"; do rcli "$p" debug populate 1000000 key 100 >/dev/null; done
listen=$(ns_listen 10.99.0.1)
# ack = "log" (the default): the primary's agent is not cut off, and
# acknowledges what it logged throughout.
read -r SRC2 _ < <(primary_agent part-src "$PK2" log)
host=$ns_b
server part-direct-r "$RD2" --replicaof 10.99.0.1 "$PD2" --repl-timeout 30
server part-kvsync-r "$RK2"
listen=$(ns_listen 10.99.0.2)
read -r REP2 _ < <(feeding_agent part-rep "$SRC2" "$RK2")
following "$SRC2"
offered "$SRC2"
following "$REP2"
cli_on sync --agent "$REP2" --source "$SRC2" --wait >/dev/null
for _ in $(seq 600); do [ "$(field "$RD2" replication master_link_status)" = up ] && break; sleep 0.05; done
[ "$(field "$RD2" replication master_link_status)" = up ] || { echo "the direct replica never linked" >&2; exit 1; }
caught_up "$PD2" "$RD2"
caught_up "$PK2" "$RK2"
declare -A fulls forks errors back
for setup in direct kvsync; do fulls[$setup]=""; forks[$setup]=""; errors[$setup]=""; back[$setup]=""; done
write_rate=$((5 * 1048576 / part_secs))
for run in $(seq "$runs"); do
    declare -A full0 fork0
    for p in "$PD2" "$PK2"; do
        full0[$p]=$(field "$p" stats sync_full); fork0[$p]=$(field "$p" stats total_forks)
    done
    writers=() pollers=()
    for p in "$PD2" "$PK2"; do
        ip netns exec "$ns_a" "$examples/redis_writer" "127.0.0.1:$p" "$write_rate" 100 >/dev/null &
        writers+=($!)
    done
    for r in "$RD2" "$RK2"; do
        rm -f "$work/stop.$r"
        ip netns exec "$ns_b" "$examples/redis_poller" "127.0.0.1:$r" key:1 "$work/stop.$r" >"$work/poll.$r" &
        pollers+=($!)
    done
    ip -n "$ns_b" link set "kvsb$$" down
    sleep "$part_secs"   # the partition's length, the thing measured
    kill "${writers[@]}"; wait "${writers[@]}" 2>/dev/null || true
    ip -n "$ns_b" link set "kvsb$$" up
    t_up=$(now)
    declare -A done_at=()
    for _ in $(seq 12000); do
        for pair in "direct $PD2 $RD2" "kvsync $PK2 $RK2"; do
            read -r setup p r <<<"$pair"
            [ -z "${done_at[$setup]:-}" ] && [ "$(offset "$r")" = "$(offset "$p")" ] && done_at[$setup]=$(now)
        done
        [ -n "${done_at[direct]:-}" ] && [ -n "${done_at[kvsync]:-}" ] && break
        sleep 0.05
    done
    for r in "$RD2" "$RK2"; do touch "$work/stop.$r"; done
    wait "${pollers[@]}"
    for pair in "direct $PD2 $RD2" "kvsync $PK2 $RK2"; do
        read -r setup p r <<<"$pair"
        [ -n "${done_at[$setup]:-}" ] || { echo "$setup never caught up after the partition" >&2; exit 1; }
        fulls[$setup]+="$(( $(field "$p" stats sync_full) - ${full0[$p]} )) "
        forks[$setup]+="$(( $(field "$p" stats total_forks) - ${fork0[$p]} )) "
        errors[$setup]+="$(sed -E 's/.*unavailable_s=([0-9.]+).*/\1/' "$work/poll.$r") "
        back[$setup]+="$(awk -v a="$t_up" -v b="${done_at[$setup]}" 'BEGIN {printf "%.2f", b - a}') "
        echo "partition run $run $setup: full resyncs ${fulls[$setup]}, forks ${forks[$setup]}, errors ${errors[$setup]}s, caught up ${back[$setup]}s" >&2
    done
done
echo "| path | full resyncs of the primary | primary forks | seconds the replica server answered errors | caught up after the link returned |"
echo "|---|---|---|---|---|"
for setup in direct kvsync; do
    echo "| ${path_name[$setup]} | $(m "${fulls[$setup]}") | $(m "${forks[$setup]}") | $(m "${errors[$setup]}") s | $(m "${back[$setup]}") s |"
done
echo ""
