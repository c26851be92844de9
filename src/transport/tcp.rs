//! BLK3 over TCP: the blocking socket drivers of both roles.
//!
//! Tokens travel as frames (`u32` length + token); the replica's first frame
//! is `SESS` with the session token; the bulk is the raw snapshot bytes after
//! MRINFO. The source sends a file with `sendfile` (checked unchanged around
//! every piece) or a cache image from memory (`MSG_ZEROCOPY` when large); the
//! replica splices the stream into its [`Sink`]'s file. Under TLS the records
//! go through the kernel where it can (`ktls`), else through rustls. Each
//! session runs on its own thread; cancelling shuts the socket down.

use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pace::{MinRate, Pace, TooSlow};
use super::{drive, Executor, Faults, Serve, Sink};
use crate::blk3::token::{FRAME_HEADER_LEN, MAX_TOKEN_LEN, SESSION_TOKEN_LEN};
use crate::blk3::{
    size_scaled_timeout, Blk3Error, BulkMode, Command, Input, Outcome, Token, TokenError,
};
use crate::store::cache::CacheError;
use crate::store::served::{Served, SnapshotFile};
use crate::sys::buf::AlignedBuf;
use crate::sys::ratelimit::RateLimiter;
use crate::sys::splice::Pipe;
use crate::sys::zerocopy::ZeroCopySender;

/// Bytes per socket write/read in the bulk phase.
const BULK_CHUNK: usize = 4 << 20;
/// Bytes per socket read under TLS (rustls takes a record or less at a time).
const TLS_READ: usize = 256 << 10;
/// Snapshots at least this large are sent with `MSG_ZEROCOPY`.
const ZEROCOPY_MIN: u64 = 64 << 20;
/// How long a closing side waits for its peer to close too.
const DRAIN: Duration = Duration::from_secs(5);

/// A TCP data-plane failure.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// A socket call failed.
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    /// The peer closed the connection.
    #[error("peer closed the connection while {0}")]
    Closed(&'static str),
    /// The peer sent bytes that are not a token.
    #[error("bad frame from peer: {0}")]
    Frame(#[from] TokenError),
    /// The session was cancelled locally.
    #[error("cancelled")]
    Cancelled,
    /// The TLS handshake failed (an untrusted or misnamed certificate).
    #[error("{0}")]
    Tls(String),
    /// The first frame was not a session proof.
    #[error("expected a SESS frame first, got {0}")]
    NoHello(String),
    /// The snapshot could not be loaded or did not verify on the source.
    #[error("source snapshot: {0}")]
    Snapshot(#[from] CacheError),
    /// The peer fell below `data.min_rate`.
    #[error(transparent)]
    TooSlow(#[from] TooSlow),
    /// The driver was asked for something TCP does not do.
    #[error("command {0} is not available over TCP")]
    Unsupported(&'static str),
}

/// Stops a running session from another thread.
#[derive(Clone)]
pub struct CancelHandle {
    stream: Arc<TcpStream>,
    flag: Arc<AtomicBool>,
}

impl CancelHandle {
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// One data connection: framing, deadlines, cancellation, and TLS when
/// the session is encrypted (timeouts and shutdown act on the socket
/// below it).
pub struct Link {
    stream: TcpStream,
    /// TLS in user space.
    tls: Option<Box<Tls>>,
    /// TLS in the kernel: the socket seals and opens the records.
    kernel_tls: bool,
    /// The floor the bulk phase must keep, both ways.
    min_rate: MinRate,
    /// The bulk phase's pace, kept across its pieces.
    pace: Option<Pace>,
    /// Where the replica receives the bulk, kept across pieces.
    landing: Option<Landing>,
    started: Instant,
    /// A dialled link: how long its TCP handshake took.
    pub handshake: Option<Duration>,
    buf: Vec<u8>,
    cancelled: Arc<AtomicBool>,
    canceller: Arc<TcpStream>,
}

impl Link {
    /// A link whose bulk phase must keep `min_rate`.
    pub fn new(stream: TcpStream, min_rate: MinRate) -> std::io::Result<Link> {
        stream.set_nodelay(true)?;
        let canceller = Arc::new(stream.try_clone()?);
        Ok(Link {
            stream,
            tls: None,
            kernel_tls: false,
            min_rate,
            pace: None,
            landing: None,
            started: Instant::now(),
            handshake: None,
            buf: Vec::with_capacity(64),
            cancelled: Arc::new(AtomicBool::new(false)),
            canceller,
        })
    }

    /// Runs the link through `tls`, a connection whose handshake is done:
    /// its records in the kernel when `kernel` and the kernel takes them,
    /// in user space otherwise.
    pub fn with_tls(
        mut self,
        tls: impl Into<rustls::Connection>,
        kernel: bool,
    ) -> std::io::Result<Link> {
        let mut conn = tls.into();
        if kernel {
            match super::ktls::offload(&self.stream, conn) {
                Ok(early) => {
                    self.kernel_tls = true;
                    self.buf = early;
                    return Ok(self);
                }
                Err(super::ktls::KtlsError::Refused(why, back)) => {
                    tracing::warn!("TLS stays in user space on this connection: {why}");
                    conn = *back;
                }
                Err(e) => return Err(std::io::Error::other(e)),
            }
        }
        // Fewer, larger socket writes; records are 16 KiB either way.
        conn.set_buffer_limit(Some(BULK_CHUNK));
        // rustls reads a record or less per call: it reads from this
        // buffer, refilled by one large socket read (the same socket, so
        // the same timeouts).
        let rx = BufReader::with_capacity(TLS_READ, self.stream.try_clone()?);
        self.tls = Some(Box::new(Tls { conn, rx }));
        Ok(self)
    }

    /// Whether the link encrypts in user space (rustls).
    pub fn user_space_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Whether the link is encrypted, in user space or in the kernel.
    pub fn encrypted(&self) -> bool {
        self.kernel_tls || self.tls.is_some()
    }

    /// Whether the kernel seals and opens the link's records.
    pub fn kernel_tls(&self) -> bool {
        self.kernel_tls
    }

    /// Reads plaintext: from the socket, or decrypted from its TLS records.
    /// A socket timeout is returned as such (`WouldBlock`).
    fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Some(Tls { conn: tls, rx }) = self.tls.as_deref_mut() else {
            return (&self.stream).read(buf);
        };
        let mut sock = &self.stream;
        loop {
            match tls.reader().read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                done => return done,
            }
            let eof = tls.read_tls(rx)? == 0;
            tls.process_new_packets()
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            while tls.wants_write() {
                tls.write_tls(&mut sock)?;
            }
            if eof {
                return tls.reader().read(buf);
            }
        }
    }

    /// Reads plaintext until `buf` is full, the peer has been silent for
    /// the socket's timeout, or the stream ends (what came before a
    /// failure is returned first). Under TLS a single read gives a record
    /// at most: the receiver writes and checks chunks, not records.
    fn recv_full(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            match self.recv(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) if got > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    /// Writes some of `bytes`; returns how many it took. Under TLS they
    /// are taken into the connection's buffer once what was buffered
    /// before has reached the socket; a failure to send them shows at the
    /// next call or at [`Link::flush`].
    fn send_some(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let Some(Tls { conn: tls, .. }) = self.tls.as_deref_mut() else {
            return (&self.stream).write(bytes);
        };
        let mut sock = &self.stream;
        while tls.wants_write() {
            tls.write_tls(&mut sock)?;
        }
        let n = tls.writer().write(bytes)?;
        while tls.wants_write() {
            if tls.write_tls(&mut sock).is_err() {
                break;
            }
        }
        Ok(n)
    }

    /// Sends everything buffered (TLS).
    fn flush(&mut self) -> std::io::Result<()> {
        if let Some(Tls { conn: tls, .. }) = self.tls.as_deref_mut() {
            let mut sock = &self.stream;
            while tls.wants_write() {
                tls.write_tls(&mut sock)?;
            }
        }
        Ok(())
    }

    /// Bytes already read from the stream (past the session proof) that
    /// the link's next read must see first, before any that its TLS had
    /// decrypted.
    pub fn with_read_ahead(mut self, mut bytes: Vec<u8>) -> Link {
        bytes.append(&mut self.buf);
        self.buf = bytes;
        self
    }

    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle {
            stream: self.canceller.clone(),
            flag: self.cancelled.clone(),
        }
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn err(&self, op: &'static str, source: std::io::Error) -> TcpError {
        if self.cancelled.load(Ordering::SeqCst) {
            TcpError::Cancelled
        } else if let Some(why) = self
            .kernel_tls
            .then(|| super::ktls::explain(&source))
            .flatten()
        {
            TcpError::Io {
                op,
                source: std::io::Error::new(source.kind(), format!("{source}: {why}")),
            }
        } else {
            TcpError::Io { op, source }
        }
    }

    /// Sends one token frame.
    pub fn send(&mut self, t: &Token) -> Result<(), TcpError> {
        let frame = t.encode_frame();
        let mut left = &frame[..];
        while !left.is_empty() {
            match self.send_some(left) {
                Ok(0) => return Err(TcpError::Closed("sending a token")),
                Ok(n) => left = &left[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.err("send token", e)),
            }
        }
        self.flush().map_err(|e| self.err("send token", e))
    }

    /// Reads one token frame; `Ok(None)` when `deadline` (session time)
    /// passes first.
    pub fn read_token(&mut self, deadline: Option<Duration>) -> Result<Option<Token>, TcpError> {
        loop {
            if let Some((t, used)) = Token::decode_frame(&self.buf)? {
                self.buf.drain(..used);
                return Ok(Some(t));
            }
            let timeout = match deadline {
                Some(d) => match d.checked_sub(self.now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Ok(None),
                },
                None => None,
            };
            self.stream
                .set_read_timeout(timeout)
                .map_err(|e| self.err("set timeout", e))?;
            let mut chunk = [0u8; FRAME_HEADER_LEN + MAX_TOKEN_LEN];
            match self.recv(&mut chunk) {
                Ok(0) => {
                    return Err(if self.cancelled.load(Ordering::SeqCst) {
                        TcpError::Cancelled
                    } else {
                        TcpError::Closed("waiting for a token")
                    })
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.err("read token", e)),
            }
        }
    }

    /// Closes our direction and reads (discarding) until the peer closes
    /// its own, for at most [`DRAIN`]: what we sent last, an RDFL above
    /// all, reaches the peer instead of being reset away with data we left
    /// unread.
    fn close_and_drain(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
        let end = Instant::now() + DRAIN;
        let mut sink = [0u8; 64 << 10];
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            if self.stream.set_read_timeout(Some(left)).is_err() {
                break;
            }
            match (&self.stream).read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }

    /// The bulk phase's pace: started by its first piece, kept after.
    fn pace(&mut self) -> &mut Pace {
        let min_rate = self.min_rate;
        self.pace
            .get_or_insert_with(|| Pace::new(min_rate, Instant::now()))
    }

    /// Reads exactly `len` raw bulk bytes of piece `index` into `sink`,
    /// at no less than the link's minimum rate: spliced into its file
    /// through a pipe on a plain link, through a buffer under TLS (in user
    /// space or in the kernel).
    fn read_bulk(&mut self, len: u64, index: u32, sink: &mut dyn Sink) -> Result<(), TcpError> {
        let mut left = len;
        // Bytes read past the last frame belong to the bulk.
        if !self.buf.is_empty() {
            let n = (self.buf.len() as u64).min(left) as usize;
            sink.piece_bytes(index, &self.buf[..n], false);
            self.buf.drain(..n);
            left -= n as u64;
        }
        let mut into = match (self.landing.take(), self.encrypted()) {
            (Some(into), _) => into,
            (None, false) => Landing::Pipe(Pipe::new().map_err(|e| self.err("create a pipe", e))?),
            (None, true) => {
                Landing::Buffer(AlignedBuf::new(BULK_CHUNK).map_err(|e| self.err("allocate", e))?)
            }
        };
        // One wait per read at most a window: a stalled peer fails the
        // floor within two windows, with no syscall per read to set it.
        let wait = self.pace().longest_wait();
        self.stream
            .set_read_timeout(wait.or(Some(size_scaled_timeout(len))))
            .map_err(|e| self.err("set timeout", e))?;
        while left > 0 {
            let want = (left as usize).min(BULK_CHUNK);
            let read = match &mut into {
                Landing::Pipe(pipe) => pipe.fill_from(self.stream.as_raw_fd(), want),
                Landing::Buffer(chunk) => self.recv_full(&mut chunk[..want]),
            };
            let n = match read {
                Ok(0) => {
                    return Err(if self.cancelled.load(Ordering::SeqCst) {
                        TcpError::Cancelled
                    } else {
                        TcpError::Closed("receiving the snapshot")
                    })
                }
                Ok(n) => n,
                Err(e) if is_timeout(&e) => 0,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                Err(e) => return Err(self.err("receive snapshot", e)),
            };
            match &into {
                _ if n == 0 => {}
                Landing::Pipe(pipe) => sink
                    .piece_from_pipe(index, pipe, n)
                    .map_err(|e| self.err("receive snapshot", e))?,
                Landing::Buffer(chunk) => sink.piece_bytes(index, &chunk[..n], false),
            }
            left -= n as u64;
            self.pace().add(n as u64, Instant::now())?;
        }
        self.landing = Some(into);
        Ok(())
    }
}

/// An encrypted link's TLS state.
struct Tls {
    conn: rustls::Connection,
    /// What was read from the socket and not yet given to `conn`.
    rx: BufReader<TcpStream>,
}

/// Where a replica's link receives the bulk, kept across pieces.
enum Landing {
    /// A plain link: a pipe the kernel splices the socket's bytes through.
    Pipe(Pipe),
    /// An encrypted link: a buffer for the decrypted bytes (by rustls, or
    /// by the kernel straight into it).
    Buffer(AlignedBuf),
}

/// A blocking socket call that ran out of its own time (`SO_RCVTIMEO` /
/// `SO_SNDTIMEO`: EAGAIN). ETIMEDOUT is not one: it is a dead peer
/// (keepalive or `TCP_USER_TIMEOUT`).
fn is_timeout(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

/// Reads the replica's session proof (the first frame) on the runtime,
/// without a thread; returns it with any bytes read past it. A frame that
/// is not a token (garbage, oversize) fails at its header.
pub async fn read_hello(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<([u8; SESSION_TOKEN_LEN], Vec<u8>), TcpError> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + MAX_TOKEN_LEN);
    loop {
        if let Some((t, used)) = Token::decode_frame(&buf)? {
            return match t {
                Token::Sess { token } => Ok((token, buf.split_off(used))),
                other => Err(TcpError::NoHello(other.kind().to_string())),
            };
        }
        let mut chunk = [0u8; FRAME_HEADER_LEN + MAX_TOKEN_LEN];
        match stream.read(&mut chunk).await {
            Ok(0) => return Err(TcpError::Closed("waiting for the session proof")),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => {
                return Err(TcpError::Io {
                    op: "read session proof",
                    source: e,
                })
            }
        }
    }
}

/// Refuses a connection with a reason the replica will show.
pub async fn refuse(stream: &mut (impl tokio::io::AsyncWrite + Unpin), reason: &str) {
    use tokio::io::AsyncWriteExt;
    let frame = Token::Rdfl {
        reason: reason.to_string(),
    }
    .encode_frame();
    let _ = stream.write_all(&frame).await;
    let _ = stream.shutdown().await;
}

/// Source-side executor: tokens plus the pieces, from the file or memory.
struct SourceIo<'a> {
    link: &'a mut Link,
    snapshot: &'a Served,
    faults: &'a Faults,
    rate: &'a RateLimiter,
    progress: &'a AtomicU64,
    /// Zero-copy sends over a clone of the socket (large images, no TLS).
    zc: Option<ZeroCopySender<'a>>,
    /// Bulk bytes sent in this session (resent pieces count again).
    sent: u64,
    /// `corrupt_at` fires once: the piece it damaged goes out clean again.
    corrupted: bool,
    /// File bytes on their way into TLS records (encrypted sessions).
    plaintext: Vec<u8>,
    serve: &'a Serve<'a>,
}

impl Executor for SourceIo<'_> {
    type Error = TcpError;

    fn now(&self) -> Duration {
        self.link.now()
    }

    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, TcpError> {
        match cmd {
            Command::Send(Token::Bdon) => {
                self.finish_bulk()?;
                self.link.send(&Token::Bdon).map(|_| None)
            }
            Command::Send(t) => self.link.send(&t).map(|_| None),
            Command::PostRecv(_) => Ok(None),
            Command::PrepareSource => Ok(Some(Input::SourceReady)),
            Command::Claim { pieces } => Ok(Some(self.serve.claim(&pieces))),
            Command::StreamPiece { offset, len, .. } => {
                self.stream_piece(offset, len)?;
                Ok(None)
            }
            Command::PostWrites { .. } => Err(TcpError::Unsupported("PostWrites")),
            Command::PrepareReceive { .. }
            | Command::TakePiece { .. }
            | Command::MorePieces { .. }
            | Command::Verify => Err(TcpError::Unsupported("replica command")),
            Command::Done(_) => Ok(None),
        }
    }

    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, TcpError> {
        Ok(self.link.read_token(deadline)?.map(Input::Received))
    }
}

impl SourceIo<'_> {
    /// Sends the `len` bytes at `offset`: from the file (checked unchanged
    /// before and after), or from the image as soon as the cache has
    /// loaded them.
    fn stream_piece(&mut self, offset: u64, len: u64) -> Result<(), TcpError> {
        if let Served::File(file) = self.snapshot {
            file.check()?;
        }
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let chunk = (end - at).min(BULK_CHUNK as u64);
            let start = self.sent;
            let this_stream = self
                .faults
                .cut_stream
                .is_none_or(|k| k == self.serve.stream);
            let stop = [self.faults.stall_after, self.faults.cut_after]
                .into_iter()
                .flatten()
                .filter(|_| this_stream)
                .min();
            let part = match stop {
                Some(stop) if stop < start + chunk => stop.saturating_sub(start),
                _ => chunk,
            };
            self.send_range(at, part as usize)?;
            self.sent += part;
            at += part;
            self.progress.store(self.sent, Ordering::Relaxed);
            if part < chunk {
                return self.injected_stop(self.sent);
            }
        }
        if let Served::File(file) = self.snapshot {
            file.check()?;
        }
        Ok(())
    }

    /// The faults' damage to the `n` bytes at `at`: `(offset, xor)` pairs
    /// (a `corrupt_at` bit once, `forge_at`'s CRC-neutral bytes always).
    fn damage(&mut self, at: u64, n: usize) -> Vec<(u64, u8)> {
        let range = at..at + n as u64;
        let mut damage = Vec::new();
        if let Some(bad) = self.faults.corrupt_at {
            if !self.corrupted && range.contains(&bad) {
                self.corrupted = true;
                damage.push((bad, 0x01));
            }
        }
        if let Some(forge) = self.faults.forge_at {
            damage.extend(
                (forge..)
                    .zip(super::CRC32_NEUTRAL)
                    .filter(|(o, _)| range.contains(o)),
            );
        }
        damage
    }

    /// Sends the `n` bytes at `at`, paced by the agent's rate limit
    /// (a fault sends a damaged copy instead).
    fn send_range(&mut self, at: u64, n: usize) -> Result<(), TcpError> {
        let (snapshot, rate) = (self.snapshot, self.rate);
        let end = at + n as u64;
        let damage = self.damage(at, n);
        if !damage.is_empty() {
            let mut copy = vec![0u8; n];
            match snapshot {
                Served::Image(image) => {
                    copy.copy_from_slice(&image.wait_loaded(end as usize)?[at as usize..])
                }
                Served::File(file) => file.read_at(&mut copy, at)?,
            }
            for (offset, xor) in damage {
                copy[(offset - at) as usize] ^= xor;
            }
            return rate.paced(n, |r| self.send_grain(&copy[r], false));
        }
        match snapshot {
            // What is loaded goes at once (a relay image fills block by block).
            Served::Image(image) => {
                let mut at = at;
                while at < end {
                    let bytes = &image.wait_past(at as usize, end as usize)?[at as usize..];
                    rate.paced(bytes.len(), |r| self.send_grain(&bytes[r], true))?;
                    at += bytes.len() as u64;
                }
                Ok(())
            }
            // TLS encrypts in user space: read the range, then send it.
            Served::File(file) if self.link.user_space_tls() => {
                let mut plaintext = std::mem::take(&mut self.plaintext);
                plaintext.resize(n, 0);
                file.read_at(&mut plaintext, at)?;
                let sent = rate.paced(n, |r| self.send_grain(&plaintext[r], false));
                self.plaintext = plaintext;
                sent
            }
            Served::File(file) => {
                rate.paced(n, |r| self.send_file(file, at + r.start as u64, r.len()))
            }
        }
    }

    /// Sends `len` bytes of the file at `offset` with `sendfile`: the
    /// kernel moves them from its page cache, keeping the link's minimum
    /// rate as [`SourceIo::send_grain`] does.
    fn send_file(&mut self, file: &SnapshotFile, offset: u64, len: usize) -> Result<(), TcpError> {
        let mut off = offset as libc::off_t;
        let end = offset + len as u64;
        let sock = self.link.stream.as_raw_fd();
        while (off as u64) < end {
            let want = (end - off as u64) as usize;
            // SAFETY: both descriptors stay open for the call (the link and
            // the offer own them); the kernel writes only `off`.
            let n = unsafe { libc::sendfile(sock, file.fd(), &mut off, want) };
            if n > 0 {
                self.link.pace().add(n as u64, Instant::now())?;
                continue;
            }
            if n == 0 {
                // The file ended early: it was truncated under us.
                file.check()?;
                return Err(TcpError::Snapshot(CacheError::Changed {
                    path: file.path().to_owned(),
                }));
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                _ if is_timeout(&e) => self.link.pace().add(0, Instant::now())?,
                _ => return Err(self.link.err("send snapshot", e)),
            }
        }
        Ok(())
    }

    /// Before BDON: everything buffered is out, the kernel released every
    /// zero-copy page, and the whole image verified on load.
    fn finish_bulk(&mut self) -> Result<(), TcpError> {
        self.link
            .flush()
            .map_err(|e| self.link.err("send snapshot", e))?;
        if let Some(zc) = self.zc.as_mut() {
            zc.finish(size_scaled_timeout(self.snapshot.len()))
                .map_err(|e| self.link.err("wait for zero-copy completions", e))?;
            tracing::debug!(
                zero_copy = zc.enabled(),
                kernel_copied = zc.copied,
                "bulk sent"
            );
        }
        match self.snapshot {
            Served::Image(image) => {
                image.wait_complete()?;
            }
            Served::File(file) => file.check()?,
        }
        Ok(())
    }

    /// Sends one grain of the bulk (zero-copy when the session has it and
    /// `zero_copy`), keeping the link's minimum rate: every byte and every
    /// send timeout is measured.
    fn send_grain(&mut self, mut bytes: &[u8], zero_copy: bool) -> Result<(), TcpError> {
        while !bytes.is_empty() {
            let sent = match self.zc.as_mut().filter(|_| zero_copy) {
                Some(zc) => zc.send(bytes),
                None => self.link.send_some(bytes),
            };
            match sent {
                Ok(0) => return Err(TcpError::Closed("sending the snapshot")),
                Ok(n) => {
                    bytes = &bytes[n..];
                    self.link.pace().add(n as u64, Instant::now())?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => self.link.pace().add(0, Instant::now())?,
                Err(e) => return Err(self.link.err("send snapshot", e)),
            }
        }
        Ok(())
    }

    /// Applies `stall_after` / `cut_after` once `sent` bytes are out. The
    /// cut is an orderly close: the replica receives every byte sent before
    /// it, so tests can count what a resumed session moves.
    fn injected_stop(&mut self, sent: u64) -> Result<(), TcpError> {
        if self.faults.cut_after.is_some_and(|c| c <= sent) {
            tracing::warn!(sent, "fault injection: cutting the connection");
            let _ = self.link.flush();
            self.link.close_and_drain();
            return Err(TcpError::Closed("fault injection cut the connection"));
        }
        tracing::warn!(sent, "fault injection: stalling until the peer leaves");
        self.link
            .stream
            .set_read_timeout(None)
            .map_err(|e| self.link.err("set timeout", e))?;
        let mut sink = [0u8; 64];
        while matches!(self.link.stream.read(&mut sink), Ok(n) if n > 0) {}
        Err(TcpError::Closed("stalled by fault injection"))
    }
}

/// Serves one authenticated session: runs the source machine, streaming
/// the pieces the replica needs (of exactly the offered bytes) as the
/// cache loads them.
pub fn run_source(link: &mut Link, s: &Serve) -> Result<Result<Outcome, Blk3Error>, TcpError> {
    let len = s.snapshot.len();
    let mut machine = s.source(len, BulkMode::Stream);
    machine.start(link.now());
    // Set once, before the zero-copy sender reads it: a reader that stops
    // reading fails the floor within two windows. The pace itself starts
    // with the first piece, not with the handshake.
    let wait = Pace::new(link.min_rate, Instant::now()).longest_wait();
    link.stream
        .set_write_timeout(wait.or(Some(size_scaled_timeout(len))))
        .map_err(|e| link.err("set timeout", e))?;
    let stream = link
        .stream
        .try_clone()
        .map_err(|e| link.err("clone socket", e))?;
    // Only images above glibc's largest mmap threshold are sure to be
    // unmapped (never reused) when freed, so pages the kernel might still
    // hold after an aborted session can never carry other data. Zero-copy
    // sends the socket's own bytes: not under TLS (the kernel's TLS takes
    // no `MSG_ZEROCOPY`). A file goes by `sendfile`, which does not copy
    // either.
    let zero_copy =
        len >= ZEROCOPY_MIN && !link.encrypted() && matches!(s.snapshot, Served::Image(_));
    let mut io = SourceIo {
        link,
        snapshot: s.snapshot,
        faults: s.faults,
        rate: s.rate,
        progress: s.progress,
        zc: zero_copy.then(|| ZeroCopySender::new(&stream)),
        sent: 0,
        corrupted: false,
        plaintext: Vec::new(),
        serve: s,
    };
    let result = drive(&mut machine, &mut io);
    s.end(&machine);
    result
}

/// Replica-side executor: tokens, and the bulk stream into the sink.
struct ReplicaIo<'a> {
    link: &'a mut Link,
    sink: &'a mut dyn Sink,
}

impl Executor for ReplicaIo<'_> {
    type Error = TcpError;

    fn now(&self) -> Duration {
        self.link.now()
    }

    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, TcpError> {
        match cmd {
            Command::Send(t) => self.link.send(&t).map(|_| None),
            Command::PostRecv(_) => Ok(None),
            Command::PrepareReceive { len } => Ok(Some(match self.sink.prepare(len) {
                Ok(()) => Input::ReceiveReady { addr: 0, rkey: 0 },
                Err(reason) => Input::ReceiveFailed(reason.to_string()),
            })),
            Command::TakePiece { index, len, .. } => {
                self.link.read_bulk(len, index, self.sink)?;
                let result = super::verdict(self.sink.piece_done(index));
                Ok(Some(Input::PieceChecked { index, result }))
            }
            Command::MorePieces { wait } => Ok(Some(super::more_pieces(self.sink, wait))),
            Command::Verify => Ok(Some(Input::Verified(super::verdict(self.sink.verify())))),
            Command::PrepareSource
            | Command::Claim { .. }
            | Command::StreamPiece { .. }
            | Command::PostWrites { .. } => Err(TcpError::Unsupported("source command")),
            Command::Done(_) => Ok(None),
        }
    }

    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, TcpError> {
        Ok(self.link.read_token(deadline)?.map(Input::Received))
    }
}

/// Runs a replica session on a connected link: proves the session with
/// `token`, then receives `offered_len` bytes into `sink`. The outer `Err`
/// is the connection's failure; the inner result the protocol's verdict.
pub fn run_replica(
    link: &mut Link,
    token: [u8; SESSION_TOKEN_LEN],
    offered_len: u64,
    sink: &mut dyn Sink,
) -> Result<Result<Outcome, Blk3Error>, TcpError> {
    let mut machine = sink.want().replica(offered_len);
    machine.start(link.now());
    link.send(&Token::Sess { token })?;
    let result = drive(&mut machine, &mut ReplicaIo { link, sink });
    if matches!(result, Ok(Err(_))) {
        // We sent RDFL while the source may still be sending pieces.
        link.close_and_drain();
    }
    result
}
