//! The narrow RDMA interface the BLK3 RDMA driver needs (docs/ARCHITECTURE.md, "Transports"), and
//! the types both implementations share.
//!
//! A [`Fabric`] is one reliable-connected queue pair: register memory (→
//! addr, rkey, len), post receives, post sends, post a linked chain of RDMA
//! Writes, poll completions, connect or accept with private data, tear down.
//! The real one is `verbs` (libibverbs + librdmacm); the userspace model is
//! `emulated`. Which WR is which, and what the protocol does with a
//! completion, is the driver's business (`transport::rdma`).

use std::sync::Arc;
use std::time::Duration;

use crate::blk3::WriteOp;

/// Makes a [`Fabric::poll`] that waits on another thread return at once.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Bytes of one posted receive buffer (one BLK3 token).
pub const RECV_BUF_LEN: usize = crate::blk3::token::MAX_TOKEN_LEN;

/// A registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Start address (the remote address the peer writes to).
    pub addr: u64,
    pub len: u64,
    /// Key the peer presents with its writes.
    pub rkey: u32,
    /// Key for local work requests.
    pub lkey: u32,
}

/// Which kind of work request completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkKind {
    Recv,
    Send,
    Write,
}

/// Work completion status codes (the subset of `ibv_wc_status` that matters
/// to BLK3; anything else is `Other`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: a Send found no posted receive.
    RnrRetryExceeded,
    /// `IBV_WC_REM_ACCESS_ERR`: wrong rkey or a write outside the region.
    RemoteAccess,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer stopped answering.
    RetryExceeded,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the QP is in error.
    Flushed,
    /// `IBV_WC_LOC_LEN_ERR` and friends: a local buffer problem.
    LocalError,
    /// Any other status, with its numeric value.
    Other(u32),
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WcStatus::RnrRetryExceeded => f.write_str("RNR_RETRY_EXC_ERR (receiver not ready)"),
            WcStatus::RemoteAccess => f.write_str("REM_ACCESS_ERR (remote access error)"),
            WcStatus::RetryExceeded => f.write_str("RETRY_EXC_ERR (transport retries exceeded)"),
            WcStatus::Flushed => f.write_str("WR_FLUSH_ERR (queue pair in error)"),
            WcStatus::LocalError => f.write_str("local protection or length error"),
            WcStatus::Other(n) => write!(f, "completion status {n}"),
        }
    }
}

/// One work completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub kind: WorkKind,
    pub status: Result<(), WcStatus>,
    /// The received message (receives only).
    pub data: Vec<u8>,
}

/// A fabric failure.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// A verbs or rdma_cm call failed.
    #[error("{call} failed: {source}")]
    Call {
        call: &'static str,
        source: std::io::Error,
    },
    /// An rdma_cm event other than the one expected arrived.
    #[error("{waiting_for}: got rdma_cm event {event} (status {status})")]
    CmEvent {
        waiting_for: &'static str,
        event: String,
        status: i32,
    },
    /// The peer refused the connection.
    #[error("connection rejected by the peer: {0}")]
    Rejected(String),
    /// The connection is gone.
    #[error("the peer disconnected")]
    Disconnected,
    /// The local RDMA device went away (hot-unplug, `rdma link delete`).
    #[error("the local rdma device was removed")]
    DeviceRemoved,
    /// The send queue is full (more WRs than its depth).
    #[error("send queue full ({depth} work requests outstanding)")]
    QueueFull { depth: usize },
    /// A wait ran out of time.
    #[error("timed out after {0:?} {1}")]
    Timeout(Duration, &'static str),
    /// The wire of the emulated fabric carried something malformed.
    #[error("emulated fabric: {0}")]
    Emulation(String),
    /// Verbs asked of a build without them.
    #[error("this build has no verbs support (cargo feature `rdma`)")]
    NoVerbs,
}

impl FabricError {
    /// Wraps the current `errno` for `call`.
    pub fn last_os(call: &'static str) -> FabricError {
        FabricError::Call {
            call,
            source: std::io::Error::last_os_error(),
        }
    }
}

/// One reliable-connected queue pair, as BLK3 uses it. Receives may be
/// posted before the connection is established (the replica posts its
/// first receives before it connects).
pub trait Fabric: Send {
    /// "verbs" or "emulated" (for logs, status and metrics).
    fn provider(&self) -> &'static str;

    /// Registers `len` bytes at `addr`, remotely writable or not.
    ///
    /// # Safety
    /// The memory must stay valid (and, for a writable region, not be read
    /// as anything but bytes) until the fabric is dropped.
    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> Result<MemoryRegion, FabricError>;

    /// Revokes remote access to `region`: a write that is landing finishes
    /// first, later writes fail with a remote access error. The memory
    /// stays valid; the replica verifies bytes nobody can change any more.
    fn revoke(&mut self, region: &MemoryRegion) -> Result<(), FabricError>;

    /// Posts one receive buffer of [`RECV_BUF_LEN`] bytes.
    fn post_recv(&mut self, wr_id: u64) -> Result<(), FabricError>;

    /// Posts one signalled Send of `msg`.
    fn post_send(&mut self, wr_id: u64, msg: &[u8]) -> Result<(), FabricError>;

    /// Posts `writes` as one linked chain of RDMA Writes from `local`
    /// (offsets are the same locally and remotely) into the peer's region at
    /// `remote_addr`; only writes marked `signaled` complete. The work
    /// request id of each write is its plan id.
    fn post_writes(
        &mut self,
        local: &MemoryRegion,
        remote_addr: u64,
        rkey: u32,
        writes: &[WriteOp],
    ) -> Result<(), FabricError>;

    /// The next completion, waiting at most `timeout` (`Ok(None)` then).
    /// A disconnection is reported after the completions it flushed.
    fn poll(&mut self, timeout: Duration) -> Result<Option<Completion>, FabricError>;

    /// Caps how long a [`Fabric::poll`] spins on the completion queue
    /// before it blocks on the completion channel (by default 20 µs, 200 µs
    /// on soft devices); a fabric that never spins ignores it.
    fn cap_spin(&mut self, _cap: Duration) {}

    /// A handle that makes this QP's [`Fabric::poll`] return `Ok(None)`
    /// at once, from any thread, and the next poll too when none waits:
    /// for a driver that also waits for work from elsewhere (the stream's
    /// log grew).
    fn waker(&mut self) -> Result<Waker, FabricError>;

    /// Replica: connects with `private_data` (the session token).
    fn connect(&mut self, private_data: &[u8], timeout: Duration) -> Result<(), FabricError>;

    /// Source: the private data of the connection request this QP answers.
    fn private_data(&self) -> &[u8];

    /// Source: accepts the connection request (receives already posted).
    fn accept(&mut self, timeout: Duration) -> Result<(), FabricError>;

    /// Source: refuses the connection request with `reason`.
    fn reject(&mut self, reason: &str);

    /// Disconnects; safe to call more than once. Resources go with `Drop`.
    fn disconnect(&mut self);

    /// Whether the connection still stands, without waiting and without
    /// taking a completion: an error once the peer disconnected or the
    /// device went (for a side that is not polling its completions).
    fn check_link(&mut self) -> Result<(), FabricError>;
}

/// Ends a connection: waits at most `linger` for the `pending` Sends
/// posted last (an RDFL, a REPLMETA) to be delivered, since disconnecting
/// flushes what is still queued, then disconnects.
pub fn linger_close<F: Fabric>(qp: &mut F, mut pending: u64, linger: Duration) {
    let deadline = std::time::Instant::now() + linger;
    while pending > 0 {
        let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
            break;
        };
        match qp.poll(left) {
            Ok(Some(c)) if c.kind == WorkKind::Send => pending -= 1,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    qp.disconnect();
}
