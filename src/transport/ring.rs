//! The replication stream over an RDMA ring: the executors that run
//! `blk3::ring`'s two ends over a [`Fabric`] (real verbs or the
//! emulation), each on its own thread.
//!
//! Owns the ring's memory and its mechanics: the replica's registered
//! ring (header and stream area) and the copy of each span out of it; the
//! source's mirror of the ring, from which a span's Writes are posted at
//! the same offsets, and its header slots (one per message that may be in
//! flight, so a header a Write still reads is never rewritten); receives
//! posted before anything can arrive; waiting on the completion queue
//! (the fabric spins briefly, then blocks on its completion channel) and
//! being woken by the layer above when its stream has more ([`Waker`]).
//! What the stream is and where it goes is the caller's: the source reads
//! it through a [`RingFeed`], the replica writes it through a [`RingSink`].

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::fabric::{Fabric, FabricError, MemoryRegion};
use super::rdma::{completed, Completed, RdmaError};
use crate::blk3::ring::{Header, RingError, RingReceiver, RingSender, CREDITS, PRODUCER_LEN};
use crate::blk3::stream::{Next, STREAM_KEY_LEN};
use crate::blk3::token::{Kind, REPLID_LEN, SESSION_TOKEN_LEN};
use crate::blk3::{Token, TokenError, WriteOp, HANDSHAKE_TIMEOUT};
use crate::sys::buf::AlignedBuf;

pub use super::fabric::Waker;

/// Work-request ids of receives and sends; writes count from 1.
const RECV_TAG: u64 = 1 << 62;
const SEND_TAG: u64 = 1 << 61;
/// How long a side waits for its last Send (an `RDFL`) before it
/// disconnects.
const LINGER: Duration = Duration::from_secs(1);
/// How often the replica answers a held poll and does its housekeeping.
pub const TICK: Duration = Duration::from_secs(1);

/// Why a ring session ended; `L` is the stream log's error (the log is
/// the layer above's: a [`RingFeed`]'s or [`RingSink`]'s).
#[derive(Debug, thiserror::Error)]
pub enum RingRunError<L> {
    /// Below the protocol: a fabric call, a completion, a bad token, the
    /// session cancelled (as for snapshots).
    #[error(transparent)]
    Link(#[from] RdmaError),
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("the peer ended the session: {0}")]
    Peer(String),
    #[error("the peer sent {0}, which a ring session does not take")]
    Unexpected(Kind),
    #[error("the stream's log: {0}")]
    Log(L),
    #[error("the peer sent nothing for {0:?}")]
    Silent(Duration),
}

impl<L> From<FabricError> for RingRunError<L> {
    fn from(e: FabricError) -> RingRunError<L> {
        RingRunError::Link(e.into())
    }
}

impl<L> From<TokenError> for RingRunError<L> {
    fn from(e: TokenError) -> RingRunError<L> {
        RingRunError::Link(e.into())
    }
}

impl<L> RingRunError<L> {
    /// Why the stream went back to TCP
    /// (`kvsync_stream_fallback_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match self {
            RingRunError::Link(e) => e.fallback_reason(),
            RingRunError::Ring(e) => e.label(),
            RingRunError::Unexpected(_) => "protocol",
            RingRunError::Peer(_) => "peer",
            RingRunError::Log(_) => "log",
            RingRunError::Silent(_) => "timeout",
        }
    }

    fn cancelled(&self) -> bool {
        matches!(self, RingRunError::Link(RdmaError::Cancelled))
    }
}

/// Where a ring source reads the stream from.
pub trait RingFeed {
    /// The log's error.
    type Error;
    /// What follows `at` for a replica whose stream has replication id
    /// `replid` there: of the bytes the stream holds past `at`, `due(held)`
    /// may go now (none: [`Next::Wait`]).
    fn next(
        &mut self,
        at: u64,
        replid: &[u8; REPLID_LEN],
        due: &dyn Fn(u64) -> u64,
    ) -> Result<Next, Self::Error>;
    /// The replica's servers applied the stream up to `offset`.
    fn applied(&mut self, offset: u64);
    /// Where the session's window stands after each round (at least every
    /// [`TICK`]): the stream was sent up to `sent`, and `due(held)` bytes
    /// of what the stream holds past it may go now.
    fn window(&mut self, due: &dyn Fn(u64) -> u64, sent: u64);
}

/// Where a ring replica writes the stream.
pub trait RingSink {
    /// The log's error.
    type Error;
    /// The checked bytes of the stream from `offset`, to log before
    /// they are acknowledged.
    fn append(&mut self, offset: u64, bytes: Vec<u8>) -> Result<(), Self::Error>;
    /// The stream continues under replication id `replid` from `offset`.
    fn epoch(&mut self, offset: u64, replid: &[u8; REPLID_LEN]) -> Result<(), Self::Error>;
    /// What the servers fed from the log applied (`None`: none reports).
    fn applied(&mut self) -> Option<u64>;
    /// Housekeeping every [`TICK`], with the stream standing at `at`.
    fn tick(&mut self, at: u64) -> Result<(), Self::Error>;
}

/// A fault for tests: the source lies in the ring's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderLie {
    /// Writes another magic.
    Magic,
    /// Writes a `write_seq` before the span it announces.
    SequenceBack,
}

/// The queue pair and what every side does with it.
struct Qp<F> {
    qp: F,
    next_id: u64,
    /// Sends posted and not completed yet.
    sends: u32,
    cancel: CancellationToken,
}

impl<F: Fabric> Qp<F> {
    /// `qp`, its busy-poll capped at `spin`, ended by `cancel`.
    fn new(mut qp: F, spin: Duration, cancel: &CancellationToken) -> Qp<F> {
        qp.cap_spin(spin);
        Qp {
            qp,
            next_id: 0,
            sends: 0,
            cancel: cancel.clone(),
        }
    }

    fn post_recv(&mut self) -> Result<(), RdmaError> {
        self.next_id += 1;
        Ok(self.qp.post_recv(RECV_TAG | self.next_id)?)
    }

    fn send(&mut self, t: &Token) -> Result<(), RdmaError> {
        self.next_id += 1;
        self.qp.post_send(SEND_TAG | self.next_id, &t.encode())?;
        self.sends += 1;
        Ok(())
    }

    /// The next received token, within `wait` (`None`: none came, or a
    /// waker woke the wait). A receive is posted again before its token
    /// is handed on; a completed Send is counted off.
    fn next(&mut self, wait: Duration) -> Result<Option<Token>, RdmaError> {
        loop {
            if self.cancel.is_cancelled() {
                return Err(RdmaError::Cancelled);
            }
            let Some(c) = self.qp.poll(wait)? else {
                return Ok(None);
            };
            match completed(c)? {
                Completed::Recv(data) => {
                    self.post_recv()?;
                    return Ok(Some(Token::decode(&data)?));
                }
                Completed::Send => self.sends = self.sends.saturating_sub(1),
                Completed::Write(_) => {}
            }
        }
    }

    /// Ends the session: tells the peer why (when it failed and the QP
    /// still works), waits briefly for that to be delivered, disconnects.
    fn close<L: std::fmt::Display>(mut self, result: &Result<(), RingRunError<L>>) {
        if let Err(e) = result {
            let deliverable = !matches!(
                e,
                RingRunError::Link(RdmaError::Fabric(_) | RdmaError::Completion { .. })
                    | RingRunError::Peer(_)
            );
            if deliverable && self.sends < CREDITS {
                let reason = e.to_string();
                let _ = self.send(&Token::Rdfl { reason });
            }
        }
        super::fabric::linger_close(&mut self.qp, self.sends.into(), LINGER);
    }
}

/// The source's end of one ring session.
pub struct RingSource {
    pub key: [u8; STREAM_KEY_LEN],
    /// Where the session starts, and the replica's replication id there.
    pub from: u64,
    pub replid: [u8; REPLID_LEN],
    /// The credit window the offer gave.
    pub window: u64,
    /// How long the replica may leave a message unanswered.
    pub silent: Duration,
    pub cancel: CancellationToken,
    pub lie: Option<HeaderLie>,
    /// The longest the source spins on its completion queue.
    pub spin: Duration,
}

/// Serves a ring session on an accepted queue pair (its private data
/// proved), until it fails or is cancelled; returns where the stream
/// stood.
pub fn run_source<F: Fabric, L: std::fmt::Display>(
    qp: F,
    s: RingSource,
    feed: &mut dyn RingFeed<Error = L>,
) -> (u64, Result<(), RingRunError<L>>) {
    let mut qp = Qp::new(qp, s.spin, &s.cancel);
    let mut at = s.from;
    let result = match serve(&mut qp, &s, feed, &mut at) {
        Err(e) if e.cancelled() => Ok(()),
        r => r,
    };
    qp.close(&result);
    (at, result)
}

fn serve<F: Fabric, L>(
    qp: &mut Qp<F>,
    s: &RingSource,
    feed: &mut dyn RingFeed<Error = L>,
    at: &mut u64,
) -> Result<(), RingRunError<L>> {
    for _ in 0..CREDITS {
        qp.post_recv()?;
    }
    qp.qp.accept(HANDSHAKE_TIMEOUT)?;
    let Token::Mrin { addr, rkey, len } = expect(qp, HANDSHAKE_TIMEOUT, "waiting for MRINFO")?
    else {
        return Err(RingRunError::Unexpected(Kind::Mrin));
    };
    let mut tx = RingSender::new(s.key, s.from, s.window, len)?;
    let mut mirror = AlignedBuf::new(len as usize).map_err(|e| alloc("the ring's mirror", e))?;
    let mut slots = AlignedBuf::new(CREDITS as usize * PRODUCER_LEN)
        .map_err(|e| alloc("the header slots", e))?;
    // SAFETY: both buffers outlive the queue pair's use of them: they are
    // dropped after `close` disconnected it (they live in this frame, the
    // QP in the caller's). They are only read by the fabric.
    let (mirror_mr, slots_mr) = unsafe {
        (
            qp.qp.register(mirror.as_mut_ptr(), mirror.len(), false)?,
            qp.qp.register(slots.as_mut_ptr(), slots.len(), false)?,
        )
    };
    let mut replid = s.replid;
    let mut published = 0u64;
    let mut heard = Instant::now();
    loop {
        // Everything that may go now.
        loop {
            match feed
                .next(tx.sent(), &replid, &|held| tx.due(held))
                .map_err(RingRunError::Log)?
            {
                Next::Wait => break,
                Next::Epoch(id) => match tx.epoch(&id) {
                    Some(t) => {
                        qp.send(&t)?;
                        replid = id;
                    }
                    None => break,
                },
                Next::Bytes(bytes) => {
                    let Some(p) = tx.publish(&bytes) else { break };
                    let mut writes = Vec::with_capacity(2);
                    for w in &p.writes {
                        mirror[w.to as usize..w.to as usize + w.len]
                            .copy_from_slice(&bytes[w.from..w.from + w.len]);
                        published += 1;
                        writes.push(WriteOp {
                            id: published,
                            offset: w.to,
                            len: w.len as u64,
                            signaled: false,
                        });
                    }
                    qp.qp.post_writes(&mirror_mr, addr, rkey, &writes)?;
                    let slot = (published % CREDITS as u64) as usize * PRODUCER_LEN;
                    let header = &mut slots[slot..slot + PRODUCER_LEN];
                    header.copy_from_slice(&p.header);
                    match s.lie {
                        Some(HeaderLie::Magic) => header[..8].copy_from_slice(b"NOTARING"),
                        Some(HeaderLie::SequenceBack) => {
                            header[16..24].copy_from_slice(&s.from.saturating_sub(1).to_be_bytes())
                        }
                        None => {}
                    }
                    let one = MemoryRegion {
                        addr: slots_mr.addr + slot as u64,
                        len: PRODUCER_LEN as u64,
                        ..slots_mr
                    };
                    published += 1;
                    let write = WriteOp {
                        id: published,
                        offset: 0,
                        len: PRODUCER_LEN as u64,
                        signaled: false,
                    };
                    qp.qp.post_writes(&one, addr, rkey, &[write])?;
                    qp.send(&p.token)?;
                }
            }
        }
        if let Some(t) = tx.poll() {
            qp.send(&t)?;
        }
        *at = tx.sent();
        feed.window(&|held| tx.due(held), tx.sent());
        // Then the replica's answers, or the feed's wake-up.
        match qp.next(TICK)? {
            Some(Token::Rack { acked, applied }) => {
                heard = Instant::now();
                if let Some(applied) = tx.on_answer(acked, applied)? {
                    feed.applied(applied);
                }
            }
            Some(Token::Rdfl { reason }) => {
                return Err(RingRunError::Peer(
                    crate::peer_text::escape_controls(&reason).into_owned(),
                ))
            }
            Some(other) => return Err(RingRunError::Unexpected(other.kind())),
            None if tx.unanswered() > 0 && heard.elapsed() > s.silent => {
                return Err(RingRunError::Silent(s.silent))
            }
            None => {}
        }
    }
}

/// The replica's end of one ring session.
pub struct RingReplica {
    pub key: [u8; STREAM_KEY_LEN],
    /// Where the log stands: the session starts there.
    pub from: u64,
    pub window: u64,
    /// Bytes of the ring's stream area (a power of two).
    pub size: u64,
    pub token: [u8; SESSION_TOKEN_LEN],
    /// How long the source may send nothing (it polls every [`TICK`]).
    pub silent: Duration,
    pub cancel: CancellationToken,
    /// The longest the replica spins on its completion queue.
    pub spin: Duration,
}

/// Follows the stream through a ring on a dialled queue pair until the
/// session fails or is cancelled (`Ok`).
pub fn run_replica<F: Fabric, L: std::fmt::Display>(
    qp: F,
    r: RingReplica,
    sink: &mut dyn RingSink<Error = L>,
) -> Result<(), RingRunError<L>> {
    let mut qp = Qp::new(qp, r.spin, &r.cancel);
    let mut ring = None;
    let result = match follow(&mut qp, &r, sink, &mut ring) {
        Err(e) if e.cancelled() => Ok(()),
        r => r,
    };
    qp.close(&result);
    // The ring's memory goes after the queue pair stopped writing into it.
    drop(ring);
    result
}

fn follow<F: Fabric, L>(
    qp: &mut Qp<F>,
    r: &RingReplica,
    sink: &mut dyn RingSink<Error = L>,
    ring: &mut Option<AlignedBuf>,
) -> Result<(), RingRunError<L>> {
    let mut rx = RingReceiver::new(r.key, r.from, r.window, r.size)?;
    let mem =
        ring.insert(AlignedBuf::new(rx.ring_len() as usize).map_err(|e| alloc("the ring", e))?);
    mem[..PRODUCER_LEN].copy_from_slice(&rx.initial_header());
    let base = mem.as_mut_ptr();
    // SAFETY: the ring lives until `run_replica` dropped it, after the
    // queue pair is disconnected; from here it is only read and written
    // through raw pointers, never as a Rust reference the fabric could
    // write under.
    let region = unsafe { qp.qp.register(base, rx.ring_len() as usize, true)? };
    for _ in 0..CREDITS {
        qp.post_recv()?;
    }
    qp.qp.connect(&r.token, HANDSHAKE_TIMEOUT)?;
    qp.send(&Token::Mrin {
        addr: region.addr,
        rkey: region.rkey,
        len: region.len,
    })?;
    let mut heard = Instant::now();
    let mut next_tick = Instant::now() + TICK;
    loop {
        let wait = next_tick.saturating_duration_since(Instant::now());
        match qp.next(wait)? {
            Some(Token::Strm { offset, len, mac }) => {
                heard = Instant::now();
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                let mut header = [0u8; PRODUCER_LEN];
                // SAFETY: the header lies within the registered ring.
                unsafe { read_ring(base, 0, &mut header) };
                let spans = rx.on_span(offset, len, &Header::read(&header))?;
                let mut copy = vec![0u8; len as usize];
                for w in spans {
                    // SAFETY: `place` keeps every span within the ring.
                    unsafe { read_ring(base, w.to, &mut copy[w.from..w.from + w.len]) };
                }
                // Checked on the copy: what the source writes from now on
                // cannot change what was checked.
                rx.accept(offset, &copy, &mac)?;
                if !copy.is_empty() {
                    sink.append(offset, copy).map_err(RingRunError::Log)?;
                }
            }
            Some(Token::Sepo {
                offset,
                replid,
                mac,
            }) => {
                heard = Instant::now();
                rx.epoch(offset, &replid, &mac)?;
                sink.epoch(offset, &replid).map_err(RingRunError::Log)?;
            }
            Some(Token::Rdfl { reason }) => {
                return Err(RingRunError::Peer(
                    crate::peer_text::escape_controls(&reason).into_owned(),
                ))
            }
            Some(other) => return Err(RingRunError::Unexpected(other.kind())),
            None => {}
        }
        let tick = Instant::now() >= next_tick;
        if tick {
            next_tick = Instant::now() + TICK;
            if heard.elapsed() > r.silent {
                return Err(RingRunError::Silent(r.silent));
            }
            sink.tick(rx.next()).map_err(RingRunError::Log)?;
        }
        let applied = sink.applied();
        while let Some(t) = rx.answer(applied, tick) {
            qp.send(&t)?;
        }
    }
}

/// Copies `out.len()` bytes from `offset` of the ring at `base`.
///
/// # Safety
/// `offset + out.len()` must lie within the registered ring.
unsafe fn read_ring(base: *const u8, offset: u64, out: &mut [u8]) {
    // SAFETY: in bounds by the caller's word; the ring is never borrowed
    // as a Rust reference, so a concurrent write by the fabric tears at
    // worst these bytes, which the MAC then refuses.
    unsafe { std::ptr::copy_nonoverlapping(base.add(offset as usize), out.as_mut_ptr(), out.len()) }
}

/// Waits for the next token, which must come within `wait`.
fn expect<F: Fabric, L>(
    qp: &mut Qp<F>,
    wait: Duration,
    what: &'static str,
) -> Result<Token, RingRunError<L>> {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match qp.next(left)? {
            Some(Token::Rdfl { reason }) => {
                return Err(RingRunError::Peer(
                    crate::peer_text::escape_controls(&reason).into_owned(),
                ))
            }
            Some(t) => return Ok(t),
            None if left.is_zero() => return Err(FabricError::Timeout(wait, what).into()),
            // Woken: keep waiting.
            None => {}
        }
    }
}

fn alloc<L>(what: &'static str, source: std::io::Error) -> RingRunError<L> {
    FabricError::Call { call: what, source }.into()
}

#[cfg(test)]
mod tests;
