//! Which bytes of a snapshot this agent is still receiving have landed, and
//! which pieces are verified.
//!
//! The receiver reports how much of each piece has landed in the staging
//! file, marks each piece as it verifies it, and says when a piece failed
//! its check (its bytes will come again). A relay feed (a replica passing
//! the snapshot on while it still receives it, see `cache`) waits here for
//! the next bytes it may pass on. When the receive ends without a piece,
//! [`Arrivals::end`] says why, and every wait for a missing piece returns
//! that reason instead of blocking.

use std::sync::{Condvar, Mutex};

/// Wakes a waiting relay feed at most once per this many landed bytes of
/// a piece (and at the piece's end): the block a relay passes on at once.
pub const RELAY_BLOCK: u64 = 1 << 20;

/// Why a piece will never arrive.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArrivalsError {
    #[error("no piece {0}")]
    NoPiece(u32),
    /// The receive ended without it; why.
    #[error("{0}")]
    Ended(String),
}

/// What is known of one piece.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Piece {
    /// Its first `landed` bytes are in the staging file (this attempt).
    pub landed: u64,
    /// It matched the manifest.
    pub verified: bool,
    /// How often it failed its check (each time its bytes come again).
    pub drops: u32,
}

#[derive(Debug)]
struct Pieces {
    pieces: Vec<Piece>,
    /// Why no more pieces will come, once none will.
    ended: Option<String>,
}

/// The landed bytes and verified pieces of one snapshot being received.
#[derive(Debug)]
pub struct Arrivals {
    state: Mutex<Pieces>,
    changed: Condvar,
}

impl Arrivals {
    /// Starts from `verified` (the pieces an earlier attempt left).
    pub fn new(verified: Vec<bool>) -> Arrivals {
        let pieces = verified
            .into_iter()
            .map(|verified| Piece {
                verified,
                ..Piece::default()
            })
            .collect();
        Arrivals {
            state: Mutex::new(Pieces {
                pieces,
                ended: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Changes piece `index` with `f`; wakes the waiters when `wake` says
    /// the change matters to them (given the piece before and after).
    fn update(
        &self,
        index: u32,
        f: impl FnOnce(&mut Piece),
        wake: impl FnOnce(Piece, Piece) -> bool,
    ) {
        let mut state = self.state.lock().expect("arrivals lock");
        if let Some(p) = state.pieces.get_mut(index as usize) {
            let before = *p;
            f(p);
            if wake(before, *p) {
                self.changed.notify_all();
            }
        }
    }

    /// The first `bytes` bytes of piece `index` are in the staging file
    /// (a new attempt at the piece starts again from fewer).
    pub fn landed(&self, index: u32, bytes: u64, piece_len: u64) {
        self.update(
            index,
            |p| p.landed = bytes,
            |before, after| {
                after.landed == piece_len
                    || after.landed / RELAY_BLOCK != before.landed / RELAY_BLOCK
            },
        );
    }

    /// Piece `index` is verified and in the staging file.
    pub fn mark(&self, index: u32) {
        self.update(index, |p| p.verified = true, |_, _| true);
    }

    /// Piece `index` failed its check: the bytes that landed are not the
    /// piece, and it will come again.
    pub fn dropped(&self, index: u32) {
        self.update(
            index,
            |p| {
                p.landed = 0;
                p.drops += 1;
            },
            |_, _| true,
        );
    }

    /// No more pieces will come (the first reason given stays).
    pub fn end(&self, why: impl Into<String>) {
        let mut state = self.state.lock().expect("arrivals lock");
        state.ended.get_or_insert_with(|| why.into());
        self.changed.notify_all();
    }

    /// Blocks until piece `index` is verified; `Err` says why it never
    /// will be.
    pub fn wait(&self, index: u32) -> Result<(), ArrivalsError> {
        self.wait_until(index, |p| p.verified).map(drop)
    }

    /// Blocks until `ready` holds for piece `index` and returns the piece;
    /// `Err` says why it never will (a verified piece no longer changes, so
    /// one that is verified but not `ready` ends the wait too).
    pub fn wait_until(
        &self,
        index: u32,
        ready: impl Fn(&Piece) -> bool,
    ) -> Result<Piece, ArrivalsError> {
        let mut state = self.state.lock().expect("arrivals lock");
        loop {
            match state.pieces.get(index as usize) {
                None => return Err(ArrivalsError::NoPiece(index)),
                Some(p) if ready(p) || p.verified => return Ok(*p),
                Some(_) => {}
            }
            if let Some(why) = &state.ended {
                return Err(ArrivalsError::Ended(why.clone()));
            }
            state = self.changed.wait(state).expect("arrivals lock");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn waits_end_with_the_piece_or_the_reason() {
        let a = Arc::new(Arrivals::new(vec![true, false, false]));
        assert_eq!(a.wait(0), Ok(()));
        let waiter = {
            let a = a.clone();
            std::thread::spawn(move || (a.wait(1), a.wait(2)))
        };
        a.mark(1);
        a.end("the relay's sync failed");
        a.end("a later reason is ignored");
        let (one, two) = waiter.join().unwrap();
        assert_eq!(one, Ok(()));
        assert_eq!(
            two,
            Err(ArrivalsError::Ended("the relay's sync failed".into()))
        );
        assert_eq!(a.wait(7), Err(ArrivalsError::NoPiece(7)));
    }

    #[test]
    fn landed_bytes_and_drops_wake_a_waiting_feed() {
        let a = Arc::new(Arrivals::new(vec![false]));
        let len = 3 * RELAY_BLOCK;
        // Waits in another thread for `ready`; the piece it saw.
        let waiter = |ready: fn(&Piece) -> bool| {
            let (tx, rx) = std::sync::mpsc::channel();
            let a = a.clone();
            std::thread::spawn(move || tx.send(a.wait_until(0, ready)));
            rx
        };
        let deadline = std::time::Duration::from_secs(10);
        let block = waiter(|p| p.landed >= RELAY_BLOCK);
        a.landed(0, RELAY_BLOCK / 2, len);
        a.landed(0, RELAY_BLOCK + 1, len);
        let block = block.recv_timeout(deadline).unwrap().unwrap();
        assert_eq!(block.landed, RELAY_BLOCK + 1);
        let dropped = waiter(|p| p.drops == 1);
        a.dropped(0);
        assert_eq!(
            dropped.recv_timeout(deadline).unwrap().unwrap(),
            Piece {
                landed: 0,
                verified: false,
                drops: 1
            }
        );
        // A verified piece ends any wait: it no longer changes.
        let whole = waiter(|p| p.landed == 3 * RELAY_BLOCK);
        a.mark(0);
        assert!(whole.recv_timeout(deadline).unwrap().unwrap().verified);
    }
}
