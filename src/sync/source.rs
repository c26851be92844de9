//! The source role: session offers and the TCP data listener.
//!
//! Owns the table of offered sessions (one-time token → the snapshot held in
//! the cache for it, with an expiry), the acceptance of data connections
//! (the first frame must prove an offered, unexpired, unused token, or the
//! connection is refused before any snapshot byte moves and counted), and the
//! source-side metrics of each served session. An offer holds its cache
//! reference from the moment it is made, so a snapshot deleted or replaced
//! after the offer is still delivered exactly as offered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::RngCore;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn};

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::cache::CacheRef;
use crate::catalog::CatalogEntry;
use crate::metrics::{unix_now, Metrics};
use crate::transport::tcp::{self, Link};
use crate::transport::{Faults, TransportKind};

/// A session offered to a replica, waiting for its data connection.
pub struct Offer {
    pub id: String,
    pub replica: String,
    pub entry: Arc<CatalogEntry>,
    pub snapshot: CacheRef,
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

    /// Takes the offer for `token` if it exists and has not expired. A token
    /// works once.
    pub fn take(&self, token: &[u8; SESSION_TOKEN_LEN]) -> Option<Offer> {
        let offer = self.offers.lock().expect("sessions lock").remove(token)?;
        (offer.expires > Instant::now()).then_some(offer)
    }

    /// Drops expired offers (releasing their cache references).
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut offers = self.offers.lock().expect("sessions lock");
        let before = offers.len();
        offers.retain(|_, o| o.expires > now);
        before - offers.len()
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
        let link = match stream.into_std().and_then(|s| {
            s.set_nonblocking(false)?;
            Link::new(s)
        }) {
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

fn serve_connection(mut link: Link, peer: std::net::SocketAddr, plane: &DataPlane) {
    let token = match tcp::read_hello(&mut link) {
        Ok(t) => t,
        Err(e) => {
            plane.metrics.data_auth_failures.inc();
            warn!(%peer, error = %e, "data connection refused: no session proof");
            return tcp::refuse(&mut link, "the first frame must prove a session");
        }
    };
    let Some(offer) = plane.sessions.take(&token) else {
        plane.metrics.data_auth_failures.inc();
        warn!(%peer, "data connection refused: unknown, used or expired session token");
        return tcp::refuse(&mut link, "unknown, used or expired session token");
    };
    let span = info_span!("session", id = %offer.id, replica = %offer.replica);
    let _enter = span.enter();
    let m = &plane.metrics;
    let transport = TransportKind::Tcp.as_str();
    m.fullsync_in_progress.with_label_values(&["source"]).inc();
    plane.sessions.serving.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let progress = AtomicU64::new(0);
    info!(%peer, bytes = offer.snapshot.len(), seq = offer.entry.info.seq, "serving snapshot over tcp");
    let result = tcp::run_source(
        &mut link,
        &offer.snapshot,
        offer.entry.info.seq,
        &plane.faults,
        &progress,
    );
    let sent = progress.load(Ordering::Relaxed);
    m.fullsync_bytes
        .with_label_values(&["source", transport])
        .inc_by(sent);
    let label = match &result {
        Ok(Ok(_)) => {
            info!(bytes = sent, elapsed = ?started.elapsed(), "session served");
            m.last_success
                .with_label_values(&["source"])
                .set(unix_now());
            "ok"
        }
        Ok(Err(e)) if e.is_checksum_report() => {
            warn!(error = %e, "replica rejected the snapshot");
            "checksum_mismatch"
        }
        Ok(Err(e)) => {
            warn!(error = %e, "session failed");
            "failed"
        }
        Err(tcp::TcpError::Cancelled) => "cancelled",
        Err(e) => {
            warn!(error = %e, "session failed");
            "failed"
        }
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
