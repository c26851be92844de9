//! BLK3, the data-plane protocol, as sans-IO state machines (docs/ARCHITECTURE.md, "BLK3").
//!
//! The [`Source`] and [`Replica`] machines take inputs — received tokens,
//! completions, results of work they asked for — together with the current
//! time as a `Duration` since the session began, and emit [`Command`]s: post a
//! receive, send a token, post a chain of writes, stream the bulk, verify,
//! done. They never touch sockets, verbs, files or clocks; the drivers in
//! `transport` execute the commands. Nothing here imports the async runtime,
//! the network or the clock, so tests can drive every ordering and failure.

pub mod plan;
pub mod replica;
pub mod ring;
pub mod share;
pub mod source;
pub mod stream;
pub mod token;

#[cfg(test)]
mod tests;

use std::time::Duration;

pub use plan::{need_ranges, runs, size_scaled_timeout, BulkParams, WriteOp, WritePlanner};
pub use replica::Replica;
pub use share::{Claims, PieceQueue};
pub use source::Source;
pub use token::{Kind, Token, TokenError};

/// How the bulk phase moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkMode {
    /// One-sided RDMA Writes into the memory the replica advertised.
    Rdma(BulkParams),
    /// A byte stream right after the source's MRINFO acceptance (TCP).
    Stream,
}

/// Timeout for handshake steps that do not scale with the snapshot.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Pieces the source may announce (PDON) without a reply: the receives
/// the replica keeps posted for them, and the source's credits.
pub const PIECE_WINDOW: u32 = 8;

/// The most times a source sends one piece in a session (the first time
/// and re-requests); a replica asking for more fails the session.
pub const MAX_PIECE_SENDS: u32 = 9;

/// Where the pieces of a snapshot lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pieces {
    pub len: u64,
    pub size: u64,
}

impl Pieces {
    pub fn count(&self) -> u32 {
        self.len.div_ceil(self.size) as u32
    }

    /// Offset and length of piece `index`.
    pub fn range(&self, index: u32) -> (u64, u64) {
        let offset = index as u64 * self.size;
        (offset, self.size.min(self.len - offset))
    }
}

/// What a machine asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Post a receive buffer for the next token (expected to be `Kind`).
    PostRecv(Kind),
    /// Send a token.
    Send(Token),
    /// Source: make the snapshot ready for the bulk phase (register memory).
    /// Answer with [`Input::SourceReady`].
    PrepareSource,
    /// Source, RDMA: post these writes as one linked chain into the remote
    /// region. Answer each signalled one with [`Input::WriteCompleted`].
    PostWrites {
        remote_addr: u64,
        rkey: u32,
        writes: Vec<WriteOp>,
    },
    /// Source: claim these pieces (a NEED's, or one asked again) for this
    /// stream in its session ([`Claims::claim`]). Answer with
    /// [`Input::Claimed`].
    Claim { pieces: Vec<u32> },
    /// Source, stream: send the piece's bytes (after its PDON). No answer.
    StreamPiece { index: u32, offset: u64, len: u64 },
    /// Replica: create the destination for `len` bytes (and register its
    /// memory for RDMA). Answer with [`Input::ReceiveReady`], or
    /// [`Input::ReceiveFailed`] when the bytes cannot be taken.
    PrepareReceive { len: u64 },
    /// Replica: take piece `index` (its PDON arrived): read it from the
    /// stream, or from the receive memory, and check it against the
    /// manifest. Answer with [`Input::PieceChecked`].
    TakePiece { index: u32, offset: u64, len: u64 },
    /// Replica on a shared queue: take this stream's next pieces from the
    /// session's [`PieceQueue`]; with `wait`, wait until there are some or
    /// none is left anywhere. Answer with [`Input::MorePieces`] (empty:
    /// none now, or with `wait` none left), or [`Input::ReceiveFailed`].
    MorePieces { wait: bool },
    /// Replica: every piece is in; verify the whole snapshot. Answer with
    /// [`Input::Verified`].
    Verify,
    /// The session is over.
    Done(Result<Outcome, Blk3Error>),
}

/// What the driver tells a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Received(Token),
    SourceReady,
    WriteCompleted {
        id: u64,
    },
    ReceiveReady {
        addr: u64,
        rkey: u32,
    },
    /// The replica cannot take the snapshot (disk full, …); the reason.
    ReceiveFailed(String),
    /// A piece's check against the manifest; `Err` carries the reason.
    PieceChecked {
        index: u32,
        result: Result<(), String>,
    },
    /// Checksum result; `Err` carries the reason.
    Verified(Result<(), String>),
    /// The claim of [`Command::Claim`]; `Err` carries the refusal.
    Claimed(Result<(), String>),
    /// The pieces [`Command::MorePieces`] took, as NEED ranges.
    MorePieces(Vec<(u32, u32)>),
}

/// How a session ended well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Source: every byte written and acknowledged with RDOK.
    Sent { len: u64 },
    /// Replica: every byte received and verified, and M handed over.
    Received { len: u64, seq: u64 },
}

/// Why a session failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Blk3Error {
    /// The peer sent a token other than the one expected now.
    #[error("protocol violation: expected {expected} while {state}, got {got}")]
    Unexpected {
        state: &'static str,
        expected: Kind,
        got: Kind,
    },
    /// The driver reported an input that makes no sense in this state.
    #[error("driver error: {input} while {state}")]
    BadInput { state: &'static str, input: String },
    /// A piece token or NEED range that does not fit the session.
    #[error("bad piece message: {0}")]
    BadPiece(String),
    /// One piece failed its check more often than the session allows.
    #[error("{CHECKSUM_FAILED}: piece {index} failed its check {tries} times: {reason}")]
    PieceRetries {
        index: u32,
        tries: u32,
        reason: String,
    },
    /// MRINFO advertised a region whose length is not the announced length.
    #[error("MRINFO length {mrinfo} differs from the announced snapshot length {announced}; refusing to write")]
    MrinfoLength { announced: u64, mrinfo: u64 },
    /// The source announced a length other than the one offered.
    #[error("source announced {announced} bytes but offered {offered}")]
    AnnouncedLength { offered: u64, announced: u64 },
    /// The received bytes failed verification (the replica sent RDFL).
    #[error("{CHECKSUM_FAILED}: {0}")]
    Checksum(String),
    /// The replica could not make room for the snapshot (it sent RDFL
    /// instead of MRINFO; no byte moved).
    #[error("cannot receive the snapshot: {0}")]
    CannotReceive(String),
    /// The peer ended the session with RDFL.
    #[error("peer failed the session: {0}")]
    PeerFailed(String),
    /// A wait ran out of time.
    #[error("timed out after {after:?} waiting for {waiting_for}")]
    Timeout {
        waiting_for: &'static str,
        after: Duration,
    },
    /// A write completion arrived out of plan.
    #[error(transparent)]
    Completion(#[from] plan::UnexpectedCompletion),
}

/// The interface drivers use to run either machine.
pub trait Machine {
    /// The next command to execute, if any.
    fn poll(&mut self) -> Option<Command>;
    /// Feeds one input at time `now` (since the session began).
    fn handle(&mut self, input: Input, now: Duration);
    /// When `on_timeout` must be called next.
    fn deadline(&self) -> Option<Duration>;
    /// Fails the session if the current wait has expired.
    fn on_timeout(&mut self, now: Duration);
}

macro_rules! impl_machine {
    ($t:ty) => {
        impl Machine for $t {
            fn poll(&mut self) -> Option<Command> {
                self.core.commands.pop_front()
            }
            fn handle(&mut self, input: Input, now: Duration) {
                <$t>::handle(self, input, now)
            }
            fn deadline(&self) -> Option<Duration> {
                self.core.deadline.map(|(_, at, _)| at)
            }
            fn on_timeout(&mut self, now: Duration) {
                self.core.on_timeout(now)
            }
        }
    };
}
impl_machine!(Source);
impl_machine!(Replica);

/// How a replica's RDFL for failed verification begins.
pub const CHECKSUM_FAILED: &str = "checksum verification failed";

impl Blk3Error {
    /// True when the peer reported failed checksum verification.
    pub fn is_checksum_report(&self) -> bool {
        matches!(self, Blk3Error::PeerFailed(r) if r.starts_with(CHECKSUM_FAILED))
    }
}

/// Shared bookkeeping: the command queue, the deadline, the final result.
#[derive(Debug, Default)]
struct Core {
    commands: std::collections::VecDeque<Command>,
    /// What we wait for, the deadline, and the timeout length.
    deadline: Option<(&'static str, Duration, Duration)>,
    done: bool,
}

impl Core {
    fn push(&mut self, c: Command) {
        self.commands.push_back(c);
    }

    fn send(&mut self, t: Token) {
        self.push(Command::Send(t));
    }

    fn wait(&mut self, what: &'static str, now: Duration, timeout: Duration) {
        self.deadline = Some((what, now + timeout, timeout));
    }

    fn finish(&mut self, result: Result<Outcome, Blk3Error>) {
        if !self.done {
            self.done = true;
            self.deadline = None;
            self.push(Command::Done(result));
        }
    }

    /// Ends with `err`, telling the peer why with RDFL first.
    fn fail(&mut self, err: Blk3Error) {
        if !self.done {
            self.send(Token::Rdfl {
                reason: err.to_string(),
            });
            self.finish(Err(err));
        }
    }

    /// Ends the session over an input that does not fit `state`.
    fn reject(&mut self, state: &'static str, expected: Kind, input: Input) {
        let err = match input {
            Input::Received(t) => Blk3Error::Unexpected {
                state,
                expected,
                got: t.kind(),
            },
            other => Blk3Error::BadInput {
                state,
                input: format!("{other:?}"),
            },
        };
        self.fail(err);
    }

    fn on_timeout(&mut self, now: Duration) {
        if let Some((what, at, after)) = self.deadline {
            if now >= at {
                self.fail(Blk3Error::Timeout {
                    waiting_for: what,
                    after,
                });
            }
        }
    }
}
