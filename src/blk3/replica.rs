//! The BLK3 replica state machine (sans-IO).
//!
//! Posts the SRDY, RDGO, BLK3 and BDON receives before anything else (so
//! before CREA, and BDON's before MRINFO: an empty snapshot's BDON may follow
//! its BLK3 header at once), [`PIECE_WINDOW`] PDON receives before MRINFO
//! and NEED, a fresh one for each PDON before its reply returns the credit,
//! and the REPLMETA receive before the final verification. A length
//! announced by the source that differs from the offer is refused, and so
//! is a snapshot the replica cannot make room for (RDFL instead of MRINFO,
//! before any byte moves). Each piece is checked as its PDON arrives: PACK
//! when it matches the manifest, PREQ to have it again, up to the
//! session's retries. An empty snapshot skips MRINFO and the pieces but
//! still receives BDON and REPLMETA, so M always arrives.
//!
//! A stream of a session on several ([`Replica::queued`]) asks for what it
//! takes from the session's queue ([`Command::MorePieces`]): its first
//! NEED once it is ready, the next whenever it holds a batch or fewer
//! unverified pieces, and an empty NEED once the queue says every piece
//! is verified.

use std::time::Duration;

use super::plan::size_scaled_timeout;
use super::{
    Blk3Error, Command, Core, Input, Kind, Outcome, Pieces, Token, HANDSHAKE_TIMEOUT, PIECE_WINDOW,
};

#[derive(Debug, Clone, Copy)]
enum ReplicaState {
    Idle,
    WaitSrdy,
    WaitRdgo,
    WaitBlk3,
    WaitMemory,
    Refill,
    Pieces,
    WaitBdon,
    WaitVerify,
    WaitReplmeta,
    Done,
}

impl ReplicaState {
    fn name(self) -> &'static str {
        match self {
            ReplicaState::Idle => "idle",
            ReplicaState::WaitSrdy => "waiting for SRDY",
            ReplicaState::WaitRdgo => "waiting for RDGO",
            ReplicaState::WaitBlk3 => "waiting for the BLK3 header",
            ReplicaState::WaitMemory => "preparing receive memory",
            ReplicaState::Refill => "taking pieces from the session's queue",
            ReplicaState::Pieces => "receiving pieces",
            ReplicaState::WaitBdon => "waiting for BDON",
            ReplicaState::WaitVerify => "verifying",
            ReplicaState::WaitReplmeta => "waiting for REPLMETA",
            ReplicaState::Done => "done",
        }
    }

    fn expected(self) -> Kind {
        match self {
            ReplicaState::Idle | ReplicaState::WaitSrdy => Kind::Srdy,
            ReplicaState::WaitRdgo => Kind::Rdgo,
            ReplicaState::WaitBlk3 => Kind::Blk3,
            ReplicaState::Refill | ReplicaState::Pieces => Kind::Pdon,
            ReplicaState::WaitMemory | ReplicaState::WaitBdon => Kind::Bdon,
            ReplicaState::WaitVerify | ReplicaState::WaitReplmeta | ReplicaState::Done => {
                Kind::Replmeta
            }
        }
    }
}

/// The replica side of one BLK3 session: the same over every transport
/// (taking a piece is the driver's business).
#[derive(Debug)]
pub struct Replica {
    /// Length from the offer; the BLK3 header must agree.
    offered_len: u64,
    len: u64,
    pieces: Pieces,
    /// What NEED asks for.
    need: Vec<(u32, u32)>,
    /// Per piece: 0 not needed (or verified), 1 wanted, 2 being taken.
    wanted: Vec<u8>,
    /// Pieces wanted or being taken.
    left: u64,
    /// Checks failed so far, per piece that failed one.
    failures: std::collections::HashMap<u32, u32>,
    /// Failed checks one piece may have before the session fails.
    retries: u32,
    /// On a shared queue: ask for more when this many or fewer pieces are
    /// left.
    refill: Option<u32>,
    /// The queue had nothing the last time it was asked without waiting.
    dry: bool,
    /// The longest silence of the source while pieces are outstanding
    /// (`None`: the whole bulk's size-scaled deadline only).
    piece_wait: Option<Duration>,
    state: ReplicaState,
    pub(super) core: Core,
}

const WANTED: u8 = 1;
const TAKING: u8 = 2;

impl Replica {
    /// A session expecting a snapshot of `offered_len` bytes in pieces of
    /// `piece_size`, asking for the pieces in `need` (ranges of `(first,
    /// count)`, ascending; see [`super::need_ranges`]) and allowing each
    /// `retries` failed checks.
    pub fn new(offered_len: u64, piece_size: u64, need: Vec<(u32, u32)>, retries: u32) -> Replica {
        let pieces = Pieces {
            len: offered_len,
            size: piece_size,
        };
        let mut wanted = vec![0u8; pieces.count() as usize];
        for &(first, count) in &need {
            let (a, b) = (
                first as usize,
                (first as usize + count as usize).min(wanted.len()),
            );
            wanted[a.min(b)..b].fill(WANTED);
        }
        Replica {
            offered_len,
            len: 0,
            pieces,
            left: wanted.iter().filter(|&&w| w == WANTED).count() as u64,
            need,
            wanted,
            failures: Default::default(),
            retries,
            refill: None,
            dry: false,
            piece_wait: None,
            state: ReplicaState::Idle,
            core: Core::default(),
        }
    }

    /// Fails the session when the source announces no piece (nor BDON
    /// after the last) for `wait` since the last sign of progress. Over
    /// RDMA the Writes land unseen, so this is how a replica notices a
    /// source that went away; TCP sees its bytes and keeps a rate floor.
    pub fn with_piece_wait(mut self, wait: Duration) -> Replica {
        self.piece_wait = Some(wait);
        self
    }

    /// Takes its pieces from the session's queue (see the module's text)
    /// instead of the `need` it was made with, asking for more when it
    /// holds `refill` or fewer (at most half the piece window). Each NEED
    /// adds a piece at least, so at most `refill + 1` are on their way
    /// before the source takes one: never more than the PIECE_WINDOW
    /// receives the source keeps posted for them.
    pub fn queued(mut self, refill: u32) -> Replica {
        self.refill = Some(refill.clamp(1, PIECE_WINDOW / 2));
        self
    }

    /// Asks the queue for more when running low, without waiting.
    fn maybe_refill(&mut self) {
        if self
            .refill
            .is_some_and(|r| self.left > 0 && self.left <= r as u64 && !self.dry)
        {
            self.core.push(Command::MorePieces { wait: false });
        }
    }

    /// Marks the pieces of `ranges` (from the queue) wanted; `Err` when
    /// one is outside the snapshot or already wanted.
    fn add(&mut self, ranges: &[(u32, u32)]) -> Result<(), String> {
        for &(first, count) in ranges {
            for i in first..first.saturating_add(count) {
                match self.wanted.get_mut(i as usize) {
                    Some(w) if *w == 0 => *w = WANTED,
                    _ => return Err(format!("the queue gave piece {i}, which is not free")),
                }
                self.left += 1;
            }
        }
        Ok(())
    }

    /// How long to wait for the next piece announcement.
    fn pieces_wait(&self, scaled: Duration) -> Duration {
        self.piece_wait.map_or(scaled, |w| w.min(scaled))
    }

    /// Posts the first receives. Call before the connection is established
    /// (RDMA) or before the first token can arrive (TCP).
    pub fn start(&mut self, now: Duration) {
        self.core.push(Command::PostRecv(Kind::Srdy));
        self.core.push(Command::PostRecv(Kind::Rdgo));
        self.core.push(Command::PostRecv(Kind::Blk3));
        self.core.push(Command::PostRecv(Kind::Bdon));
        self.state = ReplicaState::WaitSrdy;
        self.core.wait("SRDY", now, HANDSHAKE_TIMEOUT);
    }

    /// Feeds one input. One match over (state, input): the whole
    /// transition table reads in one place, which is why it is long.
    pub fn handle(&mut self, input: Input, now: Duration) {
        if self.core.done {
            return;
        }
        let scaled = size_scaled_timeout(self.len);
        match (self.state, input) {
            (_, Input::Received(Token::Rdfl { reason })) => {
                self.core.finish(Err(Blk3Error::PeerFailed(reason)));
                self.state = ReplicaState::Done;
            }
            (ReplicaState::WaitSrdy, Input::Received(Token::Srdy)) => {
                self.core.send(Token::Crea);
                self.core.send(Token::Rdpr);
                self.state = ReplicaState::WaitRdgo;
                self.core.wait("RDGO", now, HANDSHAKE_TIMEOUT);
            }
            (ReplicaState::WaitRdgo, Input::Received(Token::Rdgo)) => {
                self.state = ReplicaState::WaitBlk3;
                self.core.wait("BLK3 header", now, HANDSHAKE_TIMEOUT);
            }
            (ReplicaState::WaitBlk3, Input::Received(Token::Blk3 { len })) => {
                if len != self.offered_len {
                    return self.fail(Blk3Error::AnnouncedLength {
                        offered: self.offered_len,
                        announced: len,
                    });
                }
                self.len = len;
                let scaled = size_scaled_timeout(len);
                if len == 0 {
                    self.state = ReplicaState::WaitBdon;
                    self.core.wait("BDON", now, scaled);
                } else {
                    self.core.push(Command::PrepareReceive { len });
                    self.state = ReplicaState::WaitMemory;
                    self.core.wait("receive memory", now, scaled);
                }
            }
            (ReplicaState::WaitMemory, Input::ReceiveReady { addr, rkey }) => {
                for _ in 0..PIECE_WINDOW {
                    self.core.push(Command::PostRecv(Kind::Pdon));
                }
                self.core.send(Token::Mrin {
                    addr,
                    rkey,
                    len: self.len,
                });
                if self.refill.is_some() {
                    self.core.push(Command::MorePieces { wait: true });
                    self.state = ReplicaState::Refill;
                    return self
                        .core
                        .wait("pieces from the session's queue", now, scaled);
                }
                self.core.send(Token::Need {
                    ranges: self.need.clone(),
                });
                let wait = self.pieces_wait(scaled);
                if self.left == 0 {
                    self.state = ReplicaState::WaitBdon;
                    self.core.wait("BDON", now, wait);
                } else {
                    self.state = ReplicaState::Pieces;
                    self.core.wait("pieces", now, wait);
                }
            }
            (
                ReplicaState::WaitMemory | ReplicaState::Refill | ReplicaState::Pieces,
                Input::ReceiveFailed(reason),
            ) => {
                self.fail(Blk3Error::CannotReceive(reason));
            }
            (state @ (ReplicaState::Refill | ReplicaState::Pieces), Input::MorePieces(ranges))
                if self.refill.is_some() =>
            {
                if let Err(why) = self.add(&ranges) {
                    return self.fail(Blk3Error::BadInput {
                        state: state.name(),
                        input: why,
                    });
                }
                self.dry = ranges.is_empty();
                if !ranges.is_empty() {
                    self.core.send(Token::Need { ranges });
                    self.state = ReplicaState::Pieces;
                    self.core.wait("pieces", now, self.pieces_wait(scaled));
                    self.maybe_refill();
                } else if matches!(state, ReplicaState::Refill) {
                    // Every piece is verified: no more.
                    self.core.send(Token::Need { ranges });
                    self.state = ReplicaState::WaitBdon;
                    self.core.wait("BDON", now, self.pieces_wait(scaled));
                }
            }
            (ReplicaState::Pieces, Input::Received(Token::Pdon { index }))
                if self.wanted.get(index as usize) == Some(&WANTED) =>
            {
                self.wanted[index as usize] = TAKING;
                // The credit this PDON used comes back with the reply.
                self.core.push(Command::PostRecv(Kind::Pdon));
                let (offset, len) = self.pieces.range(index);
                self.core.push(Command::TakePiece { index, offset, len });
                self.core.wait("pieces", now, self.pieces_wait(scaled));
            }
            (ReplicaState::Pieces, Input::PieceChecked { index, result })
                if self.wanted.get(index as usize) == Some(&TAKING) =>
            {
                match result {
                    Ok(()) => {
                        self.wanted[index as usize] = 0;
                        self.left -= 1;
                        self.core.send(Token::Pack { index });
                        if self.left == 0 && self.refill.is_some() {
                            self.core.push(Command::MorePieces { wait: true });
                            self.state = ReplicaState::Refill;
                            self.core
                                .wait("pieces from the session's queue", now, scaled);
                        } else if self.left == 0 {
                            self.state = ReplicaState::WaitBdon;
                            self.core.wait("BDON", now, self.pieces_wait(scaled));
                        } else {
                            self.maybe_refill();
                        }
                    }
                    Err(reason) => {
                        let tries = self.failures.entry(index).or_insert(0);
                        *tries += 1;
                        if *tries > self.retries {
                            let tries = *tries;
                            return self.fail(Blk3Error::PieceRetries {
                                index,
                                tries,
                                reason,
                            });
                        }
                        self.wanted[index as usize] = WANTED;
                        self.core.send(Token::Preq { index });
                    }
                }
            }
            (ReplicaState::WaitBdon, Input::Received(Token::Bdon)) => {
                self.core.push(Command::PostRecv(Kind::Replmeta));
                self.core.push(Command::Verify);
                self.state = ReplicaState::WaitVerify;
                self.core.wait("checksum verification", now, scaled);
            }
            (ReplicaState::WaitVerify, Input::Verified(Ok(()))) => {
                self.core.send(Token::Rdok);
                self.state = ReplicaState::WaitReplmeta;
                self.core.wait("REPLMETA", now, HANDSHAKE_TIMEOUT);
            }
            (ReplicaState::WaitVerify, Input::Verified(Err(reason))) => {
                self.fail(Blk3Error::Checksum(reason));
            }
            (ReplicaState::WaitReplmeta, Input::Received(Token::Replmeta { seq })) => {
                self.core
                    .finish(Ok(Outcome::Received { len: self.len, seq }));
                self.state = ReplicaState::Done;
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
}
