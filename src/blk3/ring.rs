//! The rules of a stream session over an RDMA ring, free of I/O.
//!
//! The replica registers a ring: a [`HEADER_LEN`]-byte header, then
//! `size` bytes of stream (a power of two), and tells the source where it
//! is (`MRIN`). The source writes each frame of the stream (the same
//! frames, MACs and credit window as over TCP: [`super::stream`]) into the
//! ring at `offset % size` with one-sided RDMA Writes, split in two where
//! it wraps, then writes the header's producer half ([`Header`]: magic,
//! size, `write_seq` = the stream offset written up to, `head` =
//! `write_seq % size`), then Sends the frame's `STRM` token. RC executes a
//! queue pair's work in order, so when the replica's receive completes,
//! the span and the header are in its memory (the header perhaps already
//! further on: the source pipelines spans). The replica checks the header
//! against the token (a header with a wrong magic or size, a sequence
//! that goes back or stands before the token's end, is a lying or broken
//! peer: the session ends), copies the span out of the ring and checks the
//! MAC on its copy (the source can no longer change what was checked),
//! logs it, and answers.
//!
//! Every message gets exactly one answer, `RACK` (what the log holds, which
//! frees ring and window, and what the servers fed from it applied): data
//! and epoch messages at once, and an empty `STRM` (a poll, which the
//! source sends whenever nothing of its is unanswered) when the applied
//! offset changes or the replica's tick comes. So each side's messages in
//! flight are bounded by the other's: the source keeps at most
//! [`CREDITS`]` - 1` unanswered, the replica keeps [`CREDITS`] receives
//! posted and reposts each before it answers, the source keeps
//! [`CREDITS`] posted for answers, and the last receive on each side is
//! left for a closing `RDFL`. No Send meets a missing receive.
//!
//! A new session (after any failure) starts where the replica's log ends,
//! which is what it acknowledged: nothing skipped, nothing applied twice.

use super::stream::{data_mac, Receiver, Sender, StreamError, MAX_FRAME, STREAM_KEY_LEN};
use super::token::{Token, REPLID_LEN};

/// Bytes of the ring's header, before its stream bytes.
pub const HEADER_LEN: u64 = 64;
/// The header's first field.
pub const MAGIC: [u8; 8] = *b"KVSRING1";
/// Bytes of the header the source writes: magic, size, `write_seq`, `head`.
pub const PRODUCER_LEN: usize = 32;
/// The smallest and largest ring (bytes of stream).
pub const MIN_RING: u64 = MAX_FRAME as u64;
pub const MAX_RING: u64 = 1 << 30;
/// Receives each side keeps posted for the other's messages.
pub const CREDITS: u32 = 16;
/// A `RACK`'s applied offset when no server fed from the replica's log
/// reports one.
pub const NONE_APPLIED: u64 = u64::MAX;

/// A ring's header as it reads in memory (network byte order):
/// `magic`, `size`, `write_seq`, `head` (the source's, written after each
/// span), then `ack_seq`, `tail` (the replica's own, for whoever inspects
/// the memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub magic: [u8; 8],
    pub size: u64,
    pub write_seq: u64,
    pub head: u64,
}

impl Header {
    /// The producer half the source writes once the stream stands at
    /// `write_seq`.
    pub fn producer(size: u64, write_seq: u64) -> [u8; PRODUCER_LEN] {
        let mut b = [0u8; PRODUCER_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..16].copy_from_slice(&size.to_be_bytes());
        b[16..24].copy_from_slice(&write_seq.to_be_bytes());
        b[24..32].copy_from_slice(&(write_seq % size).to_be_bytes());
        b
    }

    /// The consumer half the replica keeps: `ack_seq`, `tail`.
    pub fn consumer(size: u64, ack_seq: u64) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&ack_seq.to_be_bytes());
        b[8..].copy_from_slice(&(ack_seq % size).to_be_bytes());
        b
    }

    /// Reads the producer half.
    pub fn read(b: &[u8; PRODUCER_LEN]) -> Header {
        let be64 = |r: std::ops::Range<usize>| u64::from_be_bytes(b[r].try_into().expect("8"));
        Header {
            magic: b[..8].try_into().expect("8 bytes"),
            size: be64(8..16),
            write_seq: be64(16..24),
            head: be64(24..32),
        }
    }
}

/// Why a ring session's peer is not followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error("the replica's ring of {0} bytes is not a header and a power of two from {MIN_RING} to {MAX_RING} bytes")]
    BadRing(u64),
    #[error(
        "the ring's header does not start with the ring magic: its writer is not a kvsync source"
    )]
    BadMagic,
    #[error("the ring's header says {said} where the session has {expected}")]
    BadHeader { said: String, expected: String },
    #[error("the source's write sequence went from {was} back to {now}")]
    SequenceBack { was: u64, now: u64 },
    #[error("the replica answered a message the source never sent")]
    Unasked,
    #[error("the source sent a message with none of its own answered for {CREDITS} messages")]
    NoCredit,
}

impl RingError {
    /// Its `reason` label (`kvsync_stream_refused_total`).
    pub fn label(&self) -> &'static str {
        match self {
            RingError::Stream(e) => e.label(),
            RingError::BadRing(_) => "bad_ring",
            RingError::BadMagic | RingError::BadHeader { .. } | RingError::SequenceBack { .. } => {
                "bad_header"
            }
            RingError::Unasked | RingError::NoCredit => "no_credit",
        }
    }
}

/// The ring's stream size from the length the replica registered.
fn ring_size(ring_len: u64) -> Result<u64, RingError> {
    let size = ring_len.wrapping_sub(HEADER_LEN);
    if ring_len < HEADER_LEN || !size.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&size) {
        return Err(RingError::BadRing(ring_len));
    }
    Ok(size)
}

/// One RDMA Write of a span: `len` bytes from `from` bytes into the span,
/// to `to` bytes into the ring (header included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingWrite {
    pub from: usize,
    pub to: u64,
    pub len: usize,
}

/// Where the stream's bytes `[offset, offset + len)` lie in a ring of
/// `size`: one write, or two where they wrap.
pub fn place(size: u64, offset: u64, len: usize) -> Vec<RingWrite> {
    let start = offset % size;
    let first = (len as u64).min(size - start) as usize;
    let mut writes = vec![RingWrite {
        from: 0,
        to: HEADER_LEN + start,
        len: first,
    }];
    if first < len {
        writes.push(RingWrite {
            from: first,
            to: HEADER_LEN,
            len: len - first,
        });
    }
    writes
}

/// A span to publish: its writes, then the header's producer half at
/// offset 0, then the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub writes: Vec<RingWrite>,
    pub header: [u8; PRODUCER_LEN],
    pub token: Token,
    /// Bytes of the stream it carries.
    pub len: usize,
}

/// The source's end of a ring session.
#[derive(Debug, Clone)]
pub struct RingSender {
    tx: Sender,
    key: [u8; STREAM_KEY_LEN],
    size: u64,
    /// Messages sent and not answered.
    unanswered: u32,
}

impl RingSender {
    /// A session from `from` into the replica's ring of `ring_len` bytes
    /// (its `MRIN`), with at most `window` bytes unacknowledged (cut to
    /// the ring: the source never overwrites what was not acknowledged).
    pub fn new(
        key: [u8; STREAM_KEY_LEN],
        from: u64,
        window: u64,
        ring_len: u64,
    ) -> Result<RingSender, RingError> {
        let size = ring_size(ring_len)?;
        Ok(RingSender {
            tx: Sender::new(key, from, window.min(size)),
            key,
            size,
            unanswered: 0,
        })
    }

    /// The offset the next span starts at.
    pub fn sent(&self) -> u64 {
        self.tx.sent()
    }

    /// The offset the replica's log holds.
    pub fn acked(&self) -> u64 {
        self.tx.acked()
    }

    /// Bytes of stream that may go now (0 without a message credit).
    pub fn room(&self) -> u64 {
        if self.unanswered + 1 < CREDITS {
            self.tx.room()
        } else {
            0
        }
    }

    /// How many of the `available` bytes past [`RingSender::sent`] the next
    /// message carries: [`Sender::due`], at most a frame, none without a
    /// message credit.
    pub fn due(&self, available: u64) -> u64 {
        match self.room() {
            0 => 0,
            _ => self.tx.due(available).min(MAX_FRAME as u64),
        }
    }

    /// Messages sent and not answered.
    pub fn unanswered(&self) -> u32 {
        self.unanswered
    }

    /// The span for the front of `bytes` (the stream from
    /// [`RingSender::sent`]): as much as the window, the ring and a frame
    /// allow; `None` when nothing may go.
    pub fn publish(&mut self, bytes: &[u8]) -> Option<Publish> {
        if self.room() == 0 {
            return None;
        }
        let (token, len) = self.tx.frame(bytes)?;
        self.unanswered += 1;
        Some(Publish {
            writes: place(self.size, self.tx.sent() - len as u64, len),
            header: Header::producer(self.size, self.tx.sent()),
            token,
            len,
        })
    }

    /// The change to replication id `replid` where the stream stands,
    /// when a message may go.
    pub fn epoch(&mut self, replid: &[u8; REPLID_LEN]) -> Option<Token> {
        (self.unanswered + 1 < CREDITS).then(|| {
            self.unanswered += 1;
            self.tx.epoch(replid)
        })
    }

    /// A poll (an empty `STRM`) when no message is unanswered: the
    /// replica answers it when its servers applied more, or on its tick.
    pub fn poll(&mut self) -> Option<Token> {
        (self.unanswered == 0).then(|| {
            self.unanswered = 1;
            let offset = self.tx.sent();
            Token::Strm {
                offset,
                len: 0,
                mac: data_mac(&self.key, offset, &[]),
            }
        })
    }

    /// The replica's answer to one message: credit back, and what its
    /// servers applied (`None`: no server reports).
    pub fn on_answer(&mut self, acked: u64, applied: u64) -> Result<Option<u64>, RingError> {
        if self.unanswered == 0 {
            return Err(RingError::Unasked);
        }
        self.tx.on_ack(acked)?;
        self.unanswered -= 1;
        if applied == NONE_APPLIED {
            return Ok(None);
        }
        Ok(Some(self.tx.on_applied(applied)?))
    }
}

/// The replica's end of a ring session.
#[derive(Debug, Clone)]
pub struct RingReceiver {
    rx: Receiver,
    size: u64,
    /// The source's `write_seq` last seen.
    write_seq: u64,
    /// Messages taken and not answered yet.
    owed: u32,
    /// A poll waits for its answer.
    held: bool,
    /// The applied offset last answered (`None`: none yet).
    reported: Option<u64>,
}

impl RingReceiver {
    /// A session from `from` into a ring of `size` bytes of stream, with
    /// at most `window` bytes unacknowledged (cut to the ring, as the
    /// source cuts it).
    pub fn new(
        key: [u8; STREAM_KEY_LEN],
        from: u64,
        window: u64,
        size: u64,
    ) -> Result<RingReceiver, RingError> {
        ring_size(HEADER_LEN + size)?;
        Ok(RingReceiver {
            rx: Receiver::new(key, from, window.min(size)),
            size,
            write_seq: from,
            owed: 0,
            held: false,
            reported: None,
        })
    }

    /// Bytes to register: the header and the ring.
    pub fn ring_len(&self) -> u64 {
        HEADER_LEN + self.size
    }

    /// The header the ring starts with, before the source writes its own:
    /// the magic, the size and the session's start.
    pub fn initial_header(&self) -> [u8; PRODUCER_LEN] {
        Header::producer(self.size, self.write_seq)
    }

    /// The offset the next span must start at (what the log will hold).
    pub fn next(&self) -> u64 {
        self.rx.next()
    }

    /// One message arrived (the receive for it is posted again first).
    fn took(&mut self) -> Result<(), RingError> {
        if self.owed + u32::from(self.held) + 1 >= CREDITS {
            return Err(RingError::NoCredit);
        }
        Ok(())
    }

    /// A `STRM` arrived, with the header as the ring's memory has it now:
    /// where its bytes lie in the ring, to copy out and [`accept`]. A poll
    /// (no bytes) is held for its answer.
    ///
    /// [`accept`]: RingReceiver::accept
    pub fn on_span(
        &mut self,
        offset: u64,
        len: u32,
        header: &Header,
    ) -> Result<Vec<RingWrite>, RingError> {
        if len == 0 && self.held {
            return Err(RingError::NoCredit);
        }
        self.took()?;
        self.rx.header(offset, len)?;
        if header.magic != MAGIC {
            return Err(RingError::BadMagic);
        }
        let end = offset + len as u64;
        if header.write_seq < self.write_seq {
            return Err(RingError::SequenceBack {
                was: self.write_seq,
                now: header.write_seq,
            });
        }
        // The source may have written more spans since this one: its
        // header stands at or past this span's end, never before it.
        let (size, seq, head) = (header.size, header.write_seq, header.head);
        if size != self.size || seq < end || head != seq % self.size {
            return Err(RingError::BadHeader {
                said: format!("size {size} write_seq {seq} head {head}"),
                expected: format!(
                    "size {} write_seq {end} or more, head write_seq % size",
                    self.size
                ),
            });
        }
        self.write_seq = header.write_seq;
        if len == 0 {
            self.held = true;
            return Ok(Vec::new());
        }
        Ok(place(self.size, offset, len as usize))
    }

    /// Takes a span's bytes as copied out of the ring: checked against its
    /// MAC, then the stream moves past them and an answer is owed.
    pub fn accept(&mut self, offset: u64, bytes: &[u8], mac: &[u8; 32]) -> Result<(), RingError> {
        self.rx.accept(offset, bytes, mac)?;
        if !bytes.is_empty() {
            self.owed += 1;
        }
        Ok(())
    }

    /// Takes a replication-id change; an answer is owed.
    pub fn epoch(
        &mut self,
        offset: u64,
        replid: &[u8; REPLID_LEN],
        mac: &[u8; 32],
    ) -> Result<(), RingError> {
        self.took()?;
        self.rx.epoch(offset, replid, mac)?;
        self.owed += 1;
        Ok(())
    }

    /// The next answer to send, once the log holds what was taken:
    /// one for each data or epoch message, and the held poll's when what
    /// the servers applied (`applied`; `None`: no server reports) changed
    /// since the last answer, or on the `tick`.
    pub fn answer(&mut self, applied: Option<u64>, tick: bool) -> Option<Token> {
        let applied = applied.map_or(NONE_APPLIED, |a| a.min(self.rx.next()));
        let news = self.reported != Some(applied);
        if self.owed > 0 {
            self.owed -= 1;
        } else if self.held && (news || tick) {
            self.held = false;
        } else {
            return None;
        }
        let Token::Sack { offset: acked, .. } = self.rx.ack() else {
            unreachable!("an ack is a SACK")
        };
        // `applied` is already cut to `next`, which `acked` is now.
        self.reported = Some(applied);
        Some(Token::Rack { acked, applied })
    }
}

#[cfg(test)]
mod tests;
