//! The stream's test helpers: agents that follow a primary or another
//! agent, servers seeded and fed through them, a steady writer, and waits
//! for a server to converge with its primary.

use std::path::Path;

use super::kv::*;
use super::node::*;
use super::*;

/// The config of an agent following `primary` into `log_dir`.
pub fn follower_config(primary: &Redis, log_dir: &Path) -> String {
    format!(
        "[redis]\nprimary_addr = \"{}\"\npassword = \"{}\"\n[stream]\ndir = \"{}\"\nfsync = \"always\"\n",
        primary.addr(),
        primary.password.as_deref().unwrap_or(""),
        log_dir.display()
    )
}

/// The stream status of an agent's only instance.
pub fn stream_status(agent: &Node) -> kvsync::rpc::pb::StreamStatus {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(agent.status());
    s.instances[0]
        .stream
        .clone()
        .expect("the instance keeps a stream log")
}

/// The primary's agent `src`, following `primary` into `<root>/src-log`,
/// once it follows (writes from then on go into the stream).
pub fn following_source(root: &Path, primary: &Redis, env: &[(&str, &str)]) -> Node {
    let config = follower_config(primary, &root.join("src-log"));
    source_with(root, &config, env)
}

/// The primary's agent `src` with `config`, once it follows.
pub fn source_with(root: &Path, config: &str, env: &[(&str, &str)]) -> Node {
    let source = agent(root, "src", &root.join("src-snaps"), config, env);
    wait_following(&source);
    source
}

/// Waits until `agent` follows its source, so that writes from now on go
/// into the stream (not into a full resync's RDB).
pub fn wait_following(agent: &Node) {
    wait_for("the agent to follow its source", DEADLINE, || {
        stream_status(agent)
            .state
            .starts_with("following")
            .then_some(())
    });
}

/// The config of a replica agent following `upstream`'s stream.
pub fn puller_config(upstream: &Node, log_dir: &Path) -> String {
    format!(
        "[stream]\ndir = \"{}\"\nupstream = \"{}\"\n",
        log_dir.display(),
        upstream.grpc()
    )
}

/// The replica agent `rep` following `source`'s log into `root/rep-log`.
pub fn pulling_agent(root: &Path, source: &Node) -> Node {
    let config = puller_config(source, &root.join("rep-log"));
    agent(root, "rep", &root.join("rep-snaps"), &config, &[])
}

/// The config of a replica agent following `source`'s log into
/// `log_dir` and feeding `rs` from it (`redis-stream`).
pub fn feeding_puller_config(log_dir: &Path, source: &Node, rs: &Redis) -> String {
    format!(
        "{}[handoff]\nmode = \"redis-stream\"\ntimeout = \"60s\"\n[redis]\nserver_addr = \"{}\"\n",
        puller_config(source, log_dir),
        rs.addr()
    )
}

/// A replica agent `rep` following `source`'s log with `redis-stream`, and
/// its server seeded through it from the source's snapshot of `primary`,
/// once the server has everything the primary wrote.
pub fn seeded_through_two_agents(
    root: &Path,
    server: Server,
    primary: &Redis,
    source: &Node,
) -> (Redis, Node) {
    seeded_through_two_agents_with(root, server, primary, source, "")
}

/// [`seeded_through_two_agents`] with `stream` added to the replica
/// agent's `[stream]` section.
pub fn seeded_through_two_agents_with(
    root: &Path,
    server: Server,
    primary: &Redis,
    source: &Node,
    stream: &str,
) -> (Redis, Node) {
    seeded_replica(root, server, primary, source, ("rep", "r", stream))
}

/// A replica agent `name` (its log in `<name>-log`, its snapshots in
/// `<name>-snaps`, `stream` added to its `[stream]` section) following
/// `source`'s log with `redis-stream`, and its server (in `server_dir`)
/// seeded through it from the source's snapshot of `primary`, once the
/// server has everything the primary wrote.
pub fn seeded_replica(
    root: &Path,
    server: Server,
    primary: &Redis,
    source: &Node,
    names: (&str, &str, &str),
) -> (Redis, Node) {
    seeded_replica_on(root, server, primary, source, names, free_port())
}

/// [`seeded_replica`] with its server on `port` (an address chosen before,
/// for other agents' configurations).
pub fn seeded_replica_on(
    root: &Path,
    server: Server,
    primary: &Redis,
    source: &Node,
    (name, server_dir, stream): (&str, &str, &str),
    port: u16,
) -> (Redis, Node) {
    let rs = Redis::standalone_replica_on(server, &root.join(server_dir), port);
    seed_fed(root, rs, primary, source, (name, stream, ""))
}

/// A replica agent `name` (`stream` added to its `[stream]` section,
/// `redis` to its `[redis]`) following `source`'s log with
/// `redis-stream`, and `rs` seeded through it from the source's snapshot
/// of `primary`, once the server has everything the primary wrote.
pub fn seed_fed(
    root: &Path,
    rs: Redis,
    primary: &Redis,
    source: &Node,
    (name, stream, redis): (&str, &str, &str),
) -> (Redis, Node) {
    primary.fill("before", 500, "v");
    let snapshot = wait_for("the full resync's RDB offered", DEADLINE, || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s = rt.block_on(source.status());
        s.instances[0].latest_snapshots.first().map(|e| e.seq)
    });
    let config = feeding_puller_config(&root.join(format!("{name}-log")), source, &rs)
        .replacen("[handoff]", &format!("{stream}[handoff]"), 1)
        .replacen("[redis]\n", &format!("[redis]\n{redis}"), 1);
    let replica = agent(
        root,
        name,
        &root.join(format!("{name}-snaps")),
        &config,
        &[],
    );
    wait_following(&replica);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = rt.block_on(sync_from(&replica, &source.grpc()));
    assert_eq!(p.phase, kvsync::rpc::pb::Phase::Succeeded as i32, "{p:?}");
    assert_eq!(p.seq, snapshot);
    assert!(
        p.handoff.contains("follows this agent's stream log"),
        "{}",
        p.handoff
    );
    // The server was fed the snapshot while it arrived.
    assert!(replica
        .proc
        .log()
        .contains("seeding the local server while the snapshot arrives"));
    converged(&rs, primary, "the fed server to converge after seeding");
    (rs, replica)
}

/// `SET` then `WAIT 1 timeout_ms` on one connection: how many replicas
/// acknowledged that write.
pub fn write_and_wait(con: &mut redis::Connection, key: &str, timeout_ms: u64) -> i64 {
    redis::cmd("SET")
        .arg(key)
        .arg("w")
        .query::<()>(con)
        .unwrap();
    redis::cmd("WAIT")
        .arg(1)
        .arg(timeout_ms)
        .query(con)
        .unwrap()
}

/// A writer of 2000 keys a second (`w:<n>`, values padded by `pad`
/// bytes) for `secs` seconds on `con`; the thread returns how many it set.
pub fn steady_writer(
    mut con: redis::Connection,
    secs: u64,
    pad: usize,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut n = 0usize;
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(secs) {
            let mut p = redis::pipe();
            for _ in 0..20 {
                p.cmd("SET")
                    .arg(format!("w:{n}"))
                    .arg(format!("value-{n}-of-a-steady-writer{}", "x".repeat(pad)))
                    .ignore();
                n += 1;
            }
            p.query::<()>(&mut con).unwrap();
            // The writer's pace, not a wait for a state.
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        n
    })
}

/// Waits until `rs` has applied everything `primary` wrote and holds as
/// many keys.
pub fn converged(rs: &Redis, primary: &Redis, what: &str) {
    wait_for(what, DEADLINE, || {
        let end = primary.info("replication").num("master_repl_offset");
        let at = rs.info("replication").num("master_repl_offset");
        (at == end && rs.cmd::<i64>(&["DBSIZE"]) == primary.cmd::<i64>(&["DBSIZE"])).then_some(())
    })
}

/// Every hundredth of the `written` keys of [`steady_writer`] is the
/// primary's, byte for byte.
pub fn same_sample(rs: &Redis, primary: &Redis, written: usize) {
    for i in (0..written).step_by(written / 100) {
        let key = format!("w:{i}");
        let dump = |r: &Redis| r.cmd::<Vec<u8>>(&["DUMP", &key]);
        assert_eq!(dump(rs), dump(primary), "{key}");
    }
}

/// The log's segment files in `dir`, oldest first.
pub fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvslog"))
        .collect();
    all.sort();
    all
}

/// The first offset of the log in `dir` and the whole stream it holds,
/// every record checked against its hash as it is read.
pub fn log_bytes(dir: &Path) -> (u64, Vec<u8>) {
    use kvsync::stream::log::{read, Log};
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
