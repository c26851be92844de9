//! Handing a fed server back to its primary and taking it back
//! (`kvsync stream release` and `attach`). The stream a feed serves is the
//! primary's own, byte for byte, under the primary's replication id, so the
//! server's offset means the same to both: released, it continues from the
//! primary's backlog by a partial resync; taken back, from the stream log
//! by the feed's `+CONTINUE`. Each first checks that the other side holds
//! the server's offset and refuses with the reason when it does not (a
//! hand over that would be a full resync is never started); a hand over
//! that fails to confirm puts the server back where it was.

use std::time::Duration;

use tracing::info;

use super::feed::FeedHandle;
#[cfg(doc)]
use super::log::Log;
use super::proof::{prove_asking, AskError, PeerReport, Proof, Unproved};
use super::{Downstream, SharedLog};
use crate::config::{Config, HostPort, RedisConfig};
use crate::kv::redis::{connect, info, infos, server_err, Info, RedisError};
use crate::kv::seed::{self, config_set, following, replicaof, restore_role};

/// Why a hand over was refused or failed; the server is where it was.
#[derive(Debug, thiserror::Error)]
pub enum HandError {
    #[error("the server {server} does not follow this agent's stream feed ({feed}); it follows {master}")]
    NotFed {
        server: String,
        feed: String,
        master: String,
    },
    #[error("the server {server} follows this agent's stream feed already")]
    AlreadyFed { server: String },
    #[error("the server {server} is not a replica; only a replica of the stream's primary can be taken onto the log")]
    NotReplica { server: String },
    #[error("no primary to hand the server to: pass --primary or set [redis] primary")]
    NoPrimary,
    #[error("refused, nothing was changed: {0}")]
    Unproved(#[from] Unproved),
    #[error("refused, nothing was changed: the server at {primary} {problem}")]
    NotTheServer { primary: String, problem: String },
    #[error("the primary {primary} is at replication id {primary_id}, the server at {server_id}: they do not share a history, so a release would be a full resync; nothing was changed")]
    History {
        primary: String,
        primary_id: String,
        server_id: String,
    },
    #[error("the primary {primary}'s backlog starts at offset {first}, past the server's {offset}: a release would be a full resync (raise repl-backlog-size, or release sooner); nothing was changed")]
    Backlog {
        primary: String,
        first: u64,
        offset: u64,
    },
    #[error("the stream log holds {held}, not the server's {replid} at offset {offset}: taking it back would be a full resync; nothing was changed")]
    NotHeld {
        replid: String,
        offset: u64,
        held: String,
    },
    #[error("the feed answered the server with a full resync, not a continuation")]
    FullResync,
    #[error("the server {server} took writes since it came back a master (or is no longer one): pointing it at the feed would drop them; nothing was changed")]
    TookWrites { server: String },
    #[error("the server {server} changed since it was looked at ({what}): nothing was changed; it is looked at again")]
    Changed { server: String, what: &'static str },
    #[error(transparent)]
    Redis(#[from] RedisError),
}

/// Makes the server fed by `feed` a direct replica of `primary` (empty:
/// `[redis] primary`) by a partial resync, with its own `masterauth` back
/// (else `[redis] password`), once the address is proved
/// ([`super::proof`], asking the configured peers with `ask` when the
/// configuration does not; a peer's word is checked against the server's
/// `run_id` before anything changes). The feed's acknowledgement from it
/// is forgotten: it no longer holds the stream upstream.
pub async fn release<F, Fut>(
    c: &Config,
    primary: &str,
    ask: F,
    feed: &FeedHandle,
    stream: &SharedLog,
) -> Result<String, HandError>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<PeerReport, AskError>>,
{
    let (cfg, timeout) = (&c.redis, c.handoff.timeout);
    let primary = match (primary, cfg.primary.as_str()) {
        ("", "") => return Err(HandError::NoPrimary),
        ("", p) | (p, _) => p,
    };
    let proof = prove_asking(c, primary, ask).await?;
    let to: HostPort = primary.parse().map_err(|e| server_err(primary, e))?;
    let (server, auth) = (&cfg.server_addr, &cfg.auth());
    let mut con = connect(server, auth).await?;
    let was = infos(server, auth, &["server", "replication"]).await?;
    if !follows(&was, feed) {
        return Err(HandError::NotFed {
            server: server.clone(),
            feed: feed.addr.to_string(),
            master: master_of(&was),
        });
    }
    let before = infos(primary, auth, &["server", "replication", "stats"]).await?;
    let offset = may_release(primary, &was, &before, &proof)?;
    let target = feed.target();
    let own = match seed::own_auth(&target)? {
        Some(own) => own,
        None => cfg.auth().secret().map_err(|e| server_err(server, e))?,
    };
    let moved = async {
        config_set(&mut con, server, "masterauth", &own).await?;
        replicaof(&mut con, server, &to.host, to.port).await?;
        let now = following(cfg, timeout, "the server to follow the primary", to.port, 0).await?;
        let after = info(primary, auth, "stats").await?;
        let full = after.num("sync_full") > before.num("sync_full");
        if full || after.num("sync_partial_ok") <= before.num("sync_partial_ok") {
            return Err(HandError::Redis(RedisError::FullResync {
                seq: offset,
                next: offset + 1,
                full_before: before.num("sync_full"),
                full_after: after.num("sync_full"),
            }));
        }
        Ok(now.num("master_repl_offset"))
    }
    .await;
    match moved {
        Ok(at) => {
            stream.forget(&Downstream::Server);
            info!(
                server,
                primary, offset, "released the server to its primary"
            );
            Ok(format!(
                "{server} follows the primary {primary} directly: partial resync from offset {offset}, now at {at}"
            ))
        }
        Err(e) => {
            let _ = config_set(&mut con, server, "masterauth", &target.secret).await;
            let _ = replicaof(
                &mut con,
                server,
                &feed.addr.ip().to_string(),
                feed.addr.port(),
            )
            .await;
            Err(e)
        }
    }
}

/// Decides, before anything changes, whether the fed server (`was`, its
/// `INFO`) may follow `primary` (`before`, its `INFO`; `proof`, what proved
/// its address) with a partial resync: the primary is not the server
/// itself, is the server the proof names, shares the server's history and
/// still holds its offset in its backlog. Returns the server's offset.
fn may_release(primary: &str, was: &Info, before: &Info, proof: &Proof) -> Result<u64, HandError> {
    let (id, offset) = (
        was.get("master_replid").unwrap_or_default().to_string(),
        was.num("master_repl_offset"),
    );
    if before.get("run_id") == was.get("run_id") {
        return Err(HandError::NotTheServer {
            primary: primary.into(),
            problem: "is the server being released itself".into(),
        });
    }
    if let Some(expected) = proof.run_id() {
        let found = before.get("run_id").unwrap_or_default();
        if found != expected {
            return Err(HandError::NotTheServer {
                primary: primary.into(),
                problem: format!("reports run_id {found}, not the {expected} of {proof}"),
            });
        }
    }
    let shares = before.get("master_replid") == Some(id.as_str())
        || (before.get("master_replid2") == Some(id.as_str())
            && offset <= before.num("second_repl_offset"));
    if !shares {
        return Err(HandError::History {
            primary: primary.into(),
            primary_id: before.get("master_replid").unwrap_or_default().into(),
            server_id: id,
        });
    }
    let first = before.num("repl_backlog_first_byte_offset");
    if before.get("repl_backlog_active") != Some("1") || offset + 1 < first {
        return Err(HandError::Backlog {
            primary: primary.into(),
            first,
            offset,
        });
    }
    Ok(offset)
}

/// Takes a replica of the stream's primary back onto the feed: the log
/// must continue its replication id at its offset ([`Log::continues`]);
/// the feed continues it from there.
pub async fn attach(
    cfg: &RedisConfig,
    timeout: Duration,
    feed: &FeedHandle,
    stream: &SharedLog,
) -> Result<String, HandError> {
    let (server, auth) = (&cfg.server_addr, &cfg.auth());
    let was = info(server, auth, "replication").await?;
    if follows(&was, feed) {
        return Err(HandError::AlreadyFed {
            server: server.clone(),
        });
    }
    if was.get("role") != Some("slave") {
        return Err(HandError::NotReplica {
            server: server.clone(),
        });
    }
    onto_feed(cfg, timeout, feed, stream, None).await
}

/// Points the server at the feed, which must continue it: the log holds
/// its replication id at its offset ([`Log::continues`]), checked on the
/// server's state now. `restarted`: the server is a master that came back
/// from a restart, the process with this `run_id` (checked again, as is
/// that the log follows no primary), so the history it holds is its
/// `master_replid2` (a server restarted as a master takes a new id), and
/// only while it has taken no write since (its offset is where that
/// history ended); the feed is told to continue its new id at exactly that offset
/// ([`FeedHandle::expect_restarted`]). A move the feed answers with
/// anything but a continuation puts the server back where it was (its
/// `masterauth`, and its master or none).
pub async fn onto_feed(
    cfg: &RedisConfig,
    timeout: Duration,
    feed: &FeedHandle,
    stream: &SharedLog,
    restarted: Option<&str>,
) -> Result<String, HandError> {
    let (server, auth) = (&cfg.server_addr, &cfg.auth());
    let mut con = connect(server, auth).await?;
    let was = infos(server, auth, &["server", "replication"]).await?;
    let offset = was.num("master_repl_offset");
    let own = was.get("master_replid").unwrap_or_default().to_string();
    let id = match restarted {
        None => own.clone(),
        Some(run_id) => {
            let changed = |what| HandError::Changed {
                server: server.clone(),
                what,
            };
            if was.get("run_id") != Some(run_id) {
                return Err(changed("another process"));
            }
            if matches!(stream.source(), super::source::Source::Primary(_)) {
                return Err(changed("the stream log follows a primary now"));
            }
            if was.get("role") != Some("master") || was.num("second_repl_offset") != offset + 1 {
                return Err(HandError::TookWrites {
                    server: server.clone(),
                });
            }
            was.get("master_replid2").unwrap_or_default().to_string()
        }
    };
    if let Some(held) = stream.view(|log| log.continues(&id, offset).err().map(|_| log.describe()))
    {
        return Err(HandError::NotHeld {
            replid: id,
            offset,
            held,
        });
    }
    if restarted.is_some() {
        feed.expect_restarted(own, (id.clone(), offset));
    }
    let target = feed.target();
    let (master, own) = seed::take_auth(&mut con, server, &was, &target).await?;
    let mut served = feed.served();
    let before = *served.borrow_and_update();
    let moved = async {
        config_set(&mut con, server, "masterauth", &target.secret).await?;
        replicaof(
            &mut con,
            server,
            &feed.addr.ip().to_string(),
            feed.addr.port(),
        )
        .await?;
        let follows = following(
            cfg,
            timeout,
            "the server to follow the stream feed",
            feed.addr.port(),
            offset,
        );
        let mut watched = served.clone();
        let refused = watched.wait_for(|s| s.refused > before.refused);
        let now = tokio::select! {
            now = follows => now?,
            _ = refused => return Err(HandError::TookWrites { server: server.clone() }),
        };
        if served.borrow().full > before.full {
            return Err(HandError::FullResync);
        }
        Ok(now.num("master_repl_offset"))
    }
    .await;
    match moved {
        Ok(at) => {
            info!(server, offset, "took the server back onto the stream log");
            Ok(format!(
                "{server} follows this agent's stream log again: continued from offset {offset}, now at {at}"
            ))
        }
        Err(e) => {
            let _ = config_set(&mut con, server, "masterauth", &own).await;
            restore_role(&mut con, server, master.as_ref()).await;
            Err(e)
        }
    }
}

/// Whether the server (its replication info) follows the feed.
fn follows(repl: &crate::kv::redis::Info, feed: &FeedHandle) -> bool {
    repl.get("role") == Some("slave")
        && repl.get("master_port") == Some(feed.addr.port().to_string().as_str())
        && repl
            .get("master_host")
            .and_then(|h| h.parse::<std::net::IpAddr>().ok())
            == Some(feed.addr.ip())
}

/// The server's master, for messages.
fn master_of(repl: &crate::kv::redis::Info) -> String {
    match (repl.get("master_host"), repl.get("master_port")) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        _ => "no master".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: &str = "run_id:s\nmaster_replid:aaa\nmaster_repl_offset:100\n";
    const PRIMARY: &str =
        "run_id:p\nmaster_replid:aaa\nrepl_backlog_active:1\nrepl_backlog_first_byte_offset:50\n";

    fn check(primary: &str, proof: &Proof) -> Result<u64, HandError> {
        may_release(
            "10.0.0.1:6379",
            &Info::parse(SERVER),
            &Info::parse(primary),
            proof,
        )
    }

    #[test]
    fn a_primary_on_the_servers_history_that_holds_its_offset_takes_it() {
        assert_eq!(
            check(PRIMARY, &Proof::Config("redis.primary")).unwrap(),
            100
        );
        let peer = Proof::Peer {
            peer: "b:7000".into(),
            run_id: "p".into(),
        };
        assert_eq!(check(PRIMARY, &peer).unwrap(), 100);
        // A promoted primary: the server's id is its second, up to where
        // its own history began.
        let promoted = "run_id:p\nmaster_replid:bbb\nmaster_replid2:aaa\nsecond_repl_offset:101\nrepl_backlog_active:1\nrepl_backlog_first_byte_offset:1\n";
        assert_eq!(
            check(promoted, &Proof::Config("redis.primary")).unwrap(),
            100
        );
    }

    #[test]
    fn every_reason_to_refuse_is_found_before_anything_changes() {
        let config = Proof::Config("redis.primary");
        let itself = PRIMARY.replace("run_id:p", "run_id:s");
        assert!(matches!(
            check(&itself, &config),
            Err(HandError::NotTheServer { .. })
        ));
        let liar = Proof::Peer {
            peer: "b:7000".into(),
            run_id: "q".into(),
        };
        assert!(matches!(
            check(PRIMARY, &liar),
            Err(HandError::NotTheServer { .. })
        ));
        let other = PRIMARY.replace("master_replid:aaa", "master_replid:ccc");
        assert!(matches!(
            check(&other, &config),
            Err(HandError::History { .. })
        ));
        let left_early = "run_id:p\nmaster_replid:bbb\nmaster_replid2:aaa\nsecond_repl_offset:90\nrepl_backlog_active:1\nrepl_backlog_first_byte_offset:1\n";
        assert!(matches!(
            check(left_early, &config),
            Err(HandError::History { .. })
        ));
        let trimmed = PRIMARY.replace("first_byte_offset:50", "first_byte_offset:102");
        assert!(matches!(
            check(&trimmed, &config),
            Err(HandError::Backlog { .. })
        ));
        let no_backlog = PRIMARY.replace("repl_backlog_active:1", "repl_backlog_active:0");
        assert!(matches!(
            check(&no_backlog, &config),
            Err(HandError::Backlog { .. })
        ));
    }
}
