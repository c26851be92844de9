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
//! seeded over rxe0 that continues with a partial resync; and, since the
//! VM's kernel has the `tls` module, agents with [tls] sync with their TLS
//! records in the kernel, against each other and against rustls; and a
//! replica with `tcp_streams = "auto"` runs 3 streams over a loopback
//! delayed to a 60 ms round trip (netem). A second test
//! boots two such VMs joined by one link (`rxe-vm.sh --hosts 2`): each
//! probe picks the link, not the NAT interface; a snapshot and a Redis
//! replica's seed cross between them over real RDMA; the source's rxe0,
//! then the replica's, is deleted mid-sync (the sync resumes over TCP, the
//! device can go, RDMA is back once it returns); the replica's link goes
//! down mid-sync; and a replica's agent is killed mid-sync. Each of those
//! events happens while the source holds its transfer at 8 MiB (the
//! `rdma_hold_after` fault), so no fast or slow transfer can overtake it.
//! The harness runs one VM job at a time. On the host the probe finds
//! nothing and `auto` picks TCP.

mod common;

use std::io::Write;

use common::*;

/// Everything checked inside the VM, section by section.
const VM_SCRIPT: &str = r#"
set -u
K=$KVSYNC_BIN
mkdir -p /tmp/kv
# Starts an agent; prints its ready line once it is ready. $DIR, $PRE
# (top-level keys), $DATA ([data] keys) and $POST (tables) adjust its
# config.
start_agent() {
    name=$1 mode=$2 fallback=$3; shift 3
    dir=${DIR:-/tmp/kv/$name}
    mkdir -p $dir
    cat > /tmp/kv/$name.toml <<EOT
node_id = "$name"
create_dirs = true
snapshot_dir = "$dir"
${PRE:-}
[grpc]
listen = "127.0.0.1:0"
[data]
tcp_listen = "127.0.0.1:0"
rdma_port = 0
${DATA:-}
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
echo "== write after verify"
# A source that writes into piece 0 once more after its PACK, before BDON:
# the replica never installs what it did not verify (no fallback).
WAV=$(start_agent wav auto true KVSYNC_FAULTS=rdma_write_after_verify=1 | grpc) || exit 1
WDST=$(start_agent wdst rdma false | grpc) || exit 1
"$K" gen-snapshot --size 4194304 --seq 8 /tmp/kv/wav/w8.kvr1 > /dev/null
offered $WAV 8
"$K" sync --agent $WDST --source $WAV --wait --json
cmp /tmp/kv/wav/w8.kvr1 /tmp/kv/wdst/w8.kvr1 2> /dev/null && echo "identical"
ls -A /tmp/kv/wdst | sed 's/^/left: /'
echo "== fallback"
"$K" gen-snapshot --size 4194304 --seq 9 /tmp/kv/bad/b9.kvr1 > /dev/null
offered $BAD 9
"$K" sync --agent $DST --source $BAD --wait --json
cmp /tmp/kv/bad/b9.kvr1 /tmp/kv/dst/b9.kvr1 && echo "identical"
echo "== source log"
grep -E "rdma bulk done|REM_ACCESS|transport selection" /tmp/kv/src.log /tmp/kv/bad.log

echo "== kernel tls"
# Agents with [tls] (a CA made here): the kernel's TLS on both ends, from
# the kernel to rustls, and from rustls to the kernel. The kernel's TLS
# counters tell which sockets it carried.
P=/tmp/kv/pki
mkdir -p $P
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj "/CN=vm CA" \
    -keyout $P/ca.key -out $P/ca.pem 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout $P/a.key -out $P/a.csr 2>/dev/null
echo "subjectAltName=DNS:localhost,IP:127.0.0.1" > $P/san.cnf
openssl x509 -req -in $P/a.csr -CA $P/ca.pem -CAkey $P/ca.key -CAcreateserial -days 1 \
    -extfile $P/san.cnf -out $P/a.pem 2>/dev/null || { echo "no certificate"; exit 1; }
TLS="[tls]
cert_file = \"$P/a.pem\"
key_file = \"$P/a.key\"
ca_file = \"$P/ca.pem\""
USER_TLS="kernel_tls = false"
KSRC=$(POST="$TLS" start_agent ksrc tcp false | grpc) || exit 1
USRC=$(DATA="$USER_TLS" POST="$TLS" start_agent usrc tcp false | grpc) || exit 1
KDST=$(POST="$TLS" start_agent kdst tcp false | grpc) || exit 1
UDST=$(DATA="$USER_TLS" POST="$TLS" start_agent udst tcp false | grpc) || exit 1
T="$K --tls-ca $P/ca.pem"
"$K" gen-snapshot --size 8388608 --seq 5 /tmp/kv/ksrc/t5.kvr1 > /dev/null
"$K" gen-snapshot --size 8388608 --seq 6 /tmp/kv/usrc/t6.kvr1 > /dev/null
for a in "$KSRC 5" "$USRC 6"; do
    set -- $a
    for i in $(seq 300); do $T snapshots --agent $1 --json | grep -q "\"seq\":$2[,}]" && break; sleep 0.1; done
done
echo "== kernel tls status"
$T status --agent $KSRC --json
$T status --agent $UDST --json
tls_socks() { awk '$1 == "TlsTxSw" {tx=$2} $1 == "TlsRxSw" {rx=$2} END {print tx + 0, rx + 0}' /proc/net/tls_stat; }
for run in "kernel-kernel $KDST $KSRC ksrc/t5 kdst/t5" "kernel-rustls $UDST $KSRC ksrc/t5 udst/t5" \
           "rustls-kernel $KDST $USRC usrc/t6 kdst/t6"; do
    set -- $run
    before=$(tls_socks)
    echo "== tls $1"
    $T sync --agent $2 --source $3 --wait --json
    cmp /tmp/kv/$4.kvr1 /tmp/kv/$5.kvr1 && echo "identical"
    echo "kernel tls sockets before $before after $(tls_socks)"
done
echo "== tls source logs"
grep -h "serving snapshot" /tmp/kv/ksrc.log /tmp/kv/usrc.log

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

echo "== auto streams"
# tcp_streams = "auto" over a real long link: loopback delayed 30 ms each
# way (netem), so the replica's handshake takes 60 ms; its receive buffer
# capped at 256 KiB keeps one stream window-bound (about 2 MB/s), so its
# first second leaves far more than 2 s to go. The rule: 3 streams.
ASRC=$(DATA='tcp_streams = 4
piece_size = "1MiB"' start_agent asrc tcp false | grpc) || exit 1
ADST=$(DATA='tcp_streams = "auto"' start_agent adst tcp false | grpc) || exit 1
"$K" gen-snapshot --size 16777216 --seq 11 /tmp/kv/asrc/a11.kvr1 > /dev/null
offered $ASRC 11
rmem=$(cat /proc/sys/net/ipv4/tcp_rmem)
echo "4096 131072 262144" > /proc/sys/net/ipv4/tcp_rmem
tc qdisc add dev lo root netem delay 30ms limit 100000 || exit 1
"$K" sync --agent $ADST --source $ASRC --wait --json
tc qdisc del dev lo root
echo "$rmem" > /proc/sys/net/ipv4/tcp_rmem
cmp /tmp/kv/asrc/a11.kvr1 /tmp/kv/adst/a11.kvr1 && echo "identical"
echo "== done"
"#;

fn section<'a>(out: &'a str, name: &str) -> &'a str {
    let start = out
        .find(&format!("== {name}\n"))
        .unwrap_or_else(|| panic!("no section {name} in:\n{out}"));
    let rest = &out[start + name.len() + 4..];
    &rest[..rest.find("\n== ").map_or(rest.len(), |e| e + 1)]
}

/// The VMs' time limits, about twice the slowest run seen on this project's
/// machine kind (2 cores, TCG), where the harness runs one VM job at a
/// time: the one-VM script took 65-68 s on a quiet machine and up to 88 s
/// beside a build, the two-host script 120-124 s and up to 157 s
/// (`scripts/test.sh` prints every section's seconds).
const ONE_VM_LIMIT_S: u32 = 180;
const TWO_VMS_LIMIT_S: u32 = 320;
/// The stream's two-host script (not yet measured on that machine kind;
/// set from runs on a 2-core TCG machine here, doubled).
const STREAM_VMS_LIMIT_S: u32 = 400;

/// Runs `script` in one VM or in two joined ones; it must succeed. `None`
/// where the VMs cannot run here.
fn script_ok(hosts: u8, script: &str, timeout_s: u32) -> Option<VmRun> {
    let cmd = ["bash", "-c", script];
    let env = [("KVSYNC_BIN", kvsync_bin())];
    let run = match hosts {
        1 => run_in_vm(&cmd, &env, timeout_s),
        _ => run_in_two_vms(&cmd, &env, timeout_s),
    }?;
    assert_eq!(
        run.code, 0,
        "VM run failed (code {}):\n{}\n{}",
        run.code, run.stdout, run.stderr
    );
    Some(run)
}

/// Sections "kernel tls ...": Debian's kernel has the `tls` module, so
/// agents with [tls] report kernel TLS; each sync below is byte-identical
/// and its kernel sockets are exactly the ends with `kernel_tls` on (the
/// kernel's own counters: a socket with keys in each direction), so the
/// kernel sealed what rustls opened and opened what rustls sealed.
fn assert_kernel_tls(out: &str) {
    let status: Vec<serde_json::Value> = section(out, "kernel tls status")
        .lines()
        .map(|l| serde_json::from_str(l).expect("status JSON"))
        .collect();
    let tls = |v: &serde_json::Value| v["data_tls"].as_str().unwrap().to_string();
    assert!(tls(&status[0]).starts_with("kernel TLS"), "{}", status[0]);
    assert!(
        tls(&status[1]).contains("kernel_tls = false"),
        "{}",
        status[1]
    );
    for (run, kernel_ends, detail) in [
        ("kernel-kernel", 2, "tcp (TLS in the kernel) stream"),
        ("kernel-rustls", 1, "tcp (TLS) stream"),
        ("rustls-kernel", 1, "tcp (TLS in the kernel) stream"),
    ] {
        let name = format!("tls {run}");
        let sec = section(out, &name);
        let v = synced(out, &name, "tcp");
        assert!(v["detail"].as_str().unwrap().starts_with(detail), "{v}");
        assert!(sec.contains("identical"), "{sec}");
        let counts: Vec<u64> = sec
            .lines()
            .find_map(|l| l.strip_prefix("kernel tls sockets before "))
            .unwrap_or_else(|| panic!("no counters in {sec}"))
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        // TlsTxSw and TlsRxSw, before and after.
        assert_eq!(
            (counts[2] - counts[0], counts[3] - counts[1]),
            (kernel_ends, kernel_ends),
            "{run}: {sec}"
        );
    }
    let logs = section(out, "tls source logs");
    assert_eq!(logs.matches("tls=\"kernel\"").count(), 2, "{logs}");
    assert_eq!(logs.matches("tls=\"rustls\"").count(), 1, "{logs}");
}

/// Section "redis" of `out`: the sync succeeded over RDMA, the replica
/// server continued with a partial resync (the primary counted one full
/// sync, the helper's, and one partial), and it has every key, the one
/// written after the save too.
fn assert_redis_seeded_over_rdma(out: &str) {
    let r = section(out, "redis");
    let v = synced(out, "redis", "rdma");
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
}

/// The seconds on the line "`prefix`N s" of `out`.
fn seconds(out: &str, prefix: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix)?.strip_suffix(" s")?.parse().ok())
        .unwrap_or_else(|| panic!("no line {prefix:?}… in:\n{out}"))
}

/// Section `name` of `out` is a sync that succeeded over `transport`:
/// its JSON line.
fn synced(out: &str, name: &str, transport: &str) -> serde_json::Value {
    let v = section_json(out, name);
    assert_eq!(
        (v["status"].as_str(), v["transport"].as_str()),
        (Some("succeeded"), Some(transport)),
        "{name}: {v}"
    );
    v
}

/// The first JSON line of section `name`.
fn section_json(out: &str, name: &str) -> serde_json::Value {
    let sec = section(out, name);
    let line = sec
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON in {name}:\n{sec}"));
    serde_json::from_str(line).unwrap()
}

#[test]
fn soft_roce_vm_has_active_rxe0_and_real_verbs() {
    let Some(run) = script_ok(1, VM_SCRIPT, ONE_VM_LIMIT_S) else {
        return;
    };
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
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.get(1), Some(&"40"), "all 40 writes: {line}");
    // perftest times with CPU cycles, which TCG under load sometimes
    // reports as 0.00 MB/s: the number is for the stderr line below, not
    // something this test can require (BENCHMARKS.md has the measured row).
    let avg: f64 = fields
        .get(3)
        .and_then(|v| v.parse().ok())
        .expect("BW average");
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
        let v = section_json(out, &format!("sync {size}"));
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
    let v = synced(out, "damaged piece", "rdma");
    assert_eq!(v["pieces_refetched"], 1, "{v}");
    assert_eq!(v["fallback_reason"], "", "{v}");
    assert!(dmg.contains("identical"), "{dmg}");

    // A write into a verified piece before BDON: received into the file
    // mapping, the re-check after the revoke fails the sync; into an
    // anonymous buffer, the private copy is what was checked and written.
    let wav = section(out, "write after verify");
    let v = section_json(out, "write after verify");
    if v["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("anonymous buffer")
    {
        assert_eq!(v["status"], "succeeded", "{v}");
        assert!(wav.contains("identical"), "{wav}");
    } else {
        assert_eq!(v["status"], "failed", "{v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("changed after it was verified"),
            "{v}"
        );
        assert!(!wav.contains("left: "), "nothing installed or left: {wav}");
    }

    // A real remote access error from rxe0, then TCP.
    let fb = section(out, "fallback");
    let v = synced(out, "fallback", "tcp");
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
    assert_redis_seeded_over_rdma(out);

    // `auto` measured the delayed loopback's handshake (60 ms and a
    // little) and ran 3 of the 4 streams the source granted.
    let auto = section_json(out, "auto streams");
    assert_eq!(auto["status"], "succeeded", "{auto}");
    let detail = auto["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("tcp_streams = auto: 3 of 4 streams for a 6"),
        "{auto}"
    );
    assert!(section(out, "auto streams").contains("identical"));

    assert_kernel_tls(out);

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
        "soft-RoCE, same VM run: ib_write_bw -R 4 MiB {avg:.1} MB/s; kvsync RDMA bulk (32 MiB, 4 MiB writes) {bulk:.1} MB/s; ratio {}",
        if avg > 0.0 { format!("{:.2}", bulk / avg) } else { "- (perftest measured no time)".into() }
    );
}

/// Runs in both VMs of `rxe-vm.sh --hosts 2`: a is the source host
/// (10.9.0.1), b the replica host (10.9.0.2); rxe0 is on eth1, the link
/// between them, and eth0 is user-mode NAT without RDMA. The agents listen
/// on the link (plaintext gRPC, so with tokens); b drives, then tells a it
/// is done.
const TWO_HOST_AGENTS: &str = r#"
set -u
K=$KVSYNC_BIN
mkdir -p /tmp/kv
echo kvsync-two-host-test-token-0123456789 > /tmp/kv/token
export KVSYNC_TOKEN_FILE=/tmp/kv/token
# agent NAME GRPC_LISTEN MODE FALLBACK: starts an agent with its data
# endpoints on this host's link address; $DIR, $PRE (top-level keys) and
# $POST (tables) adjust its config; $RETRIES sets [sync] retries (default 0);
# $FAULTS is its KVSYNC_FAULTS.
agent() {
    dir=${DIR:-/tmp/kv/$1}
    mkdir -p $dir
    cat > /tmp/kv/$1.toml <<EOT
node_id = "$1"
create_dirs = true
snapshot_dir = "$dir"
${PRE:-}
[grpc]
listen = "$2"
plaintext = true
[data]
tcp_listen = "$KVSYNC_VM_ADDR:0"
rdma_port = 0
peer_timeout = "3s"
piece_size = "4MiB"
[sync]
retries = ${RETRIES:-0}
rate_limit = "${RATE:-0}"
[metrics]
listen = ""
[watch]
debounce = "20ms"
[auth]
token_file = "/tmp/kv/token"
send_token_in_clear = true
[transport]
mode = "$3"
fallback_to_tcp = $4
${POST:-}
EOT
    env ${FAULTS:+KVSYNC_FAULTS=$FAULTS} "$K" agent --config /tmp/kv/$1.toml > /tmp/kv/$1.out 2> /tmp/kv/$1.log &
    for i in $(seq 600); do grep -q "agent ready" /tmp/kv/$1.out && break; sleep 0.1; done
    grep "agent ready" /tmp/kv/$1.out || { cat /tmp/kv/$1.log; exit 1; }
}
# idle AGENT: waits until AGENT serves no session.
idle() {
    for i in $(seq 600); do "$K" status --agent $1 --json | grep -q '"serving_sessions":0[,}]' && return; sleep 0.1; done
    echo "$1 still serves a session"; exit 1
}
"#;

/// The two-host sync checks, after [`TWO_HOST_AGENTS`].
const TWO_HOST_SCRIPT: &str = r#"
echo "== probe"
"$K" probe --json
SRC=10.9.0.1:7100
if [ "$KVSYNC_VM_HOST" = a ]; then
    # While /tmp/kv/hold exists, every RDMA session of src holds its
    # transfer once 8 MiB (two pieces) are written, so that b's faults
    # happen at that point of a sync, however fast or slow the sync runs.
    FAULTS=rdma_hold_after=8388608,hold_file=/tmp/kv/hold agent src $SRC auto true > /dev/null
    "$K" gen-snapshot --size 33554432 --seq 3 /tmp/kv/src/s3.kvr1 > /dev/null
    # A Redis primary with a backlog and a few MB of keys, saved, then
    # written to, and a source agent offering its RDB to host b.
    rs() {
        mkdir -p /tmp/kv/$1
        redis-server --port $2 --bind "127.0.0.1 10.9.0.1" --protected-mode no --dir /tmp/kv/$1 \
            --save "" --appendonly no --daemonize yes --pidfile /tmp/kv/$1/redis.pid \
            --logfile /tmp/kv/$1/redis.log "${@:3}"
        for i in $(seq 300); do redis-cli -p $2 ping > /dev/null 2>&1 && return; sleep 0.1; done
        echo "redis $1 did not start"; exit 1
    }
    no_fork() {
        for i in $(seq 600); do redis-cli -p 7001 info persistence | grep -q rdb_bgsave_in_progress:0 && return; sleep 0.1; done
        echo "the primary's fork never exited"; exit 1
    }
    rs rprimary 7001 --repl-diskless-sync-delay 0 --enable-debug-command yes
    rs rhelper 7002 --replicaof 127.0.0.1 7001
    for i in $(seq 600); do redis-cli -p 7002 info replication | grep -q master_link_status:up && break; sleep 0.1; done
    redis-cli -p 7002 shutdown nosave > /dev/null 2>&1 || true
    no_fork
    redis-cli -p 7001 debug populate 50000 key 64 > /dev/null
    redis-cli -p 7001 bgsave | grep -q 'Background saving started' || { echo "BGSAVE refused"; exit 1; }
    no_fork
    redis-cli -p 7001 set after-save yes > /dev/null
    DIR=/tmp/kv/rprimary PRE='snapshot_format = "redis-rdb"' POST='[redis]
primary_addr = "127.0.0.1:7001"' agent rsrc 10.9.0.1:7110 auto true > /dev/null
    # Commands from b, one per connection, until "done".
    while cmd=$(busybox nc -l -p 7199); [ "$cmd" != done ]; do
        case "$cmd" in
        rxe1)
            # A second RDMA device on this host (on a veth pair, which the
            # probe never picks), as hosts often have.
            ip link add veth-k0 type veth peer name veth-k1
            ip link set veth-k0 up; ip link set veth-k1 up
            rdma link add rxe1 type rxe netdev veth-k0 ;;
        hold) touch /tmp/kv/hold ;;
        release) rm -f /tmp/kv/hold ;;
        delrxe)
            # In the background: the kernel finishes removing a device
            # without hot-unplug support only when no process holds it.
            # The held session is released once src has seen the removal.
            rdma link delete rxe0 & echo $! > /tmp/kv/del.pid
            date +%s.%N > /tmp/kv/del.start
            for i in $(seq 300); do "$K" status --agent $SRC --json | grep -q '"rdma_available":false' && break; sleep 0.1; done
            rm -f /tmp/kv/hold ;;
        addrxe)
            echo "== device removal"
            for i in $(seq 200); do kill -0 $(cat /tmp/kv/del.pid) 2>/dev/null || break; sleep 0.1; done
            if kill -0 $(cat /tmp/kv/del.pid) 2>/dev/null; then echo "delete still running"; else
                echo "delete finished, $(echo "$(date +%s.%N) - $(cat /tmp/kv/del.start)" | bc) s after it began"; fi
            rdma link add rxe0 type rxe netdev eth1
            for i in $(seq 100); do rdma link show rxe0/1 | grep -q ACTIVE && break; sleep 0.1; done
            rdma link show rxe0/1 ;;
        esac
    done
    echo "== end"
    exit 0
fi
# Tells a to run a command (retried while a is busy with the last one).
tell() { for i in $(seq 100); do echo $1 | busybox nc -w 5 10.9.0.1 7199 && return; sleep 0.1; done; echo "a never took $1"; exit 1; }
# Deletes b's rxe0 (b has a second device by then, so its agents let go of
# it at once and the deletion finishes); fails fast if it hangs.
delete_rxe0() {
    rdma link delete rxe0 & del=$!
    for i in $(seq 200); do kill -0 $del 2>/dev/null || return 0; sleep 0.1; done
    echo "deleting rxe0 hangs"; exit 1
}
# Adds b's rxe0 back and waits until agent $1 says RDMA is usable again.
add_rxe0() {
    rdma link add rxe0 type rxe netdev eth1
    for i in $(seq 100); do rdma link show rxe0/1 | grep -q ACTIVE && break; sleep 0.1; done
    for i in $(seq 300); do "$K" status --agent $1 --json | grep -q '"rdma_available":true' && break; sleep 0.1; done
}
# Prints the replica's bytes so far of its running sync (agent at $1).
landed() { "$K" status --agent $1 --json | grep -o '"running":\[.*' | grep -o '"bytes":[0-9]*' | head -1 | cut -d: -f2; }
# held AGENT: waits until the replica at AGENT has the 8 MiB that a's
# source writes before it holds (see a's src).
held() {
    for i in $(seq 1200); do [ "$(landed $1)" -ge 8388608 ] 2>/dev/null && return; sleep 0.05; done
    echo "the sync to $1 never reached the hold point"; exit 1
}
for i in $(seq 600); do "$K" snapshots --agent $SRC --json 2>/dev/null | grep -q '"seq":3' && break; sleep 0.2; done
"$K" gen-snapshot --size 33554432 --seq 3 /tmp/kv/reference.kvr1 > /dev/null
agent dst 127.0.0.1:7200 rdma false > /dev/null
echo "== sync"
"$K" sync --agent 127.0.0.1:7200 --source $SRC --wait --json
cmp /tmp/kv/reference.kvr1 /tmp/kv/dst/s3.kvr1 && echo identical
echo "== status src"
"$K" status --agent $SRC --json
echo "== status dst"
"$K" status --agent 127.0.0.1:7200 --json
echo "== redis"
# A replica server on b seeded over RDMA from the primary on a; it must
# continue from a's backlog with a partial resync.
mkdir -p /tmp/kv/rreplica
START='["redis-server", "--port", "7003", "--bind", "127.0.0.1", "--dir", "{dir}", "--dbfilename", "{dbfilename}", "--replicaof", "{primary_host}", "{primary_port}", "--appendonly", "no", "--save", "", "--daemonize", "yes", "--pidfile", "/tmp/kv/rreplica/redis.pid", "--logfile", "/tmp/kv/rreplica/redis.log"]'
PRE='snapshot_format = "redis-rdb"' POST="[handoff]
mode = \"redis\"
timeout = \"120s\"
[redis]
server_addr = \"127.0.0.1:7003\"
dir = \"/tmp/kv/rreplica\"
dbfilename = \"dump.rdb\"
primary = \"10.9.0.1:7001\"
start = $START" agent rdst 127.0.0.1:7400 rdma false > /dev/null
for i in $(seq 300); do "$K" snapshots --agent 10.9.0.1:7110 | grep -q dump.rdb && break; sleep 0.1; done
"$K" sync --agent 127.0.0.1:7400 --source 10.9.0.1:7110 --wait --json
redis-cli -h 10.9.0.1 -p 7001 info stats | grep -E "^sync_(full|partial_ok):"
for i in $(seq 300); do [ "$(redis-cli -p 7003 get after-save)" = yes ] && break; sleep 0.1; done
echo "after-save=$(redis-cli -p 7003 get after-save) keys=$(redis-cli -p 7003 dbsize)/$(redis-cli -h 10.9.0.1 -p 7001 dbsize)"
echo "== device removed"
# a's rxe0 is deleted while a holds the transfer at 8 MiB, for a replica
# that may fall back to TCP; a has a second device, so the deletion can
# finish.
tell rxe1
tell hold
agent dr 127.0.0.1:7500 rdma true > /dev/null
"$K" sync --agent 127.0.0.1:7500 --source $SRC --wait --json > /tmp/kv/dr.json &
sync=$!
held 127.0.0.1:7500
tell delrxe
wait $sync
idle $SRC
cat /tmp/kv/dr.json
cmp /tmp/kv/reference.kvr1 /tmp/kv/dr/s3.kvr1 && echo identical
echo "== status src without rxe0"
"$K" status --agent $SRC --json
echo "== device back"
tell addrxe
for i in $(seq 300); do "$K" status --agent $SRC --json | grep -q '"rdma_available":true' && break; sleep 0.1; done
agent back 127.0.0.1:7600 rdma false > /dev/null
"$K" sync --agent 127.0.0.1:7600 --source $SRC --wait --json
cmp /tmp/kv/reference.kvr1 /tmp/kv/back/s3.kvr1 && echo identical
echo "== replica device removed"
# Now b's own rxe0 goes while a holds the transfer at 8 MiB; b gets a
# second device (rxe1 on a veth pair) first.
ip link add veth-k0 type veth peer name veth-k1
ip link set veth-k0 up; ip link set veth-k1 up
rdma link add rxe1 type rxe netdev veth-k0
agent rdr 127.0.0.1:7700 rdma true > /dev/null
tell hold
"$K" sync --agent 127.0.0.1:7700 --source $SRC --wait --json > /tmp/kv/rdr.json &
sync=$!
held 127.0.0.1:7700
delete_rxe0
tell release
wait $sync
idle $SRC
cat /tmp/kv/rdr.json
cmp /tmp/kv/reference.kvr1 /tmp/kv/rdr/s3.kvr1 && echo identical
add_rxe0 127.0.0.1:7700
echo "== link down"
# A fresh replica; its link goes down while a holds the transfer at 8 MiB
# (released once the link is back).
agent cut 127.0.0.1:7300 rdma false > /dev/null
cut=$!
tell hold
"$K" sync --agent 127.0.0.1:7300 --source $SRC --wait --json > /tmp/kv/cut.json &
sync=$!
held 127.0.0.1:7300
ip link set eth1 down
down=$(date +%s.%N)
wait $sync
echo "failed after $(echo "$(date +%s.%N) - $down" | bc) s"
cat /tmp/kv/cut.json
ls -a /tmp/kv/cut
ip link set eth1 up
for i in $(seq 300); do rdma link | grep -q "state ACTIVE" && break; sleep 0.1; done
tell release
idle $SRC
echo "== after link up"
# Soft-RoCE here completes no new rdma_cm connection from a host whose link
# went down under a live QP until its rxe device is made again (seen with
# this kernel; not the agents' state: it outlives them). The agents listen
# on the new rxe0 once it is there; the retry then resumes over RDMA.
delete_rxe0
add_rxe0 127.0.0.1:7300
# The agent restarts with sync retries (3, the default) and the same
# directory: the first QP on the new rxe0 may get the number of the cut
# connection's QP, which a's connection manager still holds, so a rejects
# it as stale (status 10) for a while; a retry gets a fresh QP number.
kill $cut; wait $cut
RETRIES=3 agent cut 127.0.0.1:7300 rdma false > /dev/null
"$K" sync --agent 127.0.0.1:7300 --source $SRC --wait --json
cmp /tmp/kv/reference.kvr1 /tmp/kv/cut/s3.kvr1 && echo identical
echo "== replica killed"
# The replica's agent dies (SIGKILL) while a holds the transfer at 8 MiB,
# and a goes on once it is dead: the source must end that session and free
# its slot.
agent dead 127.0.0.1:7800 rdma false > /dev/null
pid=$!
tell hold
"$K" sync --agent 127.0.0.1:7800 --source $SRC --json > /dev/null
held 127.0.0.1:7800
kill -9 $pid
wait $pid
killed=$(date +%s.%N)
tell release
for i in $(seq 300); do "$K" status --agent $SRC --json | grep -q '"serving_sessions":0[,}]' && break; sleep 0.1; done
echo "source free after $(echo "$(date +%s.%N) - $killed" | bc) s"
"$K" status --agent $SRC --json
echo "== end"
tell done
"#;

#[test]
fn two_soft_roce_hosts_sync_over_real_rdma() {
    let script = format!("{TWO_HOST_AGENTS}{TWO_HOST_SCRIPT}");
    let Some(run) = script_ok(2, &script, TWO_VMS_LIMIT_S) else {
        return;
    };
    let (a, b) = run
        .stdout
        .split_once("=== vm b\n")
        .unwrap_or_else(|| panic!("no output of VM b:\n{}", run.stdout));

    // Each host's probe picks the RDMA link, not the NAT interface before it.
    for (out, addr) in [(a, "10.9.0.1"), (b, "10.9.0.2")] {
        let p = section_json(out, "probe");
        assert_eq!(
            (p["interface"].as_str(), p["local_addr"].as_str()),
            (Some("eth1"), Some(addr)),
            "{p}"
        );
        assert_eq!(
            (p["device"].as_str(), p["choice"].as_str()),
            (Some("rxe0"), Some("rdma"))
        );
    }

    // Real RDMA Writes from one host to the other; an exact copy.
    let v = section_json(b, "sync");
    assert_eq!(v["status"], "succeeded", "{v}\n{}", run.stderr);
    assert_eq!(v["transport"], "rdma", "{v}");
    assert_eq!(v["fallback_reason"], "", "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(32 << 20));
    let detail = v["detail"].as_str().unwrap();
    assert!(
        detail.contains("rdma verbs via rxe0 to 10.9.0.1:"),
        "{detail}"
    );
    assert!(
        section(b, "sync").contains("identical"),
        "{}",
        section(b, "sync")
    );

    // Each agent's status names its device and its own link address.
    for (name, addr) in [("status src", "10.9.0.1"), ("status dst", "10.9.0.2")] {
        let s = section_json(b, name);
        let d = s["rdma_detail"].as_str().unwrap();
        assert!(
            s["rdma_available"] == true
                && d.contains("rxe0")
                && d.contains(&format!("{addr} (eth1)")),
            "{name}: {s}"
        );
    }

    // The replica's link goes down mid-transfer: the replica notices the
    // silent source within its piece wait (peer_timeout 3 s plus one 4 MiB
    // piece at the 1 MiB/s floor), installs nothing and keeps its verified
    // pieces for the retry.
    let cut = section(b, "link down");
    let v = section_json(b, "link down");
    assert_eq!(v["status"], "failed", "{v}");
    // Either the piece wait runs out, or rxe fails the replica's own Send
    // (a piece answer) on the link that is down: both within the bound.
    let error = v["error"].as_str().unwrap();
    assert!(
        error == "timed out after 7s waiting for pieces"
            || error.starts_with("rdma transfer failed: Send work request"),
        "{v}"
    );
    let secs = seconds(cut, "failed after ");
    assert!(
        secs < 12.0,
        "failed {secs} s after the link went down:\n{cut}"
    );
    assert!(
        !cut.contains("s3.kvr1\n"),
        "something was installed:\n{cut}"
    );
    assert!(
        cut.contains(".partial") && cut.contains(".journal"),
        "{cut}"
    );
    // b's own rxe0 is deleted mid-sync: the replica's session fails with
    // the device's removal and the sync resumes over TCP.
    let v = synced(b, "replica device removed", "tcp");
    assert!(
        v["fallback_reason"]
            .as_str()
            .unwrap()
            .starts_with("device_removed: "),
        "{v}"
    );
    assert!(v["resumed_bytes"].as_u64().unwrap() >= 4 << 20, "{v}");
    assert!(section(b, "replica device removed").contains("identical"));

    // Once the link is back (and b's rxe0 made again: see the script), a
    // retry resumes from the kept pieces over RDMA.
    let v = synced(b, "after link up", "rdma");
    assert!(v["resumed_bytes"].as_u64().unwrap() >= 4 << 20, "{v}");
    assert!(section(b, "after link up").contains("identical"));

    // a's rxe0 is deleted mid-sync: the session fails, the same sync
    // resumes over TCP, and a's agents let go of the device at once, so
    // the kernel finishes removing it while they run. Meanwhile a offers
    // TCP only and says why; once rxe0 is back, RDMA is too.
    let v = synced(b, "device removed", "tcp");
    assert!(v["fallback_reason"].as_str().unwrap() != "", "{v}");
    assert!(v["resumed_bytes"].as_u64().unwrap() >= 4 << 20, "{v}");
    assert!(section(b, "device removed").contains("identical"));
    let s = section_json(b, "status src without rxe0");
    assert_eq!(s["rdma_available"], false, "{s}");
    assert!(
        s["rdma_detail"].as_str().unwrap().contains("was removed"),
        "{s}"
    );
    let removal = section(a, "device removal");
    assert!(
        removal.contains("delete finished") && removal.contains("state ACTIVE"),
        "{removal}"
    );
    synced(b, "device back", "rdma");
    assert!(section(b, "device back").contains("identical"));

    // A Redis replica on b seeded over RDMA from a's primary continues
    // with a partial resync.
    assert_redis_seeded_over_rdma(b);
    // The replica's agent is killed mid-transfer: the source ends that
    // session and frees its slot within its reply wait (peer_timeout 3 s
    // plus one 4 MiB piece at the 1 MiB/s floor).
    let killed = section(b, "replica killed");
    let secs = seconds(killed, "source free after ");
    let s = section_json(b, "replica killed");
    assert_eq!(s["serving_sessions"], 0, "{s}");
    assert!(secs < 12.0, "the source took {secs} s:\n{killed}");

    assert!(a.contains("== end"), "VM a did not finish:\n{a}");
}

/// The replication stream through the RDMA ring between two hosts, after
/// [`TWO_HOST_AGENTS`]: a holds the primary (7001) and its agent `ssrc`,
/// which follows it into a log and acknowledges what the servers below
/// applied; b holds a replica server (7003) fed by its agent `srep`, which
/// follows `ssrc` through a ring on rxe0. b drives: the seeding, `WAIT`,
/// then faults while a writes (`INCR ctr`, so a byte applied twice or lost
/// shows as a different counter): 1% packet loss on the link, the link
/// down for 5 s, `srep` SIGKILLed and restarted, and `ssrc` pinned to a
/// core a busy loop saturates.
const STREAM_SCRIPT: &str = r#"
P7="redis-cli -h 10.9.0.1 -p 7001"
if [ "$KVSYNC_VM_HOST" = a ]; then
    mkdir -p /tmp/kv/sprimary
    redis-server --port 7001 --bind "127.0.0.1 10.9.0.1" --protected-mode no --dir /tmp/kv/sprimary \
        --save "" --appendonly no --repl-diskless-sync-delay 0 --daemonize yes \
        --pidfile /tmp/kv/sprimary/redis.pid --logfile /tmp/kv/sprimary/redis.log
    for i in $(seq 300); do redis-cli -p 7001 ping > /dev/null 2>&1 && break; sleep 0.1; done
    redis-cli -p 7001 set before yes > /dev/null
    DIR=/tmp/kv/ssrc PRE='snapshot_format = "redis-rdb"' POST='[redis]
primary_addr = "127.0.0.1:7001"
[stream]
dir = "/tmp/kv/ssrc-log"
ack = "replicas"' agent ssrc 10.9.0.1:7110 auto true > /dev/null
    ssrc=$!
    # Commands from b, one per connection, until "done".
    while cmd=$(busybox nc -l -p 7199); [ "$cmd" != done ]; do
        case "$cmd" in
        write) redis-cli -p 7001 -r 1000 -i 0.002 incr ctr > /dev/null & ;;
        busy)
            taskset -c 0 sh -c 'while :; do :; done' & echo $! > /tmp/kv/busy.pid
            taskset -apc 0 $ssrc > /dev/null ;;
        idle)
            kill $(cat /tmp/kv/busy.pid)
            taskset -apc 0,1 $ssrc > /dev/null ;;
        esac
    done
    echo "== stream source"
    "$K" status --agent 10.9.0.1:7110 --json
    grep -c "serving the replication stream over an RDMA ring" /tmp/kv/ssrc.log
    echo "== end"
    exit 0
fi
tell() { for i in $(seq 100); do echo $1 | busybox nc -w 5 10.9.0.1 7199 && return; sleep 0.1; done; echo "a never took $1"; exit 1; }
for i in $(seq 600); do "$K" snapshots --agent 10.9.0.1:7110 --json 2>/dev/null | grep -q '"seq"' && break; sleep 0.2; done
mkdir -p /tmp/kv/sreplica
redis-server --port 7003 --bind 127.0.0.1 --dir /tmp/kv/sreplica --save "" --appendonly no --daemonize yes \
    --pidfile /tmp/kv/sreplica/redis.pid --logfile /tmp/kv/sreplica/redis.log
for i in $(seq 300); do redis-cli -p 7003 ping > /dev/null 2>&1 && break; sleep 0.1; done
srep() {
    DIR=/tmp/kv/srep PRE='snapshot_format = "redis-rdb"' POST='[stream]
dir = "/tmp/kv/srep-log"
upstream = "10.9.0.1:7110"
rdma_retry = "2s"
[handoff]
mode = "redis-stream"
timeout = "120s"
[redis]
server_addr = "127.0.0.1:7003"' agent srep 127.0.0.1:7400 auto true > /dev/null
}
srep
pid=$!
state() { "$K" status --agent 127.0.0.1:7400 --json | grep -o '"state":"[^"]*"' | head -1; }
# Waits until the server has what the primary has, or says what differs.
converged() {
    for i in $(seq 900); do
        [ "$($P7 get ctr)" = "$(redis-cli -p 7003 get ctr)" ] && [ "$($P7 dbsize)" = "$(redis-cli -p 7003 dbsize)" ] && break
        sleep 0.1
    done
    echo "ctr=$($P7 get ctr)/$(redis-cli -p 7003 get ctr) keys=$($P7 dbsize)/$(redis-cli -p 7003 dbsize)"
}
# Waits until a's writer is done (its 1000 INCRs reached the primary).
written() {
    want=$1
    for i in $(seq 900); do [ "$($P7 get ctr)" = "$want" ] && return; sleep 0.1; done
    echo "the writer stopped at $($P7 get ctr)"; exit 1
}
ring() { for i in $(seq 300); do state | grep -q "RDMA ring" && return; sleep 0.1; done; }
echo "== stream seed"
"$K" sync --agent 127.0.0.1:7400 --source 10.9.0.1:7110 --wait --json
ring; state
echo "== stream wait"
for i in $(seq 20); do $P7 set w$i v > /dev/null; $P7 wait 1 5000; done | sort | uniq -c
tell write; written 1000; converged; state
echo "== stream loss"
tc qdisc add dev eth1 root netem loss 1%
tell write; written 2000; converged; state
tc qdisc del dev eth1 root
echo "== stream link down"
tell write
ip link set eth1 down
sleep 5
ip link set eth1 up
written 3000; converged; state
echo "== stream agent killed"
tell write
for i in $(seq 300); do [ "$($P7 get ctr)" -gt 3100 ] && break; sleep 0.05; done
kill -9 $pid; wait $pid
srep
written 4000; converged; state
echo "== stream busy core"
tell busy
tell write; written 5000; converged; state
tell idle
$P7 info stats | grep -E "^sync_full:"
echo "== stream replica log"
grep -c "following the upstream agent's stream through an RDMA ring" /tmp/kv/srep.log
grep -E "RDMA ring failed" /tmp/kv/srep.log | sed 's/.*reason="\{0,1\}\([a-z_]*\).*/fallback \1/' | sort | uniq -c
echo "== end"
tell done
"#;

#[test]
fn the_stream_crosses_two_soft_roce_hosts_through_the_ring_and_survives_its_faults() {
    let script = format!("{TWO_HOST_AGENTS}{STREAM_SCRIPT}");
    let Some(run) = script_ok(2, &script, STREAM_VMS_LIMIT_S) else {
        return;
    };
    let (a, b) = run
        .stdout
        .split_once("=== vm b\n")
        .unwrap_or_else(|| panic!("no output of VM b:\n{}", run.stdout));
    // Seeded, then following through the ring on rxe0.
    let seed = section(b, "stream seed");
    assert!(seed.contains("through an RDMA ring"), "{seed}");
    // Every WAIT counted the server fed through the ring.
    let wait = section(b, "stream wait");
    assert!(wait.contains("20 1\n"), "{wait}");
    // Each fault: the server ends with exactly the primary's counter and
    // keys (nothing lost, nothing applied twice).
    for name in [
        "stream wait",
        "stream loss",
        "stream link down",
        "stream agent killed",
        "stream busy core",
    ] {
        let out = section(b, name);
        let line = out
            .lines()
            .find(|l| l.starts_with("ctr="))
            .unwrap_or_else(|| panic!("{name}: no counter in {out}"));
        let (ctr, keys) = line["ctr=".len()..].split_once(" keys=").unwrap();
        let (p, r) = ctr.split_once('/').unwrap();
        let (pk, rk) = keys.split_once('/').unwrap();
        assert!(p == r && pk == rk, "{name}: {line}\n{}", run.stderr);
    }
    // Packet loss slows the ring, it does not break it. A link down for
    // 5 s may outlast the queue pair's retries or not (the ring then fails
    // and the stream goes on over TCP, and soft-RoCE here connects no new
    // queue pair from that host until its device is made again: see the
    // two-host sync test), so after it only the data is checked. A busy
    // core on the sender backs up into its log, never into the primary.
    let loss = section(b, "stream loss");
    assert!(loss.contains("through an RDMA ring"), "{loss}");
    let busy = section(b, "stream busy core");
    assert!(
        busy.contains("sync_full:1\n"),
        "one full sync, the agent's: {busy}"
    );
    let _ = writeln!(
        std::io::stderr(),
        "stream through the ring, replica log:\n{}",
        section(b, "stream replica log")
    );
    assert!(a.contains("== end"), "VM a did not finish:\n{a}");
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
