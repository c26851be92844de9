//! The BLK3 source state machine (sans-IO).
//!
//! SRDY → (CREA, RDPR) → RDGO + BLK3 header → (MRINFO, NEED, snapshot
//! ready) → pieces → BDON → RDOK/RDFL → REPLMETA. Receives are posted
//! before the message that provokes them: CREA and RDPR before SRDY, MRINFO
//! and NEED before the BLK3 header, each piece's reply before its PDON, RDOK
//! before BDON. The BLK3 header goes out before the snapshot is prepared
//! (registered), so the replica sets up its memory in parallel. An MRINFO
//! whose length is not the announced one is refused before any write.
//!
//! The pieces NEED asks for go out in order, at most [`PIECE_WINDOW`]
//! announced without a reply (the replica keeps that many PDON receives
//! posted): over RDMA, a piece's writes and then its PDON on the same queue
//! pair; over TCP, its PDON and then its bytes. PACK returns the credit;
//! PREQ returns it and puts the piece first in line again, at most
//! [`MAX_PIECE_SENDS`] sends per piece. BDON follows the last PACK.
//!
//! The streams of one session share what they [`Asked`] for: a piece goes
//! to the first stream whose NEED names it, and a NEED naming a piece
//! another stream has is refused, so one session token fetches each piece once
//! however many streams it opens.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::plan::{size_scaled_timeout, WritePlanner};
use super::{
    Blk3Error, BulkMode, Command, Core, Input, Kind, Outcome, Pieces, Token, HANDSHAKE_TIMEOUT,
    MAX_PIECE_SENDS, PIECE_WINDOW,
};

/// Pieces in flight: which to send, which await a reply, and the writes.
#[derive(Debug)]
struct Bulk {
    queue: VecDeque<u32>,
    /// Sent (or being written) and not answered.
    unanswered: Vec<u32>,
    /// Pieces still to be acknowledged.
    left: u64,
    /// Times each piece was sent, for pieces sent more than once.
    resent: std::collections::HashMap<u32, u32>,
    /// RDMA: the writes, and where they go.
    writes: Option<(WritePlanner, u64, u32)>,
}

#[derive(Debug)]
enum SourceState {
    Idle,
    WaitCrea,
    WaitRdpr,
    WaitMrin {
        region: Option<(u64, u32)>,
        need: Option<Vec<(u32, u32)>>,
        ready: bool,
    },
    Bulk(Bulk),
    WaitRdok,
    Done,
}

impl SourceState {
    fn name(&self) -> &'static str {
        match self {
            SourceState::Idle => "idle",
            SourceState::WaitCrea => "waiting for CREA",
            SourceState::WaitRdpr => "waiting for RDPR",
            SourceState::WaitMrin { .. } => "waiting for MRINFO",
            SourceState::Bulk(_) => "sending pieces",
            SourceState::WaitRdok => "waiting for RDOK",
            SourceState::Done => "done",
        }
    }

    fn expected(&self) -> Kind {
        match self {
            SourceState::Idle | SourceState::WaitCrea => Kind::Crea,
            SourceState::WaitRdpr => Kind::Rdpr,
            SourceState::WaitMrin { region: None, .. } => Kind::Mrin,
            SourceState::WaitMrin { .. } => Kind::Need,
            SourceState::Bulk(_) => Kind::Pack,
            SourceState::WaitRdok | SourceState::Done => Kind::Rdok,
        }
    }
}

/// The source side of one BLK3 session.
#[derive(Debug)]
pub struct Source {
    len: u64,
    seq: u64,
    pieces: Pieces,
    mode: BulkMode,
    /// The longest silence of the replica while pieces await replies
    /// (`None`: the whole bulk's size-scaled deadline only).
    reply_wait: Option<Duration>,
    /// The pieces the session's other streams asked for.
    asked: Option<Arc<Asked>>,
    state: SourceState,
    pub(super) core: Core,
}

/// The pieces the streams of one session asked for so far.
#[derive(Debug, Default)]
pub struct Asked(Mutex<Vec<bool>>);

impl Asked {
    /// Gives `pieces` (ascending) to one stream: all of them, or none when
    /// one is another's (that piece).
    fn take(&self, pieces: &VecDeque<u32>) -> Result<(), u32> {
        let mut taken = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let is_taken = |i: u32| taken.get(i as usize).copied().unwrap_or(false);
        if let Some(&other) = pieces.iter().find(|&&i| is_taken(i)) {
            return Err(other);
        }
        if let Some(&last) = pieces.back() {
            let len = taken.len().max(last as usize + 1);
            taken.resize(len, false);
        }
        for &i in pieces {
            taken[i as usize] = true;
        }
        Ok(())
    }
}

impl Source {
    /// A session sending a snapshot of `len` bytes with sequence number
    /// `seq`, in pieces of `piece_size` bytes.
    pub fn new(len: u64, seq: u64, piece_size: u64, mode: BulkMode) -> Source {
        Source {
            len,
            seq,
            pieces: Pieces {
                len,
                size: piece_size,
            },
            mode,
            reply_wait: None,
            asked: None,
            state: SourceState::Idle,
            core: Core::default(),
        }
    }

    /// Fails the session when the replica answers no piece for `wait`
    /// since the bulk began or its last answer. Over RDMA the source's
    /// Writes may all have completed, so the missing answers are how it
    /// notices a replica that went away.
    pub fn with_reply_wait(mut self, wait: Duration) -> Source {
        self.reply_wait = Some(wait);
        self
    }

    /// Serves one of the streams of a session, which share what they
    /// `asked` for.
    pub fn sharing(mut self, asked: Arc<Asked>) -> Source {
        self.asked = Some(asked);
        self
    }

    /// Waits (again) for the next piece reply.
    fn wait_replies(&mut self, now: Duration) {
        let scaled = size_scaled_timeout(self.len);
        let wait = self.reply_wait.map_or(scaled, |w| w.min(scaled));
        self.core.wait("piece replies", now, wait);
    }

    /// Starts the session (the connection is up).
    pub fn start(&mut self, now: Duration) {
        self.core.push(Command::PostRecv(Kind::Crea));
        self.core.push(Command::PostRecv(Kind::Rdpr));
        self.core.send(Token::Srdy);
        self.state = SourceState::WaitCrea;
        self.core.wait("CREA", now, HANDSHAKE_TIMEOUT);
    }

    /// Feeds one input.
    pub fn handle(&mut self, input: Input, now: Duration) {
        if self.core.done {
            return;
        }
        let scaled = size_scaled_timeout(self.len);
        match (&mut self.state, input) {
            (_, Input::Received(Token::Rdfl { reason })) => {
                self.core.finish(Err(Blk3Error::PeerFailed(reason)));
            }
            (SourceState::WaitCrea, Input::Received(Token::Crea)) => {
                self.state = SourceState::WaitRdpr;
                self.core.wait("RDPR", now, HANDSHAKE_TIMEOUT);
            }
            (SourceState::WaitRdpr, Input::Received(Token::Rdpr)) => {
                if self.len > 0 {
                    self.core.push(Command::PostRecv(Kind::Mrin));
                    self.core.push(Command::PostRecv(Kind::Need));
                }
                self.core.send(Token::Rdgo);
                self.core.send(Token::Blk3 { len: self.len });
                self.core.push(Command::PrepareSource);
                self.state = SourceState::WaitMrin {
                    region: None,
                    need: None,
                    ready: false,
                };
                self.core.wait("MRINFO", now, scaled);
            }
            (
                SourceState::WaitMrin { region, .. },
                Input::Received(Token::Mrin { addr, rkey, len }),
            ) if self.len > 0 && region.is_none() => {
                if len != self.len {
                    return self.fail(Blk3Error::MrinfoLength {
                        announced: self.len,
                        mrinfo: len,
                    });
                }
                *region = Some((addr, rkey));
            }
            (
                SourceState::WaitMrin { region, need, .. },
                Input::Received(Token::Need { ranges }),
            ) if region.is_some() && need.is_none() => {
                *need = Some(ranges);
                self.maybe_start_bulk(now);
            }
            (SourceState::WaitMrin { ready, .. }, Input::SourceReady) if !*ready => {
                *ready = true;
                self.maybe_start_bulk(now);
            }
            (SourceState::Bulk(bulk), Input::WriteCompleted { id }) => {
                let Some((planner, ..)) = bulk.writes.as_mut() else {
                    return self.core.reject(
                        "sending pieces",
                        Kind::Pack,
                        Input::WriteCompleted { id },
                    );
                };
                if let Err(e) = planner.complete(id) {
                    return self.fail(e.into());
                }
                self.pump(now);
            }
            (SourceState::Bulk(bulk), Input::Received(Token::Pack { index }))
                if bulk.unanswered.contains(&index) =>
            {
                bulk.unanswered.retain(|&i| i != index);
                bulk.left -= 1;
                self.wait_replies(now);
                self.pump(now);
            }
            (SourceState::Bulk(bulk), Input::Received(Token::Preq { index }))
                if bulk.unanswered.contains(&index) =>
            {
                bulk.unanswered.retain(|&i| i != index);
                let sends = bulk.resent.entry(index).or_insert(1);
                if *sends >= MAX_PIECE_SENDS {
                    return self.fail(Blk3Error::BadPiece(format!(
                        "the replica asked for piece {index} more than {MAX_PIECE_SENDS} times"
                    )));
                }
                *sends += 1;
                bulk.queue.push_front(index);
                self.wait_replies(now);
                self.pump(now);
            }
            (SourceState::WaitRdok, Input::Received(Token::Rdok)) => {
                self.core.send(Token::Replmeta { seq: self.seq });
                self.core.finish(Ok(Outcome::Sent { len: self.len }));
                self.state = SourceState::Done;
            }
            (state, input) => {
                let (name, expected) = (state.name(), state.expected());
                self.core.reject(name, expected, input);
            }
        }
    }

    /// Ends the session (the state stays where it failed, for reporting).
    fn fail(&mut self, err: Blk3Error) {
        self.core.fail(err);
    }

    /// Starts sending pieces once MRINFO and NEED (if any bytes) are in
    /// and the snapshot is ready.
    fn maybe_start_bulk(&mut self, now: Duration) {
        let SourceState::WaitMrin {
            region,
            need,
            ready,
        } = &mut self.state
        else {
            return;
        };
        if !*ready {
            return;
        }
        if self.len == 0 {
            return self.finish_bulk(now);
        }
        let (Some((addr, rkey)), Some(ranges)) = (*region, need.take()) else {
            return;
        };
        let queue = match expand(&ranges, self.pieces.count()) {
            Ok(queue) => queue,
            Err(why) => return self.fail(Blk3Error::BadPiece(why)),
        };
        if let Err(other) = self.asked.as_ref().map_or(Ok(()), |a| a.take(&queue)) {
            return self.fail(Blk3Error::BadPiece(format!(
                "piece {other} was asked for on another stream of this session; each stream may fetch only its share"
            )));
        }
        let writes = match self.mode {
            BulkMode::Rdma(params) => Some((WritePlanner::new(params), addr, rkey)),
            BulkMode::Stream => None,
        };
        self.state = SourceState::Bulk(Bulk {
            left: queue.len() as u64,
            queue,
            unanswered: Vec::new(),
            resent: Default::default(),
            writes,
        });
        self.wait_replies(now);
        self.pump(now);
    }

    /// Sends what the credits allow; BDON once every piece is acknowledged
    /// and every write completed.
    fn pump(&mut self, now: Duration) {
        let SourceState::Bulk(bulk) = &mut self.state else {
            return;
        };
        let pieces = self.pieces;
        while bulk.unanswered.len() < PIECE_WINDOW as usize {
            let Some(index) = bulk.queue.pop_front() else {
                break;
            };
            bulk.unanswered.push(index);
            let (offset, len) = pieces.range(index);
            match &mut bulk.writes {
                Some((planner, ..)) => planner.push(index, offset, len),
                None => {
                    self.core.push(Command::PostRecv(Kind::Pack));
                    self.core.send(Token::Pdon { index });
                    self.core.push(Command::StreamPiece { index, offset, len });
                }
            }
        }
        if let Some((planner, remote_addr, rkey)) = &mut bulk.writes {
            for (writes, ended) in planner.next_chains() {
                self.core.push(Command::PostWrites {
                    remote_addr: *remote_addr,
                    rkey: *rkey,
                    writes,
                });
                if let Some(index) = ended {
                    self.core.push(Command::PostRecv(Kind::Pack));
                    self.core.send(Token::Pdon { index });
                }
            }
        }
        let writing = bulk.writes.as_ref().is_some_and(|(p, ..)| !p.idle());
        if bulk.left == 0 && !writing {
            self.finish_bulk(now);
        }
    }

    /// Every piece is in: post the RDOK receive, then send BDON.
    fn finish_bulk(&mut self, now: Duration) {
        self.core.push(Command::PostRecv(Kind::Rdok));
        self.core.send(Token::Bdon);
        self.state = SourceState::WaitRdok;
        self.core.wait("RDOK", now, size_scaled_timeout(self.len));
    }
}

/// The pieces NEED asks for, in order: ranges ascending, apart, inside
/// the snapshot.
fn expand(ranges: &[(u32, u32)], count: u32) -> Result<VecDeque<u32>, String> {
    let mut queue = VecDeque::new();
    let mut next = 0u64;
    for &(first, n) in ranges {
        let end = first as u64 + n as u64;
        if n == 0 || (first as u64) < next || end > count as u64 {
            return Err(format!(
                "NEED range ({first}, {n}) is empty, out of order or past the last of {count} pieces"
            ));
        }
        queue.extend(first..first + n);
        next = end;
    }
    Ok(queue)
}
