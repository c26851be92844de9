//! The rules of a stream session, free of I/O. The source sends the
//! replication stream from the offset the replica asked for, as frames
//! (`STRM`: offset, length, MAC, then the bytes) and replication-id changes
//! (`SEPO`), each under a MAC keyed by the session's stream key, which only
//! the authenticated control plane carried: a proxy on the data path can
//! neither forge nor alter a frame. The replica takes frames strictly in
//! order (a frame must start where the stream stands: nothing skipped,
//! nothing applied twice) and acknowledges what its log holds (`SACK`); the
//! source never has more than a credit window unacknowledged, and a
//! replica refuses a source that sends past it or acknowledges what it
//! never sent. The replica also reports what the servers fed downstream of
//! it have applied (`SAPP`), at most what it acknowledged: the source's
//! view of where its replica servers stand. A source with more to send
//! than its window holds sends it in full frames ([`Sender::due`]): it
//! waits for a frame's worth of credit rather than refilling the window a
//! sliver at a time as small acknowledgements come back.

use super::token::{Token, REPLID_LEN};

/// Bytes of a stream session's MAC key.
pub const STREAM_KEY_LEN: usize = 32;
/// The most bytes one `STRM` frame carries.
pub const MAX_FRAME: u32 = 1 << 20;

/// What follows a point of the stream, for a reader of it (a source's
/// session, a feed).
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// The reader has everything there is, or may take none of the rest
    /// yet.
    Wait,
    /// The stream changes replication id here.
    Epoch([u8; REPLID_LEN]),
    /// The stream's bytes from the point asked for.
    Bytes(Vec<u8>),
}

/// The MAC of `bytes` of the stream from `offset`.
pub fn data_mac(key: &[u8; STREAM_KEY_LEN], offset: u64, bytes: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"STRM");
    h.update(&offset.to_be_bytes());
    h.update(&(bytes.len() as u32).to_be_bytes());
    h.update(bytes);
    *h.finalize().as_bytes()
}

/// The MAC of a replication-id change at `offset`.
pub fn epoch_mac(key: &[u8; STREAM_KEY_LEN], offset: u64, replid: &[u8; REPLID_LEN]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"SEPO");
    h.update(&offset.to_be_bytes());
    h.update(replid);
    *h.finalize().as_bytes()
}

/// The MAC of an acknowledgement (`SACK`: the replica's log holds up to
/// `offset`; `SAPP`: its servers applied up to it).
pub fn ack_mac(key: &[u8; STREAM_KEY_LEN], magic: &[u8; 4], offset: u64) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(magic);
    h.update(&offset.to_be_bytes());
    *h.finalize().as_bytes()
}

/// Why a stream session's peer is not followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error(
        "the frame at offset {offset} fails its MAC: its bytes are not the ones the source sent"
    )]
    Forged { offset: u64 },
    #[error("an acknowledgement of offset {offset} fails its MAC: the replica did not send it")]
    ForgedAck { offset: u64 },
    #[error("a frame at offset {offset} does not continue the stream, which stands at {expected}")]
    Discontinuous { offset: u64, expected: u64 },
    #[error("the source sent up to offset {end}, past its credit window ({window} bytes after the acknowledged {acked})")]
    OverWindow { end: u64, acked: u64, window: u64 },
    #[error("a frame of {0} bytes is larger than a frame may be ({MAX_FRAME})")]
    TooLarge(u32),
    #[error("the replica acknowledged offset {ack}, outside what was sent ({acked}..={sent})")]
    BadAck { ack: u64, acked: u64, sent: u64 },
    #[error("the replica reported offset {applied} applied downstream, past what it acknowledged as logged ({acked})")]
    BadApplied { applied: u64, acked: u64 },
}

impl StreamError {
    /// Its `reason` label (`kvsync_stream_refused_total`).
    pub fn label(&self) -> &'static str {
        match self {
            StreamError::Forged { .. } | StreamError::ForgedAck { .. } => "forged",
            StreamError::Discontinuous { .. } => "discontinuous",
            StreamError::OverWindow { .. } | StreamError::TooLarge(_) => "over_window",
            StreamError::BadAck { .. } | StreamError::BadApplied { .. } => "bad_ack",
        }
    }
}

/// The source's end: where the stream stands, what was acknowledged.
#[derive(Debug, Clone)]
pub struct Sender {
    key: [u8; STREAM_KEY_LEN],
    sent: u64,
    acked: u64,
    window: u64,
}

impl Sender {
    /// A session that sends from `from` with `window` bytes of credit.
    pub fn new(key: [u8; STREAM_KEY_LEN], from: u64, window: u64) -> Sender {
        Sender {
            key,
            sent: from,
            acked: from,
            window,
        }
    }

    /// The offset the next frame starts at.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// The offset the replica acknowledged last.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Bytes that may be sent before the next acknowledgement.
    pub fn room(&self) -> u64 {
        self.window.saturating_sub(self.sent - self.acked)
    }

    /// How many of the `available` bytes past [`Sender::sent`] to send now:
    /// all of them when they fit the room; otherwise the room, once it
    /// holds a full frame or half the window; else none, and the sender
    /// waits for acknowledgements. Without the wait a window cut into
    /// small frames (a live tail of small records when the replica
    /// stopped) would stay cut: each acknowledgement of a small frame
    /// would free room for just one more small frame, and a replica far
    /// behind would catch up a sliver per round trip (the silly window of
    /// TCP, RFC 813).
    pub fn due(&self, available: u64) -> u64 {
        let room = self.room();
        let worth = available.min(MAX_FRAME as u64).min(self.window.div_ceil(2));
        match room >= worth {
            true => room.min(available),
            false => 0,
        }
    }

    /// The frame for the front of `bytes` (the stream from [`Sender::sent`])
    /// and how many of them it carries: as many as the room and a frame
    /// allow, `None` when there is no room.
    pub fn frame(&mut self, bytes: &[u8]) -> Option<(Token, usize)> {
        let n = (bytes.len() as u64).min(self.room()).min(MAX_FRAME as u64) as usize;
        if n == 0 {
            return None;
        }
        let offset = self.sent;
        let mac = data_mac(&self.key, offset, &bytes[..n]);
        self.sent += n as u64;
        Some((
            Token::Strm {
                offset,
                len: n as u32,
                mac,
            },
            n,
        ))
    }

    /// The change to replication id `replid` at the stream's position.
    pub fn epoch(&self, replid: &[u8; REPLID_LEN]) -> Token {
        Token::Sepo {
            offset: self.sent,
            replid: *replid,
            mac: epoch_mac(&self.key, self.sent, replid),
        }
    }

    /// A `SACK`: the replica's acknowledgement under its MAC
    /// ([`Sender::on_ack`]).
    pub fn on_sack(&mut self, ack: u64, mac: &[u8; 32]) -> Result<(), StreamError> {
        if ack_mac(&self.key, b"SACK", ack) != *mac {
            return Err(StreamError::ForgedAck { offset: ack });
        }
        self.on_ack(ack)
    }

    /// A `SAPP`: the replica's report under its MAC ([`Sender::on_applied`]).
    pub fn on_sapp(&self, applied: u64, mac: &[u8; 32]) -> Result<u64, StreamError> {
        if ack_mac(&self.key, b"SAPP", applied) != *mac {
            return Err(StreamError::ForgedAck { offset: applied });
        }
        self.on_applied(applied)
    }

    /// The replica's acknowledgement: it never goes back, nor past what
    /// was sent.
    pub fn on_ack(&mut self, ack: u64) -> Result<(), StreamError> {
        if ack < self.acked || ack > self.sent {
            return Err(StreamError::BadAck {
                ack,
                acked: self.acked,
                sent: self.sent,
            });
        }
        self.acked = ack;
        Ok(())
    }

    /// The replica's report of what the servers fed downstream applied:
    /// never past what it acknowledged (it may go back, when a downstream
    /// that lags joins).
    pub fn on_applied(&self, applied: u64) -> Result<u64, StreamError> {
        if applied > self.acked {
            return Err(StreamError::BadApplied {
                applied,
                acked: self.acked,
            });
        }
        Ok(applied)
    }
}

/// The replica's end: where the stream stands, what it acknowledged.
#[derive(Debug, Clone)]
pub struct Receiver {
    key: [u8; STREAM_KEY_LEN],
    next: u64,
    acked: u64,
    window: u64,
    reported: Option<u64>,
}

impl Receiver {
    /// A session that receives from `from` with `window` bytes of credit.
    pub fn new(key: [u8; STREAM_KEY_LEN], from: u64, window: u64) -> Receiver {
        Receiver {
            key,
            next: from,
            acked: from,
            window,
            reported: None,
        }
    }

    /// The offset the next frame must start at.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Checks a `STRM` header before its bytes are read: it continues the
    /// stream, fits a frame and stays within the credit window.
    pub fn header(&self, offset: u64, len: u32) -> Result<(), StreamError> {
        if len > MAX_FRAME {
            return Err(StreamError::TooLarge(len));
        }
        if offset != self.next {
            return Err(StreamError::Discontinuous {
                offset,
                expected: self.next,
            });
        }
        let end = offset + len as u64;
        if end - self.acked > self.window {
            return Err(StreamError::OverWindow {
                end,
                acked: self.acked,
                window: self.window,
            });
        }
        Ok(())
    }

    /// Takes the frame's bytes once they are read: checked against the
    /// header and the MAC, then the stream moves past them.
    pub fn accept(&mut self, offset: u64, bytes: &[u8], mac: &[u8; 32]) -> Result<(), StreamError> {
        self.header(offset, bytes.len() as u32)?;
        if data_mac(&self.key, offset, bytes) != *mac {
            return Err(StreamError::Forged { offset });
        }
        self.next += bytes.len() as u64;
        Ok(())
    }

    /// Takes a replication-id change, which must stand where the stream
    /// does and carry its MAC.
    pub fn epoch(
        &self,
        offset: u64,
        replid: &[u8; REPLID_LEN],
        mac: &[u8; 32],
    ) -> Result<(), StreamError> {
        if offset != self.next {
            return Err(StreamError::Discontinuous {
                offset,
                expected: self.next,
            });
        }
        if epoch_mac(&self.key, offset, replid) != *mac {
            return Err(StreamError::Forged { offset });
        }
        Ok(())
    }

    /// The acknowledgement of everything taken (the log holds it): credit
    /// for another window.
    pub fn ack(&mut self) -> Token {
        self.acked = self.next;
        Token::Sack {
            offset: self.next,
            mac: ack_mac(&self.key, b"SACK", self.next),
        }
    }

    /// The report of what the servers fed downstream applied (`applied`,
    /// cut to what was acknowledged: a server may stand past a log cut
    /// back after damage), when it changed since the last.
    pub fn applied(&mut self, applied: u64) -> Option<Token> {
        let offset = applied.min(self.acked);
        (self.reported != Some(offset)).then(|| {
            self.reported = Some(offset);
            Token::Sapp {
                offset,
                mac: ack_mac(&self.key, b"SAPP", offset),
            }
        })
    }

    /// Bytes taken and not yet acknowledged.
    pub fn unacked(&self) -> u64 {
        self.next - self.acked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; STREAM_KEY_LEN] = [7; STREAM_KEY_LEN];

    fn strm(t: &Token) -> (u64, u32, [u8; 32]) {
        match t {
            Token::Strm { offset, len, mac } => (*offset, *len, *mac),
            other => panic!("not STRM: {other:?}"),
        }
    }

    #[test]
    fn frames_flow_within_the_window_and_acks_give_credit_back() {
        let stream: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let mut tx = Sender::new(KEY, 1000, 4096);
        let mut rx = Receiver::new(KEY, 1000, 4096);
        let mut at = 0;
        let mut got = Vec::new();
        while at < stream.len() {
            while let Some((t, n)) = tx.frame(&stream[at..]) {
                let (offset, len, mac) = strm(&t);
                assert_eq!(len as usize, n);
                rx.header(offset, len).unwrap();
                rx.accept(offset, &stream[at..at + n], &mac).unwrap();
                got.extend_from_slice(&stream[at..at + n]);
                at += n;
            }
            assert!(tx.sent() - tx.acked() <= 4096, "never past the window");
            let Token::Sack { offset, mac } = rx.ack() else {
                unreachable!()
            };
            tx.on_sack(offset, &mac).unwrap();
        }
        assert_eq!(got, stream);
        assert_eq!(tx.sent(), 11_000);
    }

    #[test]
    fn a_window_cut_into_small_frames_is_refilled_in_full_frames() {
        const WINDOW: u64 = 4 << 20;
        let mut tx = Sender::new(KEY, 0, WINDOW);
        let mut rx = Receiver::new(KEY, 0, WINDOW);
        // A live tail: each small record goes at once, as it comes.
        let mut inflight = std::collections::VecDeque::new();
        while tx.due(16 << 10) == 16 << 10 {
            let (t, n) = tx.frame(&[1u8; 16 << 10]).unwrap();
            let (offset, _, mac) = strm(&t);
            rx.accept(offset, &[1u8; 16 << 10][..n], &mac).unwrap();
            inflight.push_back(rx.ack());
        }
        assert_eq!(tx.room(), 0, "the window is full of 256 small frames");
        // The replica stopped meanwhile; 64 MiB wait in the log. As its
        // acknowledgements of the small frames come back one by one, the
        // source sends only full frames.
        let mut backlog = 64u64 << 20;
        let mut frames = 0;
        while backlog > 0 {
            let Token::Sack { offset, mac } = inflight.pop_front().expect("a frame in flight")
            else {
                unreachable!()
            };
            tx.on_sack(offset, &mac).unwrap();
            let due = tx.due(backlog);
            assert!(
                due == 0 || due >= u64::from(MAX_FRAME).min(backlog),
                "{due} bytes go"
            );
            let mut left = due as usize;
            while let Some((t, n)) = tx.frame(&vec![2u8; left]) {
                let (offset, len, mac) = strm(&t);
                rx.accept(offset, &vec![2u8; len as usize], &mac).unwrap();
                inflight.push_back(rx.ack());
                (left, backlog, frames) = (left - n, backlog - n as u64, frames + 1);
            }
        }
        assert_eq!(frames, 64, "one frame per MiB");
    }

    #[test]
    fn what_fits_the_room_goes_at_once_and_a_small_window_still_moves() {
        let mut tx = Sender::new(KEY, 0, 4 << 20);
        assert_eq!(tx.due(0), 0);
        assert_eq!(tx.due(100), 100, "a tail that fits goes at once");
        assert_eq!(tx.due(10 << 20), 4 << 20, "the whole window");
        while tx.frame(&[0; 1 << 20]).is_some() {}
        tx.on_ack((1 << 20) - 1).unwrap();
        assert_eq!(tx.due(10 << 20), 0, "less than a frame of room waits");
        assert_eq!(tx.due(100), 100, "unless the rest fits it");
        tx.on_ack(1 << 20).unwrap();
        assert_eq!(tx.due(10 << 20), 1 << 20, "a frame of room goes");
        // A window smaller than two frames (a small ring) goes at half.
        let mut small = Sender::new(KEY, 0, 1000);
        small.frame(&[0; 1000]);
        small.on_ack(499).unwrap();
        assert_eq!(small.due(5000), 0);
        small.on_ack(500).unwrap();
        assert_eq!(small.due(5000), 500);
    }

    #[test]
    fn a_forged_altered_or_misplaced_frame_is_refused_and_takes_nothing() {
        let mut tx = Sender::new(KEY, 0, 1 << 20);
        let mut rx = Receiver::new(KEY, 0, 1 << 20);
        let (t, _) = tx.frame(b"*1\r\n$4\r\nPING\r\n").unwrap();
        let (offset, _, mac) = strm(&t);
        // The same bytes under another key (a peer without the key).
        let forged = data_mac(&[8; STREAM_KEY_LEN], 0, b"*1\r\n$4\r\nPING\r\n");
        assert_eq!(
            rx.accept(0, b"*1\r\n$4\r\nPING\r\n", &forged),
            Err(StreamError::Forged { offset: 0 })
        );
        assert_eq!(
            rx.accept(offset, b"*1\r\n$4\r\nPONG\r\n", &mac),
            Err(StreamError::Forged { offset: 0 })
        );
        assert_eq!(rx.next(), 0, "nothing was taken");
        rx.accept(offset, b"*1\r\n$4\r\nPING\r\n", &mac).unwrap();
        // Replayed: the same frame again is not applied twice.
        assert_eq!(
            rx.accept(offset, b"*1\r\n$4\r\nPING\r\n", &mac),
            Err(StreamError::Discontinuous {
                offset: 0,
                expected: 14
            })
        );
        assert!(matches!(
            rx.header(20, 1),
            Err(StreamError::Discontinuous { .. })
        ));
        let replid = [b'f'; REPLID_LEN];
        let Token::Sepo { offset, mac, .. } = tx.epoch(&replid) else {
            unreachable!()
        };
        rx.epoch(offset, &replid, &mac).unwrap();
        assert_eq!(
            rx.epoch(offset, &[b'e'; REPLID_LEN], &mac),
            Err(StreamError::Forged { offset: 14 })
        );
    }

    #[test]
    fn a_source_past_its_window_and_an_ack_of_unsent_bytes_are_refused() {
        let rx = Receiver::new(KEY, 100, 10);
        assert!(rx.header(100, 10).is_ok());
        assert_eq!(
            rx.header(100, 11),
            Err(StreamError::OverWindow {
                end: 111,
                acked: 100,
                window: 10
            })
        );
        assert_eq!(
            rx.header(100, MAX_FRAME + 1),
            Err(StreamError::TooLarge(MAX_FRAME + 1))
        );
        let mut tx = Sender::new(KEY, 100, 10);
        let (_, n) = tx.frame(&[0; 50]).unwrap();
        assert_eq!(n, 10, "cut to the window");
        assert!(tx.frame(&[0; 5]).is_none(), "no room until an ack");
        assert!(matches!(tx.on_ack(111), Err(StreamError::BadAck { .. })));
        tx.on_ack(105).unwrap();
        assert!(matches!(tx.on_ack(104), Err(StreamError::BadAck { .. })));
        assert_eq!(tx.room(), 5);
    }

    /// A session from offset 100 whose replica took 50 bytes, unacknowledged.
    fn fifty_bytes_taken() -> (Sender, Receiver) {
        let mut tx = Sender::new(KEY, 100, 1000);
        let mut rx = Receiver::new(KEY, 100, 1000);
        let bytes = [1u8; 50];
        let (t, _) = tx.frame(&bytes).unwrap();
        let (offset, _, mac) = strm(&t);
        rx.accept(offset, &bytes, &mac).unwrap();
        (tx, rx)
    }

    #[test]
    fn an_acknowledgement_without_the_sessions_key_is_refused() {
        let (mut tx, mut rx) = fifty_bytes_taken();
        // Someone on the path who does not hold the key: an ack of what the
        // replica never logged (WAIT would count it), a report of what its
        // servers never applied, or a genuine MAC moved to another offset.
        let other = [8; STREAM_KEY_LEN];
        let forged = ack_mac(&other, b"SACK", 150);
        assert_eq!(
            tx.on_sack(150, &forged),
            Err(StreamError::ForgedAck { offset: 150 })
        );
        let Token::Sack { offset, mac } = rx.ack() else {
            unreachable!()
        };
        assert_eq!(
            tx.on_sack(offset - 1, &mac),
            Err(StreamError::ForgedAck { offset: 149 })
        );
        let sapp_as_sack = ack_mac(&KEY, b"SAPP", offset);
        assert!(
            tx.on_sack(offset, &sapp_as_sack).is_err(),
            "one kind is not the other"
        );
        assert_eq!(tx.acked(), 100, "nothing forged was taken");
        tx.on_sack(offset, &mac).unwrap();
        assert_eq!(
            tx.on_sapp(150, &ack_mac(&other, b"SAPP", 150)),
            Err(StreamError::ForgedAck { offset: 150 })
        );
        assert_eq!(StreamError::ForgedAck { offset: 1 }.label(), "forged");
    }

    #[test]
    fn applied_reports_stay_within_what_the_replica_logged() {
        let (mut tx, mut rx) = fifty_bytes_taken();
        // Before the ack, a report is cut to what was acknowledged.
        let Some(Token::Sapp { offset: 100, .. }) = rx.applied(150) else {
            panic!("a report cut to the acknowledged 100")
        };
        assert_eq!(rx.applied(120), None, "unchanged: nothing to send");
        let Token::Sack { offset, mac } = rx.ack() else {
            unreachable!()
        };
        tx.on_sack(offset, &mac).unwrap();
        let Some(Token::Sapp { offset, mac }) = rx.applied(140) else {
            panic!("a changed report is sent")
        };
        assert_eq!(tx.on_sapp(offset, &mac), Ok(140));
        assert_eq!(tx.on_applied(90), Ok(90), "a lagging downstream joined");
        assert_eq!(
            tx.on_applied(151),
            Err(StreamError::BadApplied {
                applied: 151,
                acked: 150
            })
        );
    }
}
