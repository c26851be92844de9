//! Failover with the replication stream, with real `redis-server` and
//! `valkey-server` processes and agent processes: a primary P whose agent
//! follows it, and two servers A and B fed through agents of their own.
//! A planned failover (P's writes paused, A promoted, every agent told
//! with `kvsync stream follow`) moves A's agent onto A and the other
//! agents onto A's agent, each continuing from its log's end: no server
//! and no agent takes a full sync, `WAIT` on A counts its agent, B
//! converges with A; an RDB saved after it carries A's id, and a server
//! seeded from it is fed on from the log. Before that, a promotion that
//! has not happened and a peer that does not follow the new primary yet
//! are refused with nothing changed. An unplanned one (A promoted while P
//! writes, then P killed) leaves logs that hold writes past the promotion
//! point: A's agent drops them from its log, B's agent and P's agent are
//! refused by A's agent; each counts the bytes and says so in status, and
//! B's server is re-seeded from A's agent (`reseed`), never merged;
//! pointed at P's stale agent, B's agent takes nothing from it, until P's
//! agent, told of the failover, starts its log over (`reseed`) on A's
//! history, from which B's agent then continues. When A's agent holds no
//! snapshot (A replicated from P directly), it takes one of A for B.

mod common;

use common::kv::*;
use common::node::*;
use common::stream::*;
use common::*;

/// `kvsync stream follow` of `agent` to `primary`, looking among `peers`.
fn follow(agent: &Node, primary: &Redis, peers: &[&Node]) -> (bool, String, String) {
    let (agent, primary) = (agent.grpc(), primary.addr());
    let peers: Vec<String> = peers.iter().map(|p| p.grpc()).collect();
    let mut args = vec!["stream", "follow", "--agent", &agent, "--primary", &primary];
    for p in &peers {
        args.extend(["--peer", p.as_str()]);
    }
    cli(&args)
}

/// The `[stream] servers` line naming the server on `port`.
fn servers(port: u16) -> String {
    format!("servers = [\"127.0.0.1:{port}\"]\n")
}

/// The replication id a server's history runs under now.
fn replid(server: &Redis) -> String {
    let info = server.info("replication");
    info.get("master_replid").unwrap().to_string()
}

/// The snapshots `agent` offers of its only instance.
fn snapshots(agent: &Node) -> Vec<kvsync::rpc::pb::SnapshotEntry> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(agent.status());
    s.instances[0].latest_snapshots.clone()
}

/// How many times `agent`'s feed sent its server a whole RDB.
fn full_feeds(agent: &Node) -> usize {
    agent.proc.log().matches("sent its server the RDB").count()
}

/// Waits until `agent`'s log runs under `id` and ends at `server`'s offset.
fn logged_from(agent: &Node, server: &Redis, id: &str, what: &str) {
    wait_for(what, DEADLINE, || {
        let end = server.info("replication").num("master_repl_offset");
        let st = stream_status(agent);
        (st.replid == id && st.end_offset == end && st.state.starts_with("following")).then_some(())
    });
}

fn a_planned_failover_moves_every_agent_to_the_promoted_server_without_a_full_resync(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    // No pings of its own while it is paused: its offset stands still.
    let p = Redis::start(
        server,
        &r.join("p"),
        &["--repl-ping-replica-period", "3600"],
    );
    // Its agent offers the RDBs it saves, as on a primary's host, and
    // knows A as one of the instance's servers: the only new primary it
    // points P at.
    let a_port = free_port();
    let config = follower_config(&p, &r.join("src-log")) + &servers(a_port);
    let src = agent(r, "src", &r.join("p"), &config, &[]);
    wait_following(&src);
    let (a, agent_a) = seeded_replica_on(r, server, &p, &src, ("a", "a-srv", ""), a_port);
    let (b, agent_b) = seeded_replica(r, server, &p, &src, ("b", "b-srv", ""));
    steady_writer(p.con(), 3, 0).join().unwrap();

    // Planned, as Redis's own FAILOVER does it: the primary's writes are
    // paused until the servers have everything it wrote.
    let paused: String = p.cmd(&["CLIENT", "PAUSE", "120000", "WRITE"]);
    assert_eq!(paused, "OK");
    converged(&a, &p, "A to catch up with the paused primary");
    converged(&b, &p, "B to catch up with the paused primary");
    let old_id = replid(&p);

    // Refused, with nothing changed: A is no primary yet, and no peer
    // follows it yet.
    let (ok, _, err) = follow(&agent_a, &a, &[]);
    assert!(!ok && err.contains("still a replica"), "{err}");
    let (ok, _, err) = follow(&agent_b, &a, &[&agent_a, &src]);
    assert!(!ok && err.contains("no agent follows the primary"), "{err}");
    assert!(
        err.contains(&format!("follows agent {}", src.grpc())),
        "{err}"
    );
    assert_eq!(
        stream_status(&agent_b).source,
        format!("agent {}", src.grpc())
    );

    // A promoted; its agent follows it, then the others follow that agent.
    let promoted: String = a.cmd(&["REPLICAOF", "NO", "ONE"]);
    assert_eq!(promoted, "OK");
    let new_id = replid(&a);
    assert_ne!(new_id, old_id);
    let (ok, out, err) = follow(&agent_a, &a, &[]);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("primary {}", a.addr())), "{out}");
    let (ok, out, err) = follow(&agent_b, &a, &[&src, &agent_a]);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("agent {}", agent_a.grpc())), "{out}");
    let (ok, _, err) = follow(&src, &a, &[&agent_a]);
    assert!(ok, "the old primary's agent follows the new one too: {err}");

    // The new primary takes writes, and WAIT counts its agent.
    let writer = steady_writer(a.con(), 4, 0);
    let mut con = a.con();
    while !writer.is_finished() {
        assert_eq!(write_and_wait(&mut con, "probe", 10_000), 1);
    }
    let written = writer.join().unwrap();
    converged(&b, &a, "B to converge with the new primary");
    same_sample(&b, &a, written);
    logged_from(&agent_a, &a, &new_id, "A's agent to log A's stream");
    logged_from(&agent_b, &a, &new_id, "B's agent to follow A's agent");
    logged_from(
        &src,
        &a,
        &new_id,
        "the old primary's agent to follow A's agent",
    );
    let st = stream_status(&agent_a);
    assert_eq!(st.source, format!("primary {}", a.addr()));
    assert_eq!(st.ack, "log", "it acknowledges to its primary now");
    assert_eq!(
        stream_status(&src).source,
        format!("agent {}", agent_a.grpc())
    );

    // Nothing was synced in full: A continued its agent, B its feed.
    let stats = a.info("stats");
    assert_eq!(stats.num("sync_full"), 0, "A served no full sync");
    assert!(stats.num("sync_partial_ok") >= 1, "its agent continued");
    assert_eq!(full_feeds(&agent_b), 1, "B's only full sync is its seeding");
    assert_eq!(
        p.info("stats").num("sync_full"),
        1,
        "only its agent's first"
    );
    for agent in [&agent_a, &agent_b, &src] {
        assert_eq!(stream_status(agent).diverged, "", "nothing was lost");
        assert_eq!(
            agent.metric("kvsync_stream_diverged_bytes_total{kv_instance=\"default\"}"),
            0.0
        );
    }
    let _: String = p.cmd(&["CLIENT", "UNPAUSE"]);

    // A snapshot saved after the promotion carries the new id: P, A's
    // replica now, saves one where its agent offers snapshots, and a new
    // server C seeded from it is fed on from that agent's log, which
    // continues it under the new id. A serves no full sync.
    converged(&p, &a, "the re-attached P to catch up with A");
    let _: String = p.cmd(&["BGSAVE"]);
    wait_for("P's RDB offered by its agent", DEADLINE, || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(src.status());
        let newest = s.instances[0].latest_snapshots.first()?;
        newest.path.ends_with("dump.rdb").then_some(())
    });
    let info = kvsync::snapshot::verify_file(&r.join("p/dump.rdb"), None).unwrap();
    assert_eq!(info.repl_id.as_deref(), Some(new_id.as_str()));
    let (c, agent_c) = seeded_replica(r, server, &a, &src, ("c", "c-srv", ""));
    let written = steady_writer(a.con(), 1, 0).join().unwrap();
    converged(&c, &a, "C to follow the new primary");
    same_sample(&c, &a, written);
    assert_eq!(full_feeds(&agent_c), 1, "C's only full sync is its seeding");
    assert_eq!(a.info("stats").num("sync_full"), 0, "A served none");
}

on_both_servers!(a_planned_failover_moves_every_agent_to_the_promoted_server_without_a_full_resync);

/// Sets keys on `server` until it fails (it was killed) or `stop`; the
/// thread returns how many it set.
fn writer_until_killed(
    mut con: redis::Connection,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let set: redis::RedisResult<()> = redis::cmd("SET")
                .arg(format!("k:{n}"))
                .arg("v")
                .query(&mut con);
            if set.is_err() {
                break;
            }
            n += 1;
        }
        n
    })
}

/// Promotes `a` (`REPLICAOF NO ONE`) while a writer goes on at `p`, until
/// the logs of `agents` hold 1000 bytes past the promotion point: that
/// point, and how many keys the writer set (`k:<n>`).
fn promoted_under_writes(p: &Redis, a: &Redis, agents: &[&Node]) -> (u64, usize) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = writer_until_killed(p.con(), stop.clone());
    // A still loading its first full sync answers LOADING: not yet.
    wait_for("some writes to reach A", DEADLINE, || {
        (a.try_cmd::<i64>(&["DBSIZE"]).ok()? > 1000).then_some(())
    });
    let _: String = a.cmd(&["REPLICAOF", "NO", "ONE"]);
    let at = a.info("replication").num("second_repl_offset") - 1;
    for agent in agents {
        wait_for(
            "the agents' logs to pass the promotion point",
            DEADLINE,
            || (stream_status(agent).end_offset > at + 1000).then_some(()),
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    (at, writer.join().unwrap())
}

#[test]
fn writes_lost_to_a_failover_are_counted_as_divergence_and_their_server_re_seeded() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let server = Server::Redis;
    let mut p = Redis::start(server, &r.join("p"), &[]);
    let a_port = free_port();
    let config = follower_config(&p, &r.join("src-log")) + "reseed = true\n" + &servers(a_port);
    let src = source_with(r, &config, &[]);
    let (a, agent_a) = seeded_replica_on(r, server, &p, &src, ("a", "a-srv", ""), a_port);
    let (b, agent_b) = seeded_replica(r, server, &p, &src, ("b", "b-srv", "reseed = true\n"));

    // A promoted while P goes on writing: what P takes from then on is
    // lost to the failover, though the agents' logs still get it.
    let (at, written) = promoted_under_writes(&p, &a, &[&agent_a, &agent_b, &src]);
    p.child.as_mut().unwrap().kill().unwrap();
    p.child.as_mut().unwrap().wait().unwrap();
    // P's last bytes reach every log: all that P sent is in its agent's
    // once that agent's session has ended.
    let end = wait_for("P's agent to lose P", DEADLINE, || {
        let st = stream_status(&src);
        st.state
            .starts_with("reconnecting")
            .then_some(st.end_offset)
    });
    for agent in [&agent_a, &agent_b] {
        wait_for("the logs to end where P's does", DEADLINE, || {
            (stream_status(agent).end_offset == end).then_some(())
        });
    }
    let lost = (end - at) as f64;
    let diverged =
        |agent: &Node| agent.metric("kvsync_stream_diverged_bytes_total{kv_instance=\"default\"}");

    // A's agent drops what A never had, counts it and says so.
    let (ok, _, err) = follow(&agent_a, &a, &[]);
    assert!(ok, "{err}");
    let new_id = replid(&a);
    logged_from(&agent_a, &a, &new_id, "A's agent to follow A");
    assert_eq!(diverged(&agent_a), lost);
    let said = stream_status(&agent_a).diverged;
    assert!(
        said.contains(&format!("{} bytes", end - at)) && said.contains(&a.addr()),
        "{said}"
    );

    // B's agent is refused by A's agent, from where its log stands; it
    // counts it, and B's server is re-seeded from A's agent.
    let (ok, _, err) = follow(&agent_b, &a, &[&agent_a]);
    assert!(ok, "{err}");
    wait_for("B's agent to count what diverged", DEADLINE, || {
        (diverged(&agent_b) == lost).then_some(())
    });
    a.fill("after", 500, "new-primary");
    converged(&b, &a, "B re-seeded from A's agent to converge with A");
    let value: String = b.cmd(&["GET", "after:499"]);
    assert_eq!(value, "new-primary");
    assert_eq!(full_feeds(&agent_b), 2, "the seeding, then the re-seeding");
    assert!(agent_b.proc.log().contains("re-seeding"));
    assert_eq!(a.info("stats").num("sync_full"), 0, "A served no full sync");

    // P's agent, not told yet, is stale: it still holds P's history past
    // the promotion. B's agent, pointed at it, takes nothing from it (not
    // even its snapshot, which would bring the lost writes back).
    let (ok, _, err) = cli(&[
        "stream",
        "upstream",
        "--agent",
        &agent_b.grpc(),
        "--upstream",
        &src.grpc(),
    ]);
    assert!(ok, "{err}");
    let stale = "kvsync_stream_refused_total{kv_instance=\"default\",reason=\"stale_upstream\"}";
    wait_for(
        "B's agent to refuse the stale upstream twice",
        DEADLINE,
        || (agent_b.metric(stale) >= 2.0).then_some(()),
    );
    assert_eq!(full_feeds(&agent_b), 2, "no re-seeding from the stale one");
    assert_eq!(stream_status(&agent_b).replid, new_id);
    assert_eq!(b.cmd::<i64>(&["DBSIZE"]), a.cmd::<i64>(&["DBSIZE"]));

    // Told, P's agent is refused by A's agent too and counts it; with
    // reseed its log starts over at A's agent's snapshot and follows the
    // new history, and B's agent continues from it without a re-seeding.
    let (ok, _, err) = follow(&src, &a, &[&agent_a]);
    assert!(ok, "{err}");
    wait_for("P's agent to count what diverged", DEADLINE, || {
        (diverged(&src) == lost).then_some(())
    });
    let said = stream_status(&src).diverged;
    assert!(
        said.contains("started from the upstream's snapshot"),
        "{said}"
    );
    logged_from(&src, &a, &new_id, "P's agent to start over on A's history");
    a.fill("later", 500, "via-p-agent");
    converged(&b, &a, "B to go on from P's re-seeded agent");
    assert_eq!(full_feeds(&agent_b), 2, "B continued, no re-seeding");
    assert_eq!(
        stream_status(&agent_b).source,
        format!("agent {}", src.grpc())
    );
    assert_eq!(
        b.cmd::<Option<String>>(&["GET", &format!("k:{}", written - 1)]),
        None
    );
}

/// A promoted server whose agent holds no snapshot (A replicated from P
/// directly; its agent's log followed P's agent and went on by `PSYNC`):
/// B's log, which went past the promotion point, is refused by A's agent
/// all the same, which then takes one snapshot of A for it, and B is
/// re-seeded from that (`reseed`) and converges with A without the lost
/// writes.
#[test]
fn a_promoted_servers_agent_without_a_snapshot_takes_one_for_a_replica_to_re_seed() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let server = Server::Redis;
    let p = Redis::start(server, &r.join("p"), &[]);
    let src = following_source(r, &p, &[]);
    let port = p.port.to_string();
    let a = Redis::start(server, &r.join("a"), &["--replicaof", "127.0.0.1", &port]);
    let config = puller_config(&src, &r.join("a-log"))
        + &format!(
            "[handoff]\nmode = \"redis-replicate\"\n[redis]\nserver_addr = \"{}\"\nprimary = \"{}\"\n",
            a.addr(),
            p.addr()
        );
    let agent_a = agent(r, "a", &r.join("a-snaps"), &config, &[]);
    wait_following(&agent_a);
    let (b, agent_b) = seeded_replica(r, server, &p, &src, ("b", "b-srv", "reseed = true\n"));

    // A promoted while P goes on writing; B's log gets past the point.
    let (_, written) = promoted_under_writes(&p, &a, &[&agent_b]);
    let (ok, _, err) = follow(&agent_a, &a, &[]);
    assert!(ok, "{err}");
    assert!(
        snapshots(&agent_a).is_empty(),
        "A's agent holds no snapshot"
    );
    let (ok, _, err) = follow(&agent_b, &a, &[&agent_a]);
    assert!(ok, "{err}");

    a.fill("after", 500, "new-primary");
    converged(&b, &a, "B re-seeded from A's snapshot to converge with A");
    let value: String = b.cmd(&["GET", "after:499"]);
    assert_eq!(value, "new-primary");
    assert_eq!(
        b.cmd::<Option<String>>(&["GET", &format!("k:{}", written - 1)]),
        None,
        "a write lost to the failover"
    );
    assert_eq!(full_feeds(&agent_b), 2, "the seeding, then the re-seeding");
    // The agent logs and counts the snapshot once it is in place, which
    // is also when B may already take it: wait for the log, not race it.
    wait_for("A's agent to log the snapshot it took", DEADLINE, || {
        agent_a
            .proc
            .log()
            .contains("the primary's RDB is offered")
            .then_some(())
    });
    assert_eq!(snapshots(&agent_a).len(), 1);
    assert_eq!(a.info("stats").num("sync_full"), 1, "one snapshot of A");
    let taken = "kvsync_stream_snapshots_taken_total{kv_instance=\"default\"}";
    assert_eq!(agent_a.metric(taken), 1.0);
}
