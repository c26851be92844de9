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
//! PREQ returns it and puts the piece first in line again. BDON follows
//! the last PACK.
//!
//! Every piece a NEED names, and every piece a PREQ asks for again, is
//! first claimed for the stream in its session ([`Command::Claim`], see
//! [`super::share::Claims`]): a refused claim fails the stream before the
//! piece moves. A stream of a session with several ([`Source::queued`])
//! takes further NEEDs while it sends, each naming the next pieces the
//! replica took from its queue, and an empty NEED says there are no more:
//! BDON follows the last PACK after it.

use std::collections::VecDeque;
use std::time::Duration;

use super::plan::{size_scaled_timeout, WritePlanner};
use super::{
    Blk3Error, BulkMode, Command, Core, Input, Kind, Outcome, Pieces, Token, HANDSHAKE_TIMEOUT,
    PIECE_WINDOW,
};

/// A claim the driver is making.
#[derive(Debug)]
enum Claiming {
    /// A NEED's pieces, to send in order.
    Need(VecDeque<u32>),
    /// A piece asked for again, to send next.
    Again(u32),
}

/// Pieces in flight: which to send, which await a reply, and the writes.
#[derive(Debug)]
struct Bulk {
    queue: VecDeque<u32>,
    /// Sent (or being written) and not answered.
    unanswered: Vec<u32>,
    /// Pieces still to be acknowledged.
    left: u64,
    /// No NEED follows (the replica said so, or the session has one).
    ended: bool,
    claiming: Option<Claiming>,
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
            SourceState::Bulk(bulk) if bulk.left == 0 && !bulk.ended => Kind::Need,
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
    /// More NEEDs may follow the first (a session on several streams).
    queued: bool,
    state: SourceState,
    pub(super) core: Core,
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
            queued: false,
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

    /// Serves one of the streams of a session on several: NEEDs come as
    /// the replica takes pieces from its queue, an empty one last.
    pub fn queued(mut self) -> Source {
        self.queued = true;
        self
    }

    /// The pieces this stream claimed that no PACK acknowledged (for
    /// [`super::share::Claims::end`] when the stream is over).
    pub fn unfinished(&self) -> Vec<u32> {
        let SourceState::Bulk(bulk) = &self.state else {
            return Vec::new();
        };
        let claiming = match &bulk.claiming {
            Some(Claiming::Need(pieces)) => pieces.iter().copied().collect(),
            Some(Claiming::Again(index)) => vec![*index],
            None => Vec::new(),
        };
        let sent = bulk.queue.iter().chain(&bulk.unanswered).copied();
        sent.chain(claiming).collect()
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
                    // On a shared queue, NEEDs may come PIECE_WINDOW at a
                    // time (see the replica); one is posted again for
                    // each taken.
                    let needs = if self.queued { PIECE_WINDOW } else { 1 };
                    for _ in 0..needs {
                        self.core.push(Command::PostRecv(Kind::Need));
                    }
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
                if bulk.unanswered.contains(&index) && bulk.claiming.is_none() =>
            {
                bulk.unanswered.retain(|&i| i != index);
                bulk.claiming = Some(Claiming::Again(index));
                self.core.push(Command::Claim {
                    pieces: vec![index],
                });
            }
            (SourceState::Bulk(bulk), Input::Received(Token::Need { ranges }))
                if self.queued && !bulk.ended && bulk.claiming.is_none() =>
            {
                if ranges.is_empty() {
                    bulk.ended = true;
                    return self.pump(now);
                }
                let pieces = match expand(&ranges, self.pieces.count()) {
                    Ok(pieces) => pieces,
                    Err(why) => return self.fail(Blk3Error::BadPiece(why)),
                };
                let mine = |i: &&u32| bulk.queue.contains(i) || bulk.unanswered.contains(i);
                if let Some(&i) = pieces.iter().find(mine) {
                    return self.fail(Blk3Error::BadPiece(format!(
                        "NEED names piece {i}, which this stream is still sending"
                    )));
                }
                self.core.push(Command::PostRecv(Kind::Need));
                self.core.push(Command::Claim {
                    pieces: pieces.iter().copied().collect(),
                });
                bulk.claiming = Some(Claiming::Need(pieces));
            }
            (SourceState::Bulk(bulk), Input::Claimed(result)) if bulk.claiming.is_some() => {
                let claiming = bulk.claiming.take().expect("a claim is being made");
                if let Err(why) = result {
                    return self.fail(Blk3Error::BadPiece(why));
                }
                match claiming {
                    Claiming::Need(pieces) => {
                        bulk.left += pieces.len() as u64;
                        bulk.queue.extend(pieces);
                    }
                    Claiming::Again(index) => bulk.queue.push_front(index),
                }
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
        let pieces = match expand(&ranges, self.pieces.count()) {
            Ok(pieces) => pieces,
            Err(why) => return self.fail(Blk3Error::BadPiece(why)),
        };
        let writes = match self.mode {
            BulkMode::Rdma(params) => Some((WritePlanner::new(params), addr, rkey)),
            BulkMode::Stream => None,
        };
        if self.queued {
            self.core.push(Command::PostRecv(Kind::Need));
        }
        let claiming = (!pieces.is_empty()).then(|| {
            self.core.push(Command::Claim {
                pieces: pieces.iter().copied().collect(),
            });
            Claiming::Need(pieces)
        });
        self.state = SourceState::Bulk(Bulk {
            left: 0,
            queue: VecDeque::new(),
            unanswered: Vec::new(),
            ended: !self.queued || claiming.is_none(),
            claiming,
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
        if bulk.left > 0 || writing || bulk.claiming.is_some() {
            return;
        }
        if bulk.ended {
            self.finish_bulk(now);
        } else {
            // The replica's other streams may take a while to verify
            // what they hold before it knows there is no more.
            self.core.wait("NEED", now, size_scaled_timeout(self.len));
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
