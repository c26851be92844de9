#!/usr/bin/env bash
# The benchmark report: every comparison measured side by side in one run,
# medians of several runs, the machine stated with each table.
#
#   scripts/bench.sh            # prints the report (also target/bench/report.md)
#   scripts/bench.sh --write    # and replaces the generated part of BENCHMARKS.md
#
# Sections:
#   1. full sync over TCP between two agents vs a plain single-stream TCP copy
#      (examples/plain_copy.rs: sendfile, recv, write, fsync) vs rsync (daemon
#      on loopback), per size; CPU seconds per GiB of each
#   1b. TLS vs plain TCP on the host; plain vs rustls vs kernel TLS in the
#      VM's Debian kernel (scripts/bench-tls-vm.sh; as root, BENCH_VM=1)
#   2. the emulated RDMA fabric vs the TCP path on the host; kvsync vs
#      ib_write_bw on soft-RoCE in one VM and between two VMs
#      (scripts/bench-rdma-vms.sh; as root, BENCH_VM=1, the default when root)
#   3. fan-out: 1, 2, 4, 8 replicas of one snapshot at once
#   4. `kvsync verify` vs a sequential read
#   5. seeding a Redis replica vs Redis's own full sync (BENCH_REDIS=1); a
#      Valkey replica vs Valkey's classic and dual-channel full syncs
#   6. pieces and resume: the piece checksum candidates; a sync whose replica
#      agent was killed at 75 % and restarted, resumed, vs a full sync
#   7. relay fan-out on a network that is the bottleneck: one network
#      namespace per agent, egress limited with tc; 1 replica alone vs a
#      star vs a relay tree (scripts/bench-fanout.sh; needs root)
#   8. a long link: 1 vs 4 TCP streams across a veth pair delayed with
#      netem, inside the soft-RoCE VM's Debian kernel (scripts/bench-rtt.sh;
#      as root, BENCH_VM=1)
#   9. the replication stream through two agents vs direct replication:
#      WAIT latency, throughput, egress with 8 replicas, a partition
#      (scripts/bench-stream.sh; the partition needs root; BENCH_REDIS=1)
#   9b. the stream through the RDMA ring vs the TCP stream session vs direct
#      replication on soft-RoCE, one VM and two: WAIT latency, catch-up
#      throughput against ib_write_bw, agent CPU per MiB
#      (scripts/bench-stream-ring.sh; as root, BENCH_VM=1, BENCH_REDIS=1)
#   9c. a Sentinel failover with 4 replicas, kvsync vs plain replication:
#      seconds until every replica holds a write of the new primary, and
#      the full syncs it caused (scripts/bench-failover.sh; BENCH_REDIS=1)
#
# Knobs: SIZES="1GiB 4GiB" RUNS=3 FAN_SIZE=1GiB FANOUT="1 2 4 8"
#        RESUME_SIZE=4GiB RELAY_REPLICAS=8 RELAY_SIZE=512MiB RELAY_RATE=400mbit
#        BENCH_DIR=/dev/shm (tmpfs: takes the disk out) BENCH_VM BENCH_REDIS
#        RTT_MS="100 200" RTT_SIZE=64MiB RTT_RUNS=5 RTT_RMEM=524288 RTT_PIECE=4MiB
#        SECTIONS="1 1b 2 3 4 5 6 7 8 9 9b 9c" (which sections to run; --write needs all)
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
[ "${1:-}" = "--write" ] && write=1
sizes=${SIZES:-1GiB 4GiB}
runs=${RUNS:-3}
fan_size=${FAN_SIZE:-1GiB}
fanout=${FANOUT:-1 2 4 8}
resume_size=${RESUME_SIZE:-4GiB}
relay_replicas=${RELAY_REPLICAS:-8}
relay_size=${RELAY_SIZE:-512MiB}
relay_rate=${RELAY_RATE:-400mbit}
vm=${BENCH_VM:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}
redis=${BENCH_REDIS:-1}
sections=" ${SECTIONS:-1 1b 2 3 4 5 6 7 8 9 9b 9c} "
section() { [[ "$sections" == *" $1 "* ]]; }
if [ "$write" = 1 ] && [ -n "${SECTIONS:-}" ]; then
    echo "--write replaces the whole report: run every section" >&2
    exit 2
fi

bash scripts/deps.sh rsync openssl
cargo build --locked --release --quiet
cargo build --locked --release --quiet --example plain_copy --example hash_speed
bin=$PWD/target/release/kvsync
copy=$PWD/target/release/examples/plain_copy
work=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/kvsync-bench.XXXXXX")
mkdir -p target/bench
report=$PWD/target/bench/report.md
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

machine="$(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, $(date -u +%F)"
fs=$(findmnt -no FSTYPE -T "$work" 2>/dev/null || stat -f -c %T "$work")
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
now() { date +%s.%N; }
# cpu_ticks PID: user + system clock ticks the process has used so far.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
cpu_per_gib() { awk -v t="$1" -v b="$2" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.2f", t / hz / (b / 2^30)}'; }
hwm_mib() { awk '/VmHWM/ {print int($2 / 1024)}' "/proc/$1/status"; }
mbps() { awk -v b="$1" -v s="$2" 'BEGIN {printf "%.0f", b / s / 1e6}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
out() { echo "$*" | tee -a "$report"; }
: > "$report"

# Agents may use the emulated RDMA fabric; syncs choose with --transport.
# The fan-out sources keep the default cache linger (stragglers share the
# load); every other sync is measured cold, as a first sync is.
cat > "$work/fan.toml" <<EOF
[data]
rdma_port = 0
[transport]
mode = "auto"
rdma_provider = "emulated"
EOF
{ cat "$work/fan.toml"; printf '[cache]\nlinger = "0s"\n'; } > "$work/agent.toml"

# start_agent NAME [CONFIG]: sets GRPC_<NAME>, METRICS_<NAME>, PID_<NAME>.
start_agent() {
    local name=$1 config=${2:-$work/agent.toml}
    mkdir -p "$work/$name"
    KVSYNC_LOG=warn "$bin" agent --config "$config" --node-id "$name" \
        --snapshot-dir "$work/$name" --grpc-listen 127.0.0.1:0 \
        --data-listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
        > "$work/$name.out" 2> "$work/$name.log" &
    local pid=$!
    pids+=("$pid")
    for _ in $(seq 400); do
        grep -q "ready" "$work/$name.out" 2>/dev/null && break
        sleep 0.05
    done
    local grpc metrics
    grpc=$(grep -o 'grpc=[^ ]*' "$work/$name.out" | cut -d= -f2)
    metrics=$(grep -o 'metrics=[^ ]*' "$work/$name.out" | cut -d= -f2)
    [ -n "$grpc" ] || { echo "agent $name did not start" >&2; cat "$work/$name.log" >&2; exit 1; }
    eval "GRPC_$name=$grpc; METRICS_$name=$metrics; PID_$name=$pid"
}
stop_agent() { eval "kill \$PID_$1"; }
metric() { curl -s "http://$1/metrics" | awk -v m="$2" '$1 == m {print $2}'; }
# Global CLI options for the agents at hand (TLS: --tls-ca).
cli_opts=()
# offered AGENT FILE: waits until the agent offers FILE.
offered() {
    for _ in $(seq 1200); do
        "$bin" "${cli_opts[@]}" snapshots --agent "$1" | grep -q "$2" && return
        sleep 0.05
    done
    echo "$2 never offered" >&2
    exit 1
}
# sync_secs REPLICA SOURCE TRANSPORT: one sync's duration (checks it succeeded over TRANSPORT).
sync_secs() {
    local json
    json=$("$bin" "${cli_opts[@]}" sync --agent "$1" --source "$2" --transport "$3" --wait --json)
    echo "$json" | grep -q '"status":"succeeded"' || { echo "sync failed: $json" >&2; exit 1; }
    echo "$json" | grep -q "\"transport\":\"$3\"" || { echo "sync did not use $3: $json" >&2; exit 1; }
    echo "$json" | sed -E 's/.*"duration_ms":([0-9]+).*/\1/' | awk '{print $1 / 1000}'
}

# rsync daemon on loopback serving the source dir.
rsync_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$work/rsyncd.conf" <<EOF
use chroot = no
uid = $(id -u)
gid = $(id -g)
[src]
path = $work/source
read only = yes
EOF
rsync --daemon --no-detach --address=127.0.0.1 --port="$rsync_port" --config="$work/rsyncd.conf" &
pids+=($!)

# One session on up to 4 TCP streams: the source grants at most its own
# [data] tcp_streams, a replica asks for its own.
sed 's/^\[data\]$/[data]\ntcp_streams = 4/' "$work/agent.toml" > "$work/streams.toml"
start_agent source "$work/streams.toml"
start_agent replica
start_agent replica4 "$work/streams.toml"

out "## Generated by scripts/bench.sh"
out ""
out "Machine: $machine; files on $fs; median of $runs runs, alternating."
out ""
if section 1 || section 2; then
out "### 1. Full sync over TCP vs a plain TCP copy vs rsync"
out ""
out "| snapshot | kvsync full sync | plain copy | rsync (daemon) | vs plain copy | vs rsync |"
out "|---|---|---|---|---|---|"
emu_row=""
cpu_rows=""
streams_rows=""
for size in $sizes; do
    rm -f "$work"/source/*.kvr1 "$work"/replica/*.kvr1*
    "$bin" gen-snapshot --size "$size" --seq 7 "$work/source/bench-$size.kvr1" > /dev/null
    bytes=$(stat -c %s "$work/source/bench-$size.kvr1")
    offered "$GRPC_source" "bench-$size.kvr1"
    sync_s=(); multi_s=(); copy_s=(); copy_cpu=(); rsync_s=(); emu_s=(); src_ticks=0; dst_ticks=0
    for _ in $(seq "$runs"); do
        a=$(cpu_ticks "$PID_source"); b=$(cpu_ticks "$PID_replica")
        sync_s+=("$(sync_secs "$GRPC_replica" "$GRPC_source" tcp)")
        src_ticks=$((src_ticks + $(cpu_ticks "$PID_source") - a))
        dst_ticks=$((dst_ticks + $(cpu_ticks "$PID_replica") - b))
        multi_s+=("$(sync_secs "$GRPC_replica4" "$GRPC_source" tcp)")
        rm -f "$work/copy.out"
        line=$("$copy" "$work/source/bench-$size.kvr1" "$work/copy.out")
        copy_s+=("$(echo "$line" | cut -d' ' -f1)")
        copy_cpu+=("$(echo "$line" | cut -d' ' -f3)")
        rm -rf "$work/rsync.out"
        t0=$(now)
        rsync --whole-file --fsync "rsync://127.0.0.1:$rsync_port/src/bench-$size.kvr1" "$work/rsync.out"
        t1=$(now)
        rsync_s+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')")
        rm -rf "$work/rsync.out" "$work/copy.out"
        section 2 && [ "$size" = "${sizes%% *}" ] && emu_s+=("$(sync_secs "$GRPC_replica" "$GRPC_source" rdma)")
    done
    s=$(median "${sync_s[@]}"); c=$(median "${copy_s[@]}"); r=$(median "${rsync_s[@]}")
    out "| $size | $(mbps "$bytes" "$s") MB/s | $(mbps "$bytes" "$c") MB/s | $(mbps "$bytes" "$r") MB/s | $(ratio "$c" "$s") | $(ratio "$r" "$s") |"
    m=$(median "${multi_s[@]}")
    streams_rows+="| $size | $(mbps "$bytes" "$s") MB/s | $(mbps "$bytes" "$m") MB/s | $(ratio "$s" "$m") |"$'\n'
    cpu_rows+="| $size | $(cpu_per_gib $((src_ticks / runs)) "$bytes") | $(cpu_per_gib $((dst_ticks / runs)) "$bytes") | $(awk -v c="$(median "${copy_cpu[@]}")" -v b="$bytes" 'BEGIN {printf "%.2f", c / (b / 2^30)}') |"$'\n'
    if [ ${#emu_s[@]} -gt 0 ]; then
        e=$(median "${emu_s[@]}")
        emu_row="| $size | $(mbps "$bytes" "$e") MB/s | $(mbps "$bytes" "$s") MB/s | $(ratio "$s" "$e") |"
    fi
done
replica_rss=$(hwm_mib "$PID_replica")
out ""
out "CPU seconds per GiB moved (user + system; kvsync: each agent process, mean of the runs; plain copy: both ends in one process, median):"
out ""
out "| snapshot | kvsync source | kvsync replica | plain copy, both ends |"
out "|---|---|---|---|"
out "${cpu_rows%$'\n'}"
out ""
out "One session on 4 TCP streams ([data] tcp_streams = 4) vs one stream, same run (loopback: no window limit to overcome):"
out ""
out "| snapshot | 1 stream | 4 streams | 4 / 1 |"
out "|---|---|---|---|"
out "${streams_rows%$'\n'}"
out ""
out "Replica agent peak RSS over these syncs ($(section 2 && echo "TCP and emulated RDMA" || echo TCP)): $replica_rss MiB."
out ""
fi

if section 1b; then
# 1b. TLS on the TCP data path vs plain TCP: agents with [tls] (a CA made
# here) next to the plain ones, the same snapshot, alternating.
tls_size=${sizes%% *}
pki=$work/pki
{ cat "$work/agent.toml"; bash scripts/bench-pki.sh "$pki"; } > "$work/tls.toml"
start_agent tlssrc "$work/tls.toml"
start_agent tlsdst "$work/tls.toml"
rm -f "$work"/source/*.kvr1 "$work"/replica/*.kvr1*
"$bin" gen-snapshot --size "$tls_size" --seq 8 "$work/source/tls.kvr1" > /dev/null
ln "$work/source/tls.kvr1" "$work/tlssrc/tls.kvr1"
bytes=$(stat -c %s "$work/source/tls.kvr1")
offered "$GRPC_source" tls.kvr1
cli_opts=(--tls-ca "$pki/ca.pem")
offered "$GRPC_tlssrc" tls.kvr1
plain_s=(); tls_s=()
# CPU ticks of each agent over the measured syncs.
declare -A ticks=([source]=0 [replica]=0 [tlssrc]=0 [tlsdst]=0)
# timed REPLICA SOURCE ARRAY: one sync over TCP; its seconds go to ARRAY.
timed() {
    local rp=PID_$1 sp=PID_$2 rg=GRPC_$1 sg=GRPC_$2 a b
    local -n secs=$3
    a=$(cpu_ticks "${!rp}"); b=$(cpu_ticks "${!sp}")
    secs+=("$(sync_secs "${!rg}" "${!sg}" tcp)")
    ticks[$1]=$(( ticks[$1] + $(cpu_ticks "${!rp}") - a ))
    ticks[$2]=$(( ticks[$2] + $(cpu_ticks "${!sp}") - b ))
}
for _ in $(seq "$runs"); do
    cli_opts=()
    timed replica source plain_s
    cli_opts=(--tls-ca "$pki/ca.pem")
    timed tlsdst tlssrc tls_s
done
cli_opts=()
grep -q "(TLS" <("$bin" --tls-ca "$pki/ca.pem" status --agent "$GRPC_tlsdst" --json) ||
    { echo "the TLS agents did not use TLS" >&2; exit 1; }
ktls=$("$bin" --tls-ca "$pki/ca.pem" status --agent "$GRPC_tlssrc" --json | sed -E 's/.*"data_tls":"([^"]*)".*/\1/')
stop_agent tlssrc
stop_agent tlsdst
p=$(median "${plain_s[@]}"); t=$(median "${tls_s[@]}")
out "### 1b. TLS on the TCP data path vs plain TCP"
out ""
out "TLS 1.3, TLS13_AES_128_GCM_SHA256; here: $ktls. Same run, alternating:"
out ""
out "| snapshot | TLS | plain TCP | ratio |"
out "|---|---|---|---|"
out "| $tls_size | $(mbps "$bytes" "$t") MB/s | $(mbps "$bytes" "$p") MB/s | $(ratio "$p" "$t") |"
out ""
moved=$(( bytes * runs ))
out "CPU seconds per GiB moved (user + system, each agent over the runs above; steadier than the rates here):"
out ""
out "| | source | replica |"
out "|---|---|---|"
out "| TLS | $(cpu_per_gib "${ticks[tlssrc]}" "$moved") | $(cpu_per_gib "${ticks[tlsdst]}" "$moved") |"
out "| plain TCP | $(cpu_per_gib "${ticks[source]}" "$moved") | $(cpu_per_gib "${ticks[replica]}" "$moved") |"
out ""
if [ "$vm" = 1 ]; then
    if tls_vm=$(bash scripts/bench-tls-vm.sh 2> "$work/tls-vm.log"); then
        out "Kernel TLS where the kernel has it: in the soft-RoCE VM (Debian's kernel, qemu TCG, 2 vCPUs; scripts/bench-tls-vm.sh), plain, rustls and kernel TLS in turn. TCG emulates every instruction, AES-NI too, so this compares the three paths with each other, not with this machine's hardware:"
        out ""
        while read -r l; do out "- $l"; done <<< "$tls_vm"
    else
        out "Kernel TLS VM run: failed (log: $(tail -3 "$work/tls-vm.log" | tr '\n' ' '))"
    fi
else
    out "Kernel TLS VM run: skipped (needs root; BENCH_VM=1)."
fi
out ""
fi

if section 2; then
out "### 2. RDMA"
out ""
out "Host: the EMULATED fabric (an RC QP modelled over TCP; not a fast path) vs the TCP path, same agents, same run:"
out ""
out "| snapshot | emulated RDMA | TCP path | ratio |"
out "|---|---|---|---|"
out "$emu_row"
out ""
if [ "$vm" = 1 ]; then
    vm_log=$work/vm.log
    if bash scripts/bench-rdma-vms.sh > "$vm_log" 2>&1; then
        out "Soft-RoCE (rxe0, qemu TCG, 2 vCPUs per VM; scripts/bench-rdma-vms.sh), kvsync's whole sync vs ib_write_bw -R, each boot alternating:"
        out ""
        while read -r l; do out "- $l"; done < <(grep -E '^(one|two) VM' "$vm_log")
    else
        out "Soft-RoCE VMs: the run failed (log: $(tail -3 "$vm_log" | tr '\n' ' '))"
    fi
else
    out "Soft-RoCE VM: skipped (needs root; BENCH_VM=1)."
fi
out ""
fi

if section 3; then
# 3. Fan-out: a fresh source per round, so its peak RSS and cache loads are the round's.
stop_agent source
stop_agent replica
out "### 3. Fan-out: N replicas of one $fan_size snapshot at once"
out ""
out "| replicas | aggregate | per replica | source peak RSS | cache loads |"
out "|---|---|---|---|---|"
max=$(echo "$fanout" | tr ' ' '\n' | sort -n | tail -1)
for i in $(seq "$max"); do start_agent "r$i"; done
"$bin" gen-snapshot --size "$fan_size" --seq 9 "$work/fan.kvr1" > /dev/null
bytes=$(stat -c %s "$work/fan.kvr1")
for n in $fanout; do
    start_agent "fan$n" "$work/fan.toml"
    cp "$work/fan.kvr1" "$work/fan$n/fan.kvr1"
    eval "src=\$GRPC_fan$n; srcm=\$METRICS_fan$n; srcpid=\$PID_fan$n"
    offered "$src" fan.kvr1
    jobs_=()
    t0=$(now)
    for i in $(seq "$n"); do
        rm -f "$work/r$i"/fan.kvr1*
        eval "g=\$GRPC_r$i"
        "$bin" sync --agent "$g" --source "$src" --transport tcp --wait --json > "$work/fan-$n-$i.json" &
        jobs_+=($!)
    done
    for j in "${jobs_[@]}"; do wait "$j"; done
    t1=$(now)
    if grep -L '"status":"succeeded"' "$work"/fan-"$n"-*.json | grep -q .; then
        echo "fan-out sync failed" >&2
        cat "$work"/fan-"$n"-*.json >&2
        exit 1
    fi
    el=$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')
    loads=$(metric "$srcm" kvsync_snapshot_cache_loads_total)
    out "| $n | $(mbps $((bytes * n)) "$el") MB/s | $(mbps "$bytes" "$el") MB/s | $(hwm_mib "$srcpid") MiB | $loads |"
    stop_agent "fan$n"
done
out ""
out "Targets: source peak RSS ≤ snapshot size + 256 MiB at 8 replicas ($(( bytes / 1048576 + 256 )) MiB here); one read of the file: TCP sends it from the page cache (cache loads 0), RDMA would load it once."
out ""
fi

if section 4; then
out "### 4. Snapshot verification vs sequential read"
out ""
out "| file | sequential read | kvsync verify | ratio | notes |"
out "|---|---|---|---|---|"
out "$(bash scripts/bench-verify.sh 1GiB $((runs * 2 + 1)))"
out ""
fi

if [ "$redis" = 1 ] && section 5; then
    out "### 5. Seeding a Redis replica vs Redis's own full sync"
    out ""
    out "| dataset | kvsync seeding | Redis full sync | ratio | primary forks (kvsync / Redis) | primary CoW (kvsync / Redis) | notes |"
    out "|---|---|---|---|---|---|---|"
    rows=$(AVAILABILITY=1 bash scripts/redis-seed-demo.sh 10000000 100 | grep '^| ')
    out "$(echo "$rows" | head -1)"
    # Under write load: a writer at 4 MiB/s from just before the seeding,
    # a 32 MB backlog the source grows ([redis] grow_backlog).
    out "$(WRITE_RATE=$((4 << 20)) BACKLOG=32mb bash scripts/redis-seed-demo.sh 10000000 100 | grep '^| ' | head -1)"
    out ""
    out "Seconds a client polling the replica saw errors (\`-LOADING\`) or no server, same run:"
    out ""
    out "| dataset | \`redis\` handoff (restart) | \`redis-replicate\`, swapdb, replica of the same primary | Redis full sync | notes |"
    out "|---|---|---|---|---|"
    out "$(echo "$rows" | tail -1)"
    out ""
    out "Valkey 8.0 (Debian 12's backports), same dataset: kvsync seeding vs Valkey's classic full sync vs its dual-channel full sync (both ends \`dual-channel-replication-enabled yes\`, diskless sync, delay 0), in one run:"
    out ""
    out "| dataset | kvsync seeding | classic full sync | ratio | primary forks (kvsync / classic) | primary CoW (kvsync / classic) | notes | dual-channel full sync | ratio | its forks | its CoW |"
    out "|---|---|---|---|---|---|---|---|---|---|---|"
    out "$(SERVER=valkey bash scripts/redis-seed-demo.sh 10000000 100 | grep '^| ' | head -1)"
    # The running server seeded with redis-replicate, loading while the
    # RDB still arrives, at 3 M and 10 M keys.
    for keys in 3000000 10000000; do
        out "$(SERVER=valkey HANDOFF=redis-replicate REPL_LOAD=disabled bash scripts/redis-seed-demo.sh $keys 100 | grep '^| ' | head -1)"
    done
    out ""
fi

if section 6; then
# 6. Pieces and resume. A full sync, then one whose replica agent is
# SIGKILLed once 75 % has arrived and restarted; the sync started again
# resumes. Alternating, each from an empty replica directory. The source
# keeps the default cache linger, as a source whose replica just dropped
# out does: both kinds of sync find its image loaded.
out "### 6. Pieces and resume"
out ""
out "Piece hash candidates and the formats' CRCs, one core over 256 MiB in memory (examples/hash_speed.rs): $(target/release/examples/hash_speed | awk '{printf "%s%s %s MB/s", sep, $1, $2; sep="; "}')."
out ""
start_agent rsrc "$work/fan.toml"
start_agent rdst
"$bin" gen-snapshot --size "$resume_size" --seq 10 "$work/rsrc/resume.kvr1" > /dev/null
bytes=$(stat -c %s "$work/rsrc/resume.kvr1")
offered "$GRPC_rsrc" resume.kvr1
running_bytes() {
    "$bin" status --agent "$1" --json |
        python3 -c 'import json, sys; r = json.load(sys.stdin)["running"]; print(r[0]["bytes"] if r else 0)'
}
full_s=(); resumed_s=(); kept=()
for _ in $(seq "$runs"); do
    rm -rf "${work:?}/rdst"/resume.kvr1* "$work"/rdst/.kvsync-*
    full_s+=("$(sync_secs "$GRPC_rdst" "$GRPC_rsrc" tcp)")
    rm -rf "${work:?}/rdst"/resume.kvr1* "$work"/rdst/.kvsync-*
    "$bin" sync --agent "$GRPC_rdst" --source "$GRPC_rsrc" --transport tcp > /dev/null
    until [ "$(running_bytes "$GRPC_rdst")" -ge $((bytes * 3 / 4)) ]; do sleep 0.02; done
    kill -9 "$PID_rdst"
    wait "$PID_rdst" 2>/dev/null || true
    start_agent rdst
    json=$("$bin" sync --agent "$GRPC_rdst" --source "$GRPC_rsrc" --transport tcp --wait --json)
    echo "$json" | grep -q '"status":"succeeded"' || { echo "resumed sync failed: $json" >&2; exit 1; }
    resumed_s+=("$(echo "$json" | sed -E 's/.*"duration_ms":([0-9]+).*/\1/' | awk '{print $1 / 1000}')")
    kept+=("$(echo "$json" | sed -E 's/.*"resumed_bytes":([0-9]+).*/\1/')")
done
stop_agent rsrc
stop_agent rdst
f=$(median "${full_s[@]}"); r=$(median "${resumed_s[@]}"); k=$(median "${kept[@]}")
out "| snapshot | full sync | resumed attempt (replica agent killed at 75 %, restarted) | resumed / full | found verified in place |"
out "|---|---|---|---|---|"
out "| $resume_size | $f s | $r s | $(ratio "$r" "$f") | $(awk -v k="$k" -v b="$bytes" 'BEGIN {printf "%.0f %%", 100 * k / b}') |"
out ""
fi

if section 7; then
# 7. Relay fan-out, network-bound (its own namespaces; needs root).
out "### 7. Relay fan-out: $relay_replicas replicas of a $relay_size snapshot, each host's egress limited to $relay_rate"
out ""
out "| mode | wall time | / 1 replica | the origin sent |"
out "|---|---|---|---|"
out "$(bash scripts/bench-fanout.sh "$bin" "$relay_replicas" "$relay_size" "$relay_rate")"
out ""
out "Targets: tree ≤ 1.6 × one replica (2 is the floor at degree 2 with capped egress); tree ≤ 0.35 × the star."
out ""
fi

if section 8; then
out "### 8. A long link: one session on 1 vs 4 TCP streams vs \`auto\`"
out ""
if [ "$vm" = 1 ]; then
    rtt_log=$work/rtt.log
    rmem=${RTT_RMEM:-524288}
    out "Two agents in two network namespaces inside the soft-RoCE VM (qemu TCG, 2 vCPUs), a veth pair delayed with netem on both ends, TCP receive buffers capped at $rmem bytes (so a stream's window, not the emulated CPUs, limits it), ${RTT_PIECE:-4MiB} pieces; median of ${RTT_RUNS:-5} alternating runs:"
    out ""
    out "| round trip | snapshot | 1 stream | 4 streams | 4 / 1 | auto | auto / 4 |"
    out "|---|---|---|---|---|---|---|"
    if rows=$(bash scripts/rxe-vm.sh --timeout 1500 -- env RMEM="$rmem" PIECE="${RTT_PIECE:-4MiB}" bash -c \
        'for rtt in $0; do bash scripts/bench-rtt.sh target/release/kvsync "$1" "$2" "$rtt" || exit 1; done' \
        "${RTT_MS:-100 200}" "${RTT_SIZE:-64MiB}" "${RTT_RUNS:-5}" 2> "$rtt_log"); then
        echo "$rows" | grep '^| ' | while read -r row; do out "$row"; done
        out ""
        echo "$rows" | grep -o 'rtt bench runs: .*' | while read -r runs; do
            out "Each run, seconds: ${runs#rtt bench runs: }."
        done
    else
        out "| the VM run failed: $(tail -3 "$rtt_log" | tr '\n' ' ') | | | | | | |"
    fi
    out ""
    out "Target: 4 streams ≥ 2.5 × one stream at both round trips; \`auto\` (the source grants 4) against 4."
else
    out "Skipped (needs root for the VM; BENCH_VM=1)."
fi
out ""
fi

if [ "$redis" = 1 ] && section 9; then
out "### 9. The replication stream: through two agents vs direct replication"
out ""
out "$(bash scripts/bench-stream.sh "$bin" "$runs")"
out ""
fi

if [ "$redis" = 1 ] && section 9b; then
out "### 9b. The replication stream through the RDMA ring (soft-RoCE VMs)"
out ""
if [ "$vm" = 1 ]; then
    out "$(RUNS=$runs bash scripts/bench-stream-ring.sh)"
else
    out "Skipped (needs root for the VM; BENCH_VM=1)."
fi
out ""
fi

if [ "$redis" = 1 ] && section 9c; then
out "### 9c. A Sentinel failover with 4 replicas: kvsync vs plain replication"
out ""
out "$(bash scripts/bench-failover.sh "$bin" "$runs")"
out ""
fi

if [ "$write" = 1 ]; then
    python3 - "$report" <<'EOF'
import sys
report = open(sys.argv[1]).read().rstrip() + "\n"
text = open("BENCHMARKS.md").read()
begin, end = "<!-- bench.sh:begin -->\n", "<!-- bench.sh:end -->\n"
head, rest = text.split(begin, 1)
_, tail = rest.split(end, 1)
open("BENCHMARKS.md", "w").write(head + begin + report + end + tail)
EOF
    echo "BENCHMARKS.md updated" >&2
fi
