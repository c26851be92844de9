//! How the streams of one session share its pieces (sans-IO bookkeeping).
//!
//! The replica keeps a [`PieceQueue`]: each stream takes its next small
//! batch of missing pieces from it as it runs low, instead of a share fixed
//! at the start, so a fast stream takes more and the slowest one holds up
//! the end by a batch at most; a stream that dies hands its unverified
//! pieces back for the others. The source keeps the session's [`Claims`]: a
//! piece is claimed by one stream at a time, a piece a stream acknowledged
//! (PACK) is never sent again, and no piece is sent more than
//! [`MAX_PIECE_SENDS`] times in the session, so one session token fetches
//! the snapshot once however many streams it opens. A claim on a piece a
//! live stream still holds waits for that stream to end (a replica hands a
//! dead stream's pieces back as soon as it closes it; the source notices
//! the close a moment later). docs/ARCHITECTURE.md, "The shared piece queue".

use std::collections::BTreeSet;

use super::{MAX_PIECE_SENDS, PIECE_WINDOW};

/// What a stream gets from the [`PieceQueue`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// These pieces are the stream's now (ascending).
    Pieces(Vec<u32>),
    /// None is waiting, but other streams still hold unverified ones: one
    /// may die and hand them back.
    Wait,
    /// Every piece is verified.
    Done,
}

/// The replica's queue of the pieces a session's streams still have to
/// fetch: pending ones, and ones a stream took and has not verified.
#[derive(Debug, Clone)]
pub struct PieceQueue {
    pending: BTreeSet<u32>,
    out: BTreeSet<u32>,
    batch: u32,
}

/// Bytes a stream takes at a time at most (in whole pieces, at most half
/// the piece window): enough to keep a long path busy for the round trip
/// its next NEED takes.
const BATCH_BYTES: u64 = 32 << 20;

impl PieceQueue {
    /// A queue of the `missing` pieces of `piece_size` bytes for `streams`
    /// streams. A stream holds one to two batches, so a batch is also at
    /// most a quarter of a stream's even share: half the pieces stay in
    /// the queue for the streams that turn out faster, and the slowest
    /// stream's last batch is short.
    pub fn new(
        missing: impl IntoIterator<Item = u32>,
        piece_size: u64,
        streams: u32,
    ) -> PieceQueue {
        let pending: BTreeSet<u32> = missing.into_iter().collect();
        let share = pending.len() as u64 / (4 * streams.max(1) as u64);
        let batch = BATCH_BYTES
            .div_ceil(piece_size.max(1))
            .min(share)
            .clamp(1, PIECE_WINDOW as u64 / 2) as u32;
        PieceQueue {
            pending,
            out: BTreeSet::new(),
            batch,
        }
    }

    /// Pieces taken at a time; a stream asks for more when it holds this
    /// many or fewer.
    pub fn batch(&self) -> u32 {
        self.batch
    }

    /// The next batch, lowest pieces first.
    pub fn take(&mut self) -> Take {
        if self.pending.is_empty() {
            return if self.out.is_empty() {
                Take::Done
            } else {
                Take::Wait
            };
        }
        let mut pieces = Vec::with_capacity(self.batch as usize);
        while pieces.len() < self.batch as usize {
            let Some(i) = self.pending.pop_first() else {
                break;
            };
            self.out.insert(i);
            pieces.push(i);
        }
        Take::Pieces(pieces)
    }

    /// Piece `index`, taken by a stream, verified.
    pub fn verified(&mut self, index: u32) {
        self.out.remove(&index);
    }

    /// A stream that ended gives back the pieces it took and did not verify.
    pub fn hand_back(&mut self, pieces: impl IntoIterator<Item = u32>) {
        for i in pieces {
            if self.out.remove(&i) {
                self.pending.insert(i);
            }
        }
    }

    /// Pieces not verified yet.
    pub fn left(&self) -> usize {
        self.pending.len() + self.out.len()
    }
}

/// A piece's standing in a session on the source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Hold {
    /// The stream that claimed it and has not ended.
    holder: Option<u32>,
    /// Acknowledged by a stream that ended: never sent again.
    done: bool,
    sends: u32,
}

/// Why a claim was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("piece {0} was asked for on another stream of this session, which still holds it or fetched it; each stream may fetch only what it took from the session's queue")]
    Another(u32),
    #[error("piece {0} was asked for more than {MAX_PIECE_SENDS} times in this session")]
    TooOften(u32),
    /// Another live stream holds a piece asked for: wait for it to end.
    #[error("a piece asked for is another live stream's")]
    Held,
}

/// Whether a claim can go ahead now.
#[derive(Debug, PartialEq, Eq)]
enum Standing {
    Free,
    Held,
    Refused(Refused),
}

/// The pieces the streams of one session claimed on the source (the
/// driver shares it between the streams' threads and waits on
/// [`Refused::Held`]).
#[derive(Debug, Default)]
pub struct Claims(Vec<Hold>);

impl Claims {
    /// Claims `pieces` for `stream`, all or none: each must be free or
    /// already the stream's (sent again), acknowledged by no stream, and
    /// under its send limit; [`Refused::Held`] while another live stream
    /// holds one.
    pub fn claim(&mut self, stream: u32, pieces: &[u32]) -> Result<(), Refused> {
        if let Some(&last) = pieces.iter().max() {
            let len = self.0.len().max(last as usize + 1);
            self.0.resize(len, Hold::default());
        }
        match standing(&self.0, stream, pieces) {
            Standing::Free => {}
            Standing::Held => return Err(Refused::Held),
            Standing::Refused(why) => return Err(why),
        }
        for &i in pieces {
            let hold = &mut self.0[i as usize];
            hold.holder = Some(stream);
            hold.sends += 1;
        }
        Ok(())
    }

    /// The piece of `pieces` another stream holds, for the refusal once a
    /// wait for it ran out.
    pub fn held_of(&self, stream: u32, pieces: &[u32]) -> Option<u32> {
        pieces.iter().copied().find(|&i| {
            self.0
                .get(i as usize)
                .is_some_and(|h| h.holder.is_some_and(|s| s != stream))
        })
    }

    /// `stream` ended: the pieces it claimed and did not see acknowledged
    /// (`unfinished`) are free again, the rest are done.
    pub fn end(&mut self, stream: u32, unfinished: &[u32]) {
        for (i, hold) in self.0.iter_mut().enumerate() {
            if hold.holder == Some(stream) {
                hold.holder = None;
                hold.done = !unfinished.contains(&(i as u32));
            }
        }
    }
}

/// Whether `stream` may claim `pieces` now.
fn standing(holds: &[Hold], stream: u32, pieces: &[u32]) -> Standing {
    let mut held = false;
    for &i in pieces {
        let hold = holds[i as usize];
        if hold.done {
            return Standing::Refused(Refused::Another(i));
        }
        if hold.sends >= MAX_PIECE_SENDS {
            return Standing::Refused(Refused::TooOften(i));
        }
        held |= hold.holder.is_some_and(|h| h != stream);
    }
    if held {
        Standing::Held
    } else {
        Standing::Free
    }
}
