//! Why a replica's sync failed: [`JobError`] and its `result` label. What
//! each failure leads to (another attempt, another source, TCP) is
//! `policy`'s.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::blk3::Blk3Error;
use crate::kv::handoff::HandoffError;
use crate::rpc::dial::ConnectError;
use crate::store::install::InstallError;
use crate::store::room::RoomError;
use crate::transport::session::{DialError, LinkError};

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
    /// This agent's own settings refuse to dial the source (its token
    /// policy, the address, TLS): another attempt would refuse again.
    #[error(transparent)]
    WillNotDial(ConnectError),
    /// The source refused to offer a session.
    #[error("source refused the sync ({code:?}): {message}")]
    Refused { code: tonic::Code, message: String },
    /// The offer cannot be used by this agent.
    #[error("unusable offer from the source: {0}")]
    BadOffer(String),
    /// The data endpoint could not be reached.
    #[error("cannot connect to data endpoint {endpoint}: {source}")]
    DataConnect {
        endpoint: SocketAddr,
        source: DialError,
    },
    /// The data connection failed below the protocol.
    #[error(transparent)]
    Transport(#[from] LinkError),
    /// The transfer thread panicked (a bug); nothing was installed.
    #[error("internal error in the transfer: {0}")]
    Panicked(String),
    /// The offered snapshot is larger than this agent accepts, or its
    /// directory cannot take it.
    #[error(transparent)]
    Room(#[from] RoomError),
    /// RDMA was required but cannot be used, and fallback is off.
    #[error("rdma required but unavailable: {0} (set transport.fallback_to_tcp = true or use mode auto)")]
    RdmaUnavailable(String),
    /// BLK3 ended the session.
    #[error("{0}")]
    Protocol(Blk3Error),
    /// The received bytes are not the snapshot (RDFL sent, nothing installed).
    #[error("received snapshot failed verification: {0}")]
    Checksum(String),
    /// This host could not store or install it (disk full, I/O error).
    #[error("install failed: {0}")]
    Install(Arc<InstallError>),
    /// Installed, but the KV did not take it.
    #[error("snapshot installed at {} but the handoff failed: {source}", installed.display())]
    Handoff {
        installed: PathBuf,
        source: HandoffError,
    },
    /// The local server holds data a seeding would replace and nothing
    /// proves it may ([`crate::stream::keep::may_seed`]).
    #[error("refused, nothing was changed: {0}")]
    ServerHeld(String),
    /// The stream log could not start over at the snapshot for its
    /// server's re-seeding.
    #[error("the stream log cannot start over at the snapshot: {0}")]
    StartOver(Arc<crate::stream::log::LogError>),
    /// Cancelled by an operator or shutdown.
    #[error("cancelled")]
    Cancelled,
}

impl From<InstallError> for JobError {
    fn from(e: InstallError) -> JobError {
        JobError::Install(Arc::new(e))
    }
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
}
