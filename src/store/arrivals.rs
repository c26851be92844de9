//! Which pieces of a snapshot this agent is still receiving are verified.
//!
//! The receiver marks each piece as it verifies it; a relay feed (a replica
//! passing the snapshot on while it still receives it, see `cache`) waits
//! here for the next piece it needs. When the receive ends without a piece,
//! [`Arrivals::end`] says why, and every wait for a missing piece returns
//! that reason instead of blocking.

use std::sync::{Condvar, Mutex};

/// Why a piece will never arrive.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArrivalsError {
    #[error("no piece {0}")]
    NoPiece(u32),
    /// The receive ended without it; why.
    #[error("{0}")]
    Ended(String),
}

#[derive(Debug)]
struct Pieces {
    verified: Vec<bool>,
    /// Why no more pieces will come, once none will.
    ended: Option<String>,
}

/// The verified pieces of one snapshot being received.
#[derive(Debug)]
pub struct Arrivals {
    state: Mutex<Pieces>,
    changed: Condvar,
}

impl Arrivals {
    /// Starts from `verified` (the pieces an earlier attempt left).
    pub fn new(verified: Vec<bool>) -> Arrivals {
        Arrivals {
            state: Mutex::new(Pieces {
                verified,
                ended: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Piece `index` is verified and in the staging file.
    pub fn mark(&self, index: u32) {
        let mut state = self.state.lock().expect("arrivals lock");
        if let Some(v) = state.verified.get_mut(index as usize) {
            *v = true;
        }
        self.changed.notify_all();
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
        let mut state = self.state.lock().expect("arrivals lock");
        loop {
            match state.verified.get(index as usize) {
                Some(true) => return Ok(()),
                None => return Err(ArrivalsError::NoPiece(index)),
                Some(false) => {}
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
}
