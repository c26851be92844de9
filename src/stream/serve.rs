//! The source's side of stream sessions: the offered sessions by one-time
//! token (what `OpenStream` agreed: the instance's log, the offset and
//! replication id to start at, the MAC key, TLS or not), and serving a
//! proved one. A session sends the log from its offset as `STRM` frames
//! within the credit window, a `SEPO` where the log's history changes
//! replication id, and waits for more when it has sent everything; it
//! ends when the replica goes, breaks the rules, the log no longer holds
//! its offset (trimmed, or started over by a full resync: the replica is
//! told, and asks again), or the agent stops. What the replica reports
//! its servers applied (`SAPP`) is the log's acknowledgement by that
//! agent ([`Downstream::Agent`]) while the session lasts. A session
//! offered over an RDMA ring runs the same way on a blocking thread
//! ([`serve_ring`], `transport::ring`). Whether to offer is
//! `sync::offer`'s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rand::RngCore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::log::LogError;
use super::{Downstream, SharedLog, Traffic};
use crate::blk3::stream::{Next, Sender, StreamError, STREAM_KEY_LEN};
use crate::blk3::token::{Kind, REPLID_LEN, SESSION_TOKEN_LEN};
use crate::blk3::Token;
use crate::metrics::{Metrics, Running};
use crate::transport::faults;
use crate::transport::ring::{HeaderLie, RingFeed, RingRunError, RingSource};
use crate::transport::session::SourceLink;
use crate::transport::stream::{StreamLink, StreamLinkError};

/// Bytes a source sends beyond the replica's last acknowledgement.
pub const WINDOW: u64 = 4 << 20;
/// Stream sessions offered or served at once, at most (every instance).
pub const MAX_SESSIONS: usize = 256;

/// A stream session agreed by `OpenStream`.
pub struct StreamSession {
    pub id: String,
    pub instance: String,
    pub replica: String,
    pub stream: SharedLog,
    pub key: [u8; STREAM_KEY_LEN],
    /// The replica's replication id at `from`, where the session starts.
    pub replid: String,
    pub from: u64,
    /// TCP under TLS.
    pub tls: bool,
    /// Over an RDMA ring.
    pub rdma: bool,
    /// `[stream] stall_timeout`.
    pub stall_timeout: std::time::Duration,
    /// `[stream] rdma_spin`, for a session over a ring.
    pub spin: std::time::Duration,
    pub expires: Instant,
}

/// Stream sessions offered (by token) and served, within [`MAX_SESSIONS`].
#[derive(Default)]
pub struct StreamOffers {
    offers: Mutex<HashMap<[u8; SESSION_TOKEN_LEN], StreamSession>>,
    serving: Arc<AtomicUsize>,
}

/// [`MAX_SESSIONS`] are offered or served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// A served session's place among [`MAX_SESSIONS`], held until dropped.
pub struct Serving(Arc<AtomicUsize>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl StreamOffers {
    /// Stores `session` under a fresh random token.
    pub fn insert(&self, session: StreamSession) -> Result<[u8; SESSION_TOKEN_LEN], Busy> {
        let mut offers = self.offers.lock().expect("stream offers lock");
        let now = Instant::now();
        offers.retain(|_, s| s.expires > now);
        if offers.len() + self.serving.load(Ordering::SeqCst) >= MAX_SESSIONS {
            return Err(Busy);
        }
        let mut token = [0u8; SESSION_TOKEN_LEN];
        rand::rng().fill_bytes(&mut token);
        offers.insert(token, session);
        Ok(token)
    }

    /// Takes the unexpired session of `token`, once.
    pub fn take(&self, token: &[u8]) -> Option<(StreamSession, Serving)> {
        let token: &[u8; SESSION_TOKEN_LEN] = token.get(..SESSION_TOKEN_LEN)?.try_into().ok()?;
        let session = self
            .offers
            .lock()
            .expect("stream offers lock")
            .remove(token)
            .filter(|s| s.expires > Instant::now())?;
        self.serving.fetch_add(1, Ordering::SeqCst);
        Some((session, Serving(self.serving.clone())))
    }

    /// Drops every offer (shutdown).
    pub fn clear(&self) {
        self.offers.lock().expect("stream offers lock").clear();
    }
}

/// A random MAC key for one session.
pub fn new_key() -> [u8; STREAM_KEY_LEN] {
    let mut key = [0u8; STREAM_KEY_LEN];
    rand::rng().fill_bytes(&mut key);
    key
}

/// Why a served stream session ended.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Link(#[from] StreamLinkError),
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("the replica ended the session: {0}")]
    Replica(String),
    #[error("the replica sent {0}, which a stream session does not take")]
    Unexpected(Kind),
}

impl ServeError {
    /// The `kvsync_stream_refused_total` reason, when the session ended
    /// for one.
    fn refusal(&self) -> Option<&'static str> {
        match self {
            ServeError::Stream(e) => Some(e.label()),
            ServeError::Log(LogError::NotHeld { .. }) => Some("too_old"),
            _ => None,
        }
    }
}

/// Serves a proved stream session until it ends or `shutdown`.
pub async fn serve(
    mut link: StreamLink,
    session: StreamSession,
    _serving: Serving,
    peer: String,
    shutdown: CancellationToken,
    metrics: Arc<Metrics>,
) {
    let s = &session;
    let _running = Running::start(
        metrics
            .stream_sessions
            .with_label_values(&[&s.instance, "source"]),
    );
    info!(session = %s.id, instance = %s.instance, replica = %s.replica, %peer, from = s.from, tls = s.tls, "serving the replication stream");
    let sent = Traffic::of(&metrics, &s.instance, "source");
    let downstream = Downstream::Agent {
        node: s.replica.clone(),
        session: s.id.clone(),
    };
    let mut stall = Stall::new(s, &downstream, &metrics);
    let result = send_stream(&mut link, s, &downstream, &shutdown, (&sent, &mut stall)).await;
    s.stream.forget(&downstream);
    match result {
        Ok(at) => info!(session = %s.id, at, "stream session ended: the agent stops"),
        Err(e) => {
            if let Some(reason) = e.refusal() {
                metrics
                    .stream_refused
                    .with_label_values(&[&s.instance, reason])
                    .inc();
            }
            warn!(session = %s.id, instance = %s.instance, error = %e, "stream session ended");
            if !matches!(e, ServeError::Link(_) | ServeError::Replica(_)) {
                link.fail(&e.to_string()).await;
            }
        }
    }
}

/// Serves a proved stream session over an RDMA ring on this blocking
/// thread, until it ends or `shutdown`: the same log, window, MACs and id
/// changes as over TCP, through `transport::ring`. The session is woken
/// whenever the log grows.
pub fn serve_ring(
    link: SourceLink,
    session: StreamSession,
    _serving: Serving,
    peer: String,
    plane: RingPlane,
) {
    let s = &session;
    let metrics = &plane.metrics;
    let _running = Running::start(
        metrics
            .stream_sessions
            .with_label_values(&[&s.instance, "source"]),
    );
    info!(session = %s.id, instance = %s.instance, replica = %s.replica, %peer, from = s.from, "serving the replication stream over an RDMA ring");
    metrics
        .stream_ring_sessions
        .with_label_values(&[&s.instance, "source"])
        .inc();
    let Ok(replid) = <[u8; REPLID_LEN]>::try_from(s.replid.as_bytes()) else {
        return warn!(session = %s.id, "stream session without a 40-byte replication id");
    };
    let downstream = Downstream::Agent {
        node: s.replica.clone(),
        session: s.id.clone(),
    };
    let mut feed = LogFeed {
        stream: &s.stream,
        downstream: &downstream,
        sent: Traffic::of(metrics, &s.instance, "source"),
        stall: Stall::new(s, &downstream, metrics),
    };
    let source = RingSource {
        key: s.key,
        from: s.from,
        replid,
        window: WINDOW,
        silent: plane.silent,
        cancel: plane.shutdown.clone(),
        lie: first_ring_lie(),
        spin: s.spin,
    };
    let mut watcher = None;
    let served = link.serve_ring(source, &mut feed, |wake| {
        let mut changed = s.stream.watch();
        watcher = Some(plane.runtime.spawn(async move {
            while changed.changed().await.is_ok() {
                wake();
            }
        }));
    });
    if let Some(w) = watcher {
        w.abort();
    }
    s.stream.forget(&downstream);
    match served {
        None => warn!(session = %s.id, "a ring session's connection is not RDMA"),
        Some((at, Ok(()))) => info!(session = %s.id, at, "ring session ended: the agent stops"),
        Some((at, Err(e))) => {
            if let RingRunError::Ring(r) = &e {
                metrics
                    .stream_refused
                    .with_label_values(&[&s.instance, r.label()])
                    .inc();
            }
            warn!(session = %s.id, instance = %s.instance, at, error = %e, "ring session ended");
        }
    }
}

/// What a ring session needs of the agent besides its session.
pub struct RingPlane {
    pub metrics: Arc<Metrics>,
    pub shutdown: CancellationToken,
    /// How long the replica may leave the source unanswered.
    pub silent: std::time::Duration,
    /// Where the log's wake-ups run.
    pub runtime: tokio::runtime::Handle,
}

/// The `stream_ring_lie` fault: in this agent's first ring session only.
fn first_ring_lie() -> Option<HeaderLie> {
    static LIED: AtomicBool = AtomicBool::new(false);
    faults::active()
        .stream_ring_lie
        .filter(|_| !LIED.swap(true, Ordering::SeqCst))
}

/// The log as a ring session reads it.
struct LogFeed<'a> {
    stream: &'a SharedLog,
    downstream: &'a Downstream,
    sent: Traffic,
    stall: Stall<'a>,
}

impl RingFeed for LogFeed<'_> {
    type Error = LogError;

    fn next(
        &mut self,
        at: u64,
        replid: &[u8; REPLID_LEN],
        due: &dyn Fn(u64) -> u64,
    ) -> Result<Next, LogError> {
        let next = self
            .stream
            .next_blocking(at, &String::from_utf8_lossy(replid), due)?;
        if let Next::Bytes(run) = &next {
            self.sent.frame(run.len());
        }
        Ok(next)
    }

    fn applied(&mut self, offset: u64) {
        self.stream.acked(self.downstream.clone(), offset);
    }

    fn window(&mut self, due: &dyn Fn(u64) -> u64, sent: u64) {
        self.stall.update(due, sent);
    }
}

/// A served session's credit window against the log: full while the log
/// holds more than was sent and the window lets none of it go
/// ([`Sender::due`]). Each full stretch is one
/// credit stall (`kvsync_stream_credit_stalls_total`); one that lasts
/// `[stream] stall_timeout` marks the downstream lagging until the window
/// opens again. The source only waits, the log keeps the stream meanwhile:
/// the primary is never slowed.
struct Stall<'a> {
    stream: &'a SharedLog,
    downstream: &'a Downstream,
    timeout: std::time::Duration,
    stalls: prometheus::IntCounter,
    since: Option<Instant>,
}

impl<'a> Stall<'a> {
    fn new(s: &'a StreamSession, downstream: &'a Downstream, metrics: &Metrics) -> Stall<'a> {
        Stall {
            stream: &s.stream,
            downstream,
            timeout: s.stall_timeout,
            stalls: metrics
                .stream_credit_stalls
                .with_label_values(&[&s.instance]),
            since: None,
        }
    }

    /// Where the window stands (the stream sent up to `sent`, `due(held)`
    /// of what the log holds past it may go); while a stall has not yet
    /// lasted the timeout, when to look again.
    fn update(&mut self, due: &dyn Fn(u64) -> u64, sent: u64) -> Option<Instant> {
        let held = self.stream.held_past(sent);
        self.mark(held > 0 && due(held) == 0)
    }

    /// A send the replica has left blocked for the whole timeout (its
    /// socket full: it stopped reading, or reads too slowly), which stalls
    /// the session as a full window does, before the window is used up.
    fn blocked(&mut self) {
        if self.since.is_none() {
            self.stalls.inc();
        }
        self.since = Some(Instant::now() - self.timeout);
        self.mark(true);
    }

    fn mark(&mut self, full: bool) -> Option<Instant> {
        match (full, self.since) {
            (true, None) => {
                self.stalls.inc();
                self.since = Some(Instant::now());
            }
            (false, Some(_)) => {
                self.since = None;
                if self.stream.is_lagging(self.downstream) {
                    info!(downstream = %self.downstream, "the downstream takes the stream again: no longer lagging");
                    self.stream.set_lagging(self.downstream, false);
                }
            }
            _ => {}
        }
        let deadline = self.since? + self.timeout;
        if Instant::now() < deadline {
            return Some(deadline);
        }
        if !self.stream.is_lagging(self.downstream) {
            warn!(downstream = %self.downstream, stalled_for = ?self.timeout, "the downstream has left the stream unacknowledged (its credit window full, or its socket): marked lagging; the log keeps the stream for it");
            self.stream.set_lagging(self.downstream, true);
        }
        None
    }
}

/// Sends one frame; a send still blocked after `[stream] stall_timeout`
/// marks the replica lagging ([`Stall::blocked`]) and goes on waiting.
async fn send_frame(
    link: &mut StreamLink,
    (frame, bytes): (&Token, &[u8]),
    stall: &mut Stall<'_>,
) -> Result<(), ServeError> {
    let timeout = stall.timeout;
    let send = link.send_with(frame, bytes);
    tokio::pin!(send);
    tokio::select! {
        r = &mut send => return Ok(r?),
        _ = tokio::time::sleep(timeout) => {}
    }
    stall.blocked();
    Ok(send.await?)
}

/// Sends the stream from the session's offset until the session ends;
/// returns where it stood at shutdown.
async fn send_stream(
    link: &mut StreamLink,
    s: &StreamSession,
    downstream: &Downstream,
    shutdown: &CancellationToken,
    (sent, stall): (&Traffic, &mut Stall<'_>),
) -> Result<u64, ServeError> {
    let corrupt_at = faults::active().stream_corrupt_at;
    let mut tx = Sender::new(s.key, s.from, WINDOW);
    let mut replid = s.replid.clone();
    let mut changed = s.stream.watch();
    loop {
        loop {
            match s
                .stream
                .next(tx.sent(), &replid, &|held| tx.due(held))
                .await?
            {
                Next::Wait => break,
                Next::Epoch(id) => {
                    link.send(&tx.epoch(&id)).await?;
                    replid = String::from_utf8_lossy(&id).into_owned();
                }
                Next::Bytes(run) => {
                    // Consecutive records go out in frames as large as the
                    // window and a frame allow: a log of many small records
                    // (one per read from the primary) costs a frame, a MAC
                    // and an acknowledgement per megabyte, not per record.
                    let mut bytes = &run[..];
                    while let Some((frame, n)) = tx.frame(bytes) {
                        let end = tx.sent();
                        match corrupt_at.filter(|at| (end - n as u64..end).contains(at)) {
                            // The fault: a bit flipped past the MAC.
                            Some(at) => {
                                let mut changed = bytes[..n].to_vec();
                                changed[(at - (end - n as u64)) as usize] ^= 0x20;
                                send_frame(link, (&frame, &changed), stall).await?;
                            }
                            None => send_frame(link, (&frame, &bytes[..n]), stall).await?,
                        }
                        sent.frame(n);
                        bytes = &bytes[n..];
                    }
                    debug_assert!(bytes.is_empty(), "what was due fits the room");
                }
            }
        }
        let look_again = stall.update(&|held| tx.due(held), tx.sent());
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(tx.sent()),
            _ = tokio::time::sleep_until(look_again.unwrap_or_else(Instant::now).into()), if look_again.is_some() => {}
            // The writer is gone with its instance: nothing more comes.
            r = changed.changed() => if r.is_err() { return Ok(tx.sent()) },
            t = link.next_token() => match t? {
                Token::Sack { offset, mac } => tx.on_sack(offset, &mac)?,
                Token::Sapp { offset, mac } => s.stream.acked(downstream.clone(), tx.on_sapp(offset, &mac)?),
                Token::Rdfl { reason } => return Err(ServeError::Replica(reason)),
                other => return Err(ServeError::Unexpected(other.kind())),
            },
        }
    }
}

/// What protects the stream sessions of an agent whose control plane is
/// under TLS (`tls`) or not: the key of each session's MAC travels in the
/// `OpenStream` answer.
pub fn integrity(tls: bool) -> &'static str {
    match tls {
        true => "frames and acknowledgements under a per-session MAC whose key only the TLS control plane carried",
        false => "frames and acknowledgements under a per-session MAC whose key crossed the control plane in plain text ([tls] is off): whoever can read that path can forge them; set [tls] where the path is not yours",
    }
}
