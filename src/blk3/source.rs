//! The BLK3 source state machine (sans-IO).
//!
//! SRDY → (CREA, RDPR) → RDGO + BLK3 header → (MRINFO, snapshot ready) →
//! writes or stream → BDON → RDOK/RDFL → REPLMETA. Receives are posted before
//! the message that provokes them: CREA and RDPR before SRDY, MRINFO before
//! the BLK3 header, RDOK before BDON. The BLK3 header goes out before the
//! snapshot is prepared (registered), so the replica sets up its memory in
//! parallel. An MRINFO whose length is not the announced one is refused
//! before any write.

use std::time::Duration;

use super::plan::{size_scaled_timeout, WritePlanner};
use super::{Blk3Error, BulkMode, Command, Core, Input, Kind, Outcome, Token, HANDSHAKE_TIMEOUT};

#[derive(Debug)]
enum State {
    Idle,
    WaitCrea,
    WaitRdpr,
    WaitMrin {
        region: Option<(u64, u32)>,
        ready: bool,
    },
    Writing {
        planner: WritePlanner,
        addr: u64,
        rkey: u32,
    },
    Streaming,
    WaitRdok,
    Done,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Idle => "idle",
            State::WaitCrea => "waiting for CREA",
            State::WaitRdpr => "waiting for RDPR",
            State::WaitMrin { .. } => "waiting for MRINFO",
            State::Writing { .. } => "writing",
            State::Streaming => "streaming",
            State::WaitRdok => "waiting for RDOK",
            State::Done => "done",
        }
    }

    fn expected(&self) -> Kind {
        match self {
            State::Idle | State::WaitCrea => Kind::Crea,
            State::WaitRdpr => Kind::Rdpr,
            State::WaitMrin { .. } => Kind::Mrin,
            State::Writing { .. } | State::Streaming | State::WaitRdok | State::Done => Kind::Rdok,
        }
    }
}

/// The source side of one BLK3 session.
#[derive(Debug)]
pub struct Source {
    len: u64,
    seq: u64,
    mode: BulkMode,
    state: State,
    pub(super) core: Core,
}

impl Source {
    /// A session sending a snapshot of `len` bytes with sequence number `seq`.
    pub fn new(len: u64, seq: u64, mode: BulkMode) -> Source {
        Source {
            len,
            seq,
            mode,
            state: State::Idle,
            core: Core::default(),
        }
    }

    /// Starts the session (the connection is up).
    pub fn start(&mut self, now: Duration) {
        self.core.push(Command::PostRecv(Kind::Crea));
        self.core.push(Command::PostRecv(Kind::Rdpr));
        self.core.send(Token::Srdy);
        self.state = State::WaitCrea;
        self.core.wait("CREA", now, HANDSHAKE_TIMEOUT);
    }

    /// Bytes known to be in the replica's memory (RDMA) so far.
    pub fn bytes_done(&self) -> u64 {
        match &self.state {
            State::Writing { planner, .. } => planner.bytes_done(),
            State::WaitRdok | State::Done => self.len,
            _ => 0,
        }
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
            (State::WaitCrea, Input::Received(Token::Crea)) => {
                self.state = State::WaitRdpr;
                self.core.wait("RDPR", now, HANDSHAKE_TIMEOUT);
            }
            (State::WaitRdpr, Input::Received(Token::Rdpr)) => {
                if self.len > 0 {
                    self.core.push(Command::PostRecv(Kind::Mrin));
                }
                self.core.send(Token::Rdgo);
                self.core.send(Token::Blk3 { len: self.len });
                self.core.push(Command::PrepareSource);
                self.state = State::WaitMrin {
                    region: None,
                    ready: false,
                };
                self.core.wait("MRINFO", now, scaled);
            }
            (State::WaitMrin { region, .. }, Input::Received(Token::Mrin { addr, rkey, len }))
                if self.len > 0 && region.is_none() =>
            {
                if len != self.len {
                    return self.fail(Blk3Error::MrinfoLength {
                        announced: self.len,
                        mrinfo: len,
                    });
                }
                *region = Some((addr, rkey));
                self.maybe_start_bulk(now);
            }
            (State::WaitMrin { ready, .. }, Input::SourceReady) if !*ready => {
                *ready = true;
                self.maybe_start_bulk(now);
            }
            (
                State::Writing {
                    planner,
                    addr,
                    rkey,
                },
                Input::WriteCompleted { id },
            ) => {
                if let Err(e) = planner.complete(id) {
                    return self.fail(e.into());
                }
                if planner.done() {
                    return self.finish_bulk(now);
                }
                let writes = planner.next_chain();
                if !writes.is_empty() {
                    let (remote_addr, rkey) = (*addr, *rkey);
                    self.core.push(Command::PostWrites {
                        remote_addr,
                        rkey,
                        writes,
                    });
                }
            }
            (State::Streaming, Input::BulkSent) => self.finish_bulk(now),
            (State::WaitRdok, Input::Received(Token::Rdok)) => {
                self.core.send(Token::Replmeta { seq: self.seq });
                self.core.finish(Ok(Outcome::Sent { len: self.len }));
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

    /// Starts the bulk phase once MRINFO (if any bytes) and the snapshot are ready.
    fn maybe_start_bulk(&mut self, now: Duration) {
        let State::WaitMrin { region, ready } = &self.state else {
            return;
        };
        if !*ready {
            return;
        }
        if self.len == 0 {
            return self.finish_bulk(now);
        }
        let Some((addr, rkey)) = *region else { return };
        let scaled = size_scaled_timeout(self.len);
        match self.mode {
            BulkMode::Rdma(params) => {
                let mut planner = WritePlanner::new(self.len, params);
                let writes = planner.next_chain();
                self.core.push(Command::PostWrites {
                    remote_addr: addr,
                    rkey,
                    writes,
                });
                self.state = State::Writing {
                    planner,
                    addr,
                    rkey,
                };
                self.core.wait("bulk write completions", now, scaled);
            }
            BulkMode::Stream => {
                self.core.push(Command::StreamBulk { len: self.len });
                self.state = State::Streaming;
                self.core.wait("bulk stream", now, scaled);
            }
        }
    }

    /// Every byte is out: post the RDOK receive, then send BDON.
    fn finish_bulk(&mut self, now: Duration) {
        self.core.push(Command::PostRecv(Kind::Rdok));
        self.core.send(Token::Bdon);
        self.state = State::WaitRdok;
        self.core.wait("RDOK", now, size_scaled_timeout(self.len));
    }
}
