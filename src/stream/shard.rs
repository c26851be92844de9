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
//! itself (by its configured address) when it is a primary, else the
//! primary its line names, once that one is in the table, reachable in
//! the node's eyes and itself a primary. Each name that differs from the
//! last is passed on, whatever config epoch the table gives it (an epoch
//! is gossip as well). A server that is not in cluster mode is asked
//! again every [`RECHECK`] (it may be restarted in cluster mode).
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

use super::named::Known;
use crate::config::ServerAuth;
use crate::kv::cluster::{parse_nodes, NodeLine};
use crate::kv::redis::{server_err, RedisError};
use crate::peer_text::escape_controls;

/// How often the local node is asked its role.
pub const POLL: Duration = Duration::from_millis(100);
/// How often a server is asked while it does not answer.
const FIRST_POLL: Duration = Duration::from_secs(1);
/// How often its table is read even when its role stays the same (the
/// role names a primary by address only; the table also gives its epoch
/// and whether the node sees it alive).
pub const RECHECK: Duration = Duration::from_secs(5);
/// The longest one question to the node may take (the client's own
/// reply timeout may end it sooner).
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
/// the node itself when it is a primary, under its configured address
/// `local` (the IP its own line shows is what the last node to meet it
/// said, which anyone on the bus can be), else the primary its line names.
pub fn named(nodes: &[NodeLine], local: &str) -> Result<Known, NoPrimary> {
    let me = nodes
        .iter()
        .find(|n| n.is_myself())
        .ok_or(NoPrimary::NoMyself)?;
    if me.is_master() {
        return Ok(Known {
            epoch: me.config_epoch,
            addr: local.to_string(),
        });
    }
    // A line is gossip: its text reaches status only escaped.
    let text = |t: &str| escape_controls(t).into_owned();
    let primary = nodes
        .iter()
        .find(|n| n.id == me.master)
        .ok_or_else(|| NoPrimary::Unlisted(text(&me.master)))?;
    if primary.is_lost() {
        return Err(NoPrimary::Lost {
            id: text(&primary.id),
            flags: text(&primary.flags.join(",")),
            link: text(&primary.link),
        });
    }
    if !primary.is_master() {
        return Err(NoPrimary::NotAPrimary(text(&primary.id)));
    }
    let addr = address(primary).ok_or_else(|| NoPrimary::NoAddress {
        id: text(&primary.id),
        address: primary.address.clone(),
    })?;
    Ok(Known {
        epoch: primary.config_epoch,
        addr,
    })
}

/// `ip:port` of a node's line (IPv6 in brackets); `None` unless the IP is
/// an IP address or a plain host name and the port a real one.
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

/// One connection to the local node, made again after any error; whether
/// the server is in cluster mode is asked once per connection (a server
/// restarted with another mode is a new connection).
struct Node {
    addr: String,
    auth: ServerAuth,
    con: Option<(redis::aio::MultiplexedConnection, bool)>,
}

impl Node {
    async fn query<T: redis::FromRedisValue>(
        addr: &str,
        con: &mut redis::aio::MultiplexedConnection,
        cmd: &redis::Cmd,
    ) -> Result<T, RedisError> {
        let asked = cmd.query_async(con);
        tokio::time::timeout(ASK, asked)
            .await
            .map_err(|_| server_err(addr, format!("no answer within {ASK:?}")))?
            .map_err(|e| server_err(addr, e))
    }

    /// The connection, and whether the server is in cluster mode.
    async fn connected(
        &mut self,
    ) -> Result<(&mut redis::aio::MultiplexedConnection, bool), RedisError> {
        if self.con.is_none() {
            let mut con = crate::kv::redis::connect(&self.addr, &self.auth).await?;
            let info: String =
                Self::query(&self.addr, &mut con, redis::cmd("INFO").arg("cluster")).await?;
            let cluster = info.lines().any(|l| l.trim() == "cluster_enabled:1");
            self.con = Some((con, cluster));
        }
        let (con, cluster) = self.con.as_mut().expect("connected just now");
        Ok((con, *cluster))
    }

    /// Asks `cmd`; an error drops the connection.
    async fn ask<T: redis::FromRedisValue>(
        &mut self,
        cmd: &redis::Cmd,
    ) -> Result<Option<T>, RedisError> {
        let addr = self.addr.clone();
        let answer = match self.connected().await {
            Ok((_, false)) => return Ok(None),
            Ok((con, true)) => Self::query(&addr, con, cmd).await.map(Some),
            Err(e) => Err(e),
        };
        if answer.is_err() {
            self.con = None;
        }
        answer
    }

    async fn role(&mut self) -> Result<Role, RedisError> {
        let Some(role) = self.ask::<Vec<redis::Value>>(&redis::cmd("ROLE")).await? else {
            return Ok(None);
        };
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
        let text: Option<String> = self.ask(redis::cmd("CLUSTER").arg("NODES")).await?;
        Ok(parse_nodes(&text.unwrap_or_default()))
    }
}

/// Keeps `primary` at the shard primary the node at `local` names, until
/// `stop`; `report` hears what the table says (status).
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
    // The role the table was read at; `None` until the server answered
    // as a cluster node.
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
        let next = match node.role().await {
            Ok(None) => {
                debug!(server = %local, "the server is not in cluster mode: no cluster failover to follow");
                role = None;
                RECHECK
            }
            Ok(Some(now)) => {
                if role.as_ref() != Some(&now) || read.elapsed() >= RECHECK {
                    match node.table().await.map(|t| named(&t, &local)) {
                        Ok(Ok(k)) => say(take(k, &primary, &local), false),
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
                POLL
            }
            // A server not known to be a cluster node yet is the health
            // poll's to report.
            Err(e) if role.is_none() => {
                debug!(node = %local, error = %e, "the server did not answer");
                FIRST_POLL
            }
            Err(e) => {
                say(format!("the node did not answer: {e}"), true);
                FIRST_POLL
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(next) => {}
        }
    }
}

/// Passes `k` on when it names another address than the one passed on
/// last, whatever epoch it gives: an epoch is gossip too, and one raised
/// past every later failover would keep the agent from ever following
/// again. What guards the take is its proof. What the table says, for
/// status.
fn take(k: Known, primary: &watch::Sender<Option<Known>>, local: &str) -> String {
    let text = format!(
        "the node {local} names the shard primary {} (config epoch {})",
        k.addr, k.epoch
    );
    primary.send_if_modified(|f| {
        let new = f.as_ref().is_none_or(|f| f.addr != k.addr);
        if new {
            *f = Some(k);
        }
        new
    });
    text
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
        // A primary is named by its configured address, whatever IP its
        // own line shows (the last node to meet it said which).
        let me = "aaaa 10.9.9.9:7000@17000 myself,master - 0 0 4 connected 0-5460";
        let k = named(&table(&[me]), "10.0.0.1:7000").unwrap();
        assert_eq!((k.addr.as_str(), k.epoch), ("10.0.0.1:7000", 4));
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
        // Gossip is data: its text reaches status escaped, and an address
        // with control characters is refused.
        let odd = "bbbb 10.0.0.2:7001@17001 myself,slave \u{1b}]0;x\u{7} 0 0 3 connected";
        let said = named(&table(&[odd]), "x").unwrap_err().to_string();
        assert!(!crate::peer_text::has_control(&said), "{said}");
        let escape = "aaaa \u{1b}]0;x:7000@17000 master - 0 0 3 connected 0-5460";
        assert!(matches!(
            named(&table(&[escape, R]), "x"),
            Err(NoPrimary::NoAddress { .. })
        ));
        assert_eq!(named(&table(&[P]), "x"), Err(NoPrimary::NoMyself));
    }

    #[test]
    fn a_name_is_passed_on_when_its_address_changes_whatever_its_epoch() {
        let (tx, mut rx) = watch::channel(None);
        let k = |epoch, addr: &str| Known {
            epoch,
            addr: addr.into(),
        };
        take(k(u64::MAX, "a:1"), &tx, "n");
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().as_ref().unwrap().addr, "a:1");
        // A poisoned epoch stops nothing: the promoted node under a lower one.
        take(k(7, "b:1"), &tx, "n");
        assert_eq!(rx.borrow_and_update().as_ref().unwrap().addr, "b:1");
        // The same address under another epoch is nothing new.
        take(k(8, "b:1"), &tx, "n");
        assert!(!rx.has_changed().unwrap());
    }
}
