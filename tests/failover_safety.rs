//! Attacks on what an agent does to its servers at a failover, with real
//! `redis-server`/`valkey-server` and Sentinel processes, real agent
//! processes and a fake server or Sentinel ([`common::fake`]) that records
//! every command it receives. Each was seen to succeed before its defence:
//! - `kvsync stream follow` on the primary's agent naming a fake master (or
//!   a mistyped address) made the agent send `REPLICAOF` to its own
//!   primary (wiped by the fake's empty RDB) and the primary's password
//!   to the fake; now it is refused, nothing reaches the address, and the
//!   primary keeps its keys and role;
//! - one lying Sentinel (a huge epoch, a fake master) beside two honest
//!   ones did the same without any call; now only a majority is followed,
//!   the liar is reported (status, `kvsync_stream_sentinel_dissent_total`),
//!   and the report clears once it is gone, without a restart;
//! - `kvsync stream release` toward a fake that echoes the primary's
//!   replication id handed the fed server to it with `masterauth`; now it
//!   is refused and the server stays on its feed;
//! - a "primary" announcing a 1 TB RDB made the agent write it into
//!   `snapshot_dir`; now it is refused before a byte is written;
//! - `kvsync stream follow` naming a configured server that is a primary
//!   of another history (a replica restarted without `replicaof`, with an
//!   agent of its own) made the old primary its replica: a full resync
//!   wiped it; now the re-attach needs the new primary to continue the old
//!   one's history;
//! - the Sentinel the agent subscribes to, publishing any message every
//!   half second, put off the agent's asking of the others for good (it
//!   would miss a failover); now they are asked every 10 s regardless.

mod common;

use common::fake::{Fake, Script};
use common::kv::*;
use common::sentinel::{start_sentinel, MASTER};
use common::stream::*;
use common::*;

const PASSWORD: &str = "primary-secret-0123";

/// A primary with a password and 1000 keys, and its agent following it.
fn primary_and_agent(
    server: Server,
    root: &std::path::Path,
    extra: &str,
) -> (Redis, common::node::Node) {
    let p = Redis::start(server, &root.join("p"), &["--requirepass", PASSWORD]);
    p.fill("k", 1000, "v");
    let config = follower_config(&p, &root.join("src-log")) + extra;
    let src = source_with(root, &config, &[]);
    (p, src)
}

/// That `p` is still a primary with its 1000 keys.
fn untouched(p: &Redis) {
    assert_eq!(p.info("replication").get("role"), Some("master"));
    assert_eq!(p.cmd::<i64>(&["DBSIZE"]), 1000);
}

fn follow_never_points_the_primary_at_an_address_nothing_proves(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let (p, src) = primary_and_agent(server, root.path(), "");
    let replid = p
        .info("replication")
        .get("master_replid")
        .unwrap()
        .to_string();
    let fake = Fake::start(Script {
        replid,
        ..Script::default()
    });
    let typo = format!("127.0.0.1:{}", p.port + 1);
    for (addr, what) in [(fake.addr(), "a fake master"), (typo, "a typo")] {
        let (ok, _, err) = cli(&[
            "stream",
            "follow",
            "--agent",
            &src.grpc(),
            "--primary",
            &addr,
        ]);
        untouched(&p);
        assert_eq!(
            fake.commands(),
            Vec::<String>::new(),
            "nothing reached the fake, not even AUTH"
        );
        assert!(!ok, "{what} was taken");
        assert!(
            err.contains("refused, nothing was changed")
                && err.contains(&format!("nothing proves the server {addr}")),
            "{what}: {err}"
        );
        assert_eq!(stream_status(&src).source, format!("primary {}", p.addr()));
    }
    assert!(!src.proc.log().contains("REPLICAOF"));
    // Without [tls] the stream's key crosses the control plane in plain
    // text: status says what that leaves.
    let integrity = stream_status(&src).integrity;
    assert!(
        integrity.contains("plain text") && integrity.contains("[tls]"),
        "{integrity}"
    );
}

/// Two real Sentinels of `p` and a fake one that names `master` under a
/// huge epoch.
fn two_honest_sentinels_and_a_liar(
    server: Server,
    root: &std::path::Path,
    p: &Redis,
    master: &Fake,
) -> (Vec<Redis>, Fake) {
    let honest = (0..2)
        .map(|i| {
            start_sentinel(
                server,
                &root.join(format!("sentinel-{i}")),
                ("127.0.0.1", &p.addr()),
                std::time::Duration::from_secs(1),
            )
        })
        .collect();
    let liar = Fake::start(Script {
        sentinel_master: Some(("127.0.0.1".into(), master.port, 1 << 62)),
        ..Script::default()
    });
    (honest, liar)
}

fn one_lying_sentinel_never_moves_the_primary(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let p = Redis::start(server, &r.join("p"), &[]);
    let fake_master = Fake::start(Script::default());
    let (honest, liar) = two_honest_sentinels_and_a_liar(server, r, &p, &fake_master);
    p.fill("k", 1000, "v");
    let mut sentinels: Vec<String> = honest.iter().map(|s| format!("\"{}\"", s.addr())).collect();
    sentinels.push(format!("\"{}\"", liar.addr()));
    let stream = format!(
        "sentinels = [{}]\nmaster_name = \"{MASTER}\"\npeers = [\"127.0.0.1:9\"]\n",
        sentinels.join(", ")
    );
    let config = follower_config(&p, &r.join("src-log")) + &stream;
    let src = source_with(r, &config, &[]);
    let dissent = "kvsync_stream_sentinel_dissent_total{kv_instance=\"default\"}";
    let said = wait_for("the agent to report the lying Sentinel", DEADLINE, || {
        untouched(&p);
        let st = stream_status(&src);
        (src.metric(dissent) >= 1.0 && st.sentinels.contains("not followed"))
            .then_some(st.sentinels)
    });
    assert!(
        said.starts_with(&format!("2 of 3 Sentinels name {}", p.addr())),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "Sentinel {} names {}",
            liar.addr(),
            fake_master.addr()
        )),
        "{said}"
    );
    untouched(&p);
    assert_eq!(stream_status(&src).source, format!("primary {}", p.addr()));
    assert_eq!(
        fake_master.commands(),
        Vec::<String>::new(),
        "nothing reached the fake master"
    );

    // The liar gone, the agent follows the majority as before, no restart.
    drop(liar);
    wait_for("the report to clear", DEADLINE, || {
        let st = stream_status(&src);
        (!st.sentinels.contains("not followed") && st.sentinels.contains("2 of 3")).then_some(())
    });
    untouched(&p);
    assert_eq!(fake_master.commands(), Vec::<String>::new());
    drop(honest);
}

on_both_servers!(
    follow_never_points_the_primary_at_an_address_nothing_proves,
    one_lying_sentinel_never_moves_the_primary,
);

fn a_release_toward_a_fake_that_echoes_the_replid_is_refused(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let p = Redis::start(server, &root.path().join("p"), &[]);
    let src = following_source(root.path(), &p, &[]);
    let (rs, replica) = seeded_through_two_agents(root.path(), server, &p, &src);
    let before = rs.info("replication");
    let auth_before: Vec<String> = rs.cmd(&["CONFIG", "GET", "masterauth"]);
    let fake = Fake::start(Script {
        replid: before.get("master_replid").unwrap().to_string(),
        offset: before.num("master_repl_offset") + 1_000_000,
        ..Script::default()
    });
    let (ok, _, err) = cli(&[
        "stream",
        "release",
        "--agent",
        &replica.grpc(),
        "--primary",
        &fake.addr(),
    ]);
    assert_eq!(
        fake.commands(),
        Vec::<String>::new(),
        "nothing reached the fake"
    );
    let after = rs.info("replication");
    assert_eq!(
        after.get("master_port"),
        before.get("master_port"),
        "still on its feed"
    );
    assert_eq!(
        rs.cmd::<Vec<String>>(&["CONFIG", "GET", "masterauth"]),
        auth_before
    );
    assert!(!ok, "released to a fake");
    assert!(
        err.contains(&format!("nothing proves the server {}", fake.addr())),
        "{err}"
    );
}

on_both_servers!(a_release_toward_a_fake_that_echoes_the_replid_is_refused);

#[test]
fn a_primary_announcing_a_huge_rdb_is_refused_before_a_byte_is_written() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let fake = Fake::start(Script {
        rdb_len: 1_000_000_000_000,
        ..Script::default()
    });
    let config = format!(
        "[redis]\nprimary_addr = \"{}\"\n[stream]\ndir = \"{}\"\n",
        fake.addr(),
        r.join("log").display()
    );
    let agent = agent(r, "src", &r.join("snaps"), &config, &[]);
    wait_for("the agent to refuse the RDB", DEADLINE, || {
        agent
            .proc
            .log()
            .contains("announced an RDB that is not taken")
            .then_some(())
    });
    assert!(fake.commands().contains(&"PSYNC".to_string()));
    let files: Vec<_> = std::fs::read_dir(r.join("snaps"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(files.is_empty(), "nothing written: {files:?}");
}

#[test]
fn a_sentinel_that_floods_messages_cannot_put_off_the_asking_of_the_others() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let p = Redis::start(Server::Redis, &r.join("p"), &[]);
    let names_p = Some(("127.0.0.1".to_string(), p.port, 0));
    // The first Sentinel, the one subscribed to, publishes a switch of
    // another master twice a second; the other two only answer.
    let flooder = Fake::start(Script {
        sentinel_master: names_p.clone(),
        publish: Some((
            "another 10.0.0.1 6379 10.0.0.2 6379".into(),
            std::time::Duration::from_millis(500),
        )),
        ..Script::default()
    });
    let others: Vec<Fake> = (0..2)
        .map(|_| {
            Fake::start(Script {
                sentinel_master: names_p.clone(),
                ..Script::default()
            })
        })
        .collect();
    let list = [&flooder, &others[0], &others[1]]
        .iter()
        .map(|f| format!("\"{}\"", f.addr()))
        .collect::<Vec<_>>()
        .join(", ");
    let stream =
        format!("sentinels = [{list}]\nmaster_name = \"{MASTER}\"\npeers = [\"127.0.0.1:9\"]\n");
    let config = follower_config(&p, &r.join("src-log")) + &stream;
    let _src = source_with(r, &config, &[]);
    let asked = |f: &Fake| f.commands().iter().filter(|c| *c == "SENTINEL").count();
    // Asked at the subscription, then every 10 s.
    wait_for(
        "the other Sentinels to be asked three times",
        DEADLINE,
        || (asked(&others[0]) >= 3 && asked(&others[1]) >= 3).then_some(()),
    );
    assert!(flooder.commands().contains(&"SUBSCRIBE".to_string()));
}

#[test]
fn the_old_primary_is_never_re_attached_to_another_history() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    // B: a standalone primary with one stale key, known to the old
    // primary's agent as one of the instance's servers, followed by an
    // agent of its own (a peer whose log follows B).
    let b = Redis::start(Server::Redis, &r.join("b"), &["--requirepass", PASSWORD]);
    let _: () = b.cmd(&["SET", "stale", "1"]);
    let b_agent = agent(
        r,
        "b-agent",
        &r.join("b-snaps"),
        &follower_config(&b, &r.join("b-log")),
        &[],
    );
    wait_following(&b_agent);
    let servers = format!("servers = [\"{}\"]\n", b.addr());
    let (p, src) = primary_and_agent(Server::Redis, r, &servers);
    let (ok, out, err) = cli(&[
        "stream",
        "follow",
        "--agent",
        &src.grpc(),
        "--primary",
        &b.addr(),
        "--peer",
        &b_agent.grpc(),
    ]);
    untouched(&p);
    assert!(ok, "{err}");
    assert!(
        out.contains("was not re-attached") && out.contains("not promoted from its history"),
        "{out}"
    );
}
