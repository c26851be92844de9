//! Failover told by Sentinel, with real servers and three Sentinels of
//! their family (`redis-server` and `redis-sentinel`; `valkey-server`,
//! also as its Sentinel) and agent processes; the partition runs on
//! Redis. P is the primary and its agent follows it; A is a replica of P
//! that Sentinel knows (a server Sentinel may promote replicates from the
//! primary itself: it re-points every replica it knows at the primary),
//! and its agent keeps a log that follows P's agent; B is fed through an agent of its own
//! (`redis-stream`), out of Sentinel's sight. Every agent names the
//! Sentinels and the master's name, and follows what they say.
//!
//! A planned `SENTINEL FAILOVER` (P's writes paused, a writer that asks
//! Sentinel where to write): A's agent follows A, P's agent and B's follow
//! A's agent, P's agent re-attaches P as A's replica; no server takes a
//! full sync, the writer goes on at A, `WAIT` on A counts its replicas, B
//! converges with A; and back to P the same way, A's agent re-attaching A
//! while it is still paused (Sentinel cannot), no full sync. P killed
//! under writes: Sentinel promotes A, what the
//! logs hold past the promotion point is counted as divergence (B is
//! re-seeded only then), B converges with A, and P, restarted, is made A's
//! replica by Sentinel. P's host cut off by a partition (network
//! namespaces) while P takes writes: B never gets a byte of P's side, and
//! once the partition heals P's agent makes P A's replica and counts what
//! its log held past the promotion point.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::kv::*;
use common::node::*;
use common::sentinel::*;
use common::stream::*;
use common::*;

/// Three Sentinels watching `primary` as [`MASTER`] (quorum 2), quick to
/// call it down (1 s).
fn sentinels(root: &Path, primary: &Redis) -> Vec<Redis> {
    (0..3)
        .map(|i| {
            sentinel(
                primary.server,
                &root.join(format!("sentinel-{i}")),
                "127.0.0.1",
                &primary.addr(),
            )
        })
        .collect()
}

/// A Sentinel of `server`'s family in `dir`, listening on 127.0.0.1 and
/// `ip`, watching the primary at `primary` as [`MASTER`] with two others
/// (quorum 2), quick to call it down (1 s).
fn sentinel(server: Server, dir: &Path, ip: &str, primary: &str) -> Redis {
    start_sentinel(server, dir, (ip, primary), Duration::from_secs(1))
}

/// Waits until every Sentinel knows the other two and `replica` as a
/// healthy replica it could promote.
fn sentinels_ready(sentinels: &[Redis], replica: &Redis) {
    wait_for(
        "the Sentinels to know each other and the replica",
        DEADLINE * 2,
        || {
            sentinels
                .iter()
                .all(|s| sentinel_ready(s, replica.port))
                .then_some(())
        },
    );
}

/// A writer that asks `sentinel` where the master is and sets `w:<n>`
/// there, 20 a batch, asking again after any failure, until `stop`; the
/// thread returns how many it set (a batch that failed is set again).
fn writer_through_sentinel(
    sentinel: String,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut con = None;
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let Some(c) = con.as_mut() else {
                con = master_con(&sentinel).ok();
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

/// How many replicas acknowledge a write to `master` (`WAIT 2`).
fn acked(master: &Redis) -> i64 {
    let mut con = master.con();
    redis::cmd("SET")
        .arg("probe")
        .arg("w")
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("WAIT")
        .arg(2)
        .arg(10_000)
        .query(&mut con)
        .unwrap()
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

fn cast(server: Server, root: &Path, b_stream: &str) -> Cast {
    let p = Redis::start(
        server,
        &root.join("p"),
        &["--repl-ping-replica-period", "3600"],
    );
    let sentinels = sentinels(root, &p);
    let addrs: Vec<String> = sentinels.iter().map(|s| s.addr()).collect();
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
                sentinel_lines(&addrs, std::slice::from_ref(&a_addr))
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
        sentinel_lines(&addrs, std::slice::from_ref(&src_addr)),
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
        sentinel_lines(&addrs, &[src_addr.clone(), a_addr.clone()])
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

fn planned_sentinel_failovers_there_and_back_move_every_agent_without_a_full_sync(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let c = cast(server, root.path(), "");
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
    fail_over(&c.sentinels[1]);

    // Every agent follows Sentinel's word on its own.
    c.all_follow_a();
    replicates_from(&c.p, c.a.port, "P to replicate from A");
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
    assert_eq!(acked(&c.a), 2, "P and A's agent acknowledge A's writes");
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

    // And back to P, planned the same way (A's pings held too: a pause
    // does not hold them), once the Sentinels are done with the first
    // failover: a paused master holds their hellos (`PUBLISH`) and every
    // command behind them, so that it looks down to them within their
    // `down-after-milliseconds`. Sentinel cannot convert A while it is
    // paused either (its REPLICAOF comes in a transaction the pause
    // holds): A's agent, whose log followed A as the primary, re-attaches
    // it.
    sentinels_ready(&c.sentinels, &c.p);
    let _: String =
        c.a.cmd(&["CONFIG", "SET", "repl-ping-replica-period", "3600"]);
    let paused: String = c.a.cmd(&["CLIENT", "PAUSE", "120000", "WRITE"]);
    assert_eq!(paused, "OK");
    converged(&c.p, &c.a, "P to catch up with the paused A");
    fail_over(&c.sentinels[2]);
    wait_for(
        "the agents to follow P's history again",
        DEADLINE * 2,
        || {
            let p_follows = stream_status(&c.src).source == format!("primary {}", c.p.addr());
            let others = [&c.agent_a, &c.agent_b]
                .iter()
                .all(|n| stream_status(n).source == format!("agent {}", c.src.grpc()));
            (p_follows && others).then_some(())
        },
    );
    replicates_from(&c.a, c.p.port, "A, still paused, to replicate from P");
    assert!(
        c.agent_a.proc.log().contains(&format!(
            "the old primary {} replicates from {}",
            c.a.addr(),
            c.p.addr()
        )),
        "A's agent re-attached A"
    );
    let _: String = c.a.cmd(&["CLIENT", "UNPAUSE"]);
    assert_eq!(acked(&c.p), 2, "A and P's agent acknowledge P's writes");
    converged(&c.b, &c.p, "B to converge with P");
    assert_eq!(full(&c.a), a_full, "A served no full sync");
    assert_eq!(full(&c.p), p_full, "P served none either");
    assert_eq!(full_feeds(&c.agent_b), 1, "B was not seeded again");
    for agent in [&c.agent_a, &c.agent_b, &c.src] {
        assert_eq!(stream_status(agent).diverged, "", "nothing was lost");
        assert_eq!(diverged(agent), 0.0);
    }
}

fn a_primary_killed_under_writes_is_failed_over_by_sentinel_and_nothing_lost_is_merged(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let mut c = cast(server, root.path(), "reseed = true\n");
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
    let p = Redis::start_on(server, &p_dir, &[], None, p_port);
    replicates_from(&p, c.a.port, "Sentinel to make P a replica of A");
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

on_both_servers!(
    planned_sentinel_failovers_there_and_back_move_every_agent_without_a_full_sync,
    a_primary_killed_under_writes_is_failed_over_by_sentinel_and_nothing_lost_is_merged,
);

/// A Sentinel with its `default` user off: the agent logs in as the ACL
/// user `kvsync` with the rights docs/REDIS.md gives it, its password (with `:`, `@` and `/` in it) kept in
/// `sentinel_password_file`. While the file holds another password the
/// Sentinel refuses the agent, and the agent's log says as whom it tried
/// to log in and where the password came from; once
/// the file holds the right one, the agent subscribes without a restart.
/// No log holds either password.
/// A Sentinel failover where every link is TLS: the servers on TLS ports
/// asking for client certificates and replicating over TLS, three
/// Sentinels that reach them and each other over TLS, the agents that
/// reach both over TLS (`[redis] tls`, `[stream] sentinel_tls`). Asked to
/// fail over, the Sentinels promote A; P's agent hears it over TLS, proves
/// A's TLS address, and re-attaches P to A, which P reaches over TLS; A's
/// agent follows A; nothing is synced in full.
fn a_sentinel_failover_with_every_link_over_tls(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let pki = common::pki::Pki::new(root, "kv");
    let tls_server = |name: &str, extra: &[&str]| {
        let (mut args, port) = pki.server_tls(name);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        (Redis::start(server, &root.join(name), &args), port)
    };
    let (p, p_tls) = tls_server("p", &["--repl-ping-replica-period", "3600"]);
    let p_at = format!("127.0.0.1:{p_tls}");
    let sentinels: Vec<(Redis, u16)> = (0..3)
        .map(|i| {
            let (conf, port) = pki.sentinel_tls(&format!("sentinel-{i}"));
            let dir = root.join(format!("sentinel-{i}"));
            let s = start_sentinel_conf(
                server,
                &dir,
                ("127.0.0.1", &p_at),
                Duration::from_secs(1),
                &[],
                &conf,
            );
            (s, port)
        })
        .collect();
    let addrs: Vec<String> = sentinels
        .iter()
        .map(|(_, port)| format!("127.0.0.1:{port}"))
        .collect();
    let redis_tls = pki.redis_tls("agent");
    let (src_port, a_port) = (free_port(), free_port());
    let (src_addr, a_addr) = (
        format!("127.0.0.1:{src_port}"),
        format!("127.0.0.1:{a_port}"),
    );
    let src_config = format!(
        "[redis]\nprimary_addr = \"{p_at}\"\n{redis_tls}[stream]\ndir = \"{}\"\nfsync = \"always\"\nsentinel_tls = true\n{}",
        root.join("src-log").display(),
        sentinel_lines(&addrs, std::slice::from_ref(&a_addr))
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
    let (a, a_tls) = tls_server("a", &["--replicaof", "127.0.0.1", &p_tls.to_string()]);
    let a_at = format!("127.0.0.1:{a_tls}");
    let a_config = format!(
        "[stream]\ndir = \"{}\"\nupstream = \"{src_addr}\"\nsentinel_tls = true\n{}[handoff]\nmode = \"redis-replicate\"\n[redis]\nserver_addr = \"{a_at}\"\nprimary = \"{p_at}\"\n{redis_tls}",
        root.join("a-log").display(),
        sentinel_lines(&addrs, std::slice::from_ref(&src_addr)),
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
    p.fill("before", 2000, "v");
    converged(&a, &p, "A to have what P wrote");
    wait_for(
        "the Sentinels to know each other and A",
        DEADLINE * 2,
        || {
            sentinels
                .iter()
                .all(|(s, _)| sentinel_ready(s, a_tls))
                .then_some(())
        },
    );
    let full = |r: &Redis| r.info("stats").num("sync_full");
    let (p_full, a_full) = (full(&p), full(&a));

    let paused: String = p.cmd(&["CLIENT", "PAUSE", "120000", "WRITE"]);
    assert_eq!(paused, "OK");
    converged(&a, &p, "A to catch up with the paused primary");
    fail_over(&sentinels[1].0);
    replicates_from(&p, a_tls, "P to replicate from A, over TLS");
    let _: String = p.cmd(&["CLIENT", "UNPAUSE"]);
    wait_for("P's agent to re-attach P to A", DEADLINE, || {
        src.proc
            .log()
            .contains(&format!("the old primary {p_at} replicates from {a_at}"))
            .then_some(())
    });
    wait_for("A's agent to follow A", DEADLINE * 2, || {
        (stream_status(&agent_a).source == format!("primary {a_at}")).then_some(())
    });
    a.fill("after", 2000, "v");
    converged(&p, &a, "P to converge with A");
    assert_eq!(full(&p), p_full, "P never synced in full");
    assert_eq!(full(&a), a_full, "A served no full sync");
}

on_both_servers!(a_sentinel_failover_with_every_link_over_tls);

#[test]
fn an_agent_logs_in_to_a_sentinel_as_an_acl_user_with_its_password_in_a_file() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let primary = Redis::start(Server::Redis, &root.join("p"), &[]);
    let (wrong, right) = ("not-it", "s3nt:in@l/pw");
    let file = root.join("sentinel.pass");
    std::fs::write(&file, format!("{wrong}\n")).unwrap();
    let s = start_sentinel_acl(
        Server::Redis,
        &root.join("sentinel"),
        ("127.0.0.1", &primary.addr()),
        Duration::from_secs(30),
        &[&documented_acl(3, right)],
    );
    let config = format!(
        "{}{}sentinel_user = \"kvsync\"\nsentinel_password_file = \"{}\"\n",
        follower_config(&primary, &root.join("src-log")),
        sentinel_lines(&[s.addr()], &["127.0.0.1:1".to_string()]),
        file.display()
    );
    let agent = source_with(root, &config, &[]);
    wait_for(
        "the Sentinel's refusal in the agent's log",
        DEADLINE,
        || {
            let log = agent.proc.log();
            let said = format!(
            "authentication failed - AuthenticationFailed (logging in as user \"kvsync\" with the password in {})",
            file.display()
        );
            (log.contains("cannot subscribe to the Sentinel") && log.contains(&said)).then_some(())
        },
    );
    std::fs::write(&file, format!("{right}\n")).unwrap();
    wait_for("the agent to subscribe to the Sentinel", DEADLINE, || {
        agent
            .proc
            .log()
            .contains("following the Sentinels' +switch-master")
            .then_some(())
    });
    // Its rights let it ask the Sentinel too: status names the primary.
    wait_for("the Sentinel's primary in status", DEADLINE, || {
        stream_status(&agent)
            .sentinels
            .contains(&primary.addr())
            .then_some(())
    });
    let log = agent.proc.log();
    assert!(
        !log.contains(right) && !log.contains(wrong),
        "a password in the log: {log}"
    );

    // `check-config --live` finds the Sentinel role's rights, and names
    // the one taken away.
    let file = root.join("agent.toml");
    std::fs::write(&file, &config).unwrap();
    let live = || cli(&["check-config", "--live", file.to_str().unwrap()]);
    let (ok, out, err) = live();
    assert!(ok, "every documented right is there: {out}{err}");
    for (take, named, give) in [
        ("-sentinel|master", "+sentinel|master", "+sentinel|master"),
        ("-subscribe", "+subscribe", "+subscribe"),
        ("resetchannels", "&+switch-master", "&+switch-master"),
    ] {
        let _: () = s.cmd(&["ACL", "SETUSER", "kvsync", take]);
        let (ok, out, err) = live();
        let _: () = s.cmd(&["ACL", "SETUSER", "kvsync", give]);
        let line = out.lines().find(|l| l.starts_with(&s.addr()));
        assert!(
            !ok && line.is_some_and(|l| l.ends_with(&format!(
                "missing {named} (docs/REDIS.md gives each role's rights)"
            ))),
            "without {named}: {out}{err}"
        );
    }
}

/// A network partition that cuts the primary's host off (network
/// namespaces, one host each for P and its agent, A and its agent, B and
/// its agent, and a third Sentinel; a Sentinel on each host but P's). P
/// goes on taking writes on its side and its agent logging them; the
/// Sentinels promote A; B's agent follows A's agent and B never gets a
/// byte of P's side, before or after the partition heals. Healed, P's
/// agent hears of the switch, makes P a replica of A (which syncs it in
/// full: it wrote past the promotion point) and counts what its log held
/// past it; nothing of P's side reaches A or B.
#[test]
fn a_partition_of_the_old_primarys_host_feeds_no_server_from_both_sides() {
    use common::netns::{block_on, Hosts};
    let Some(hosts) = Hosts::create_n("failover partition", 4) else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    const AGENT_PORT: u16 = 7700;
    let ip = |h: usize| hosts.ip(h);
    let agent_at_host = |h: usize| format!("{}:{AGENT_PORT}", ip(h));
    let server = Server::Redis;
    let p = hosts.run_in(0, || {
        let p = Redis::start(
            server,
            &r.join("p"),
            &["--bind", "127.0.0.1", &ip(0), "--protected-mode", "no"],
        );
        p.fill("before", 500, "v");
        p
    });
    let p_addr = format!("{}:{}", ip(0), p.port);
    let sentinels: Vec<Redis> = (1..=3)
        .map(|h| {
            hosts.run_in(h, || {
                sentinel(server, &r.join(format!("sentinel-{h}")), &ip(h), &p_addr)
            })
        })
        .collect();
    let sentinel_addrs: Vec<String> = (1..=3)
        .map(|h| format!("{}:{}", ip(h), sentinels[h - 1].port))
        .collect();
    let lines = |peers: &[String]| sentinel_lines(&sentinel_addrs, peers);
    let src = hosts.run_in(0, || {
        let config = format!(
            "[redis]\nprimary_addr = \"{p_addr}\"\n[stream]\ndir = \"{}\"\nfsync = \"always\"\n{}",
            r.join("src-log").display(),
            lines(&[agent_at_host(1)])
        );
        let src = agent_at(r, "src", &r.join("src-snaps"), &config, &ip(0), AGENT_PORT);
        wait_following(&src);
        src
    });
    let (a, agent_a) = hosts.run_in(1, || {
        let pport = p.port.to_string();
        let a = Redis::start(
            server,
            &r.join("a"),
            &[
                "--bind",
                "127.0.0.1",
                &ip(1),
                "--protected-mode",
                "no",
                "--replicaof",
                &ip(0),
                &pport,
            ],
        );
        let config = format!(
            "[stream]\ndir = \"{}\"\nupstream = \"{}\"\n{}[handoff]\nmode = \"redis-replicate\"\n[redis]\nserver_addr = \"{}:{}\"\nprimary = \"{p_addr}\"\n",
            r.join("a-log").display(),
            agent_at_host(0),
            lines(&[agent_at_host(0)]),
            ip(1),
            a.port
        );
        let agent_a = agent_at(r, "a", &r.join("a-snaps"), &config, &ip(1), AGENT_PORT);
        wait_following(&agent_a);
        (a, agent_a)
    });
    let (b, agent_b) = hosts.run_in(2, || {
        let b = Redis::standalone_replica(server, &r.join("b"));
        let config = format!(
            "[stream]\ndir = \"{}\"\nupstream = \"{}\"\n{}[handoff]\nmode = \"redis-stream\"\ntimeout = \"60s\"\n[redis]\nserver_addr = \"{}\"\n",
            r.join("b-log").display(),
            agent_at_host(0),
            lines(&[agent_at_host(0), agent_at_host(1)]),
            b.addr()
        );
        let agent_b = agent_at(r, "b", &r.join("b-snaps"), &config, &ip(2), AGENT_PORT);
        wait_following(&agent_b);
        let done = block_on(sync_from(&agent_b, &agent_at_host(0)));
        assert_eq!(done.phase, kvsync::rpc::pb::Phase::Succeeded as i32, "{done:?}");
        (b, agent_b)
    });
    let keys = |h: usize, server: &Redis, pattern: &str| {
        hosts.run_in(h, || server.cmd::<Vec<String>>(&["KEYS", pattern]).len())
    };
    wait_for("B and A to hold what P wrote", DEADLINE, || {
        (keys(2, &b, "before:*") == 500 && keys(1, &a, "before:*") == 500).then_some(())
    });
    wait_for(
        "the Sentinels to know each other and the replica",
        DEADLINE * 2,
        || {
            (1..=3)
                .all(|h| hosts.run_in(h, || sentinel_ready(&sentinels[h - 1], a.port)))
                .then_some(())
        },
    );

    // P's host cut off; P takes writes on its side, its agent logs them.
    hosts.set_link(0, false);
    hosts.run_in(0, || p.fill("isolated", 2000, "lost"));
    let logged = hosts.run_in(0, || {
        let end = p.info("replication").num("master_repl_offset");
        wait_for("P's agent to log P's side", DEADLINE, || {
            (stream_status(&src).end_offset == end).then_some(end)
        })
    });
    wait_for("the Sentinels to promote A", DEADLINE * 2, || {
        hosts.run_in(1, || {
            (try_info(&a)?.get("role") == Some("master")).then_some(())
        })
    });
    let (new_id, at) = hosts.run_in(1, || {
        let info = a.info("replication");
        let id = info.get("master_replid").unwrap().to_string();
        (id, info.num("second_repl_offset") - 1)
    });
    assert!(logged > at, "P's side went past the promotion point");
    let a_agent = agent_at_host(1);
    wait_for("B's agent to follow A's agent", DEADLINE * 2, || {
        hosts
            .run_in(2, || {
                let st = stream_status(&agent_b);
                st.source == format!("agent {a_agent}") && st.replid == new_id
            })
            .then_some(())
    });
    hosts.run_in(1, || a.fill("after", 500, "new"));
    wait_for("B to take A's writes", DEADLINE, || {
        (keys(2, &b, "after:*") == 500).then_some(())
    });
    assert_eq!(
        keys(2, &b, "isolated:*"),
        0,
        "nothing of P's side reached B"
    );

    // Healed: P's agent hears of the switch within its recheck, makes P
    // A's replica, and its log counts what it held past the promotion.
    hosts.set_link(0, true);
    wait_for("P's agent to follow A's agent", DEADLINE * 2, || {
        hosts
            .run_in(0, || {
                stream_status(&src).source == format!("agent {a_agent}")
            })
            .then_some(())
    });
    hosts.run_in(0, || {
        replicates_from(&p, a.port, "P to replicate from A");
        wait_for("P to hold A's writes, without its side", DEADLINE, || {
            let keys = |pattern| {
                let mut con = redis::Client::open(p.url()).ok()?.get_connection().ok()?;
                redis::cmd("KEYS")
                    .arg(pattern)
                    .query::<Vec<String>>(&mut con)
                    .ok()
            };
            (keys("isolated:*")?.is_empty() && keys("after:*")?.len() == 500).then_some(())
        });
    });
    // At least what P took before the promotion's check (its pings may
    // add some after).
    wait_for("P's agent to count what diverged", DEADLINE, || {
        hosts
            .run_in(0, || diverged(&src) >= (logged - at) as f64)
            .then_some(())
    });
    assert!(hosts.run_in(0, || !stream_status(&src).diverged.is_empty()));
    // B's agent never took from the stale side: no re-seeding, and the
    // promoted server's history only.
    hosts.run_in(2, || {
        assert_eq!(full_feeds(&agent_b), 1, "B's only full sync is its seeding");
        assert_eq!(diverged(&agent_b), 0.0);
        assert_eq!(stream_status(&agent_b).replid, new_id);
    });
    assert_eq!(keys(1, &a, "isolated:*"), 0);
    assert_eq!(keys(2, &b, "isolated:*"), 0);
    drop(agent_a);
}
