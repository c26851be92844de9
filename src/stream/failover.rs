//! A failover as one instance's agent takes it (`kvsync stream follow
//! --primary`, an orchestrator's call, or Redis Sentinel's word through
//! [`super::sentinel`]): which primary the stream log follows from now on,
//! and through whom. The agent next to the promoted server follows that
//! server as its replica: the log continues under the new replication id
//! from the promotion point ([`super::follow`], which drops and reports
//! what the log holds past that point). Every other agent follows the
//! agent that does, found among its peers by what each one's log follows.
//! The agent of the old primary also re-attaches its server as a replica
//! of the new one, so that it takes no more writes of a history the others
//! left (the server's own PSYNC continues it, or syncs it in full if it
//! wrote past the promotion point: never a merge). Nothing changes while
//! the named primary is not a primary yet, or while no peer follows it:
//! the caller is told what to do and calls again. The continuity is the
//! logs': an upstream continues a log only from an offset its history
//! holds under the same id, so a log from before the promotion continues,
//! and one that went past it (writes lost to the failover) or a stale
//! upstream is refused, never merged.

use std::future::Future;

use super::source::{ChainError, Source};
use crate::config::HostPort;
use crate::kv::redis::RedisError;
use crate::rpc::dial::Dialer;
use crate::rpc::pb;
use crate::sync::instance::Instance;

/// Why a failover was not taken.
#[derive(Debug, thiserror::Error)]
pub enum FailoverError {
    #[error("{0:?} is not a server's address host:port")]
    NotAnAddress(String),
    #[error("instance {0} keeps no stream log ([stream] dir)")]
    NoLog(String),
    #[error("the local server {server} is still a replica (role {role}): promote it first (REPLICAOF NO ONE), then call again")]
    NotPromoted { server: String, role: String },
    #[error("the local server: {0}")]
    Server(#[from] RedisError),
    #[error("no agent follows the primary {primary} yet; give its agent with --peer or in [stream] peers, and tell the promoted server's agent first")]
    NoPeers { primary: String },
    #[error("no agent follows the primary {primary} yet (asked: {}); tell the promoted server's agent first, then call again", asked.join("; "))]
    NoPeerFollows { primary: String, asked: Vec<String> },
    #[error(transparent)]
    Source(#[from] ChainError),
}

/// What a failover did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Followed {
    /// What the log follows now.
    pub source: Source,
    /// What became of the local server when it was the old primary (the
    /// instance's `[redis] primary_addr`, not the new one): re-attached,
    /// or why not; `None` when there was nothing to do.
    pub local_server: Option<String>,
}

/// Makes instance `i`'s log follow `primary` from now on: as its replica
/// when it is the local server (which must be a primary by now), else
/// through the first of `peers` (the request's, or `[stream] peers`) whose
/// log follows it; `source_of(peer)` tells what a peer's log follows
/// (`primary <addr>` or `agent <addr>`, or why it could not be asked).
/// The old primary's agent first makes its server a replica of `primary`
/// when `re_attach` (a caller that tries one primary again and again asks
/// for that once: the old primary may be down, and each try would reach
/// for it again).
pub async fn follow_primary<F, Fut>(
    i: &Instance,
    primary: &str,
    peers: &[String],
    re_attach: bool,
    source_of: F,
) -> Result<Followed, FailoverError>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<String, String>>,
{
    let primary = primary.trim();
    let Ok(new) = primary.parse::<HostPort>() else {
        return Err(FailoverError::NotAnAddress(primary.to_string()));
    };
    let upstreams = i
        .upstreams
        .as_ref()
        .ok_or_else(|| FailoverError::NoLog(i.name.clone()))?;
    let wanted = Source::Primary(primary.to_string());
    let redis = &i.config.redis;
    let local = redis.local_server(i.config.handoff.mode);
    let promoted = match local {
        Some(local) => same_server(local, primary, &redis.password).await,
        None => false,
    };
    let local_server = match redis.primary_addr.as_str() {
        old if promoted || old.is_empty() || !re_attach => None,
        old => attach_old_primary(old, &redis.password, &new).await,
    };
    let followed = |source| Followed {
        source,
        local_server: local_server.clone(),
    };
    if let (true, Some(local)) = (promoted, local) {
        let info = crate::kv::redis::info(local, &redis.password, "replication").await?;
        let role = info.get("role").unwrap_or("unknown");
        if role != "master" {
            return Err(FailoverError::NotPromoted {
                server: primary.to_string(),
                role: role.to_string(),
            });
        }
        // Under the address the others know it by, which they look for.
        if upstreams.source() != wanted {
            upstreams.set_primary(primary)?;
        }
        return Ok(followed(wanted));
    }
    let peers = match peers.is_empty() {
        true => &i.config.stream.peers,
        false => peers,
    };
    if peers.is_empty() {
        return Err(FailoverError::NoPeers {
            primary: primary.to_string(),
        });
    }
    let mut asked = Vec::new();
    for peer in peers {
        match source_of(peer.clone()).await {
            Ok(source) if source == wanted.to_string() => {
                // A chain through that peer (a relay tree) is kept.
                if !upstreams.chain().contains(peer) {
                    upstreams.set(vec![peer.clone()], &i.config.sync.allowed_sources)?;
                }
                return Ok(followed(upstreams.source()));
            }
            Ok(source) => asked.push(format!("{peer} follows {source}")),
            Err(e) => asked.push(format!("{peer}: {e}")),
        }
    }
    Err(FailoverError::NoPeerFollows {
        primary: primary.to_string(),
        asked,
    })
}

/// Whether `addr` names the local server at `local`: the same text, or a
/// server with the same `run_id` (Sentinel names servers by IP address,
/// a configuration may say `localhost`).
async fn same_server(local: &str, addr: &str, password: &str) -> bool {
    if local == addr {
        return true;
    }
    match (run_id(local, password).await, run_id(addr, password).await) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

async fn run_id(addr: &str, password: &str) -> Option<String> {
    let info = crate::kv::redis::info(addr, password, "server")
        .await
        .ok()?;
    info.get("run_id").map(str::to_string)
}

/// Makes the old primary `server` a replica of `new`, unless it is one
/// already or `new` does not answer as a primary: what was done, or why
/// not (it may be down; whoever restarts it must attach it, as Sentinel
/// does).
async fn attach_old_primary(server: &str, password: &str, new: &HostPort) -> Option<String> {
    let attach = async {
        let info = crate::kv::redis::info(server, password, "replication").await?;
        let master = (info.get("master_host"), info.get("master_port"));
        let port = new.port.to_string();
        if info.get("role") == Some("slave")
            && master == (Some(new.host.as_str()), Some(port.as_str()))
        {
            return Ok(None);
        }
        // Only toward a server seen to be a primary (and, by the caller's
        // run_id check, another one): never its own replica.
        let theirs = crate::kv::redis::info(&new.to_string(), password, "replication").await?;
        if theirs.get("role") != Some("master") {
            return Err(RedisError::Precondition(format!(
                "{new} answers as role {}, not a primary",
                theirs.get("role").unwrap_or("unknown")
            )));
        }
        let mut con = crate::kv::redis::connect(server, password).await?;
        crate::kv::seed::replicaof(&mut con, server, &new.host, new.port).await?;
        Ok::<_, RedisError>(Some(format!(
            "the old primary {server} replicates from {new} now"
        )))
    };
    let said = match attach.await {
        Ok(None) => return None,
        Ok(Some(done)) => done,
        Err(e) => format!(
            "the old primary {server} could not be re-attached ({e}): make it a replica of {new} (REPLICAOF) before it takes writes again"
        ),
    };
    tracing::warn!("{said}");
    Some(said)
}

/// What `peer`'s log of `instance` follows, asked with this agent's own
/// token (a peer's, where those are separate).
pub async fn peer_source(dialer: &Dialer, peer: &str, instance: &str) -> Result<String, String> {
    const CALL: std::time::Duration = std::time::Duration::from_secs(10);
    let channel = dialer
        .connect(peer, CALL)
        .await
        .map_err(|e| format!("unreachable: {e}"))?;
    let mut client = pb::peer_client::PeerClient::new(channel);
    let request = pb::StreamSourceRequest {
        instance: instance.to_string(),
    };
    tokio::time::timeout(CALL, client.get_stream_source(request))
        .await
        .map_err(|_| format!("no answer within {CALL:?}"))?
        .map(|r| r.into_inner().source)
        .map_err(|s| format!("refused: {}", s.message()))
}
