//! The old primary re-attached when it is a replica a failover promoted:
//! an agent in handoff mode `redis-replicate` whose server answers as a
//! primary sends it `REPLICAOF <new primary>` when told of another one,
//! only toward a proved primary promoted from that server's history. With
//! real servers and agent processes, and fake servers or Sentinels
//! ([`common::fake`]):
//! - one lying Sentinel of three names a fake master that echoes the
//!   promoted server's replication id, at an address the agent's own
//!   configuration proves (no `run_id` is asked of it, and the replid
//!   check would pass): refused by the majority rule, nothing reaches the
//!   fake;
//! - the promoted server does not answer when the agent hears of the next
//!   failover: the re-attach is pending, and the next try (a call, or the
//!   Sentinel follower's every 10 s) does it once the server answers;
//! - the promoted server was followed under another of its addresses (one
//!   `[stream] servers` lists, proved the local server by its `run_id`):
//!   it is re-attached all the same;
//! - a stale Sentinel majority names the primary whose history the
//!   promoted server left: nothing is sent to it.
//!
//! P is the primary with its agent `src` (`[redis] primary_addr`); Q is a
//! replica of P with its agent `q` (`redis-replicate`, its log following
//! `src`); each names the other in `[stream] peers`. A failover to Q is
//! told to both agents (`kvsync stream follow`), then one back to P.

mod common;

use std::path::Path;

use common::fake::{Fake, Script};
use common::kv::*;
use common::node::*;
use common::sentinel::*;
use common::stream::*;
use common::*;

/// The cast after a failover to Q.
struct Promoted {
    p: Redis,
    src: Node,
    q: Redis,
    agent_q: Node,
    /// The address Q was promoted under (what the agents were told).
    q_name: String,
    /// `q`'s configuration and gRPC port, to start it again.
    q_config: String,
    q_port: u16,
}

/// `kvsync stream follow --agent agent --primary primary`: its output;
/// panics when refused.
fn follow(agent: &Node, primary: &str) -> String {
    let (ok, out, err) = cli(&[
        "stream",
        "follow",
        "--agent",
        &agent.grpc(),
        "--primary",
        primary,
    ]);
    assert!(ok, "follow {primary} on {}: {err}", agent.grpc());
    eprintln!("follow {primary} on {}: {}", agent.grpc(), out.trim());
    out
}

/// A server's role and the port of its master (0: none).
fn role(server: &Redis) -> (String, u64) {
    let info = try_info(server).expect("the server answers INFO");
    (
        info.get("role").unwrap_or_default().to_string(),
        info.num("master_port"),
    )
}

/// P (1000 keys) with its agent `src`; Q, a replica of P, with its
/// `redis-replicate` agent `q` (`server_addr` Q's 127.0.0.1 address);
/// then Q promoted and both agents told (`kvsync stream follow`), under
/// Q's 127.0.0.1 address, or with `alt` under its 127.0.0.2 one, which
/// both agents list in `[stream] servers` (Q listens on both). Without
/// `tell_src` only Q's agent is told: P stays a master of the old history.
fn promoted_q(root: &Path, alt: bool, tell_src: bool) -> Promoted {
    let server = Server::Redis;
    let p = Redis::start(
        server,
        &root.join("p"),
        &["--repl-ping-replica-period", "3600"],
    );
    let q_server_port = free_port();
    let q_alt = format!("127.0.0.2:{q_server_port}");
    let servers = match alt {
        true => format!("servers = [\"{q_alt}\"]\n"),
        false => String::new(),
    };
    let (src_port, q_port) = (free_port(), free_port());
    let (src_addr, q_addr) = (
        format!("127.0.0.1:{src_port}"),
        format!("127.0.0.1:{q_port}"),
    );
    let src_config = format!(
        "{}peers = [\"{q_addr}\"]\n{servers}",
        follower_config(&p, &root.join("src-log"))
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
    let mut args = vec![
        "--replicaof",
        "127.0.0.1",
        pport.as_str(),
        "--repl-ping-replica-period",
        "3600",
    ];
    if alt {
        args.extend(["--bind", "127.0.0.1", "127.0.0.2"]);
    }
    let q = Redis::start_on(server, &root.join("q"), &args, None, q_server_port);
    let q_config = format!(
        "[stream]\ndir = \"{}\"\nupstream = \"{src_addr}\"\npeers = [\"{src_addr}\"]\n{servers}[handoff]\nmode = \"redis-replicate\"\n[redis]\nserver_addr = \"{}\"\nprimary = \"{}\"\n",
        root.join("q-log").display(),
        q.addr(),
        p.addr()
    );
    let agent_q = agent_at(
        root,
        "q",
        &root.join("q-snaps"),
        &q_config,
        "127.0.0.1",
        q_port,
    );
    wait_following(&agent_q);
    p.fill("k", 1000, "v");
    converged(&q, &p, "Q to have P's keys");

    // The failover to Q, the promoted server's agent first.
    let _: () = q.cmd(&["REPLICAOF", "NO", "ONE"]);
    let q_name = match alt {
        true => q_alt,
        false => q.addr(),
    };
    let out = follow(&agent_q, &q_name);
    assert!(out.contains(&format!("follows primary {q_name}")), "{out}");
    if tell_src {
        follow(&src, &q_name);
        replicates_from(&p, q.port, "P to replicate from Q");
    }
    Promoted {
        p,
        src,
        q,
        agent_q,
        q_name,
        q_config,
        q_port,
    }
}

/// Three fake Sentinels that agree on the primary at 127.0.0.1:`port`
/// under `epoch` (Q's agent only asks `SENTINEL MASTER`), and `q_config`
/// with them.
fn agreeing_sentinels(q_config: &str, port: u16, epoch: u64) -> (Vec<Fake>, String) {
    let sentinels: Vec<Fake> = (0..3)
        .map(|_| {
            Fake::start(Script {
                sentinel_master: Some(("127.0.0.1".into(), port, epoch)),
                ..Script::default()
            })
        })
        .collect();
    let list: Vec<String> = sentinels
        .iter()
        .map(|s| format!("\"{}\"", s.addr()))
        .collect();
    let config = q_config.replace(
        "[handoff]\n",
        &format!(
            "sentinels = [{}]\nmaster_name = \"{MASTER}\"\n[handoff]\n",
            list.join(", ")
        ),
    );
    (sentinels, config)
}

/// Q takes writes, P catches up and is promoted back, P's agent follows
/// it; Q's agent is yet to be told.
fn fail_back(c: &Promoted) {
    c.q.fill("q", 100, "v");
    converged(&c.p, &c.q, "P to have Q's writes");
    let _: () = c.p.cmd(&["REPLICAOF", "NO", "ONE"]);
    let out = follow(&c.src, &c.p.addr());
    assert!(
        out.contains(&format!("follows primary {}", c.p.addr())),
        "{out}"
    );
}

/// Attack: one lying Sentinel of three names, under a huge epoch, a fake
/// master that answers as a master under the promoted server's
/// replication id, at an address Q's agent's own configuration lists
/// (`[stream] servers`: proved by configuration, no `run_id` checked).
/// Were it followed (and a configured peer followed it), the replid
/// check would pass and Q would full-sync the fake's empty RDB. Refused
/// by the majority rule: nothing reaches the fake, Q stays the primary
/// with its keys.
#[test]
fn one_lying_sentinel_cannot_make_a_promoted_replicas_agent_re_attach_it() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let Promoted {
        p: _p,
        src: _src,
        q,
        agent_q,
        q_name,
        q_config,
        q_port,
    } = promoted_q(r, false, true);
    let q_replid = q
        .info("replication")
        .get("master_replid")
        .unwrap()
        .to_string();
    let fake = Fake::start(Script {
        replid: q_replid,
        ..Script::default()
    });
    let honest: Vec<Redis> = (0..2)
        .map(|i| {
            start_sentinel(
                Server::Redis,
                &r.join(format!("sentinel-{i}")),
                ("127.0.0.1", &q.addr()),
                std::time::Duration::from_secs(1),
            )
        })
        .collect();
    let liar = Fake::start(Script {
        sentinel_master: Some(("127.0.0.1".into(), fake.port, 1 << 62)),
        ..Script::default()
    });
    let sentinels: Vec<String> = honest
        .iter()
        .map(|s| s.addr())
        .chain([liar.addr()])
        .map(|a| format!("\"{a}\""))
        .collect();

    // Q's agent again, now following the Sentinels; its kept source
    // (upstreams.json) still follows Q.
    drop(agent_q);
    let config = q_config.replace(
        "[handoff]\n",
        &format!(
            "servers = [\"{}\"]\nsentinels = [{}]\nmaster_name = \"{MASTER}\"\n[handoff]\n",
            fake.addr(),
            sentinels.join(", ")
        ),
    );
    let agent_q = agent_at(r, "q", &r.join("q-snaps"), &config, "127.0.0.1", q_port);
    let keys = q.cmd::<i64>(&["DBSIZE"]);
    let said = wait_for("Q's agent to report the lying Sentinel", DEADLINE, || {
        let st = stream_status(&agent_q);
        st.sentinels
            .contains("not followed")
            .then_some(st.sentinels)
    });
    eprintln!("Q's agent: {said}");
    assert!(
        said.starts_with(&format!("2 of 3 Sentinels name {q_name}")),
        "{said}"
    );
    // Several askings (every 250 ms while they disagree), each a chance
    // to act.
    let dissent = "kvsync_stream_sentinel_dissent_total{kv_instance=\"default\"}";
    wait_for(
        "Q's agent to ask the Sentinels five times",
        DEADLINE,
        || (agent_q.metric(dissent) >= 5.0).then_some(()),
    );
    assert_eq!(
        fake.commands(),
        Vec::<String>::new(),
        "nothing reached the fake"
    );
    assert_eq!(role(&q).0, "master", "Q is still the primary");
    assert_eq!(q.cmd::<i64>(&["DBSIZE"]), keys, "Q kept its keys");
    assert_eq!(stream_status(&agent_q).source, format!("primary {q_name}"));
    assert!(!agent_q.proc.log().contains("replicates from"));
    drop((honest, liar));
}

/// Race: Q does not answer when its agent hears of the failover back to
/// P (paused here with SIGSTOP; any stall past the Redis client's 0.5 s
/// response timeout does the same). The agent follows P's agent and says
/// the re-attach is pending, to be tried again; its log's source has
/// moved on by then, so the next try asks the server, not the log,
/// whether it is a primary, and re-attaches Q (before the fix it found no
/// old primary and reported the failover done: Q stayed a writable master
/// of the history the others left).
#[test]
fn a_pending_re_attach_of_a_promoted_replica_is_done_once_it_answers() {
    let root = tempfile::tempdir().unwrap();
    let c = promoted_q(root.path(), false, true);
    fail_back(&c);
    let pid = c.q.child.as_ref().unwrap().id() as i32;
    // SAFETY: signalling a process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let (ok, first, err) = cli(&[
        "stream",
        "follow",
        "--agent",
        &c.agent_q.grpc(),
        "--primary",
        &c.p.addr(),
    ]);
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    eprintln!("first try, Q stopped: {}", first.trim());
    assert!(ok, "{err}");
    assert!(
        first.contains("did not answer"),
        "the first try finds Q silent: {first}"
    );
    assert_eq!(
        stream_status(&c.agent_q).source,
        format!("agent {}", c.src.grpc())
    );
    // Q answers again: the call the agent asked for.
    let second = follow(&c.agent_q, &c.p.addr());
    let (role, port) = role(&c.q);
    let written: redis::RedisResult<()> = c.q.try_cmd(&["SET", "split-brain", "1"]);
    eprintln!(
        "after the second try Q is a {role} (master_port {port}); a write to it: {written:?}"
    );
    assert!(
        role == "slave" && port == c.p.port as u64,
        "the old primary Q was not re-attached once it answered again: it is a {role}, writable ({written:?}); the try said: {}",
        second.trim()
    );
}

/// Race: Q was promoted under another of its own addresses (127.0.0.2,
/// in `[stream] servers`; the agent's `server_addr` says 127.0.0.1): its
/// agent followed it as the local server (the same `run_id`), and at the
/// failover back to P re-attaches it (before the fix the log's source was
/// matched with `server_addr` by address only, and Q was never
/// re-attached).
#[test]
fn a_replica_promoted_under_another_of_its_addresses_is_re_attached() {
    let root = tempfile::tempdir().unwrap();
    let c = promoted_q(root.path(), true, true);
    fail_back(&c);
    let out = follow(&c.agent_q, &c.p.addr());
    let (role, port) = role(&c.q);
    eprintln!(
        "Q promoted as {}; after the failover back Q is a {role} (master_port {port})",
        c.q_name
    );
    assert!(
        role == "slave" && port == c.p.port as u64,
        "Q, promoted as {}, was not re-attached: it is a {role}; the call said: {}",
        c.q_name,
        out.trim()
    );
}

/// The same race under Sentinel: Q's agent follows three Sentinels that
/// agree on P (fakes here: the agent only asks `SENTINEL MASTER`) and
/// starts while Q does not answer. Its first take of P says the re-attach
/// is pending, and a try within the next 10 s re-attaches Q once it
/// answers (before the fix that try found no old primary, reported P
/// taken and never tried again).
#[test]
fn under_sentinel_a_pending_re_attach_of_a_promoted_replica_is_done_once_it_answers() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let c = promoted_q(r, false, true);
    fail_back(&c);
    let Promoted {
        p,
        src: _src,
        q,
        agent_q,
        q_config,
        q_port,
        ..
    } = c;
    let (_sentinels, config) = agreeing_sentinels(&q_config, p.port, 2);
    drop(agent_q);
    let pid = q.child.as_ref().unwrap().id() as i32;
    // SAFETY: signalling a process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let agent_q = agent_at(r, "q", &r.join("q-snaps"), &config, "127.0.0.1", q_port);
    let pending = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_for("Q's agent to find Q silent", DEADLINE, || {
            agent_q.proc.log().contains("did not answer").then_some(())
        })
    }));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    pending.unwrap();
    // Within two of the agent's 10 s retries.
    wait_for("Q's agent to re-attach Q", DEADLINE, || {
        (role(&q) == ("slave".to_string(), p.port as u64)).then_some(())
    });
}

/// Race: Sentinels that are behind (a majority still names P, whose
/// server still runs as a master of the old history: Q was promoted by
/// an operator and only Q's agent told) while Q's agent restarts (its
/// kept `upstreams.json` follows Q, so Q counts as the old primary). P
/// is proved (`[redis] primary`), answers as a master, and P's agent
/// follows it, so only the replid check stands between Q and a full
/// sync of P's history over what Q took since its promotion. Refused:
/// nothing is sent to Q, it keeps its keys.
#[test]
fn a_stale_majority_never_re_attaches_a_promoted_replica_to_the_history_it_left() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let Promoted {
        p,
        src: _src,
        q,
        agent_q,
        q_config,
        q_port,
        ..
    } = promoted_q(r, false, false);
    q.fill("q", 100, "v");
    let keys = q.cmd::<i64>(&["DBSIZE"]);
    let (_sentinels, config) = agreeing_sentinels(&q_config, p.port, 1);
    drop(agent_q);
    let agent_q = agent_at(r, "q", &r.join("q-snaps"), &config, "127.0.0.1", q_port);
    let said = wait_for("Q's agent to take P", DEADLINE, || {
        agent_q
            .proc
            .log()
            .lines()
            .find(|l| l.contains("re-attached") || l.contains("replicates from"))
            .map(str::to_string)
    });
    eprintln!("Q's agent: {said}");
    // The refusal is decided before anything is sent.
    assert_eq!(role(&q).0, "master", "Q was re-attached to P: {said}");
    assert_eq!(q.cmd::<i64>(&["DBSIZE"]), keys, "Q kept its keys");
    assert!(
        said.contains("was not re-attached") && said.contains("not promoted from its history"),
        "{said}"
    );
    assert_eq!(role(&p).0, "master");
    assert_eq!(p.cmd::<i64>(&["DBSIZE"]), 1000);
}
