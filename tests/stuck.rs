//! States an operator could neither see nor leave, with real servers and
//! agent processes, each left on its own or named: a `redis-stream`
//! replica stranded by its upstream's full resync (the primary's agent was
//! down longer than the primary's backlog, so its log starts after the
//! replica's offset) is re-seeded from the upstream's snapshot, and with
//! `[stream] reseed = false` says it needs a snapshot until `kvsync sync`
//! of one starts its log over and completes the hand-off; a fed server
//! restarted from its own config (a writable master from then on) is
//! pointed back at its feed and continues with a partial resync, while one
//! promoted on purpose (`REPLICAOF NO ONE`) is left alone and named, and a
//! sync into it refused before it changes anything; a stream that cannot
//! write its snapshot directory refuses to start (each failed save of the
//! primary's RDB was a full sync of the primary). Each
//! state turns the instance's health and `/readyz` red until it is left.

mod common;

use std::path::Path;

use serde_json::Value;

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
    // (Once the source offers the snapshot its full resync made.)
    wait_for(
        "the replica agent to say it needs the source's snapshot",
        DEADLINE,
        || {
            let s = stream_status(&replica).state;
            (s.starts_with("needs a snapshot") && s.contains("continues into its log"))
                .then_some(())
        },
    );
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
    wait_health(&replica, "ok");
    fed_by_its_agent(&rs, &primary);
}

on_both_servers!(
    a_stranded_replica_without_reseed_says_it_needs_a_snapshot_until_a_sync_re_seeds_it
);

/// Waits until `agent`'s only instance has the health `verdict`, in its
/// status and in `/readyz` (200 only when ok); returns `/readyz`'s body.
fn wait_health(agent: &Node, verdict: &str) -> Value {
    let metrics = agent.proc.addr("metrics");
    wait_for(
        &format!("the instance's health to be {verdict}"),
        DEADLINE,
        || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            let status = rt.block_on(agent.status());
            let (code, body) = http_status(&metrics, "/readyz");
            let body: Value = serde_json::from_str(&body).expect("a JSON body");
            let said = body["instances"][0]["health"].as_str() == Some(verdict);
            (status.instances[0].health == verdict && said && (code == 200) == (verdict == "ok"))
                .then_some(body)
        },
    )
}

fn a_fed_server_restarted_from_its_own_config_is_back_on_its_feed_by_a_partial_resync(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    let source = following_source(root.path(), &primary, &[]);
    let (rs, replica) = seeded_through_two_agents(root.path(), server, &primary, &source);
    wait_health(&replica, "ok");
    let series =
        |v: &str| format!("kvsync_instance_health{{kv_instance=\"default\",verdict=\"{v}\"}}");
    let exported = |v: &str| {
        wait_for(
            &format!("kvsync_instance_health to say {v}"),
            DEADLINE,
            || (replica.metric(&series(v)) == 1.0).then_some(()),
        )
    };
    exported("ok");

    // Shut down with a save and started again from its own config: a
    // writable master, under a new replication id.
    let (dir, port, run_id) = (
        rs.dir.clone(),
        rs.port,
        rs.info("server").get("run_id").unwrap().to_string(),
    );
    let _ = rs.try_cmd::<()>(&["SHUTDOWN", "SAVE"]);
    drop(rs);
    primary.fill("while-down", 200, "v");
    let rs = Redis::standalone_replica_on(server, &dir, port);
    assert_ne!(rs.info("server").get("run_id").unwrap(), run_id);
    converged(&rs, &primary, "the restarted server to be fed again");
    let repl = rs.info("replication");
    assert_eq!(repl.get("role"), Some("slave"));
    fed_by_its_agent(&rs, &primary);
    let log = replica.proc.log();
    assert!(log.contains("came back a master (restarted)"), "{log}");
    assert_eq!(
        log.matches("sent its server the RDB").count(),
        1,
        "only the seeding: {log}"
    );
    assert!(
        log.matches("continues its server from the log").count() >= 1,
        "{log}"
    );
    let repointed = "kvsync_stream_server_repointed_total{kv_instance=\"default\"}";
    wait_for("the move to be counted", DEADLINE, || {
        (replica.metric(repointed) == 1.0).then_some(())
    });
    wait_health(&replica, "ok");

    // Promoted on purpose (the same process): left a master, and named.
    let () = rs.cmd(&["REPLICAOF", "NO", "ONE"]);
    let body = wait_health(&replica, "stuck");
    assert!(
        body["instances"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("promoted while running"),
        "{body}"
    );
    exported("stuck");
    // Its link, read for the role it should have: down.
    let link = format!(
        "kvsync_kv_link_up{{kv_instance=\"default\",server=\"{}\"}}",
        rs.addr()
    );
    wait_for("kvsync_kv_link_up to say 0", DEADLINE, || {
        (replica.metric(&link) == 0.0).then_some(())
    });
    assert_eq!(
        rs.info("replication").get("role"),
        Some("master"),
        "left alone"
    );
    assert_eq!(replica.metric(repointed), 1.0);
    // A sync into it is refused before anything changes: it keeps its
    // writes (before the check, the seeding made it a replica of the feed).
    let () = rs.cmd(&["SET", "taken-as-master", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let refused = |rs: &Redis| {
        let p = rt.block_on(sync_from(&replica, &source.grpc()));
        assert_eq!(p.phase, kvsync::rpc::pb::Phase::Failed as i32, "{p:?}");
        assert!(
            p.error.contains("refused, nothing was changed"),
            "{}",
            p.error
        );
        assert_eq!(rs.info("replication").get("role"), Some("master"));
        assert_eq!(rs.cmd::<i64>(&["EXISTS", "taken-as-master"]), 1);
    };
    refused(&rs);
    // The same with the agent's record of the fed server damaged (a bad
    // disk): a record that cannot be read is never "never fed".
    let record = root
        .path()
        .join("rep-log")
        .join(kvsync::stream::keep::RUN_ID_FILE);
    assert!(record.exists());
    std::fs::write(&record, b"\xff\xfe damaged").unwrap();
    refused(&rs);

    // Promoted on purpose, then crashed: restarted on the RDB of its fed
    // days (the feed's id, at an offset the log continues), it is still
    // the server someone chose, not a restart from the feed: left alone
    // (before the fix, the keeper pointed it back at its feed).
    let (dir, port) = (rs.dir.clone(), rs.port);
    drop(rs);
    let rs = Redis::standalone_replica_on(server, &dir, port);
    let repl = rs.info("replication");
    assert_eq!(
        repl.num("second_repl_offset"),
        repl.num("master_repl_offset") + 1,
        "it holds its fed days' history"
    );
    wait_for("the keeper to look at the new process", DEADLINE, || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(replica.status());
        s.instances[0]
            .health_reason
            .contains("did not see restart from its feed")
            .then_some(())
    });
    assert_eq!(rs.info("replication").get("role"), Some("master"));
    assert_eq!(replica.metric(repointed), 1.0);
}

on_both_servers!(
    a_fed_server_restarted_from_its_own_config_is_back_on_its_feed_by_a_partial_resync
);

#[test]
fn a_stream_with_a_snapshot_dir_it_cannot_write_refuses_to_start_and_leaves_the_primary_alone() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let snaps = root.path().join("ro-snaps");
    let Some(_fs) = SmallFs::mount(&snaps, "1m") else {
        return;
    };
    let remounted = std::process::Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&snaps)
        .status()
        .unwrap();
    assert!(remounted.success());
    let path = root.path().join("src.toml");
    std::fs::write(
        &path,
        format!(
            "create_dirs = true\nsnapshot_dir = \"{}\"\nsnapshot_format = \"redis-rdb\"\n[grpc]\nlisten = \"127.0.0.1:0\"\n[data]\ntcp_listen = \"127.0.0.1:0\"\nrdma_port = 0\n[metrics]\nlisten = \"\"\n{}",
            snaps.display(),
            follower_config(&primary, &root.path().join("src-log"))
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(kvsync_bin())
        .args(["agent", "--config", path.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_for("the agent to exit", DEADLINE, || child.try_wait().unwrap());
    let out = child.wait_with_output().unwrap();
    let log =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("a stream that follows a primary saves the primary's RDB there"),
        "{log}"
    );
    assert_eq!(
        primary.info("stats").num("sync_full"),
        0,
        "no fork of the primary"
    );
}

/// A seeding asked right after the agents start, before the primary's
/// agent has started its log: the offer waits for the log to reach the
/// snapshot instead of refusing it ("the log holds nothing"). Here the
/// primary is down when its agent starts (its RDB, saved at shutdown with
/// its replication position, offered meanwhile) and comes back once the
/// offer waits: its agent continues from the RDB's position, and the
/// seeding goes on, in one attempt.
fn a_seeding_asked_before_the_sources_log_started_waits_for_it(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let primary = Redis::start(server, &root.join("p"), &[]);
    primary.make_backlog(root);
    primary.fill("before", 1000, "v");
    let config = follower_config(&primary, &root.join("src-log"));
    let (dir, port) = (primary.dir.clone(), primary.port);
    let _ = primary.try_cmd::<()>(&["SHUTDOWN", "SAVE"]);
    drop(primary);
    let snaps = root.join("src-snaps");
    std::fs::create_dir_all(&snaps).unwrap();
    std::fs::copy(dir.join("dump.rdb"), snaps.join("dump.rdb")).unwrap();
    let seq = kvsync::snapshot::verify_file(&snaps.join("dump.rdb"), None)
        .unwrap()
        .seq;
    let source = agent(root, "src", &snaps, &config, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(source.offered(seq));
    let rs = Redis::standalone_replica(server, &root.join("rs"));
    let replica = agent(
        root,
        "rep",
        &root.join("rep-snaps"),
        &feeding_puller_config(&root.join("rep-log"), &source, &rs),
        &[],
    );
    let id = rt.block_on(start_sync(&replica, &source));
    wait_for("the offer to wait for the log", DEADLINE, || {
        source
            .proc
            .log()
            .contains("waiting for the stream log to reach the snapshot")
            .then_some(())
    });
    // Waiting offers hold no session slot: with as many more asks waiting
    // or refused as the source has slots (16, each ask from another name),
    // a replica's next ask is still answered, not refused as busy (before,
    // each waiting ask held a slot for up to 30 s).
    let ask = |name: String, from_stream_log: bool| {
        let grpc = source.grpc();
        async move {
            kvsync::rpc::pb::peer_client::PeerClient::connect(format!("http://{grpc}"))
                .await
                .unwrap()
                .open_full_sync(kvsync::rpc::pb::OpenFullSyncRequest {
                    replica_node_id: name,
                    format: "redis-rdb".into(),
                    from_stream_log,
                    ..Default::default()
                })
                .await
        }
    };
    let asks: Vec<_> = (0..16)
        .map(|i| rt.spawn(ask(format!("asker-{i}"), true)))
        .collect();
    wait_for("the asks to wait, or be refused", DEADLINE, || {
        let waiting = source
            .proc
            .log()
            .matches("waiting for the stream log to reach the snapshot")
            .count();
        let answered = asks.iter().filter(|a| a.is_finished()).count();
        (waiting + answered > 16).then_some(())
    });
    let next = rt.block_on(ask("next".into(), false));
    let message = next
        .err()
        .map(|e| e.message().to_string())
        .unwrap_or_default();
    assert!(!message.contains("already serves"), "{message}");
    let primary = Redis::start_on(server, &dir, &[], None, port);
    let done = rt.block_on(wait_done(&replica, &id));
    assert_eq!(
        done.phase,
        kvsync::rpc::pb::Phase::Succeeded as i32,
        "{done:?}"
    );
    assert_eq!(done.attempts, 1, "{done:?}");
    converged(&rs, &primary, "the seeded server to follow the primary");
    assert_eq!(primary.info("stats").num("sync_full"), 0, "no fork");
}

on_both_servers!(a_seeding_asked_before_the_sources_log_started_waits_for_it);
