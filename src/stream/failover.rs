//! A failover as one instance's agent takes it (`kvsync stream follow
//! --primary`, an orchestrator's call): which primary the stream log
//! follows from now on, and through whom. The agent next to the promoted
//! server follows that server as its replica: the log continues under the
//! new replication id from the promotion point ([`super::follow`], which
//! drops and reports what the log holds past that point). Every other
//! agent follows the agent that does, found among its peers by what each
//! one's log follows. Nothing changes while the named primary is not a
//! primary yet, or while no peer follows it: the caller is told what to do
//! and calls again. The continuity is the logs': an upstream continues a
//! log only from an offset its history holds under the same id, so a log
//! from before the promotion continues, and one that went past it (writes
//! lost to the failover) or a stale upstream is refused, never merged.

use std::future::Future;

use super::source::{ChainError, Source};
use crate::kv::redis::RedisError;
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

/// Makes instance `i`'s log follow `primary` from now on: as its replica
/// when it is the local server (which must be a primary by now), else
/// through the first of `peers` (the request's, or `[stream] peers`) whose
/// log follows it; `source_of(peer)` tells what a peer's log follows
/// (`primary <addr>` or `agent <addr>`, or why it could not be asked).
/// Returns what the log follows now.
pub async fn follow_primary<F, Fut>(
    i: &Instance,
    primary: &str,
    peers: &[String],
    source_of: F,
) -> Result<String, FailoverError>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<String, String>>,
{
    let primary = primary.trim();
    if primary.parse::<crate::config::HostPort>().is_err() {
        return Err(FailoverError::NotAnAddress(primary.to_string()));
    }
    let upstreams = i
        .upstreams
        .as_ref()
        .ok_or_else(|| FailoverError::NoLog(i.name.clone()))?;
    let wanted = Source::Primary(primary.to_string());
    let redis = &i.config.redis;
    if redis.local_server(i.config.handoff.mode) == Some(primary) {
        let info = crate::kv::redis::info(primary, &redis.password, "replication").await?;
        let role = info.get("role").unwrap_or("unknown");
        if role != "master" {
            return Err(FailoverError::NotPromoted {
                server: primary.to_string(),
                role: role.to_string(),
            });
        }
        if upstreams.source() != wanted {
            upstreams.set_primary(primary)?;
        }
        return Ok(wanted.to_string());
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
                let chain = vec![peer.clone()];
                if upstreams.chain() != chain {
                    upstreams.set(chain, &i.config.sync.allowed_sources)?;
                }
                return Ok(upstreams.source().to_string());
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
