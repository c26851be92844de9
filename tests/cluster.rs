//! Seeding replica nodes of a Redis Cluster and a Valkey cluster (real
//! servers in cluster mode, three shards on loopback; every test on both,
//! as `<test>::redis` and `<test>::valkey`) with the `redis` handoff: a new
//! node and a node rebuilt under its old id continue from the shard
//! primary's RDB with a partial resync, no fork of the primary, and join
//! the cluster by `CLUSTER MEET`; a primary at config epoch 0 loses no
//! slot and no key; and the inputs that would turn a shard primary into a
//! replica are refused before anything is stopped.

mod common;

use std::path::Path;

use common::kv::*;
use common::node::*;
use common::stream::*;
use common::*;
use kvsync::kv::cluster::{parse_nodes, NodeLine};
use kvsync::rpc::pb;

/// The arguments of a cluster node on `port` with its bus on `cport`
/// (replica migration off: a test's second replica of a shard stays put).
fn cluster_args(cport: u16) -> Vec<String> {
    [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-port",
        &cport.to_string(),
        "--cluster-allow-replica-migration",
        "no",
    ]
    .map(String::from)
    .to_vec()
}

/// A cluster node in `dir` on `port` (its pidfile lets a handoff stop it),
/// with a backlog that holds a test's writes.
fn cluster_node(server: Server, dir: &Path, port: u16) -> Redis {
    cluster_node_with(server, dir, port, &[])
}

/// [`cluster_node`], with `extra` arguments.
fn cluster_node_with(server: Server, dir: &Path, port: u16, extra: &[&str]) -> Redis {
    let mut args = cluster_args(free_port());
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend([
        "--pidfile".into(),
        dir.join("redis.pid").display().to_string(),
        "--repl-backlog-size".into(),
        "64mb".into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Redis::start_on(server, dir, &args, None, port)
}

fn myself(node: &Redis) -> NodeLine {
    let nodes: String = node.cmd(&["CLUSTER", "NODES"]);
    parse_nodes(&nodes)
        .into_iter()
        .find(NodeLine::is_myself)
        .unwrap()
}

fn table(node: &Redis) -> Vec<NodeLine> {
    parse_nodes(&node.cmd::<String>(&["CLUSTER", "NODES"]))
}

fn cluster_ok(node: &Redis) -> bool {
    node.try_cmd::<String>(&["CLUSTER", "INFO"])
        .is_ok_and(|i| i.contains("cluster_state:ok"))
}

/// `other` meets `node` on the cluster bus.
fn meet(other: &Redis, node: &Redis) {
    let line = myself(node);
    let cport = line.cport().unwrap().to_string();
    let port = node.port.to_string();
    let _: () = other.cmd(&["CLUSTER", "MEET", "127.0.0.1", &port, &cport]);
}

/// Three shard primaries owning a third of the slots each, at config
/// epochs `epochs` (0 leaves a primary at epoch 0), and a replica of the
/// first (made the cluster's way, so that it has a backlog); once every
/// node's state is `ok`.
struct Shards {
    primaries: Vec<Redis>,
    replica: Redis,
}

fn three_shards(server: Server, root: &Path, epochs: [u64; 3]) -> Shards {
    three_shards_with(server, root, epochs, &[])
}

/// [`three_shards`], every node started with `extra` arguments.
fn three_shards_with(server: Server, root: &Path, epochs: [u64; 3], extra: &[&str]) -> Shards {
    let ranges = [("0", "5460"), ("5461", "10922"), ("10923", "16383")];
    let primaries: Vec<Redis> = (0..3)
        .map(|i| cluster_node_with(server, &root.join(format!("shard{i}")), free_port(), extra))
        .collect();
    for ((p, (from, to)), epoch) in primaries.iter().zip(ranges).zip(epochs) {
        let _: () = p.cmd(&["CLUSTER", "ADDSLOTSRANGE", from, to]);
        if epoch > 0 {
            let _: () = p.cmd(&["CLUSTER", "SET-CONFIG-EPOCH", &epoch.to_string()]);
        }
    }
    meet(&primaries[0], &primaries[1]);
    meet(&primaries[0], &primaries[2]);
    let replica = cluster_node_with(server, &root.join("replica0"), free_port(), extra);
    meet(&replica, &primaries[0]);
    let a = myself(&primaries[0]).id;
    wait_for("the replica to know the first primary", DEADLINE, || {
        table(&replica).iter().any(|n| n.id == a).then_some(())
    });
    let _: () = replica.cmd(&["CLUSTER", "REPLICATE", &a]);
    wait_for(
        "the cluster to be ok and the replica linked",
        DEADLINE,
        || {
            (primaries.iter().all(cluster_ok)
                && cluster_ok(&replica)
                && replica.info("replication").get("master_link_status") == Some("up"))
            .then_some(())
        },
    );
    wait_for(
        "the first primary's replication fork to exit",
        DEADLINE,
        || {
            (primaries[0]
                .info("persistence")
                .num("rdb_bgsave_in_progress")
                == 0)
                .then_some(())
        },
    );
    Shards { primaries, replica }
}

/// Writes `n` keys `{tag}prefix:i` to `node`.
fn fill_tagged(node: &Redis, tag: &str, prefix: &str, n: usize) {
    node.fill(&format!("{{{tag}}}{prefix}"), n, "value-of-a-cluster-key");
}

/// A replica agent whose `redis` handoff seeds the cluster node on `port`
/// (files in `dir`) as a replica of `primary`.
fn replica_agent(
    root: &Path,
    tag: &str,
    primary: &str,
    server: Server,
    port: u16,
    dir: &Path,
) -> Node {
    let addr = format!("127.0.0.1:{port}");
    replica_agent_with(root, tag, primary, server, (&addr, dir), (&[], ""))
}

/// [`replica_agent`], with `start_extra` arguments in its `start` and
/// `redis_extra` lines in its `[redis]`.
fn replica_agent_with(
    root: &Path,
    tag: &str,
    primary: &str,
    server: Server,
    (addr, dir): (&str, &Path),
    (start_extra, redis_extra): (&[&str], &str),
) -> Node {
    let config = replica_config(primary, server, (addr, dir), (start_extra, redis_extra));
    agent(
        root,
        &format!("replica{tag}"),
        &root.join(format!("replica-agent{tag}")),
        &config,
        &[],
    )
}

/// The configuration of [`replica_agent_with`].
fn replica_config(
    primary: &str,
    server: Server,
    (addr, dir): (&str, &Path),
    (start_extra, redis_extra): (&[&str], &str),
) -> String {
    let port: u16 = addr.rsplit_once(':').unwrap().1.parse().unwrap();
    let mut args = cluster_args(free_port());
    args.extend(start_extra.iter().map(|a| a.to_string()));
    let start = start_command(server, port, dir, &args);
    format!(
        "[transport]\nmode = \"tcp\"\n[handoff]\nmode = \"redis\"\ntimeout = \"60s\"\n[redis]\nserver_addr = \"{addr}\"\ndir = \"{}\"\ndbfilename = \"dump.rdb\"\nprimary = \"{primary}\"\nstart = [{start}]\n{redis_extra}\n",
        dir.display()
    )
}

/// A source agent on `primary`'s dir, once it offers the RDB just saved.
async fn source_agent(root: &Path, primary: &Redis) -> Node {
    source_agent_named(root, "source", primary).await
}

/// [`source_agent`], named `name`.
async fn source_agent_named(root: &Path, name: &str, primary: &Redis) -> Node {
    let config = format!(
        "[transport]\nmode = \"tcp\"\n[redis]\nprimary_addr = \"{}\"\n",
        primary.addr()
    );
    let source = agent(root, name, &primary.dir, &config, &[]);
    let seq = kvsync::snapshot::verify_file(&primary.dir.join("dump.rdb"), None)
        .unwrap()
        .seq;
    source.offered(seq).await;
    source
}

/// A handle on the node a handoff started (daemonized, found by pidfile).
fn started(server: Server, port: u16, dir: &Path) -> Redis {
    Redis {
        server,
        port,
        dir: dir.to_owned(),
        child: None,
        password: None,
        user: None,
    }
}

/// The node `node` is a replica of `primary` in `primary`'s table, owns
/// no slot, has its failover back, sees the cluster `ok`, and holds the
/// primary's keys once both rest at the same offset.
fn joined_and_caught_up(node: &Redis, primary: &Redis) -> String {
    let id = myself(node).id;
    let p = myself(primary);
    wait_for(
        "the primary to list the node as its replica",
        DEADLINE,
        || {
            table(primary)
                .into_iter()
                .find(|n| n.id == id && n.master == p.id && !n.is_master())
                .filter(|n| {
                    !n.flags
                        .iter()
                        .any(|f| f == "nofailover" || f.starts_with("fail"))
                })
        },
    );
    assert!(myself(node).slots.is_empty(), "the replica owns no slot");
    wait_for("the node to see the cluster ok", DEADLINE, || {
        cluster_ok(node).then_some(())
    });
    wait_for("the node to hold the primary's keys", DEADLINE, || {
        let (p, r) = (primary.info("replication"), node.info("replication"));
        (p.num("master_repl_offset") == r.num("slave_repl_offset")
            && primary.cmd::<u64>(&["DBSIZE"]) == node.cmd::<u64>(&["DBSIZE"]))
        .then_some(())
    });
    id
}

/// What the primary has done for replicas: full syncs, partial ones, forks.
fn sync_counters(primary: &Redis) -> (u64, u64, u64) {
    let s = primary.info("stats");
    (
        s.num("sync_full"),
        s.num("sync_partial_ok"),
        s.num("total_forks"),
    )
}

fn a_new_node_is_seeded_as_a_shard_replica_with_a_partial_resync_no_fork_and_no_slot_claimed(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // The first primary stays at config epoch 0: a node that loaded its
    // keys as a primary could win their slots from it.
    let shards = three_shards(server, root, [0, 2, 3]);
    let a = &shards.primaries[0];
    let tag = tag_in(a, 0..=5460);
    fill_tagged(a, &tag, "k", 20_000);
    a.bgsave();
    let (full, partial, forks) = sync_counters(a);
    let slots = myself(a).slots;
    let ids: Vec<String> = table(a).into_iter().map(|n| n.id).collect();

    // About 1 MB/s: well within the backlog while the seeding runs.
    let value = "w".repeat(512);
    let writer_tag = tag.clone();
    let writer = Client::start(a, move |con, i| {
        let mut p = redis::pipe();
        for j in 0..20 {
            p.cmd("SET")
                .arg(format!("{{{writer_tag}}}during:{}", i * 20 + j))
                .arg(&value)
                .ignore();
        }
        let _: () = p.query(con).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    });
    let ndir = root.join("new-node");
    std::fs::create_dir_all(&ndir).unwrap();
    let port = free_port();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let source = source_agent(root, a).await;
        let replica = replica_agent(root, "", &a.addr(), server, port, &ndir);
        let p = sync_ok(&replica, &source).await;
        assert!(
            p.handoff.contains("partial resync accepted"),
            "{}",
            p.handoff
        );
        assert!(
            p.handoff.contains("(new) joined as a replica"),
            "{}",
            p.handoff
        );
    });
    drop(writer);
    let node = started(server, port, &ndir);
    let id = joined_and_caught_up(&node, a);
    assert!(!ids.contains(&id), "a new node gets a fresh id");
    assert_eq!(
        sync_counters(a),
        (full, partial + 1, forks),
        "one partial resync, no fork"
    );
    assert_eq!(myself(a).slots, slots, "the primary kept its slots");
    let seeded: Vec<String> = a.cmd(&["KEYS", &format!("{{{tag}}}k:*")]);
    assert_eq!(seeded.len(), 20_000, "the primary lost no key");
    assert_eq!(myself(a).config_epoch, 0);
    drop(shards);
}

fn a_replica_node_lost_with_its_files_is_rebuilt_under_its_old_id(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let a = &shards.primaries[0];
    fill_tagged(a, &tag_in(a, 0..=5460), "k", 20_000);
    a.bgsave();
    let (full, partial, forks) = sync_counters(a);
    // The replica's host loses the node: process, data and nodes.conf.
    let Shards { primaries, replica } = shards;
    let (old_id, port, rdir) = (myself(&replica).id, replica.port, replica.dir.clone());
    drop(replica);
    std::fs::remove_dir_all(&rdir).unwrap();
    std::fs::create_dir_all(&rdir).unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let source = source_agent(root, &primaries[0]).await;
        let replica = replica_agent(root, "", &primaries[0].addr(), server, port, &rdir);
        let p = sync_ok(&replica, &source).await;
        assert!(
            p.handoff
                .contains("kept from the cluster's table at its address"),
            "{}",
            p.handoff
        );
    });
    let node = started(server, port, &rdir);
    assert_eq!(joined_and_caught_up(&node, &primaries[0]), old_id);
    let at_port = table(&primaries[0])
        .into_iter()
        .filter(|n| n.ip_port().1 == port)
        .count();
    assert_eq!(at_port, 1, "no second node at the address");
    assert_eq!(sync_counters(&primaries[0]), (full, partial + 1, forks));
    drop(primaries);
}

/// A hash tag whose keys land in `range`'s slots.
fn tag_in(node: &Redis, range: std::ops::RangeInclusive<u64>) -> String {
    (0..100)
        .map(|i| format!("t{i}"))
        .find(|t| range.contains(&node.cmd::<u64>(&["CLUSTER", "KEYSLOT", &format!("{{{t}}}")])))
        .unwrap()
}

/// A node in `root/name` that has met the cluster through `via` and knows
/// `other`.
fn joined_node(server: Server, root: &Path, name: &str, via: &Redis, other: &str) -> Redis {
    let node = cluster_node(server, &root.join(name), free_port());
    meet(&node, via);
    wait_for("the node to know the cluster", DEADLINE, || {
        table(&node).iter().any(|n| n.id == other).then_some(())
    });
    node
}

/// A refused handoff: its tag, `[redis] primary`, the local server's
/// address and dir, extra `start` arguments and `[redis]` lines, and what
/// the error says.
type Case<'a> = (
    &'a str,
    String,
    (String, std::path::PathBuf),
    &'a [&'a str],
    &'a str,
    &'a str,
);

fn run_id(node: &Redis) -> String {
    node.info("server").get("run_id").unwrap().to_string()
}

/// Every input that would make the handoff stop a node it must not touch
/// ends it before anything is stopped or written: the local server is
/// another shard's primary (running, or stopped: its `nodes.conf`, or its
/// data without one), a node importing a slot, a replica of another shard,
/// a server whose `cluster-config-file` is not the configured one; or
/// `[redis] primary` names a replica; or `start` has `replicaof` in any
/// spelling; or the `nodes.conf` could not be written. Each running
/// server keeps its process (`run_id`) and its state.
fn a_handoff_that_would_turn_a_shard_primary_into_a_replica_is_refused_before_anything_changes(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let a = &shards.primaries[0];
    fill_tagged(a, &tag_in(a, 0..=5460), "k", 2_000);
    a.bgsave();
    let b = &shards.primaries[1];
    let b_id = myself(b).id;
    fill_tagged(b, &tag_in(b, 5461..=10922), "own", 500);
    // A node importing a slot of B's, and a replica of B.
    let importing = joined_node(server, root, "importing", a, &b_id);
    let _: () = importing.cmd(&["CLUSTER", "SETSLOT", "6000", "IMPORTING", &b_id]);
    let other_shard = joined_node(server, root, "other-shard", a, &b_id);
    let _: () = other_shard.cmd(&["CLUSTER", "REPLICATE", &b_id]);
    wait_for("the other shard's replica to link", DEADLINE, || {
        (other_shard.info("replication").get("master_link_status") == Some("up")).then_some(())
    });
    let running = [b, &importing, &other_shard, &shards.replica];
    let before: Vec<(String, NodeLine)> = running.iter().map(|n| (run_id(n), myself(n))).collect();

    let fresh = |name: &str| (format!("127.0.0.1:{}", free_port()), root.join(name));
    let at = |node: &Redis| (node.addr(), node.dir.clone());
    // A server without cluster mode whose keys are all in database 1.
    let standalone = Redis::standalone_replica(server, &root.join("standalone"));
    let mut p = redis::pipe();
    p.cmd("SELECT").arg(1).ignore();
    for i in 0..100 {
        p.cmd("SET").arg(format!("k{i}")).arg("v").ignore();
    }
    let _: () = p.query(&mut standalone.con()).unwrap();
    let standalone_run = run_id(&standalone);
    // Stopped nodes known only by a nodes.conf: B's id with no slot (the
    // cluster says otherwise), and a slot-less primary with data.
    let conf = |name: &str, id: &str, data: bool| {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        let line = format!(
            "{id} :1@2 myself,master - 0 0 0 connected\nvars currentEpoch 3 lastVoteEpoch 0\n"
        );
        std::fs::write(d.join("nodes.conf"), line).unwrap();
        if data {
            std::fs::write(d.join("dump.rdb"), b"REDIS0010 a primary's keys").unwrap();
        }
        (format!("127.0.0.1:{}", free_port()), d)
    };
    let cases: Vec<Case> = vec![
        (
            "primary",
            a.addr(),
            at(b),
            &[],
            "",
            "a primary owning slots 5461-10922",
        ),
        (
            "importing",
            a.addr(),
            at(&importing),
            &[],
            "",
            "open migrations: [6000-<-",
        ),
        (
            "other-shard",
            a.addr(),
            at(&other_shard),
            &[],
            "",
            "another shard's primary",
        ),
        (
            "config-file",
            a.addr(),
            at(&shards.replica),
            &[],
            "cluster_config_file = \"wrong.conf\"",
            "reads its node from",
        ),
        (
            "not-a-primary",
            shards.replica.addr(),
            fresh("unused1"),
            &[],
            "",
            "is not a shard primary",
        ),
        (
            "replicaof",
            a.addr(),
            fresh("unused2"),
            &["--REPLICAOF", "127.0.0.1", "1"],
            "",
            "refuses to start with replicaof",
        ),
        (
            "unwritable",
            a.addr(),
            fresh("unused3"),
            &[],
            "cluster_config_file = \"missing/nodes.conf\"",
            "cannot write in",
        ),
        (
            "standalone",
            a.addr(),
            at(&standalone),
            &[],
            "",
            "runs without cluster mode and holds 100 keys",
        ),
        (
            "stopped-b-id",
            a.addr(),
            conf("stopped-b-id", &b_id, false),
            &[],
            "",
            "the cluster's table: the local server is node",
        ),
        (
            "stopped-primary",
            a.addr(),
            conf("stopped-primary", "beef", true),
            &[],
            "",
            "a primary, stopped with dump.rdb",
        ),
        (
            // The table holds a live node (the replica) at this host's
            // address and the port; the local server does not answer.
            "alive-at-address",
            a.addr(),
            (
                format!("127.0.0.2:{}", shards.replica.port),
                root.join("unused4"),
            ),
            &[],
            "",
            "is alive, but the local server does not answer",
        ),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let refused = |source: &Node,
                   tag: &str,
                   primary: &str,
                   (addr, ndir): (&str, &Path),
                   extra: (&[&str], &str),
                   says: &str| {
        std::fs::create_dir_all(ndir).unwrap();
        let replica = replica_agent_with(root, tag, primary, server, (addr, ndir), extra);
        rt.block_on(async {
            let id = start_sync(&replica, source).await;
            let p = wait_done(&replica, &id).await;
            assert_eq!(p.phase, pb::Phase::Failed as i32, "{tag}: {p:?}");
            assert!(p.error.contains(says), "{tag}: {}", p.error);
        });
    };
    let source = rt.block_on(source_agent(root, a));
    let a_counters = sync_counters(a);
    // What each local server's dir holds before its refusal: its RDB, and
    // its own line of its nodes.conf (a running node rewrites the rest as
    // it hears gossip).
    let contents = |d: &Path| {
        let own = std::fs::read_to_string(d.join("nodes.conf"))
            .ok()
            .map(|text| parse_nodes(&text).into_iter().find(|n| n.is_myself()));
        (own, std::fs::read(d.join("dump.rdb")).ok())
    };
    for (tag, primary, (addr, ndir), start_extra, redis_extra, says) in cases {
        let held = contents(&ndir);
        refused(
            &source,
            tag,
            &primary,
            (&addr, &ndir),
            (start_extra, redis_extra),
            says,
        );
        assert_eq!(contents(&ndir), held, "{tag}: nothing written or placed");
    }
    assert_eq!(sync_counters(a), a_counters, "the primary served no sync");
    for (node, (id, line)) in running.iter().zip(&before) {
        assert_eq!(&run_id(node), id, "{} was not restarted", node.port);
        assert_eq!(&myself(node), line, "{} is as it was", node.port);
    }
    assert_eq!(b.cmd::<u64>(&["DBSIZE"]), 500);
    assert_eq!(run_id(&standalone), standalone_run);

    // B stopped: its nodes.conf says what it was; with another file
    // named, its data without one is not taken for a new node's.
    b.bgsave();
    let _: redis::RedisResult<()> = b.try_cmd(&["SHUTDOWN", "NOSAVE"]);
    let (b_addr, b_dir) = at(b);
    let files = |d: &Path| ["nodes.conf", "dump.rdb"].map(|f| std::fs::read(d.join(f)).unwrap());
    let kept = files(&b_dir);
    refused(
        &source,
        "stopped",
        &a.addr(),
        (&b_addr, &b_dir),
        (&[], ""),
        "nodes.conf: the local server is node",
    );
    refused(
        &source,
        "stopped-data",
        &a.addr(),
        (&b_addr, &b_dir),
        (&[], "cluster_config_file = \"other.conf\""),
        "cannot tell which node's data",
    );
    assert_eq!(files(&b_dir), kept, "nothing written or placed");
    drop(source);
    drop((importing, other_shard, shards));
}

/// A stream log at each node of a shard, once both follow: the agent
/// of the primary `p` follows it, the agent of the replica node `r`
/// follows that agent, each names the other as a peer. The primary's
/// agent, the replica's, and the replica's agent's address.
fn shard_agents(root: &Path, server: Server, p: &Redis, r: &Redis) -> (Node, Node, String) {
    let (p_port, r_port) = (free_port(), free_port());
    let (p_agent, r_agent) = (format!("127.0.0.1:{p_port}"), format!("127.0.0.1:{r_port}"));
    let p_config = follower_config(p, &root.join("p-log")).replace(
        "[stream]\n",
        &format!("[stream]\npeers = [\"{r_agent}\"]\n"),
    );
    let src = agent_at(
        root,
        "p",
        &root.join("p-snaps"),
        &p_config,
        "127.0.0.1",
        p_port,
    );
    wait_following(&src);
    let r_config = format!(
        "{}[stream]\ndir = \"{}\"\nupstream = \"{p_agent}\"\npeers = [\"{p_agent}\"]\n",
        replica_config(&p.addr(), server, (&r.addr(), &r.dir), (&[], "")),
        root.join("r-log").display()
    );
    let follower = agent_at(
        root,
        "r",
        &root.join("r-snaps"),
        &r_config,
        "127.0.0.1",
        r_port,
    );
    wait_following(&follower);
    (src, follower, r_agent)
}

/// Promotes the replica `node` by `CLUSTER FAILOVER`, asked again every
/// 6 s until its own line says master: a manual failover the cluster
/// does not finish within its 5 s (a busy machine) is dropped silently.
fn promote(node: &Redis) {
    let mut asked: Option<std::time::Instant> = None;
    wait_for("the replica to be promoted", DEADLINE, || {
        if myself(node).is_master() {
            return Some(());
        }
        if asked.is_none_or(|at| at.elapsed() > std::time::Duration::from_secs(6)) {
            // (Refused if it became a master meanwhile: the next look says so.)
            let _: redis::RedisResult<String> = node.try_cmd(&["CLUSTER", "FAILOVER"]);
            asked = Some(std::time::Instant::now());
        }
        None
    });
}

/// A stream log at each node of a shard: the primary's agent follows the
/// primary, the replica node's agent follows that agent, each names the
/// other as a peer. A `CLUSTER FAILOVER` to the replica node moves both
/// logs (the promoted node's agent follows its node, the old primary's
/// follows that agent) with no full sync of any server or log, and no
/// server is sent anything; a failover to a node no configured agent sits
/// beside moves no log.
fn a_cluster_failover_moves_the_shards_logs_without_a_full_sync_and_never_to_an_unproved_node(
    server: Server,
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let (p, r) = (&shards.primaries[0], &shards.replica);
    let tag = tag_in(p, 0..=5460);
    let (src, follower, r_agent) = shard_agents(root, server, p, r);
    fill_tagged(p, &tag, "before", 2_000);
    let at_end = |agent: &Node, server: &Redis| {
        stream_status(agent).end_offset == server.info("replication").num("master_repl_offset")
    };
    wait_for("both logs to hold the primary's writes", DEADLINE, || {
        (at_end(&src, p) && at_end(&follower, p)).then_some(())
    });
    let full = |n: &Redis| n.info("stats").num("sync_full");
    let (p_full, r_full) = (full(p), full(r));

    promote(r);
    wait_for("the agents to follow the promoted node", DEADLINE, || {
        (stream_status(&follower).source == format!("primary {}", r.addr())
            && stream_status(&src).source == format!("agent {r_agent}"))
        .then_some(())
    });
    assert!(
        stream_status(&follower)
            .cluster
            .contains(&format!("names the shard primary {}", r.addr())),
        "{}",
        stream_status(&follower).cluster
    );
    fill_tagged(r, &tag, "after", 2_000);
    wait_for(
        "the old primary and both logs to hold the new primary's writes",
        DEADLINE,
        || {
            (at_end(&follower, r) && at_end(&src, r) && p.cmd::<u64>(&["DBSIZE"]) == 4_000)
                .then_some(())
        },
    );
    assert_eq!(
        (full(p), full(r)),
        (p_full, r_full),
        "no full sync of a server or a log"
    );
    assert!(
        !src.proc.log().contains("REPLICAOF") && !src.proc.log().contains("replicates from"),
        "nothing was sent to the old primary: the cluster re-attached it"
    );

    // A node no configured agent sits beside: the table names it, the
    // proof does not, no log moves.
    let other = joined_node(server, root, "other", r, &myself(r).id);
    let _: () = other.cmd(&["CLUSTER", "REPLICATE", &myself(r).id]);
    wait_for("the third node to be a linked replica", DEADLINE, || {
        (other.info("replication").get("master_link_status") == Some("up")).then_some(())
    });
    promote(&other);
    wait_for(
        "the promoted node's agent to refuse the unproved node",
        DEADLINE,
        || {
            follower
                .proc
                .log()
                .contains(&format!(
                    "no agent follows the primary {} yet",
                    other.addr()
                ))
                .then_some(())
        },
    );
    assert!(stream_status(&follower).cluster.contains(&other.addr()));
    assert_eq!(
        stream_status(&follower).source,
        format!("primary {}", r.addr())
    );
    assert_eq!(stream_status(&src).source, format!("agent {r_agent}"));
    drop((src, follower, other, shards));
}

/// `check-config --live` on cluster nodes also probes what the agent asks
/// of them: the role and table it follows failovers by, `CLUSTER MEET` on
/// the node it seeds, and the shard primary's table, cluster info and
/// client info; without one of these, it names it, and the probe changed
/// nothing (no node met).
fn check_config_live_probes_the_cluster_rights(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (p, r) = (
        cluster_node(server, &root.join("p"), free_port()),
        cluster_node(server, &root.join("r"), free_port()),
    );
    std::fs::write(root.join("password"), "kvsync-pw\n").unwrap();
    let p_rights = format!(
        "+psync +replconf +info +config|get +role +cluster|nodes +cluster|info +client|info{}",
        // Redis 7.0 has no shard ids.
        if server == Server::Valkey {
            " +cluster|myshardid"
        } else {
            ""
        }
    );
    let rights = [
        (p_rights.as_str(), &p),
        (
            "+info +config|get +config|set +replicaof +role +cluster|nodes +cluster|meet",
            &r,
        ),
    ];
    for (rights, node) in rights {
        let mut acl = vec![
            "ACL",
            "SETUSER",
            "kvsync",
            "on",
            ">kvsync-pw",
            "resetchannels",
            "-@all",
        ];
        acl.extend(rights.split(' '));
        let _: () = node.cmd(&acl);
    }
    let file = root.join("check.toml");
    std::fs::write(
        &file,
        format!(
            "snapshot_format = \"redis-rdb\"\n[redis]\nprimary_addr = \"{}\"\nserver_addr = \"{}\"\nprimary = \"{0}\"\nuser = \"kvsync\"\npassword_file = \"{}\"\n[stream]\ndir = \"{}\"\n[handoff]\nmode = \"redis-replicate\"\n",
            p.addr(),
            r.addr(),
            root.join("password").display(),
            root.join("log").display()
        ),
    )
    .unwrap();
    let live = || cli(&["check-config", "--live", file.to_str().unwrap()]);
    let (ok, out, err) = live();
    assert!(ok, "every documented right is there: {out}{err}");
    for (node, right) in [
        (&p, "role"),
        (&p, "cluster|nodes"),
        (&p, "cluster|info"),
        (&p, "client|info"),
        (&r, "role"),
        (&r, "cluster|nodes"),
        (&r, "cluster|meet"),
    ] {
        names_missing(node, right, live);
    }
    assert_eq!(table(&r).len(), 1, "the MEET probe met no node");
}

/// A running node whose RDB cannot be placed after its new `nodes.conf`
/// was written (its `stop` leaves a directory where the RDB goes) gets
/// its own `nodes.conf` back, byte for byte, and is started again; the
/// handoff says so.
fn a_node_whose_rdb_cannot_be_placed_gets_its_nodes_conf_back_and_is_started_again(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let a = &shards.primaries[0];
    fill_tagged(a, &tag_in(a, 0..=5460), "k", 1_000);
    a.bgsave();
    let (ndir, port) = (root.join("node"), free_port());
    let node = cluster_node(server, &ndir, port);
    let conf = std::fs::read(ndir.join("nodes.conf")).unwrap();
    let stop = format!(
        "stop = [\"sh\", \"-c\", \"kill $(cat {0}/redis.pid) && mkdir -p {0}/dump.rdb/in-the-way\"]",
        ndir.display()
    );
    let replica = replica_agent_with(
        root,
        "",
        &a.addr(),
        server,
        (&node.addr(), &ndir),
        (&[], &stop),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = rt.block_on(async {
        let source = source_agent(root, a).await;
        let id = start_sync(&replica, &source).await;
        wait_done(&replica, &id).await
    });
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(
        p.error.contains("dump.rdb") && p.error.contains("the server was started again as it was"),
        "{}",
        p.error
    );
    assert_eq!(
        std::fs::read(ndir.join("nodes.conf")).unwrap(),
        conf,
        "its own nodes.conf, put back"
    );
    drop((node, shards));
}

/// The shard primary is killed and the cluster fails it over by itself
/// (node timeout): the promoted node's agent follows its node, and its log
/// takes the new primary's writes; the old primary's agent, whose node
/// no longer answers, says so and moves nothing.
fn an_automatic_failover_moves_the_promoted_nodes_log_onto_its_node(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let mut shards =
        three_shards_with(server, root, [1, 2, 3], &["--cluster-node-timeout", "1000"]);
    let tag = tag_in(&shards.primaries[0], 0..=5460);
    let (src, follower, _) = shard_agents(root, server, &shards.primaries[0], &shards.replica);
    fill_tagged(&shards.primaries[0], &tag, "before", 2_000);
    let p_addr = shards.primaries[0].addr();
    wait_for(
        "the promoted node to hold the primary's writes",
        DEADLINE,
        || (shards.replica.cmd::<u64>(&["DBSIZE"]) == 2_000).then_some(()),
    );
    let full = shards.replica.info("stats").num("sync_full");
    drop(shards.primaries.remove(0));
    let r = &shards.replica;
    wait_for(
        "the cluster to promote the replica node and its agent to follow it",
        DEADLINE,
        || (stream_status(&follower).source == format!("primary {}", r.addr())).then_some(()),
    );
    fill_tagged(r, &tag, "after", 2_000);
    wait_for(
        "the promoted node's log to hold its writes",
        DEADLINE,
        || {
            (stream_status(&follower).end_offset == r.info("replication").num("master_repl_offset"))
                .then_some(())
        },
    );
    assert_eq!(
        r.info("stats").num("sync_full"),
        full,
        "the log continued with a partial resync"
    );
    wait_for(
        "the old primary's agent to say its node is gone",
        DEADLINE,
        || {
            stream_status(&src)
                .cluster
                .contains("did not answer")
                .then_some(())
        },
    );
    assert_eq!(stream_status(&src).source, format!("primary {p_addr}"));
    drop((src, follower, shards));
}

/// `kvsync fanout --cluster`: one command seeds a new node for every
/// shard, each from the agent beside its shard's primary (the sources
/// given in another order than the replicas: each replica goes to the
/// source of the primary it names), each with a partial resync and no
/// fork; a replica of a primary no given source sits beside refuses the
/// whole set before anything starts.
fn one_cluster_fanout_seeds_a_new_node_for_every_shard_from_its_primarys_agent(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let ranges = [0..=5460, 5461..=10922, 10923..=16383];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut sources = Vec::new();
    for (i, (p, range)) in shards.primaries.iter().zip(ranges).enumerate() {
        // An RDB with a replication position needs a backlog.
        p.make_backlog(&root.join(format!("backlog{i}")));
        fill_tagged(p, &tag_in(p, range), "k", 1_000);
        p.bgsave();
        sources.push(rt.block_on(source_agent_named(root, &format!("source{i}"), p)));
    }
    let before: Vec<_> = shards.primaries.iter().map(sync_counters).collect();
    let nodes: Vec<(u16, std::path::PathBuf)> = (0..3)
        .map(|i| (free_port(), root.join(format!("new{i}"))))
        .collect();
    let replicas: Vec<Node> = shards
        .primaries
        .iter()
        .zip(&nodes)
        .enumerate()
        .map(|(i, (p, (port, ndir)))| {
            std::fs::create_dir_all(ndir).unwrap();
            replica_agent(root, &i.to_string(), &p.addr(), server, *port, ndir)
        })
        .collect();

    // A replica whose primary no given source sits beside: refused.
    let (ok, out, err) = cli(&[
        "fanout",
        "--cluster",
        "--source",
        &sources[0].grpc(),
        "--replica",
        &replicas[1].grpc(),
        "--wait",
    ]);
    assert!(
        !ok && err.contains("which no --source sits beside"),
        "{out}{err}"
    );
    assert_eq!(
        shards
            .primaries
            .iter()
            .map(sync_counters)
            .collect::<Vec<_>>(),
        before,
        "nothing started"
    );

    let mut args = vec!["fanout".to_string(), "--cluster".into()];
    for s in sources.iter().rev() {
        args.extend(["--source".into(), s.grpc()]);
    }
    for r in &replicas {
        args.extend(["--replica".into(), r.grpc()]);
    }
    args.extend(["--wait".into(), "--json".into()]);
    let (ok, out, err) = cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{out}{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["shards"].as_array().unwrap().len(), 3, "{summary}");
    for ((p, (port, ndir)), (full, partial, forks)) in
        shards.primaries.iter().zip(&nodes).zip(before)
    {
        let node = started(server, *port, ndir);
        joined_and_caught_up(&node, p);
        assert_eq!(
            sync_counters(p),
            (full, partial + 1, forks),
            "partial, no fork"
        );
    }
    drop((sources, replicas, shards));
}

/// An RDB the shard primary cannot continue, one of another shard's
/// primary, is refused before the node is stopped (one whose offset left
/// the primary's backlog after the source offered it is refused alike:
/// `restart::tests`). The running node keeps its process, its
/// `nodes.conf` and its files.
fn an_rdb_the_primary_cannot_continue_is_refused_before_the_node_is_stopped(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let (a, b) = (&shards.primaries[0], &shards.primaries[1]);
    b.make_backlog(&root.join("backlog-b"));
    fill_tagged(b, &tag_in(b, 5461..=10922), "k", 100);
    b.bgsave();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let other_shard = rt.block_on(source_agent_named(root, "source-b", b));
    let (ndir, port) = (root.join("node"), free_port());
    let node = cluster_node(server, &ndir, port);
    let (id, conf) = (
        run_id(&node),
        std::fs::read(ndir.join("nodes.conf")).unwrap(),
    );
    let replica = replica_agent(root, "", &a.addr(), server, port, &ndir);
    let counters = sync_counters(a);
    let p = rt.block_on(async {
        let id = start_sync(&replica, &other_shard).await;
        wait_done(&replica, &id).await
    });
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(
        p.error.contains("another shard's or another history's")
            && p.error.contains("nothing was stopped"),
        "{}",
        p.error
    );

    assert_eq!(run_id(&node), id, "the node was not restarted");
    assert_eq!(std::fs::read(ndir.join("nodes.conf")).unwrap(), conf);
    assert!(!ndir.join("dump.rdb").exists(), "no RDB placed");
    assert_eq!(sync_counters(a), counters, "the primary served no sync");
    drop((other_shard, replica, node, shards));
}

/// A new node whose RDB's offset the shard primary's backlog no longer
/// holds: its agent, whose stream log follows the primary's agent, feeds
/// it the gap before it meets the cluster (the primary's address in its
/// `nodes.conf` the agent's feed until then), under writes; the primary
/// then continues it with a partial resync and never forks. A cancel
/// while the node is fed changes nothing: the node's own `masterauth` is
/// back and it joins. (Without such a log the handoff is refused before
/// anything is stopped: `restart::tests`.)
fn a_gap_beyond_the_primarys_backlog_is_filled_through_the_agent_without_a_fork(server: Server) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let shards = three_shards(server, root, [1, 2, 3]);
    let a = &shards.primaries[0];
    let tag = tag_in(a, 0..=5460);
    fill_tagged(a, &tag, "k", 5_000);
    let s_port = free_port();
    let src = agent_at(
        root,
        "p",
        &a.dir,
        &follower_config(a, &root.join("p-log")),
        "127.0.0.1",
        s_port,
    );
    wait_following(&src);
    let (ndir, port) = (root.join("new-node"), free_port());
    std::fs::create_dir_all(&ndir).unwrap();
    let feed = format!("seed_listen = \"127.0.0.1:{}\"", free_port());
    let r_config = replica_config(
        &a.addr(),
        server,
        (&format!("127.0.0.1:{port}"), &ndir),
        (&[], &feed),
    ) + &puller_config(&src, &root.join("r-log"));
    let follower = agent(root, "r", &root.join("r-snaps"), &r_config, &[]);
    wait_following(&follower);
    a.bgsave();
    let seq = kvsync::snapshot::verify_file(&a.dir.join("dump.rdb"), None)
        .unwrap()
        .seq;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(src.offered(seq));

    // The primary's backlog (its smallest) moves on past the RDB's offset.
    let _: () = a.cmd(&["CONFIG", "SET", "repl-backlog-size", "1mb"]);
    a.fill(&format!("{{{tag}}}gap"), 20_000, &"g".repeat(200));
    // (The server trims its backlog a little at a time, in its cron.)
    wait_for(
        "the backlog to no longer hold the RDB's next offset",
        DEADLINE,
        || (a.info("replication").num("repl_backlog_first_byte_offset") > seq + 1).then_some(()),
    );
    wait_for("the node's agent's log to hold the gap", DEADLINE, || {
        let end = a.info("replication").num("master_repl_offset");
        (stream_status(&follower).end_offset == end).then_some(())
    });
    let (full, partial, forks) = sync_counters(a);
    // About 10 kB/s while the seeding runs.
    let writer_tag = tag.clone();
    let writer = Client::start(a, move |con, i| {
        let _: () = redis::cmd("SET")
            .arg(format!("{{{writer_tag}}}during:{i}"))
            .arg("d".repeat(100))
            .query(con)
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    });
    // Cancelled while the node is fed the gap: the handoff, which acts on
    // the node step by step, still runs to its end.
    let node = started(server, port, &ndir);
    let p = rt.block_on(async {
        let id = start_sync(&follower, &src).await;
        wait_for("the node to take the feed's password", DEADLINE, || {
            let mut con = redis::Client::open(node.url())
                .ok()?
                .get_connection()
                .ok()?;
            let auth: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg("masterauth")
                .query(&mut con)
                .ok()?;
            auth.get(1).is_some_and(|p| !p.is_empty()).then_some(())
        });
        let mut c = follower.client().await;
        c.cancel_sync(pb::CancelSyncRequest {
            sync_id: id.clone(),
        })
        .await
        .unwrap();
        wait_done(&follower, &id).await
    });
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    for says in [
        "this agent's stream log fed the node",
        "partial resync accepted",
        "(new) joined as a replica",
    ] {
        assert!(p.handoff.contains(says), "{says}: {}", p.handoff);
    }
    drop(writer);
    joined_and_caught_up(&node, a);
    assert_eq!(
        sync_counters(a),
        (full, partial + 1, forks),
        "the primary continued the node once, with no full sync and no fork"
    );
    let auth: Vec<String> = node.cmd(&["CONFIG", "GET", "masterauth"]);
    assert_eq!(auth[1], "", "the node's own masterauth is back");
    drop((follower, src, shards));
}

on_both_servers!(
    a_new_node_is_seeded_as_a_shard_replica_with_a_partial_resync_no_fork_and_no_slot_claimed,
    a_replica_node_lost_with_its_files_is_rebuilt_under_its_old_id,
    a_handoff_that_would_turn_a_shard_primary_into_a_replica_is_refused_before_anything_changes,
    a_cluster_failover_moves_the_shards_logs_without_a_full_sync_and_never_to_an_unproved_node,
    check_config_live_probes_the_cluster_rights,
    a_node_whose_rdb_cannot_be_placed_gets_its_nodes_conf_back_and_is_started_again,
    an_automatic_failover_moves_the_promoted_nodes_log_onto_its_node,
    one_cluster_fanout_seeds_a_new_node_for_every_shard_from_its_primarys_agent,
    an_rdb_the_primary_cannot_continue_is_refused_before_the_node_is_stopped,
    a_gap_beyond_the_primarys_backlog_is_filled_through_the_agent_without_a_fork,
);
