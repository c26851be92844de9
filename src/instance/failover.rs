//! A failover as one instance's agent takes it (`kvsync stream follow
//! --primary`, an orchestrator's call, or the Sentinels' majority through
//! [`crate::stream::sentinel`]): which primary the stream log follows from now on,
//! and through whom. The agent next to the promoted server follows that
//! server as its replica: the log continues under the new replication id
//! from the promotion point ([`crate::stream::follow`], which drops and reports
//! what the log holds past that point). Every other agent follows the
//! agent that does, found among its peers by what each one's log follows.
//! The agent of the old primary (its configured `primary_addr`, or its own
//! server while that answers as a primary: a failover promoted it) also
//! re-attaches that server as a replica of the new one, so that it takes
//! no more writes of a history the others left (the server's own PSYNC
//! continues it, or syncs it in full if it wrote past the promotion
//! point: never a merge); a cluster node is left to its cluster, which
//! does that itself ([`crate::stream::shard`]).
//!
//! Everything is decided before anything changes: the named primary must
//! be the local server (promoted by now) or a peer's log must follow it,
//! and the old primary's agent points its server only at an address
//! [`crate::stream::proof`] proves, whose server reports the `run_id` its agent
//! gave and answers as a primary. A refused call changes nothing and says
//! why; the re-attach comes last, and one that could not be done (the old
//! primary is down) is reported as pending, to be tried again. The
//! continuity is the logs': an upstream continues a log only from an
//! offset its history holds under the same id, so a log from before the
//! promotion continues, and one that went past it (writes lost to the
//! failover) or a stale upstream is refused, never merged.

use std::future::Future;

use super::Instance;
use crate::config::ServerAuth;
use crate::config::{Config, HandoffMode, HostPort};
use crate::kv::redis::{Info, RedisError};
use crate::rpc::auth::ClientAuth;
use crate::rpc::dial::Dialer;
use crate::rpc::pb;
use crate::stream::proof::{
    configured_peers, prove, same_addr, AskError, PeerReport, Proof, Unproved,
};
use crate::stream::source::{ChainError, Source};

/// Why a failover was not taken; nothing was changed.
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
    /// The old primary's agent would point its server at an address
    /// nothing proves.
    #[error("refused, nothing was changed: {0}")]
    Unproved(#[from] Unproved),
    /// The proved address answers, but not as the server it was proved as.
    #[error("refused, nothing was changed: the server at {addr} {problem}")]
    NotTheServer { addr: String, problem: String },
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
    /// The old primary could not be re-attached (it did not answer): a
    /// caller tries the failover again, which re-attaches it once it does.
    pub re_attach_pending: bool,
}

/// Who a server says it is: what a failover checks before it acts on it.
struct Identity {
    run_id: String,
    role: String,
    /// Its replication id, and the one it continued from (a promoted
    /// server's old primary's).
    replid: String,
    replid2: String,
}

/// Makes instance `i`'s log follow `primary` from now on: as its replica
/// when it is the local server (which must be a primary by now), else
/// through the first of `peers` (the request's, or `[stream] peers`) whose
/// log follows it; `ask(peer)` tells what a peer's log follows and which
/// server it sits beside ([`PeerReport`]). The old primary's agent then
/// makes its server a replica of `primary`, once everything else is done.
pub async fn follow_primary<F, Fut>(
    i: &Instance,
    primary: &str,
    peers: &[String],
    ask: F,
) -> Result<Followed, FailoverError>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<PeerReport, AskError>>,
{
    let primary = primary.trim();
    let Ok(new) = primary.parse::<HostPort>() else {
        return Err(FailoverError::NotAnAddress(primary.to_string()));
    };
    let upstreams = i
        .upstreams
        .as_ref()
        .ok_or_else(|| FailoverError::NoLog(i.name.clone()))?;
    let c = &i.config;
    let redis = &c.redis;
    let local = redis.local_server(c.handoff.mode);
    let wanted = Source::Primary(primary.to_string());

    // Decide. The local server under a name its configuration gives.
    if let Some(local) = local {
        if same_addr(local, primary).await {
            return follow_local(i, local, primary).await;
        }
    }
    let look_among = match peers.is_empty() {
        true => &c.stream.peers,
        false => peers,
    };
    let mut asked_peers = look_among.to_vec();
    for p in configured_peers(c) {
        if !asked_peers.contains(&p) {
            asked_peers.push(p);
        }
    }
    let reports: Vec<(String, Result<PeerReport, AskError>)> = futures::future::join_all(
        asked_peers
            .iter()
            .map(|p| async { (p.clone(), ask(p.clone()).await) }),
    )
    .await;
    let proof = prove(c, primary, &reports).await;
    // A proved address may be asked who it is; nothing else is.
    let theirs = match &proof {
        Ok(_) => identity(primary, &redis.auth()).await.ok(),
        Err(_) => None,
    };
    // The local server under another name (a proved one, with its run_id).
    // A local server that does not answer is not the one that does.
    if let (Some(local), Some(theirs)) = (local, &theirs) {
        let ours = identity(local, &redis.auth()).await;
        if ours.is_ok_and(|ours| ours.run_id == theirs.run_id) {
            return follow_local(i, local, primary).await;
        }
    }
    // The old primary's agent acts on its server: only toward a proved
    // primary that is the server it was proved as.
    let old = old_primary(c).await;
    if let OldPrimary::Server(_) = old {
        let proof = proof?;
        check_new_primary(primary, &proof, theirs.as_ref())?;
    }
    if look_among.is_empty() {
        return Err(FailoverError::NoPeers {
            primary: primary.to_string(),
        });
    }
    let follower = reports.iter().find_map(|(peer, r)| {
        let follows =
            look_among.contains(peer) && r.as_ref().is_ok_and(|r| r.source == wanted.to_string());
        follows.then_some(peer.clone())
    });
    let Some(follower) = follower else {
        let asked = reports
            .iter()
            .filter(|(p, _)| look_among.contains(p))
            .map(|(peer, r)| match r {
                Ok(r) => format!("{peer} follows {}", r.source),
                Err(e) => format!("{peer}: {e}"),
            })
            .collect();
        return Err(FailoverError::NoPeerFollows {
            primary: primary.to_string(),
            asked,
        });
    };

    // Act: the log's source first (a chain through that peer, a relay
    // tree, is kept), the old primary last.
    if !upstreams.chain().contains(&follower) {
        upstreams.set(vec![follower], &c.sync.allowed_sources)?;
    }
    let theirs = theirs.as_ref();
    let again =
        "call this failover again once it is up; an agent that follows Sentinels tries every 10 s";
    let (local_server, re_attach_pending) = match (old, theirs) {
        (OldPrimary::Server(old), Some(theirs)) => {
            match re_attach(old, &redis.auth(), &new, theirs).await {
                Ok(None) => (None, false),
                Ok(Some(said)) => (Some(said), false),
                Err(e) => {
                    let said = format!(
                        "the old primary {old} could not be re-attached ({e}): make it a replica of {new} before it takes writes again ({again})"
                    );
                    (Some(said), true)
                }
            }
        }
        (OldPrimary::Unanswered(local, e), _) => {
            let said = format!(
                "the local server {local} did not answer ({e}): if a failover had made it a primary, make it a replica of {new} before it takes writes again ({again})"
            );
            (Some(said), true)
        }
        _ => (None, false),
    };
    if let Some(said) = &local_server {
        tracing::warn!(instance = %i.name, "{said}");
    }
    Ok(Followed {
        source: upstreams.source(),
        local_server,
        re_attach_pending,
    })
}

/// Which server this agent re-attaches when another is promoted, as the
/// old primary's agent.
enum OldPrimary<'c> {
    /// The primary it is configured to follow (`[redis] primary_addr`),
    /// or the local server of a handoff that makes it a replica of the
    /// primary (`redis`, `redis-replicate`: one Sentinel may promote),
    /// which answers as a primary (a failover promoted it, and nothing
    /// has made it a replica since). Asked of the server, not of the log,
    /// whose source has moved on once a re-attach is pending, and which
    /// may name the server by another of its addresses. [`re_attach`]
    /// acts only on one whose history the new primary continues. A server
    /// fed from the log (`redis-stream`) is never one: a primary there is
    /// [`crate::stream::keep`]'s to judge.
    Server(&'c str),
    /// The local server did not answer: whether it is one is asked again.
    Unanswered(&'c str, RedisError),
    /// No server of this agent's is a primary.
    Not,
}

/// Which [`OldPrimary`] this agent's server is, asked of the server.
async fn old_primary(c: &Config) -> OldPrimary<'_> {
    if !c.redis.primary_addr.is_empty() {
        return OldPrimary::Server(&c.redis.primary_addr);
    }
    let local = match c.handoff.mode {
        HandoffMode::RedisStream => None,
        mode => c.redis.local_server(mode),
    };
    let Some(local) = local else {
        return OldPrimary::Not;
    };
    match identity(local, &c.redis.auth()).await {
        Ok(ours) if ours.role == "master" => OldPrimary::Server(local),
        Ok(_) => OldPrimary::Not,
        Err(e) => OldPrimary::Unanswered(local, e),
    }
}

/// The log follows the local server at `local`, named `primary` (under
/// the address the others know it by, which they look for), once it is a
/// primary.
async fn follow_local(i: &Instance, local: &str, primary: &str) -> Result<Followed, FailoverError> {
    let ours = identity(local, &i.config.redis.auth()).await?;
    if ours.role != "master" {
        return Err(FailoverError::NotPromoted {
            server: primary.to_string(),
            role: ours.role,
        });
    }
    let upstreams = i
        .upstreams
        .as_ref()
        .ok_or_else(|| FailoverError::NoLog(i.name.clone()))?;
    let wanted = Source::Primary(primary.to_string());
    if upstreams.source() != wanted {
        upstreams.set_primary(primary)?;
    }
    Ok(Followed {
        source: wanted,
        local_server: None,
        re_attach_pending: false,
    })
}

/// That the server at `addr`, proved by `proof`, is that server and a
/// primary.
fn check_new_primary(
    addr: &str,
    proof: &Proof,
    identity: Option<&Identity>,
) -> Result<(), FailoverError> {
    let bad = |problem: String| FailoverError::NotTheServer {
        addr: addr.to_string(),
        problem,
    };
    let Some(theirs) = identity else {
        return Err(bad(format!("({proof}) does not answer INFO")));
    };
    if let Some(expected) = proof.run_id() {
        if theirs.run_id != expected {
            return Err(bad(format!(
                "reports run_id {}, not the {expected} of {proof}",
                theirs.run_id
            )));
        }
    }
    if theirs.role != "master" {
        return Err(bad(format!(
            "answers as role {}, not as a primary",
            theirs.role
        )));
    }
    Ok(())
}

/// The `run_id`, role and replication ids of the server at `addr`.
async fn identity(addr: &str, auth: &ServerAuth) -> Result<Identity, RedisError> {
    let info = crate::kv::redis::infos(addr, auth, &["server", "replication"]).await?;
    let get = |key: &str| info.get(key).unwrap_or_default().to_string();
    Ok(Identity {
        run_id: get("run_id"),
        role: info.get("role").unwrap_or("unknown").to_string(),
        replid: get("master_replid"),
        replid2: get("master_replid2"),
    })
}

/// Makes the old primary `server` a replica of `new` (whose server is
/// `theirs`) unless it is one already (`None`), unless it is a cluster
/// node (the cluster re-attaches it, and refuses `REPLICAOF`), or unless
/// `new` was not promoted from its history: a REPLICAOF would then
/// replace its data with another history's (a server restarted empty is
/// Sentinel's to convert). What was done or refused, or why it could not be asked
/// (`Err`: it did not answer).
async fn re_attach(
    server: &str,
    auth: &ServerAuth,
    new: &HostPort,
    theirs: &Identity,
) -> Result<Option<String>, RedisError> {
    let info = crate::kv::redis::infos(server, auth, &["replication", "cluster"]).await?;
    if replicates_from(&info, new) {
        return Ok(None);
    }
    if info.get("cluster_enabled") == Some("1") {
        return Ok(Some(format!(
            "the old primary {server} is a cluster node, which the cluster itself makes a replica of {new}: nothing was sent to it"
        )));
    }
    let ours = info.get("master_replid").unwrap_or_default();
    if ours != theirs.replid && ours != theirs.replid2 {
        return Ok(Some(format!(
            "the old primary {server} was not re-attached, nothing was sent to it: {new} was not promoted from its history (it runs under {} after {}, the old primary under {ours}), so a REPLICAOF would replace its data",
            theirs.replid, theirs.replid2
        )));
    }
    let mut con = crate::kv::redis::connect(server, auth).await?;
    crate::kv::seed::replicaof(&mut con, server, &new.host, new.port).await?;
    Ok(Some(format!(
        "the old primary {server} replicates from {new} now"
    )))
}

/// Whether a server (its `INFO replication`) is a replica of `new`.
fn replicates_from(info: &Info, new: &HostPort) -> bool {
    let port = new.port.to_string();
    info.get("role") == Some("slave")
        && info.get("master_host") == Some(new.host.as_str())
        && info.get("master_port") == Some(port.as_str())
}

/// What this agent tells a peer of instance `c`: what its log follows
/// (`source`), and the server beside it with the `run_id` it reports now.
pub async fn own_report(c: &Config, source: String) -> PeerReport {
    let server = c.redis.local_server(c.handoff.mode).unwrap_or_default();
    let run_id = match server {
        "" => String::new(),
        s => identity(s, &c.redis.auth())
            .await
            .map(|i| i.run_id)
            .unwrap_or_default(),
    };
    PeerReport {
        source,
        server: server.to_string(),
        run_id,
    }
}

/// The `ask` of [`follow_primary`] and of a release for instance `i`:
/// [`peer_report`] of the peers' instance that `i`'s log follows, dialled
/// with `dialer`. A configured peer of `i` (`[stream] peers`, `upstream`)
/// is asked with this agent's own token; any other (one a caller named)
/// only with the `caller`'s token, never this agent's (`None`: no caller,
/// only configured peers are asked).
pub fn peer_asker(
    dialer: Dialer,
    i: &Instance,
    caller: Option<ClientAuth>,
) -> impl Fn(String) -> futures::future::BoxFuture<'static, Result<PeerReport, AskError>> + Clone {
    let configured = configured_peers(&i.config);
    let instance = i.config.stream.upstream_instance_of(&i.name);
    move |peer: String| {
        let (dialer, instance) = (dialer.clone(), instance.clone());
        let who = match configured.contains(&peer) {
            true => Some(None),
            false => caller.clone().map(Some),
        };
        Box::pin(async move {
            let Some(who) = who else {
                return Err(AskError::NotConfigured);
            };
            peer_report(&dialer, &peer, &instance, who).await
        })
    }
}

/// What `peer`'s log of `instance` follows and which server it sits
/// beside, asked with this agent's own token (a peer's, where those are
/// separate), or with a caller's (`as_caller`).
pub async fn peer_report(
    dialer: &Dialer,
    peer: &str,
    instance: &str,
    as_caller: Option<ClientAuth>,
) -> Result<PeerReport, AskError> {
    const CALL: std::time::Duration = std::time::Duration::from_secs(10);
    let channel = match as_caller {
        None => dialer.connect(peer, CALL).await,
        Some(auth) => dialer.connect_as(peer, CALL, auth).await,
    }
    .map_err(|e| AskError::Unreachable(e.to_string()))?;
    let mut client = pb::peer_client::PeerClient::new(channel);
    let request = pb::StreamSourceRequest {
        instance: instance.to_string(),
    };
    tokio::time::timeout(CALL, client.get_stream_source(request))
        .await
        .map_err(|_| AskError::Silent(CALL))?
        .map(|r| {
            let r = r.into_inner();
            PeerReport {
                source: r.source,
                server: r.server,
                run_id: r.server_run_id,
            }
        })
        .map_err(|s| AskError::Refused(s.message().to_string()))
}
