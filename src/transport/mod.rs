//! Data-plane transports: the drivers that execute BLK3 commands.
//!
//! Owns the generic driver loop ([`drive`]) that runs a sans-IO machine over
//! an [`Executor`], the [`Sink`] every replica driver feeds, the transport
//! labels used in status and metrics. Fault injection: [`faults`]. Each submodule owns one transport; [`session`] makes them
//! one type for the layers above; protocol decisions stay in `blk3`.

pub mod emulated;
pub mod fabric;
pub mod faults;
pub mod ktls;
pub mod pace;
pub mod probe;
pub mod rdma;
pub mod ring;
pub mod select;
pub mod session;
pub mod stream;
pub mod tcp;
pub mod tls;
#[cfg(feature = "rdma")]
pub mod verbs;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::blk3::share::Refused;
use crate::blk3::{
    Blk3Error, BulkMode, BulkParams, Claims, Command, Input, Machine, Outcome, Replica, Source,
};
use crate::store::install::InstallError;
use crate::store::journal::ClaimsError;
use crate::store::served::Served;
use crate::sys::ratelimit::RateLimiter;

pub use crate::rpc::dial::CONNECT_TIMEOUT;
pub use faults::{Faults, CRC32_NEUTRAL};

/// What a source session sends, and under which limits.
pub struct Serve<'a> {
    /// Exactly the offered bytes (the cache image or file the offer holds).
    pub snapshot: &'a Served,
    pub seq: u64,
    /// The piece size of the snapshot's manifest.
    pub piece_size: u64,
    /// Bulk parameters of RDMA sessions (soft-device caps applied).
    pub params: BulkParams,
    pub faults: &'a Faults,
    pub rate: &'a RateLimiter,
    /// Bytes known sent.
    pub progress: &'a AtomicU64,
    /// Stops RDMA sessions (TCP ones stop through their socket).
    pub cancel: CancellationToken,
    /// RDMA: how long the replica may leave every piece unanswered.
    pub reply_wait: Duration,
    /// The pieces the session's streams claimed.
    pub asked: &'a Arc<Asked>,
    /// This connection's number among the session's streams.
    pub stream: u32,
    /// The session runs on several streams, sharing the replica's queue.
    pub queued: bool,
}

/// How long a stream's claim waits for a piece another stream of the
/// session holds (a replica hands a dead stream's pieces on as soon as it
/// closes it; the source notices the close about a round trip later).
pub const CLAIM_WAIT: Duration = Duration::from_secs(10);

/// The pieces the streams of one session claimed on the source
/// ([`Claims`]), shared by their threads: a claim on a piece another live
/// stream holds waits for that stream to end.
#[derive(Debug, Default)]
pub struct Asked {
    claims: std::sync::Mutex<Claims>,
    released: std::sync::Condvar,
}

impl Asked {
    /// [`Claims::claim`], waiting up to `wait` while another stream holds
    /// a piece; refused when it still does.
    pub fn claim(&self, stream: u32, pieces: &[u32], wait: Duration) -> Result<(), Refused> {
        let until = std::time::Instant::now() + wait;
        let mut claims = self.claims.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match claims.claim(stream, pieces) {
                Err(Refused::Held) => {}
                other => return other,
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                let held = claims.held_of(stream, pieces).unwrap_or_default();
                return Err(Refused::Another(held));
            }
            claims = self
                .released
                .wait_timeout(claims, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// [`Claims::end`], waking the claims that wait.
    pub fn end(&self, stream: u32, unfinished: &[u32]) {
        let mut claims = self.claims.lock().unwrap_or_else(PoisonError::into_inner);
        claims.end(stream, unfinished);
        drop(claims);
        self.released.notify_all();
    }
}

impl Serve<'_> {
    /// The source machine for this session's `len` bytes over `mode`.
    pub fn source(&self, len: u64, mode: BulkMode) -> Source {
        let machine = Source::new(len, self.seq, self.piece_size, mode);
        if self.queued {
            machine.queued()
        } else {
            machine
        }
    }

    /// The answer to the machine's [`Command::Claim`].
    pub fn claim(&self, pieces: &[u32]) -> Input {
        let claimed = self.asked.claim(self.stream, pieces, CLAIM_WAIT);
        Input::Claimed(claimed.map_err(|e| e.to_string()))
    }

    /// The stream is over: what its machine claimed and no PACK answered
    /// is free for the session's other streams.
    pub fn end(&self, machine: &Source) {
        self.asked.end(self.stream, &machine.unfinished());
    }
}

/// What a replica session asks its source for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// The piece size of the snapshot's manifest.
    pub piece_size: u64,
    /// The pieces it lacks, as NEED ranges.
    pub need: Vec<(u32, u32)>,
    /// Failed checks one piece may have.
    pub retries: u32,
    /// A stream of a session on several: it takes its pieces from the
    /// session's queue ([`Sink::more_pieces`], not `need`), asking for more
    /// when it holds this many or fewer.
    pub refill: Option<u32>,
}

impl Want {
    /// The replica machine for a snapshot of `offered_len` bytes.
    pub fn replica(self, offered_len: u64) -> Replica {
        let machine = Replica::new(offered_len, self.piece_size, self.need, self.retries);
        match self.refill {
            Some(refill) => machine.queued(refill),
            None => machine,
        }
    }
}

/// The answer to a replica machine's [`Command::MorePieces`].
fn more_pieces(sink: &mut dyn Sink, wait: bool) -> Input {
    match sink.more_pieces(wait) {
        Ok(ranges) => Input::MorePieces(ranges),
        Err(e) => Input::ReceiveFailed(e.to_string()),
    }
}

/// Why a [`Sink`] refuses a piece or the snapshot. Its text is what the
/// replica tells the source (RDFL, a piece asked again).
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// This host cannot store the bytes (disk full, a write error).
    #[error(transparent)]
    Local(Arc<InstallError>),
    /// A piece is not what the manifest says.
    #[error("piece {index} (bytes {offset}..{}) hashes to {hash} over {got} bytes; the manifest says {want} over {len}", offset + len)]
    BadPiece {
        index: u32,
        offset: u64,
        len: u64,
        got: u64,
        hash: blake3::Hash,
        want: blake3::Hash,
    },
    /// A piece verified, then changed while the source could still write
    /// the receive memory (found by the re-check after the revoke).
    #[error("piece {0} changed after it was verified: the source wrote into it after its PDON; nothing was installed")]
    Changed(u32),
    /// Every piece matches the manifest, but the whole is not a valid
    /// snapshot of the offered format (the source lied about its file).
    #[error("the pieces match the source's manifest but are not a valid snapshot: {0}; nothing was installed")]
    NotSnapshot(#[source] crate::snapshot::Corruption),
    /// A valid snapshot, but not the one the manifest describes.
    #[error("the bytes are a valid snapshot, but its {0} is not what the source's manifest says; nothing was installed")]
    NotAsOffered(&'static str),
    /// The resume journal claimed pieces the staging file does not hold.
    #[error("the resume journal was wrong ({0}); the partial sync was discarded")]
    Journal(#[source] ClaimsError),
    /// Pieces asked for that never verified.
    #[error("{0} pieces never verified")]
    Missing(usize),
    /// The session's other streams held their pieces past the deadline.
    #[error("waited {0:?} for the session's other streams to verify or hand back their pieces")]
    QueueWait(Duration),
}

/// A sink's verdict as BLK3 carries it: the reason in words (for RDFL).
fn verdict(result: Result<(), SinkError>) -> Result<(), String> {
    result.map_err(|e| e.to_string())
}

/// Where a replica session puts the snapshot it receives. Drivers only move
/// bytes and report them here, piece by piece; the sink owns the
/// destination, the checks and the first local failure, identically for
/// every transport.
pub trait Sink: Send {
    /// The pieces to ask for.
    fn want(&self) -> Want;
    /// Makes room for `len` bytes. `Err` is the reason the session ends
    /// with (RDFL before any byte moves).
    fn prepare(&mut self, len: u64) -> Result<(), SinkError>;
    /// The prepared file, for receive memory mapped over it (RDMA).
    fn file(&self) -> &std::fs::File;
    /// The next bytes of piece `index`, in order: written to the prepared
    /// file from memory only this process writes, or (`in_file`) already
    /// there through a shared mapping of it that the source may still
    /// write (RDMA), so that every piece is checked again after the
    /// source's access is revoked, before [`Sink::verify`] answers.
    fn piece_bytes(&mut self, index: u32, bytes: &[u8], in_file: bool);
    /// The next `n` bytes of piece `index`, waiting in `pipe` (plain TCP).
    /// A sink over a file moves them there inside the kernel and checks
    /// them where they landed; this default reads them out and hands them
    /// to [`Sink::piece_bytes`].
    fn piece_from_pipe(
        &mut self,
        index: u32,
        pipe: &crate::sys::splice::Pipe,
        n: usize,
    ) -> std::io::Result<()> {
        let mut buf = vec![0u8; n];
        pipe.read_into(&mut buf)?;
        self.piece_bytes(index, &buf, false);
        Ok(())
    }
    /// Piece `index` is complete: checks it; `Err` says why it is bad.
    fn piece_done(&mut self, index: u32) -> Result<(), SinkError>;
    /// A stream of a session on several ([`Want::refill`]): its next pieces
    /// from the session's queue, as NEED ranges; with `wait`, waits until
    /// there are some or none is left anywhere (empty). A sink of one
    /// stream has no queue.
    fn more_pieces(&mut self, _wait: bool) -> Result<Vec<(u32, u32)>, SinkError> {
        Ok(Vec::new())
    }
    /// Every piece is in: verifies the whole; `Err` is the reason for RDFL.
    fn verify(&mut self) -> Result<(), SinkError>;
}

/// A connected data socket as a blocking one for its transfer thread, set
/// up to notice a dead peer (see [`detect_dead_peer`]).
pub fn blocking_data_socket(
    stream: tokio::net::TcpStream,
    peer_timeout: Duration,
) -> std::io::Result<std::net::TcpStream> {
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    detect_dead_peer(&stream, peer_timeout)?;
    Ok(stream)
}

/// Sets up a stream session's socket, either end: a dead peer noticed as
/// on every data connection ([`detect_dead_peer`]), and every write sent at
/// once. A stream frame or an acknowledgement is small and awaited: with
/// Nagle's algorithm a frame's second write waits for the peer's delayed
/// ACK (40 ms), and every `WAIT` on the primary with it.
pub fn stream_socket(
    stream: &impl std::os::fd::AsFd,
    peer_timeout: Duration,
) -> std::io::Result<()> {
    detect_dead_peer(stream, peer_timeout)?;
    socket2::SockRef::from(stream).set_tcp_nodelay(true)
}

/// Makes a data connection notice a peer that went silent (cable cut, host
/// gone: no FIN, no RST) within `peer_timeout`: keepalive probes while it
/// waits to read, `TCP_USER_TIMEOUT` while its writes go unacknowledged. The
/// BLK3 waits allow minutes for a multi-GB transfer; a dead link must not.
pub fn detect_dead_peer(
    stream: &impl std::os::fd::AsFd,
    peer_timeout: Duration,
) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    let probe = (peer_timeout / 4).max(Duration::from_secs(1));
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(probe)
            .with_interval(probe)
            .with_retries(3),
    )?;
    socket.set_tcp_user_timeout(Some(peer_timeout))
}

/// Which transport moves a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    Tcp,
    Rdma,
}

impl TransportKind {
    /// Label for metrics and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Carries out BLK3 commands on real (or emulated) I/O.
pub trait Executor {
    type Error;
    /// Time since the session began.
    fn now(&self) -> Duration;
    /// Executes one command; an immediate result comes back as an input.
    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, Self::Error>;
    /// Waits for the next input until `deadline` (`Ok(None)` when it passes).
    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, Self::Error>;
}

/// Runs `machine` over `io` until the session ends. The outer `Err` is an
/// I/O failure of the executor; the inner result is the protocol's verdict.
pub fn drive<M: Machine, E: Executor>(
    machine: &mut M,
    io: &mut E,
) -> Result<Result<Outcome, Blk3Error>, E::Error> {
    loop {
        while let Some(cmd) = machine.poll() {
            if let Command::Done(result) = cmd {
                return Ok(result);
            }
            if let Some(input) = io.execute(cmd)? {
                machine.handle(input, io.now());
            }
        }
        match io.next_input(machine.deadline())? {
            Some(input) => machine.handle(input, io.now()),
            None => machine.on_timeout(io.now()),
        }
    }
}
