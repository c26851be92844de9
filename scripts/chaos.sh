#!/usr/bin/env bash
# The chaos run as a soak (tests/chaos.rs; the suite runs it for 30 s):
# a primary, a replica Sentinel may promote, their agents and three
# replica agents in two tiers feeding their servers, a writer whose
# WAIT-acknowledged markers are recorded, and a seeded random schedule of
# faults (agents killed and started again, frozen and thawed, a relay's
# record damaged on disk ahead of a reader, a log disk full, a replica
# server killed and started again from its own configuration, a host's
# link cut, a planned Sentinel failover) for CHAOS_SECONDS on each server. It
# ends with the keyspaces compared, the acknowledged writes looked for on
# every server, the logs checked,
# and a summary line per server (seed, faults by kind, full resyncs,
# keys, markers, agents' peak RSS and fds).
#
#   scripts/chaos.sh                       # 30 minutes on Redis, then on Valkey
#   CHAOS_SECONDS=120 CHAOS_SEED=7 scripts/chaos.sh redis
set -euo pipefail
cd "$(dirname "$0")/.."
export CHAOS_SECONDS=${CHAOS_SECONDS:-1800}
export CHAOS_SEED=${CHAOS_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
servers=${*:-redis valkey}
echo "chaos: seed $CHAOS_SEED, $CHAOS_SECONDS s per server (replay with CHAOS_SEED=$CHAOS_SEED)"
status=0
for s in $servers; do
    log=$(mktemp /tmp/kvsync-chaos-$s.XXXX.log)
    if ! cargo test --release --locked --features faults --test chaos -- --nocapture --exact "chaos_run::$s" > "$log" 2>&1; then
        status=1
        echo "chaos on $s FAILED (seed $CHAOS_SEED); the whole output is in $log"
    fi
    grep -E '^chaos|panicked|assertion' "$log" || true
done
exit $status
