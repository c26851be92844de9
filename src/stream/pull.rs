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

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::log::{LogError, Record};
use super::SharedLog;
use crate::blk3::stream::{Receiver, StreamError, MAX_FRAME, STREAM_KEY_LEN};
use crate::blk3::token::{Kind, SESSION_TOKEN_LEN};
use crate::blk3::Token;
use crate::metrics::{Metrics, Running};
use crate::rpc::dial::{Dialer, CONNECT_TIMEOUT};
use crate::rpc::pb;
use crate::transport::stream::{StreamLink, StreamLinkError, StreamTls};

/// An upstream that sends nothing for this long is taken as gone (its
/// primary pings the stream every few seconds).
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest credit window a replica accepts from an offer.
const MAX_WINDOW: u64 = 256 << 20;

/// What the puller needs to know of its instance and its upstream.
pub struct Pull {
    pub instance: String,
    /// The upstream agent's gRPC address and the instance asked of it.
    pub upstream: String,
    pub upstream_instance: String,
    pub node_id: String,
    pub dialer: Dialer,
    /// The name the upstream's data-plane certificate must carry.
    pub tls_name: String,
    pub peer_timeout: Duration,
    pub metrics: Arc<Metrics>,
    /// The (replication id, M) of the snapshots this agent has, which the
    /// log's retention keeps continuous.
    pub offered: Box<dyn Fn() -> Vec<(String, u64)> + Send + Sync>,
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
}

impl PullError {
    /// The `kvsync_stream_refused_total` reason, when the session ended
    /// for one.
    fn refusal(&self) -> Option<&'static str> {
        match self {
            PullError::Stream(e) => Some(e.label()),
            PullError::TooOld { .. } => Some("too_old"),
            _ => None,
        }
    }
}

/// Follows the upstream until `stop`, a new session after every failure
/// (100 ms, doubling to 5 s while sessions fail before any stream; 30 s
/// while the upstream answers "too old" to a log that holds a stream).
pub async fn run(pull: Pull, stream: SharedLog, stop: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let before = stream.lock().position();
        let result = tokio::select! {
            _ = stop.cancelled() => return,
            r = session(&pull, &stream) => r,
        };
        let Err(e) = result else { return };
        if matches!(e, PullError::Log(LogError::Io { .. })) {
            pull.metrics
                .stream_write_errors
                .with_label_values(&[&pull.instance])
                .inc();
        }
        if let Some(reason) = e.refusal() {
            pull.metrics
                .stream_refused
                .with_label_values(&[&pull.instance, reason])
                .inc();
        }
        warn!(instance = %pull.instance, upstream = %pull.upstream, error = %e, "following the upstream agent's stream stopped; it asks again");
        stream.set_state(format!("reconnecting: {e}"));
        if stream.lock().position() != before {
            backoff = Duration::from_millis(100);
        }
        // An upstream that lost this log's offset will not find it again
        // soon; one with nothing yet (a log that asked from none) will.
        let wait = match &e {
            PullError::TooOld { replid, .. } if !replid.is_empty() => Duration::from_secs(30),
            _ => backoff,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// An offer to continue, checked.
struct Offer {
    token: [u8; SESSION_TOKEN_LEN],
    key: [u8; STREAM_KEY_LEN],
    endpoint: SocketAddr,
    tls: bool,
    replid: String,
    offset: u64,
    window: u64,
}

/// Asks the upstream to continue from `at` (the log's position).
async fn ask(pull: &Pull, at: Option<&(String, u64)>) -> Result<Offer, PullError> {
    let upstream = pull.upstream.clone();
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
            replica_node_id: pull.node_id.clone(),
            instance: pull.upstream_instance.clone(),
            replid: replid.clone(),
            offset,
            data_tls: pull.dialer.data_tls.is_some(),
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
            return Err(PullError::TooOld {
                upstream,
                replid,
                offset,
                held: crate::peer_text::escape_controls(&o.held).into_owned(),
                snapshot: o.snapshot.map(|s| format!("snapshot of seq {}", s.seq)),
            })
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
        replid: o.replid,
        offset: o.offset,
        window: o.window,
    };
    if !(MAX_FRAME as u64..=MAX_WINDOW).contains(&offer.window) {
        return Err(bad("its credit window is outside 1 MiB to 256 MiB"));
    }
    Ok(offer)
}

/// Where the log asks to continue from: its end, else the newest of this
/// agent's snapshots (so the log continues it), else nothing.
fn start_point(pull: &Pull, stream: &SharedLog) -> Option<(String, u64)> {
    let held = stream.lock().position();
    held.or_else(|| (pull.offered)().into_iter().max_by_key(|(_, m)| *m))
}

async fn session(pull: &Pull, stream: &SharedLog) -> Result<(), PullError> {
    let at = start_point(pull, stream);
    let offer = ask(pull, at.as_ref()).await?;
    let tls = match (offer.tls, &pull.dialer.data_tls) {
        (false, _) => None,
        (true, Some(config)) => Some(StreamTls {
            config: config.clone(),
            name: pull.tls_name.clone(),
        }),
        (true, None) => {
            return Err(PullError::BadOffer(
                "it asks for TLS on the data plane, which this agent has no [tls] for".into(),
            ))
        }
    };
    let mut link = StreamLink::dial(
        offer.endpoint,
        tls.as_ref(),
        &offer.token,
        pull.peer_timeout,
    )
    .await?;
    if stream.lock().position().is_none() {
        let (id, offset) = (offer.replid.clone(), offer.offset);
        blocking(stream, move |s| s.write(|l| l.restart(&id, offset))).await?;
    }
    let m = &pull.metrics;
    let _running = Running::start(
        m.stream_sessions
            .with_label_values(&[&pull.instance, "replica"]),
    );
    let received = m
        .stream_bytes
        .with_label_values(&[&pull.instance, "replica"]);
    info!(instance = %pull.instance, upstream = %pull.upstream, replid = %offer.replid, offset = offer.offset, tls = offer.tls, "following the upstream agent's stream");
    stream.set_state(format!("following agent {}", pull.upstream));
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
                blocking(stream, move |s| {
                    let mut log = s.lock();
                    log.still_ends_at(end)?;
                    log.tick(floor)
                })
                .await?;
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
                let rec = Record::new(offset, bytes);
                blocking(stream, move |s| s.write(|l| l.append(&rec))).await?;
                received.inc_by(len as u64);
                link.send(&rx.ack()).await?;
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

/// Sends the upstream what the servers fed from the log applied, when it
/// changed.
async fn report_applied(
    link: &mut StreamLink,
    rx: &mut Receiver,
    stream: &SharedLog,
) -> Result<(), PullError> {
    if let Some(t) = stream.applied().and_then(|a| rx.applied(a)) {
        link.send(&t).await?;
        if let Token::Sapp { offset } = t {
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
