//! BLK3 over an RDMA fabric (real verbs or the emulation): the executors
//! that run the source and replica machines over a [`Fabric`].
//!
//! Owns the mapping from BLK3 commands to queue-pair work — tokens by
//! Send/Recv, the bulk by chained RDMA Writes from the shared snapshot
//! buffer — and the replica's receive memory: a `MAP_SHARED` mapping of the
//! file its [`Sink`] prepared, registered for remote write (zero-copy into
//! the page cache), or, when the fabric refuses to register file pages, an
//! anonymous page-aligned buffer whose pieces are written to the file as
//! their PDONs arrive. Which path was used is logged and reported.
//! Protocol decisions stay in `blk3`; queue-pair mechanics stay in the
//! fabrics.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::fabric::{Completion, Fabric, FabricError, MemoryRegion, WcStatus, WorkKind};
use super::{drive, Executor, Serve, Sink, CONNECT_TIMEOUT};
use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::{Blk3Error, BulkMode, Command, Input, Outcome, Token, TokenError};
use crate::store::cache::{CacheError, CacheRef};
use crate::sys::buf::AlignedBuf;
use crate::sys::ratelimit::RateLimiter;

/// Work-request ids of receives and sends; writes use their plan id.
const RECV_TAG: u64 = 1 << 62;
const SEND_TAG: u64 = 1 << 61;
/// How long a finished session waits for its last Sends to be delivered.
const LINGER: Duration = Duration::from_secs(5);
/// Longest single wait on the completion queue before cancellation is
/// checked again.
const POLL_SLICE: Duration = Duration::from_millis(200);

/// An RDMA session failure below the protocol.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// A fabric call failed (connect, register, post, poll).
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// A work request completed in error.
    #[error("{kind:?} work request {wr_id:#x} completed with {status}")]
    Completion {
        kind: WorkKind,
        wr_id: u64,
        status: WcStatus,
    },
    /// A received message is not a token.
    #[error("bad message from peer: {0}")]
    Token(#[from] TokenError),
    /// The snapshot could not be loaded or did not verify on the source.
    #[error("source snapshot: {0}")]
    Snapshot(#[from] CacheError),
    /// The driver was asked for something this role does not do.
    #[error("command {0} is not available over RDMA")]
    Unsupported(&'static str),
    /// The session was cancelled locally.
    #[error("cancelled")]
    Cancelled,
}

/// A completion as a driver reads it, once a failed one has ended the
/// session ([`completed`]).
pub enum Completed {
    /// A message arrived.
    Recv(Vec<u8>),
    /// A signalled write with this work request id finished.
    Write(u64),
    /// A Send finished.
    Send,
}

/// Reads completion `c`: a work request that completed in error is the
/// end of the session.
pub fn completed(c: Completion) -> Result<Completed, RdmaError> {
    match c {
        Completion {
            kind,
            wr_id,
            status: Err(status),
            ..
        } => Err(RdmaError::Completion {
            kind,
            wr_id,
            status,
        }),
        Completion {
            kind: WorkKind::Recv,
            data,
            ..
        } => Ok(Completed::Recv(data)),
        Completion {
            kind: WorkKind::Write,
            wr_id,
            ..
        } => Ok(Completed::Write(wr_id)),
        Completion {
            kind: WorkKind::Send,
            ..
        } => Ok(Completed::Send),
    }
}

impl RdmaError {
    /// Label for `kvsync_transport_fallback_total{reason}`.
    pub fn fallback_reason(&self) -> &'static str {
        match self {
            RdmaError::Fabric(FabricError::Timeout(..)) => "timeout",
            RdmaError::Fabric(FabricError::Rejected(_)) => "rejected",
            RdmaError::Fabric(FabricError::DeviceRemoved) => "device_removed",
            RdmaError::Fabric(FabricError::Disconnected | FabricError::CmEvent { .. }) => {
                "disconnected"
            }
            RdmaError::Fabric(_) => "fabric_error",
            RdmaError::Completion { .. } => "completion_error",
            RdmaError::Token(_) => "protocol",
            RdmaError::Snapshot(_) => "local_error",
            RdmaError::Unsupported(_) => "protocol",
            RdmaError::Cancelled => "cancelled",
        }
    }
}

/// How many writes a source posted, how many of them were signalled, and
/// how long the bulk took (first write posted → last write complete).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriteStats {
    pub posted: u64,
    pub signaled: u64,
    pub bulk: Option<Duration>,
}

impl WriteStats {
    /// Bulk throughput in MB/s (10^6 bytes), if there was a bulk phase.
    pub fn bulk_mb_s(&self, bytes: u64) -> Option<f64> {
        self.bulk
            .map(|d| bytes as f64 / d.as_secs_f64().max(1e-9) / 1e6)
    }
}

/// What both executors share: the queue pair, the session clock, ids.
struct Link<F> {
    qp: F,
    cancel: CancellationToken,
    started: Instant,
    next_id: u64,
    connected: bool,
    /// Sends posted and not completed yet.
    sends_pending: u64,
}

impl<F: Fabric> Link<F> {
    fn new(qp: F, cancel: CancellationToken) -> Link<F> {
        Link {
            qp,
            cancel,
            started: Instant::now(),
            next_id: 0,
            connected: false,
            sends_pending: 0,
        }
    }

    fn id(&mut self, tag: u64) -> u64 {
        self.next_id += 1;
        tag | self.next_id
    }

    fn post_recv(&mut self) -> Result<(), RdmaError> {
        let id = self.id(RECV_TAG);
        Ok(self.qp.post_recv(id)?)
    }

    fn send(&mut self, t: &Token) -> Result<(), RdmaError> {
        let id = self.id(SEND_TAG);
        self.qp.post_send(id, &t.encode())?;
        self.sends_pending += 1;
        Ok(())
    }

    /// Ends the session: waits (briefly) until the last Sends — RDFL,
    /// REPLMETA — are delivered, since disconnecting flushes what is still
    /// queued, then disconnects.
    fn close(&mut self) {
        let pending = if self.connected {
            self.sends_pending
        } else {
            0
        };
        super::fabric::linger_close(&mut self.qp, pending, LINGER);
    }

    /// The next completion that matters to the machine: received tokens and
    /// signalled writes; successful Sends are consumed here.
    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, RdmaError> {
        loop {
            if self.cancel.is_cancelled() {
                return Err(RdmaError::Cancelled);
            }
            // A deadline that passed while this side was busy (a paced
            // source posting its writes) does not hide what has arrived
            // meanwhile: one last poll that does not wait.
            let (timeout, last) = match deadline {
                Some(d) => match d.checked_sub(self.started.elapsed()) {
                    Some(left) if !left.is_zero() => (left.min(POLL_SLICE), false),
                    _ => (Duration::ZERO, true),
                },
                None => (POLL_SLICE, false),
            };
            let Some(c) = self.qp.poll(timeout)? else {
                if last {
                    return Ok(None);
                }
                continue;
            };
            match completed(c).inspect_err(|_| self.connected = false)? {
                Completed::Recv(data) => return Ok(Some(Input::Received(Token::decode(&data)?))),
                Completed::Write(id) => return Ok(Some(Input::WriteCompleted { id })),
                Completed::Send => self.sends_pending -= 1,
            }
        }
    }
}

/// Source-side executor.
struct SourceIo<'a, F> {
    link: Link<F>,
    snapshot: &'a CacheRef,
    region: Option<MemoryRegion>,
    faults: &'a RdmaFaults,
    rate: &'a RateLimiter,
    progress: &'a AtomicU64,
    /// Signalled writes in flight with the bytes posted up to each, oldest first.
    signaled_ends: VecDeque<(u64, u64)>,
    /// Bytes posted in this session (resent pieces count again).
    posted_bytes: u64,
    stats: WriteStats,
    bulk_started: Option<Instant>,
    /// The `hold_after` fault has been applied.
    held: bool,
    /// The replica's receive memory, from the writes posted into it.
    remote: Option<(u64, u32)>,
    /// The `write_after_verify` fault's bytes, registered while it lasts.
    forged: Option<(Vec<u8>, MemoryRegion)>,
    serve: &'a Serve<'a>,
}

impl<F: Fabric> SourceIo<'_, F> {
    /// The `hold_after` fault: before posting past that point, waits while
    /// the hold file exists, watching the connection and the cancellation
    /// (a session that fails meanwhile ends with that error). Writes
    /// already posted complete meanwhile; replies stay queued. A hold
    /// longer than the reply wait fails the session after its release.
    fn hold(&mut self) -> Result<(), RdmaError> {
        let (Some(at), Some(file)) = (self.faults.hold_after, &self.faults.hold_file) else {
            return Ok(());
        };
        if self.held || self.posted_bytes < at || !file.exists() {
            return Ok(());
        }
        self.held = true;
        warn!(posted = self.posted_bytes, file = %file.display(), "fault injection: holding the transfer while the file exists");
        let limit = Instant::now() + HOLD_LIMIT;
        while file.exists() && Instant::now() < limit {
            if self.link.cancel.is_cancelled() {
                return Err(RdmaError::Cancelled);
            }
            self.link.qp.check_link()?;
            std::thread::sleep(Duration::from_millis(20));
        }
        warn!("fault injection: transfer released");
        Ok(())
    }

    /// Accepts the connection before the first Send, so the receives the
    /// machine posted first are in place before the replica can send.
    /// The `write_after_verify` fault, before BDON: one more write into
    /// piece 0, which the replica has verified by now, acting as a source
    /// that changes what it vouched for.
    fn write_after_verify(&mut self) -> Result<(), RdmaError> {
        let Some((remote_addr, rkey)) = self.remote.filter(|_| self.faults.write_after_verify)
        else {
            return Ok(());
        };
        warn!("fault injection: writing into a verified piece before BDON");
        let mut bytes = vec![0xee_u8; 64.min(self.snapshot.len())];
        // SAFETY: the buffer lives in `self.forged` until the session ends,
        // after the queue pair that reads it; it is only read.
        let region = unsafe {
            self.link
                .qp
                .register(bytes.as_mut_ptr(), bytes.len(), false)
        }?;
        let write = crate::blk3::plan::WriteOp {
            id: self.link.id(SEND_TAG),
            offset: 0,
            len: bytes.len() as u64,
            signaled: false,
        };
        self.link
            .qp
            .post_writes(&region, remote_addr, rkey, &[write])?;
        self.forged = Some((bytes, region));
        Ok(())
    }

    fn accept(&mut self) -> Result<(), RdmaError> {
        if !self.link.connected {
            self.link.qp.accept(CONNECT_TIMEOUT)?;
            self.link.connected = true;
        }
        Ok(())
    }
}

impl<F: Fabric> Executor for SourceIo<'_, F> {
    type Error = RdmaError;

    fn now(&self) -> Duration {
        self.link.started.elapsed()
    }

    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, RdmaError> {
        match cmd {
            Command::PostRecv(_) => self.link.post_recv().map(|_| None),
            Command::Send(t) => {
                self.accept()?;
                if t == Token::Bdon {
                    self.stats.bulk = self.bulk_started.map(|s| s.elapsed());
                    // Every byte is written; the image must also have
                    // verified on load before we vouch for it.
                    self.snapshot.wait_complete()?;
                    self.write_after_verify()?;
                }
                self.link.send(&t).map(|_| None)
            }
            Command::PrepareSource => {
                if !self.snapshot.is_empty() {
                    // SAFETY: the cache image outlives this session (the
                    // offer holds it), and the region is only read.
                    let region = unsafe {
                        self.link.qp.register(
                            self.snapshot.as_ptr() as *mut u8,
                            self.snapshot.len(),
                            false,
                        )
                    }?;
                    self.region = Some(region);
                }
                Ok(Some(Input::SourceReady))
            }
            Command::PostWrites {
                remote_addr,
                rkey,
                writes,
            } => {
                let region = self
                    .region
                    .ok_or(RdmaError::Unsupported("writes before registration"))?;
                self.remote = Some((remote_addr, rkey));
                let end = writes.iter().map(|w| w.offset + w.len).max().unwrap_or(0);
                self.hold()?;
                self.bulk_started.get_or_insert_with(Instant::now);
                // The agent's bandwidth limit, paid per chunk before posting.
                let bytes: u64 = writes.iter().map(|w| w.len).sum();
                self.rate
                    .paced(bytes as usize, |_| Ok::<_, RdmaError>(()))?;
                // Writes go out as soon as the cache has loaded their range.
                self.snapshot.wait_loaded(end as usize)?;
                for w in &writes {
                    self.posted_bytes += w.len;
                    if w.signaled {
                        self.signaled_ends.push_back((w.id, self.posted_bytes));
                    }
                }
                self.stats.posted += writes.len() as u64;
                self.stats.signaled += writes.iter().filter(|w| w.signaled).count() as u64;
                let rkey = if self.faults.bad_rkey {
                    rkey ^ 0x5a5a
                } else {
                    rkey
                };
                self.link
                    .qp
                    .post_writes(&region, remote_addr, rkey, &writes)?;
                Ok(None)
            }
            Command::Claim { pieces } => Ok(Some(self.serve.claim(&pieces))),
            Command::StreamPiece { .. } => Err(RdmaError::Unsupported("StreamPiece")),
            Command::PrepareReceive { .. }
            | Command::TakePiece { .. }
            | Command::MorePieces { .. }
            | Command::Verify => Err(RdmaError::Unsupported("replica command")),
            Command::Done(_) => Ok(None),
        }
    }

    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, RdmaError> {
        self.accept()?;
        let input = self.link.next_input(deadline)?;
        if let Some(Input::WriteCompleted { id }) = input {
            while let Some(&(done, end)) = self.signaled_ends.front() {
                if done > id {
                    break;
                }
                self.progress.store(end, Ordering::Relaxed);
                self.signaled_ends.pop_front();
            }
        }
        Ok(input)
    }
}

/// Driver-level faults for fault tests (never in production).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RdmaFaults {
    /// Source: write with a wrong rkey (the replica's NIC must refuse).
    pub bad_rkey: bool,
    /// Replica: do not try to register the temp file mapping.
    pub no_file_mr: bool,
    /// Replica: flip a byte of this piece in the receive memory once it
    /// has landed, the first time (damage in flight, on any fabric).
    pub damage_piece: Option<u32>,
    /// Source: once this many bytes are posted, hold the transfer while
    /// `hold_file` exists, so a test can make an event (a device removed,
    /// a link down, an agent killed) happen at a known point of a sync
    /// instead of racing it.
    pub hold_after: Option<u64>,
    /// The file whose existence holds a transfer at `hold_after`.
    pub hold_file: Option<std::path::PathBuf>,
    /// Source: after the last piece is acknowledged, write into piece 0
    /// once more before BDON (a source changing verified bytes).
    pub write_after_verify: bool,
}

/// The longest a fault hold lasts when nobody removes its file.
const HOLD_LIMIT: Duration = Duration::from_secs(120);

/// What a source session produced.
pub struct SourceRun {
    pub result: Result<Result<Outcome, Blk3Error>, RdmaError>,
    pub stats: WriteStats,
}

/// Serves one session on an accepted-but-not-yet-established queue pair
/// whose private data already proved the session: runs the source machine.
pub fn run_source<F: Fabric>(qp: F, s: Serve) -> SourceRun {
    let Some(image) = s.snapshot.image() else {
        return SourceRun {
            result: Err(RdmaError::Unsupported(
                "an RDMA session needs the snapshot in memory",
            )),
            stats: WriteStats::default(),
        };
    };
    let mut io = SourceIo {
        link: Link::new(qp, s.cancel.clone()),
        snapshot: image,
        region: None,
        faults: &s.faults.rdma,
        rate: s.rate,
        progress: s.progress,
        signaled_ends: VecDeque::new(),
        posted_bytes: 0,
        stats: WriteStats::default(),
        bulk_started: None,
        held: false,
        remote: None,
        forged: None,
        serve: &s,
    };
    let mut machine = s
        .source(image.len() as u64, BulkMode::Rdma(s.params))
        .with_reply_wait(s.reply_wait);
    machine.start(io.now());
    let result = drive(&mut machine, &mut io);
    s.end(&machine);
    // Tear the connection down before the snapshot reference can go.
    io.link.close();
    SourceRun {
        result,
        stats: io.stats,
    }
}

/// Where the replica receives the bulk.
enum RecvMemory {
    /// A shared mapping of the temp file, registered: bytes land in the page cache.
    Mapped(MmapMut),
    /// An anonymous buffer, each piece written to the temp file when its
    /// PDON arrives.
    Heap(AlignedBuf),
}

impl RecvMemory {
    /// Short description for status and logs.
    fn label(&self) -> &'static str {
        match self {
            RecvMemory::Mapped(_) => "registered temp-file mapping (zero-copy)",
            RecvMemory::Heap(_) => "anonymous buffer + pwrite (file registration refused)",
        }
    }
}

/// Replica-side executor. `link` is declared first so the queue pair is torn
/// down before the memory it may write to is released.
struct ReplicaIo<'a, F: Fabric> {
    link: Link<F>,
    memory: Option<RecvMemory>,
    /// The registered receive memory, until its remote access is revoked.
    region: Option<MemoryRegion>,
    /// A piece copied out of the anonymous receive buffer, which the
    /// source can still write: the sink checks and writes this copy.
    private: Vec<u8>,
    token: [u8; SESSION_TOKEN_LEN],
    sink: &'a mut dyn Sink,
    faults: &'a RdmaFaults,
    /// `faults.damage_piece` until it has fired.
    damage: Option<u32>,
}

impl<F: Fabric> ReplicaIo<'_, F> {
    /// Connects before the first wait, with the receives already posted.
    fn connect(&mut self) -> Result<(), RdmaError> {
        if !self.link.connected {
            self.link.qp.connect(&self.token, CONNECT_TIMEOUT)?;
            self.link.connected = true;
        }
        Ok(())
    }

    /// Registers receive memory for `len` bytes over the sink's prepared
    /// file: its shared mapping when the fabric takes file pages, else an
    /// anonymous buffer.
    fn register(&mut self, len: u64) -> Result<MemoryRegion, RdmaError> {
        let len = len as usize;
        if !self.faults.no_file_mr {
            // SAFETY: the sink sized the file to `len` and only this session
            // touches it until install.
            match unsafe {
                memmap2::MmapOptions::new()
                    .len(len)
                    .map_mut(self.sink.file())
            } {
                Ok(mut map) => {
                    // SAFETY: the mapping lives in `self.memory`, dropped after the QP.
                    match unsafe { self.link.qp.register(map.as_mut_ptr(), len, true) } {
                        Ok(region) => {
                            self.memory = Some(RecvMemory::Mapped(map));
                            return Ok(region);
                        }
                        Err(e) => {
                            warn!(error = %e, "cannot register the temp file mapping (common for file pages on recent kernels); receiving into an anonymous buffer")
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "cannot map the temp file; receiving into an anonymous buffer")
                }
            }
        }
        let mut buf = AlignedBuf::new(len).map_err(|source| FabricError::Call {
            call: "allocate receive memory",
            source,
        })?;
        // SAFETY: as above; the buffer is only read, a piece at a time,
        // after the PDON that follows its writes.
        let region = unsafe { self.link.qp.register(buf.as_mut_ptr(), len, true) }?;
        self.memory = Some(RecvMemory::Heap(buf));
        Ok(region)
    }

    /// Hands one piece the source wrote to the sink: bytes already in the
    /// file through the mapping (re-checked after the revoke), or copied
    /// once out of the anonymous buffer, so that the bytes checked are the
    /// bytes written whatever the source writes next.
    fn land(&mut self, index: u32, offset: u64, len: u64) {
        let range = offset as usize..(offset + len) as usize;
        if self.damage == Some(index) && len > 0 {
            self.damage = None;
            warn!(
                index,
                "fault injection: damaging a piece in the receive memory"
            );
            match &mut self.memory {
                Some(RecvMemory::Mapped(map)) => map[range.start] ^= 0x01,
                Some(RecvMemory::Heap(buf)) => buf[range.start] ^= 0x01,
                None => {}
            }
        }
        match &self.memory {
            Some(RecvMemory::Mapped(map)) => self.sink.piece_bytes(index, &map[range], true),
            Some(RecvMemory::Heap(buf)) => {
                self.private.clear();
                self.private.extend_from_slice(&buf[range]);
                self.sink.piece_bytes(index, &self.private, false)
            }
            None => {}
        }
    }
}

impl<F: Fabric> Executor for ReplicaIo<'_, F> {
    type Error = RdmaError;

    fn now(&self) -> Duration {
        self.link.started.elapsed()
    }

    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, RdmaError> {
        match cmd {
            Command::PostRecv(_) => self.link.post_recv().map(|_| None),
            Command::Send(t) => {
                self.connect()?;
                self.link.send(&t).map(|_| None)
            }
            Command::PrepareReceive { len } => {
                if let Err(reason) = self.sink.prepare(len) {
                    return Ok(Some(Input::ReceiveFailed(reason.to_string())));
                }
                let region = self.register(len)?;
                self.region = Some(region);
                info!(
                    memory = self.memory.as_ref().map(RecvMemory::label),
                    bytes = len,
                    "receive memory registered"
                );
                Ok(Some(Input::ReceiveReady {
                    addr: region.addr,
                    rkey: region.rkey,
                }))
            }
            Command::TakePiece { index, offset, len } => {
                // The PDON came after the piece's writes on this RC queue
                // pair: every byte of the piece is in place.
                self.land(index, offset, len);
                let result = super::verdict(self.sink.piece_done(index));
                Ok(Some(Input::PieceChecked { index, result }))
            }
            Command::Verify => {
                // The source must not change what is verified and installed.
                if let Some(region) = self.region.take() {
                    self.link.qp.revoke(&region)?;
                }
                Ok(Some(Input::Verified(super::verdict(self.sink.verify()))))
            }
            Command::MorePieces { wait } => Ok(Some(super::more_pieces(self.sink, wait))),
            Command::PrepareSource
            | Command::Claim { .. }
            | Command::StreamPiece { .. }
            | Command::PostWrites { .. } => Err(RdmaError::Unsupported("source command")),
            Command::Done(_) => Ok(None),
        }
    }

    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, RdmaError> {
        self.connect()?;
        self.link.next_input(deadline)
    }
}

/// What a replica session produced.
pub struct ReplicaRun {
    /// Fabric failure, or the protocol's verdict.
    pub result: Result<Result<Outcome, Blk3Error>, RdmaError>,
    /// Which receive-memory path was used, if any.
    pub memory: Option<&'static str>,
}

/// Runs a replica session on a queue pair that reached the source but is
/// not connected yet: posts the first receives, connects presenting `token`,
/// and receives `offered_len` bytes into `sink`, failing when the source
/// announces no piece for `piece_wait(piece_size)`.
pub fn run_replica<F: Fabric>(
    qp: F,
    token: [u8; SESSION_TOKEN_LEN],
    offered_len: u64,
    sink: &mut dyn Sink,
    faults: &RdmaFaults,
    cancel: CancellationToken,
    piece_wait: impl Fn(u64) -> Duration,
) -> ReplicaRun {
    let mut io = ReplicaIo {
        link: Link::new(qp, cancel),
        memory: None,
        region: None,
        private: Vec::new(),
        token,
        sink,
        faults,
        damage: faults.damage_piece,
    };
    let want = io.sink.want();
    let piece_size = want.piece_size;
    let mut machine = want
        .replica(offered_len)
        .with_piece_wait(piece_wait(piece_size));
    machine.start(io.now());
    let result = drive(&mut machine, &mut io);
    io.link.close();
    ReplicaRun {
        result,
        memory: io.memory.as_ref().map(RecvMemory::label),
    }
}

#[cfg(test)]
mod tests;
