//! Why a replica's sync failed: [`JobError`], its `result` label, whether
//! another attempt may help, and why an RDMA attempt falls back to TCP.

use std::path::PathBuf;

use crate::blk3::Blk3Error;
use crate::kv::handoff::HandoffError;
use crate::store::install::InstallError;
use crate::transport::rdma::RdmaError;
use crate::transport::session::LinkError;
use crate::transport::tcp::TcpError;

/// Why a sync failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The destination directory cannot receive.
    #[error(transparent)]
    NotWritable(InstallError),
    /// The source agent could not be reached.
    #[error("source {source_addr} unreachable: {message}")]
    Unreachable {
        source_addr: String,
        message: String,
    },
    /// The source refused to offer a session.
    #[error("source refused the sync ({code:?}): {message}")]
    Refused { code: tonic::Code, message: String },
    /// The offer cannot be used by this agent.
    #[error("unusable offer from the source: {0}")]
    BadOffer(String),
    /// The data endpoint could not be reached.
    #[error("cannot connect to data endpoint {endpoint}: {message}")]
    DataConnect { endpoint: String, message: String },
    /// The data connection failed below the protocol.
    #[error(transparent)]
    Transport(#[from] LinkError),
    /// The transfer thread panicked (a bug); nothing was installed.
    #[error("internal error in the transfer: {0}")]
    Panicked(String),
    /// The offered snapshot is larger than this agent accepts.
    #[error("the source offers a {size}-byte snapshot, more than sync.max_snapshot_bytes ({max}); raise it to accept this snapshot")]
    TooLarge { size: u64, max: u64 },
    /// The snapshot directory's file system cannot take the snapshot and
    /// keep its headroom.
    #[error("not enough free space in {}: the snapshot needs {size} bytes, {free} are free and sync.min_free_after keeps {keep} free; free space or lower sync.min_free_after", dir.display())]
    NoRoom {
        dir: PathBuf,
        size: u64,
        free: u64,
        keep: u64,
    },
    /// RDMA was required but cannot be used, and fallback is off.
    #[error("rdma required but unavailable: {0} (set transport.fallback_to_tcp = true or use mode auto)")]
    RdmaUnavailable(String),
    /// BLK3 ended the session.
    #[error("{0}")]
    Protocol(Blk3Error),
    /// The received bytes are not the snapshot (RDFL sent, nothing installed).
    #[error("received snapshot failed verification: {0}")]
    Checksum(String),
    /// Verified, but the disk refused it.
    #[error("install failed: {0}")]
    Install(#[from] InstallError),
    /// Installed, but the KV did not take it.
    #[error("snapshot installed at {} but the handoff failed: {source}", installed.display())]
    Handoff {
        installed: PathBuf,
        source: HandoffError,
    },
    /// Cancelled by an operator or shutdown.
    #[error("cancelled")]
    Cancelled,
}

impl JobError {
    /// The `result` label of `kvsync_fullsync_total`.
    pub fn result_label(&self) -> &'static str {
        match self {
            JobError::Checksum(_) => "checksum_mismatch",
            JobError::Cancelled => "cancelled",
            _ => "failed",
        }
    }

    /// Worth another attempt: the source or network may recover. Checksum
    /// mismatches count too (the caller gives up on the second).
    pub(super) fn is_transient(&self) -> bool {
        match self {
            JobError::Unreachable { .. } | JobError::DataConnect { .. } | JobError::Checksum(_) => {
                true
            }
            JobError::Transport(e) => match e {
                LinkError::Tcp(e) => !matches!(e, TcpError::Cancelled),
                LinkError::Rdma(e) => {
                    matches!(e, RdmaError::Fabric(_) | RdmaError::Completion { .. })
                }
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
    pub(super) fn blames_source(&self) -> bool {
        match self {
            JobError::Unreachable { .. }
            | JobError::Refused { .. }
            | JobError::BadOffer(_)
            | JobError::DataConnect { .. }
            | JobError::Protocol(_)
            | JobError::Checksum(_) => true,
            JobError::Transport(_) => self.is_transient(),
            _ => false,
        }
    }

    /// Why an RDMA attempt that failed this way is retried over TCP
    /// (`kvsync_transport_fallback_total{reason}`), or `None` when the
    /// failure is not the transport's (cancel, local disk, handoff).
    pub(super) fn fallback_reason(&self) -> Option<&'static str> {
        Some(match self {
            JobError::Transport(LinkError::Rdma(e)) => e.fallback_reason(),
            JobError::DataConnect { .. } => "connect",
            JobError::Checksum(_) => "checksum",
            JobError::Protocol(Blk3Error::Timeout { .. }) => "timeout",
            JobError::Protocol(Blk3Error::PeerFailed(_)) => "peer_failed",
            JobError::Protocol(_) => "protocol",
            _ => return None,
        })
    }
}
