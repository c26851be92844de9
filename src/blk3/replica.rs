//! The BLK3 replica state machine (sans-IO).
//!
//! Posts the SRDY, RDGO, BLK3 and BDON receives before anything else (so
//! before CREA, and BDON's before MRINFO: an empty snapshot's BDON may follow
//! its BLK3 header at once), the REPLMETA receive before running the
//! checksum. A length announced by the source that differs from the
//! offer is refused, and so is a snapshot the replica cannot make room for
//! (RDFL instead of MRINFO, before any byte moves). An empty snapshot skips MRINFO and the bulk phase but
//! still receives BDON and REPLMETA, so M always arrives.

use std::time::Duration;

use super::plan::size_scaled_timeout;
use super::{Blk3Error, BulkMode, Command, Core, Input, Kind, Outcome, Token, HANDSHAKE_TIMEOUT};

#[derive(Debug, Clone, Copy)]
enum State {
    Idle,
    WaitSrdy,
    WaitRdgo,
    WaitBlk3,
    WaitMemory,
    WaitBulk,
    WaitBdon,
    WaitVerify,
    WaitReplmeta,
    Done,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Idle => "idle",
            State::WaitSrdy => "waiting for SRDY",
            State::WaitRdgo => "waiting for RDGO",
            State::WaitBlk3 => "waiting for the BLK3 header",
            State::WaitMemory => "preparing receive memory",
            State::WaitBulk => "receiving the bulk stream",
            State::WaitBdon => "waiting for BDON",
            State::WaitVerify => "verifying",
            State::WaitReplmeta => "waiting for REPLMETA",
            State::Done => "done",
        }
    }

    fn expected(self) -> Kind {
        match self {
            State::Idle | State::WaitSrdy => Kind::Srdy,
            State::WaitRdgo => Kind::Rdgo,
            State::WaitBlk3 => Kind::Blk3,
            State::WaitMemory | State::WaitBulk | State::WaitBdon => Kind::Bdon,
            State::WaitVerify | State::WaitReplmeta | State::Done => Kind::Replmeta,
        }
    }
}

/// The replica side of one BLK3 session.
#[derive(Debug)]
pub struct Replica {
    mode: BulkMode,
    /// Length from the offer; the BLK3 header must agree.
    offered_len: u64,
    len: u64,
    state: State,
    pub(super) core: Core,
}

impl Replica {
    /// A session expecting a snapshot of `offered_len` bytes.
    pub fn new(offered_len: u64, mode: BulkMode) -> Replica {
        Replica {
            mode,
            offered_len,
            len: 0,
            state: State::Idle,
            core: Core::default(),
        }
    }

    /// Posts the first receives. Call before the connection is established
    /// (RDMA) or before the first token can arrive (TCP).
    pub fn start(&mut self, now: Duration) {
        self.core.push(Command::PostRecv(Kind::Srdy));
        self.core.push(Command::PostRecv(Kind::Rdgo));
        self.core.push(Command::PostRecv(Kind::Blk3));
        self.core.push(Command::PostRecv(Kind::Bdon));
        self.state = State::WaitSrdy;
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
                self.state = State::Done;
            }
            (State::WaitSrdy, Input::Received(Token::Srdy)) => {
                self.core.send(Token::Crea);
                self.core.send(Token::Rdpr);
                self.state = State::WaitRdgo;
                self.core.wait("RDGO", now, HANDSHAKE_TIMEOUT);
            }
            (State::WaitRdgo, Input::Received(Token::Rdgo)) => {
                self.state = State::WaitBlk3;
                self.core.wait("BLK3 header", now, HANDSHAKE_TIMEOUT);
            }
            (State::WaitBlk3, Input::Received(Token::Blk3 { len })) => {
                if len != self.offered_len {
                    return self.fail(Blk3Error::AnnouncedLength {
                        offered: self.offered_len,
                        announced: len,
                    });
                }
                self.len = len;
                let scaled = size_scaled_timeout(len);
                if len == 0 {
                    self.state = State::WaitBdon;
                    self.core.wait("BDON", now, scaled);
                } else {
                    self.core.push(Command::PrepareReceive { len });
                    self.state = State::WaitMemory;
                    self.core.wait("receive memory", now, scaled);
                }
            }
            (State::WaitMemory, Input::ReceiveReady { addr, rkey }) => {
                self.core.send(Token::Mrin {
                    addr,
                    rkey,
                    len: self.len,
                });
                match self.mode {
                    BulkMode::Rdma(_) => {
                        self.state = State::WaitBdon;
                        self.core.wait("BDON", now, scaled);
                    }
                    BulkMode::Stream => {
                        self.core.push(Command::ReceiveBulk { len: self.len });
                        self.state = State::WaitBulk;
                        self.core.wait("bulk stream", now, scaled);
                    }
                }
            }
            (State::WaitMemory, Input::ReceiveFailed(reason)) => {
                self.fail(Blk3Error::CannotReceive(reason));
            }
            (State::WaitBulk, Input::BulkReceived) => {
                self.state = State::WaitBdon;
                self.core.wait("BDON", now, scaled);
            }
            (State::WaitBdon, Input::Received(Token::Bdon)) => {
                self.core.push(Command::PostRecv(Kind::Replmeta));
                self.core.push(Command::Verify);
                self.state = State::WaitVerify;
                self.core.wait("checksum verification", now, scaled);
            }
            (State::WaitVerify, Input::Verified(Ok(()))) => {
                self.core.send(Token::Rdok);
                self.state = State::WaitReplmeta;
                self.core.wait("REPLMETA", now, HANDSHAKE_TIMEOUT);
            }
            (State::WaitVerify, Input::Verified(Err(reason))) => {
                self.fail(Blk3Error::Checksum(reason));
            }
            (State::WaitReplmeta, Input::Received(Token::Replmeta { seq })) => {
                self.core
                    .finish(Ok(Outcome::Received { len: self.len, seq }));
                self.state = State::Done;
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
