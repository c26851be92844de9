//! The replica job's decisions, as plain code: which transport an attempt
//! asks for and whether it may fall back, whether an offer is one this
//! agent takes, and what follows a failed attempt (pull from the next
//! upstream source, retry after a backoff, fall back to TCP, or give up).
//! Domain values in, decisions out: no gRPC types, no I/O, no clock, so
//! every rule is unit-tested here; `job` asks, then acts.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::Blk3Error;
use crate::config::{DataTls, SyncConfig, TransportMode};
use crate::snapshot::{Format, SnapshotId};
use crate::store::room::Room;
use crate::transport::rdma::RdmaError;
use crate::transport::session::LinkError;
use crate::transport::tcp::TcpError;
use crate::transport::TransportKind;

use super::error::JobError;

/// A source's offer of a session, in domain terms (its shape already
/// checked where it was read off the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub session_id: String,
    pub token: [u8; SESSION_TOKEN_LEN],
    pub transport: TransportKind,
    /// The data listener for `transport`.
    pub endpoint: SocketAddr,
    /// The format's name as offered.
    pub format: String,
    /// Its digest is always there: an offer without one is refused.
    pub snapshot: SnapshotId,
    /// The source agent's node id (a plain name).
    pub source_node: String,
    /// The agent whose snapshot it is, when the source relays it.
    pub origin_node: Option<String>,
    /// The file name the source gives it (not trusted for the install).
    pub name: String,
    pub piece_size: u64,
    /// TCP under TLS.
    pub data_tls: bool,
    /// TCP streams granted.
    pub tcp_streams: u32,
    pub rdma_device: String,
    /// Redis: bytes the primary can still write before M+1 leaves its backlog.
    pub backlog_bytes_left: u64,
    /// The source's instance it is of (empty from a source that predates
    /// instances).
    pub instance: String,
}

impl Offer {
    /// The node id of the agent whose snapshot this is: the relay's origin,
    /// or the source itself. Partial syncs resume by it.
    pub fn origin(&self) -> &str {
        self.origin_node.as_deref().unwrap_or(&self.source_node)
    }
}

/// Which transport an attempt asks for, and whether it may fall back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportPlan {
    pub mode: TransportMode,
    pub may_fall_back: bool,
    /// RDMA is asked for.
    pub want_rdma: bool,
    /// RDMA was wanted but this agent has none: the attempt starts fallen
    /// back (counted as reason `unavailable`).
    pub fell_back: bool,
}

impl TransportPlan {
    /// The plan for a request asking `asked` (`None`: no preference, the
    /// configured `mode`), with `fallback_to_tcp` and this agent's RDMA
    /// `available` or not. `Err` when RDMA is required and missing.
    pub fn new(
        asked: Option<TransportMode>,
        mode: TransportMode,
        fallback_to_tcp: bool,
        available: bool,
    ) -> Result<TransportPlan, NoRdma> {
        let mode = asked.unwrap_or(mode);
        let may_fall_back = mode == TransportMode::Auto || fallback_to_tcp;
        let missing = mode == TransportMode::Rdma && !available;
        if missing && !may_fall_back {
            return Err(NoRdma);
        }
        Ok(TransportPlan {
            mode,
            may_fall_back,
            want_rdma: mode != TransportMode::Tcp && available,
            fell_back: missing,
        })
    }

    /// Only a sync that cannot fall back insists on RDMA with the source.
    pub fn insist(&self) -> bool {
        self.mode == TransportMode::Rdma && !self.may_fall_back
    }

    /// A TCP offer to an attempt that asked for RDMA: was RDMA required
    /// (a fallback, counted), or only preferred?
    pub fn tcp_offer_is_fallback(&self) -> bool {
        self.want_rdma && self.mode == TransportMode::Rdma
    }

    /// After an RDMA session failed with `err`: the fallback reason when
    /// the attempt goes on over TCP, `None` when it ends with `err`.
    pub fn fall_back_after(&self, err: &JobError) -> Option<&'static str> {
        fallback_reason(err).filter(|_| self.may_fall_back)
    }
}

/// RDMA is required and this agent has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRdma;

/// What a replica asked the source for, to check the offer against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    pub format: Format,
    /// Exactly this snapshot (`None`: the source's latest).
    pub snapshot: Option<SnapshotId>,
    /// RDMA was among the transports asked for.
    pub rdma: bool,
    /// The source's instance asked for (empty: its only one).
    pub instance: String,
}

/// The offer answers the request: the format, the snapshot and a
/// transport that were asked for.
pub fn answers(offer: &Offer, asked: &Asked) -> Result<(), JobError> {
    let bad = |why: String| Err(JobError::BadOffer(why));
    if offer.format != asked.format.as_str() {
        return bad(format!(
            "format {} but this agent installs {}",
            offer.format, asked.format
        ));
    }
    if let Some(want) = asked.snapshot {
        let got = offer.snapshot;
        if !want.matches(&got) {
            return bad(format!("it offers {got}, not the requested {want}"));
        }
    }
    if offer.transport == TransportKind::Rdma && !asked.rdma {
        return bad("transport rdma is not available here".into());
    }
    if !asked.instance.is_empty() && !offer.instance.is_empty() && offer.instance != asked.instance
    {
        return bad(format!(
            "it is of instance {:?}, not the requested {:?}",
            offer.instance, asked.instance
        ));
    }
    Ok(())
}

/// This agent's limits on what it takes.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    pub data_tls: DataTls,
    pub max_snapshot_bytes: u64,
    pub min_free_after: u64,
    pub dir: &'a Path,
}

/// Checks an offer from the source at `source_addr` against this agent's
/// limits, before anything is reserved: TLS when required, the allowed
/// sources, `sync.max_snapshot_bytes`, and the headroom
/// `sync.min_free_after` keeps of the `free` bytes on the directory.
pub fn within_limits(
    limits: &Limits,
    source_addr: &str,
    offer: &Offer,
    free: u64,
) -> Result<(), JobError> {
    if limits.data_tls == DataTls::Required
        && offer.transport == TransportKind::Tcp
        && !offer.data_tls
    {
        return Err(JobError::BadOffer(format!(
            "source {source_addr} offered the data plane without TLS and this replica requires it ([data] tls = \"required\"); give the source a [tls] configuration"
        )));
    }
    let room = Room {
        max_snapshot_bytes: limits.max_snapshot_bytes,
        min_free_after: limits.min_free_after,
        dir: limits.dir,
    };
    Ok(room.fits(offer.snapshot.size, free)?)
}

/// RDMA pins the receive memory: an RDMA offer larger than the memory
/// budget is refused with this reason (`None`: it may be taken).
pub fn too_large_to_pin(offer: &Offer, budget: u64) -> Option<String> {
    let size = offer.snapshot.size;
    (offer.transport == TransportKind::Rdma && size > budget).then(|| {
        format!(
            "the {size}-byte snapshot is larger than cache.memory_budget ({budget}), the most this agent pins for rdma"
        )
    })
}

/// Where a job stands in its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Attempts {
    /// Attempts made, the failed one included.
    pub made: u32,
    /// Of them, failed verification.
    pub checksum_failures: u32,
}

/// What follows a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Pull from the next upstream source at once (resuming what was
    /// verified): the source was to blame.
    NextSource,
    /// Try the same source again after this backoff.
    Retry(Duration),
    /// The failure is the job's end.
    GiveUp,
}

/// The decision after an attempt failed with `err`: another source when
/// the source is to blame and an upstream is left; else another attempt
/// when the failure may pass, a second checksum failure has not happened,
/// and `sync.retries` allows; else the end. `jitter` in `0.75..1.25`
/// spreads the backoff.
pub fn after_failure(
    err: &JobError,
    attempts: Attempts,
    upstream_left: bool,
    sync: &SyncConfig,
    jitter: f64,
) -> Next {
    // A source this agent will not dial (its own policy) is passed over
    // too: the next may be one it will.
    let passed_over = blames_source(err) || matches!(err, JobError::WillNotDial(_));
    if passed_over && upstream_left {
        return Next::NextSource;
    }
    let retry =
        is_transient(err) && attempts.checksum_failures < 2 && attempts.made <= sync.retries;
    if !retry {
        return Next::GiveUp;
    }
    Next::Retry(backoff(
        sync.retry_backoff,
        sync.retry_backoff_max,
        attempts.made,
        jitter,
    ))
}

/// `base × 2^(attempt-1)`, capped at `max`, times `jitter`.
pub fn backoff(base: Duration, max: Duration, attempt: u32, jitter: f64) -> Duration {
    let exp = base
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(16))
        .min(max);
    exp.mul_f64(jitter)
}

/// Worth another attempt: the source or network may recover. Checksum
/// mismatches count too (the job gives up on the second).
pub fn is_transient(err: &JobError) -> bool {
    match err {
        JobError::Unreachable { .. } | JobError::DataConnect { .. } | JobError::Checksum(_) => true,
        JobError::Transport(e) => match e {
            LinkError::Tcp(e) => !matches!(e, TcpError::Cancelled),
            LinkError::Rdma(e) => matches!(e, RdmaError::Fabric(_) | RdmaError::Completion { .. }),
        },
        JobError::Protocol(e) => !matches!(
            e,
            Blk3Error::MrinfoLength { .. } | Blk3Error::AnnouncedLength { .. }
        ),
        JobError::Refused { code, .. } => matches!(
            code,
            tonic::Code::Unavailable
                | tonic::Code::ResourceExhausted
                | tonic::Code::Aborted
                | tonic::Code::NotFound // no snapshot yet
        ),
        _ => false,
    }
}

/// The source (not this agent, and not an operator) is why the attempt
/// failed: another source may do better.
pub fn blames_source(err: &JobError) -> bool {
    match err {
        JobError::Unreachable { .. }
        | JobError::Refused { .. }
        | JobError::BadOffer(_)
        | JobError::DataConnect { .. }
        | JobError::Protocol(_)
        | JobError::Checksum(_) => true,
        JobError::Transport(_) => is_transient(err),
        _ => false,
    }
}

/// Why an RDMA attempt that failed this way is retried over TCP
/// (`kvsync_transport_fallback_total{reason}`), or `None` when the failure
/// is not the transport's (cancel, local disk, handoff).
pub fn fallback_reason(err: &JobError) -> Option<&'static str> {
    Some(match err {
        JobError::Transport(LinkError::Rdma(e)) => e.fallback_reason(),
        JobError::DataConnect { .. } => "connect",
        JobError::Checksum(_) => "checksum",
        JobError::Protocol(Blk3Error::Timeout { .. }) => "timeout",
        JobError::Protocol(Blk3Error::PeerFailed(_)) => "peer_failed",
        JobError::Protocol(_) => "protocol",
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
