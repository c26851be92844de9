//! The minimum rate a bulk transfer must keep (`[data] min_rate` over
//! `[data] min_rate_window`): a peer that trickles bytes, or stops reading,
//! loses its session within two windows instead of holding a slot, reserved
//! disk and a cache image for the size-scaled timeouts. Pure bookkeeping;
//! the TCP driver asks it how long one blocking call may wait, and both
//! ends of an RDMA session how long the other may stay silent.

use std::time::{Duration, Instant};

/// The floor: at least `bytes_per_sec` on average over every `window`.
/// `bytes_per_sec = 0` turns it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinRate {
    pub bytes_per_sec: u64,
    pub window: Duration,
}

impl Default for MinRate {
    fn default() -> Self {
        MinRate {
            bytes_per_sec: 1 << 20,
            window: Duration::from_secs(30),
        }
    }
}

impl From<&crate::config::DataConfig> for MinRate {
    fn from(c: &crate::config::DataConfig) -> MinRate {
        MinRate {
            bytes_per_sec: c.min_rate.as_u64(),
            window: c.min_rate_window,
        }
    }
}

impl MinRate {
    /// How long one end of an RDMA session, which cannot see bytes move
    /// (Writes land unseen), may wait for the other's next piece
    /// announcement or answer, pieces being `piece_size` bytes: a peer
    /// silent for `peer_timeout`, plus the piece at the floor's rate (none
    /// when the floor is off).
    pub fn piece_wait(&self, peer_timeout: Duration, piece_size: u64) -> Duration {
        let at_floor = match self.bytes_per_sec {
            0 => Duration::ZERO,
            rate => Duration::from_secs_f64(piece_size as f64 / rate as f64),
        };
        peer_timeout + at_floor
    }
}

/// A transfer that fell below the floor.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the peer moved {bytes} bytes in {elapsed:?}, below data.min_rate ({min} bytes/s): it stalled or is too slow")]
pub struct TooSlow {
    pub bytes: u64,
    pub elapsed: Duration,
    pub min: u64,
}

/// One direction of one transfer, measured against a [`MinRate`].
#[derive(Debug)]
pub struct Pace {
    min: MinRate,
    window_start: Instant,
    window_bytes: u64,
}

impl Pace {
    pub fn new(min: MinRate, now: Instant) -> Pace {
        Pace {
            min,
            window_start: now,
            window_bytes: 0,
        }
    }

    /// Counts `n` more bytes at `now` (0 after a wait that timed out).
    /// Fails once a whole window has passed below the floor.
    pub fn add(&mut self, n: u64, now: Instant) -> Result<(), TooSlow> {
        self.window_bytes += n;
        let elapsed = now.saturating_duration_since(self.window_start);
        if self.min.bytes_per_sec == 0 || elapsed < self.min.window {
            return Ok(());
        }
        let need = (self.min.bytes_per_sec as f64 * elapsed.as_secs_f64()) as u64;
        if self.window_bytes < need {
            return Err(TooSlow {
                bytes: self.window_bytes,
                elapsed,
                min: self.min.bytes_per_sec,
            });
        }
        self.window_start = now;
        self.window_bytes = 0;
        Ok(())
    }

    /// How long one blocking read or write may wait: one window (`None`:
    /// no floor). A call that waits that long without a byte ends the
    /// current window, which then fails unless it already moved enough.
    pub fn longest_wait(&self) -> Option<Duration> {
        (self.min.bytes_per_sec > 0).then_some(self.min.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: MinRate = MinRate {
        bytes_per_sec: 1000,
        window: Duration::from_secs(10),
    };

    #[test]
    fn a_steady_peer_passes_and_a_trickle_fails_after_one_window() {
        let t0 = Instant::now();
        let mut p = Pace::new(MIN, t0);
        for s in 1..=30 {
            p.add(1000, t0 + Duration::from_secs(s)).unwrap();
        }
        let mut p = Pace::new(MIN, t0);
        p.add(1, t0 + Duration::from_secs(9)).unwrap();
        let e = p.add(1, t0 + Duration::from_secs(10)).unwrap_err();
        assert_eq!((e.bytes, e.min), (2, 1000));
    }

    #[test]
    fn a_blocking_call_waits_at_most_one_window() {
        let t0 = Instant::now();
        assert_eq!(Pace::new(MIN, t0).longest_wait(), Some(MIN.window));
        let off = Pace::new(
            MinRate {
                bytes_per_sec: 0,
                ..MIN
            },
            t0,
        );
        assert_eq!(off.longest_wait(), None);
        // A stalled peer: the timed-out wait at the window's end fails it.
        let mut p = Pace::new(MIN, t0);
        assert!(p.add(0, t0 + MIN.window).is_err());
    }
}
