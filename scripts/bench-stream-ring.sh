#!/usr/bin/env bash
# The replication stream through the RDMA ring against the TCP stream
# session and Redis's own replication, on soft-RoCE in the VM harness
# (scripts/rxe-vm.sh; needs root): one VM (everything on its rxe0) and two
# VMs joined by one link (primaries and their agents on a, replica agents
# and servers on b). Three setups side by side, each with its own primary:
#   ring:   primary -> its agent (ack = "replicas") -> a replica agent
#           following it through an RDMA ring -> its server (redis-stream);
#   tcp:    the same with [stream] rdma_ring = 0 (the TCP stream session);
#   direct: primary -> replica server (replicaof).
# Measured, runs alternating between the setups, medians of RUNS:
#   1. WAIT 1 round trip (examples/wait_latency) for LAT_SECS while
#      examples/redis_writer writes RATE bytes/s to the same primary:
#      P50, P99, P99.9 and P99.9/P50.
#   2. Catch-up (ring and tcp): the replica agent stopped (SIGSTOP) while
#      the primary takes CATCHUP_MIB of writes, then let go: the stream's
#      bytes over the time until the replica agent's log has them all, and
#      the source's and replica's agent CPU per MiB meanwhile; against
#      `ib_write_bw -R` of 4 MiB messages on the same rxe0 in the same boot.
# The VM runs on TCG: absolute figures are the emulator's, compare ratios.
#
#   sudo bash scripts/bench-stream-ring.sh   # RUNS=3 LAT_SECS=10 RATE=262144 CATCHUP_MIB=48 HOSTS="1 2"
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != --inside ]; then
    bash scripts/deps.sh redis-server redis-tools >&2
    cargo build --locked --release --quiet
    cargo build --locked --release --quiet --example wait_latency --example redis_writer
    for hosts in ${HOSTS:-1 2}; do
        out=$(KVSYNC_BIN=$PWD/target/release/kvsync EXAMPLES=$PWD/target/release/examples \
            RUNS=${RUNS:-3} LAT_SECS=${LAT_SECS:-10} RATE=${RATE:-262144} CATCHUP_MIB=${CATCHUP_MIB:-48} \
            bash scripts/rxe-vm.sh --hosts "$hosts" --timeout 1800 \
            --env KVSYNC_BIN --env EXAMPLES --env RUNS --env LAT_SECS --env RATE --env CATCHUP_MIB \
            -- bash scripts/bench-stream-ring.sh --inside) ||
            { echo "the $hosts-VM run failed:" >&2; echo "$out" >&2; exit 1; }
        case "$hosts" in
            1) echo "### One VM (both ends on rxe0)" ;;
            2) echo "### Two VMs (one link between them)" ;;
        esac
        echo ""
        sed -n 's/^RESULT //p' <<< "$out"
        echo ""
    done
    exit 0
fi

# --- inside a VM --------------------------------------------------------------
K=$KVSYNC_BIN
role=${KVSYNC_VM_HOST:-one}
addr=${KVSYNC_VM_ADDR:-10.0.2.15}
phost=${KVSYNC_VM_PEER:-10.0.2.15}   # where the primaries and their agents are
[ "$role" = a ] && phost=$addr
mkdir -p /tmp/kv
echo kvsync-stream-bench-token-0123456789abcd > /tmp/kv/token
export KVSYNC_TOKEN_FILE=/tmp/kv/token
# agent NAME GRPC_LISTEN CONFIG_TAIL
agent() {
    mkdir -p "/tmp/kv/$1"
    cat > "/tmp/kv/$1.toml" <<EOT
node_id = "$1"
create_dirs = true
snapshot_dir = "/tmp/kv/$1"
snapshot_format = "redis-rdb"
[grpc]
listen = "$2"
plaintext = true
[data]
tcp_listen = "$addr:0"
rdma_port = 0
[metrics]
listen = ""
[auth]
token_file = "/tmp/kv/token"
send_token_in_clear = true
$3
EOT
    "$K" agent --config "/tmp/kv/$1.toml" > "/tmp/kv/$1.out" 2> "/tmp/kv/$1.log" &
    echo $! > "/tmp/kv/$1.pid"
    for _ in $(seq 600); do grep -q "agent ready" "/tmp/kv/$1.out" && return; sleep 0.1; done
    cat "/tmp/kv/$1.log" >&2
    exit 1
}
server() { # NAME PORT [ARGS]
    mkdir -p "/tmp/kv/$1"
    redis-server --port "$2" --bind "127.0.0.1 $addr" --protected-mode no --dir "/tmp/kv/$1" --save "" \
        --appendonly no --daemonize yes --pidfile "/tmp/kv/$1/redis.pid" --logfile "/tmp/kv/$1/redis.log" "${@:3}"
    for _ in $(seq 300); do redis-cli -p "$2" ping > /dev/null 2>&1 && return; sleep 0.1; done
    echo "redis $1 did not start" >&2; exit 1
}
if [ "$role" != b ]; then
    server pring 7001 --repl-diskless-sync-delay 0
    server ptcp 7002 --repl-diskless-sync-delay 0
    server pdirect 7003 --repl-backlog-size 64mb
    for s in ring:7001:7110 tcp:7002:7120; do
        IFS=: read -r name port grpc <<< "$s"
        agent "s$name" "$addr:$grpc" "[redis]
primary_addr = \"127.0.0.1:$port\"
[stream]
dir = \"/tmp/kv/s$name-log\"
ack = \"replicas\"
retain = \"4GiB\""
    done
    if [ "$role" = a ]; then
        # ib_write_bw servers for b, one per command, until "done".
        while cmd=$(busybox nc -l -p 7199); [ "$cmd" != done ]; do
            ib_write_bw -R -d rxe0 -s 4194304 -n $((CATCHUP_MIB / 4)) -F > /dev/null 2>&1 &
        done
        exit 0
    fi
fi
tell() { [ "$role" = b ] || return 0; for _ in $(seq 100); do echo "$1" | busybox nc -w 5 "$phost" 7199 && return; sleep 0.1; done; exit 1; }
for s in 7110 7120; do
    for _ in $(seq 600); do "$K" snapshots --agent "$phost:$s" --json 2>/dev/null | grep -q '"seq"' && break; sleep 0.2; done
done
server rring 7101
server rtcp 7102
server rdirect 7103 --replicaof "$phost" 7003
for s in ring:7110:7101:16MiB tcp:7120:7102:0; do
    IFS=: read -r name grpc port size <<< "$s"
    agent "r$name" "127.0.0.1:$((grpc + 100))" "[stream]
dir = \"/tmp/kv/r$name-log\"
upstream = \"$phost:$grpc\"
rdma_ring = \"$size\"
retain = \"4GiB\"
[handoff]
mode = \"redis-stream\"
timeout = \"300s\"
[redis]
server_addr = \"127.0.0.1:$port\""
    "$K" sync --agent "127.0.0.1:$((grpc + 100))" --source "$phost:$grpc" --wait --json > "/tmp/kv/seed-$name.json" ||
        { cat "/tmp/kv/seed-$name.json" >&2; exit 1; }
done
state() { "$K" status --agent "$1" --json | grep -o '"state":"[^"]*"' | head -1; }
for _ in $(seq 300); do state 127.0.0.1:7210 | grep -q "RDMA ring" && break; sleep 0.1; done
state 127.0.0.1:7210 | grep -q "RDMA ring" || { echo "the ring replica is not on the ring: $(state 127.0.0.1:7210)" >&2; exit 1; }
for _ in $(seq 600); do redis-cli -p 7103 info replication | grep -q master_link_status:up && break; sleep 0.1; done
declare -A primary=([ring]=$phost:7001 [tcp]=$phost:7002 [direct]=$phost:7003)
declare -A p50 p99 p999 rate cpu_src cpu_rep
for s in ring tcp direct; do p50[$s]=""; p99[$s]=""; p999[$s]=""; rate[$s]=""; cpu_src[$s]=""; cpu_rep[$s]=""; done
ib=""
end_of() { "$K" status --agent "$1" --json | grep -o '"end_offset":[0-9]*' | head -1 | cut -d: -f2; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for run in $(seq "$RUNS"); do
    for s in ring tcp direct; do
        IFS=: read -r h p <<< "${primary[$s]}"
        "$EXAMPLES/redis_writer" "${primary[$s]}" "$RATE" 100 > /dev/null &
        writer=$!
        line=$("$EXAMPLES/wait_latency" "${primary[$s]}" "$LAT_SECS")
        kill $writer; wait $writer 2>/dev/null || true
        echo "run $run $s: $line" >&2
        p50[$s]+="$(sed -E 's/.*p50_ms=([0-9.]+).*/\1/' <<< "$line") "
        p99[$s]+="$(sed -E 's/.*p99_ms=([0-9.]+).*/\1/' <<< "$line") "
        p999[$s]+="$(sed -E 's/.*p999_ms=([0-9.]+).*/\1/' <<< "$line") "
    done
    for s in ring tcp; do
        case $s in ring) src=$phost:7110 rep=127.0.0.1:7210 ;; tcp) src=$phost:7120 rep=127.0.0.1:7220 ;; esac
        pid=$(cat "/tmp/kv/r$s.pid")
        from=$(end_of "$rep")
        kill -STOP "$pid"
        redis-benchmark -h "$phost" -p "${primary[$s]#*:}" -t set -n $((CATCHUP_MIB * 256)) -d 4000 -r 5000 -P 16 -q > /dev/null
        want=$(redis-cli -h "$phost" -p "${primary[$s]#*:}" info replication | sed -n 's/^master_repl_offset:\([0-9]*\).*/\1/p')
        for _ in $(seq 1200); do [ "$(end_of "$src")" -ge "$want" ] && break; sleep 0.1; done
        c0=$(ticks "$pid")
        [ "$role" = one ] && s0=$(ticks "$(cat /tmp/kv/s$s.pid)")
        t0=$(date +%s.%N)
        kill -CONT "$pid"
        for _ in $(seq 6000); do [ "$(end_of "$rep")" -ge "$want" ] && break; sleep 0.05; done
        t1=$(date +%s.%N)
        mib=$(awk -v a="$want" -v b="$from" 'BEGIN {printf "%.2f", (a - b) / 1048576}')
        rate[$s]+="$(awk -v m="$mib" -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", m * 1.048576 / (b - a)}') "
        cpu_rep[$s]+="$(awk -v c="$(($(ticks "$pid") - c0))" -v m="$mib" 'BEGIN {printf "%.1f", c * 10 / m}') "
        [ "$role" = one ] && cpu_src[$s]+="$(awk -v c="$(($(ticks "$(cat /tmp/kv/s$s.pid)") - s0))" -v m="$mib" 'BEGIN {printf "%.1f", c * 10 / m}') "
        echo "run $run $s catch-up: $mib MiB in $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}') s" >&2
    done
    # An ib_write_bw server: a's (told), or this VM's own.
    tell ib
    [ "$role" = one ] && { ib_write_bw -R -d rxe0 -s 4194304 -n $((CATCHUP_MIB / 4)) -F > /dev/null 2>&1 & }
    ok=0
    for _ in $(seq 80); do
        if ib_write_bw -R -d rxe0 -s 4194304 -n $((CATCHUP_MIB / 4)) -F "$phost" > /tmp/kv/ib.out 2>&1; then ok=1; break; fi
        sleep 0.25
    done
    [ "$ok" = 1 ] || { cat /tmp/kv/ib.out >&2; exit 1; }
    ib+="$(awk '$1 == 4194304 {print $4}' /tmp/kv/ib.out) "
done
tell done
m() { printf '%s\n' $1 | sort -n | awk '{x[NR]=$1} END {print x[int((NR+1)/2)]}'; }
name() { case $1 in ring) echo "through the RDMA ring" ;; tcp) echo "through the TCP stream session" ;; direct) echo "direct redis replication" ;; esac; }
echo "RESULT #### WAIT 1 round trip, a writer at $RATE bytes/s of 100-byte values, $LAT_SECS s a run, median of $RUNS alternating runs"
echo "RESULT "
echo "RESULT | path | P50 | P99 | P99.9 | P99.9 / P50 |"
echo "RESULT |---|---|---|---|---|"
for s in ring tcp direct; do
    echo "RESULT | $(name $s) | $(m "${p50[$s]}") ms | $(m "${p99[$s]}") ms | $(m "${p999[$s]}") ms | $(awk -v a="$(m "${p999[$s]}")" -v b="$(m "${p50[$s]}")" 'BEGIN {printf "%.1f", a / b}') |"
done
echo "RESULT "
echo "RESULT ring / TCP stream, P99.9: $(awk -v a="$(m "${p999[ring]}")" -v b="$(m "${p999[tcp]}")" 'BEGIN {printf "%.2f", a / b}')"
echo "RESULT "
echo "RESULT #### Catch-up of $CATCHUP_MIB MiB of writes (4000-byte SETs) after the replica agent was stopped, median of $RUNS"
echo "RESULT "
echo "RESULT | path | MB/s | replica agent CPU ms/MiB | source agent CPU ms/MiB |"
echo "RESULT |---|---|---|---|"
for s in ring tcp; do
    src_cpu=$( [ "$role" = one ] && m "${cpu_src[$s]}" || echo "-" )
    echo "RESULT | $(name $s) | $(m "${rate[$s]}") | $(m "${cpu_rep[$s]}") | $src_cpu |"
done
echo "RESULT | ib_write_bw -R, 4 MiB messages, same rxe0 | $(m "$ib") | | |"
echo "RESULT "
echo "RESULT ring / ib_write_bw: $(awk -v a="$(m "${rate[ring]}")" -v b="$(m "$ib")" 'BEGIN {printf "%.2f", a / b}'); ring / TCP stream: $(awk -v a="$(m "${rate[ring]}")" -v b="$(m "${rate[tcp]}")" 'BEGIN {printf "%.2f", a / b}')"
