//! Failover told by Redis Sentinel, with real `redis-server` and three
//! `redis-sentinel` processes and agent processes. P is the primary and
//! its agent follows it; A is a replica of P that Sentinel knows (a
//! server Sentinel may promote replicates from the primary itself: it
//! re-points every replica it knows at the primary), and its agent keeps
//! a log that follows P's agent; B is fed through an agent of its own
//! (`redis-stream`), out of Sentinel's sight. Every agent names the
//! Sentinels and the master's name, and follows what they say.
//!
//! A planned `SENTINEL FAILOVER` (P's writes paused, a writer that asks
//! Sentinel where to write): A's agent follows A, P's agent and B's follow
//! A's agent, P's agent re-attaches P as A's replica; no server takes a
//! full sync, the writer goes on at A, `WAIT` on A counts its replicas, B
//! converges with A. P killed under writes: Sentinel promotes A, what the
//! logs hold past the promotion point is counted as divergence (B is
//! re-seeded only then), B converges with A, and P, restarted, is made A's
//! replica by Sentinel.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::kv::*;
use common::node::*;
use common::stream::*;
use common::*;

const MASTER: &str = "kvmaster";

/// Three Sentinels watching `primary` as [`MASTER`] (quorum 2), quick to
/// call it down (1 s).
fn sentinels(root: &Path, primary: &Redis) -> Vec<Redis> {
    (0..3)
        .map(|i| {
            let dir = root.join(format!("sentinel-{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            let port = free_port();
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nlogfile {}\nsentinel monitor {MASTER} 127.0.0.1 {} 2\nsentinel down-after-milliseconds {MASTER} 1000\nsentinel failover-timeout {MASTER} 20000\n",
                    dir.display(),
                    dir.join("sentinel.log").display(),
                    primary.port
                ),
            )
            .unwrap();
            let child = std::process::Command::new("redis-sentinel")
                .arg(&conf)
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("redis-sentinel (the test command installs it)");
            let s = Redis {
                server: Server::Redis,
                port,
                dir,
                child: Some(child),
                password: None,
            };
            s.wait_up();
            s
        })
        .collect()
}

/// A Sentinel's field-value answer as pairs.
fn fields(flat: &[String]) -> std::collections::HashMap<String, String> {
    flat.chunks_exact(2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect()
}

/// Waits until every Sentinel knows the other two and `replica` as a
/// healthy replica it could promote.
fn sentinels_ready(sentinels: &[Redis], replica: &Redis) {
    wait_for(
        "the Sentinels to know each other and A",
        DEADLINE * 2,
        || {
            sentinels
                .iter()
                .all(|s| {
                    let master = fields(&s.cmd::<Vec<String>>(&["SENTINEL", "MASTER", MASTER]));
                    let replicas: Vec<Vec<String>> = s.cmd(&["SENTINEL", "REPLICAS", MASTER]);
                    master["num-other-sentinels"] == "2"
                        && replicas.iter().map(|r| fields(r)).any(|r| {
                            r["port"] == replica.port.to_string()
                                && r["flags"] == "slave"
                                && r["master-link-status"] == "ok"
                        })
                })
                .then_some(())
        },
    );
}

/// Where `sentinel` says the master is.
fn master_of(sentinel: &Redis) -> String {
    let at: Vec<String> = sentinel.cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER]);
    format!("{}:{}", at[0], at[1])
}

/// `[stream]` lines of an agent that follows the Sentinels, its peers
/// `peers`.
fn sentinel_lines(sentinels: &[Redis], peers: &[String]) -> String {
    let list = |v: Vec<String>| {
        v.iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "sentinels = [{}]\nmaster_name = \"{MASTER}\"\npeers = [{}]\n",
        list(sentinels.iter().map(|s| s.addr()).collect()),
        list(peers.to_vec())
    )
}

/// A writer that asks `sentinel` where the master is and sets `w:<n>`
/// there, 20 a batch, asking again after any failure, until `stop`; the
/// thread returns how many it set (a batch that failed is set again).
fn writer_through_sentinel(
    sentinel: String,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let ask = || -> redis::RedisResult<redis::Connection> {
            let mut s = redis::Client::open(format!("redis://{sentinel}/"))?.get_connection()?;
            let at: Vec<String> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER)
                .query(&mut s)?;
            redis::Client::open(format!("redis://{}:{}/", at[0], at[1]))?.get_connection()
        };
        let mut con = None;
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let Some(c) = con.as_mut() else {
                con = ask().ok();
                // The writer's pace while the master cannot be reached.
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            };
            let mut p = redis::pipe();
            for i in n..n + 20 {
                p.cmd("SET")
                    .arg(format!("w:{i}"))
                    .arg(format!("v{i}"))
                    .ignore();
            }
            match p.query::<()>(c) {
                Ok(()) => n += 20,
                Err(_) => con = None,
            }
            // The writer's pace, not a wait for a state.
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        n
    })
}

/// The replication id a server's history runs under now.
fn replid(server: &Redis) -> String {
    server
        .info("replication")
        .get("master_replid")
        .unwrap()
        .to_string()
}

/// How many times `agent`'s feed sent its server a whole RDB.
fn full_feeds(agent: &Node) -> usize {
    agent.proc.log().matches("sent its server the RDB").count()
}

/// Bytes instance `default`'s log of `agent` counted as lost to a failover.
fn diverged(agent: &Node) -> f64 {
    agent.metric("kvsync_stream_diverged_bytes_total{kv_instance=\"default\"}")
}

/// The cast: P with its agent (`src`), A a replica of P with its agent,
/// B fed through its agent, three Sentinels that know P, A and each other.
struct Cast {
    p: Redis,
    src: Node,
    a: Redis,
    agent_a: Node,
    b: Redis,
    agent_b: Node,
    sentinels: Vec<Redis>,
}

impl Cast {
    /// Waits until A's agent follows A and the others follow A's agent.
    fn all_follow_a(&self) {
        wait_for("the agents to follow A's history", DEADLINE * 2, || {
            let a_follows =
                stream_status(&self.agent_a).source == format!("primary {}", self.a.addr());
            let others = [&self.src, &self.agent_b]
                .iter()
                .all(|n| stream_status(n).source == format!("agent {}", self.agent_a.grpc()));
            (a_follows && others).then_some(())
        });
    }
}

/// Waits until `server` replicates from `primary` with its link up.
fn replicates_from(server: &Redis, primary: &Redis, what: &str) {
    wait_for(what, DEADLINE * 2, || {
        let info = server.info("replication");
        (info.get("role") == Some("slave")
            && info.num("master_port") == primary.port as u64
            && info.get("master_link_status") == Some("up"))
        .then_some(())
    });
}

fn cast(root: &Path, b_stream: &str) -> Cast {
    let server = Server::Redis;
    let p = Redis::start(
        server,
        &root.join("p"),
        &["--repl-ping-replica-period", "3600"],
    );
    let sentinels = sentinels(root, &p);
    // Both agents name each other: their addresses are chosen first.
    let (src_port, a_port) = (free_port(), free_port());
    let (src_addr, a_addr) = (
        format!("127.0.0.1:{src_port}"),
        format!("127.0.0.1:{a_port}"),
    );
    // P's agent knows P as localhost, the Sentinels by its address: the
    // same server.
    let src_config = follower_config(&p, &root.join("src-log"))
        .replace(&p.addr(), &format!("localhost:{}", p.port))
        .replace(
            "[stream]\n",
            &format!(
                "[stream]\n{}",
                sentinel_lines(&sentinels, std::slice::from_ref(&a_addr))
            ),
        );
    let src = agent_at(
        root,
        "src",
        &root.join("src-snaps"),
        &src_config,
        "127.0.0.1",
        src_port,
    );
    wait_following(&src);
    let pport = p.port.to_string();
    let a = Redis::start(
        server,
        &root.join("a"),
        &["--replicaof", "127.0.0.1", &pport],
    );
    let a_config = format!(
        "[stream]\ndir = \"{}\"\nupstream = \"{src_addr}\"\n{}[handoff]\nmode = \"redis-replicate\"\n[redis]\nserver_addr = \"{}\"\nprimary = \"{}\"\n",
        root.join("a-log").display(),
        sentinel_lines(&sentinels, std::slice::from_ref(&src_addr)),
        a.addr(),
        p.addr()
    );
    let agent_a = agent_at(
        root,
        "a",
        &root.join("a-snaps"),
        &a_config,
        "127.0.0.1",
        a_port,
    );
    wait_following(&agent_a);
    let b_stream = format!(
        "{}{b_stream}",
        sentinel_lines(&sentinels, &[src_addr.clone(), a_addr.clone()])
    );
    let (b, agent_b) = seeded_replica(root, server, &p, &src, ("b", "b-srv", &b_stream));
    converged(&a, &p, "A to have what P wrote");
    sentinels_ready(&sentinels, &a);
    Cast {
        p,
        src,
        a,
        agent_a,
        b,
        agent_b,
        sentinels,
    }
}

#[test]
fn a_sentinel_failover_moves_every_agent_to_the_promoted_server_without_a_full_sync() {
    let root = tempfile::tempdir().unwrap();
    let c = cast(root.path(), "");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = writer_through_sentinel(c.sentinels[0].addr(), stop.clone());
    wait_for("the writer to write at P", DEADLINE, || {
        (c.b.cmd::<i64>(&["DBSIZE"]) > 2000).then_some(())
    });
    let full = |r: &Redis| r.info("stats").num("sync_full");
    let (p_full, a_full) = (full(&c.p), full(&c.a));
    let old_id = replid(&c.p);

    // Planned: P's writes paused until A has everything P wrote, then
    // Sentinel is asked to fail over.
    let paused: String = c.p.cmd(&["CLIENT", "PAUSE", "120000", "WRITE"]);
    assert_eq!(paused, "OK");
    converged(&c.a, &c.p, "A to catch up with the paused primary");
    let done: String = c.sentinels[1].cmd(&["SENTINEL", "FAILOVER", MASTER]);
    assert_eq!(done, "OK");

    // Every agent follows Sentinel's word on its own.
    c.all_follow_a();
    replicates_from(&c.p, &c.a, "P to replicate from A");
    assert!(
        c.src.proc.log().contains(&format!(
            "the old primary localhost:{} replicates from {}",
            c.p.port,
            c.a.addr()
        )),
        "P's agent re-attached P"
    );
    let _: String = c.p.cmd(&["CLIENT", "UNPAUSE"]);
    for s in &c.sentinels {
        wait_for("every Sentinel to name A", DEADLINE, || {
            (master_of(s) == c.a.addr()).then_some(())
        });
    }

    // The writer goes on at A; WAIT there counts P and A's agent.
    let new_id = replid(&c.a);
    assert_ne!(new_id, old_id);
    wait_for("the writer to write at A", DEADLINE, || {
        (c.a.info("replication").num("master_repl_offset")
            > c.a.info("replication").num("second_repl_offset") + 10_000)
            .then_some(())
    });
    let mut con = c.a.con();
    redis::cmd("SET")
        .arg("probe")
        .arg("w")
        .query::<()>(&mut con)
        .unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(2)
        .arg(10_000)
        .query(&mut con)
        .unwrap();
    assert_eq!(acked, 2, "P and A's agent acknowledge A's writes");
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    converged(&c.b, &c.a, "B to converge with the new primary");
    converged(&c.p, &c.a, "P to converge with the new primary");
    for i in (0..written).step_by(written / 50) {
        let key = format!("w:{i}");
        let get = |r: &Redis| r.cmd::<Option<String>>(&["GET", &key]);
        assert_eq!(get(&c.b), Some(format!("v{i}")), "{key}");
        assert_eq!(get(&c.b), get(&c.a), "{key}");
    }

    // No full sync anywhere: A continued P and its agent, B its feed.
    assert_eq!(full(&c.a), a_full, "A served no full sync");
    assert_eq!(full(&c.p), p_full, "P served none either");
    assert_eq!(
        full_feeds(&c.agent_b),
        1,
        "B's only full sync is its seeding"
    );
    for agent in [&c.agent_a, &c.agent_b, &c.src] {
        let st = stream_status(agent);
        assert_eq!(st.replid, new_id);
        assert_eq!(st.diverged, "", "nothing was lost");
        assert_eq!(diverged(agent), 0.0);
    }
}

#[test]
fn a_primary_killed_under_writes_is_failed_over_by_sentinel_and_nothing_lost_is_merged() {
    let root = tempfile::tempdir().unwrap();
    let mut c = cast(root.path(), "reseed = true\n");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = writer_through_sentinel(c.sentinels[0].addr(), stop.clone());
    wait_for("the writer to write at P", DEADLINE, || {
        (c.b.cmd::<i64>(&["DBSIZE"]) > 2000).then_some(())
    });
    c.p.child.as_mut().unwrap().kill().unwrap();
    c.p.child.as_mut().unwrap().wait().unwrap();

    // Sentinel promotes A; every agent follows A's history, and a log that
    // holds writes past the promotion point counts them.
    c.all_follow_a();
    let new_id = replid(&c.a);
    for agent in [&c.agent_a, &c.agent_b, &c.src] {
        wait_for("each log on A's history", DEADLINE, || {
            let st = stream_status(agent);
            (st.replid == new_id || !st.diverged.is_empty()).then_some(())
        });
    }
    assert!(
        c.src.proc.log().contains("could not be re-attached"),
        "P was down when its agent moved"
    );
    // P restarted, empty: Sentinel makes it A's replica, a full sync.
    let (p_port, p_dir) = (c.p.port, c.p.dir.clone());
    drop(c.p);
    let p = Redis::start_on(Server::Redis, &p_dir, &[], None, p_port);
    replicates_from(&p, &c.a, "Sentinel to make P a replica of A");
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    converged(&c.b, &c.a, "B to converge with A");
    converged(&p, &c.a, "P to converge with A");

    // What each log held past the promotion point was counted, and B was
    // re-seeded exactly when its log had gone past it.
    let b_lost = diverged(&c.agent_b);
    assert_eq!(
        full_feeds(&c.agent_b),
        if b_lost > 0.0 { 2 } else { 1 },
        "B is re-seeded only when it held lost writes ({b_lost} bytes)"
    );
    for agent in [&c.agent_a, &c.agent_b, &c.src] {
        let st = stream_status(agent);
        if diverged(agent) > 0.0 {
            assert!(st.diverged.contains("bytes"), "{}", st.diverged);
        }
    }
    assert_eq!(stream_status(&c.agent_b).replid, new_id);
}
