//! Real RDMA verbs without an RDMA NIC: the soft-RoCE VM harness
//! (`scripts/rxe-vm.sh`) boots Debian's stock kernel with `rdma_rxe`, and
//! these tests check, in one VM boot to keep CI time down, that rxe0 is
//! ACTIVE, that perftest's `ib_write_bw -R` moves 4 MiB messages over real
//! rdma_cm connections, that kvsync's probe finds rxe0 (soft, capped) and
//! `auto` picks RDMA there, and that real agents sync 0-byte-payload, odd
//! and 32 MiB snapshots by RDMA Writes over rxe0 — with a source addressed as
//! 127.0.0.1 reached through the interface address, a piece damaged in the
//! replica's memory written again alone over rxe0, and a real remote
//! access error (wrong rkey) falling back to TCP — and a real Redis replica
//! seeded over rxe0 that continues with a partial resync. On the host the
//! probe finds nothing and `auto` picks TCP.

mod common;

use std::io::Write;

use common::*;

/// Everything checked inside the VM, section by section.
const VM_SCRIPT: &str = r#"
set -u
K=$KVSYNC_BIN
mkdir -p /tmp/kv
# Starts an agent; prints its ready line once it is ready. $DIR, $PRE
# (top-level keys) and $POST (tables) adjust its config.
start_agent() {
    name=$1 mode=$2 fallback=$3; shift 3
    dir=${DIR:-/tmp/kv/$name}
    mkdir -p $dir
    cat > /tmp/kv/$name.toml <<EOT
node_id = "$name"
snapshot_dir = "$dir"
${PRE:-}
[grpc]
listen = "127.0.0.1:0"
[data]
tcp_listen = "127.0.0.1:0"
rdma_port = 0
[metrics]
listen = ""
[watch]
debounce = "20ms"
[transport]
mode = "$mode"
fallback_to_tcp = $fallback
${POST:-}
EOT
    env "$@" "$K" agent --config /tmp/kv/$name.toml > /tmp/kv/$name.out 2> /tmp/kv/$name.log &
    for i in $(seq 600); do grep -q "kvsync agent ready" /tmp/kv/$name.out && break; sleep 0.1; done
    grep "kvsync agent ready" /tmp/kv/$name.out || { cat /tmp/kv/$name.log >&2; exit 1; }
}
# Waits until agent $1 offers seq $2.
offered() {
    for i in $(seq 300); do "$K" snapshots --agent $1 --json | grep -q "\"seq\":$2[,}]" && return; sleep 0.1; done
    echo "snapshot seq $2 never offered by $1"; exit 1
}
grpc() { sed 's/.* grpc=\([^ ]*\).*/\1/'; }

echo "== devinfo"
ibv_devinfo -d rxe0 | grep -E 'hca_id|state'
echo "== probe"
"$K" probe --json
echo "== ib_write_bw"
ib_write_bw -R -d rxe0 -s 4194304 -n 40 -F > /tmp/server.log 2>&1 &
server=$!
ok=0
# The server needs a moment to listen; retry the client with a bound.
for attempt in $(seq 40); do
    if ib_write_bw -R -d rxe0 -s 4194304 -n 40 -F 10.0.2.15 > /tmp/client.log 2>&1; then ok=1; break; fi
    sleep 0.25
done
wait $server
cat /tmp/client.log
[ $ok = 1 ] || { echo "ib_write_bw client never connected"; cat /tmp/server.log; exit 1; }

echo "== agents"
SRC_LINE=$(start_agent src auto true) || exit 1
BAD_LINE=$(start_agent bad auto true KVSYNC_FAULTS=rdma_bad_rkey=1) || exit 1
DST_LINE=$(start_agent dst rdma true) || exit 1
echo "$SRC_LINE"
SRC=$(echo "$SRC_LINE" | grpc) BAD=$(echo "$BAD_LINE" | grpc) DST=$(echo "$DST_LINE" | grpc)
for spec in "36 1" "1234567 2" "33554432 3"; do
    set -- $spec
    "$K" gen-snapshot --size $1 --seq $2 /tmp/kv/src/s$2.kvr1 > /dev/null
    offered $SRC $2
    echo "== sync $1"
    "$K" sync --agent $DST --source $SRC --wait --json
    cmp /tmp/kv/src/s$2.kvr1 /tmp/kv/dst/s$2.kvr1 && echo "identical"
    head -1 /tmp/kv/dst/s$2.kvr1.replmeta
done
echo "== damaged piece"
# The replica's driver damages piece 1 (of two) in its receive memory once:
# only that piece is written again over rxe0, no fallback.
DMG=$(DIR=/tmp/kv/dmg start_agent dmg rdma false KVSYNC_FAULTS=rdma_damage_piece=1 | grpc) || exit 1
"$K" sync --agent $DMG --source $SRC --wait --json
cmp /tmp/kv/src/s3.kvr1 /tmp/kv/dmg/s3.kvr1 && echo "identical"
echo "== fallback"
"$K" gen-snapshot --size 4194304 --seq 9 /tmp/kv/bad/b9.kvr1 > /dev/null
offered $BAD 9
"$K" sync --agent $DST --source $BAD --wait --json
cmp /tmp/kv/bad/b9.kvr1 /tmp/kv/dst/b9.kvr1 && echo "identical"
echo "== source log"
grep -E "rdma bulk done|REM_ACCESS|transport selection" /tmp/kv/src.log /tmp/kv/bad.log

echo "== redis"
# A primary with a backlog and a few MB of keys, saved, then written to;
# a replica server seeded over rxe0 that must continue with a partial resync.
RP=7001 RH=7002 RR=7003
rs() {
    name=$1 port=$2; shift 2
    mkdir -p /tmp/kv/$name
    redis-server --port $port --bind 127.0.0.1 --dir /tmp/kv/$name --save "" --appendonly no \
        --daemonize yes --pidfile /tmp/kv/$name/redis.pid --logfile /tmp/kv/$name/redis.log "$@"
    for i in $(seq 300); do redis-cli -p $port ping > /dev/null 2>&1 && return; sleep 0.1; done
    echo "redis $name did not start"; exit 1
}
link_up() {
    for i in $(seq 600); do redis-cli -p $1 info replication | grep -q master_link_status:up && return; sleep 0.1; done
    echo "no replication link on $1"; exit 1
}
rs rprimary $RP --repl-diskless-sync-delay 0 --enable-debug-command yes
rs rhelper $RH --replicaof 127.0.0.1 $RP
link_up $RH
redis-cli -p $RH shutdown nosave > /dev/null 2>&1 || true
no_fork() {
    for i in $(seq 600); do redis-cli -p $RP info persistence | grep -q rdb_bgsave_in_progress:0 && return; sleep 0.1; done
    echo "the primary's fork never exited"; exit 1
}
# The helper's diskless sync fork may outlive its link coming up.
no_fork
redis-cli -p $RP debug populate 50000 key 64 > /dev/null
redis-cli -p $RP bgsave | grep -q 'Background saving started' || { echo "BGSAVE refused"; exit 1; }
no_fork
redis-cli -p $RP set after-save yes > /dev/null
rs rreplica $RR
RSRC=$(DIR=/tmp/kv/rprimary PRE='snapshot_format = "redis-rdb"' POST="[redis]
primary_addr = \"127.0.0.1:$RP\"" start_agent rsrc auto true | grpc) || exit 1
START="[\"redis-server\", \"--port\", \"$RR\", \"--bind\", \"127.0.0.1\", \"--dir\", \"{dir}\", \"--dbfilename\", \"{dbfilename}\", \"--replicaof\", \"{primary_host}\", \"{primary_port}\", \"--appendonly\", \"no\", \"--save\", \"\", \"--daemonize\", \"yes\", \"--pidfile\", \"/tmp/kv/rreplica/redis.pid\", \"--logfile\", \"/tmp/kv/rreplica/redis.log\"]"
RDST=$(PRE='snapshot_format = "redis-rdb"' POST="[handoff]
mode = \"redis\"
timeout = \"120s\"
[redis]
server_addr = \"127.0.0.1:$RR\"
dir = \"/tmp/kv/rreplica\"
dbfilename = \"dump.rdb\"
primary = \"127.0.0.1:$RP\"
start = $START" start_agent rdst rdma false | grpc) || exit 1
for i in $(seq 300); do "$K" snapshots --agent $RSRC | grep -q dump.rdb && break; sleep 0.1; done
"$K" sync --agent $RDST --source $RSRC --wait --json
redis-cli -p $RP info stats | grep -E "^sync_(full|partial_ok):"
for i in $(seq 300); do [ "$(redis-cli -p $RR get after-save)" = yes ] && break; sleep 0.1; done
echo "after-save=$(redis-cli -p $RR get after-save) keys=$(redis-cli -p $RR dbsize)/$(redis-cli -p $RP dbsize)"
echo "== done"
"#;

fn section<'a>(out: &'a str, name: &str) -> &'a str {
    let start = out
        .find(&format!("== {name}\n"))
        .unwrap_or_else(|| panic!("no section {name} in:\n{out}"));
    let rest = &out[start + name.len() + 4..];
    &rest[..rest.find("\n== ").map_or(rest.len(), |e| e + 1)]
}

#[test]
fn soft_roce_vm_has_active_rxe0_and_real_verbs() {
    let Some(run) = run_in_vm(
        &["bash", "-c", VM_SCRIPT],
        &[("KVSYNC_BIN", kvsync_bin())],
        300,
    ) else {
        return;
    };
    assert_eq!(
        run.code, 0,
        "VM run failed (code {}):\n{}\n{}",
        run.code, run.stdout, run.stderr
    );
    let out = &run.stdout;

    let devinfo = section(out, "devinfo");
    assert!(
        devinfo.contains("rxe0") && devinfo.contains("PORT_ACTIVE"),
        "{devinfo}"
    );

    let probe: serde_json::Value =
        serde_json::from_str(section(out, "probe").trim()).expect("probe JSON");
    assert_eq!(probe["rdma_available"], true, "{probe}");
    assert_eq!(probe["device"], "rxe0");
    assert_eq!(probe["devices"][0]["soft"], true);
    assert_eq!(probe["devices"][0]["ports"][0]["state"], "ACTIVE");

    // perftest's result line: bytes, iterations, BW peak, BW average, msg rate.
    let bw = section(out, "ib_write_bw");
    let line = bw
        .lines()
        .find(|l| l.trim_start().starts_with("4194304"))
        .unwrap_or_else(|| panic!("no 4 MiB result line in:\n{bw}"));
    let avg: f64 = line
        .split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .expect("BW average");
    assert!(avg > 0.0, "{line}");
    assert_eq!(
        probe["choice"], "rdma",
        "auto picks RDMA in the VM: {probe}"
    );
    assert_eq!(probe["soft"], true);
    assert_eq!(
        (probe["chunk_mb"].as_u64(), probe["pipeline"].as_u64()),
        (Some(4), Some(32))
    );
    assert_eq!(probe["local_addr"], "10.0.2.15");

    // Real RDMA syncs between agents, the source addressed as 127.0.0.1.
    assert!(
        section(out, "agents").contains("rdma=verbs:10.0.2.15:"),
        "{}",
        section(out, "agents")
    );
    for (size, seq) in [(36u64, 1u64), (1_234_567, 2), (32 << 20, 3)] {
        let sec = section(out, &format!("sync {size}"));
        let json = sec
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("no JSON in {sec}"));
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["status"], "succeeded", "{v}\n{}", run.stderr);
        assert_eq!(v["transport"], "rdma", "{v}");
        assert_eq!(v["fallback_reason"], "", "{v}");
        assert_eq!(v["bytes"].as_u64(), Some(size));
        let detail = v["detail"].as_str().unwrap();
        assert!(
            detail.contains("rdma verbs via rxe0") && detail.contains("to 10.0.2.15:"),
            "{detail}"
        );
        assert!(detail.contains("receive memory:"), "{detail}");
        assert!(sec.contains("identical"), "{sec}");
        assert!(sec.contains(&format!("REPLMETA {seq}")), "{sec}");
    }

    // A damaged piece is written again over rxe0 alone.
    let dmg = section(out, "damaged piece");
    let v: serde_json::Value = serde_json::from_str(
        dmg.lines()
            .find(|l| l.starts_with('{'))
            .expect("damaged piece JSON"),
    )
    .unwrap();
    assert_eq!(
        (v["status"].as_str(), v["transport"].as_str()),
        (Some("succeeded"), Some("rdma")),
        "{v}"
    );
    assert_eq!(v["pieces_refetched"], 1, "{v}");
    assert_eq!(v["fallback_reason"], "", "{v}");
    assert!(dmg.contains("identical"), "{dmg}");

    // A real remote access error from rxe0, then TCP.
    let fb = section(out, "fallback");
    let v: serde_json::Value = serde_json::from_str(
        fb.lines()
            .find(|l| l.starts_with('{'))
            .expect("fallback JSON"),
    )
    .unwrap();
    assert_eq!(
        (v["status"].as_str(), v["transport"].as_str()),
        (Some("succeeded"), Some("tcp")),
        "{v}"
    );
    assert!(
        v["fallback_reason"]
            .as_str()
            .unwrap()
            .starts_with("completion_error"),
        "{v}"
    );
    assert!(fb.contains("identical"), "{fb}");
    let logs = section(out, "source log");
    assert!(logs.contains("REM_ACCESS_ERR"), "{logs}");

    // A Redis replica seeded by real RDMA continues with a partial resync.
    let r = section(out, "redis");
    let v: serde_json::Value = serde_json::from_str(
        r.lines()
            .find(|l| l.starts_with('{'))
            .expect("redis sync JSON"),
    )
    .unwrap();
    assert_eq!(
        (v["status"].as_str(), v["transport"].as_str()),
        (Some("succeeded"), Some("rdma")),
        "{v}"
    );
    assert!(
        v["handoff"]
            .as_str()
            .unwrap()
            .contains("partial resync accepted"),
        "{v}"
    );
    let stat = |k: &str| {
        r.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("{k}:"))?.parse::<u64>().ok())
    };
    assert_eq!(
        (stat("sync_full"), stat("sync_partial_ok")),
        (Some(1), Some(1)),
        "{r}"
    );
    assert!(r.contains("after-save=yes keys=50001/50001"), "{r}");

    // kvsync's bulk throughput against ib_write_bw on the same device.
    let bulk: f64 = logs
        .lines()
        .filter(|l| l.contains("rdma bulk done") && l.contains("writes=8"))
        .find_map(|l| {
            l.split("bulk_mb_s=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no 32 MiB bulk line in {logs}"));
    let _ = writeln!(
        std::io::stderr(),
        "soft-RoCE, same VM run: ib_write_bw -R 4 MiB {avg:.1} MB/s; kvsync RDMA bulk (32 MiB, 4 MiB writes) {bulk:.1} MB/s; ratio {:.2}",
        bulk / avg
    );
}

#[test]
fn host_probe_finds_no_rdma() {
    let out = std::process::Command::new(kvsync_bin())
        .args(["probe", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "probe exits 0 without RDMA");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if std::path::Path::new("/sys/class/infiniband").exists() {
        return; // a host with a real RDMA stack
    }
    assert_eq!(v["rdma_available"], false);
    assert_eq!(v["devices"], serde_json::json!([]));
    assert!(v["reason"].as_str().unwrap().starts_with("no RDMA"));
    let text = std::process::Command::new(kvsync_bin())
        .arg("probe")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("would use: tcp"));
}
