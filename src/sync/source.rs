//! The source role: session offers and the data listeners (TCP, and RDMA
//! over verbs or the emulated fabric).
//!
//! Owns the table of offered sessions (one-time token → the snapshot held in
//! the cache for it, the transport it was offered on, an expiry), the
//! acceptance of data connections (the first TCP frame, or the RDMA connect
//! private data, must prove an offered, unexpired, unused token for that
//! transport, or the connection is refused before any snapshot byte moves
//! and counted), and the source-side metrics of each served session. An
//! offer holds its cache reference from the moment it is made, so a
//! snapshot deleted or replaced after the offer is still delivered exactly
//! as offered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::RngCore;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn};

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::{Blk3Error, BulkParams, Outcome};
use crate::cache::CacheRef;
use crate::catalog::CatalogEntry;
use crate::metrics::{unix_now, Metrics};
use crate::transport::fabric::Fabric;
use crate::transport::ratelimit::RateLimiter;
use crate::transport::tcp::{self, Link, TcpError};
use crate::transport::{rdma, Faults, TransportKind};

/// A session offered to a replica, waiting for its data connection.
pub struct Offer {
    pub id: String,
    pub replica: String,
    pub entry: Arc<CatalogEntry>,
    pub snapshot: CacheRef,
    /// The transport the token is valid on.
    pub transport: TransportKind,
    pub expires: Instant,
}

/// Offered sessions by token, plus a count of sessions being served.
#[derive(Default)]
pub struct SessionTable {
    offers: Mutex<HashMap<[u8; SESSION_TOKEN_LEN], Offer>>,
    serving: AtomicUsize,
}

impl SessionTable {
    /// Stores `offer` and returns its fresh random token.
    pub fn insert(&self, offer: Offer) -> [u8; SESSION_TOKEN_LEN] {
        let mut token = [0u8; SESSION_TOKEN_LEN];
        rand::rng().fill_bytes(&mut token);
        self.offers
            .lock()
            .expect("sessions lock")
            .insert(token, offer);
        token
    }

    /// Takes the offer for `token` if it exists, has not expired and was
    /// made for `transport`. A token works once.
    pub fn take(&self, token: &[u8], transport: TransportKind) -> Option<Offer> {
        let token: &[u8; SESSION_TOKEN_LEN] = token.get(..SESSION_TOKEN_LEN)?.try_into().ok()?;
        let offer = self.offers.lock().expect("sessions lock").remove(token)?;
        (offer.expires > Instant::now() && offer.transport == transport).then_some(offer)
    }

    /// Drops expired offers (releasing their cache references).
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut offers = self.offers.lock().expect("sessions lock");
        let before = offers.len();
        offers.retain(|_, o| o.expires > now);
        before - offers.len()
    }

    /// Sessions offered and not yet connected, plus those being served.
    pub fn active(&self) -> usize {
        self.offers.lock().expect("sessions lock").len() + self.serving()
    }

    /// Sessions moving bytes now.
    pub fn serving(&self) -> usize {
        self.serving.load(Ordering::Relaxed)
    }

    /// Drops every offer (shutdown).
    pub fn clear(&self) {
        self.offers.lock().expect("sessions lock").clear();
    }
}

/// Everything a data connection needs on the source.
#[derive(Clone)]
pub struct DataPlane {
    pub sessions: Arc<SessionTable>,
    pub metrics: Arc<Metrics>,
    pub faults: Faults,
    /// Bulk parameters of RDMA sessions (soft-device caps applied).
    pub bulk: BulkParams,
    /// Stops RDMA sessions at shutdown.
    pub shutdown: CancellationToken,
    /// The agent's bandwidth limit for what it sends.
    pub rate: Arc<RateLimiter>,
    /// How long a silent replica may take before its connection fails.
    pub peer_timeout: Duration,
}

/// Accepts data connections until `shutdown`; each runs on its own thread.
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    plane: DataPlane,
    shutdown: CancellationToken,
) {
    let expiry = tokio::spawn({
        let (sessions, stop) = (plane.sessions.clone(), shutdown.clone());
        async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => { sessions.sweep(); }
                }
            }
        }
    });
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %e, "data listener accept failed");
                continue;
            }
        };
        let link = match crate::transport::blocking_data_socket(stream, plane.peer_timeout)
            .and_then(Link::new)
        {
            Ok(l) => l,
            Err(e) => {
                warn!(%peer, error = %e, "data connection unusable");
                continue;
            }
        };
        // Shutdown cancels the session's socket, which unblocks its thread.
        let cancel = link.cancel_handle();
        let plane = plane.clone();
        let job = tokio::task::spawn_blocking(move || serve_connection(link, peer, &plane));
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => cancel.cancel(),
                _ = job => {}
            }
        });
    }
    expiry.abort();
}

/// The refusal a replica sees for a bad session proof.
const BAD_TOKEN: &str = "unknown, used or expired session token";

fn serve_connection(mut link: Link, peer: std::net::SocketAddr, plane: &DataPlane) {
    let token = match tcp::read_hello(&mut link) {
        Ok(t) => t,
        Err(e) => {
            plane.metrics.data_auth_failures.inc();
            warn!(%peer, error = %e, "data connection refused: no session proof");
            return tcp::refuse(&mut link, "the first frame must prove a session");
        }
    };
    let Some(offer) = plane.sessions.take(&token, TransportKind::Tcp) else {
        plane.metrics.data_auth_failures.inc();
        warn!(%peer, "data connection refused: {BAD_TOKEN}");
        return tcp::refuse(&mut link, BAD_TOKEN);
    };
    serve(
        plane,
        &offer,
        &peer.to_string(),
        |progress| match tcp::run_source(
            &mut link,
            &offer.snapshot,
            offer.entry.info.seq,
            &plane.faults,
            &plane.rate,
            progress,
        ) {
            Ok(r) => Served::from(r),
            Err(TcpError::Cancelled) => Served::Cancelled,
            Err(e) => Served::Failed(e.to_string()),
        },
    );
}

/// Serves one RDMA connection request: checks the session token in the
/// private data (rejecting the connection otherwise), then runs the session.
pub fn serve_rdma<F: Fabric>(mut qp: F, peer: &str, plane: &DataPlane) {
    let Some(offer) = plane.sessions.take(qp.private_data(), TransportKind::Rdma) else {
        plane.metrics.data_auth_failures.inc();
        warn!(%peer, provider = qp.provider(), "rdma connection rejected: {BAD_TOKEN}");
        return qp.reject(BAD_TOKEN);
    };
    let provider = qp.provider();
    serve(plane, &offer, peer, |progress| {
        let run = rdma::run_source(
            qp,
            rdma::SourceSession {
                snapshot: &offer.snapshot,
                seq: offer.entry.info.seq,
                params: plane.bulk,
                faults: &plane.faults.rdma,
                rate: &plane.rate,
                progress,
                cancel: plane.shutdown.clone(),
            },
        );
        let bulk_mb_s = run.stats.bulk_mb_s(offer.snapshot.len() as u64);
        info!(
            writes = run.stats.posted,
            signaled = run.stats.signaled,
            bulk_mb_s,
            provider,
            "rdma bulk done"
        );
        match run.result {
            Ok(r) => Served::from(r),
            Err(rdma::RdmaError::Cancelled) => Served::Cancelled,
            Err(e) => Served::Failed(e.to_string()),
        }
    });
}

/// How a served session ended.
enum Served {
    Ok,
    Rejected(Blk3Error),
    Failed(String),
    Cancelled,
}

impl From<Result<Outcome, Blk3Error>> for Served {
    fn from(r: Result<Outcome, Blk3Error>) -> Served {
        match r {
            Ok(_) => Served::Ok,
            Err(e) if e.is_checksum_report() => Served::Rejected(e),
            Err(e) => Served::Failed(e.to_string()),
        }
    }
}

/// Runs one authenticated session with its logs and metrics.
fn serve(plane: &DataPlane, offer: &Offer, peer: &str, run: impl FnOnce(&AtomicU64) -> Served) {
    let span = info_span!("session", id = %offer.id, replica = %offer.replica);
    let _enter = span.enter();
    let m = &plane.metrics;
    let transport = offer.transport.as_str();
    m.fullsync_in_progress.with_label_values(&["source"]).inc();
    plane.sessions.serving.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let progress = AtomicU64::new(0);
    info!(%peer, bytes = offer.snapshot.len(), seq = offer.entry.info.seq, "serving snapshot over {transport}");
    let served = run(&progress);
    let sent = progress.load(Ordering::Relaxed);
    m.fullsync_bytes
        .with_label_values(&["source", transport])
        .inc_by(sent);
    let label = match served {
        Served::Ok => {
            info!(bytes = sent, elapsed = ?started.elapsed(), "session served");
            m.last_success
                .with_label_values(&["source"])
                .set(unix_now());
            "ok"
        }
        Served::Rejected(e) => {
            warn!(error = %e, "replica rejected the snapshot");
            "checksum_mismatch"
        }
        Served::Failed(e) => {
            warn!(error = %e, "session failed");
            "failed"
        }
        Served::Cancelled => "cancelled",
    };
    m.fullsync_total
        .with_label_values(&["source", transport, label])
        .inc();
    m.fullsync_duration
        .with_label_values(&["source", transport])
        .observe(started.elapsed().as_secs_f64());
    m.fullsync_in_progress.with_label_values(&["source"]).dec();
    plane.sessions.serving.fetch_sub(1, Ordering::Relaxed);
}

/// Accepts emulated-fabric connections until `shutdown`; each session runs
/// on its own blocking thread.
pub async fn serve_emulated(
    listener: tokio::net::TcpListener,
    plane: DataPlane,
    shutdown: CancellationToken,
) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "emulated rdma listener accept failed");
                    continue;
                }
            },
        };
        let plane = plane.clone();
        tokio::task::spawn_blocking(move || {
            let qp = crate::transport::blocking_data_socket(stream, plane.peer_timeout)
                .map_err(|e| e.to_string())
                .and_then(|s| {
                    crate::transport::emulated::EmuQp::incoming(
                        s,
                        tcp::HELLO_TIMEOUT,
                        plane.faults.emu.clone(),
                    )
                    .map_err(|e| e.to_string())
                });
            match qp {
                Ok(qp) => serve_rdma(qp, &peer.to_string(), &plane),
                Err(e) => {
                    plane.metrics.data_auth_failures.inc();
                    warn!(%peer, error = %e, "emulated rdma connection refused");
                }
            }
        });
    }
}

/// Accepts rdma_cm connection requests on a blocking thread until
/// `shutdown`; each session runs on its own thread.
#[cfg(feature = "rdma")]
pub fn serve_verbs(listener: crate::transport::verbs::VerbsListener, soft: bool, plane: DataPlane) {
    let shutdown = plane.shutdown.clone();
    while !shutdown.is_cancelled() {
        // Wake up now and then to notice shutdown.
        match listener.accept(Duration::from_millis(250), soft) {
            Ok(Some(qp)) => {
                let plane = plane.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvsync-rdma-session".into())
                    .spawn(move || serve_rdma(qp, "rdma_cm", &plane));
                if let Err(e) = spawned {
                    warn!(error = %e, "cannot start an rdma session thread");
                }
            }
            Ok(None) => {}
            Err(e) => warn!(error = %e, "rdma listener"),
        }
    }
}
