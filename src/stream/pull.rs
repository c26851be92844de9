//! Following an upstream agent's stream log into this agent's own: the
//! replica's side of stream sessions. Each session asks the upstream
//! (`OpenStream`) to continue from where the log stands (its replication
//! id and end; a log that holds nothing continues this agent's newest
//! snapshot, or else starts where the upstream's log does),
//! dials the data endpoint it is given and proves the session, then takes
//! frames strictly in order under the session's MAC (`blk3::stream`),
//! appends each to the log and acknowledges it once the log holds it, and
//! reports what the servers fed from the log applied (`SAPP`, whenever it
//! changes), so acknowledgements reach the primary's agent. A log cut back
//! after damage ends the session: the next fetches it again. A
//! failed session is followed by another from the log's end, so nothing
//! is skipped or applied twice across reconnects. An upstream whose log
//! no longer holds the offset answers "too old": the log is left as it
//! is, the state says which snapshot would continue, and the agent asks
//! again later.
//!
//! The upstream is a chain, nearest first ([`Upstreams`]: `[stream]
//! upstream`, or what a fan-out or a failover set): a
//! session that fails passes over its upstream for [`PASS_OVER`] and the
//! next starts at once with the next of the chain, from the log's end, so
//! a relay's failure re-parents its children onto its ancestors without a
//! gap; a session on any but the nearest ends after [`PASS_OVER`], so a
//! relay that is back gets its children back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::log::LogError;
use super::policy::{self, Ended, NotHeld, Pick, Then, UpstreamPolicy, PASS_OVER};
use super::source::{Source, Upstreams};
use super::{Over, SharedLog, Traffic, WriterState};
use crate::blk3::stream::{Receiver, StreamError, MAX_FRAME, STREAM_KEY_LEN};
use crate::blk3::token::REPLID_LEN;
use crate::blk3::token::{Kind, SESSION_TOKEN_LEN};
use crate::blk3::Token;
use crate::config::RdmaProvider;
use crate::metrics::{Metrics, Running};
use crate::rpc::dial::{Dialer, CONNECT_TIMEOUT};
use crate::rpc::pb;
use crate::transport::faults;
use crate::transport::probe::LocalRdma;
use crate::transport::ring::{RingReplica, RingRunError, RingSink};
use crate::transport::session::{DataLink, DialError, DialSpec};
use crate::transport::stream::{StreamLink, StreamLinkError, StreamTls};

/// An upstream that sends nothing for this long is taken as gone (its
/// primary pings the stream every few seconds).
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest credit window a replica accepts from an offer.
const MAX_WINDOW: u64 = 256 << 20;
/// Starts a sync of a snapshot from an upstream agent (its gRPC address).
pub type Reseed = Box<dyn Fn(&str, pb::SnapshotId) + Send + Sync>;

/// What the puller needs to know of its instance and its upstreams.
pub struct Pull {
    pub instance: String,
    /// The upstream agents' gRPC addresses and the instance asked of them.
    pub upstreams: Arc<Upstreams>,
    pub upstream_instance: String,
    pub node_id: String,
    pub dialer: Dialer,
    /// `[tls] server_name`: the name upstreams' data-plane certificates
    /// must carry (empty: each upstream's host).
    pub tls_server_name: String,
    /// `[stream] reseed`: syncs the snapshot an upstream names from it.
    pub reseed: Option<Reseed>,
    pub peer_timeout: Duration,
    pub metrics: Arc<Metrics>,
    /// The (replication id, M) of the snapshots this agent has, which the
    /// log's retention keeps continuous.
    pub offered: Offered,
    /// How to follow through an RDMA ring (`None`: TCP only).
    pub ring: Option<RingAsk>,
}

/// The (replication id, M) of the snapshots an agent has.
pub type Offered = Arc<dyn Fn() -> Vec<(String, u64)> + Send + Sync>;

/// How an agent follows its upstream through an RDMA ring
/// (`[stream] rdma_ring`, `[transport] mode` not `tcp`).
pub struct RingAsk {
    pub rdma: Arc<LocalRdma>,
    pub provider: RdmaProvider,
    /// Bytes of the ring's stream area.
    pub size: u64,
    /// After a ring session failed, how long the stream runs over TCP
    /// before the ring is tried again (`[stream] rdma_retry`).
    pub retry: Duration,
    /// `[stream] rdma_spin`.
    pub spin: Duration,
}

/// Why a session with the upstream ended.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("cannot reach the upstream agent {upstream}: {message}")]
    Unreachable { upstream: String, message: String },
    #[error("the upstream agent {upstream} refused the stream: {message}")]
    Refused { upstream: String, message: String },
    #[error("the upstream agent {upstream} no longer holds offset {offset} of {replid} (it holds {held}); this instance needs a snapshot first{}", snapshot.as_ref().map_or(String::new(), |s| format!(": the upstream's {s} continues into its log")))]
    TooOld {
        upstream: String,
        replid: String,
        offset: u64,
        held: String,
        snapshot: Option<String>,
        /// The snapshot the upstream's log continues from, with its
        /// replication id and M.
        continues: Option<(pb::SnapshotId, String, u64)>,
        /// Where `replid` ended in the upstream's log, before `offset`: a
        /// failover's promotion point, past which this log diverged.
        diverged_at: Option<u64>,
    },
    #[error("the upstream agent {upstream} still follows {replid} to offset {end}, a history this log left at offset {left_at} for a new primary's (a failover it has not followed): nothing is taken from it")]
    Stale {
        upstream: String,
        replid: String,
        end: u64,
        left_at: u64,
    },
    #[error("the upstream agent {upstream} stands at offset {end} of {replid}, behind this log's {offset} on the same history (it is catching up): it is asked again, and its snapshot is not taken")]
    Behind {
        upstream: String,
        replid: String,
        end: u64,
        offset: u64,
    },
    #[error("the upstream's offer is unusable: {0}")]
    BadOffer(String),
    #[error(transparent)]
    Link(#[from] StreamLinkError),
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("the upstream ended the session: {0}")]
    Upstream(String),
    #[error("the upstream sent {0}, which a stream session does not take")]
    Unexpected(Kind),
    #[error("the upstream sent nothing for {UPSTREAM_TIMEOUT:?}")]
    Silent,
    #[error("the RDMA ring: {0}")]
    Ring(#[from] RingRunError<RingLogError>),
    #[error("cannot reach the upstream's RDMA endpoint: {0}")]
    RingDial(#[from] DialError),
}

impl PullError {
    /// The upstream does not hold the offset asked for (too old, on
    /// another history, or behind): asking it again will not change that.
    pub fn not_held(&self) -> bool {
        matches!(
            self,
            PullError::TooOld { .. } | PullError::Stale { .. } | PullError::Behind { .. }
        )
    }

    /// The `kvsync_stream_refused_total` reason, when the session ended
    /// for one.
    fn refusal(&self) -> Option<&'static str> {
        match self {
            PullError::Stream(e) => Some(e.label()),
            PullError::Ring(RingRunError::Ring(e)) => Some(e.label()),
            PullError::TooOld { .. } => Some("too_old"),
            PullError::Stale { .. } => Some("stale_upstream"),
            PullError::Behind { .. } => Some("upstream_behind"),
            _ => None,
        }
    }

    /// How the session ended, as `stream::policy` decides on it.
    fn ended(&self) -> Ended {
        match self {
            PullError::Ring(_) | PullError::RingDial(_) => Ended::RingFailed,
            PullError::Log(_) => Ended::LogFailed,
            PullError::TooOld {
                replid, continues, ..
            } => Ended::TooOld {
                held: !replid.is_empty(),
                continues: continues.as_ref().map(|(_, id, m)| (id.clone(), *m)),
            },
            _ => Ended::Failed,
        }
    }

    /// Why the ring failed, when it did (the stream goes on over TCP).
    fn ring_failure(&self) -> Option<&'static str> {
        match self {
            PullError::Ring(e) => Some(e.reason()),
            PullError::RingDial(_) => Some("connect"),
            _ => None,
        }
    }
}

/// Follows the upstreams until `stop`, a new session after every failure,
/// as `stream::policy` decides: at once with the next upstream not passed
/// over, else after a pause with the nearest again.
pub async fn run(pull: Arc<Pull>, stream: SharedLog, stop: CancellationToken) {
    let mut policy = UpstreamPolicy::new(pull.ring.as_ref().map_or(Duration::ZERO, |r| r.retry));
    let mut chain = pull.upstreams.watch();
    let mut named = HashMap::new();
    loop {
        let upstreams = match &*chain.borrow_and_update() {
            Source::Agents(chain) => chain.clone(),
            Source::Primary(_) => Vec::new(),
        };
        let now = std::time::Instant::now();
        let Some(Pick {
            upstream,
            nearest,
            tcp_until,
        }) = policy.pick(&upstreams, now)
        else {
            // No agents (the source is a primary now): wait for some.
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = chain.changed() => continue,
            }
        };
        let upstream = upstream.to_string();
        let before = stream.position();
        let ring = pull
            .ring
            .as_ref()
            .filter(|r| tcp_until.is_none() && r.rdma.available());
        let result = tokio::select! {
            _ = stop.cancelled() => return,
            r = session(&pull, &upstream, &stream, ring, tcp_until.is_some()) => r,
            // A TCP session after a ring failed ends in time to try the
            // ring again.
            _ = tokio::time::sleep_until(tcp_until.unwrap_or(now).into()), if tcp_until.is_some() => continue,
            _ = chain.changed() => {
                info!(instance = %pull.instance, source = %chain.borrow().clone(), "the stream's upstreams changed: following the nearest from the log's end");
                policy.chain_changed();
                continue;
            }
            _ = tokio::time::sleep(PASS_OVER), if !nearest => continue,
        };
        let Err(e) = result else { return };
        let progressed = stream.position() != before;
        let then = ended(
            &pull,
            &stream,
            (&mut policy, &mut named),
            &upstream,
            &upstreams,
            e,
            progressed,
        )
        .await;
        if let Then::Pause(wait) = then {
            // A sync that starts the log over ends the pause.
            let mut log = stream.watch();
            log.borrow_and_update();
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = log.changed() => {}
            }
            policy.paused();
        }
    }
}

/// After the session with `upstream` (of `upstreams`) ended with `e`:
/// counts and reports it, asks the policy what next, and acts on all but
/// a pause (re-seeding, or the fall back to TCP after a ring failed),
/// which it returns. `named`: the snapshot each upstream last named when
/// it said "too old".
async fn ended(
    pull: &Pull,
    stream: &SharedLog,
    (policy, named): (&mut UpstreamPolicy, &mut HashMap<String, pb::SnapshotId>),
    upstream: &str,
    upstreams: &[String],
    e: PullError,
    progressed: bool,
) -> Then {
    count(pull, &e);
    let why = e.ended();
    if why != Ended::RingFailed {
        warn!(instance = %pull.instance, %upstream, error = %e, "following the upstream agent's stream stopped; it asks again");
        stream.set_state(WriterState::Reconnecting {
            reason: e.to_string(),
        });
    }
    if let PullError::TooOld {
        replid,
        offset,
        diverged_at: Some(at),
        ..
    } = &e
    {
        diverged(pull, stream, (replid, *offset, *at), upstream);
    }
    // The snapshot the upstream named, kept for a re-seeding from it,
    // unless this log already holds it and the upstream names no failover
    // this log went past (its word contradicts what it refused: nothing is
    // started over on it).
    let mut why = why;
    if let (
        PullError::TooOld {
            continues: Some((id, replid, m)),
            diverged_at,
            ..
        },
        Ended::TooOld { continues, .. },
    ) = (&e, &mut why)
    {
        if diverged_at.is_none() && stream.view(|l| l.covers(replid, *m).is_ok()) {
            warn!(instance = %pull.instance, %upstream, %replid, m, "the upstream says this log is too old, yet names a snapshot the log holds: not re-seeding on its word");
            *continues = None;
        } else {
            named.insert(upstream.to_string(), id.clone());
        }
    }
    let now = std::time::Instant::now();
    // Never over a server that left the feed as a master (the sync's own
    // check refuses it too, before anything changes).
    let can_reseed = pull.reseed.is_some() && !stream.server_left();
    let mut then = policy.ended(upstream, upstreams, &why, progressed, can_reseed, now);
    if let Then::Reseed {
        upstream: from,
        replid,
        m,
    } = &then
    {
        // (The policy re-seeds only from an upstream that named one.)
        let started = match (&pull.reseed, named.get(from)) {
            (Some(sync), Some(id)) => {
                match reseed(pull, stream, from, (sync, id), (replid.clone(), *m)).await {
                    Ok(()) => true,
                    Err(le) => {
                        warn!(instance = %pull.instance, error = %le, "the log cannot start over for a re-seeding");
                        false
                    }
                }
            }
            _ => false,
        };
        if !started {
            then = policy.ended(upstream, upstreams, &why, progressed, false, now);
        }
    }
    if matches!(e, PullError::TooOld { .. }) && !matches!(then, Then::Reseed { .. }) {
        stream.set_state(WriterState::NeedsSnapshot {
            reason: e.to_string(),
        });
    }
    if then == Then::OverTcp {
        let retry = pull.ring.as_ref().map_or(Duration::ZERO, |r| r.retry);
        let reason = e.ring_failure().unwrap_or_default();
        warn!(instance = %pull.instance, %upstream, error = %e, reason, "the RDMA ring failed: the stream goes on over TCP from what the log holds, and tries the ring again in {retry:?}");
        stream.set_state(WriterState::RingFailed {
            reason: e.to_string(),
        });
    }
    then
}

/// Counts a failed session in the metrics: a reconnect, and why.
fn count(pull: &Pull, e: &PullError) {
    let m = &pull.metrics;
    let i = pull.instance.as_str();
    m.stream_reconnects.with_label_values(&[i, "agent"]).inc();
    if matches!(e, PullError::Log(LogError::Io { .. })) {
        m.stream_write_errors.with_label_values(&[i]).inc();
    }
    if let Some(reason) = e.refusal() {
        m.stream_refused.with_label_values(&[i, reason]).inc();
    }
    if let Some(reason) = e.ring_failure() {
        m.stream_fallback.with_label_values(&[i, reason]).inc();
    }
}

/// How to dial the upstream's ring `endpoint` with this agent's RDMA.
fn ring_spec(pull: &Pull, ring: &RingAsk, endpoint: SocketAddr) -> DialSpec {
    let probe = ring.rdma.probe();
    let local = probe.local_addr;
    DialSpec {
        endpoint: SocketAddr::new(
            crate::transport::select::map_peer(endpoint.ip(), local.unwrap_or(endpoint.ip())),
            endpoint.port(),
        ),
        rdma: Some(ring.provider),
        peer_timeout: pull.peer_timeout,
        min_rate: Default::default(),
        local,
        soft: probe.soft,
        tls: None,
    }
}

/// Starts the log over at the upstream's snapshot `id` (replication id,
/// M) and syncs that snapshot from it with `sync`.
async fn reseed(
    pull: &Pull,
    stream: &SharedLog,
    upstream: &str,
    (sync, id): (&Reseed, &pb::SnapshotId),
    (replid, m): (String, u64),
) -> Result<(), LogError> {
    let state = WriterState::Reseeding {
        upstream: upstream.to_string(),
        seq: id.seq,
    };
    blocking(stream, move |s| s.start_over(&replid, m, state)).await?;
    warn!(instance = %pull.instance, %upstream, seq = id.seq, "re-seeding: the log starts over at the upstream's snapshot, which is synced from it");
    sync(upstream, id.clone());
    Ok(())
}

/// Reports, once, that the log holds `offset - at` bytes of `replid` past
/// `at`, where the upstream's history went on under another id: writes
/// the old primary took after a failover's promotion point. The log is
/// left as it is (its server applied them); `[stream] reseed` starts it
/// over at the upstream's snapshot, which re-seeds the server.
fn diverged(
    pull: &Pull,
    stream: &SharedLog,
    (replid, offset, at): (&str, u64, u64),
    upstream: &str,
) {
    let lost = offset - at;
    let what = format!(
        "{lost} bytes of {replid} past offset {at} are not in the history of the upstream {upstream}, where a new primary took over at that offset: writes the old primary took after the promotion; the server fed from them needs a re-seeding{}",
        match pull.reseed {
            Some(_) => " (started from the upstream's snapshot)",
            None => " (sync a snapshot, or set [stream] reseed)",
        }
    );
    if stream.diverged() != what {
        pull.metrics
            .stream_diverged
            .with_label_values(&[&pull.instance])
            .inc_by(lost);
        warn!(instance = %pull.instance, lost, at, "{what}");
        stream.set_diverged(what);
    }
}

/// An offer to continue, checked.
struct Offer {
    token: [u8; SESSION_TOKEN_LEN],
    key: [u8; STREAM_KEY_LEN],
    endpoint: SocketAddr,
    tls: bool,
    /// The session runs over an RDMA ring: dial here.
    rdma_endpoint: Option<SocketAddr>,
    replid: String,
    offset: u64,
    window: u64,
}

/// Asks `upstream` to continue from `at` (the log's position), for the
/// replica node `who`.
async fn ask(
    (pull, who): (&Pull, &str),
    (upstream, stream): (&str, &SharedLog),
    at: Option<&(String, u64)>,
    ring: Option<&RingAsk>,
) -> Result<Offer, PullError> {
    let upstream = upstream.to_string();
    let channel = pull
        .dialer
        .connect(&upstream, CONNECT_TIMEOUT)
        .await
        .map_err(|e| PullError::Unreachable {
            upstream: upstream.clone(),
            message: e.to_string(),
        })?;
    let (replid, offset) = at.cloned().unwrap_or_default();
    let o = pb::peer_client::PeerClient::new(channel)
        .open_stream(pb::OpenStreamRequest {
            replica_node_id: who.to_string(),
            instance: pull.upstream_instance.clone(),
            replid: replid.clone(),
            offset,
            data_tls: pull.dialer.data_tls.is_some(),
            rdma_provider: ring.map(|r| r.provider.to_string()).unwrap_or_default(),
        })
        .await
        .map_err(|s| PullError::Refused {
            upstream: upstream.clone(),
            message: s.message().to_string(),
        })?
        .into_inner();
    let bad = |why: &str| PullError::BadOffer(why.to_string());
    match pb::stream_offer::Answer::try_from(o.answer) {
        Ok(pb::stream_offer::Answer::Continue) => {}
        Ok(pb::stream_offer::Answer::TooOld) => {
            return Err(not_held(upstream, stream, at.cloned(), o))
        }
        _ => return Err(bad("it answers neither continue nor too old")),
    }
    // A log that holds a stream continues exactly there; an empty one
    // starts wherever the upstream's does.
    if at.is_some() && (o.replid != replid || o.offset != offset) {
        return Err(bad("it starts elsewhere than the log stands"));
    }
    let offer = Offer {
        token: o
            .session_token
            .as_slice()
            .try_into()
            .map_err(|_| bad("its session token is not 32 bytes"))?,
        key: o
            .stream_key
            .as_slice()
            .try_into()
            .map_err(|_| bad("its stream key is not 32 bytes"))?,
        endpoint: o
            .data_endpoint
            .parse()
            .map_err(|_| bad("its data endpoint is no host:port"))?,
        tls: o.data_tls,
        rdma_endpoint: match o.rdma_endpoint.as_str() {
            "" => None,
            e if ring.is_some() => Some(
                e.parse()
                    .map_err(|_| bad("its RDMA endpoint is no host:port"))?,
            ),
            _ => {
                return Err(bad(
                    "it offers an RDMA ring, which this agent did not ask for",
                ))
            }
        },
        replid: o.replid,
        offset: o.offset,
        window: o.window,
    };
    if !(MAX_FRAME as u64..=MAX_WINDOW).contains(&offer.window) {
        return Err(bad("its credit window is outside 1 MiB to 256 MiB"));
    }
    Ok(offer)
}

/// Why an upstream that answered "too old" to the point this log asked
/// from (`asked`: its end, or the snapshot an empty log continues; `None`:
/// from nothing) is not followed, from where the upstream's log stands
/// (`o`) and this log's history: stale, behind, or too old.
fn not_held(
    upstream: String,
    stream: &SharedLog,
    asked: Option<(String, u64)>,
    o: pb::StreamOffer,
) -> PullError {
    let ours = asked.as_ref().map(|(id, at)| (id.as_str(), *at));
    let not_held = stream.view(|l| {
        policy::not_held(
            (&o.log_replid, o.log_end),
            l.superseded_at(&o.log_replid),
            ours,
        )
    });
    let (replid, offset) = asked.clone().unwrap_or_default();
    let theirs = || crate::peer_text::escape_controls(&o.log_replid).into_owned();
    match not_held {
        NotHeld::Stale { left_at } => PullError::Stale {
            upstream,
            replid: theirs(),
            end: o.log_end,
            left_at,
        },
        NotHeld::Behind => PullError::Behind {
            upstream,
            replid: theirs(),
            end: o.log_end,
            offset,
        },
        NotHeld::TooOld => PullError::TooOld {
            upstream,
            replid,
            offset,
            held: crate::peer_text::escape_controls(&o.held).into_owned(),
            snapshot: o
                .snapshot
                .as_ref()
                .map(|s| format!("snapshot of seq {}", s.seq)),
            continues: o
                .snapshot
                .filter(|_| !o.replid.is_empty())
                .map(|s| (s, o.replid, o.offset)),
            diverged_at: Some(o.diverged_at).filter(|&at| at > 0 && at < offset),
        },
    }
}

/// Where the log asks to continue from: its end, else the newest of this
/// agent's snapshots (so the log continues it), else nothing.
fn start_point(pull: &Pull, stream: &SharedLog) -> Option<(String, u64)> {
    let held = stream.position();
    held.or_else(|| (pull.offered)().into_iter().max_by_key(|(_, m)| *m))
}

async fn session(
    pull: &Pull,
    upstream: &str,
    stream: &SharedLog,
    ring: Option<&RingAsk>,
    fell_back: bool,
) -> Result<(), PullError> {
    let at = start_point(pull, stream);
    let offer = ask((pull, &pull.node_id), (upstream, stream), at.as_ref(), ring).await?;
    if let (Some(ring), Some(endpoint)) = (ring, offer.rdma_endpoint) {
        return ring_session(pull, ring, upstream, stream, offer, endpoint).await;
    }
    let link = dial_tcp(pull, upstream, &offer).await?;
    start_log(stream, &offer).await?;
    let _running = Running::start(
        pull.metrics
            .stream_sessions
            .with_label_values(&[&pull.instance, "replica"]),
    );
    info!(instance = %pull.instance, %upstream, replid = %offer.replid, offset = offer.offset, tls = offer.tls, "following the upstream agent's stream");
    stream.set_state(WriterState::FollowingAgent {
        upstream: upstream.to_string(),
        over: match fell_back {
            true => Over::TcpFallback,
            false => Over::Tcp,
        },
    });
    receive(pull, stream, link, &offer).await
}

/// Dials the upstream's data endpoint for the stream session `offer`
/// opened (under TLS when the offer asks for it).
async fn dial_tcp(pull: &Pull, upstream: &str, offer: &Offer) -> Result<StreamLink, PullError> {
    let tls = match (offer.tls, &pull.dialer.data_tls) {
        (false, _) => None,
        (true, Some(config)) => Some(StreamTls {
            config: config.clone(),
            name: crate::rpc::dial::tls_name(&pull.tls_server_name, upstream),
        }),
        (true, None) => {
            return Err(PullError::BadOffer(
                "it asks for TLS on the data plane, which this agent has no [tls] for".into(),
            ))
        }
    };
    let link = StreamLink::dial(
        offer.endpoint,
        tls.as_ref(),
        &offer.token,
        pull.peer_timeout,
    )
    .await?;
    Ok(link)
}

/// Takes the stream session's frames into the log over `link` until it
/// ends: each checked frame appended and acknowledged, what the servers
/// below applied passed on, an upstream silent for [`UPSTREAM_TIMEOUT`]
/// left.
async fn receive(
    pull: &Pull,
    stream: &SharedLog,
    mut link: StreamLink,
    offer: &Offer,
) -> Result<(), PullError> {
    let received = Traffic::of(&pull.metrics, &pull.instance, "replica");
    // The fault: acknowledge only on the once-a-second tick.
    let ack_on_tick = faults::active().stream_ack_on_tick;
    let mut rx = Receiver::new(offer.key, offer.offset, offer.window);
    let mut heard = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut acks = stream.watch_acks();
    loop {
        let token = tokio::select! {
            t = link.next_token() => t?,
            _ = tick.tick() => {
                if heard.elapsed() > UPSTREAM_TIMEOUT {
                    return Err(PullError::Silent);
                }
                let (floor, end) = (stream.floor(&(pull.offered)()), rx.next());
                blocking(stream, move |s| s.tick(end, floor)).await?;
                if ack_on_tick {
                    link.send(&rx.ack()).await?;
                }
                continue;
            }
            Ok(()) = acks.changed() => {
                report_applied(&mut link, &mut rx, stream).await?;
                continue;
            }
        };
        heard = Instant::now();
        match token {
            Token::Strm { offset, len, mac } => {
                rx.header(offset, len)?;
                let bytes = link.read_bytes(len as usize).await?;
                rx.accept(offset, &bytes, &mac)?;
                stream.append(move |l| l.append(offset, &bytes)).await?;
                received.frame(len as usize);
                if !ack_on_tick {
                    link.send(&rx.ack()).await?;
                }
                report_applied(&mut link, &mut rx, stream).await?;
            }
            Token::Sepo {
                offset,
                replid,
                mac,
            } => {
                rx.epoch(offset, &replid, &mac)?;
                let id = String::from_utf8_lossy(&replid).into_owned();
                info!(instance = %pull.instance, offset, replid = %id, "the stream continues under a new replication id");
                blocking(stream, move |s| s.write(|l| l.switch(&id))).await?;
            }
            Token::Rdfl { reason } => {
                return Err(PullError::Upstream(
                    crate::peer_text::escape_controls(&reason).into_owned(),
                ))
            }
            other => return Err(PullError::Unexpected(other.kind())),
        }
    }
}

/// The `len` bytes of the stream after `offset` of `replid` once more,
/// from an upstream agent's log, to mend a damaged record of the log: a
/// stream session of its own over TCP (asked as `<node id>.mend`, so that
/// it takes the place of no session of the log's), read for those bytes,
/// each frame checked under its MAC, and closed. Each upstream of the
/// chain is asked in turn; the error is one that may pass, if any.
pub async fn fetch_again(
    pull: &Pull,
    stream: &SharedLog,
    (replid, offset): (&str, u64),
    len: u64,
) -> Result<Vec<u8>, PullError> {
    let chain = match pull.upstreams.source() {
        Source::Agents(chain) => chain,
        Source::Primary(_) => Vec::new(),
    };
    // "Not held" only when every upstream says so: one that failed for
    // now may still give the record.
    let (mut failed, mut not_held) = (None, None);
    let who = format!("{}{}", pull.node_id, super::serve::MEND);
    for upstream in &chain {
        let at = (replid.to_string(), offset);
        let fetched = async {
            let offer = ask((pull, &who), (upstream, stream), Some(&at), None).await?;
            let mut link = dial_tcp(pull, upstream, &offer).await?;
            let mut rx = Receiver::new(offer.key, offer.offset, offer.window);
            let mut bytes = Vec::with_capacity(len as usize);
            while (bytes.len() as u64) < len {
                let token = tokio::time::timeout(UPSTREAM_TIMEOUT, link.next_token())
                    .await
                    .map_err(|_| PullError::Silent)??;
                match token {
                    Token::Strm { offset, len, mac } => {
                        rx.header(offset, len)?;
                        let frame = link.read_bytes(len as usize).await?;
                        rx.accept(offset, &frame, &mac)?;
                        bytes.extend_from_slice(&frame);
                    }
                    Token::Rdfl { reason } => {
                        return Err(PullError::Upstream(
                            crate::peer_text::escape_controls(&reason).into_owned(),
                        ))
                    }
                    other => return Err(PullError::Unexpected(other.kind())),
                }
            }
            bytes.truncate(len as usize);
            Ok(bytes)
        };
        match fetched.await {
            Ok(bytes) => return Ok(bytes),
            Err(e) if e.not_held() => not_held = Some(e),
            Err(e) => failed = Some(e),
        }
    }
    Err(failed.or(not_held).unwrap_or(PullError::Unreachable {
        upstream: String::new(),
        message: "the stream's source names no upstream agent".into(),
    }))
}

/// A log that holds nothing starts where the offer does.
async fn start_log(stream: &SharedLog, offer: &Offer) -> Result<(), LogError> {
    if stream.position().is_none() {
        let (id, offset) = (offer.replid.clone(), offer.offset);
        blocking(stream, move |s| s.write(|l| l.restart(&id, offset))).await?;
    }
    Ok(())
}

/// One session through an RDMA ring, on a blocking thread: dials the
/// upstream's RDMA endpoint (off loopback, as for snapshots) and runs
/// `transport::ring` into the log; the thread is woken whenever the
/// servers fed from the log acknowledge, and stopped when this future is
/// dropped.
async fn ring_session(
    pull: &Pull,
    ring: &RingAsk,
    upstream: &str,
    stream: &SharedLog,
    offer: Offer,
    endpoint: SocketAddr,
) -> Result<(), PullError> {
    let spec = ring_spec(pull, ring, endpoint);
    start_log(stream, &offer).await?;
    let m = &pull.metrics;
    let _running = Running::start(
        m.stream_sessions
            .with_label_values(&[&pull.instance, "replica"]),
    );
    info!(instance = %pull.instance, %upstream, %endpoint, replid = %offer.replid, offset = offer.offset, size = ring.size, "following the upstream agent's stream through an RDMA ring");
    let r = RingReplica {
        key: offer.key,
        from: offer.offset,
        window: offer.window,
        size: ring.size,
        token: offer.token,
        silent: UPSTREAM_TIMEOUT,
        cancel: CancellationToken::new(),
        spin: ring.spin,
    };
    let stop = r.cancel.clone();
    let _stop = stop.clone().drop_guard();
    let mut sink = LogSink {
        stream: stream.clone(),
        offered: pull.offered.clone(),
        received: Traffic::of(m, &pull.instance, "replica"),
        instance: pull.instance.clone(),
        stop: stop.clone(),
    };
    let sessions = m
        .stream_ring_sessions
        .with_label_values(&[&pull.instance, "replica"]);
    let (log, state) = (
        stream.clone(),
        WriterState::FollowingAgent {
            upstream: upstream.to_string(),
            over: Over::Ring,
        },
    );
    let runtime = tokio::runtime::Handle::current();
    let mut acks = stream.watch_acks();
    let run = tokio::task::spawn_blocking(move || {
        let link = DataLink::dial(&spec)?;
        sessions.inc();
        log.set_state(state);
        let mut watcher = None;
        let result = link.run_ring(r, &mut sink, |wake| {
            watcher = Some(runtime.spawn(async move {
                loop {
                    tokio::select! {
                        changed = acks.changed() => if changed.is_err() { return },
                        _ = stop.cancelled() => return wake(),
                    }
                    wake();
                }
            }));
        });
        if let Some(w) = watcher {
            w.abort();
        }
        Ok::<_, DialError>(result)
    });
    match run.await.expect("ring session thread")? {
        None => Err(PullError::BadOffer("its RDMA endpoint is not RDMA".into())),
        Some(Ok(())) => Ok(()),
        // The ring's log errors are the log's own.
        Some(Err(RingRunError::Log(RingLogError::Log(e)))) => Err(PullError::Log(e)),
        Some(Err(e)) => Err(e.into()),
    }
}

/// Why the log did not take what a ring session brought.
#[derive(Debug, thiserror::Error)]
pub enum RingLogError {
    #[error(transparent)]
    Log(#[from] LogError),
    /// The session was dropped: a next one may already write the log.
    #[error("the session was stopped")]
    Stopped,
}

/// The log as a ring session writes it.
struct LogSink {
    stream: SharedLog,
    offered: Offered,
    received: Traffic,
    instance: String,
    /// The session was dropped: a next one may already write the log.
    stop: CancellationToken,
}

impl RingSink for LogSink {
    type Error = RingLogError;

    fn append(&mut self, offset: u64, bytes: Vec<u8>) -> Result<(), RingLogError> {
        if self.stop.is_cancelled() {
            return Err(RingLogError::Stopped);
        }
        self.stream.write(|l| l.append(offset, &bytes))?;
        self.received.frame(bytes.len());
        Ok(())
    }

    fn epoch(&mut self, offset: u64, replid: &[u8; REPLID_LEN]) -> Result<(), RingLogError> {
        let id = String::from_utf8_lossy(replid).into_owned();
        info!(instance = %self.instance, offset, replid = %id, "the stream continues under a new replication id");
        Ok(self.stream.write(|l| l.switch(&id))?)
    }

    fn applied(&mut self) -> Option<u64> {
        let applied = self.stream.applied();
        if let Some(a) = applied {
            self.stream.set_upstream_acked(a);
        }
        applied
    }

    fn tick(&mut self, at: u64) -> Result<(), RingLogError> {
        let floor = self.stream.floor(&(self.offered)());
        Ok(self.stream.tick(at, floor)?)
    }
}

/// Sends the upstream what the servers fed from the log applied, when it
/// changed.
async fn report_applied(
    link: &mut StreamLink,
    rx: &mut Receiver,
    stream: &SharedLog,
) -> Result<(), PullError> {
    if let Some(t) = stream.applied().and_then(|a| rx.applied(a)) {
        link.send(&t).await?;
        if let Token::Sapp { offset, .. } = t {
            stream.set_upstream_acked(offset);
        }
    }
    Ok(())
}

/// Runs a log operation off the runtime.
async fn blocking<T: Send + 'static>(
    stream: &SharedLog,
    f: impl FnOnce(&SharedLog) -> Result<T, LogError> + Send + 'static,
) -> Result<T, LogError> {
    let stream = stream.clone();
    tokio::task::spawn_blocking(move || f(&stream))
        .await
        .expect("log task")
}
