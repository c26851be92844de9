//! The control plane: gRPC services (`kvsync.v1`), health and reflection.
//!
//! Owns the generated protobuf code ([`pb`]), the one place where errors
//! become `tonic::Status` ([`ApiError`]), client connections to other
//! agents, and the server that hosts the orchestrator-facing service
//! ([`orchestrator`]) and the agent-to-agent service ([`peer`]).

pub mod auth;
pub mod orchestrator;
pub mod peer;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use auth::{ClientAuth, Tokens};

use crate::cache::CacheError;
use crate::sync::SyncError;

/// Generated protobuf and gRPC code.
pub mod pb {
    tonic::include_proto!("kvsync.v1");

    /// Encoded descriptors, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/kvsync_descriptor.bin"));
}

/// Every error a gRPC call can end with, and its status code.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The source has no valid snapshot to offer (yet) → NOT_FOUND; replicas
    /// retry it with backoff.
    #[error("{0}")]
    NoSnapshot(String),
    /// Another precondition does not hold → FAILED_PRECONDITION.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A request field is bad → INVALID_ARGUMENT.
    #[error("{0}")]
    InvalidArgument(String),
    /// Over a limit; retry later → RESOURCE_EXHAUSTED.
    #[error("{0}")]
    Busy(String),
    /// No such sync → NOT_FOUND.
    #[error("{0}")]
    NotFound(String),
    /// Transient; retry → UNAVAILABLE.
    #[error("{0}")]
    Unavailable(String),
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        let code = match e {
            ApiError::NoSnapshot(_) => Code::NotFound,
            ApiError::FailedPrecondition(_) => Code::FailedPrecondition,
            ApiError::InvalidArgument(_) => Code::InvalidArgument,
            ApiError::Busy(_) => Code::ResourceExhausted,
            ApiError::NotFound(_) => Code::NotFound,
            ApiError::Unavailable(_) => Code::Unavailable,
        };
        Status::new(code, e.to_string())
    }
}

impl From<SyncError> for ApiError {
    fn from(e: SyncError) -> ApiError {
        let msg = e.to_string();
        match e {
            SyncError::InvalidArgument(_) => ApiError::InvalidArgument(msg),
            SyncError::NotFound(_) => ApiError::NotFound(msg),
            SyncError::FailedPrecondition(_) => ApiError::FailedPrecondition(msg),
            SyncError::Busy(_) => ApiError::Busy(msg),
            SyncError::Unavailable(_) => ApiError::Unavailable(msg),
        }
    }
}

impl From<CacheError> for ApiError {
    fn from(e: CacheError) -> ApiError {
        let msg = e.to_string();
        match e {
            CacheError::TooLarge { .. } | CacheError::OverBudget { .. } => ApiError::Busy(msg),
            CacheError::Changed { .. } => ApiError::Unavailable(format!("{msg}; retry")),
            CacheError::Io { .. } | CacheError::Corrupt { .. } | CacheError::Load(_) => {
                ApiError::FailedPrecondition(msg)
            }
        }
    }
}

impl From<SyncError> for Status {
    fn from(e: SyncError) -> Status {
        ApiError::from(e).into()
    }
}

/// A channel to another agent that presents a bearer token on every call.
pub type AgentChannel = InterceptedService<Channel, ClientAuth>;

/// How this process reaches other agents: over TLS or plaintext, and with
/// the bearer token of its (reloadable) token file.
#[derive(Clone)]
pub struct Dialer {
    pub tls: Option<ClientTlsConfig>,
    pub tokens: Arc<Tokens>,
}

impl Dialer {
    /// Opens a channel to an agent's gRPC address (`host:port`).
    pub async fn connect(&self, addr: &str, timeout: Duration) -> Result<AgentChannel, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| format!("bad address {addr:?}: {e}"))?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| format!("TLS settings: {}", error_chain(&e)))?;
        }
        let channel = endpoint.connect().await.map_err(|e| error_chain(&e))?;
        Ok(InterceptedService::new(channel, self.tokens.client()))
    }
}

/// An error and its sources on one line (a transport error's sources carry
/// the useful part: refused, TLS alert, certificate unknown, …).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg = format!("{msg}: {text}");
        }
        src = s.source();
    }
    msg
}

/// Maps a phase to its lowercase name for humans.
pub fn phase_name(phase: i32) -> &'static str {
    match pb::Phase::try_from(phase).unwrap_or(pb::Phase::Unspecified) {
        pb::Phase::Unspecified => "unknown",
        pb::Phase::Negotiating => "negotiating",
        pb::Phase::Connecting => "connecting",
        pb::Phase::Transferring => "transferring",
        pb::Phase::Verifying => "verifying",
        pb::Phase::Installing => "installing",
        pb::Phase::HandingOff => "handing off",
        pb::Phase::Succeeded => "succeeded",
        pb::Phase::Failed => "failed",
        pb::Phase::Cancelled => "cancelled",
    }
}

/// True for the phases a sync ends in.
pub fn is_terminal(phase: i32) -> bool {
    [
        pb::Phase::Succeeded as i32,
        pb::Phase::Failed as i32,
        pb::Phase::Cancelled as i32,
    ]
    .contains(&phase)
}

/// Transport label for humans and JSON.
pub fn transport_name(t: i32) -> &'static str {
    match pb::Transport::try_from(t).unwrap_or(pb::Transport::Unspecified) {
        pb::Transport::Tcp => "tcp",
        pb::Transport::Rdma => "rdma",
        pb::Transport::Unspecified => "",
    }
}
