//! The control plane's services: the orchestrator-facing one
//! ([`orchestrator`]) and the agent-to-agent one ([`peer`]), and the one
//! place where errors become `tonic::Status` ([`ApiError`]). The generated
//! types, tokens, TLS and dialing are `rpc`'s; the agent hosts the server.

pub mod orchestrator;
pub mod peer;

use tonic::{Code, Status};

use crate::store::cache::CacheError;
use crate::sync::offer::OfferError;
use crate::sync::SyncError;

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
    /// Not allowed by this agent's configuration → PERMISSION_DENIED.
    #[error("{0}")]
    PermissionDenied(String),
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
            ApiError::PermissionDenied(_) => Code::PermissionDenied,
        };
        Status::new(code, e.to_string())
    }
}

impl From<SyncError> for ApiError {
    fn from(e: SyncError) -> ApiError {
        let msg = e.to_string();
        match e {
            SyncError::BadRequest(_) => ApiError::InvalidArgument(msg),
            SyncError::NoSuchSync(_) => ApiError::NotFound(msg),
            SyncError::CannotStart(_) => ApiError::FailedPrecondition(msg),
            SyncError::Busy(_) => ApiError::Busy(msg),
            SyncError::ShuttingDown(_) => ApiError::Unavailable(msg),
            SyncError::SourceNotAllowed(_) => ApiError::PermissionDenied(msg),
        }
    }
}

impl From<OfferError> for ApiError {
    fn from(e: OfferError) -> ApiError {
        let msg = e.to_string();
        match e {
            OfferError::BadRequest(_) | OfferError::Instance(_) => ApiError::InvalidArgument(msg),
            OfferError::Unsupported(_) => ApiError::FailedPrecondition(msg),
            OfferError::Draining => ApiError::Unavailable(msg),
            OfferError::Busy(_) => ApiError::Busy(msg),
            OfferError::NoSnapshot(_) => ApiError::NoSnapshot(msg),
            OfferError::Cache(e) => e.into(),
        }
    }
}

impl From<CacheError> for ApiError {
    fn from(e: CacheError) -> ApiError {
        let msg = e.to_string();
        match e {
            CacheError::TooLarge { .. } | CacheError::OverBudget { .. } => ApiError::Busy(msg),
            CacheError::Changed { .. } => ApiError::Unavailable(format!("{msg}; retry")),
            CacheError::RelayEnded(_)
            | CacheError::PieceChanged { .. }
            | CacheError::PieceDropped { .. } => {
                ApiError::Unavailable(format!("{msg}; pull from this relay's own source instead"))
            }
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
