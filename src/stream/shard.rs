//! A cluster's word on who an instance's primary is, for an agent beside
//! a node of a Redis Cluster or Valkey cluster. The cluster elects a
//! shard's primary itself (its primaries vote, and the winner takes a new
//! config epoch), and re-attaches the old one as a replica of the new:
//! kvsync never promotes a cluster node and never sends one `REPLICAOF`.
//! What its agents do at a failover (`CLUSTER FAILOVER`, or an automatic
//! one) is move their logs, as after a Sentinel failover.
//!
//! [`watch`] asks the local node (the instance's `[redis] primary_addr`,
//! else its `server_addr`) its `ROLE` every [`POLL`], and reads its table
//! (`CLUSTER NODES`) at start, whenever the role changes and every
//! [`RECHECK`]. The table names the shard's primary ([`named`]): the node
//! itself when it is a primary, else the primary its line names, once
//! that one is in the table, reachable in the node's eyes and itself a
//! primary, under that primary's config epoch. A name under an older
//! epoch than the one followed is never taken. A server that is not in
//! cluster mode ends the watch.
//!
//! The table is gossip, which any node on the cluster bus can add to, so
//! the name proves nothing by itself: [`super::named::apply`] takes it
//! the way `kvsync stream follow --primary` does, where the log follows
//! the local server only when that is a primary now, and otherwise only a
//! configured peer agent whose log follows the named primary. A node no
//! configured agent sits beside is never followed (status says why), and
//! the old primary's agent points no server anywhere in cluster mode.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::named::{supersedes, Known};
use crate::config::ServerAuth;
use crate::kv::cluster::{parse_nodes, NodeLine};
use crate::kv::redis::{server_err, RedisError};

/// How often the local node is asked its role.
pub const POLL: Duration = Duration::from_millis(100);
/// How often a server is asked while it has not answered yet (whether it
/// is a cluster node at all is not known).
const FIRST_POLL: Duration = Duration::from_secs(1);
/// How often its table is read even when its role stays the same (the
/// role names a primary by address only; the table also gives its epoch
/// and whether the node sees it alive).
pub const RECHECK: Duration = Duration::from_secs(5);
/// The longest one question to the node may take.
const ASK: Duration = Duration::from_secs(5);

/// Why the local node's table names no primary now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoPrimary {
    #[error("the node's table has no line for itself")]
    NoMyself,
    #[error("the node's primary {0} is not in its table")]
    Unlisted(String),
    #[error("the node's primary {id} is lost in its eyes (flags {flags}, link {link}): a failover may be under way")]
    Lost {
        id: String,
        flags: String,
        link: String,
    },
    #[error("the node follows {0}, which is no primary in its table")]
    NotAPrimary(String),
    #[error("the node's primary {id} has no usable address ({address:?})")]
    NoAddress { id: String, address: String },
}

/// The shard primary the table `nodes` of the node at `local` names:
/// the node itself when it is a primary (under the address its table
/// gives it, else `local`), else the primary its line names.
pub fn named(nodes: &[NodeLine], local: &str) -> Result<Known, NoPrimary> {
    let me = nodes
        .iter()
        .find(|n| n.is_myself())
        .ok_or(NoPrimary::NoMyself)?;
    if me.is_master() {
        let addr = address(me).unwrap_or_else(|| local.to_string());
        return Ok(Known {
            epoch: me.config_epoch,
            addr,
        });
    }
    let primary = nodes
        .iter()
        .find(|n| n.id == me.master)
        .ok_or_else(|| NoPrimary::Unlisted(me.master.clone()))?;
    if primary.is_lost() {
        return Err(NoPrimary::Lost {
            id: primary.id.clone(),
            flags: primary.flags.join(","),
            link: primary.link.clone(),
        });
    }
    if !primary.is_master() {
        return Err(NoPrimary::NotAPrimary(primary.id.clone()));
    }
    let addr = address(primary).ok_or_else(|| NoPrimary::NoAddress {
        id: primary.id.clone(),
        address: primary.address.clone(),
    })?;
    Ok(Known {
        epoch: primary.config_epoch,
        addr,
    })
}

/// `ip:port` of a node's line (IPv6 in brackets); `None` unless the IP is
/// an IP address or a plain host name and the port a real one (a line is
/// gossip: no control characters reach status or a log).
fn address(n: &NodeLine) -> Option<String> {
    let (ip, port) = n.ip_port();
    let plain = ip.parse::<std::net::IpAddr>().is_ok() || crate::peer_text::is_plain_name(ip);
    match (plain && port != 0, ip.contains(':')) {
        (false, _) => None,
        (true, true) => Some(format!("[{ip}]:{port}")),
        (true, false) => Some(format!("{ip}:{port}")),
    }
}

/// What the node says of its role: `master`, or `slave <host> <port>`
/// (`None`: the server is not in cluster mode).
type Role = Option<String>;

/// One connection to the local node, made again after any error.
struct Node {
    addr: String,
    auth: ServerAuth,
    con: Option<redis::aio::MultiplexedConnection>,
}

impl Node {
    async fn query<T: redis::FromRedisValue>(&mut self, cmd: redis::Cmd) -> Result<T, RedisError> {
        let addr = self.addr.clone();
        let asked = async {
            let con = match &mut self.con {
                Some(con) => con,
                None => self
                    .con
                    .insert(crate::kv::redis::connect(&addr, &self.auth).await?),
            };
            cmd.query_async(con).await.map_err(|e| server_err(&addr, e))
        };
        let answer = tokio::time::timeout(ASK, asked)
            .await
            .unwrap_or_else(|_| Err(server_err(&addr, format!("no answer within {ASK:?}"))));
        if answer.is_err() {
            self.con = None;
        }
        answer
    }

    async fn role(&mut self) -> Result<Role, RedisError> {
        let cluster: String = self
            .query(redis::cmd("INFO").arg("cluster").clone())
            .await?;
        if !cluster.lines().any(|l| l.trim() == "cluster_enabled:1") {
            return Ok(None);
        }
        let role: Vec<redis::Value> = self.query(redis::cmd("ROLE")).await?;
        // A primary's role also gives its offset, which moves with every
        // write: only a replica's primary (host and port) is kept.
        let words: Vec<String> = role
            .into_iter()
            .take(3)
            .filter_map(|v| redis::from_redis_value::<String>(v).ok())
            .collect();
        Ok(Some(match words.first().map(String::as_str) {
            Some("master") => "master".into(),
            _ => words.join(" "),
        }))
    }

    async fn table(&mut self) -> Result<Vec<NodeLine>, RedisError> {
        let text: String = self
            .query(redis::cmd("CLUSTER").arg("NODES").clone())
            .await?;
        Ok(parse_nodes(&text))
    }
}

/// Keeps `primary` at the shard primary the node at `local` names, never
/// going back to an older epoch, until `stop` or until the server turns
/// out not to be in cluster mode; `report` hears what the table says
/// (status).
pub async fn watch(
    local: String,
    auth: ServerAuth,
    primary: watch::Sender<Option<Known>>,
    report: impl Fn(String) + Send,
    stop: CancellationToken,
) {
    let mut node = Node {
        addr: local.clone(),
        auth,
        con: None,
    };
    let mut role = None::<String>;
    let mut read = Instant::now();
    let mut said = String::new();
    let mut say = |text: String, warn: bool| {
        if text != said {
            match warn {
                true => warn!(node = %local, "{text}"),
                false => info!(node = %local, "{text}"),
            }
            report(text.clone());
            said = text;
        }
    };
    loop {
        match node.role().await {
            Ok(None) => {
                info!(server = %local, "the server is not in cluster mode: no cluster failover to follow");
                return;
            }
            Ok(Some(now)) => {
                if role.as_ref() != Some(&now) || read.elapsed() >= RECHECK {
                    match node.table().await.map(|t| named(&t, &local)) {
                        Ok(Ok(k)) => {
                            let (text, warn) = take(k, &primary, &local);
                            say(text, warn)
                        }
                        Ok(Err(why)) => say(
                            format!("the node {local} names no shard primary: {why}"),
                            true,
                        ),
                        Err(e) => say(format!("the node's table could not be read: {e}"), true),
                    }
                    // Read again when the role changes or RECHECK passes,
                    // not at every POLL while the table names no one.
                    role = Some(now);
                    read = Instant::now();
                }
            }
            // A server not known to be a cluster node yet is the health
            // poll's to report.
            Err(e) if role.is_none() => {
                debug!(node = %local, error = %e, "the server did not answer")
            }
            Err(e) => say(format!("the node did not answer: {e}"), true),
        }
        let next = match role {
            Some(_) => POLL,
            None => FIRST_POLL,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(next) => {}
        }
    }
}

/// Passes `k` on unless it is older than the primary followed; what
/// the table says, and whether that is a warning.
fn take(k: Known, primary: &watch::Sender<Option<Known>>, local: &str) -> (String, bool) {
    // Cloned on its own: no borrow is held across the send below.
    let followed = primary.borrow().clone();
    if let Some(f) = followed.filter(|f| *f != k && !supersedes(&k, Some(f))) {
        let text = format!(
            "the node {local} names {} under config epoch {}, older than the followed {}'s {}: not taken",
            k.addr, k.epoch, f.addr, f.epoch
        );
        return (text, true);
    }
    let text = format!(
        "the node {local} names the shard primary {} (config epoch {})",
        k.addr, k.epoch
    );
    primary.send_if_modified(|f| match supersedes(&k, f.as_ref()) {
        true => {
            *f = Some(k);
            true
        }
        false => false,
    });
    (text, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(lines: &[&str]) -> Vec<NodeLine> {
        parse_nodes(&lines.join("\n"))
    }

    const P: &str = "aaaa 10.0.0.1:7000@17000 master - 0 0 3 connected 0-5460";
    const R: &str = "bbbb 10.0.0.2:7001@17001 myself,slave aaaa 0 0 3 connected";

    #[test]
    fn a_replica_names_its_primary_and_a_primary_itself() {
        let k = named(&table(&[P, R]), "r.local:7001").unwrap();
        assert_eq!((k.addr.as_str(), k.epoch), ("10.0.0.1:7000", 3));
        let me = "aaaa 10.0.0.1:7000@17000 myself,master - 0 0 4 connected 0-5460";
        let k = named(&table(&[me]), "p.local:7000").unwrap();
        assert_eq!((k.addr.as_str(), k.epoch), ("10.0.0.1:7000", 4));
        // A node that never met another has no IP of its own yet.
        let alone = "aaaa :7000@17000 myself,master - 0 0 0 connected";
        assert_eq!(
            named(&table(&[alone]), "p.local:7000").unwrap().addr,
            "p.local:7000"
        );
        // The table writes an IPv6 address without brackets.
        let v6 = "aaaa ::1:7000@17000 master - 0 0 3 connected 0-5460";
        let r6 = "bbbb ::1:7001@17001 myself,slave aaaa 0 0 3 connected";
        let k = named(&table(&[v6, r6]), "x").unwrap();
        assert_eq!(k.addr, "[::1]:7000");
    }

    #[test]
    fn a_lost_unlisted_or_odd_primary_is_named_by_no_one() {
        let lost = "aaaa 10.0.0.1:7000@17000 master,fail - 0 0 3 disconnected 0-5460";
        assert!(matches!(
            named(&table(&[lost, R]), "x"),
            Err(NoPrimary::Lost { .. })
        ));
        let maybe = "aaaa 10.0.0.1:7000@17000 master,fail? - 0 0 3 connected 0-5460";
        assert!(matches!(
            named(&table(&[maybe, R]), "x"),
            Err(NoPrimary::Lost { .. })
        ));
        assert_eq!(
            named(&table(&[R]), "x"),
            Err(NoPrimary::Unlisted("aaaa".into()))
        );
        let replica = "aaaa 10.0.0.1:7000@17000 slave cccc 0 0 3 connected";
        assert_eq!(
            named(&table(&[replica, R]), "x"),
            Err(NoPrimary::NotAPrimary("aaaa".into()))
        );
        // Gossip is data: an address with control characters is refused.
        let escape = "aaaa \u{1b}]0;x:7000@17000 master - 0 0 3 connected 0-5460";
        assert!(matches!(
            named(&table(&[escape, R]), "x"),
            Err(NoPrimary::NoAddress { .. })
        ));
        assert_eq!(named(&table(&[P]), "x"), Err(NoPrimary::NoMyself));
    }

    #[test]
    fn a_name_under_an_older_epoch_is_not_passed_on() {
        let (tx, rx) = watch::channel(None);
        let k = |epoch, addr: &str| Known {
            epoch,
            addr: addr.into(),
        };
        assert!(!take(k(2, "a:1"), &tx, "n").1);
        assert_eq!(*rx.borrow(), Some(k(2, "a:1")));
        let (text, warn) = take(k(1, "b:1"), &tx, "n");
        assert!(warn && text.ends_with("not taken"), "{text}");
        assert_eq!(*rx.borrow(), Some(k(2, "a:1")));
        assert!(!take(k(3, "b:1"), &tx, "n").1);
        assert_eq!(*rx.borrow(), Some(k(3, "b:1")));
    }
}
