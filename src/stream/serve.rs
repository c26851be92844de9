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
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::RngCore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::log::LogError;
use super::{Downstream, SharedLog, Traffic};
use crate::blk3::stream::{Next, Sender, StreamError, MAX_FRAME, STREAM_KEY_LEN};
use crate::blk3::token::{Kind, REPLID_LEN, SESSION_TOKEN_LEN};
use crate::blk3::Token;
use crate::metrics::{Metrics, Running};
use crate::transport::faults;
use crate::transport::ring::{HeaderLie, RingFeed, RingRunError, RingSource};
use crate::transport::session::SourceLink;
use crate::transport::stream::{StreamLink, StreamLinkError};

/// Bytes a source sends beyond the replica's last acknowledgement.
pub const WINDOW: u64 = 4 << 20;
/// The most a session reads of the log at once, before it sends it: a
/// frame, so a replica that stops reading pins a frame, not its window.
const READ_AT_ONCE: u64 = MAX_FRAME as u64;
/// How long an ended session waits to tell the replica why.
const TELL_WAIT: Duration = Duration::from_secs(2);
/// Stream sessions offered or served at once, at most (every instance).
pub use crate::config::MAX_STREAM_SESSIONS as MAX_SESSIONS;

/// A stream session agreed by `OpenStream`.
pub struct StreamSession {
    pub id: String,
    pub instance: String,
    pub replica: String,
    /// The address the replica asked from (as the control plane saw it;
    /// kept as the host it counts for once offered).
    pub host: Option<IpAddr>,
    pub stream: SharedLog,
    pub key: [u8; STREAM_KEY_LEN],
    /// The replica's replication id at `from`, where the session starts.
    pub replid: String,
    pub from: u64,
    /// TCP under TLS.
    pub tls: bool,
    /// Over an RDMA ring.
    pub rdma: bool,
    /// `[stream] stall_timeout` and `stall_end`.
    pub stall_timeout: Duration,
    pub stall_end: Duration,
    /// `[stream] max_sessions_per_host`.
    pub max_per_host: usize,
    /// `[stream] rdma_spin`, for a session over a ring.
    pub spin: Duration,
    pub expires: Instant,
}

/// Stream sessions offered (by token) and served: within [`MAX_SESSIONS`]
/// in all and `[stream] max_sessions_per_host` per host; one of each
/// (replica, instance, host) served, the newest. A replica's session that
/// fetches a damaged record of its log again (named `<replica>`[`MEND`])
/// may go one past the host's cap, while that replica's own session from
/// the same host is offered or served.
#[derive(Default)]
pub struct StreamOffers(Arc<Mutex<Sessions>>);

#[derive(Default)]
struct Sessions {
    offers: HashMap<[u8; SESSION_TOKEN_LEN], StreamSession>,
    /// The sessions served, by a serial: who asked, and what ends each.
    serving: HashMap<u64, (Who, CancellationToken)>,
    next: u64,
}

/// Who a session is for: the host that asked ([`host_key`]), and the
/// replica agent and instance it named. Only the same host may replace a
/// replica's session: a name is the asker's word, its address is not.
#[derive(Clone, PartialEq, Eq)]
struct Who {
    host: Option<IpAddr>,
    replica: String,
    instance: String,
}

impl Who {
    /// Of a session whose `host` is already a [`host_key`] (as
    /// [`StreamOffers::insert`] keeps it).
    fn of(s: &StreamSession) -> Who {
        Who {
            host: s.host,
            replica: s.replica.clone(),
            instance: s.instance.clone(),
        }
    }

    fn is(&self, s: &StreamSession) -> bool {
        (self.host, self.replica.as_str(), self.instance.as_str())
            == (s.host, s.replica.as_str(), s.instance.as_str())
    }
}

/// What a replica agent adds to its name for the session that fetches a
/// damaged record of its log again ([`super::mend`]).
pub const MEND: &str = ".mend";

/// The host an address counts for: an IPv4 address itself (also when
/// mapped into IPv6), an IPv6 address's /64 (one host holds a whole /64
/// to choose from).
fn host_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let net = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(net.into())
        }
        v4 => v4,
    }
}

/// Why a session was not offered: the limit it met.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Busy {
    #[error("this source already offers or serves {MAX_SESSIONS} stream sessions; retry in a few seconds")]
    Full,
    #[error("this source already offers or serves {0} stream sessions to agents of this host ([stream] max_sessions_per_host)")]
    Host(usize),
}

/// Whether `who` is a replica's session to mend its log ([`MEND`]) while
/// that replica's own session from the same host is offered or served,
/// and no other such session of it is served.
fn mends_one_held(
    who: &Who,
    offers: &HashMap<[u8; SESSION_TOKEN_LEN], StreamSession>,
    serving: &HashMap<u64, (Who, CancellationToken)>,
) -> bool {
    let Some(replica) = who.replica.strip_suffix(MEND) else {
        return false;
    };
    let own = Who {
        replica: replica.to_string(),
        ..who.clone()
    };
    let held = offers.values().any(|s| own.is(s)) || serving.values().any(|(w, _)| *w == own);
    held && !serving.values().any(|(w, _)| w == who)
}

/// A served session's place among the sessions, held until dropped, and
/// what ends it: the agent's shutdown, a newer session of the same
/// replica, instance and host, or (over a ring) its stall.
pub struct Serving {
    sessions: Arc<Mutex<Sessions>>,
    serial: u64,
    end: CancellationToken,
}

impl Serving {
    /// Cancelled when the session is to end.
    pub fn end(&self) -> &CancellationToken {
        &self.end
    }

    /// Ends the sessions served before this one to the same replica,
    /// instance and host (it asked again: they are gone or going); called
    /// once this one runs on the transport it was offered for.
    fn replace_older(&self) {
        let sessions = self.sessions.lock().expect("stream sessions lock");
        let Some((who, _)) = sessions.serving.get(&self.serial) else {
            return;
        };
        for (serial, (old, end)) in &sessions.serving {
            if *serial < self.serial && old == who {
                end.cancel();
            }
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let mut sessions = self.sessions.lock().expect("stream sessions lock");
        sessions.serving.remove(&self.serial);
    }
}

impl StreamOffers {
    /// Stores `session` under a fresh random token, in place of any
    /// offer not yet taken to the same replica, instance and host.
    pub fn insert(&self, mut session: StreamSession) -> Result<[u8; SESSION_TOKEN_LEN], Busy> {
        session.host = session.host.map(host_key);
        let mut sessions = self.0.lock().expect("stream sessions lock");
        let (now, who) = (Instant::now(), Who::of(&session));
        let Sessions {
            offers, serving, ..
        } = &mut *sessions;
        offers.retain(|_, s| s.expires > now && !who.is(s));
        if offers.len() + serving.len() >= MAX_SESSIONS {
            return Err(Busy::Full);
        }
        let from_host = offers.values().filter(|s| s.host == who.host).count()
            + serving.values().filter(|(w, _)| w.host == who.host).count();
        if from_host >= session.max_per_host && !mends_one_held(&who, offers, serving) {
            return Err(Busy::Host(session.max_per_host));
        }
        let mut token = [0u8; SESSION_TOKEN_LEN];
        rand::rng().fill_bytes(&mut token);
        offers.insert(token, session);
        Ok(token)
    }

    /// Takes the unexpired session of `token`, once, ended by `shutdown`
    /// or by a newer one of the same replica ([`Serving::replace_older`]).
    pub fn take(
        &self,
        token: &[u8],
        shutdown: &CancellationToken,
    ) -> Option<(StreamSession, Serving)> {
        let token: &[u8; SESSION_TOKEN_LEN] = token.get(..SESSION_TOKEN_LEN)?.try_into().ok()?;
        let mut sessions = self.0.lock().expect("stream sessions lock");
        let session = sessions
            .offers
            .remove(token)
            .filter(|s| s.expires > Instant::now())?;
        let who = Who::of(&session);
        let (serial, end) = (sessions.next, shutdown.child_token());
        sessions.next += 1;
        sessions.serving.insert(serial, (who, end.clone()));
        let serving = Serving {
            sessions: self.0.clone(),
            serial,
            end,
        };
        Some((session, serving))
    }

    /// Drops every offer (shutdown).
    pub fn clear(&self) {
        self.0.lock().expect("stream sessions lock").offers.clear();
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
    #[error("the replica took nothing of the stream for {0:?} ([stream] stall_end) while the log held more: the session is ended, and a new one continues from its log's end")]
    NoProgress(Duration),
    #[error("{ENDED}")]
    Ended,
}

impl ServeError {
    /// The `kvsync_stream_refused_total` reason, when the session ended
    /// for one.
    fn refusal(&self) -> Option<&'static str> {
        match self {
            ServeError::Stream(e) => Some(e.label()),
            ServeError::Log(LogError::NotHeld { .. }) => Some("too_old"),
            ServeError::NoProgress(_) => Some("no_progress"),
            _ => None,
        }
    }
}

/// Serves a proved stream session until it ends or `serving` is ended.
pub async fn serve(
    mut link: StreamLink,
    session: StreamSession,
    serving: Serving,
    peer: String,
    metrics: Arc<Metrics>,
) {
    let s = &session;
    serving.replace_older();
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
    let end = serving.end();
    let result = send_stream(&mut link, s, &downstream, end, (&sent, &mut stall)).await;
    s.stream.forget(&downstream);
    match result {
        Ok(at) => info!(session = %s.id, at, "{ENDED}"),
        Err(ServeError::Ended) => info!(session = %s.id, "{ENDED}"),
        Err(e) => {
            if let Some(reason) = e.refusal() {
                metrics
                    .stream_refused
                    .with_label_values(&[&s.instance, reason])
                    .inc();
            }
            warn!(session = %s.id, instance = %s.instance, error = %e, "stream session ended");
            // Told why, unless it broke the link or reads nothing (a
            // replica that takes nothing could hold a wait for the telling).
            if !matches!(
                e,
                ServeError::Link(_) | ServeError::Replica(_) | ServeError::NoProgress(_)
            ) {
                let _ = tokio::time::timeout(TELL_WAIT, link.fail(&e.to_string())).await;
            }
        }
    }
}

/// Why a session ends without an error: the agent stops, or the replica
/// asked for a new session.
const ENDED: &str = "stream session ended: the agent stops, or a newer session of the same replica, instance and host replaced it";

/// Serves a proved stream session over an RDMA ring on this blocking
/// thread, until it ends or `serving` is ended: the same log, window, MACs and id
/// changes as over TCP, through `transport::ring`. The session is woken
/// whenever the log grows.
pub fn serve_ring(
    link: SourceLink,
    session: StreamSession,
    serving: Serving,
    peer: String,
    plane: RingPlane,
) {
    let s = &session;
    serving.replace_older();
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
        end: serving.end(),
        stalled: None,
    };
    let source = RingSource {
        key: s.key,
        from: s.from,
        replid,
        window: WINDOW,
        silent: plane.silent,
        cancel: serving.end().clone(),
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
        Some((at, Ok(()))) => match feed.stalled {
            Some(e) => {
                let reason = e.refusal().unwrap_or("no_progress");
                metrics
                    .stream_refused
                    .with_label_values(&[&s.instance, reason])
                    .inc();
                warn!(session = %s.id, instance = %s.instance, at, error = %e, "ring session ended");
            }
            None => info!(session = %s.id, at, "{ENDED}"),
        },
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
    /// Cancelled to end the session: it made no progress.
    end: &'a CancellationToken,
    stalled: Option<ServeError>,
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
        if let Err(e) = self.stall.update(due, sent) {
            self.stalled = Some(e);
            self.end.cancel();
        }
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
    timeout: Duration,
    /// `[stream] stall_end`: a stall this long ends the session.
    end: Duration,
    stalls: prometheus::IntCounter,
    since: Option<Instant>,
}

impl<'a> Stall<'a> {
    fn new(s: &'a StreamSession, downstream: &'a Downstream, metrics: &Metrics) -> Stall<'a> {
        Stall {
            stream: &s.stream,
            downstream,
            timeout: s.stall_timeout,
            end: s.stall_end,
            stalls: metrics
                .stream_credit_stalls
                .with_label_values(&[&s.instance]),
            since: None,
        }
    }

    /// Where the window stands (the stream sent up to `sent`, `due(held)`
    /// of what the log holds past it may go); during a stall, when to
    /// look again; a stall of `[stream] stall_end` is an error.
    fn update(
        &mut self,
        due: &dyn Fn(u64) -> u64,
        sent: u64,
    ) -> Result<Option<Instant>, ServeError> {
        let held = self.stream.held_past(sent);
        self.mark(held > 0 && due(held) == 0)
    }

    /// A frame went out without blocking for the timeout: the replica
    /// takes the stream (a stall, and lagging, end).
    fn flowing(&mut self) {
        if self.since.is_some() {
            let _ = self.mark(false);
        }
    }

    /// A send the replica has left blocked for the whole timeout (its
    /// socket full: it stopped reading, or reads too slowly), which stalls
    /// the session as a full window does, before the window is used up;
    /// how much longer the send may wait.
    fn blocked(&mut self) -> Result<Duration, ServeError> {
        if self.since.is_none() {
            self.stalls.inc();
        }
        // From the first block on: a replica that lets a frame through
        // now and then does not start the clock again.
        let blocked_at = Instant::now() - self.timeout;
        let since = *self.since.get_or_insert(blocked_at);
        self.since = Some(since.min(blocked_at));
        self.mark(true)?;
        let end = self.since.map_or(Instant::now(), |s| s + self.end);
        Ok(end.saturating_duration_since(Instant::now()))
    }

    fn mark(&mut self, full: bool) -> Result<Option<Instant>, ServeError> {
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
        let Some(since) = self.since else {
            return Ok(None);
        };
        let (lagging, end, now) = (since + self.timeout, since + self.end, Instant::now());
        if now >= end {
            return Err(ServeError::NoProgress(self.end));
        }
        if now < lagging {
            return Ok(Some(lagging));
        }
        if !self.stream.is_lagging(self.downstream) {
            warn!(downstream = %self.downstream, stalled_for = ?self.timeout, "the downstream has left the stream unacknowledged (its credit window full, or its socket): marked lagging; the log keeps the stream for it");
            self.stream.set_lagging(self.downstream, true);
        }
        Ok(Some(end))
    }
}

/// Sends one frame; a send still blocked after `[stream] stall_timeout`
/// marks the replica lagging ([`Stall::blocked`]) and goes on waiting, up
/// to `[stream] stall_end`.
async fn send_frame(
    link: &mut StreamLink,
    (frame, bytes): (&Token, &[u8]),
    (stall, end): (&mut Stall<'_>, &CancellationToken),
) -> Result<(), ServeError> {
    let timeout = stall.timeout;
    let send = link.send_with(frame, bytes);
    tokio::pin!(send);
    tokio::select! {
        r = &mut send => {
            r?;
            stall.flowing();
            return Ok(());
        }
        _ = end.cancelled() => return Err(ServeError::Ended),
        _ = tokio::time::sleep(timeout) => {}
    }
    let more = stall.blocked()?;
    tokio::select! {
        r = send => Ok(r?),
        _ = end.cancelled() => Err(ServeError::Ended),
        _ = tokio::time::sleep(more) => Err(ServeError::NoProgress(stall.end)),
    }
}

/// Sends the stream from the session's offset until the session ends;
/// returns where it stood when `end` ended it.
async fn send_stream(
    link: &mut StreamLink,
    s: &StreamSession,
    downstream: &Downstream,
    end: &CancellationToken,
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
                .next(tx.sent(), &replid, &|held| tx.due(held).min(READ_AT_ONCE))
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
                        let to = tx.sent();
                        match corrupt_at.filter(|at| (to - n as u64..to).contains(at)) {
                            // The fault: a bit flipped past the MAC.
                            Some(at) => {
                                let mut changed = bytes[..n].to_vec();
                                changed[(at - (to - n as u64)) as usize] ^= 0x20;
                                send_frame(link, (&frame, &changed), (stall, end)).await?;
                            }
                            None => send_frame(link, (&frame, &bytes[..n]), (stall, end)).await?,
                        }
                        sent.frame(n);
                        bytes = &bytes[n..];
                    }
                    debug_assert!(bytes.is_empty(), "what was due fits the room");
                }
            }
        }
        let look_again = stall.update(&|held| tx.due(held), tx.sent())?;
        tokio::select! {
            _ = end.cancelled() => return Ok(tx.sent()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StreamConfig;
    use crate::stream::log::Log;
    use crate::stream::{source::Source, Stream};

    fn session(stream: &SharedLog, replica: &str, host: [u8; 4]) -> StreamSession {
        StreamSession {
            id: replica.into(),
            instance: "default".into(),
            replica: replica.into(),
            host: Some(IpAddr::from(host)),
            stream: stream.clone(),
            key: [0; STREAM_KEY_LEN],
            replid: String::new(),
            from: 0,
            tls: false,
            rdma: false,
            stall_timeout: Duration::from_secs(1),
            stall_end: Duration::from_secs(2),
            max_per_host: 2,
            spin: Duration::ZERO,
            expires: Instant::now() + Duration::from_secs(60),
        }
    }

    /// The stream of an empty log in `dir`.
    fn empty_stream(dir: &std::path::Path) -> SharedLog {
        let log = Log::open(StreamConfig {
            dir: dir.to_path_buf(),
            ..StreamConfig::default()
        })
        .unwrap();
        Stream::new(log, Source::Primary("p".into()), &Metrics::new(), "t")
    }

    #[test]
    fn sessions_are_capped_per_host_and_a_replicas_newer_session_ends_its_older() {
        let dir = tempfile::tempdir().unwrap();
        let stream = empty_stream(dir.path());
        let (offers, shutdown) = (StreamOffers::default(), CancellationToken::new());
        let a = offers.insert(session(&stream, "a", [10, 0, 0, 1])).unwrap();
        let b = offers.insert(session(&stream, "b", [10, 0, 0, 1])).unwrap();
        assert_eq!(
            offers.insert(session(&stream, "c", [10, 0, 0, 1])),
            Err(Busy::Host(2)),
            "a third from the same host"
        );
        offers.insert(session(&stream, "c", [10, 0, 0, 2])).unwrap();
        let (_, served_a) = offers.take(&a, &shutdown).unwrap();
        assert!(offers.take(&a, &shutdown).is_none(), "once");
        // `b` asks again: its untaken offer is replaced.
        let b2 = offers.insert(session(&stream, "b", [10, 0, 0, 1])).unwrap();
        assert!(offers.take(&b, &shutdown).is_none());
        // `a` asks again while its session runs: taking the new one ends it.
        drop(offers.take(&b2, &shutdown).unwrap());
        assert_eq!(
            offers
                .insert(session(&stream, "a", [10, 0, 0, 1]))
                .map(|_| ()),
            Ok(()),
            "b's session ended: room for a's new offer beside a's session"
        );
        let a2 = offers.insert(session(&stream, "a", [10, 0, 0, 1])).unwrap();
        // The same name from another host replaces nothing: a name is the
        // asker's word.
        let a_elsewhere = offers.insert(session(&stream, "a", [10, 0, 0, 3])).unwrap();
        let (_, served_elsewhere) = offers.take(&a_elsewhere, &shutdown).unwrap();
        served_elsewhere.replace_older();
        assert!(!served_a.end().is_cancelled());
        let (_, served_a2) = offers.take(&a2, &shutdown).unwrap();
        assert!(!served_a.end().is_cancelled(), "not before it runs");
        served_a2.replace_older();
        assert!(served_a.end().is_cancelled(), "the older session of a ends");
        assert!(!served_a2.end().is_cancelled() && !served_elsewhere.end().is_cancelled());
        shutdown.cancel();
        assert!(served_a2.end().is_cancelled(), "and every one at shutdown");
    }

    /// Attack (review): the session that mends a replica's log was refused
    /// at its host's cap, which the replica's own session filled, and the
    /// damaged record's log was cut.
    #[test]
    fn a_replicas_mend_goes_one_past_its_hosts_cap_and_no_further() {
        let dir = tempfile::tempdir().unwrap();
        let stream = empty_stream(dir.path());
        let (offers, shutdown) = (StreamOffers::default(), CancellationToken::new());
        let host = [10, 0, 0, 1];
        let a = offers.insert(session(&stream, "a", host)).unwrap();
        let _b = offers.insert(session(&stream, "b", host)).unwrap();
        let (_, _served_a) = offers.take(&a, &shutdown).unwrap();
        let mend = offers.insert(session(&stream, "a.mend", host)).unwrap();
        assert_eq!(
            offers.insert(session(&stream, "c.mend", host)),
            Err(Busy::Host(2)),
            "no session of c to mend for"
        );
        assert_eq!(
            offers
                .insert(session(&stream, "a.mend", [10, 0, 0, 2]))
                .map(|_| ()),
            Ok(()),
            "another host has its own cap"
        );
        let (_, _mending) = offers.take(&mend, &shutdown).unwrap();
        assert_eq!(
            offers.insert(session(&stream, "a.mend", host)),
            Err(Busy::Host(2)),
            "one mend of a at a time past the cap"
        );
        assert_eq!(
            offers.insert(session(&stream, "c", host)),
            Err(Busy::Host(2)),
            "the cap holds for the rest"
        );
    }

    #[test]
    fn a_host_is_its_ipv4_address_mapped_or_not_or_its_ipv6_64() {
        let key = |a: &str| host_key(a.parse().unwrap());
        assert_eq!(key("::ffff:10.1.2.3"), key("10.1.2.3"));
        assert_ne!(key("10.1.2.3"), key("10.1.2.4"));
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::9"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
    }
}
