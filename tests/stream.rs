//! The replication stream with real `redis-server` and `valkey-server`
//! processes (each test runs against both) and agent processes: the
//! primary's agent follows its primary into the stream log (a full resync
//! whose RDB becomes an offered snapshot, then the stream, acknowledged so
//! `WAIT` counts it), and after a restart continues from its log with a
//! partial resync.

mod common;

use std::path::Path;

use common::kv::*;
use common::node::*;
use common::*;
use kvsync::stream::log::{read, Log};

/// The config of an agent following `primary` into `log_dir`.
fn follower_config(primary: &Redis, log_dir: &Path) -> String {
    format!(
        "[redis]\nprimary_addr = \"{}\"\npassword = \"{}\"\n[stream]\ndir = \"{}\"\nfsync = \"always\"\n",
        primary.addr(),
        primary.password.as_deref().unwrap_or(""),
        log_dir.display()
    )
}

/// The offset the primary holds for its one replica (the agent's ack).
fn replica_offset(primary: &Redis) -> Option<u64> {
    let info = primary.info("replication");
    let line = info.get("slave0")?;
    line.split(',')
        .find_map(|kv| kv.strip_prefix("offset="))
        .and_then(|o| o.parse().ok())
}

/// The whole stream the log holds, from its first offset.
fn log_bytes(dir: &Path) -> (u64, Vec<u8>) {
    let log = Log::open(kvsync::config::StreamConfig {
        dir: dir.to_path_buf(),
        ..Default::default()
    })
    .unwrap();
    let (first, (_, end)) = (log.first().unwrap(), log.position().unwrap());
    let (mut at, mut out) = (first, Vec::new());
    while at < end {
        for r in read(&log.plan(at).unwrap(), 1 << 20).unwrap() {
            out.extend_from_slice(&r.bytes[(at - r.offset) as usize..]);
            at = r.end();
        }
    }
    (first, out)
}

fn the_primarys_agent_follows_it_into_the_log_and_continues_after_a_restart(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(
        server,
        &root.path().join("p"),
        &["--requirepass", "s3cret-pass"],
    );
    primary.fill("before", 500, "v");
    let (snaps, log_dir) = (root.path().join("snaps"), root.path().join("log"));
    let config = follower_config(&primary, &log_dir);
    let mut agent = agent(root.path(), "src", &snaps, &config, &[]);
    // A full resync: its RDB is offered, at the offset the log starts at.
    let offered = wait_for(
        "the full resync's RDB offered in snapshot_dir",
        DEADLINE,
        || {
            std::fs::read_dir(&snaps)
                .ok()?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .find(|n| n.starts_with("stream-") && n.ends_with(".rdb"))
        },
    );
    let rdb_offset: u64 = offered["stream-".len()..offered.len() - 4].parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(agent.offered(rdb_offset));

    primary.fill("after", 2000, "value-of-the-stream");
    // WAIT counts the agent once the writes are in its log.
    let acked: i64 = primary.cmd(&["WAIT", "1", "10000"]);
    assert_eq!(acked, 1, "WAIT 1 counts the agent");
    let end = primary.info("replication").num("master_repl_offset");
    wait_for(
        "the agent to acknowledge the primary's offset",
        DEADLINE,
        || (replica_offset(&primary) == Some(end)).then_some(()),
    );
    let stats = primary.info("stats");
    assert_eq!(stats.num("sync_full"), 1, "one full resync");

    agent.proc.signal(libc::SIGTERM);
    agent.proc.wait_exit();
    let (first, bytes) = log_bytes(&log_dir);
    assert_eq!(
        first, rdb_offset,
        "the log starts where the offered RDB does"
    );
    assert_eq!(
        first + bytes.len() as u64,
        end,
        "the log ends at the primary's offset"
    );
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("after:1999") && text.contains("value-of-the-stream"));

    // Writes while the agent is down, then a restart: PSYNC from the log's
    // end continues (no second full resync), and the log stays continuous.
    primary.fill("while-down", 300, "v");
    let agent = agent_again(root.path(), &snaps, &config);
    let end = primary.info("replication").num("master_repl_offset");
    wait_for("the restarted agent to catch up", DEADLINE, || {
        (replica_offset(&primary) == Some(end)).then_some(())
    });
    let stats = primary.info("stats");
    assert_eq!(stats.num("sync_full"), 1, "no second full resync");
    assert!(stats.num("sync_partial_ok") >= 1, "a partial resync");
    drop(agent);
    let (first2, bytes2) = log_bytes(&log_dir);
    assert_eq!(first2, first);
    assert_eq!(&bytes2[..bytes.len()], &bytes[..]);
    assert!(String::from_utf8_lossy(&bytes2).contains("while-down:299"));
}

/// The agent started again with the same config file.
fn agent_again(root: &Path, snaps: &Path, config: &str) -> Node {
    agent(root, "src", snaps, config, &[])
}

on_both_servers!(the_primarys_agent_follows_it_into_the_log_and_continues_after_a_restart);
