//! The source role's data side: the table of offered sessions (one-time
//! token → the held snapshot, its transport, an expiry) with its admission
//! limits, and the one serve loop for data connections on every transport.
//! A connection must prove an offered, unexpired, unused token for its
//! transport (its first TCP frame, or the RDMA connect's private data), read
//! on the runtime under `data.hello_timeout` with caps on connections still
//! proving one; only then does it get a thread, memory or a queue pair, and
//! its session's source-side metrics. A proof of a stream session
//! (`stream::serve`) is served on the runtime instead. What is offered is
//! `offer`'s.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use rand::RngCore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn};

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::BulkParams;
use crate::metrics::{unix_now, Metrics, Running};
use crate::rpc::conn_limit;
use crate::store::catalog::CatalogEntry;
use crate::store::served::Served;
use crate::stream::serve::{Serving, StreamOffers, StreamSession};
use crate::sys::ratelimit::RateLimiter;
use crate::transport::pace::MinRate;
use crate::transport::probe::LocalRdma;
use crate::transport::session::{Accepted, Proved, SessionResult, SourceLink};
use crate::transport::Asked;
use crate::transport::{faults, ktls, Serve, TransportKind};

/// A session offered to a replica, waiting for its data connection.
pub struct OfferedSession {
    pub id: String,
    /// The instance whose snapshot it serves (and no other's).
    pub instance: String,
    pub replica: String,
    /// The address the replica asked from: its data connections are
    /// expected from there.
    pub replica_ip: Option<IpAddr>,
    pub entry: Arc<CatalogEntry>,
    /// Its bytes, held for the session.
    pub snapshot: Served,
    /// The transport the token is valid on.
    pub transport: TransportKind,
    /// TCP under TLS.
    pub tls: bool,
    pub expires: Instant,
    /// The agent whose snapshot this is, when this agent relays it.
    pub origin: Option<String>,
    /// The primary's backlog, held for a Redis seeding.
    pub backlog: Option<crate::kv::backlog::Lease>,
    /// Data connections the session runs on at once (TCP streams; 1 for RDMA).
    pub streams: u32,
}

/// One unit of a counter, held until dropped.
pub struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(counter: &Arc<AtomicUsize>) -> Slot {
        counter.fetch_add(1, Ordering::SeqCst);
        Slot(counter.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One session of one replica (a node id at an address), counted until
/// dropped.
pub struct ReplicaSlot {
    counts: Arc<Mutex<HashMap<String, usize>>>,
    replica: String,
}

impl Drop for ReplicaSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().expect("replica counts lock");
        if let Some(n) = counts.get_mut(&self.replica) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.replica);
            }
        }
    }
}

/// Room reserved for one offer before it is prepared.
pub struct Admission {
    pending: Slot,
    replica: ReplicaSlot,
}

/// Why an offer was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `sync.max_outgoing_syncs` sessions are offered or served.
    Busy(usize),
    /// This replica already holds `sync.max_sessions_per_replica`.
    ReplicaBusy(usize),
}

/// A data connection that proved an offer's token: served until dropped.
/// The streams of one session share its offer and its admission.
pub struct Session {
    pub offer: Arc<OfferedSession>,
    /// The pieces its streams claimed.
    pub asked: Arc<Asked>,
    /// This connection's number among the session's streams.
    pub stream: u32,
    _serving: Arc<Slot>,
    _replica: Arc<ReplicaSlot>,
}

/// Why a token opened no session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untaken {
    /// Unknown, used up, expired or offered for another transport.
    Unknown,
    /// Its session ran and all its streams ended: a stream the replica
    /// dialled late, or one of a session that is over.
    Over,
}

/// An offer waiting for its data connections.
struct Waiting {
    offer: Arc<OfferedSession>,
    /// Data connections it still accepts.
    streams_left: u32,
    /// The pieces its streams asked for.
    asked: Arc<Asked>,
    /// Its one count as served, from its first connection on, held by
    /// its connections: once they all ended, the session is over and the
    /// connections it did not use are refused.
    serving: Option<Weak<Slot>>,
    replica: Arc<ReplicaSlot>,
}

impl Waiting {
    /// Its streams ran and have all ended.
    fn ended(&self) -> bool {
        self.serving.as_ref().is_some_and(|s| s.strong_count() == 0)
    }

    fn open(&self, now: Instant) -> bool {
        self.offer.expires > now && !self.ended()
    }
}

/// Limits on the sessions a source offers and serves at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// All replicas together (`sync.max_outgoing_syncs`).
    pub total: usize,
    /// One replica: a node id at an address (`sync.max_sessions_per_replica`).
    pub per_replica: usize,
}

impl From<&crate::config::SyncConfig> for Limits {
    fn from(c: &crate::config::SyncConfig) -> Limits {
        Limits {
            total: c.max_outgoing_syncs,
            per_replica: c.max_sessions_per_replica,
        }
    }
}

/// Offered sessions by token, the sessions being prepared and served, and
/// the limits on them, in total and per replica.
pub struct SessionTable {
    offers: Mutex<HashMap<[u8; SESSION_TOKEN_LEN], Waiting>>,
    /// Offers being prepared (admitted, not yet inserted).
    pending: Arc<AtomicUsize>,
    serving: Arc<AtomicUsize>,
    /// Offered, prepared or served sessions per replica.
    per_replica: Arc<Mutex<HashMap<String, usize>>>,
    limits: Mutex<Limits>,
}

impl SessionTable {
    pub fn new(limits: Limits) -> SessionTable {
        SessionTable {
            offers: Mutex::default(),
            pending: Arc::default(),
            serving: Arc::default(),
            per_replica: Arc::default(),
            limits: Mutex::new(limits),
        }
    }

    /// Reserves room for one more session of `replica` (its node id and
    /// address, see [`replica_key`]) before an offer is prepared. The checks
    /// and the reservation are one step, so concurrent offers cannot exceed
    /// the limits. A replica that changes its node id gets more sessions,
    /// but never more than the total.
    pub fn admit(&self, replica: &str) -> Result<Admission, Refusal> {
        let offers = self.offers.lock().expect("sessions lock");
        let limits = *self.limits.lock().expect("limits lock");
        if self.active(&offers) >= limits.total {
            return Err(Refusal::Busy(limits.total));
        }
        let mut counts = self.per_replica.lock().expect("replica counts lock");
        let held = counts.entry(replica.to_string()).or_insert(0);
        if *held >= limits.per_replica {
            return Err(Refusal::ReplicaBusy(limits.per_replica));
        }
        *held += 1;
        Ok(Admission {
            pending: Slot::take(&self.pending),
            replica: ReplicaSlot {
                counts: self.per_replica.clone(),
                replica: replica.to_string(),
            },
        })
    }

    /// Changes the limits (running sessions continue).
    pub fn set_limits(&self, limits: Limits) {
        *self.limits.lock().expect("limits lock") = limits;
    }

    /// Stores `offer` in the room `admitted` reserved and returns its fresh
    /// random token.
    pub fn insert(&self, offer: OfferedSession, admitted: Admission) -> [u8; SESSION_TOKEN_LEN] {
        let mut token = [0u8; SESSION_TOKEN_LEN];
        rand::rng().fill_bytes(&mut token);
        let Admission { pending, replica } = admitted;
        let mut offers = self.offers.lock().expect("sessions lock");
        let streams_left = offer.streams.max(1);
        offers.insert(
            token,
            Waiting {
                offer: Arc::new(offer),
                streams_left,
                asked: Arc::default(),
                serving: None,
                replica: Arc::new(replica),
            },
        );
        drop(pending);
        token
    }

    /// Takes the offer for `token` if it exists, has not expired and was
    /// made for `transport`. A token works for as many connections as the
    /// offer has streams (once, mostly), while the session runs; a misused
    /// one not at all. The session counts as served until its last
    /// connection's value drops.
    pub fn take(&self, token: &[u8], transport: TransportKind) -> Result<Session, Untaken> {
        let token: &[u8; SESSION_TOKEN_LEN] = token
            .get(..SESSION_TOKEN_LEN)
            .and_then(|t| t.try_into().ok())
            .ok_or(Untaken::Unknown)?;
        let mut offers = self.offers.lock().expect("sessions lock");
        let waiting = offers.get_mut(token).ok_or(Untaken::Unknown)?;
        let refused =
            if waiting.offer.expires <= Instant::now() || waiting.offer.transport != transport {
                Some(Untaken::Unknown)
            } else if waiting.ended() {
                Some(Untaken::Over)
            } else {
                None
            };
        if let Some(why) = refused {
            offers.remove(token);
            return Err(why);
        }
        let serving = match waiting.serving.as_ref().and_then(Weak::upgrade) {
            Some(serving) => serving,
            None => {
                let serving = Arc::new(Slot::take(&self.serving));
                waiting.serving = Some(Arc::downgrade(&serving));
                serving
            }
        };
        let offer = &waiting.offer;
        let session = Session {
            offer: offer.clone(),
            asked: waiting.asked.clone(),
            stream: offer.streams.max(1) - waiting.streams_left,
            _serving: serving,
            _replica: waiting.replica.clone(),
        };
        waiting.streams_left -= 1;
        if waiting.streams_left == 0 {
            offers.remove(token);
        }
        Ok(session)
    }

    /// Data connections the source expects from `ip`: the streams left of
    /// the offers made to a replica there, not yet expired.
    pub fn expects(&self, ip: IpAddr) -> usize {
        let now = Instant::now();
        let offers = self.offers.lock().expect("sessions lock");
        offers
            .values()
            .filter(|w| w.offer.replica_ip == Some(ip) && w.open(now))
            .map(|w| w.streams_left as usize)
            .sum()
    }

    /// Drops expired offers and those whose streams all ended (releasing
    /// their cache references).
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut offers = self.offers.lock().expect("sessions lock");
        let before = offers.len();
        offers.retain(|_, w| w.open(now));
        before - offers.len()
    }

    /// Withdraws the unused offer with session id `id` (its replica will
    /// not connect), releasing its cache reference. False when none.
    pub fn withdraw(&self, id: &str) -> bool {
        let mut offers = self.offers.lock().expect("sessions lock");
        let before = offers.len();
        offers.retain(|_, w| w.offer.id != id);
        offers.len() < before
    }

    /// The offered (not yet used) session `id`: its instance and its
    /// piece manifest.
    pub fn offered(&self, id: &str) -> Option<(String, Arc<crate::snapshot::manifest::Manifest>)> {
        let now = Instant::now();
        let offers = self.offers.lock().expect("sessions lock");
        offers
            .values()
            .find(|w| w.offer.id == id && w.open(now))
            .map(|w| (w.offer.instance.clone(), w.offer.entry.manifest.clone()))
    }

    /// Sessions admitted: offered and not yet taken (or being admitted),
    /// or being served; what `sync.max_outgoing_syncs` limits.
    pub fn admitted(&self) -> usize {
        self.active(&self.offers.lock().expect("sessions lock"))
    }

    /// Admitted sessions, given the offers held (one whose first stream
    /// runs counts as served).
    fn active(&self, offers: &HashMap<[u8; SESSION_TOKEN_LEN], Waiting>) -> usize {
        offers.values().filter(|w| w.serving.is_none()).count()
            + self.pending.load(Ordering::SeqCst)
            + self.serving.load(Ordering::SeqCst)
    }

    /// Sessions moving bytes now.
    pub fn serving(&self) -> usize {
        self.serving.load(Ordering::SeqCst)
    }

    /// Drops every offer (shutdown).
    pub fn clear(&self) {
        self.offers.lock().expect("sessions lock").clear();
    }

    /// Drops expired offers every second until `shutdown`.
    pub async fn expire(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => { self.sweep(); }
            }
        }
    }
}

/// The key a replica's sessions of one of this agent's instances are
/// counted under: its node id at its address, and the instance (a replica
/// agent serving many instances pulls each of them).
pub fn replica_key(node_id: &str, addr: Option<IpAddr>, instance: &str) -> String {
    match addr {
        Some(ip) => format!("{node_id}@{ip}/{instance}"),
        None => format!("{node_id}@?/{instance}"),
    }
}

/// Where this agent's data plane listens, and what its RDMA probe found:
/// what offers advertise and status reports.
pub struct DataEndpoints {
    /// The TCP data listener.
    pub tcp: SocketAddr,
    /// Where the RDMA listener is bound, when it started.
    pub rdma: Option<SocketAddr>,
    pub local_rdma: Arc<LocalRdma>,
    /// How the TCP data path is encrypted here (status, logs).
    pub tls: String,
}

impl DataEndpoints {
    /// The RDMA listener's address while it serves (not while its device
    /// is gone).
    pub fn rdma_endpoint(&self) -> Option<SocketAddr> {
        self.rdma.filter(|_| self.local_rdma.available())
    }
}

/// Everything a data connection needs on the source.
#[derive(Clone)]
pub struct DataPlane {
    pub sessions: Arc<SessionTable>,
    pub metrics: Arc<Metrics>,
    /// Bulk parameters of RDMA sessions (soft-device caps applied).
    pub bulk: BulkParams,
    /// Stops every session at shutdown.
    pub shutdown: CancellationToken,
    /// The agent's bandwidth limit for what it sends.
    pub rate: Arc<RateLimiter>,
    /// How long a silent replica may take before its connection fails.
    pub peer_timeout: Duration,
    /// The floor a replica must read at.
    pub min_rate: MinRate,
    /// How long a connection may take to prove its session.
    pub hello_timeout: Duration,
    /// Connections still proving their session, at most.
    pub pending: conn_limit::Limits,
    /// TLS of the TCP data path (`None`: plaintext only).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// `[data] kernel_tls`: records in the kernel where it can.
    pub kernel_tls: bool,
    /// Stream sessions offered, which prove themselves on the same
    /// listener.
    pub streams: Arc<StreamOffers>,
}

/// The one serve loop: takes accepted data connections, of any transport,
/// until shutdown. Each proves its session on the runtime; a proved
/// session runs on its own blocking thread.
pub async fn serve(mut incoming: impl Stream<Item = (Accepted, String)> + Unpin, plane: DataPlane) {
    let shutdown = plane.shutdown.clone();
    let pending = conn_limit::Counter::new(plane.pending);
    // Connections from where an offer's replica asked have places of their
    // own, as many as it has streams left: churn from elsewhere cannot
    // delay them.
    let expected = conn_limit::Counter::new(conn_limit::Limits {
        total: usize::MAX,
        per_peer: usize::MAX,
    });
    loop {
        let (conn, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = incoming.next() => match next {
                Some(c) => c,
                None => break,
            },
        };
        // Over the cap the connection is closed at once (dropped).
        let reserved = conn.peer_ip().map_or(0, |ip| plane.sessions.expects(ip));
        let slot = match expected
            .admit_within(conn.peer_ip(), reserved)
            .or_else(|_| pending.admit(conn.peer_ip()))
        {
            Ok(slot) => slot,
            Err(over) => {
                let reason = match over {
                    conn_limit::Over::Total => "pending_total",
                    conn_limit::Over::PerPeer => "pending_per_peer",
                };
                plane
                    .metrics
                    .data_refused
                    .with_label_values(&[reason])
                    .inc();
                debug!(%peer, reason, "data connection closed: too many proving a session");
                continue;
            }
        };
        tokio::spawn(prove_and_serve(conn, peer, slot, plane.clone()));
    }
}

/// The refusal a replica sees for a bad session proof.
const BAD_TOKEN: &str = "unknown, used or expired session token";
const SESSION_OVER: &str = "the session's other streams have all ended";

/// Reads the connection's session proof (within `hello_timeout`) and takes
/// its offer; refuses (and counts) a connection that cannot prove one, and
/// hands a proved one to a blocking thread.
async fn prove_and_serve(conn: Accepted, peer: String, slot: conn_limit::Slot, plane: DataPlane) {
    let kind = conn.kind();
    let refused =
        |reason: &str, why: &dyn std::fmt::Display| count_refusal(&plane, &peer, kind, reason, why);
    let proved =
        match tokio::time::timeout(plane.hello_timeout, conn.prove(plane.tls.as_ref())).await {
            Err(_) => {
                let limit = plane.hello_timeout;
                return refused(
                    "hello_timeout",
                    &format!("no session proof within {limit:?}"),
                );
            }
            Ok(Err(e)) => return refused("bad_hello", &e),
            Ok(Ok(proved)) => proved,
        };
    if let Some((session, serving)) = plane.streams.take(proved.proof(), &plane.shutdown) {
        return serve_stream(proved, kind, session, serving, peer, slot, plane).await;
    }
    let session = match plane.sessions.take(proved.proof(), kind) {
        Ok(session) => session,
        Err(Untaken::Over) => {
            plane
                .metrics
                .data_refused
                .with_label_values(&["session_over"])
                .inc();
            info!(%peer, "data connection refused: {SESSION_OVER}");
            let _ = tokio::time::timeout(plane.hello_timeout, proved.refuse(SESSION_OVER)).await;
            return;
        }
        Err(Untaken::Unknown) => {
            refused("bad_token", &BAD_TOKEN);
            let _ = tokio::time::timeout(plane.hello_timeout, proved.refuse(BAD_TOKEN)).await;
            return;
        }
    };
    // A session offered under TLS is served only under TLS (and the other
    // way round): the offer said which.
    if session.offer.tls != proved.encrypted() {
        let why = if session.offer.tls {
            "this session was offered with TLS; open the data connection with TLS"
        } else {
            "this session was offered without TLS"
        };
        refused("bad_hello", &why);
        let _ = tokio::time::timeout(plane.hello_timeout, proved.refuse(why)).await;
        return;
    }
    drop(slot);
    tokio::task::spawn_blocking(move || serve_proved(proved, session, &peer, &plane));
}

/// Counts a data connection refused for `reason` and says `why`.
fn count_refusal(
    plane: &DataPlane,
    peer: &str,
    kind: TransportKind,
    reason: &str,
    why: &dyn std::fmt::Display,
) {
    plane
        .metrics
        .data_refused
        .with_label_values(&[reason])
        .inc();
    plane.metrics.data_auth_failures.inc();
    warn!(%peer, transport = %kind, "data connection refused: {why}");
}

/// Serves a connection that proved a stream session: on the transport and
/// TLS settings the session was offered with, and on no other; a ring on
/// a blocking thread, TCP on the runtime (a long, mostly idle session).
async fn serve_stream(
    proved: Proved,
    kind: TransportKind,
    session: StreamSession,
    serving: Serving,
    peer: String,
    slot: conn_limit::Slot,
    plane: DataPlane,
) {
    // The session runs on the transport and TLS settings it was
    // offered with, and on no other.
    if session.tls != proved.encrypted() || session.rdma != (kind == TransportKind::Rdma) {
        count_refusal(
            &plane,
            &peer,
            kind,
            "bad_hello",
            &"this stream session was offered with other transport or TLS settings than the connection uses",
        );
        let _ = tokio::time::timeout(
            plane.hello_timeout,
            proved.refuse("open the data connection as the offer said (rdma_endpoint, data_tls)"),
        )
        .await;
        return;
    }
    drop(slot);
    if session.rdma {
        let ring = crate::stream::serve::RingPlane {
            metrics: plane.metrics.clone(),
            silent: crate::stream::pull::UPSTREAM_TIMEOUT,
            runtime: tokio::runtime::Handle::current(),
        };
        tokio::task::spawn_blocking(move || {
            match proved.open(plane.peer_timeout, plane.min_rate, false) {
                Ok(link) => crate::stream::serve::serve_ring(link, session, serving, peer, ring),
                Err(e) => warn!(%peer, "stream connection failed to open: {e}"),
            }
        });
        return;
    }
    match proved.into_stream(plane.peer_timeout) {
        Ok(Ok(link)) => {
            crate::stream::serve::serve(link, session, serving, peer, plane.metrics.clone()).await
        }
        Ok(Err(e)) => warn!(%peer, "stream connection failed to open: {e}"),
        Err(_) => warn!(%peer, "stream connection refused: stream sessions run over TCP"),
    }
}

/// On a blocking thread: sets the proved connection up (socket, emulated
/// QP threads, verbs resources) and serves its session; shutdown stops it.
fn serve_proved(proved: Proved, session: Session, peer: &str, plane: &DataPlane) {
    let kernel_tls = ktls::use_kernel(plane.kernel_tls, session.offer.snapshot.len());
    let link = match proved.open(plane.peer_timeout, plane.min_rate, kernel_tls) {
        Ok(link) => link,
        Err(e) => return warn!(%peer, "data connection failed to open: {e}"),
    };
    // Shutdown stops a TCP session by shutting its socket.
    let stop = link.canceller().map(|c| {
        let shutdown = plane.shutdown.clone();
        tokio::runtime::Handle::current().spawn(async move {
            shutdown.cancelled().await;
            c.cancel();
        })
    });
    serve_session(plane, &session, peer, link);
    if let Some(stop) = stop {
        stop.abort();
    }
}

/// Runs one authenticated session with its logs and metrics.
fn serve_session(plane: &DataPlane, session: &Session, peer: &str, link: SourceLink) {
    let offer = &session.offer;
    let span =
        info_span!("session", id = %offer.id, instance = %offer.instance, replica = %offer.replica);
    let _enter = span.enter();
    let m = &plane.metrics;
    let transport = offer.transport.as_str();
    let instance = offer.instance.as_str();
    let _running = Running::start(
        m.fullsync_in_progress
            .with_label_values(&[instance, "source"]),
    );
    let started = Instant::now();
    let progress = AtomicU64::new(0);
    info!(%peer, bytes = offer.snapshot.len(), from = if offer.snapshot.image().is_some() { "memory" } else { "file" }, seq = offer.entry.info.seq, tls = link.tls(), "serving snapshot over {transport}");
    let result = link.serve(Serve {
        snapshot: &offer.snapshot,
        seq: offer.entry.info.seq,
        piece_size: offer.entry.manifest.piece_size,
        params: plane.bulk,
        faults: faults::active(),
        rate: &plane.rate,
        progress: &progress,
        cancel: plane.shutdown.clone(),
        reply_wait: plane
            .min_rate
            .piece_wait(plane.peer_timeout, offer.entry.manifest.piece_size),
        asked: &session.asked,
        stream: session.stream,
        queued: offer.streams > 1,
    });
    let sent = progress.load(Ordering::Relaxed);
    m.fullsync_bytes
        .with_label_values(&[instance, "source", transport])
        .inc_by(sent);
    if offer.origin.is_some() {
        m.relay_bytes.with_label_values(&[instance]).inc_by(sent);
    }
    let label = served_label(&result);
    match &result {
        Ok(Ok(_)) => {
            info!(bytes = sent, elapsed = ?started.elapsed(), "session served");
            if let Some(lease) = &offer.backlog {
                lease.served(sent, started.elapsed());
            }
            m.last_success
                .with_label_values(&[instance, "source"])
                .set(unix_now());
        }
        Ok(Err(e)) if label == "checksum_mismatch" => {
            warn!(error = %e, "replica rejected the snapshot")
        }
        Ok(Err(e)) => warn!(error = %e, "session failed"),
        Err(e) if label == "cancelled" => info!(error = %e, "session cancelled"),
        Err(e) => warn!(error = %e, "session failed"),
    }
    m.fullsync_total
        .with_label_values(&[instance, "source", transport, label])
        .inc();
    m.fullsync_duration
        .with_label_values(&[instance, "source", transport])
        .observe(started.elapsed().as_secs_f64());
}

/// The `result` label of a served session.
fn served_label(result: &SessionResult) -> &'static str {
    match result {
        Ok(Ok(_)) => "ok",
        Ok(Err(e)) if e.is_checksum_report() => "checksum_mismatch",
        Err(e) if e.is_cancelled() => "cancelled",
        _ => "failed",
    }
}

/// TCP data connections from `listener`, for [`serve`].
pub fn tcp_connections(
    listener: tokio::net::TcpListener,
    emulated: bool,
) -> impl Stream<Item = (Accepted, String)> + Unpin {
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |accepted| {
        std::future::ready(match accepted {
            Ok(s) => {
                let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
                let conn = if emulated {
                    Accepted::Emulated(s)
                } else {
                    Accepted::Tcp(s)
                };
                Some((conn, peer))
            }
            Err(e) => {
                warn!(error = %e, "data listener accept failed");
                None
            }
        })
    })
}

/// rdma_cm connection requests from `listener`, accepted on a blocking
/// thread until `shutdown`, for [`serve`]. When rdma_cm reports that the
/// device was removed, the listener goes at once (the kernel cannot finish
/// removing the device before), `local` says RDMA is lost, and the thread
/// tries each second to listen on the same address again: once a device
/// serves it, RDMA is back.
#[cfg(feature = "rdma")]
pub fn verbs_connections(
    listener: crate::transport::verbs::VerbsListener,
    local: Arc<LocalRdma>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<impl Stream<Item = (Accepted, String)> + Unpin> {
    use crate::transport::fabric::FabricError;
    use crate::transport::verbs::{self, VerbsListener};
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let addr = listener.local_addr();
    let soft = local.probe().soft;
    std::thread::Builder::new()
        .name("kvsync-rdma-listen".into())
        .spawn(move || {
            let mut listener = Some(listener);
            while !shutdown.is_cancelled() {
                let Some(l) = &listener else {
                    std::thread::sleep(Duration::from_secs(1));
                    verbs::release_removed_devices();
                    if let Ok(l) = VerbsListener::bind(addr) {
                        info!(%addr, "an rdma device serves the listener's address again: rdma is back");
                        listener = Some(l);
                        local.set_lost(None);
                        metrics.rdma_available.set(1);
                    }
                    continue;
                };
                // Wake up now and then to notice shutdown.
                match l.accept(Duration::from_millis(250), soft) {
                    Ok(Some(qp)) => {
                        if tx
                            .blocking_send((Accepted::Verbs(Box::new(qp)), "rdma_cm".into()))
                            .is_err()
                        {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(FabricError::DeviceRemoved) => {
                        let why = format!("no RDMA: the rdma device under {addr} was removed; this agent uses tcp until a device serves that address again");
                        warn!("{why}");
                        listener = None;
                        verbs::release_removed_devices();
                        local.set_lost(Some(why));
                        metrics.rdma_available.set(0);
                    }
                    Err(e) => warn!(error = %e, "rdma listener"),
                }
            }
        })?;
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_counts_in_total_and_per_replica_and_releases_on_drop() {
        let table = SessionTable::new(Limits {
            total: 3,
            per_replica: 2,
        });
        let ip = |last: u8| Some(IpAddr::from([10, 0, 0, last]));
        let (a, b, c) = (
            &replica_key("r1", ip(1), "default"),
            &replica_key("r2", ip(2), "default"),
            &replica_key("r1", ip(3), "default"),
        );
        let a1 = table.admit(a).unwrap();
        let _a2 = table.admit(a).unwrap();
        assert_eq!(table.admit(a).err(), Some(Refusal::ReplicaBusy(2)));
        let _b1 = table.admit(b).unwrap();
        assert_eq!(table.admit(c).err(), Some(Refusal::Busy(3)));
        drop(a1);
        assert!(table.admit(a).is_ok(), "a released slot is free again");
        table.set_limits(Limits {
            total: 4,
            per_replica: 2,
        });
        assert!(table.admit(c).is_ok());
    }
}
