//! Sentinels in tests: starting one of a server's family, asking what it
//! knows (the master it names, whether a replica is one it could
//! promote), the `[stream]` lines of an agent that follows Sentinels, and
//! waits on a server's role that tolerate a Sentinel killing clients.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use super::kv::{free_port, Redis, Server, HARNESS};
use super::*;

/// The master's name every test's Sentinels watch.
pub const MASTER: &str = "kvmaster";

/// A Sentinel of `server`'s family in `dir`, listening on 127.0.0.1 and
/// `ip`, watching the primary at `primary` as [`MASTER`] (quorum 2),
/// calling it down after `down_after` without an answer.
pub fn start_sentinel(
    server: Server,
    dir: &Path,
    (ip, primary): (&str, &str),
    down_after: Duration,
) -> Redis {
    start_sentinel_acl(server, dir, (ip, primary), down_after, &[])
}

/// [`start_sentinel`] with ACL `users` (each a rule list, `"kvsync on >pw
/// ~* +@all"`): when there are any, its `default` user is off and the
/// harness connects as [`HARNESS`].
pub fn start_sentinel_acl(
    server: Server,
    dir: &Path,
    (ip, primary): (&str, &str),
    down_after: Duration,
    users: &[&str],
) -> Redis {
    start_sentinel_conf(server, dir, (ip, primary), down_after, users, "")
}

/// [`start_sentinel_acl`] with `extra` lines in its `sentinel.conf`.
pub fn start_sentinel_conf(
    server: Server,
    dir: &Path,
    (ip, primary): (&str, &str),
    down_after: Duration,
    users: &[&str],
    extra: &str,
) -> Redis {
    std::fs::create_dir_all(dir).unwrap();
    let port = free_port();
    let conf = dir.join("sentinel.conf");
    let (host, primary_port) = primary.rsplit_once(':').unwrap();
    let bind = match ip {
        "127.0.0.1" => ip.to_string(),
        _ => format!("127.0.0.1 {ip}\nprotected-mode no"),
    };
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind {bind}\ndir {}\nlogfile {}\n{extra}sentinel monitor {MASTER} {host} {primary_port} 2\nsentinel down-after-milliseconds {MASTER} {}\nsentinel failover-timeout {MASTER} 20000\n",
            dir.display(),
            dir.join("sentinel.log").display(),
            down_after.as_millis(),
        ),
    )
    .unwrap();
    let acl = !users.is_empty();
    if acl {
        let mut lines = format!(
            "user {} on >{} ~* &* +@all\nuser default off\n",
            HARNESS.0, HARNESS.1
        );
        for rules in users {
            lines += &format!("user {rules}\n");
        }
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&conf)
            .unwrap();
        std::io::Write::write_all(&mut f, lines.as_bytes()).unwrap();
    }
    let child = server
        .sentinel(&conf)
        .stdout(Stdio::null())
        .spawn()
        .expect("a Sentinel (the test command installs redis-sentinel)");
    let s = Redis {
        server,
        port,
        dir: dir.to_owned(),
        child: Some(child),
        password: acl.then(|| HARNESS.1.to_string()),
        user: acl.then(|| HARNESS.0.to_string()),
    };
    s.wait_up();
    s
}

/// A Sentinel's field-value answer as pairs.
fn fields(flat: &[String]) -> HashMap<String, String> {
    flat.chunks_exact(2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect()
}

/// Whether `sentinel` knows two other Sentinels, the master as up with no
/// failover in progress (one ends once every replica it knows is
/// re-pointed, or after its `failover-timeout`), and the replica on port
/// `replica` as one it would promote: up, its link to the master up and
/// never down since, and heard from lately (Sentinel wants a ping
/// answered within 5 s and its `INFO` within 30 s; asked here with a
/// margin: after a cut, Sentinel's link to it may take longer than the
/// cut to come back).
pub fn sentinel_ready(sentinel: &Redis, replica: u16) -> bool {
    let master = fields(&sentinel.cmd::<Vec<String>>(&["SENTINEL", "MASTER", MASTER]));
    let replicas: Vec<Vec<String>> = sentinel.cmd(&["SENTINEL", "REPLICAS", MASTER]);
    let ms = |r: &HashMap<String, String>, field: &str| r[field].parse::<u64>().unwrap_or(u64::MAX);
    master["num-other-sentinels"] == "2"
        && master["flags"] == "master"
        && replicas.iter().map(|r| fields(r)).any(|r| {
            r["port"] == replica.to_string()
                && r["flags"] == "slave"
                && r["master-link-status"] == "ok"
                && r["master-link-down-time"] == "0"
                && ms(&r, "last-ok-ping-reply") < 2_000
                && ms(&r, "info-refresh") < 20_000
        })
}

/// A connection to the master that the Sentinel at `sentinel` (host:port)
/// names.
pub fn master_con(sentinel: &str) -> redis::RedisResult<redis::Connection> {
    let mut s = redis::Client::open(format!("redis://{sentinel}/"))?.get_connection()?;
    let at: Vec<String> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(MASTER)
        .query(&mut s)?;
    redis::Client::open(format!("redis://{}:{}/", at[0], at[1]))?.get_connection()
}

/// Where `sentinel` says the master is.
pub fn master_of(sentinel: &Redis) -> String {
    let at: Vec<String> = sentinel.cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER]);
    format!("{}:{}", at[0], at[1])
}

/// `[stream]` lines of an agent that follows the Sentinels at `sentinels`
/// (`host:port`), its peers `peers`.
pub fn sentinel_lines(sentinels: &[String], peers: &[String]) -> String {
    let list = |v: &[String]| {
        v.iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "sentinels = [{}]\nmaster_name = \"{MASTER}\"\npeers = [{}]\n",
        list(sentinels),
        list(peers)
    )
}

/// `INFO replication` of `server`, or `None` when the ask failed: a
/// Sentinel that promotes or demotes a server kills its clients
/// (`CLIENT KILL TYPE normal`), and a wait asks again.
pub fn try_info(server: &Redis) -> Option<kvsync::kv::redis::Info> {
    let mut con = redis::Client::open(server.url())
        .ok()?
        .get_connection()
        .ok()?;
    let text: String = redis::cmd("INFO").arg("replication").query(&mut con).ok()?;
    Some(kvsync::kv::redis::Info::parse(&text))
}

/// Waits until `server` replicates from the server on port `primary`
/// with its link up.
pub fn replicates_from(server: &Redis, primary: u16, what: &str) {
    wait_for(what, DEADLINE * 2, || {
        let info = try_info(server)?;
        (info.get("role") == Some("slave")
            && info.num("master_port") == primary as u64
            && info.get("master_link_status") == Some("up"))
        .then_some(())
    });
}

/// Asks `sentinel` to fail [`MASTER`] over.
pub fn fail_over(sentinel: &Redis) {
    let started: String = sentinel.cmd(&["SENTINEL", "FAILOVER", MASTER]);
    assert_eq!(started, "OK");
}
