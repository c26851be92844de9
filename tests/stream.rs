//! The replication stream with real `redis-server` and `valkey-server`
//! processes (each test runs against both) and agent processes: the
//! primary's agent follows its primary into the stream log (a full resync
//! whose RDB becomes an offered snapshot, then the stream, acknowledged so
//! `WAIT` counts it), and after a restart continues from its log with a
//! partial resync; a replica agent follows the primary's agent into a log
//! of its own, byte for byte, resumes from its log after being killed, and
//! refuses a frame changed on the wire; a server fed through two agents
//! keeps up with a steady writer while `WAIT` counts it (`ack =
//! "replicas"`); a server seeded through its agent loads the snapshot's
//! verified pieces while the rest arrives, and a stopped sync leaves it as
//! it was; a replica agent killed while the primary writes ten times
//! its backlog continues its server from its log once restarted, with no
//! full sync; the link between two agents' hosts (network namespaces) cut
//! while the primary writes several times its backlog, once with the
//! primary's agent restarted meanwhile, costs a reconnect and no full
//! sync; a fed server is released to the primary and attached back,
//! each by a continuation, and a hand over that would be a full resync is
//! refused with nothing changed; a `fanout --stream` tree converges and a
//! dead relay's children re-parent to the origin from their offsets; a
//! replica agent too old for its upstream is re-seeded from the snapshot
//! it names (`reseed`); a replica that acknowledges slowly stalls the source's credit and loses
//! nothing; the primary's write safety is reported degraded while no
//! replica acknowledges; a record damaged on disk in an old segment is
//! never served and is fetched again alone (from the primary's backlog,
//! or from the upstream agent's log), the rest of the log kept; a full log disk stops logging with an error,
//! never an acknowledgement of what was not written, and logging continues
//! once there is space.

mod common;

use std::path::{Path, PathBuf};

use common::kv::*;
use common::netns::{block_on, Hosts, IPS};
use common::node::*;
use common::stream::*;
use common::*;
use kvsync::stream::log::{Log, RECORD_HEADER, SEGMENT_HEADER};

/// The offset the primary holds for its one replica (the agent's ack).
fn replica_offset(primary: &Redis) -> Option<u64> {
    let info = primary.info("replication");
    let line = info.get("slave0")?;
    line.split(',')
        .find_map(|kv| kv.strip_prefix("offset="))
        .and_then(|o| o.parse().ok())
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
    // WAIT counts the agent once the writes are in its log, and at once:
    // the agent answers the primary's GETACK without waiting for its
    // once-a-second acknowledgement.
    let acked: i64 = primary.cmd(&["WAIT", "1", "10000"]);
    assert_eq!(acked, 1, "WAIT 1 counts the agent");
    let mut con = primary.con();
    for i in 0..20 {
        assert_eq!(write_and_wait(&mut con, &format!("waited:{i}"), 200), 1);
    }
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

/// Waits until `agent` follows its source and its log ends at the
/// primary's offset then.
fn wait_logged(agent: &Node, primary: &Redis, what: &str) -> u64 {
    wait_for(what, DEADLINE, || {
        let end = primary.info("replication").num("master_repl_offset");
        let st = stream_status(agent);
        (st.state.starts_with("following") && st.end_offset == end && end > 0).then_some(end)
    })
}

fn a_replica_agent_follows_the_primarys_agent_into_its_own_log_and_resumes_after_a_kill(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    primary.fill("before", 200, "v");
    let src_log = root.path().join("src-log");
    let source = following_source(root.path(), &primary, &[]);
    primary.fill("first", 1000, "first-value");
    wait_logged(&source, &primary, "the source agent to log the stream");
    let rep_log = root.path().join("rep-log");
    let rep_config = puller_config(&source, &rep_log);
    let rep_snaps = root.path().join("rep-snaps");
    let mut replica = agent(root.path(), "rep", &rep_snaps, &rep_config, &[]);
    wait_logged(
        &replica,
        &primary,
        "the replica agent to follow the source's log",
    );
    let st = stream_status(&replica);
    assert!(st.state.starts_with("following agent"), "{st:?}");
    assert_eq!(
        st.first_offset,
        stream_status(&source).first_offset,
        "an empty log starts where the upstream's does"
    );
    assert_eq!(stream_status(&source).serving, 1);
    // The stream keeps flowing to it as the primary writes.
    primary.fill("second", 1000, "second-value");
    wait_logged(&replica, &primary, "the replica agent to follow new writes");

    // Killed while the primary writes, then started again: it asks from
    // its log's end and nothing is skipped or applied twice.
    replica.proc.signal(libc::SIGKILL);
    replica.proc.wait_exit();
    primary.fill("while-killed", 500, "v");
    let replica = agent(root.path(), "rep", &rep_snaps, &rep_config, &[]);
    primary.fill("after-restart", 500, "v");
    let end = wait_logged(
        &replica,
        &primary,
        "the restarted replica agent to catch up",
    );
    wait_logged(&source, &primary, "the source agent");
    assert!(
        replica.metric("kvsync_stream_bytes_total{kv_instance=\"default\",role=\"replica\"}") > 0.0
    );
    assert!(
        source.metric("kvsync_stream_bytes_total{kv_instance=\"default\",role=\"source\"}") > 0.0
    );
    drop(replica);
    drop(source);
    let (first, src) = log_bytes(&src_log);
    let (rep_first, rep) = log_bytes(&rep_log);
    assert_eq!(rep_first, first);
    assert_eq!(first + rep.len() as u64, end);
    assert!(
        rep == src,
        "the replica agent's log is the source's, byte for byte"
    );
    assert!(String::from_utf8_lossy(&rep).contains("while-killed:499"));
}

on_both_servers!(
    a_replica_agent_follows_the_primarys_agent_into_its_own_log_and_resumes_after_a_kill
);

#[test]
fn a_stream_frame_changed_on_the_wire_is_refused_and_never_logged() {
    // As an on-path attacker without the session's key would: one bit of
    // the stream flipped after its frame's MAC was made, in every session.
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let at = primary.info("replication").num("master_repl_offset") + 5000;
    let src_log = root.path().join("src-log");
    let fault = format!("stream_corrupt_at={at}");
    let source = following_source(root.path(), &primary, &[("KVSYNC_FAULTS", &fault)]);
    primary.fill("k", 1000, "value-of-the-stream");
    wait_logged(&source, &primary, "the source agent to log the stream");
    let rep_log = root.path().join("rep-log");
    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &puller_config(&source, &rep_log),
        &[],
    );
    let series = "kvsync_stream_refused_total{kv_instance=\"default\",reason=\"forged\"}";
    wait_for(
        "the replica agent to refuse the changed frame twice",
        DEADLINE,
        || (replica.metric(series) >= 2.0).then_some(()),
    );
    let st = stream_status(&replica);
    assert!(
        st.end_offset <= at,
        "nothing at or past the changed byte was logged: {st:?}"
    );
    assert!(st.state.contains("fails its MAC"), "{st:?}");
    drop(replica);
    drop(source);
    let (first, src) = log_bytes(&src_log);
    let (rep_first, rep) = log_bytes(&rep_log);
    assert_eq!(rep_first, first);
    assert!(
        src.starts_with(&rep),
        "what was logged is the stream itself"
    );
}

#[test]
fn a_stream_session_runs_under_tls_when_the_source_requires_it() {
    let root = tempfile::tempdir().unwrap();
    let fleet = common::pki::Pki::new(root.path(), "fleet");
    let tls = |who: &str| fleet.agent_tls(who);
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let src_log = root.path().join("src-log");
    let source = agent(
        root.path(),
        "src",
        &root.path().join("src-snaps"),
        &format!(
            "[data]\ntls = \"required\"\n{}{}",
            follower_config(&primary, &src_log),
            tls("src")
        ),
        &[],
    );
    let ca = fleet.ca_file().display().to_string();
    let status = |agent: &Node| -> serde_json::Value {
        let out = std::process::Command::new(kvsync_bin())
            .args([
                "--tls-ca",
                &ca,
                "status",
                "--agent",
                &agent.grpc(),
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["instances"][0]["stream"].clone()
    };
    let logged = |agent: &Node, what: &str| {
        wait_for(what, DEADLINE, || {
            let end = primary.info("replication").num("master_repl_offset");
            let st = status(agent);
            (st["state"].as_str()?.starts_with("following") && st["end_offset"] == end && end > 0)
                .then_some(end)
        })
    };
    wait_for("the source agent to follow its primary", DEADLINE, || {
        status(&source)["state"]
            .as_str()?
            .starts_with("following")
            .then_some(())
    });
    primary.fill("k", 500, "value-of-the-stream");
    logged(&source, "the source agent to log the stream");
    let rep_log = root.path().join("rep-log");
    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &format!("{}{}", puller_config(&source, &rep_log), tls("rep")),
        &[],
    );
    logged(&replica, "the replica agent to follow under TLS");
    let log = source.proc.log();
    assert!(
        log.lines()
            .any(|l| l.contains("serving the replication stream") && l.contains("tls=true")),
        "{log}"
    );
}

#[test]
fn an_offset_the_upstream_does_not_hold_is_reported_and_the_log_left_as_it_is() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let source = following_source(root.path(), &primary, &[]);
    primary.fill("k", 100, "v");
    wait_logged(&source, &primary, "the source agent to log the stream");
    // A log of another history: nothing the upstream holds continues it.
    let rep_log = root.path().join("rep-log");
    let other = "f".repeat(40);
    let cfg = kvsync::config::StreamConfig {
        dir: rep_log.clone(),
        ..Default::default()
    };
    Log::open(cfg.clone()).unwrap().restart(&other, 7).unwrap();
    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &(puller_config(&source, &rep_log) + "reseed = false\n"),
        &[],
    );
    let series = "kvsync_stream_refused_total{kv_instance=\"default\",reason=\"too_old\"}";
    wait_for("the replica agent to hear \"too old\"", DEADLINE, || {
        (replica.metric(series) >= 1.0).then_some(())
    });
    let st = stream_status(&replica);
    assert!(
        st.state.starts_with("needs a snapshot") && st.state.contains("no longer holds offset 7"),
        "{st:?}"
    );
    assert_eq!((st.replid.as_str(), st.end_offset), (other.as_str(), 7));
    drop(replica);
    assert_eq!(Log::open(cfg).unwrap().position(), Some((other, 7)));
}

fn a_server_fed_from_the_replica_agents_log_converges_and_continues_after_a_cut(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    let source = following_source(root.path(), &primary, &[]);
    let (rs, replica) = seeded_through_two_agents(root.path(), server, &primary, &source);
    // The primary's writes reach the server through both agents' logs.
    primary.fill("after", 2000, "value-of-the-stream");
    converged(&rs, &primary, "the fed server to converge with the primary");
    let end = primary.info("replication").num("master_repl_offset");
    wait_for("the server's ack of the offset in status", DEADLINE, || {
        (stream_status(&replica).fed_offset == end).then_some(())
    });
    let value: String = rs.cmd(&["GET", "after:1999"]);
    assert_eq!(value, "value-of-the-stream");
    // A cut link between the server and the agent: the server reconnects
    // and continues from the agent's log, no full sync anywhere.
    let continued = || {
        replica
            .proc
            .log()
            .matches("continues its server from the log")
            .count()
    };
    let before = continued();
    let killed: i64 = rs.cmd(&["CLIENT", "KILL", "TYPE", "master"]);
    assert_eq!(killed, 1);
    primary.fill("after-cut", 300, "v");
    converged(&rs, &primary, "the server to continue after the cut");
    wait_for("the feed to continue its server", DEADLINE, || {
        (continued() > before).then_some(())
    });
    let log = replica.proc.log();
    assert_eq!(
        log.matches("sent its server the RDB").count(),
        1,
        "one full sync, the seeding: {log}"
    );
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
}

on_both_servers!(a_server_fed_from_the_replica_agents_log_converges_and_continues_after_a_cut);

/// Servers with their `default` user off: both agents authenticate as the
/// ACL user `kvsync`, with exactly the rights docs/REDIS.md gives its role
/// on each server, its password (with `:`, `@` and `/` in it) kept in a
/// file. The primary's agent follows the primary, the replica agent seeds
/// and feeds its server, and `check-replica` compares them as
/// `kvsync-check`, with that page's rights too. A rotation done file first: the cut link is refused
/// with the server's own words in the log, and comes back by itself once
/// the servers take the new password, without a full sync. No log holds
/// either password.
fn acl_users_with_passwords_in_files_carry_the_stream_through_a_rotation(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let (old, new) = ("s3:cr@t/one", "n3w:p@ss/two");
    let file = root.join("kvsync.pass");
    std::fs::write(&file, format!("{old}\n")).unwrap();
    // The rights docs/REDIS.md gives each role, and no more.
    let (source_role, replica_role) = (documented_acl(0, old), documented_acl(1, old));
    let check_role = documented_acl(2, old);
    let primary = Redis::start_acl(server, &root.join("p"), &[], &[&source_role, &check_role]);
    let login = format!(
        "user = \"kvsync\"\npassword_file = \"{}\"\n",
        file.display()
    );
    let config = format!(
        "[redis]\nprimary_addr = \"{}\"\n{login}[stream]\ndir = \"{}\"\nfsync = \"always\"\n",
        primary.addr(),
        root.join("src-log").display()
    );
    let source = source_with(root, &config, &[]);
    let pidfile = root.join("r").join("redis.pid");
    let rs = Redis::start_acl(
        server,
        &root.join("r"),
        &["--pidfile", pidfile.to_str().unwrap()],
        &[&replica_role, &check_role],
    );
    let (rs, replica) = seed_fed(root, rs, &primary, &source, ("rep", "", &login));
    primary.fill("after", 500, "v");
    converged(&rs, &primary, "the fed server to converge");
    // Their rights let both agents read their server's INFO: health says up.
    for (agent, server) in [(&source, &primary), (&replica, &rs)] {
        let up = format!(
            r#"kvsync_kv_up{{kv_instance="default",server="{}"}}"#,
            server.addr()
        );
        wait_for("the agent's health poll of its server", DEADLINE, || {
            (agent.metric(&up) == 1.0).then_some(())
        });
    }
    let check_replica = |when: &str| {
        let (ok, out, err) = cli(&[
            "check-replica",
            "--primary",
            &primary.addr(),
            "--replica",
            &rs.addr(),
            "--user",
            "kvsync-check",
            "--password-file",
            file.to_str().unwrap(),
        ]);
        assert!(ok, "check-replica as its ACL user {when}: {out}{err}");
    };
    check_replica("");

    // The file first: the primary's agent, cut off, is refused.
    let refused = || source.proc.log().matches("WRONGPASS").count();
    std::fs::write(&file, format!("{new}\n")).unwrap();
    let killed: i64 = primary.cmd(&["CLIENT", "KILL", "USER", "kvsync"]);
    assert!(killed >= 1, "the agents' connections as kvsync");
    wait_for("the agent's AUTH refused, in its log", DEADLINE, || {
        (refused() > 0).then_some(())
    });
    // Then the servers: the agent comes back by itself.
    for r in [&primary, &rs] {
        for user in ["kvsync", "kvsync-check"] {
            let _: () = r.cmd(&["ACL", "SETUSER", user, "resetpass", &format!(">{new}")]);
        }
    }
    primary.fill("rotated", 500, "v");
    converged(
        &rs,
        &primary,
        "the fed server to converge after the rotation",
    );
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
    check_replica("with the rotated file");
    for agent in [&source, &replica] {
        let log = agent.proc.log();
        assert!(
            !log.contains(old) && !log.contains(new),
            "a password in the log: {log}"
        );
        assert!(!log.contains("NOPERM"), "a right the role lacks: {log}");
    }

    // `check-config --live` logs in as both roles and finds every right;
    // without one, it names it.
    let both_roles = root.join("both-roles.toml");
    std::fs::write(
        &both_roles,
        format!(
            "snapshot_format = \"redis-rdb\"\n[redis]\nprimary_addr = \"{}\"\nserver_addr = \"{}\"\n{login}[stream]\ndir = \"{}\"\n[handoff]\nmode = \"redis-stream\"\n",
            primary.addr(),
            rs.addr(),
            root.join("check-log").display()
        ),
    )
    .unwrap();
    let live = || cli(&["check-config", "--live", both_roles.to_str().unwrap()]);
    let (ok, out, err) = live();
    assert!(ok, "every documented right is there: {out}{err}");
    assert_eq!(
        out.matches(": ok").count(),
        3,
        "the file and both logins: {out}"
    );
    for (r, right) in [
        (&primary, "psync"),
        (&primary, "replconf"),
        (&primary, "info"),
        (&primary, "config|get"),
        (&rs, "info"),
        (&rs, "config|get"),
        (&rs, "config|set"),
        (&rs, "replicaof"),
    ] {
        names_missing(r, right, live);
    }
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "the PSYNC probe never started a sync"
    );
    // An agent started without one says so in its log at once.
    let _: () = rs.cmd(&["ACL", "SETUSER", "kvsync", "-replicaof"]);
    let late = agent(
        root,
        "late",
        &root.join("late-snaps"),
        &std::fs::read_to_string(&both_roles)
            .unwrap()
            .replace("snapshot_format = \"redis-rdb\"\n", ""),
        &[],
    );
    wait_for("the missing right in the agent's log", DEADLINE, || {
        let log = late.proc.log();
        (log.contains("lacks rights its role needs") && log.contains("+replicaof")).then_some(())
    });
}

on_both_servers!(acl_users_with_passwords_in_files_carry_the_stream_through_a_rotation);

/// A primary that echoes the arguments of a command it refuses (`AUTH`
/// renamed away): the agent's refused login says as whom it tried and
/// from which file, and neither its log nor its status holds the password.
fn a_server_that_echoes_a_refused_auth_never_gets_the_password_into_the_log(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let secret = "echo-me-s3cret";
    let file = root.join("kvsync.pass");
    std::fs::write(&file, secret).unwrap();
    let primary = Redis::start(server, &root.join("p"), &["--rename-command", "AUTH", ""]);
    let config = format!(
        "[redis]\nprimary_addr = \"{}\"\nuser = \"kvsync\"\npassword_file = \"{}\"\n[stream]\ndir = \"{}\"\n",
        primary.addr(),
        file.display(),
        root.join("src-log").display()
    );
    let source = agent(root, "src", &root.join("src-snaps"), &config, &[]);
    let said = format!(
        "refused the login (user \"kvsync\" with the password in {})",
        file.display()
    );
    wait_for("the refused login in the agent's log", DEADLINE, || {
        source.proc.log().contains(&said).then_some(())
    });
    let log = source.proc.log();
    assert!(
        log.contains("<password>"),
        "the echo, with the password cut out: {log}"
    );
    let status = format!("{:?}", stream_status(&source));
    for (what, text) in [("log", &log), ("status", &status)] {
        assert!(!text.contains(secret), "the password in the {what}: {text}");
    }
}

on_both_servers!(a_server_that_echoes_a_refused_auth_never_gets_the_password_into_the_log);

/// A primary the agent reaches on its TLS port, which asks for client
/// certificates (`tls-auth-clients yes`): the primary's agent follows it
/// (the replication link, `INFO`, the pre-flight of its offer) over TLS
/// with its client certificate, a replica agent seeds and feeds its server
/// from it, a cut link continues with a partial resync, and
/// `check-replica` compares both servers on their TLS ports. The fed
/// server replicates over TLS (`tls-replication yes`): its agent's feed
/// answers it over TLS with the agent's certificate, and after its link is
/// cut too it continues from the log. An agent whose CA is another one is
/// refused, and its log says which setting to check.
fn a_primary_on_its_tls_port_is_followed_over_tls_and_a_wrong_ca_is_refused(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let pki = common::pki::Pki::new(root, "kv");
    let (agent_cert, agent_key) = pki.issue("agent", &["kvsync-agent"]);
    let ca = pki.ca_file();
    // A server with a TLS port beside the plain one the harness uses.
    let with_tls = |dir: &str, extra: &[&str]| {
        let (mut args, port) = pki.server_tls(dir);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        (Redis::start(server, &root.join(dir), &args), port)
    };
    let (primary, tls_port) = with_tls("p", &[]);
    let config = |ca: &Path, log: &str| {
        format!(
            "[redis]\nprimary_addr = \"127.0.0.1:{tls_port}\"\ntls = true\ntls_ca_file = \"{}\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n[stream]\ndir = \"{}\"\nfsync = \"always\"\n",
            ca.display(),
            agent_cert.display(),
            agent_key.display(),
            root.join(log).display()
        )
    };
    let source = source_with(root, &config(&ca, "src-log"), &[]);
    let pidfile = root.join("r").join("redis.pid");
    let (rs, rs_tls) = with_tls("r", &["--pidfile", pidfile.to_str().unwrap()]);
    let served = format!(
        "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
        agent_cert.display(),
        agent_key.display()
    );
    let (rs, replica) = seed_fed(root, rs, &primary, &source, ("rep", "", &served));
    primary.fill("after", 500, "v");
    converged(&rs, &primary, "the fed server to converge");
    let continued = |log: &str| log.matches("the stream feed continues its server").count();
    let before = continued(&replica.proc.log());
    let killed: i64 = rs.cmd(&["CLIENT", "KILL", "TYPE", "master"]);
    assert_eq!(killed, 1, "the fed server's link to its agent");
    primary.fill("after-feed-cut", 500, "v");
    converged(&rs, &primary, "the fed server to converge after its cut");
    wait_for("the feed to continue its server", DEADLINE, || {
        (continued(&replica.proc.log()) > before).then_some(())
    });
    let partial = primary.info("stats").num("sync_partial_ok");
    let killed: i64 = primary.cmd(&["CLIENT", "KILL", "TYPE", "replica"]);
    assert_eq!(killed, 1, "the agent's replication link");
    primary.fill("after-cut", 500, "v");
    converged(&rs, &primary, "the fed server to converge after the cut");
    let stats = primary.info("stats");
    assert_eq!(stats.num("sync_full"), 1, "only the source agent's first");
    assert!(
        stats.num("sync_partial_ok") > partial,
        "the link continued: {stats:?}"
    );
    let (ok, out, err) = cli(&[
        "check-replica",
        "--primary",
        &format!("127.0.0.1:{tls_port}"),
        "--replica",
        &format!("127.0.0.1:{rs_tls}"),
        "--server-tls-ca",
        ca.to_str().unwrap(),
        "--server-tls-cert",
        agent_cert.to_str().unwrap(),
        "--server-tls-key",
        agent_key.to_str().unwrap(),
    ]);
    assert!(ok, "check-replica over TLS: {out}{err}");

    let other = common::pki::Pki::new(root, "other");
    let wrong = agent(
        root,
        "wrong",
        &root.join("wrong-snaps"),
        &config(&other.ca_file(), "wrong-log"),
        &[],
    );
    wait_for(
        "the wrong CA's refusal in the agent's log",
        DEADLINE,
        || {
            let log = wrong.proc.log();
            (log.contains("TLS to the primary") && log.contains("tls_ca_file")).then_some(())
        },
    );
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "nothing more asked of it"
    );
}

on_both_servers!(a_primary_on_its_tls_port_is_followed_over_tls_and_a_wrong_ca_is_refused);

/// A server seeded through its agent (`redis-stream`) loads the snapshot's
/// verified pieces while the rest still arrives: the source stalls at
/// 2.5 MiB of an RDB in 1 MiB pieces, and the server has received exactly
/// the 2 verified MiB from the feed while the sync is still transferring.
/// A stopped sync ends the payload short: the server keeps its own data
/// and is a primary again with its own `masterauth`, and no temp file is
/// left.
fn a_fed_server_loads_the_verified_pieces_while_the_rest_arrives_and_a_stopped_sync_leaves_it_as_it_was(
    server: Server,
) {
    const MIB: u64 = 1 << 20;
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let primary = Redis::start(server, &r.join("p"), &[]);
    primary.fill("key", 100_000, "value-of-some-length");
    let config = follower_config(&primary, &r.join("src-log")) + "[data]\npiece_size = \"1MiB\"\n";
    let source = source_with(r, &config, &[("KVSYNC_FAULTS", "stall_after=2621440")]);
    let size = wait_for("the full resync's RDB offered", DEADLINE, || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(source.status());
        s.instances[0].latest_snapshots.first().map(|e| e.size)
    });
    assert!(size > 3 * MIB, "an RDB of several pieces: {size}");
    let rs = Redis::standalone_replica(server, &r.join("r"));
    let _: () = rs.cmd(&["SET", "own", "1"]);
    let config = feeding_puller_config(&r.join("rep-log"), &source, &rs);
    let replica = agent(r, "rep", &r.join("rep-snaps"), &config, &[]);
    wait_following(&replica);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let id = start_sync(&replica, &source).await;
        wait_for(
            "the server to receive the verified pieces",
            DEADLINE,
            || (rs.info("replication").num("master_sync_read_bytes") == 2 * MIB).then_some(()),
        );
        let i = rs.info("replication");
        assert_eq!(i.num("master_sync_total_bytes"), size, "{i:?}");
        cancel_while_transferring(&replica, &id).await;
    });
    wait_for("the server to be a primary again", DEADLINE, || {
        (rs.info("replication").get("role") == Some("master")).then_some(())
    });
    assert_eq!(
        rs.cmd::<Option<String>>(&["GET", "own"]).as_deref(),
        Some("1")
    );
    assert_eq!(rs.cmd::<u64>(&["DBSIZE"]), 1);
    let auth: Vec<String> = rs.cmd(&["CONFIG", "GET", "masterauth"]);
    assert_eq!(auth[1], "", "its own masterauth (none) again");
    assert_eq!(replica.temp_files(), Vec::<String>::new());
    assert!(replica
        .proc
        .log()
        .contains("seeding the local server while the snapshot arrives"));
}

on_both_servers!(
    a_fed_server_loads_the_verified_pieces_while_the_rest_arrives_and_a_stopped_sync_leaves_it_as_it_was
);

/// The agent started again with the same config file.
fn agent_again(root: &Path, snaps: &Path, config: &str) -> Node {
    agent(root, "src", snaps, config, &[])
}

on_both_servers!(the_primarys_agent_follows_it_into_the_log_and_continues_after_a_restart);

fn a_server_fed_through_two_agents_keeps_up_with_a_writer_and_wait_counts_it(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    let config = format!(
        "{}ack = \"replicas\"\n",
        follower_config(&primary, &root.path().join("src-log"))
    );
    let source = source_with(root.path(), &config, &[]);
    let (rs, replica) = seeded_through_two_agents(root.path(), server, &primary, &source);

    // A writer at a fixed rate (2000 keys a second) for 30 s; meanwhile
    // every write of the main connection is acknowledged by a replica
    // server through both agents.
    let writer = steady_writer(primary.con(), 30, 0);
    let mut con = primary.con();
    let mut waits = 0;
    while !writer.is_finished() {
        let acked = write_and_wait(&mut con, "probe", 10_000);
        assert_eq!(
            acked, 1,
            "WAIT 1 counts the agent once the fed server has the write"
        );
        waits += 1;
    }
    let written = writer.join().unwrap();
    assert!(waits > 10, "{waits} waits");
    converged(&rs, &primary, "the fed server to converge with the primary");
    same_sample(&rs, &primary, written);
    // Each agent shows what its downstream acknowledged; the primary's
    // agent measured the lag from its log to the server's acknowledgement.
    wait_for(
        "the acknowledgements to reach the primary's agent",
        DEADLINE,
        || {
            let end = primary.info("replication").num("master_repl_offset");
            let (src, rep) = (stream_status(&source), stream_status(&replica));
            let fed = |st: &kvsync::rpc::pb::StreamStatus, name: &str| {
                st.downstreams
                    .iter()
                    .any(|d| d.name.starts_with(name) && d.offset == end)
            };
            let behind = source.metric("kvsync_stream_behind_bytes{kv_instance=\"default\"}");
            (fed(&rep, "server") && fed(&src, "agent") && src.acked_offset == end && behind == 0.0)
                .then_some(())
        },
    );
    assert_eq!(stream_status(&source).ack, "replicas");
    // What the dashboard and the alert rules ask of the stream's series,
    // these two agents export.
    let exported = format!("{}{}", source.proc.metrics(), replica.proc.metrics());
    for file in [
        include_str!("../grafana/kvsync-dashboard.json"),
        include_str!("../deploy/kvsync-alerts.yml"),
    ] {
        let names = file
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("kvsync_stream_"));
        for name in names {
            assert!(
                exported.contains(&format!("\n{name}{{")),
                "{name} is not exported"
            );
        }
    }
    assert!(source.metric("kvsync_stream_lag_seconds_count{kv_instance=\"default\"}") > 100.0);

    // The fed server stopped: the primary's agent no longer acknowledges
    // new writes, so WAIT does not count it; it does again once the server
    // runs and has them.
    let pid: i32 = std::fs::read_to_string(rs.dir.join("redis.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) on the test's own server process.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let acked = write_and_wait(&mut con, "while-stopped", 500);
    // Meanwhile status says for how long the server has been behind.
    let behind = stream_status(&source).behind_seconds;
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(acked, 0, "no replica server has the write");
    assert!(behind >= 0.5, "{behind} s behind after WAIT's 500 ms");
    assert_eq!(write_and_wait(&mut con, "after", 10_000), 1);
    wait_for("the server to be behind no more", DEADLINE, || {
        (stream_status(&source).behind_seconds == 0.0).then_some(())
    });
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
}

on_both_servers!(a_server_fed_through_two_agents_keeps_up_with_a_writer_and_wait_counts_it);

fn a_replica_agent_killed_for_longer_than_the_primarys_backlog_continues_its_server(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(
        server,
        &root.path().join("p"),
        &["--repl-backlog-size", "1mb"],
    );
    let source = following_source(root.path(), &primary, &[]);
    let (rs, mut replica) = seeded_through_two_agents(root.path(), server, &primary, &source);
    let process_id = rs.info("server").num("process_id");
    let full = primary.info("stats").num("sync_full");

    // Killed while the primary writes ten times its backlog and more.
    replica.proc.signal(libc::SIGKILL);
    replica.proc.wait_exit();
    let from = primary.info("replication").num("master_repl_offset");
    let written = steady_writer(primary.con(), 10, 600).join().unwrap();
    let wrote = primary.info("replication").num("master_repl_offset") - from;
    assert!(
        wrote > 10 << 20,
        "{wrote} bytes written while the agent was down"
    );

    // Started again: the server continues from the agent's log, which
    // continues from the primary's agent's: no full sync anywhere.
    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &feeding_puller_config(&root.path().join("rep-log"), &source, &rs),
        &[],
    );
    converged(
        &rs,
        &primary,
        "the server to continue after the agent's restart",
    );
    same_sample(&rs, &primary, written);
    assert_eq!(
        rs.info("server").num("process_id"),
        process_id,
        "the same server process"
    );
    assert_eq!(
        primary.info("stats").num("sync_full"),
        full,
        "no full resync of the primary"
    );
    let log = replica.proc.log();
    assert!(log.contains("continues its server from the log"), "{log}");
    assert!(!log.contains("sent its server the RDB"), "{log}");
}

on_both_servers!(a_replica_agent_killed_for_longer_than_the_primarys_backlog_continues_its_server);

/// A crash (of the host, not only the agent) loses what the page cache
/// held of the log: the agent comes back with a log that ends before the
/// offset its server already applied. The server asks for that offset;
/// the feed continues it once the log has fetched up to it from upstream,
/// and serves nothing before: no full sync, nothing applied twice.
fn a_fed_server_ahead_of_its_agents_log_after_a_crash_continues_once_the_log_reaches_it(
    server: Server,
) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    let source = following_source(root.path(), &primary, &[]);
    let (rs, mut replica) = seeded_through_two_agents(root.path(), server, &primary, &source);
    primary.fill("before-crash", 2000, &"v".repeat(100));
    converged(&rs, &primary, "the fed server to converge before the crash");
    let applied = rs.info("replication").num("master_repl_offset");
    let process_id = rs.info("server").num("process_id");
    let full = primary.info("stats").num("sync_full");

    // The crash: the agent killed, and its newest segment loses its last
    // 64 KiB (cut mid-record, as a lost page cache leaves it).
    replica.proc.signal(libc::SIGKILL);
    replica.proc.wait_exit();
    let rep_log = root.path().join("rep-log");
    let newest = segment_files(&rep_log).pop().expect("a segment");
    let len = std::fs::metadata(&newest).unwrap().len();
    assert!(len > 200 << 10, "{len} bytes in the newest segment");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)
        .unwrap();
    file.set_len(len - (64 << 10)).unwrap();
    drop(file);
    primary.fill("after-crash", 300, "w");

    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &feeding_puller_config(&rep_log, &source, &rs),
        &[],
    );
    converged(&rs, &primary, "the server to continue after the crash");
    let log = replica.proc.log();
    let cut_at: u64 = log
        .split("it is cut there")
        .next()
        .and_then(|before| before.rsplit("at offset ").next())
        .and_then(|n| n.trim().trim_end_matches(';').parse().ok())
        .unwrap_or_else(|| panic!("the torn tail is cut: {log}"));
    assert!(
        cut_at < applied,
        "the log ({cut_at}) restarts behind its server ({applied})"
    );
    let value: String = rs.cmd(&["GET", "before-crash:1999"]);
    assert_eq!(value, "v".repeat(100));
    let value: String = rs.cmd(&["GET", "after-crash:299"]);
    assert_eq!(value, "w");
    assert_eq!(rs.info("server").num("process_id"), process_id);
    assert_eq!(primary.info("stats").num("sync_full"), full);
    assert!(log.contains("continues its server from the log"), "{log}");
    assert!(!log.contains("sent its server the RDB"), "{log}");
    wait_logged(&replica, &primary, "the replica agent's log to catch up");
    drop(replica);
    drop(source);
    same_logs(root.path());
}

on_both_servers!(
    a_fed_server_ahead_of_its_agents_log_after_a_crash_continues_once_the_log_reaches_it
);

/// The log's segment files in `dir`, oldest first, each with its length
/// and inode (a file made again has another).
fn segments(dir: &Path) -> Vec<(PathBuf, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    segment_files(dir)
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).unwrap();
            (p, meta.len(), meta.ino())
        })
        .collect()
}

/// Flips one bit in the bytes of the first record of the oldest segment
/// in `dir`; returns that segment and the byte's position and value.
fn damage_oldest_record(dir: &Path) -> (PathBuf, u64, u8) {
    use std::os::unix::fs::FileExt;
    let (segment, ..) = segments(dir).remove(0);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&segment)
        .unwrap();
    // Past the segment's header and the record's.
    let at = (SEGMENT_HEADER + RECORD_HEADER + 3) as u64;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x04], at).unwrap();
    (segment, at, byte[0])
}

/// The byte at `at` of `path`.
fn byte_at(path: &Path, at: u64) -> u8 {
    use std::os::unix::fs::FileExt;
    let mut byte = [0u8];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut byte, at)
        .unwrap();
    byte[0]
}

/// The config lines that make an agent's log several small segments,
/// read from the files by every reader (none of the newest bytes kept in
/// memory), as a reader further behind reads them.
const SMALL_SEGMENTS_FROM_FILES: &str = "memory_tail = \"0\"\nsegment_size = \"1MiB\"\n";

const DAMAGED: &str = "kvsync_stream_checksum_failures_total{kv_instance=\"default\"}";
const MENDED: &str = "kvsync_stream_refetched_total{kv_instance=\"default\",result=\"mended\"}";

/// A record damaged on disk in the oldest of several segments is never
/// served: the source fetches that record alone again from its primary's
/// backlog (a partial resync, no fork) and writes it back in place; the
/// later segments stay as they were.
fn a_record_damaged_in_an_old_segment_is_fetched_again_alone_and_the_rest_kept(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(
        server,
        &root.path().join("p"),
        &["--repl-backlog-size", "64mb"],
    );
    let src_log = root.path().join("src-log");
    let config = format!(
        "{}{SMALL_SEGMENTS_FROM_FILES}",
        follower_config(&primary, &src_log)
    );
    let source = source_with(root.path(), &config, &[]);
    primary.fill("k", 4000, &"v".repeat(1000));
    let end = wait_logged(&source, &primary, "the source agent to log the stream");
    let before = segments(&src_log);
    assert!(before.len() >= 3, "several segments: {before:?}");
    let (damaged_segment, at, byte) = damage_oldest_record(&src_log);
    let stats = primary.info("stats");
    let (full, partial) = (stats.num("sync_full"), stats.num("sync_partial_ok"));
    // A replica agent with an empty log starts where the source's log
    // does, so the source reads the damaged record to serve it.
    let rep_log = root.path().join("rep-log");
    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &puller_config(&source, &rep_log),
        &[],
    );
    wait_for("the source to find the damage", DEADLINE, || {
        (source.metric(DAMAGED) >= 1.0).then_some(())
    });
    assert_eq!(
        wait_logged(
            &replica,
            &primary,
            "the replica agent to hold the whole stream"
        ),
        end
    );
    let stats = primary.info("stats");
    assert_eq!(stats.num("sync_full"), full, "no second full resync");
    assert_eq!(
        stats.num("sync_partial_ok"),
        partial + 1,
        "the record came from the backlog"
    );
    assert_eq!(segments(&src_log), before, "every segment kept as it was");
    assert_eq!(
        byte_at(&damaged_segment, at),
        byte,
        "the damaged byte mended"
    );
    assert_eq!(source.metric(MENDED), 1.0);
    let log = source.proc.log();
    assert!(log.contains("a damaged record in the stream log"), "{log}");
    assert!(log.contains("is mended"), "{log}");
    drop(replica);
    drop(source);
    let rep = same_log(&src_log, &rep_log, end);
    assert!(String::from_utf8_lossy(&rep).contains("k:3999"));
}

on_both_servers!(a_record_damaged_in_an_old_segment_is_fetched_again_alone_and_the_rest_kept);

/// A replica agent's log damaged in an old segment is mended from its
/// upstream agent's log (its primary's backlog no longer holds the range):
/// the relay serves a leaf agent every byte, and keeps its segments. The
/// mend's session is the relay's second at its source, which allows one
/// per host (attack: that cap refused the mend, and the log was cut).
#[test]
fn a_record_damaged_in_a_relays_log_is_fetched_again_from_its_upstream_agent() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(
        Server::Redis,
        &root.path().join("p"),
        &["--repl-backlog-size", "1mb"],
    );
    let config = format!(
        "{}max_sessions_per_host = 1\n",
        follower_config(&primary, &root.path().join("src-log"))
    );
    let source = source_with(root.path(), &config, &[]);
    let relay_log = root.path().join("relay-log");
    let relay = agent(
        root.path(),
        "relay",
        &root.path().join("relay-snaps"),
        &format!(
            "{}{SMALL_SEGMENTS_FROM_FILES}",
            puller_config(&source, &relay_log)
        ),
        &[],
    );
    primary.fill("k", 4000, &"v".repeat(1000));
    let end = wait_logged(&relay, &primary, "the relay to log the stream");
    let before = segments(&relay_log);
    assert!(before.len() >= 3, "several segments: {before:?}");
    let (damaged_segment, at, byte) = damage_oldest_record(&relay_log);
    let full = primary.info("stats").num("sync_full");
    let leaf_log = root.path().join("leaf-log");
    let leaf = agent(
        root.path(),
        "leaf",
        &root.path().join("leaf-snaps"),
        &puller_config(&relay, &leaf_log),
        &[],
    );
    wait_for("the relay to find the damage", DEADLINE, || {
        (relay.metric(DAMAGED) >= 1.0).then_some(())
    });
    assert_eq!(
        wait_logged(&leaf, &primary, "the leaf agent to hold the whole stream"),
        end
    );
    assert_eq!(primary.info("stats").num("sync_full"), full);
    assert_eq!(segments(&relay_log), before, "every segment kept as it was");
    assert_eq!(
        byte_at(&damaged_segment, at),
        byte,
        "the damaged byte mended"
    );
    assert_eq!(relay.metric(MENDED), 1.0);
    drop(leaf);
    drop(relay);
    drop(source);
    let src_log = root.path().join("src-log");
    same_log(&src_log, &relay_log, end);
    same_log(&src_log, &leaf_log, end);
}

/// The live stream is served from the log's newest bytes in memory: a
/// replica agent that keeps up never makes its source read a file. One
/// that starts behind a restarted source (whose memory holds nothing of
/// what it logged before) is served from the files, the same bytes.
#[test]
fn the_live_stream_is_served_from_memory_and_a_reader_behind_it_from_the_files() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let src_log = root.path().join("src-log");
    let config = follower_config(&primary, &src_log);
    let mut source = source_with(root.path(), &config, &[]);
    let replica_of = |source: &Node, name: &str| {
        let log = root.path().join(format!("{name}-log"));
        let snaps = root.path().join(format!("{name}-snaps"));
        (
            agent(root.path(), name, &snaps, &puller_config(source, &log), &[]),
            log,
        )
    };
    let (replica, _) = replica_of(&source, "rep");
    primary.fill("k", 1000, "value-of-the-stream");
    wait_logged(&replica, &primary, "the replica agent to hold the stream");
    let read = |agent: &Node, from: &str| {
        agent.metric(&format!(
            "kvsync_stream_read_bytes_total{{from=\"{from}\",kv_instance=\"default\"}}"
        ))
    };
    assert!(read(&source, "memory") > 0.0);
    assert_eq!(
        read(&source, "file"),
        0.0,
        "no file read for the live stream"
    );
    drop(replica);
    source.proc.signal(libc::SIGTERM);
    assert_eq!(source.proc.wait_exit(), Some(0));
    drop(source);
    let source = source_with(root.path(), &config, &[]);
    let (late, late_log) = replica_of(&source, "late");
    let end = wait_logged(&late, &primary, "the late replica agent to hold the stream");
    assert!(
        read(&source, "file") > 0.0,
        "what it logged before is read from the files"
    );
    drop(late);
    drop(source);
    same_log(&src_log, &late_log, end);
}

/// Asserts that the log in `copy` holds the log in `dir` byte for byte,
/// from where it starts to `end`; returns its bytes.
fn same_log(dir: &Path, copy: &Path, end: u64) -> Vec<u8> {
    let (first, src) = log_bytes(dir);
    let (copy_first, bytes) = log_bytes(copy);
    assert_eq!((copy_first, first + src.len() as u64), (first, end));
    assert!(bytes == src, "the copy's log is the stream, byte for byte");
    bytes
}

/// The attack client: `n` stream sessions asked for from `from` (a
/// loopback address of its own), each proved on the data plane and then
/// never read. Returns the links held and how many asks were refused.
async fn idle_sessions(
    source: &Node,
    from: std::net::IpAddr,
    n: usize,
) -> (Vec<kvsync::transport::stream::StreamLink>, usize) {
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", source.grpc()))
        .unwrap()
        .local_address(Some(from))
        .connect()
        .await
        .unwrap();
    let mut client = kvsync::rpc::pb::peer_client::PeerClient::new(channel);
    let (mut held, mut refused) = (Vec::new(), 0);
    for i in 0..n {
        let ask = kvsync::rpc::pb::OpenStreamRequest {
            replica_node_id: format!("greedy-{i}"),
            ..Default::default()
        };
        let offer = match client.open_stream(ask).await {
            Ok(offer) => offer.into_inner(),
            Err(_) => {
                refused += 1;
                continue;
            }
        };
        let token = offer.session_token.as_slice().try_into().unwrap();
        let endpoint = offer.data_endpoint.parse().unwrap();
        let link = kvsync::transport::stream::StreamLink::dial(
            endpoint,
            None,
            token,
            std::time::Duration::from_secs(600),
        )
        .await
        .unwrap();
        held.push(link);
    }
    (held, refused)
}

/// Attack (review): one peer token took every stream session (256) and
/// ~2 GB of the source (each idle session pinned its window), and a real
/// replica got RESOURCE_EXHAUSTED while they were held. Sessions are
/// bounded per host, buffer at most a frame each, and one that takes
/// nothing while the log holds more is ended.
#[test]
fn idle_stream_sessions_from_one_peer_neither_starve_a_real_replica_nor_the_sources_memory() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let config = follower_config(&primary, &root.path().join("src-log"))
        + "stall_timeout = \"1s\"\nstall_end = \"4s\"\n";
    let source = source_with(root.path(), &config, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let greedy = std::net::IpAddr::from([127, 0, 0, 2]);
    let (held, refused) = rt.block_on(idle_sessions(&source, greedy, 300));
    assert!(refused > 0, "the greedy host is refused past its cap");
    let before = peak_rss(source.proc.child.id());
    primary.fill("k", 40_000, &"v".repeat(1000));
    let replica = pulling_agent(root.path(), &source);
    wait_logged(&replica, &primary, "the real replica to be served");
    let grew = peak_rss(source.proc.child.id()).saturating_sub(before);
    assert!(
        grew < 128 << 20,
        "{} idle sessions grew the source by {grew} bytes",
        held.len()
    );
    // The idle sessions are ended: only the real replica is served.
    wait_for("the idle sessions to be ended", DEADLINE, || {
        (stream_status(&source).serving == 1).then_some(())
    });
    let ended = source
        .metric("kvsync_stream_refused_total{kv_instance=\"default\",reason=\"no_progress\"}");
    assert!(ended >= 1.0, "{ended}");
    drop(held);
}

/// Attack (review): one flipped bit in the oldest segment kept the agent
/// down (exit 1, every instance with it) until files were deleted by hand.
/// It starts, sets the segment aside, says so, and serves the rest.
#[test]
fn a_damaged_old_segment_is_set_aside_on_restart_and_the_rest_served() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let src_log = root.path().join("src-log");
    let config = format!(
        "{}segment_size = \"1MiB\"\n",
        follower_config(&primary, &src_log)
    );
    let mut source = source_with(root.path(), &config, &[]);
    primary.fill("k", 3500, &"v".repeat(1000));
    wait_logged(&source, &primary, "the source agent to log 3.5 MB");
    source.proc.signal(libc::SIGKILL);
    source.proc.wait_exit();
    let segments = segment_files(&src_log);
    assert!(segments.len() >= 3, "{segments:?}");
    // The offset field of the oldest segment's first record header.
    let mut b = std::fs::read(&segments[0]).unwrap();
    b[SEGMENT_HEADER + 3] ^= 1;
    std::fs::write(&segments[0], b).unwrap();

    let source = source_with(root.path(), &config, &[]);
    let st = stream_status(&source);
    assert_eq!(st.set_aside.len(), 1, "{st:?}");
    assert!(
        st.set_aside[0].contains("00000000000000000000.kvslog."),
        "{st:?}"
    );
    let second: u64 = segments[1]
        .file_stem()
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(st.first_offset, second, "{st:?}");
    assert_eq!(
        source.metric("kvsync_stream_files_set_aside{kv_instance=\"default\"}"),
        1.0
    );
    // The rest is served: a replica agent follows from the log's start.
    primary.fill("after", 100, "w");
    let replica = pulling_agent(root.path(), &source);
    wait_logged(&replica, &primary, "the replica agent to follow the rest");
    assert_eq!(stream_status(&replica).first_offset, second);
}

fn a_full_log_disk_stops_logging_with_an_error_and_leaves_the_primary_alone(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let Some(fs) = SmallFs::mount(&root.path().join("logfs"), "2m") else {
        return;
    };
    let primary = Redis::start(
        server,
        &root.path().join("p"),
        &["--repl-backlog-size", "64mb"],
    );
    let log_dir = fs.0.join("log");
    let config = follower_config(&primary, &log_dir);
    let source = source_with(root.path(), &config, &[]);
    // The log's disk nearly full: a few hundred KiB are left.
    let filler = fs.0.join("filler");
    std::fs::write(&filler, vec![0u8; 1700 << 10]).unwrap();
    let big = "v".repeat(1000);
    primary.fill("k", 2000, &big);
    let errors = "kvsync_stream_log_write_errors_total{kv_instance=\"default\"}";
    wait_for("the agent to report the full log disk", DEADLINE, || {
        (source.metric(errors) >= 1.0).then_some(())
    });
    // The primary takes writes as ever; the agent never acknowledges what
    // its log does not hold, and says why.
    primary.fill("more", 100, "v");
    let st = stream_status(&source);
    let end = primary.info("replication").num("master_repl_offset");
    assert!(st.end_offset < end, "{st:?}");
    assert!(
        replica_offset(&primary).unwrap_or(0) <= st.end_offset,
        "an acknowledgement past the log's end"
    );
    assert!(
        source.proc.log().contains("No space left on device"),
        "the operator is told"
    );
    // Space again: the log continues from where it stood, without a fork.
    std::fs::remove_file(&filler).unwrap();
    let end = wait_logged(&source, &primary, "the log to catch up once there is space");
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "no second full resync"
    );
    drop(source);
    let (first, bytes) = log_bytes(&log_dir);
    assert_eq!(first + bytes.len() as u64, end, "the log is continuous");
    assert!(String::from_utf8_lossy(&bytes).contains("more:99"));
}

on_both_servers!(a_full_log_disk_stops_logging_with_an_error_and_leaves_the_primary_alone);

/// `kvsync stream release` of `agent`'s server to `primary`.
fn release(agent: &str, primary: &Redis) -> (bool, String, String) {
    cli(&[
        "stream",
        "release",
        "--agent",
        agent,
        "--primary",
        &primary.addr(),
    ])
}

fn a_fed_server_is_released_to_the_primary_and_attached_back_without_a_full_resync(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    let source = following_source(root.path(), &primary, &[]);
    let (rs, replica) = seeded_through_two_agents(root.path(), server, &primary, &source);
    let agent = replica.grpc();
    let feed_port = rs.info("replication").num("master_port");
    let stats = || {
        let s = primary.info("stats");
        (s.num("sync_full"), s.num("sync_partial_ok"))
    };
    let (full, partial) = stats();
    // Both hand overs happen while the primary writes.
    let writer = steady_writer(primary.con(), 8, 0);

    let (ok, _, err) = cli(&["stream", "attach", "--agent", &agent]);
    assert!(
        !ok && err.contains("follows this agent's stream feed already"),
        "{err}"
    );
    let (ok, out, err) = release(&agent, &primary);
    assert!(ok, "{err}");
    assert!(out.contains("partial resync from offset"), "{out}");
    let repl = rs.info("replication");
    assert_eq!(repl.num("master_port"), primary.port as u64, "{out}");
    assert_eq!(stats(), (full, partial + 1), "the primary continued it");
    let (ok, _, err) = release(&agent, &primary);
    assert!(
        !ok && err.contains("does not follow this agent's stream feed"),
        "{err}"
    );

    let continued = |n: &Node| {
        n.proc
            .log()
            .matches("continues its server from the log")
            .count()
    };
    let before = continued(&replica);
    let (ok, out, err) = cli(&["stream", "attach", "--agent", &agent]);
    assert!(ok, "{err}");
    assert!(
        out.contains("follows this agent's stream log again"),
        "{out}"
    );
    assert_eq!(continued(&replica), before + 1);
    let repl = rs.info("replication");
    assert_eq!(repl.get("master_link_status"), Some("up"));
    assert_eq!(repl.num("master_port"), feed_port, "the agent's feed again");

    let written = writer.join().unwrap();
    converged(&rs, &primary, "the attached server to converge");
    same_sample(&rs, &primary, written);
    assert_eq!(stats().0, full, "no full resync of the primary");
    let log = replica.proc.log();
    assert_eq!(
        log.matches("sent its server the RDB").count(),
        1,
        "only the seeding: {log}"
    );
}

on_both_servers!(a_fed_server_is_released_to_the_primary_and_attached_back_without_a_full_resync);

#[test]
fn a_hand_over_that_would_be_a_full_resync_is_refused_and_changes_nothing() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(
        Server::Redis,
        &root.path().join("p"),
        &["--repl-backlog-size", "1mb"],
    );
    let mut source = following_source(root.path(), &primary, &[]);
    // The replica agent knows the primary from its configuration: the
    // agent that would vouch for it is down below.
    let servers = format!("servers = [\"{}\"]\n", primary.addr());
    let (rs, replica) =
        seeded_through_two_agents_with(root.path(), Server::Redis, &primary, &source, &servers);
    let agent = replica.grpc();
    let feed_port = rs.info("replication").num("master_port");
    // The stream stops at the primary's agent while the primary writes
    // three times its backlog: the server's offset is gone from it.
    source.proc.signal(libc::SIGKILL);
    source.proc.wait_exit();
    primary.fill("past", 3000, &"v".repeat(1000));
    let (ok, _, err) = release(&agent, &primary);
    assert!(!ok && err.contains("backlog starts at offset"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    let repl = rs.info("replication");
    assert_eq!(repl.num("master_port"), feed_port, "still fed by the agent");
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
    // A server that is no replica is not taken onto the log.
    let _: () = rs.cmd(&["REPLICAOF", "NO", "ONE"]);
    let (ok, _, err) = cli(&["stream", "attach", "--agent", &agent]);
    assert!(!ok && err.contains("is not a replica"), "{err}");
    assert_eq!(rs.info("replication").get("role"), Some("master"));
}

fn a_stream_tree_converges_and_children_re_parent_from_their_offsets_when_their_relay_dies(
    server: Server,
) {
    // origin → relays a, b; a → c, d (fan-out degree 2), c and d feeding
    // servers; then a is killed and c, d turn to the origin.
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let primary = Redis::start(server, &r.join("p"), &[]);
    let origin = following_source(r, &primary, &[]);
    primary.fill("before", 500, "v");
    wait_for("the full resync's RDB offered", DEADLINE, || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(origin.status());
        (!s.instances[0].latest_snapshots.is_empty()).then_some(())
    });
    let relay = |name: &str| {
        let log = r.join(format!("{name}-log"));
        agent(
            r,
            name,
            &r.join(format!("{name}-snaps")),
            &puller_config(&origin, &log),
            &[],
        )
    };
    let (mut a, b) = (relay("a"), relay("b"));
    let servers = [
        Redis::standalone_replica(server, &r.join("rc")),
        Redis::standalone_replica(server, &r.join("rd")),
    ];
    let leaves: Vec<Node> = ["c", "d"]
        .iter()
        .zip(&servers)
        .map(|(name, rs)| {
            let config = feeding_puller_config(&r.join(format!("{name}-log")), &origin, rs);
            agent(r, name, &r.join(format!("{name}-snaps")), &config, &[])
        })
        .collect();
    let source = origin.grpc();
    let mut args = vec!["fanout", "--source", &source, "--degree", "2", "--stream"];
    let names: Vec<String> = [&a, &b, &leaves[0], &leaves[1]]
        .iter()
        .map(|n| n.grpc())
        .collect();
    for n in &names {
        args.extend(["--replica", n]);
    }
    args.extend(["--wait", "--json"]);
    let (ok, out, err) = cli(&args);
    assert!(ok, "{out}\n{err}");

    // The leaves follow a, which follows the origin.
    let follows = |n: &Node, up: &Node| {
        let st = stream_status(n);
        st.state == format!("following agent {}", up.grpc())
    };
    for leaf in &leaves {
        wait_for("a leaf to follow its relay", DEADLINE, || {
            follows(leaf, &a).then_some(())
        });
        assert_eq!(stream_status(leaf).upstreams, [a.grpc(), origin.grpc()]);
    }
    assert_eq!(stream_status(&a).upstreams, [origin.grpc()]);
    primary.fill("tree", 2000, "value-through-the-tree");
    for rs in &servers {
        converged(rs, &primary, "a leaf's server to converge through the tree");
    }
    wait_for("the origin to serve the two relays", DEADLINE, || {
        (stream_status(&origin).serving == 2 && stream_status(&a).serving == 2).then_some(())
    });

    // The relay dies: its children continue from their offsets, from the
    // origin, and their servers never need a full sync.
    a.proc.signal(libc::SIGKILL);
    a.proc.wait_exit();
    primary.fill("after-relay", 2000, "value-after-the-relay");
    for (leaf, rs) in leaves.iter().zip(&servers) {
        wait_for("a leaf to re-parent to the origin", DEADLINE, || {
            follows(leaf, &origin).then_some(())
        });
        converged(
            rs,
            &primary,
            "a leaf's server to converge after its relay died",
        );
        let value: String = rs.cmd(&["GET", "after-relay:1999"]);
        assert_eq!(value, "value-after-the-relay");
        let log = leaf.proc.log();
        assert_eq!(
            log.matches("sent its server the RDB").count(),
            1,
            "only the seeding: {log}"
        );
        assert!(stream_status(leaf).reconnects >= 1);
    }
    assert_eq!(stream_status(&origin).serving, 3, "b, c and d");
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the origin's"
    );
    drop(b);
}

on_both_servers!(
    a_stream_tree_converges_and_children_re_parent_from_their_offsets_when_their_relay_dies
);

#[test]
fn the_primarys_write_safety_is_watched_degraded_while_no_replica_acknowledges_and_restored() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(
        Server::Redis,
        &root.path().join("p"),
        &[
            "--min-replicas-to-write",
            "1",
            "--min-replicas-max-lag",
            "2",
        ],
    );
    // `ack = "replicas"` with no server fed: the agent never acknowledges,
    // so the primary counts no good replica and refuses writes.
    let log_dir = root.path().join("src-log");
    let config = format!(
        "{}ack = \"replicas\"\n",
        follower_config(&primary, &log_dir)
    );
    let mut source = source_with(root.path(), &config, &[]);
    let degraded = "kvsync_stream_write_safety_degraded{kv_instance=\"default\"}";
    let st = wait_for("the write safety to be degraded", DEADLINE, || {
        let st = stream_status(&source);
        // Degraded for a few seconds: past the first moments after the
        // full resync, when the primary still counts the agent as fresh.
        let secs = st
            .write_safety
            .strip_prefix("degraded for ")
            .and_then(|r| r.split(' ').next()?.parse::<u64>().ok());
        (secs >= Some(3) && source.metric(degraded) == 1.0).then_some(st)
    });
    assert!(
        st.write_safety.contains("min-replicas-to-write asks 1"),
        "{st:?}"
    );
    let refused = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query::<()>(&mut primary.con());
    assert!(format!("{refused:?}").contains("NOREPLICAS"), "{refused:?}");
    source.proc.signal(libc::SIGTERM);
    source.proc.wait_exit();

    // The default `ack = "log"`: the agent counts once the bytes are in its
    // log, so the condition holds again.
    let source = source_with(root.path(), &follower_config(&primary, &log_dir), &[]);
    wait_for("the write safety to hold", DEADLINE, || {
        let st = stream_status(&source);
        (st.write_safety.starts_with("holds: 1 replicas") && source.metric(degraded) == 0.0)
            .then_some(())
    });
    let _: () = primary.cmd(&["SET", "k", "v"]);
}

#[test]
fn a_replica_that_acknowledges_slowly_stalls_the_sources_credit_and_loses_nothing() {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let source = following_source(root.path(), &primary, &[]);
    // The replica acknowledges once a second: the source fills its 4 MiB
    // credit window and waits.
    let replica = agent(
        root.path(),
        "rep",
        &root.path().join("rep-snaps"),
        &puller_config(&source, &root.path().join("rep-log")),
        &[("KVSYNC_FAULTS", "stream_ack_on_tick=1")],
    );
    wait_following(&replica);
    primary.fill("big", 12_000, &"v".repeat(1000));
    wait_logged(&replica, &primary, "the replica agent to log everything");
    let stalls = source.metric("kvsync_stream_credit_stalls_total{kv_instance=\"default\"}");
    assert!(stalls >= 1.0, "{stalls} credit stalls");
    drop(replica);
    drop(source);
    assert!(
        log_bytes(&root.path().join("rep-log")) == log_bytes(&root.path().join("src-log")),
        "the replica's log is the source's, byte for byte"
    );
}

#[test]
fn a_replica_agent_stopped_past_the_stall_timeout_is_marked_lagging_the_primary_goes_on_and_it_catches_up_in_full_frames(
) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
    let config =
        follower_config(&primary, &root.path().join("src-log")) + "stall_timeout = \"1s\"\n";
    let source = source_with(root.path(), &config, &[]);
    let replica = pulling_agent(root.path(), &source);
    wait_following(&replica);
    primary.fill("first", 100, "v");
    wait_logged(&replica, &primary, "the replica agent to follow");
    let lagging = "kvsync_stream_lagging_downstreams{kv_instance=\"default\"}";
    assert_eq!(source.metric(lagging), 0.0);
    // The replica agent stops taking the stream (SIGSTOP) while the
    // primary writes far more than the 4 MiB credit window, 16 writes at a
    // time: the source's log takes them as many small records, and its
    // window fills with as many small frames.
    replica.proc.signal(libc::SIGSTOP);
    let mut con = primary.con();
    for i in 0..1_250 {
        let mut p = redis::pipe();
        for j in 0..16 {
            p.cmd("SET")
                .arg(format!("big:{i}:{j}"))
                .arg("v".repeat(1000))
                .ignore();
        }
        p.query::<()>(&mut con).unwrap();
    }
    wait_for("the stopped agent to be marked lagging", DEADLINE, || {
        let st = stream_status(&source);
        (source.metric(lagging) == 1.0 && st.lagging.len() == 1).then_some(st)
    });
    // The primary is not slowed: its writes go on while the source's log
    // keeps the stream.
    primary.fill("meanwhile", 500, "v");
    wait_logged(
        &source,
        &primary,
        "the source to log while the replica is stopped",
    );
    // Its catch-up goes in full frames, however the window was cut up
    // when it stopped (a frame per small record of the live tail): a
    // window refilled a sliver at a time would re-read and re-check a
    // record of the log per sliver and crawl.
    let frames = "kvsync_stream_frames_total{kv_instance=\"default\",role=\"source\"}";
    let bytes = "kvsync_stream_bytes_total{kv_instance=\"default\",role=\"source\"}";
    let before = (source.metric(frames), source.metric(bytes));
    replica.proc.signal(libc::SIGCONT);
    wait_logged(&replica, &primary, "the replica agent to catch up");
    wait_for("the lagging mark to clear", DEADLINE, || {
        (source.metric(lagging) == 0.0 && stream_status(&source).lagging.is_empty()).then_some(())
    });
    let (sent_frames, sent) = (
        source.metric(frames) - before.0,
        source.metric(bytes) - before.1,
    );
    assert!(
        sent > 16e6 && sent / sent_frames >= 256.0 * 1024.0,
        "the catch-up sent {sent} bytes in {sent_frames} frames: a mean of {} bytes",
        sent / sent_frames
    );
    drop(replica);
    drop(source);
    assert!(
        log_bytes(&root.path().join("rep-log")) == log_bytes(&root.path().join("src-log")),
        "the replica's log is the source's, byte for byte"
    );
}

#[test]
fn a_replica_agent_too_old_for_its_upstream_is_re_seeded_from_the_snapshot_it_names() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    // The primary's backlog holds far more than the log: the snapshot
    // offered later passes the backlog guard.
    let primary = Redis::start(
        Server::Redis,
        &r.join("p"),
        &["--repl-backlog-size", "64mb"],
    );
    let config = format!(
        "{}segment_size = \"1MiB\"\nretain = \"1MiB\"\n",
        follower_config(&primary, &r.join("src-log"))
    );
    let source = source_with(r, &config, &[]);
    let (rs, mut replica) =
        seeded_through_two_agents_with(r, Server::Redis, &primary, &source, "reseed = true\n");
    let left_at = stream_status(&replica).end_offset;
    replica.proc.signal(libc::SIGKILL);
    replica.proc.wait_exit();

    // While it is down the source offers a newer snapshot instead of its
    // first, and its log moves past where the replica agent stopped.
    primary.fill("while-down", 3000, &"v".repeat(1000));
    let rdb = primary.bgsave();
    let snaps = r.join("src-snaps");
    std::fs::copy(&rdb, r.join("newer.rdb")).unwrap();
    std::fs::rename(r.join("newer.rdb"), snaps.join("newer.rdb")).unwrap();
    for e in std::fs::read_dir(&snaps).unwrap() {
        let path = e.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("stream-")
        {
            std::fs::remove_file(path).unwrap();
        }
    }
    primary.fill("after-save", 3000, &"w".repeat(1000));
    wait_for(
        "the source's log to move past the replica agent's",
        DEADLINE,
        || (stream_status(&source).first_offset > left_at).then_some(()),
    );

    // Started again: too old, so its log starts over at the newer
    // snapshot, which it syncs and feeds its server.
    let replica = agent(
        r,
        "rep",
        &r.join("rep-snaps"),
        &feeding_puller_config(&r.join("rep-log"), &source, &rs).replacen(
            "[handoff]",
            "reseed = true\n[handoff]",
            1,
        ),
        &[],
    );
    converged(&rs, &primary, "the re-seeded server to converge");
    let value: String = rs.cmd(&["GET", "after-save:2999"]);
    assert_eq!(value, "w".repeat(1000));
    let log = replica.proc.log();
    assert!(log.contains("re-seeding"), "{log}");
    assert_eq!(log.matches("sent its server the RDB").count(), 1, "{log}");
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
}

/// Waits until `rs` on host 1 has applied everything `primary` on host 0
/// wrote and holds as many keys.
fn converged_across(hosts: &Hosts, rs: &Redis, primary: &Redis, what: &str) {
    wait_for(what, DEADLINE, || {
        let (end, keys) = hosts.run_in(0, || {
            (
                primary.info("replication").num("master_repl_offset"),
                primary.cmd::<i64>(&["DBSIZE"]),
            )
        });
        let (at, has) = hosts.run_in(1, || {
            (
                rs.info("replication").num("master_repl_offset"),
                rs.cmd::<i64>(&["DBSIZE"]),
            )
        });
        (at == end && has == keys).then_some(())
    })
}

/// [`same_sample`] across hosts.
fn same_sample_across(hosts: &Hosts, rs: &Redis, primary: &Redis, written: usize) {
    let keys: Vec<String> = (0..written)
        .step_by(written / 100)
        .map(|i| format!("w:{i}"))
        .collect();
    let dumps = |r: &Redis| {
        keys.iter()
            .map(|k| r.cmd::<Vec<u8>>(&["DUMP", k]))
            .collect::<Vec<_>>()
    };
    let want = hosts.run_in(0, || dumps(primary));
    assert!(
        hosts.run_in(1, || dumps(rs)) == want,
        "the sampled keys differ"
    );
}

/// The primary's agent's fixed gRPC port on host 0, so that it can be
/// started again where its replica agent calls it.
const SOURCE_PORT: u16 = 7700;

/// A link cut between the two agents' hosts while the primary writes
/// several times its backlog (the primary with its agent on host 0, the
/// replica agent with its server on host 1): once the link is back, the
/// replica agent continues from the primary's agent's log and its server
/// from the replica agent's, with no full sync anywhere; then the same
/// with the primary's agent restarted during the cut.
fn a_link_cut_between_the_agents_for_longer_than_the_primarys_backlog_continues_from_the_log(
    server: Server,
) {
    let Some(hosts) = Hosts::create("stream link cut") else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let backlog = 1 << 20;
    let primary = hosts.run_in(0, || {
        let p = Redis::start(server, &r.join("p"), &["--repl-backlog-size", "1mb"]);
        p.fill("before", 500, "v");
        p
    });
    // A dead peer is noticed within 5 s on both sides.
    let timeout = "[data]\npeer_timeout = \"5s\"\n";
    let source_config = format!("{}{timeout}", follower_config(&primary, &r.join("src-log")));
    let start_source = || {
        hosts.run_in(0, || {
            let source = agent_at(
                r,
                "src",
                &r.join("src-snaps"),
                &source_config,
                IPS[0],
                SOURCE_PORT,
            );
            wait_following(&source);
            source
        })
    };
    let mut source = start_source();
    let (rs, replica) = hosts.run_in(1, || {
        let rs = Redis::standalone_replica(server, &r.join("r"));
        let config = format!(
            "{}{timeout}",
            feeding_puller_config(&r.join("rep-log"), &source, &rs)
        );
        let replica = agent_at(r, "rep", &r.join("rep-snaps"), &config, IPS[1], 0);
        wait_following(&replica);
        let p = block_on(sync_from(&replica, &source.grpc()));
        assert_eq!(p.phase, kvsync::rpc::pb::Phase::Succeeded as i32, "{p:?}");
        (rs, replica)
    });
    converged_across(
        &hosts,
        &rs,
        &primary,
        "the fed server to converge after seeding",
    );
    let process_id = hosts.run_in(1, || rs.info("server").num("process_id"));
    let reconnects = || {
        hosts.run_in(1, || {
            replica
                .metric("kvsync_stream_reconnects_total{kv_instance=\"default\",source=\"agent\"}")
        })
    };
    // Writes of several times the primary's backlog while the replica
    // agent's host is cut off; `restart` runs during the cut.
    let cut_while_writing = |restart: &mut dyn FnMut()| {
        let before = reconnects();
        let con = hosts.run_in(0, || primary.con());
        let offset = || hosts.run_in(0, || primary.info("replication").num("master_repl_offset"));
        let from = offset();
        hosts.set_link(1, false);
        let written = steady_writer(con, 4, 600).join().unwrap();
        let held = hosts.run_in(1, || rs.info("replication").num("master_repl_offset"));
        assert!(held < offset(), "the cut holds the stream back");
        restart();
        hosts.set_link(1, true);
        assert!(
            offset() - from > 4 * backlog,
            "{} bytes written during the cut",
            offset() - from
        );
        converged_across(
            &hosts,
            &rs,
            &primary,
            "the fed server to continue after the cut",
        );
        same_sample_across(&hosts, &rs, &primary, written);
        assert!(
            reconnects() > before,
            "the replica agent's session broke and it asked again"
        );
    };
    cut_while_writing(&mut || {});
    // The primary's agent killed and started again during the cut: it
    // continues from its log, and so does its replica agent.
    cut_while_writing(&mut || {
        source.proc.signal(libc::SIGKILL);
        source.proc.wait_exit();
        source = start_source();
    });
    let (full, partial) = hosts.run_in(0, || {
        let stats = primary.info("stats");
        (stats.num("sync_full"), stats.num("sync_partial_ok"))
    });
    assert_eq!(full, 1, "only the primary's agent's first sync was full");
    assert!(
        partial >= 1,
        "the restarted agent continued by a partial resync"
    );
    assert_eq!(
        hosts.run_in(1, || rs.info("server").num("process_id")),
        process_id,
        "the same server process"
    );
    let log = replica.proc.log();
    assert_eq!(
        log.matches("sent its server the RDB").count(),
        1,
        "one full sync of the server, the seeding: {log}"
    );
}

on_both_servers!(
    a_link_cut_between_the_agents_for_longer_than_the_primarys_backlog_continues_from_the_log
);

/// A server seeded through two agents (`redis-stream`) after the primary
/// wrote several times its backlog since the full resync's RDB: the
/// primary's backlog no longer holds M+1, but the primary's agent's log
/// continues the RDB, and the server is fed from that log, so the seeding
/// is offered and the server converges with no second full sync.
#[test]
fn a_stream_seeding_needs_the_log_to_continue_the_snapshot_not_the_primarys_backlog() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let primary = Redis::start(Server::Redis, &r.join("p"), &["--repl-backlog-size", "1mb"]);
    let source = following_source(r, &primary, &[]);
    wait_for("the full resync's RDB offered", DEADLINE, || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(source.status());
        (!s.instances[0].latest_snapshots.is_empty()).then_some(())
    });
    let from = primary.info("replication").num("master_repl_offset");
    steady_writer(primary.con(), 3, 600).join().unwrap();
    let wrote = primary.info("replication").num("master_repl_offset") - from;
    assert!(wrote > 3 << 20, "{wrote} bytes past the RDB");
    let (rs, _replica) = seeded_through_two_agents(r, Server::Redis, &primary, &source);
    converged(&rs, &primary, "the fed server to converge");
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
}

/// `[transport]` of an agent whose RDMA is the emulated fabric (the host
/// has no RDMA; the same code runs over soft-RoCE in the VM tests).
const EMULATED_RDMA: &str = "[transport]\nrdma_provider = \"emulated\"\n";

/// The primary's agent on the emulated fabric, with `stream` added to its
/// `[stream]`, once it follows.
fn emulated_source(root: &Path, primary: &Redis, stream: &str, env: &[(&str, &str)]) -> Node {
    let config = follower_config(primary, &root.join("src-log")) + stream + EMULATED_RDMA;
    source_with(root, &config, env)
}

/// The replica agent's and the source's logs hold the same stream.
fn same_logs(root: &Path) {
    let (first, src) = log_bytes(&root.join("src-log"));
    let (rep_first, rep) = log_bytes(&root.join("rep-log"));
    let skip = (rep_first - first) as usize;
    assert!(
        rep[..] == src[skip..skip + rep.len()],
        "the replica agent's log is the source's, byte for byte"
    );
}

fn a_server_fed_through_an_rdma_ring_converges_and_wait_counts_it(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let primary = Redis::start(server, &root.path().join("p"), &[]);
    let source = emulated_source(root.path(), &primary, "ack = \"replicas\"\n", &[]);
    let (rs, replica) =
        seeded_through_two_agents_with(root.path(), server, &primary, &source, EMULATED_RDMA);
    let mut con = primary.con();
    for i in 0..50 {
        // Each write reaches the server through the ring before WAIT
        // answers: the primary's agent acknowledges what the servers below
        // it applied, which reaches it in the ring's answers.
        assert_eq!(write_and_wait(&mut con, &format!("ring:{i}"), 10_000), 1);
    }
    primary.fill("bulk", 3000, "through-the-ring");
    converged(&rs, &primary, "the fed server to converge through the ring");
    let st = stream_status(&replica);
    assert!(st.state.contains("through an RDMA ring"), "{st:?}");
    assert!(
        replica
            .metric(r#"kvsync_stream_ring_sessions_total{kv_instance="default",role="replica"}"#)
            >= 1.0
    );
    assert_eq!(
        source.metric(r#"kvsync_stream_ring_sessions_total{kv_instance="default",role="source"}"#),
        replica
            .metric(r#"kvsync_stream_ring_sessions_total{kv_instance="default",role="replica"}"#),
        "every session the replica ran the source served"
    );
    let fallbacks: f64 = STREAM_FALLBACK_REASONS
        .iter()
        .map(|r| {
            replica.metric(&format!(
                r#"kvsync_stream_fallback_total{{kv_instance="default",reason="{r}"}}"#
            ))
        })
        .sum();
    assert_eq!(fallbacks, 0.0, "the ring held");
    drop(replica);
    drop(source);
    same_logs(root.path());
    assert_eq!(
        primary.info("stats").num("sync_full"),
        1,
        "only the source agent's"
    );
}

on_both_servers!(a_server_fed_through_an_rdma_ring_converges_and_wait_counts_it);

const STREAM_FALLBACK_REASONS: &[&str] = kvsync::metrics::STREAM_FALLBACKS;

#[test]
fn a_ring_header_that_lies_is_refused_counted_and_the_stream_goes_on_over_tcp_then_the_ring() {
    for lie in ["1", "2"] {
        let root = tempfile::tempdir().unwrap();
        let primary = Redis::start(Server::Redis, &root.path().join("p"), &[]);
        // The source lies in the header of its first ring session.
        let fault = format!("stream_ring_lie={lie}");
        let source = emulated_source(root.path(), &primary, "", &[("KVSYNC_FAULTS", &fault)]);
        primary.fill("first", 500, "v");
        // The ring is tried again a second after it failed.
        let config = puller_config(&source, &root.path().join("rep-log"))
            + "rdma_retry = \"1s\"\n"
            + EMULATED_RDMA;
        let replica = agent(
            root.path(),
            "rep",
            &root.path().join("rep-snaps"),
            &config,
            &[],
        );
        wait_logged(
            &replica,
            &primary,
            "the replica agent to follow after the lie",
        );
        let refused = r#"kvsync_stream_refused_total{kv_instance="default",reason="bad_header"}"#;
        let fell_back =
            r#"kvsync_stream_fallback_total{kv_instance="default",reason="bad_header"}"#;
        let ring = r#"kvsync_stream_ring_sessions_total{kv_instance="default",role="replica"}"#;
        wait_for("the ring tried again and used", DEADLINE, || {
            let st = stream_status(&replica);
            (st.state.contains("through an RDMA ring") && replica.metric(ring) >= 2.0).then_some(())
        });
        assert_eq!(replica.metric(refused), 1.0, "lie {lie}");
        assert_eq!(replica.metric(fell_back), 1.0, "lie {lie}");
        let log = replica.proc.log();
        assert!(log.contains("the RDMA ring failed"), "{log}");
        assert!(
            log.lines()
                .any(|l| l.contains("following the upstream agent's stream")
                    && !l.contains("RDMA ring")),
            "a TCP session between the ring's attempts: {log}"
        );
        primary.fill("second", 500, "v");
        wait_logged(&replica, &primary, "the stream to go on through the ring");
        drop(replica);
        drop(source);
        same_logs(root.path());
    }
}
