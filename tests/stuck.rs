//! States an operator could neither see nor leave, with real servers and
//! agent processes, each left on its own or named: a `redis-stream`
//! replica stranded by its upstream's full resync (the primary's agent was
//! down longer than the primary's backlog, so its log starts after the
//! replica's offset) is re-seeded from the upstream's snapshot, and with
//! `[stream] reseed = false` says it needs a snapshot until `kvsync sync`
//! of one starts its log over and completes the hand-off.

mod common;

use std::path::Path;

use common::kv::*;
use common::node::*;
use common::stream::*;
use common::*;

/// A primary with a 1 MiB backlog, its agent on a gRPC port it can be
/// started again at, and a replica agent (`extra` in its `[stream]`)
/// feeding a server seeded through it; then the primary's agent is killed
/// while the primary writes more than its backlog holds and started again:
/// its full resync starts its log past the replica's offset. Returns the
/// primary, its agent, the fed server and its agent.
fn stranded(server: Server, root: &Path, extra: &str) -> (Redis, Node, Redis, Node) {
    let primary = Redis::start(server, &root.join("p"), &["--repl-backlog-size", "1mb"]);
    let port = free_port();
    let config = follower_config(&primary, &root.join("src-log"));
    let start_source = || {
        let source = agent_at(
            root,
            "src",
            &root.join("src-snaps"),
            &config,
            "127.0.0.1",
            port,
        );
        wait_following(&source);
        source
    };
    let mut source = start_source();
    let (rs, replica) = seeded_through_two_agents_with(root, server, &primary, &source, extra);
    let left_at = stream_status(&replica).end_offset;
    source.proc.signal(libc::SIGKILL);
    source.proc.wait_exit();
    drop(source);
    primary.fill("while-down", 3000, &"v".repeat(1000));
    let source = start_source();
    let first = stream_status(&source).first_offset;
    assert!(
        first > left_at,
        "the source's log starts at {first}, past {left_at}"
    );
    primary.fill("after", 100, "w");
    (primary, source, rs, replica)
}

fn a_replica_stranded_by_its_upstreams_full_resync_is_re_seeded_from_its_snapshot(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let (primary, _source, rs, replica) = stranded(server, root.path(), "");
    converged(
        &rs,
        &primary,
        "the stranded server to be re-seeded and converge",
    );
    let value: String = rs.cmd(&["GET", "while-down:2999"]);
    assert_eq!(value, "v".repeat(1000));
    let log = replica.proc.log();
    assert!(log.contains("re-seeding"), "{log}");
    fed_by_its_agent(&rs, &primary);
}

/// `rs` follows its agent's feed, and the primary serves one replica: the
/// primary's agent (the re-seeding came from it, never from the primary).
fn fed_by_its_agent(rs: &Redis, primary: &Redis) {
    let port = rs.info("replication").num("master_port");
    assert_ne!(port, u64::from(primary.port), "the server follows its feed");
    assert_eq!(primary.info("replication").num("connected_slaves"), 1);
}

on_both_servers!(a_replica_stranded_by_its_upstreams_full_resync_is_re_seeded_from_its_snapshot);

fn a_stranded_replica_without_reseed_says_it_needs_a_snapshot_until_a_sync_re_seeds_it(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let (primary, source, rs, replica) = stranded(server, root.path(), "reseed = false\n");
    let state = wait_for(
        "the replica agent to say it needs a snapshot",
        DEADLINE,
        || {
            let s = stream_status(&replica).state;
            s.starts_with("needs a snapshot").then_some(s)
        },
    );
    assert!(state.contains("continues into its log"), "{state}");
    assert_eq!(
        rs.cmd::<i64>(&["EXISTS", "after:99"]),
        0,
        "the server is stuck"
    );

    // The sync the state asks for completes its hand-off: the log starts
    // over at the snapshot, which the feed seeds the server from.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = rt.block_on(sync_from(&replica, &source.grpc()));
    assert_eq!(p.phase, kvsync::rpc::pb::Phase::Succeeded as i32, "{p:?}");
    converged(&rs, &primary, "the server to converge after the sync");
    let value: String = rs.cmd(&["GET", "after:99"]);
    assert_eq!(value, "w");
    assert!(
        stream_status(&replica).state.starts_with("following"),
        "{:?}",
        stream_status(&replica)
    );
    fed_by_its_agent(&rs, &primary);
}

on_both_servers!(
    a_stranded_replica_without_reseed_says_it_needs_a_snapshot_until_a_sync_re_seeds_it
);
