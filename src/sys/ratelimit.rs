//! The agent's data-plane bandwidth limit (`[sync] rate_limit`): one token
//! bucket shared by every session of the agent, drawn from in small grains
//! (at most [`GRAIN`] bytes per call) so concurrent sessions interleave
//! fairly and bursts stay short. Changing the rate (SIGHUP) takes effect on
//! the next grain. Blocking: callers are the data-plane threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Largest piece one call may take.
pub const GRAIN: usize = 256 << 10;
/// Burst allowance: this much time's worth of bytes.
const BURST: Duration = Duration::from_millis(50);

/// A token bucket in bytes per second (0 = unlimited).
pub struct RateLimiter {
    rate: AtomicU64,
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    pub fn new(bytes_per_sec: u64) -> RateLimiter {
        RateLimiter {
            rate: AtomicU64::new(bytes_per_sec),
            bucket: Mutex::new((0.0, Instant::now())),
        }
    }

    /// Sets a new rate (0 = unlimited).
    pub fn set_rate(&self, bytes_per_sec: u64) {
        self.rate.store(bytes_per_sec, Ordering::Relaxed);
    }

    pub fn rate(&self) -> u64 {
        self.rate.load(Ordering::Relaxed)
    }

    /// Waits until `bytes` (≤ [`GRAIN`]) may be sent.
    pub fn take(&self, bytes: usize) {
        let rate = self.rate() as f64;
        if rate == 0.0 {
            return;
        }
        let wait = {
            let mut b = self.bucket.lock().expect("rate limiter lock");
            let now = Instant::now();
            let burst = rate * BURST.as_secs_f64();
            let tokens = (b.0 + now.duration_since(b.1).as_secs_f64() * rate).min(burst);
            // Take now; a negative balance is the time the caller must wait.
            let left = tokens - bytes as f64;
            *b = (left, now);
            if left < 0.0 {
                Duration::from_secs_f64(-left / rate)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }

    /// Takes `bytes` in grains, calling `step` with each grain's range.
    pub fn paced<E>(
        &self,
        bytes: usize,
        mut step: impl FnMut(std::ops::Range<usize>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = 0;
        while at < bytes {
            let end = (at + GRAIN).min(bytes);
            self.take(end - at);
            step(at..end)?;
            at = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_never_waits_and_grains_cover_the_range() {
        let r = RateLimiter::new(0);
        let mut seen = Vec::new();
        r.paced(GRAIN * 2 + 5, |g| {
            seen.push(g);
            Ok::<_, ()>(())
        })
        .unwrap();
        assert_eq!(
            seen,
            vec![0..GRAIN, GRAIN..2 * GRAIN, 2 * GRAIN..2 * GRAIN + 5]
        );
    }

    #[test]
    fn rate_is_never_exceeded() {
        // 8 MiB at 32 MiB/s cannot take less than ~0.25 s (minus the burst).
        let r = RateLimiter::new(32 << 20);
        let started = Instant::now();
        r.paced(8 << 20, |_| Ok::<_, ()>(())).unwrap();
        let min = Duration::from_millis(250) - BURST;
        assert!(started.elapsed() >= min, "{:?}", started.elapsed());
    }
}
