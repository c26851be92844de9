#!/usr/bin/env bash
# kvsync's RDMA sync against perftest's ib_write_bw on soft-RoCE, in the VM
# harness (scripts/rxe-vm.sh; needs root): one VM (both ends on its rxe0)
# and two VMs joined by one link (an end in each). In each boot the two
# alternate RUNS times: `ib_write_bw -R` of SIZE in 4 MiB messages, then a
# full kvsync sync of a SIZE snapshot over RDMA (its bytes over its
# duration, handshake, checks and fsync included). Prints one line per
# setup: medians, spread and the ratio kvsync / ib_write_bw.
#
#   sudo bash scripts/bench-rdma-vms.sh        # RUNS=5 SIZE_MIB=128 HOSTS="1 2"
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != --inside ]; then
    # ib_write_bw wants at least 5 iterations of its 4 MiB messages.
    [ "${SIZE_MIB:-128}" -ge 20 ] || { echo "SIZE_MIB must be at least 20" >&2; exit 2; }
    cargo build --locked --release --quiet
    for hosts in ${HOSTS:-1 2}; do
        out=$(KVSYNC_BIN=$PWD/target/release/kvsync RUNS=${RUNS:-5} SIZE_MIB=${SIZE_MIB:-128} \
            bash scripts/rxe-vm.sh --hosts "$hosts" --timeout 1500 \
            --env KVSYNC_BIN --env RUNS --env SIZE_MIB -- bash scripts/bench-rdma-vms.sh --inside)
        line=$(grep -m1 '^RESULT ' <<< "$out" | cut -d' ' -f2-) ||
            { echo "no result from the $hosts-VM run:" >&2; echo "$out" >&2; exit 1; }
        case "$hosts" in
            1) echo "one VM (both ends on rxe0): $line" ;;
            2) echo "two VMs (one link between them): $line" ;;
        esac
    done
    exit 0
fi

# --- inside a VM --------------------------------------------------------------
K=$KVSYNC_BIN
runs=$RUNS
bytes=$((SIZE_MIB << 20))
iters=$((SIZE_MIB / 4))
role=${KVSYNC_VM_HOST:-one}
addr=${KVSYNC_VM_ADDR:-10.0.2.15}
server=${KVSYNC_VM_PEER:-10.0.2.15}
mkdir -p /tmp/kv
echo kvsync-rdma-bench-token-0123456789abcdef > /tmp/kv/token
export KVSYNC_TOKEN_FILE=/tmp/kv/token
agent() { # NAME GRPC_LISTEN
    mkdir -p "/tmp/kv/$1"
    cat > "/tmp/kv/$1.toml" <<EOT
node_id = "$1"
create_dirs = true
snapshot_dir = "/tmp/kv/$1"
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
[cache]
linger = "0s"
[transport]
mode = "rdma"
fallback_to_tcp = false
EOT
    "$K" agent --config "/tmp/kv/$1.toml" > "/tmp/kv/$1.out" 2> "/tmp/kv/$1.log" &
    for _ in $(seq 600); do grep -q "agent ready" "/tmp/kv/$1.out" && return; sleep 0.1; done
    cat "/tmp/kv/$1.log" >&2
    exit 1
}
src=$server:7100
if [ "$role" != b ]; then
    # The source end: an agent and one ib_write_bw server per run.
    agent src "$addr:7100"
    "$K" gen-snapshot --size "$bytes" --seq 1 /tmp/kv/src/s.kvr1 > /dev/null
    (for _ in $(seq "$runs"); do
        ib_write_bw -R -d rxe0 -s 4194304 -n "$iters" -F > /dev/null 2>&1 ||
            echo "ib_write_bw server failed" >&2
    done) &
    [ "$role" = a ] && { busybox nc -l -p 7199 > /dev/null; exit 0; }
fi
for _ in $(seq 600); do "$K" snapshots --agent "$src" 2>/dev/null | grep -q s.kvr1 && break; sleep 0.2; done
agent dst 127.0.0.1:7200
ib=() kv=()
for _ in $(seq "$runs"); do
    ok=0
    for _ in $(seq 80); do
        if ib_write_bw -R -d rxe0 -s 4194304 -n "$iters" -F "$server" > /tmp/kv/ib.out 2>&1; then ok=1; break; fi
        sleep 0.25
    done
    [ "$ok" = 1 ] || { cat /tmp/kv/ib.out >&2; exit 1; }
    ib+=("$(awk '$1 == 4194304 {print $4}' /tmp/kv/ib.out)")
    rm -f /tmp/kv/dst/s.kvr1*
    json=$("$K" sync --agent 127.0.0.1:7200 --source "$src" --transport rdma --wait --json)
    grep -q '"transport":"rdma"' <<< "$json" && grep -q '"status":"succeeded"' <<< "$json" ||
        { echo "sync failed: $json" >&2; exit 1; }
    ms=$(sed -E 's/.*"duration_ms":([0-9]+).*/\1/' <<< "$json")
    kv+=("$(awk -v b="$bytes" -v ms="$ms" 'BEGIN {printf "%.1f", b / ms / 1000}')")
done
[ "$role" = b ] && echo done | busybox nc -w 5 "$server" 7199
stats() { printf '%s\n' "$@" | sort -n | awk '{x[NR]=$1} END {printf "%s %s %s", x[int((NR+1)/2)], x[1], x[NR]}'; }
read -r ib_med ib_min ib_max <<< "$(stats "${ib[@]}")"
read -r kv_med kv_min kv_max <<< "$(stats "${kv[@]}")"
echo "RESULT ${SIZE_MIB} MiB, $runs alternating runs: ib_write_bw -R median $ib_med MB/s ($ib_min–$ib_max); kvsync sync median $kv_med MB/s ($kv_min–$kv_max); ratio $(awk -v a="$kv_med" -v b="$ib_med" 'BEGIN {printf "%.2f", a / b}')"
