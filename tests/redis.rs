//! Seeding Redis replicas with real `redis-server` and `valkey-server`
//! processes (Debian's packages, installed by the test command; every test
//! runs against each, as `<test>::redis` and `<test>::valkey`): RDBs saved
//! by the real server parsed and verified, a replica seeded over TCP and
//! over the emulated RDMA fabric that continues with a partial resync (the
//! primary never full-syncs it), and the refusals: no replication position,
//! a backlog that no longer holds M+1, a corrupted byte in flight.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::kv::*;
use common::node::*;
use common::*;
use kvsync::rpc::pb;

/// `[transport]` and `[redis]` of a source watching `primary`.
fn source_config(primary: &Redis, transport: &str) -> String {
    format!(
        "[transport]\n{transport}\n[redis]\nprimary_addr = \"{}\"\nrate_window = \"300ms\"\n",
        primary.addr()
    )
}

/// `--replicaof` the primary, for the `redis` handoff's `start` array.
fn replicaof() -> Vec<String> {
    ["--replicaof", "{primary_host}", "{primary_port}"]
        .map(String::from)
        .to_vec()
}

/// The replica agent's config: `redis` handoff seeding the server on `port`.
fn replica_config(primary: &Redis, port: u16, dir: &Path, transport: &str) -> String {
    let start = start_command(primary.server, port, dir, &replicaof());
    format!(
        "[transport]\n{transport}\n[handoff]\nmode = \"redis\"\ntimeout = \"60s\"\n[redis]\nserver_addr = \"127.0.0.1:{port}\"\ndir = \"{}\"\ndbfilename = \"dump.rdb\"\nprimary = \"{}\"\nstart = [{start}]\n",
        dir.display(),
        primary.addr()
    )
}

fn rdbs_saved_by_the_real_server_carry_the_replication_position(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &["--rdbcompression", "yes"]);
    primary.fill("k", 100, "v");
    let _: String = primary.cmd(&["SAVE"]);
    let rdb = primary.dir.join("dump.rdb");
    // No backlog yet: no replication position.
    let err = kvsync::snapshot::verify_file(&rdb, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("no replication position in this RDB"),
        "{err}"
    );
    let out = Command::new(kvsync_bin())
        .arg("verify")
        .arg(&rdb)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no replication backlog"));
    // A source agent watching the primary's dir never offers it.
    let source = agent(root.path(), "source", &primary.dir, "", &[]);
    wait_for(
        "the RDB rejected for its missing position",
        DEADLINE,
        || {
            (source.metric(r#"kvsync_snapshots_rejected_total{reason="no_replication_position"}"#)
                == 1.0)
                .then_some(())
        },
    );
    assert!(
        source
            .proc
            .log()
            .contains("no replication position in this RDB"),
        "{}",
        source.proc.log()
    );
    // The operator sees why, where they look: `kvsync snapshots` names the
    // rejected file with its reason (on stderr: what it prints on stdout,
    // which scripts read, stays the offered snapshots), and a sync from
    // the agent says so.
    let grpc = source.grpc();
    for json in [None, Some("--json")] {
        let args: Vec<&str> = ["snapshots", "--agent", &grpc]
            .into_iter()
            .chain(json)
            .collect();
        let (ok, out, err) = cli(&args);
        assert!(ok, "{err}");
        assert!(!out.contains("dump.rdb"), "{out}");
        assert!(
            err.contains("rejected")
                && err.contains("dump.rdb")
                && err.contains("no replication position"),
            "{err}"
        );
    }
    drop(source);

    primary.make_backlog(root.path());
    // Encodings: small ints, large ints, long compressible strings, and
    // every collection type.
    let _: () = primary.cmd(&["SET", "small", "7"]);
    let _: () = primary.cmd(&["SET", "large", "123456789012345"]);
    let _: () = primary.cmd(&["SET", "lzf", &"abc".repeat(400)]);
    let _: () = primary.cmd(&["HSET", "h", "f1", "v1", "f2", "v2"]);
    let _: () = primary.cmd(&["RPUSH", "l", "a", "b", "c"]);
    let _: () = primary.cmd(&["SADD", "s", "x", "y"]);
    let _: () = primary.cmd(&["ZADD", "z", "1", "one", "2", "two"]);
    let _: String = primary.cmd(&["SAVE"]);
    let repl = primary.info("replication");
    let info = kvsync::snapshot::verify_file(&rdb, None).unwrap();
    assert_eq!(info.seq, repl.num("master_repl_offset"));
    assert!(info.seq > 0);
    assert_eq!(info.repl_id.as_deref(), repl.get("master_replid"));
    assert_ne!(info.checksum, 0);
    // The head carries the saving server's own version: Valkey 8 keeps
    // the REDIS magic and RDB version 11 but writes `valkey-ver` with its
    // own version (its INFO's redis_version is the Redis it is compatible
    // with, 7.2.4).
    let head = kvsync::snapshot::rdb::parse_head(&std::fs::read(&rdb).unwrap())
        .unwrap()
        .unwrap();
    let about = primary.info("server");
    let version = match server {
        Server::Redis => about.get("redis_version"),
        Server::Valkey => about.get("valkey_version"),
    };
    assert_eq!(head.server, "REDIS", "{head:?}");
    assert_eq!(head.server_version.as_deref(), version, "{head:?}");
    let out = Command::new(kvsync_bin())
        .arg("verify")
        .arg(&rdb)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(&format!("repl-offset (M) {}", info.seq)),
        "{text}"
    );

    let bytes = std::fs::read(&rdb).unwrap();
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x10;
    let bad = root.path().join("bad.rdb");
    std::fs::write(&bad, &flipped).unwrap();
    let err = kvsync::snapshot::verify_file(&bad, None).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    std::fs::write(&bad, &bytes[..bytes.len() - 100]).unwrap();
    let err = kvsync::snapshot::verify_file(&bad, None).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
}

/// A primary with a backlog and 100k+ keys saved, more written after.
fn loaded_primary(server: Server, root: &Path, backlog: &str) -> (Redis, PathBuf) {
    let primary = Redis::start(
        server,
        &root.join("primary"),
        &["--repl-backlog-size", backlog],
    );
    primary.make_backlog(root);
    primary.fill("key", 100_000, "value-of-some-length");
    for i in 0..200 {
        let (h, l) = (format!("hash:{i}"), format!("list:{i}"));
        let _: () = primary.cmd(&["HSET", &h, "a", "1", "b", "2"]);
        let _: () = primary.cmd(&["RPUSH", &l, "x", "y", "z"]);
        let _: () = primary.cmd(&["ZADD", &format!("zset:{i}"), "1", "m"]);
        let _: () = primary.cmd(&["SADD", &format!("set:{i}"), "m1", "m2"]);
    }
    let rdb = primary.bgsave();
    (primary, rdb)
}

fn seeds_a_replica_with_a_partial_resync(server: Server, transport: &str, expect: pb::Transport) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "64mb");
    primary.fill("after", 500, "written-after-the-save");
    let full_before = primary.info("stats").num("sync_full");
    let partial_before = primary.info("stats").num("sync_partial_ok");

    // The replica's server runs standalone with data of its own.
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let _: () = replica_redis.cmd(&["SET", "stale", "1"]);
    let port = replica_redis.port;

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (source, replica, seq) =
            source_and_replica(root, "", &primary, port, &rdir, transport, &[]).await;
        // The source has measured its primary's write rate in the
        // background for a whole `rate_window`: the offer does not wait.
        wait_for(
            "the source's write meter to span its window",
            DEADLINE,
            || {
                let log = source.proc.log();
                log.contains("write rate is measured over the last rate_window")
                    .then_some(())
            },
        );
        let p = sync_ok(&replica, &source).await;
        let log = source.proc.log();
        let passed = log.lines().find(|l| l.contains("backlog guard passed"));
        assert!(passed.is_some_and(|l| l.contains("waited_ms=0")), "{log}");
        assert_eq!(p.transport, expect as i32, "{p:?}");
        assert!(
            p.handoff.contains("partial resync accepted"),
            "{}",
            p.handoff
        );
        assert_eq!(replmeta_seq(&p.installed_path), Some(seq));
        assert_eq!(
            replica.metric(r#"kvsync_handoff_total{mode="redis",result="ok"}"#),
            1.0
        );
    });
    let stats = primary.info("stats");
    assert_eq!(
        stats.num("sync_full"),
        full_before,
        "the primary never full-synced the replica"
    );
    assert_eq!(stats.num("sync_partial_ok"), partial_before + 1);
    // Every key, including those written after the save, is on the replica.
    let replica_now = Redis {
        server,
        port,
        dir: rdir.clone(),
        child: None,
        password: None,
        user: None,
    };
    wait_for("the replica to catch up", DEADLINE, || {
        let p: u64 = primary.cmd(&["DBSIZE"]);
        let r: u64 = replica_now.cmd(&["DBSIZE"]);
        (p == r).then_some(())
    });
    assert_eq!(
        replica_now
            .cmd::<Option<String>>(&["GET", "after:499"])
            .as_deref(),
        Some("written-after-the-save")
    );
    assert_eq!(
        replica_now
            .cmd::<Option<String>>(&["HGET", "hash:7", "b"])
            .as_deref(),
        Some("2")
    );
    assert_eq!(
        replica_now.cmd::<Option<String>>(&["GET", "stale"]),
        None,
        "the replica holds the primary's data"
    );
    drop(replica_redis);
}

fn replica_seeded_over_tcp_continues_with_a_partial_resync(server: Server) {
    seeds_a_replica_with_a_partial_resync(server, "mode = \"tcp\"", pb::Transport::Tcp);
}

fn replica_seeded_over_the_emulated_rdma_fabric_continues_with_a_partial_resync(server: Server) {
    seeds_a_replica_with_a_partial_resync(
        server,
        "mode = \"rdma\"\nrdma_provider = \"emulated\"\nfallback_to_tcp = false",
        pb::Transport::Rdma,
    );
}

const TCP: &str = "mode = \"tcp\"";
/// TCP, and a damaged piece fails the session at once (no second try).
const TCP_NO_PIECE_RETRY: &str = "mode = \"tcp\"\n[data]\npiece_retries = 0\n";

/// A source agent on `primary`'s dir (started with `env`) and a replica agent
/// that seeds the server on `port`, both named with `tag`, once the source
/// offers the primary's RDB; with the RDB's M.
async fn source_and_replica(
    root: &Path,
    tag: &str,
    primary: &Redis,
    port: u16,
    rdir: &Path,
    transport: &str,
    env: &[(&str, &str)],
) -> (Node, Node, u64) {
    let source = agent(
        root,
        &format!("source{tag}"),
        &primary.dir,
        &source_config(primary, transport),
        env,
    );
    let replica = replica_agent(root, tag, primary, (port, rdir), transport);
    let seq = offered_rdb(&source, primary).await;
    (source, replica, seq)
}

/// A replica agent (named with `tag`) that seeds the server on `port`
/// (its files in `rdir`) from `primary`.
fn replica_agent(
    root: &Path,
    tag: &str,
    primary: &Redis,
    (port, rdir): (u16, &Path),
    transport: &str,
) -> Node {
    agent(
        root,
        &format!("replica{tag}"),
        &root.join(format!("replica-agent{tag}")),
        &replica_config(primary, port, rdir, transport),
        &[],
    )
}

/// Waits until `source` offers `primary`'s RDB; its M.
async fn offered_rdb(source: &Node, primary: &Redis) -> u64 {
    let seq = kvsync::snapshot::verify_file(&primary.dir.join("dump.rdb"), None)
        .unwrap()
        .seq;
    source.offered(seq).await;
    seq
}

/// A source agent on `primary`'s dir with `source` config, and a replica
/// agent seeding the server on `port` over TCP, once the source offers the
/// primary's RDB; with the RDB's M.
async fn seeding(
    root: &Path,
    primary: &Redis,
    source: &str,
    port: u16,
    rdir: &Path,
) -> (Node, Node, u64) {
    let source = agent(root, "source", &primary.dir, source, &[]);
    let replica = replica_agent(root, "", primary, (port, rdir), TCP);
    let seq = offered_rdb(&source, primary).await;
    (source, replica, seq)
}

fn refusals_leave_the_replica_server_untouched(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let _: () = replica_redis.cmd(&["SET", "mine", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();

    // A backlog too small for what was written since the save.
    let (primary, _) = loaded_primary(server, &root.join("small"), "16kb");
    primary.fill("after", 2000, "pushes-the-saved-offset-out-of-the-backlog");
    rt.block_on(async {
        let (source, replica, _) =
            source_and_replica(root, "1", &primary, replica_redis.port, &rdir, TCP, &[]).await;
        let id = start_sync(&replica, &source).await;
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32);
        assert!(
            p.error.contains("FailedPrecondition") && p.error.contains("grow repl-backlog-size"),
            "{}",
            p.error
        );
        assert!(
            source.metric(r#"kvsync_snapshot_cache_loads_total"#) == 0.0,
            "refused before loading"
        );
    });
    drop(primary);

    // A corrupted byte in flight, and no second try: RDFL, nothing placed.
    let (primary, _) = loaded_primary(server, &root.join("big"), "64mb");
    rt.block_on(async {
        let env = [("KVSYNC_FAULTS", "corrupt_at=100000")];
        let (source, replica, _) = source_and_replica(
            root,
            "2",
            &primary,
            replica_redis.port,
            &rdir,
            TCP_NO_PIECE_RETRY,
            &env,
        )
        .await;
        let id = start_sync(&replica, &source).await;
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.result, "checksum_mismatch", "{p:?}");
        assert!(p.error.contains("piece 0"), "{}", p.error);
    });
    // The server kept running, standalone, with its own data.
    assert_eq!(
        replica_redis
            .cmd::<Option<String>>(&["GET", "mine"])
            .as_deref(),
        Some("1")
    );
    assert_eq!(
        replica_redis.info("replication").get("role"),
        Some("master")
    );
    assert!(!rdir.join("dump.rdb").exists(), "nothing placed");
}

fn a_full_resync_is_a_failed_handoff(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "1mb");
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    // `[redis] stop`: after the transfer, more is written to the primary
    // than its 1 MB backlog holds, then the replica's server is stopped.
    // Its PSYNC from M+1 can only be answered with a full resync.
    let stop = root.join("stop.sh");
    std::fs::write(
        &stop,
        format!(
            "{} -p {} eval \"for i = 1, 40000 do redis.call('SET', 'fill:' .. i, 'pushes M+1 out of the backlog') end\" 0 >/dev/null\nkill $(cat {})\n",
            primary.server.cli(),
            primary.port,
            rdir.join("redis.pid").display()
        ),
    )
    .unwrap();
    let full_before = primary.info("stats").num("sync_full");
    let config = format!(
        "{}stop = [\"sh\", \"{}\"]\n",
        replica_config(&primary, replica_redis.port, &rdir, TCP),
        stop.display()
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let source = agent(
            root,
            "source",
            &primary.dir,
            &source_config(&primary, TCP),
            &[],
        );
        let replica = agent(root, "replica", &root.join("replica-agent"), &config, &[]);
        let seq = offered_rdb(&source, &primary).await;
        let id = start_sync(&replica, &source).await;
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32);
        assert!(
            p.error.contains("FULL resync") && p.error.contains(&format!("M = {seq}")),
            "{}",
            p.error
        );
        assert_eq!(
            replica.metric(r#"kvsync_handoff_total{mode="redis",result="failed"}"#),
            1.0
        );
        assert_eq!(
            replica.metric(r#"kvsync_handoff_total{mode="redis",result="ok"}"#),
            0.0
        );
    });
    assert_eq!(primary.info("stats").num("sync_full"), full_before + 1);
    assert_eq!(
        primary
            .cmd::<Option<String>>(&["GET", "fill:40000"])
            .as_deref(),
        Some("pushes M+1 out of the backlog"),
        "the stop command ran"
    );
}

fn an_rdb_without_its_own_checksum_is_verified_piece_by_piece(server: Server) {
    // `rdbchecksum no` writes a zero trailer: the RDB cannot check itself.
    // The manifest still catches a flipped byte, and the status says which
    // check applied.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let primary = Redis::start(server, &root.join("primary"), &["--rdbchecksum", "no"]);
    primary.make_backlog(root);
    primary.fill("key", 20_000, "value-of-some-length");
    let rdb = primary.bgsave();
    let info = kvsync::snapshot::verify_file(&rdb, None).unwrap();
    assert_eq!(info.checksum, 0, "saved without a checksum");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let tcp = "[transport]\nmode = \"tcp\"\n";
        let env = [("KVSYNC_FAULTS", "corrupt_at=4000")];
        let source = agent(root, "source", &primary.dir, tcp, &env);
        let replica = agent(root, "replica", &root.join("replica"), tcp, &[]);
        source.offered(info.seq).await;
        let p = sync_ok(&replica, &source).await;
        assert_eq!(p.pieces_refetched, 1, "{p:?}");
        assert!(
            p.check.contains("blake3 of each of 1 pieces")
                && p.check.contains("saved with rdbchecksum no: no CRC"),
            "{}",
            p.check
        );
        assert!(std::fs::read(&p.installed_path).unwrap() == std::fs::read(&rdb).unwrap());
    });
}

/// The value of `series` in `node`'s scrape, once `ok` holds for it.
fn wait_metric(node: &Node, series: &str, what: &str, ok: impl Fn(f64) -> bool) -> f64 {
    wait_for(what, DEADLINE, || {
        metric_value(&node.proc.metrics(), series).filter(|v| ok(*v))
    })
}

fn replication_health_of_both_servers_reaches_prometheus(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let primary = Redis::start(server, &root.join("primary"), &[]);
    let port = primary.port.to_string();
    let rdir = root.join("replica-redis");
    let mut replica = Redis::start(server, &rdir, &["--replicaof", "127.0.0.1", &port]);
    wait_for("the replica's link", DEADLINE, || {
        (replica.info("replication").get("master_link_status") == Some("up")).then_some(())
    });
    let fast = "[redis]\nhealth_interval = \"100ms\"\n";
    let source = agent(
        root,
        "source",
        &root.join("source-agent"),
        &source_config(&primary, TCP).replace("[redis]\n", fast),
        &[],
    );
    let replica_agent = agent(
        root,
        "replica",
        &root.join("replica-agent"),
        &replica_config(&primary, replica.port, &rdir, TCP).replace(
            "[redis]\n",
            &format!("{fast}consistency_interval = \"1s\"\n"),
        ),
        &[],
    );
    let (p, r) = (
        format!("server=\"{}\"", primary.addr()),
        format!("server=\"{}\"", replica.addr()),
    );
    let up = |node: &Node, server: &str, want: f64, what: &str| {
        wait_metric(node, &format!("kvsync_kv_link_up{{{server}}}"), what, |v| {
            v == want
        });
    };
    up(
        &replica_agent,
        &r,
        1.0,
        "the replica agent to see its link up",
    );
    up(&source, &p, 1.0, "the source agent to see its primary");
    wait_metric(
        &replica_agent,
        &format!("kvsync_kv_replication_offset{{{r}}}"),
        "the replica's offset",
        |v| v > 0.0,
    );
    // What the dashboard and the alert rules ask of the kv_* series, the
    // two agents export.
    let exported = format!("{}{}", source.proc.metrics(), replica_agent.proc.metrics());
    for file in [
        include_str!("../grafana/kvsync-dashboard.json"),
        include_str!("../deploy/kvsync-alerts.yml"),
    ] {
        let names = file
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("kvsync_kv_"));
        for name in names {
            assert!(
                exported.contains(&format!("\n{name}{{")),
                "{name} is not exported"
            );
        }
    }

    // The replica stops acknowledging: its lag on the primary grows by what
    // is written meanwhile, and drains once it runs again.
    let lag = format!(
        "kvsync_kv_replica_lag_bytes{{replica=\"127.0.0.1:{}\",{p}}}",
        replica.port
    );
    wait_metric(&source, &lag, "the replica's lag series", |_| true);
    let pid = replica.child.as_ref().unwrap().id() as i32;
    // SAFETY: signalling a process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    primary.fill("while-paused", 5000, "a-value-of-some-length-to-lag-behind");
    wait_metric(&source, &lag, "the lag to grow while paused", |v| {
        v > 100_000.0
    });
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    wait_metric(&source, &lag, "the lag to drain", |v| v < 100_000.0);

    // A new replica makes the primary run a full resync: counted.
    let full = format!("kvsync_kv_full_syncs_total{{{p}}}");
    let before = wait_metric(&source, &full, "the full-sync counter", |_| true);
    let newcomer = Redis::start(
        server,
        &root.join("newcomer"),
        &["--replicaof", "127.0.0.1", &port],
    );
    wait_metric(&source, &full, "the full resync to be counted", |v| {
        v == before + 1.0
    });
    drop(newcomer);

    // The primary goes away: the replica's link is down, its server is up.
    drop(primary);
    up(
        &replica_agent,
        &r,
        0.0,
        "the replica agent to see its link down",
    );
    assert_eq!(
        metric_value(
            &replica_agent.proc.metrics(),
            &format!("kvsync_kv_up{{{r}}}")
        ),
        Some(1.0)
    );
    // The replica's server stops: down too.
    replica.child.take().map(|mut c| {
        c.kill().unwrap();
        c.wait().unwrap()
    });
    wait_metric(
        &replica_agent,
        &format!("kvsync_kv_up{{{r}}}"),
        "the replica agent to see its server down",
        |v| v == 0.0,
    );
}

/// `kvsync check-replica --primary P --replica R --sample 100000 --json`:
/// (succeeded, report).
fn check_replica(primary: &Redis, replica: &Redis) -> (bool, serde_json::Value) {
    let out = Command::new(kvsync_bin())
        .args(["check-replica", "--primary", &primary.addr()])
        .args(["--replica", &replica.addr(), "--sample", "100000", "--json"])
        .output()
        .unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
    });
    (out.status.success(), report)
}

fn check_replica_ignores_writes_in_flight_and_finds_exactly_the_planted_keys(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let primary = Redis::start(server, &root.join("primary"), &[]);
    let port = primary.port.to_string();
    primary.fill("key", 3000, "v");
    for i in 0..200 {
        let (h, s, z) = (format!("hash:{i}"), format!("set:{i}"), format!("zset:{i}"));
        let _: () = primary.cmd(&["HSET", &h, "a", "1", "b", "2"]);
        let _: () = primary.cmd(&["SADD", &s, "m1", "m2", "m3"]);
        let _: () = primary.cmd(&["ZADD", &z, "1", "m", "2", "n"]);
    }
    let rdir = root.join("replica-redis");
    let replica = Redis::start(server, &rdir, &["--replicaof", "127.0.0.1", &port]);
    wait_for("the replica's link", DEADLINE, || {
        (replica.info("replication").get("master_link_status") == Some("up")).then_some(())
    });

    // A writer keeps changing keys (never back to an old value) while the
    // check runs: in flight, not a mismatch.
    let writer = Client::start(&primary, |con, i| {
        let mut p = redis::pipe();
        for j in 0..50 {
            p.cmd("INCR")
                .arg(format!("counter:{}", (i * 50 + j) % 300))
                .ignore();
            p.cmd("SET")
                .arg(format!("key:{}", (i * 7 + j) % 3000))
                .arg(i)
                .ignore();
        }
        let _: () = p.query(con).unwrap();
    });
    let (ok, report) = check_replica(&primary, &replica);
    drop(writer);
    assert!(ok, "{report}");
    assert_eq!(report["mismatches"], serde_json::json!([]), "{report}");
    assert!(report["checked"].as_u64().unwrap() >= 3600, "{report}");

    // Keys written on the replica behind the primary's back.
    let _: () = replica.cmd(&["CONFIG", "SET", "replica-read-only", "no"]);
    let _: () = replica.cmd(&["SET", "key:5", "planted"]);
    let _: () = replica.cmd(&["HSET", "hash:7", "a", "999"]);
    let _: () = replica.cmd(&["SADD", "set:3", "extra"]);
    let (ok, report) = check_replica(&primary, &replica);
    assert!(!ok, "{report}");
    assert_eq!(
        report["mismatches"],
        serde_json::json!(["hash:7", "key:5", "set:3"]),
        "{report}"
    );

    // The replica's agent finds them too, on its own, and counts them.
    let config = replica_config(&primary, replica.port, &rdir, TCP).replace(
        "[redis]\n",
        "[redis]\nconsistency_interval = \"100ms\"\nconsistency_sample = 100000\nhealth_interval = \"0s\"\n",
    );
    let agent = agent(root, "replica", &root.join("replica-agent"), &config, &[]);
    let series = format!(
        "kvsync_kv_consistency_mismatches_total{{server=\"{}\"}}",
        replica.addr()
    );
    wait_metric(
        &agent,
        &series,
        "the agent's check to count the planted keys",
        |v| v >= 3.0,
    );
}

fn a_primary_writing_faster_than_its_backlog_can_hold_is_refused_before_anything_moves(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let _: () = replica_redis.cmd(&["SET", "mine", "1"]);
    let (primary, _) = loaded_primary(server, &root.join("busy"), "1mb");
    // A writer keeps the primary busy while the offer is made.
    let writer = Client::start(&primary, |con, i| {
        let _: () = redis::cmd("SET")
            .arg(format!("busy:{}", i % 100))
            .arg(i)
            .query(con)
            .unwrap();
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Seeding is expected to run at 1 MiB/s: seconds for this RDB.
        let slow = "[redis]\nexpected_transfer_rate = \"1MiB\"\nexpected_load_rate = \"1MiB\"\n";
        let (source, replica, _) = seeding(
            root,
            &primary,
            &source_config(&primary, TCP).replace("[redis]\n", slow),
            replica_redis.port,
            &rdir,
        )
        .await;
        let id = start_sync(&replica, &source).await;
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        // Refused for what the seeding will write, or (on a slow machine,
        // when the writer got there first) for what was already written.
        let will_overrun = p.error.contains("its backlog must hold")
            && p.error.contains("CONFIG SET repl-backlog-size")
            && p.error.contains("grow_backlog = true");
        let overrun = p.error.contains("backlog no longer holds offset")
            && p.error.contains("grow repl-backlog-size");
        assert!(
            p.error.contains("FailedPrecondition") && (will_overrun || overrun),
            "{}",
            p.error
        );
        assert_eq!(
            source.metric("kvsync_snapshot_cache_loads_total"),
            0.0,
            "refused before loading"
        );
        assert!(replica.temp_files().is_empty());
    });
    drop(writer);
    assert_eq!(
        replica_redis.cmd::<String>(&["GET", "mine"]),
        "1",
        "the replica's server is untouched"
    );
}

/// The primary's `repl-backlog-size`.
fn backlog_size(primary: &Redis) -> u64 {
    let pair: Vec<String> = primary.cmd(&["CONFIG", "GET", "repl-backlog-size"]);
    pair[1].parse().unwrap()
}

/// A writer setting 50 keys of 1 KiB (`seeding:<n>`) every 50 ms, about
/// 1 MB/s: a 1 MB backlog holding M+1 overruns within a second, sooner
/// than a seeding of a few MB at a few MiB/s ends, but after the offer.
fn steady_writer(primary: &Redis) -> Client {
    let value = "w".repeat(1024);
    Client::start(primary, move |con, i| {
        let mut p = redis::pipe();
        for j in 0..50 {
            p.cmd("SET")
                .arg(format!("seeding:{}", i * 50 + j))
                .arg(&value)
                .ignore();
        }
        let _: () = p.query(con).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
    })
}

/// A source that grows the backlog, its transfers held to `rate` (the
/// guard's expected transfer rate stays at its default: the limit alone
/// tells it how long a seeding takes).
fn growing_source(primary: &Redis, rate: &str) -> String {
    format!(
        "rate_limit = \"{rate}\"\n{}grow_backlog = true\n",
        source_config(primary, TCP)
    )
}

/// Starts a sync of `replica` from `source` and waits until its first
/// bytes arrived; its id.
async fn transferring(replica: &Node, source: &Node) -> String {
    let id = start_sync(replica, source).await;
    wait_for_async("the transfer to begin", DEADLINE, || async {
        let s = replica.status().await;
        s.running.iter().find(|p| p.bytes_done > 0).map(drop)
    })
    .await;
    id
}

/// After a seeding `p` of an RDB saved at `seq` under writes: it ended in a
/// partial resync although the writes overran the operator's backlog
/// (`original` bytes), because the source `raised` it, and the report put
/// the operator's value back.
fn seeded_on_a_grown_backlog(
    primary: &Redis,
    source: &Node,
    p: &pb::SyncProgress,
    (seq, original): (u64, u64),
    raised: &str,
) {
    assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
    let written = primary.info("replication").num("master_repl_offset") - seq;
    assert!(
        written > original,
        "the writes during the seeding ({written} bytes) overran the operator's backlog"
    );
    let log = source.proc.log();
    assert!(log.contains(raised), "{log}");
    // The replica's report ended the lease: the operator's value is back.
    assert_eq!(backlog_size(primary), original, "{log}");
    assert!(!primary.dir.join(kvsync::kv::backlog::RECORD).exists());
}

fn a_backlog_too_small_for_the_writes_during_a_seeding_is_grown_then_restored(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "1mb");
    let original = backlog_size(&primary);
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let port = replica_redis.port;
    let stats = primary.info("stats");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let writer = rt.block_on(async {
        let (source, replica, seq) = seeding(
            root,
            &primary,
            &growing_source(&primary, "2MiB"),
            port,
            &rdir,
        )
        .await;
        let writer = steady_writer(&primary);
        let p = sync_ok(&replica, &source).await;
        seeded_on_a_grown_backlog(
            &primary,
            &source,
            &p,
            (seq, original),
            "raised the primary's repl-backlog-size",
        );
        assert_eq!(
            source.metric(&format!(
                "kvsync_kv_backlog_grown_bytes{{server=\"{}\"}}",
                primary.addr()
            )),
            0.0
        );
        writer
    });
    drop(writer);
    one_partial_resync_since(&primary, &stats);
    // Every key written during the seeding reached the replica.
    let written: u64 = primary.cmd(&["DBSIZE"]);
    wait_for("the replica to catch up", DEADLINE, || {
        (replica_redis.cmd::<u64>(&["DBSIZE"]) == written).then_some(())
    });
    let last: Vec<String> = primary.cmd(&["KEYS", "seeding:*"]);
    assert!(last.len() > 1000, "the writer ran during the seeding");
    for key in last.iter().step_by(97) {
        assert_eq!(
            replica_redis.cmd::<Option<String>>(&["GET", key]),
            primary.cmd::<Option<String>>(&["GET", key]),
            "{key}"
        );
    }
}

fn writes_faster_during_a_seeding_than_at_the_offer_grow_the_backlog_in_time(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "1mb");
    let original = backlog_size(&primary);
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let stats = primary.info("stats");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let writer = rt.block_on(async {
        let config = growing_source(&primary, "1MiB");
        let (source, replica, seq) =
            seeding(root, &primary, &config, replica_redis.port, &rdir).await;
        // The primary is quiet at the offer: its backlog is enough then.
        let id = transferring(&replica, &source).await;
        assert_eq!(
            backlog_size(&primary),
            original,
            "nothing grown at the offer"
        );
        // Then about 1 MB/s: the 1 MB backlog would lose M+1 within a
        // second, well before the seeding ends.
        let writer = steady_writer(&primary);
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
        seeded_on_a_grown_backlog(
            &primary,
            &source,
            &p,
            (seq, original),
            "raised its repl-backlog-size during the seeding",
        );
        assert!(source.status().await.warnings.is_empty());
        writer
    });
    drop(writer);
    one_partial_resync_since(&primary, &stats);
}

fn an_agent_killed_holding_a_grown_backlog_restores_it_when_it_starts_again(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "1mb");
    let original = backlog_size(&primary);
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let _: () = replica_redis.cmd(&["SET", "mine", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Slow enough that the source dies mid-transfer.
        let config = growing_source(&primary, "1MiB");
        let (mut source, replica, _) =
            seeding(root, &primary, &config, replica_redis.port, &rdir).await;
        let writer = steady_writer(&primary);
        let id = start_sync(&replica, &source).await;
        wait_for("the backlog to grow", DEADLINE, || {
            (backlog_size(&primary) > original).then_some(())
        });
        assert!(primary.dir.join(kvsync::kv::backlog::RECORD).exists());
        source.proc.signal(libc::SIGKILL);
        source.proc.wait_exit();
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        assert!(backlog_size(&primary) > original, "nobody restored it yet");

        let _again = agent(root, "source", &primary.dir, &config, &[]);
        wait_for(
            "the restarted agent to restore the backlog",
            DEADLINE,
            || (backlog_size(&primary) == original).then_some(()),
        );
        assert!(!primary.dir.join(kvsync::kv::backlog::RECORD).exists());
        assert!(replica.temp_files().is_empty());
        drop(writer);
    });
    assert_eq!(replica_redis.cmd::<String>(&["GET", "mine"]), "1");
}

fn a_burst_of_writes_that_pushes_m_out_of_the_backlog_is_reported_before_the_handoff(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "1mb");
    let rdir = root.join("replica-redis");
    let replica_redis = Redis::standalone_replica(server, &rdir);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // The primary is quiet when the offer is made: the guard passes.
        // It may grow the backlog, but not past 1 MiB: the burst is more.
        let config = format!(
            "rate_limit = \"1MiB\"\n{}grow_backlog = true\nmax_backlog = \"1MiB\"\n",
            source_config(&primary, TCP)
        );
        let (source, replica, seq) =
            seeding(root, &primary, &config, replica_redis.port, &rdir).await;
        let id = transferring(&replica, &source).await;
        // Then 2 MB are written: M+1 leaves the 1 MB backlog.
        primary.fill("burst", 2_000, &"b".repeat(1024));
        let lost = format!("lost offset {}", seq + 1);
        wait_for_async("the source to warn", DEADLINE, || async {
            let warnings = source.status().await.warnings;
            warnings.into_iter().find(|w| w.contains(&lost))
        })
        .await;
        assert!(
            replica.status().await.running.len() == 1,
            "warned while the transfer still runs"
        );
        let series = format!(
            "kvsync_kv_backlog_at_risk_total{{server=\"{}\"}}",
            primary.addr()
        );
        assert_eq!(source.metric(&series), 1.0);
        assert!(source.proc.log().contains("full resync"));
        // The handoff then meets the full resync it was warned of.
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        assert!(p.error.contains("FULL resync"), "{}", p.error);
        assert!(source.status().await.warnings.is_empty());
    });
}

/// The replica agent's config: `redis-replicate` handoff seeding the server
/// on `port` without restarting it.
fn replicate_config(primary: &Redis, port: u16) -> String {
    format!(
        "[transport]\n{TCP}\n[handoff]\nmode = \"redis-replicate\"\ntimeout = \"60s\"\n[redis]\nserver_addr = \"127.0.0.1:{port}\"\nprimary = \"{}\"\n",
        primary.addr()
    )
}

/// A source on `primary` and a `redis-replicate` replica agent for the
/// server on `port`, once the source offers the RDB; with its M.
async fn replicating(root: &Path, primary: &Redis, port: u16) -> (Node, Node, u64) {
    replicating_with(root, primary, port, "", "").await
}

/// [`replicating`], with `both` added to both agents' `[redis]` sections
/// and `replica` to the replica's.
async fn replicating_with(
    root: &Path,
    primary: &Redis,
    port: u16,
    both: &str,
    replica: &str,
) -> (Node, Node, u64) {
    let source = agent(
        root,
        "source",
        &primary.dir,
        &format!("{}{both}", source_config(primary, TCP)),
        &[],
    );
    let replica = agent(
        root,
        "replica",
        &root.join("replica-agent"),
        &format!("{}{both}{replica}", replicate_config(primary, port)),
        &[],
    );
    let seq = offered_rdb(&source, primary).await;
    (source, replica, seq)
}

/// The primary served one partial resync since `stats` (its `INFO
/// stats` then), and no full one.
fn one_partial_resync_since(primary: &Redis, stats: &kvsync::kv::redis::Info) {
    let after = primary.info("stats");
    assert_eq!(after.num("sync_full"), stats.num("sync_full"));
    assert_eq!(
        after.num("sync_partial_ok"),
        stats.num("sync_partial_ok") + 1
    );
}

fn a_running_replica_is_seeded_over_the_replication_protocol_without_a_restart(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "64mb");
    let stats = primary.info("stats");
    // A running server with data of its own, never restarted.
    let replica_redis = Redis::start(server, &root.join("replica-redis"), &[]);
    let _: () = replica_redis.cmd(&["SET", "stale", "1"]);
    let pid = replica_redis.info("server").num("process_id");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let writer = rt.block_on(async {
        let (source, replica, seq) = replicating(root, &primary, replica_redis.port).await;
        let writer = steady_writer(&primary);
        let p = sync_ok(&replica, &source).await;
        assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
        assert!(
            primary.info("replication").num("master_repl_offset") > seq,
            "written during the seeding"
        );
        assert_eq!(
            replica.metric(r#"kvsync_handoff_total{mode="redis-replicate",result="ok"}"#),
            1.0
        );
        writer
    });
    drop(writer);
    assert_eq!(
        replica_redis.info("server").num("process_id"),
        pid,
        "never restarted"
    );
    one_partial_resync_since(&primary, &stats);
    let repl = replica_redis.info("replication");
    assert_eq!(
        repl.get("master_port"),
        Some(primary.port.to_string().as_str())
    );
    let written: u64 = primary.cmd(&["DBSIZE"]);
    wait_for("the replica to catch up", DEADLINE, || {
        (replica_redis.cmd::<u64>(&["DBSIZE"]) == written).then_some(())
    });
    assert_eq!(replica_redis.cmd::<Option<String>>(&["GET", "stale"]), None);
    let keys: Vec<String> = primary.cmd(&["KEYS", "seeding:*"]);
    assert!(!keys.is_empty(), "the writer ran during the seeding");
    for key in keys.iter().step_by(37).chain(["hash:7".to_string()].iter()) {
        assert_eq!(
            replica_redis.cmd::<Vec<u8>>(&["DUMP", key]),
            primary.cmd::<Vec<u8>>(&["DUMP", key]),
            "{key}"
        );
    }
}

/// Servers as production runs them with TLS: each has a TLS port, asks
/// every client for a certificate and replicates over TLS, and the agents
/// reach them only on their TLS ports. A running replica is seeded through
/// the seed port, which answers it over TLS with the agent's certificate
/// (`redis-replicate`), or restarted on the installed RDB with its TLS
/// port (`redis`), and continues from its primary over TLS with a partial
/// resync.
fn seeded_with_every_link_over_tls(server: Server, handoff: &str) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let pki = common::pki::Pki::new(root, "kv");
    let (primary_args, primary_tls) = pki.server_tls("primary");
    let primary_args: Vec<&str> = primary_args.iter().map(String::as_str).collect();
    let primary = Redis::start(server, &root.join("primary"), &primary_args);
    primary.make_backlog(root);
    primary.fill("key", 20_000, "value-of-some-length");
    primary.bgsave();
    let rdir = root.join("replica-redis");
    let (tls_args, replica_tls) = pki.server_tls("replica-redis");
    let pidfile = rdir.join("redis.pid").display().to_string();
    let args: Vec<&str> = tls_args
        .iter()
        .map(String::as_str)
        .chain(["--pidfile", &pidfile])
        .collect();
    let replica_redis = Redis::start(server, &rdir, &args);
    let _: () = replica_redis.cmd(&["SET", "stale", "1"]);
    let primary_at = format!("127.0.0.1:{primary_tls}");
    let source = agent(
        root,
        "source",
        &primary.dir,
        &format!(
            "[transport]\n{TCP}\n[redis]\nprimary_addr = \"{primary_at}\"\n{}",
            pki.redis_tls("source")
        ),
        &[],
    );
    // The `redis` handoff restarts the server as it runs now, TLS port
    // and all.
    let restart = match handoff {
        "redis" => format!(
            "dir = \"{}\"\ndbfilename = \"dump.rdb\"\nstart = [{}]\n",
            rdir.display(),
            start_command(
                server,
                replica_redis.port,
                &rdir,
                &[replicaof(), tls_args].concat(),
            )
        ),
        _ => String::new(),
    };
    let replica = agent(
        root,
        "replica",
        &root.join("replica-agent"),
        &format!(
            "[transport]\n{TCP}\n[handoff]\nmode = \"{handoff}\"\ntimeout = \"60s\"\n[redis]\nserver_addr = \"127.0.0.1:{replica_tls}\"\nprimary = \"{primary_at}\"\n{restart}{}",
            pki.redis_tls("replica")
        ),
        &[],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let stats = primary.info("stats");
    rt.block_on(async {
        offered_rdb(&source, &primary).await;
        let p = sync_ok(&replica, &source).await;
        assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
    });
    one_partial_resync_since(&primary, &stats);
    let repl = replica_redis.info("replication");
    assert_eq!(repl.get("master_port"), Some(&*primary_tls.to_string()));
    primary.fill("after", 100, "v");
    let written: u64 = primary.cmd(&["DBSIZE"]);
    wait_for("the replica to catch up over TLS", DEADLINE, || {
        (replica_redis.cmd::<u64>(&["DBSIZE"]) == written).then_some(())
    });
    assert_eq!(replica_redis.cmd::<Option<String>>(&["GET", "stale"]), None);
}

fn a_server_that_replicates_over_tls_is_seeded_over_tls_and_continues_with_a_partial_resync(
    server: Server,
) {
    seeded_with_every_link_over_tls(server, "redis-replicate");
}

fn a_server_on_tls_ports_is_restarted_on_the_snapshot_and_continues_with_a_partial_resync(
    server: Server,
) {
    seeded_with_every_link_over_tls(server, "redis");
}

/// A server with `REPLICAOF` renamed away: `check-config --live` says the
/// seeding role cannot use it, though no ACL denies it.
fn a_renamed_command_the_role_needs_is_named_by_the_live_check(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let renamed = Redis::start(
        server,
        &root.join("r"),
        &["--rename-command", "REPLICAOF", ""],
    );
    let file = root.join("replica.toml");
    std::fs::write(
        &file,
        format!(
            "snapshot_dir = \"{}\"\nsnapshot_format = \"redis-rdb\"\n{}",
            root.display(),
            replicate_config(&renamed, renamed.port)
        ),
    )
    .unwrap();
    let (ok, out, err) = cli(&["check-config", "--live", file.to_str().unwrap()]);
    assert!(
        !ok && out.contains("missing +replicaof (the command is renamed or disabled there"),
        "{out}{err}"
    );
}

/// The source stalls 2.5 MiB into an RDB of 1 MiB pieces. The running
/// server already receives the two verified pieces (it loads while the
/// rest still moves), and nothing unverified. The sync is then cancelled:
/// the server drops what it got and keeps its own data, its replication
/// and `masterauth` are as they were, and no temp or seed file is left.
/// A sync from a source that does not stall then seeds it.
fn a_running_server_loads_the_verified_pieces_while_the_rest_arrives_and_a_stopped_sync_leaves_it_as_it_was(
    server: Server,
) {
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, rdb) = loaded_primary(server, root, "64mb");
    let size = std::fs::metadata(&rdb).unwrap().len();
    assert!(size > 3 * MIB, "an RDB of several pieces: {size}");
    let replica_redis = Redis::start(server, &root.join("replica-redis"), &[]);
    let _: () = replica_redis.cmd(&["SET", "own", "1"]);
    let pieces = "[data]\npiece_size = \"1MiB\"\n";
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let stalling = agent(
            root,
            "stalling",
            &primary.dir,
            &format!("{pieces}{}", source_config(&primary, TCP)),
            &[("KVSYNC_FAULTS", "stall_after=2621440")],
        );
        let replica = agent(
            root,
            "replica",
            &root.join("replica-agent"),
            &replicate_config(&primary, replica_redis.port),
            &[],
        );
        offered_rdb(&stalling, &primary).await;
        let id = start_sync(&replica, &stalling).await;
        wait_for(
            "the server to receive the verified pieces",
            DEADLINE,
            || {
                let i = replica_redis.info("replication");
                (i.num("master_sync_read_bytes") == 2 * MIB).then_some(())
            },
        );
        let i = replica_redis.info("replication");
        assert_eq!(i.num("master_sync_total_bytes"), size, "{i:?}");
        cancel_while_transferring(&replica, &id).await;
        wait_for("the server to be a primary again", DEADLINE, || {
            (replica_redis.info("replication").get("role") == Some("master")).then_some(())
        });
        assert_eq!(
            replica_redis
                .cmd::<Option<String>>(&["GET", "own"])
                .as_deref(),
            Some("1")
        );
        assert_eq!(replica_redis.cmd::<u64>(&["DBSIZE"]), 1);
        let auth: Vec<String> = replica_redis.cmd(&["CONFIG", "GET", "masterauth"]);
        assert_eq!(auth[1], "", "its own masterauth (none) again");
        assert!(!seed_record(root).exists());
        assert_eq!(replica.temp_files(), Vec::<String>::new());
        drop(stalling);

        let source = agent(
            root,
            "source",
            &primary.dir,
            &format!("{pieces}{}", source_config(&primary, TCP)),
            &[],
        );
        offered_rdb(&source, &primary).await;
        let p = sync_ok(&replica, &source).await;
        assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
        assert!(replica
            .proc
            .log()
            .contains("seeding the local server while the snapshot arrives"));
    });
    assert_eq!(replica_redis.cmd::<Option<String>>(&["GET", "own"]), None);
    assert_eq!(
        replica_redis.cmd::<Vec<u8>>(&["DUMP", "hash:7"]),
        primary.cmd::<Vec<u8>>(&["DUMP", "hash:7"])
    );
}

fn a_replica_reseeded_with_swapdb_serves_its_old_data_while_it_loads_and_the_seed_admits_one_connection(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "64mb");
    // A replica of this primary, to be seeded again (a lagging replica's
    // case): its data is of the same history, so with swapdb it keeps
    // serving it while the new copy loads. Loading is slowed
    // (key-load-delay, µs per key) so the test can read and knock during it.
    let replica_redis = Redis::start(
        server,
        &root.join("replica-redis"),
        &[
            "--repl-diskless-load",
            "swapdb",
            "--replicaof",
            "127.0.0.1",
            &primary.port.to_string(),
        ],
    );
    wait_for("the replica's first sync", DEADLINE, || {
        (replica_redis.info("replication").get("master_link_status") == Some("up")).then_some(())
    });
    let _: () = replica_redis.cmd(&["CONFIG", "SET", "key-load-delay", "20"]);
    // A client reads throughout; what it saw, (good reads, errors).
    let seen = std::sync::Arc::new(std::sync::Mutex::new((0u64, Vec::<String>::new())));
    let reader = {
        let seen = seen.clone();
        Client::start(&replica_redis, move |con, _| {
            let read = redis::cmd("GET").arg("key:1").query::<Option<String>>(con);
            let mut seen = seen.lock().unwrap();
            match read {
                Ok(Some(_)) => seen.0 += 1,
                Ok(None) => seen.1.push("key:1 missing".to_string()),
                Err(e) => seen.1.push(e.to_string()),
            }
        })
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (source, replica, _) = replicating(root, &primary, replica_redis.port).await;
        let id = start_sync(&replica, &source).await;
        // The seed's address, once it serves; a second connection to it
        // is turned away.
        let seed = wait_for("the seed to listen", DEADLINE, || {
            let log = replica.proc.log();
            let line = log.lines().find(|l| l.contains("serving the RDB"))?;
            let addr = line.split("seed=").nth(1)?.split_whitespace().next()?;
            Some(addr.to_string())
        });
        // Sent: the server now loads it (slowly, for seconds).
        wait_for("the RDB to be sent", DEADLINE, || {
            replica
                .proc
                .log()
                .contains("RDB sent to the local server")
                .then_some(())
        });

        let mut knock = std::net::TcpStream::connect(&seed).unwrap();
        let mut answer = String::new();
        std::io::Read::read_to_string(&mut knock, &mut answer).unwrap();
        assert!(
            answer.starts_with("-ERR this kvsync seed serves one replica"),
            "{answer:?}"
        );
        let p = wait_done(&replica, &id).await;
        drop(reader);
        assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    });
    let (reads, errors) = seen.lock().unwrap().clone();
    assert!(reads > 0, "the reader ran during the seeding");
    assert_eq!(
        errors,
        Vec::<String>::new(),
        "served throughout, never an error"
    );
}

fn a_server_that_refuses_replicaof_fails_the_handoff_and_is_left_as_it_was(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "64mb");
    let replica_redis = Redis::start(
        server,
        &root.join("replica-redis"),
        &[
            "--rename-command",
            "REPLICAOF",
            "kvsync-may-not",
            "--rename-command",
            "SLAVEOF",
            "nor-this",
        ],
    );
    let _: () = replica_redis.cmd(&["SET", "mine", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (source, replica, _) = replicating(root, &primary, replica_redis.port).await;
        let id = start_sync(&replica, &source).await;
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        assert!(p.error.contains("refused REPLICAOF"), "{}", p.error);
        assert_eq!(
            replica.metric(r#"kvsync_handoff_total{mode="redis-replicate",result="failed"}"#),
            1.0
        );
    });
    assert_eq!(replica_redis.cmd::<String>(&["GET", "mine"]), "1");
    assert_eq!(
        replica_redis.info("replication").get("role"),
        Some("master")
    );
}

/// `id -u user` (or `-g`).
fn agents_run_as_nobody_seed_a_server_run_as_redis_with_debians_modes(server: Server) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip(
            "users",
            "running the servers and agents as other users needs root",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // The primary runs as redis: its dir 0750 redis:redis, its dump 0660.
    let primary = Redis::start_as(
        server,
        &root.join("primary"),
        &["--repl-backlog-size", "64mb"],
        Some(server.user()),
    );
    primary.make_backlog(root);
    primary.fill("key", 10_000, "value");
    let rdb = primary.bgsave();
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&rdb).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o660, "Debian's modes");
    let replica_redis = Redis::start_as(
        server,
        &root.join("replica-redis"),
        &[],
        Some(server.user()),
    );
    let _: () = replica_redis.cmd(&["SET", "mine", "1"]);
    // Both agents run as nobody; the source also in group redis (the
    // drop-in's SupplementaryGroups), with its record outside the
    // primary's dir.
    let state = root.join("state");
    let replica_dir = root.join("replica-agent");
    for d in [&state, &replica_dir] {
        std::fs::create_dir_all(d).unwrap();
        std::os::unix::fs::chown(d, Some(uid("nobody")), Some(gid("nobody"))).unwrap();
    }
    let source_as = [
        "setpriv",
        "--reuid",
        "nobody",
        "--regid",
        "nogroup",
        "--groups",
        server.user(),
        "--",
    ];
    let replica_as = [
        "setpriv",
        "--reuid",
        "nobody",
        "--regid",
        "nogroup",
        "--clear-groups",
        "--",
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let config = format!(
            "{}backlog_record = \"{}\"\n",
            source_config(&primary, TCP),
            state.join("redis-backlog").display()
        );
        let source = agent_as(root, "source", &primary.dir, &config, &[], &source_as);
        let replica = agent_as(
            root,
            "replica",
            &replica_dir,
            &replicate_config(&primary, replica_redis.port),
            &[],
            &replica_as,
        );
        offered_rdb(&source, &primary).await;
        let p = sync_ok(&replica, &source).await;
        assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
        let owner =
            std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&p.installed_path).unwrap());
        assert_eq!(owner, uid("nobody"), "installed by the unprivileged agent");
    });
    assert_eq!(replica_redis.cmd::<Option<String>>(&["GET", "mine"]), None);
    assert_eq!(
        replica_redis
            .cmd::<Option<String>>(&["GET", "key:9999"])
            .as_deref(),
        Some("value")
    );
}

/// A local process spinning on a fixed seed port, asking for a full sync
/// with whatever password it guesses: every byte it was sent.
fn squatter(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<u8>> {
    use std::io::{Read, Write};
    std::thread::spawn(move || {
        let mut got = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
                continue;
            };
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            let _ = s.write_all(b"PING\r\nAUTH guess\r\nREPLCONF capa eof\r\nPSYNC ? -1\r\n");
            let _ = s.read_to_end(&mut got);
        }
        got
    })
}

/// The seed's one-time `masterauth` record in the replica agent's directory.
fn seed_record(root: &Path) -> PathBuf {
    root.join("replica-agent").join(kvsync::kv::seed::RECORD)
}

fn a_replica_with_masterauth_is_seeded_while_a_local_process_on_the_seed_port_gets_no_rdb_byte(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let secret = ["--requirepass", "fleet-secret"];
    let primary = Redis::start(
        server,
        &root.join("primary"),
        &[&secret[..], &["--repl-backlog-size", "64mb"]].concat(),
    );
    primary.make_backlog(root);
    primary.fill("key", 10_000, "value");
    primary.bgsave();
    let replica_redis = Redis::start(
        server,
        &root.join("replica-redis"),
        &[&secret[..], &["--masterauth", "fleet-secret"]].concat(),
    );
    let seed_port = free_port();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinning = squatter(seed_port, stop.clone());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (source, replica, _) = replicating_with(
            root,
            &primary,
            replica_redis.port,
            "password = \"fleet-secret\"\n",
            &format!("seed_listen = \"127.0.0.1:{seed_port}\"\n"),
        )
        .await;
        let p = sync_ok(&replica, &source).await;
        assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let got = String::from_utf8_lossy(&spinning.join().unwrap()).into_owned();
    assert!(!got.is_empty(), "the squatter reached the seed port");
    assert!(
        !got.contains("FULLRESYNC") && !got.contains("REDIS0"),
        "{got:?}"
    );
    assert_eq!(
        replica_redis.cmd::<Vec<String>>(&["CONFIG", "GET", "masterauth"]),
        ["masterauth", "fleet-secret"],
        "the server's masterauth is back"
    );
    assert!(!seed_record(root).exists());
    assert_eq!(
        replica_redis
            .cmd::<Option<String>>(&["GET", "key:9999"])
            .as_deref(),
        Some("value")
    );
}

fn an_agent_killed_while_seeding_puts_the_servers_masterauth_back_when_it_starts_again(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "64mb");
    let replica_redis = Redis::start(
        server,
        &root.join("replica-redis"),
        &["--masterauth", "before"],
    );
    // Loading is slowed (µs per key) so the agent dies while it seeds.
    let _: () = replica_redis.cmd(&["CONFIG", "SET", "key-load-delay", "20"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (source, mut replica, _) = replicating(root, &primary, replica_redis.port).await;
        let id = start_sync(&replica, &source).await;
        wait_for("the RDB to be sent", DEADLINE, || {
            replica
                .proc
                .log()
                .contains("RDB sent to the local server")
                .then_some(())
        });
        let during: Vec<String> = replica_redis.cmd(&["CONFIG", "GET", "masterauth"]);
        assert_ne!(during[1], "before", "a one-time password while seeding");
        assert!(seed_record(root).exists());
        replica.proc.signal(libc::SIGKILL);
        replica.proc.wait_exit();
        drop(id);
        let _again = agent(
            root,
            "replica",
            &root.join("replica-agent"),
            &replicate_config(&primary, replica_redis.port),
            &[],
        );
        wait_for(
            "the restarted agent to restore masterauth",
            DEADLINE,
            || {
                let now: Vec<String> = replica_redis.cmd(&["CONFIG", "GET", "masterauth"]);
                (now[1] == "before" && !seed_record(root).exists()).then_some(())
            },
        );
    });
    // It was no one's replica, and is again (not the dead seed's).
    assert_eq!(
        replica_redis.info("replication").get("role"),
        Some("master")
    );
}

fn a_fixed_seed_port_that_is_taken_fails_the_handoff_and_says_so(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (primary, _) = loaded_primary(server, root, "64mb");
    let replica_redis = Redis::start(server, &root.join("replica-redis"), &[]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (source, replica, _) = replicating_with(
            root,
            &primary,
            replica_redis.port,
            "",
            &format!("seed_listen = \"127.0.0.1:{port}\"\n"),
        )
        .await;
        let id = start_sync(&replica, &source).await;
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        assert!(
            p.error.contains("is taken") && p.error.contains("port to 0"),
            "{}",
            p.error
        );
    });
    assert_eq!(
        replica_redis.info("replication").get("role"),
        Some("master")
    );
}

/// An agent with `instances` (`[[instance]]` tables) and nothing else of
/// its own: both transports, the emulated RDMA fabric.
fn multi_instance_agent(root: &Path, name: &str, instances: &str) -> Node {
    let path = root.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "node_id = \"{name}\"\ncreate_dirs = true\n[grpc]\nlisten = \"127.0.0.1:0\"\n[data]\ntcp_listen = \"127.0.0.1:0\"\nrdma_port = 0\n[metrics]\nlisten = \"127.0.0.1:0\"\n[watch]\ndebounce = \"20ms\"\n[sync]\nretries = 0\n[transport]\nmode = \"auto\"\nrdma_provider = \"emulated\"\n{instances}"
        ),
    )
    .unwrap();
    Node {
        proc: AgentProcess::start(&["--config", path.to_str().unwrap()], root),
        dir: root.to_owned(),
        token: None,
    }
}

/// A primary with a backlog and `n` keys `prefix:i`, saved.
fn small_primary(server: Server, root: &Path, prefix: &str, n: usize) -> Redis {
    let primary = Redis::start(
        server,
        &root.join(format!("primary-{prefix}")),
        &["--repl-backlog-size", "16mb"],
    );
    primary.make_backlog(&root.join(format!("helper-{prefix}")));
    primary.fill(prefix, n, "value");
    primary.bgsave();
    primary
}

fn one_agent_pair_seeds_two_redis_instances_and_a_kvr1_one_at_once(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let a = small_primary(server, root, "a", 20_000);
    let b = small_primary(server, root, "b", 30_000);
    let (ra, rb) = (
        Redis::start(server, &root.join("replica-a"), &[]),
        Redis::start(server, &root.join("replica-b"), &[]),
    );
    let before: Vec<_> = [&a, &b].iter().map(|p| p.info("stats")).collect();
    let blobs = root.join("blobs-source");
    std::fs::create_dir_all(&blobs).unwrap();
    put_snapshot(&blobs, "s.kvr1", 3 << 20, 77);
    let redis_source = |name: &str, primary: &Redis| {
        format!(
            "[[instance]]\nname = \"{name}\"\nsnapshot_dir = \"{}\"\nsnapshot_format = \"redis-rdb\"\n[instance.redis]\nprimary_addr = \"{}\"\nrate_window = \"300ms\"\nhealth_interval = \"200ms\"\n",
            primary.dir.display(),
            primary.addr()
        )
    };
    let source = multi_instance_agent(
        root,
        "source",
        &format!(
            "{}{}[[instance]]\nname = \"blobs\"\nsnapshot_dir = \"{}\"\n",
            redis_source("cache-a", &a),
            redis_source("cache-b", &b),
            blobs.display()
        ),
    );
    let redis_replica = |name: &str, primary: &Redis, server: &Redis| {
        format!(
            "[[instance]]\nname = \"{name}\"\nsnapshot_dir = \"{}\"\nsnapshot_format = \"redis-rdb\"\n[instance.handoff]\nmode = \"redis-replicate\"\ntimeout = \"60s\"\n[instance.redis]\nserver_addr = \"{}\"\nprimary = \"{}\"\n",
            root.join(format!("{name}-replica")).display(),
            server.addr(),
            primary.addr()
        )
    };
    let replica = multi_instance_agent(
        root,
        "replica",
        &format!(
            "{}{}[[instance]]\nname = \"blobs\"\nsnapshot_dir = \"{}\"\n",
            redis_replica("cache-a", &a, &ra),
            redis_replica("cache-b", &b, &rb),
            root.join("blobs-replica").display()
        ),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for (instance, primary) in [("cache-a", &a), ("cache-b", &b)] {
            let seq = kvsync::snapshot::verify_file(&primary.dir.join("dump.rdb"), None)
                .unwrap()
                .seq;
            source.offered_in(instance, seq).await;
        }
        source.offered_in("blobs", 77).await;
        // All three at once: two over the emulated RDMA fabric, one over TCP.
        let mut c = replica.client().await;
        let mut ids = Vec::new();
        for (instance, transport) in [
            ("cache-a", pb::TransportPreference::Rdma),
            ("cache-b", pb::TransportPreference::Tcp),
            ("blobs", pb::TransportPreference::Rdma),
        ] {
            let started = c
                .start_full_sync(pb::StartFullSyncRequest {
                    source: source.grpc(),
                    instance: instance.into(),
                    transport: transport as i32,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            ids.push((instance, transport, started.sync_id));
        }
        for (instance, transport, id) in ids {
            let p = wait_done(&replica, &id).await;
            assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{instance}: {p:?}");
            assert_eq!(p.instance, instance);
            let (expected, label) = match transport {
                pb::TransportPreference::Tcp => (pb::Transport::Tcp, "tcp"),
                _ => (pb::Transport::Rdma, "rdma"),
            };
            assert_eq!(p.transport, expected as i32, "{instance}: {p:?}");
            if instance != "blobs" {
                assert!(p.handoff.contains("partial resync accepted"), "{p:?}");
            }
            for (node, role) in [(&replica, "replica"), (&source, "source")] {
                assert_eq!(
                    node.metric(&format!(
                        r#"kvsync_fullsync_total{{kv_instance="{instance}",result="ok",role="{role}",transport="{label}"}}"#
                    )),
                    1.0,
                    "{instance} {role}"
                );
            }
        }
    });
    // Each server continued from its own primary, which never full-synced it.
    for ((primary, replica_server), stats) in [(&a, &ra), (&b, &rb)].into_iter().zip(&before) {
        let now = primary.info("stats");
        assert_eq!(now.num("sync_full"), stats.num("sync_full"));
        assert_eq!(now.num("sync_partial_ok"), stats.num("sync_partial_ok") + 1);
        let keys: u64 = primary.cmd(&["DBSIZE"]);
        wait_for("the replica to catch up", DEADLINE, || {
            (replica_server.cmd::<u64>(&["DBSIZE"]) == keys).then_some(())
        });
        assert_eq!(
            replica_server.info("replication").get("master_port"),
            Some(primary.port.to_string().as_str())
        );
    }
    assert_eq!(
        ra.cmd::<Option<String>>(&["GET", "a:19999"]).as_deref(),
        Some("value")
    );
    assert_eq!(ra.cmd::<Option<String>>(&["GET", "b:0"]), None);
    for (instance, primary) in [("cache-a", &a), ("cache-b", &b)] {
        wait_metric(
            &source,
            &format!(
                r#"kvsync_kv_up{{kv_instance="{instance}",server="{}"}}"#,
                primary.addr()
            ),
            "the source's health poll of each primary",
            |v| v == 1.0,
        );
        assert_eq!(
            replica.metric(&format!(
                r#"kvsync_handoff_total{{kv_instance="{instance}",mode="redis-replicate",result="ok"}}"#
            )),
            1.0
        );
    }
}

on_both_servers!(
    a_server_that_replicates_over_tls_is_seeded_over_tls_and_continues_with_a_partial_resync
);

on_both_servers!(a_renamed_command_the_role_needs_is_named_by_the_live_check);
on_both_servers!(
    a_server_on_tls_ports_is_restarted_on_the_snapshot_and_continues_with_a_partial_resync
);

on_both_servers!(
    rdbs_saved_by_the_real_server_carry_the_replication_position,
    replica_seeded_over_tcp_continues_with_a_partial_resync,
    replica_seeded_over_the_emulated_rdma_fabric_continues_with_a_partial_resync,
    refusals_leave_the_replica_server_untouched,
    a_full_resync_is_a_failed_handoff,
    an_rdb_without_its_own_checksum_is_verified_piece_by_piece,
    replication_health_of_both_servers_reaches_prometheus,
    check_replica_ignores_writes_in_flight_and_finds_exactly_the_planted_keys,
    a_primary_writing_faster_than_its_backlog_can_hold_is_refused_before_anything_moves,
    a_backlog_too_small_for_the_writes_during_a_seeding_is_grown_then_restored,
    writes_faster_during_a_seeding_than_at_the_offer_grow_the_backlog_in_time,
    an_agent_killed_holding_a_grown_backlog_restores_it_when_it_starts_again,
    a_burst_of_writes_that_pushes_m_out_of_the_backlog_is_reported_before_the_handoff,
    a_running_replica_is_seeded_over_the_replication_protocol_without_a_restart,
    a_running_server_loads_the_verified_pieces_while_the_rest_arrives_and_a_stopped_sync_leaves_it_as_it_was,
    a_server_that_refuses_replicaof_fails_the_handoff_and_is_left_as_it_was,
    agents_run_as_nobody_seed_a_server_run_as_redis_with_debians_modes,
    a_replica_with_masterauth_is_seeded_while_a_local_process_on_the_seed_port_gets_no_rdb_byte,
    an_agent_killed_while_seeding_puts_the_servers_masterauth_back_when_it_starts_again,
    a_fixed_seed_port_that_is_taken_fails_the_handoff_and_says_so,
    a_replica_reseeded_with_swapdb_serves_its_old_data_while_it_loads_and_the_seed_admits_one_connection,
    one_agent_pair_seeds_two_redis_instances_and_a_kvr1_one_at_once,
);
