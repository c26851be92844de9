#!/usr/bin/env bash
# The TCP data path under kernel TLS vs rustls in user space vs plain TCP,
# inside the VM harness (scripts/rxe-vm.sh, Debian's stock kernel, which
# has the tls module; needs root). Three pairs of agents on the VM's
# loopback — plain, [tls] with kernel_tls = false, [tls] with kernel TLS —
# sync one SIZE snapshot in turn, RUNS times. Prints the medians, the
# ratios to plain TCP, and each agent's CPU seconds per GiB. Under qemu TCG
# every instruction is emulated: the ratios say what kernel TLS saves
# relative to rustls, not what this machine's hardware would move.
#
#   sudo bash scripts/bench-tls-vm.sh        # RUNS=5 SIZE_MIB=64
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != --inside ]; then
    cargo build --locked --release --quiet
    out=$(KVSYNC_BIN=$PWD/target/release/kvsync RUNS=${RUNS:-5} SIZE_MIB=${SIZE_MIB:-64} \
        bash scripts/rxe-vm.sh --timeout 1500 --env KVSYNC_BIN --env RUNS --env SIZE_MIB \
        -- bash "$PWD/scripts/bench-tls-vm.sh" --inside)
    grep '^RESULT ' <<< "$out" | cut -d' ' -f2- | grep . ||
        { echo "no result from the VM run:" >&2; echo "$out" >&2; exit 1; }
    exit 0
fi

# --- inside the VM ------------------------------------------------------------
K=$KVSYNC_BIN
bytes=$((SIZE_MIB << 20))
mkdir -p /tmp/kv
tls=$(bash scripts/bench-pki.sh /tmp/kv/pki)
agent() { # NAME TLS_TABLE [DATA_KEY]
    mkdir -p "/tmp/kv/$1"
    cat > "/tmp/kv/$1.toml" <<EOT
node_id = "$1"
create_dirs = true
snapshot_dir = "/tmp/kv/$1"
[grpc]
listen = "127.0.0.1:0"
[data]
tcp_listen = "127.0.0.1:0"
rdma_port = 0
${3:-}
[metrics]
listen = ""
[transport]
mode = "tcp"
$2
EOT
    "$K" agent --config "/tmp/kv/$1.toml" > "/tmp/kv/$1.out" 2> "/tmp/kv/$1.log" &
    eval "PID_$1=$!"
    for _ in $(seq 600); do grep -q "agent ready" "/tmp/kv/$1.out" && break; sleep 0.1; done
    grep -q "agent ready" "/tmp/kv/$1.out" || { cat "/tmp/kv/$1.log" >&2; exit 1; }
    eval "GRPC_$1=$(sed -n 's/.* grpc=\([^ ]*\).*/\1/p' "/tmp/kv/$1.out")"
}
agent psrc "" && agent pdst ""
agent usrc "$tls" "kernel_tls = false" && agent udst "$tls" "kernel_tls = false"
agent ksrc "$tls" && agent kdst "$tls"
"$K" gen-snapshot --size "$bytes" --seq 1 /tmp/kv/psrc/s.kvr1 > /dev/null
ln /tmp/kv/psrc/s.kvr1 /tmp/kv/usrc/s.kvr1
ln /tmp/kv/psrc/s.kvr1 /tmp/kv/ksrc/s.kvr1
cli() { # MODE ARGS...: the CLI for a pair (TLS pairs need the CA)
    local mode=$1; shift
    if [ "$mode" = p ]; then "$K" "$@"; else "$K" --tls-ca /tmp/kv/pki/ca.pem "$@"; fi
}
for m in p u k; do
    g=GRPC_${m}src
    for _ in $(seq 600); do cli $m snapshots --agent "${!g}" | grep -q s.kvr1 && break; sleep 0.1; done
done
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
declare -A secs=([p]="" [u]="" [k]="") cpu=()
for _ in $(seq "$RUNS"); do
    for m in p u k; do
        s=GRPC_${m}src d=GRPC_${m}dst sp=PID_${m}src dp=PID_${m}dst
        rm -f /tmp/kv/${m}dst/s.kvr1*
        a=$(ticks "${!sp}") b=$(ticks "${!dp}")
        json=$(cli $m sync --agent "${!d}" --source "${!s}" --transport tcp --wait --json)
        grep -q '"status":"succeeded"' <<< "$json" || { echo "sync failed: $json" >&2; exit 1; }
        cpu[${m}src]=$(( ${cpu[${m}src]:-0} + $(ticks "${!sp}") - a ))
        cpu[${m}dst]=$(( ${cpu[${m}dst]:-0} + $(ticks "${!dp}") - b ))
        secs[$m]+="$(sed -E 's/.*"duration_ms":([0-9]+).*/\1/' <<< "$json") "
    done
done
grep -q 'tls="kernel"' /tmp/kv/ksrc.log && grep -q 'tls="rustls"' /tmp/kv/usrc.log ||
    { echo "the TLS pairs did not run as configured" >&2; exit 1; }
median() { printf '%s\n' $1 | sort -n | awk '{x[NR]=$1} END {print x[int((NR+1)/2)]}'; }
rate() { awk -v b="$bytes" -v ms="$(median "$1")" 'BEGIN {printf "%.1f", b / ms / 1000}'; }
per_gib() { awk -v t="$1" -v hz="$(getconf CLK_TCK)" -v b="$((bytes * RUNS))" 'BEGIN {printf "%.2f", t / hz / (b / 1073741824)}'; }
p=$(rate "${secs[p]}") u=$(rate "${secs[u]}") k=$(rate "${secs[k]}")
echo "RESULT ${SIZE_MIB} MiB, $RUNS runs in turn: plain TCP $p MB/s; rustls $u MB/s ($(awk -v a="$u" -v b="$p" 'BEGIN {printf "%.2f", a / b}') × plain); kernel TLS $k MB/s ($(awk -v a="$k" -v b="$p" 'BEGIN {printf "%.2f", a / b}') × plain, $(awk -v a="$k" -v b="$u" 'BEGIN {printf "%.2f", a / b}') × rustls)"
echo "RESULT CPU s/GiB, source / replica: plain $(per_gib "${cpu[psrc]}") / $(per_gib "${cpu[pdst]}"); rustls $(per_gib "${cpu[usrc]}") / $(per_gib "${cpu[udst]}"); kernel TLS $(per_gib "${cpu[ksrc]}") / $(per_gib "${cpu[kdst]}")"
