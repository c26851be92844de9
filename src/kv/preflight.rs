//! The source's pre-flight check of its local primary before it offers an
//! RDB (docs/ARCHITECTURE.md, "Backlog guard"): does the backlog still hold
//! offset M+1, and how large must it be to still hold it when the replica
//! has received and loaded the RDB, at the write rate measured now? The
//! rate is the primary's offset growth over `rate_window`, which
//! [`WriteMeter`] samples in the background, so an offer need not wait a
//! window to know it. Whether a shortfall is refused or the backlog grown
//! is `backlog`'s.

use std::collections::VecDeque;
use std::sync::{Mutex, Weak};
use std::time::{Duration, Instant};

use crate::config::RedisConfig;
use crate::kv::redis::{info, Info, RedisError};
use crate::snapshot::SnapshotInfo;

/// What the pre-flight check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preflight {
    /// Bytes the primary can still write before offset M+1 leaves its backlog.
    pub backlog_bytes_left: u64,
}

/// How long a seeding is expected to take, and how much the primary
/// writes meanwhile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Foresight {
    /// The primary's write rate, bytes per second.
    pub write_rate: f64,
    /// Moving and loading the RDB, bytes per second each.
    pub transfer_rate: u64,
    pub load_rate: u64,
    pub safety: f64,
}

impl Foresight {
    /// Seconds a seeding of `size` bytes is expected to take.
    pub fn seconds(&self, size: u64) -> f64 {
        size as f64 / self.transfer_rate.max(1) as f64 + size as f64 / self.load_rate.max(1) as f64
    }

    /// The backlog a seeding of an RDB of `size` bytes saved at `seq` needs
    /// when the primary is at `master`: what was written since the save,
    /// plus what the primary writes during the seeding, times the safety
    /// factor.
    pub fn backlog_needed(&self, master: u64, seq: u64, size: u64) -> u64 {
        let ahead = self.write_rate * self.seconds(size) * self.safety;
        master.saturating_sub(seq) + ahead.ceil() as u64
    }
}

/// Decides from the primary's `INFO replication` whether a replica loading
/// an RDB saved at (`repl_id`, `seq`) can continue with a partial resync.
pub fn check_backlog(repl: &Info, repl_id: &str, seq: u64) -> Result<Preflight, RedisError> {
    let next = seq + 1;
    let current = repl.get("master_replid").unwrap_or("");
    if !repl.holds_history(repl_id, next) {
        return Err(RedisError::Precondition(format!(
            "the primary's replication id is {current}, the RDB was saved under {repl_id}: the primary restarted or failed over since; save a fresh RDB on the primary"
        )));
    }
    if repl.num("repl_backlog_active") == 0 {
        return Err(RedisError::Precondition(
            "the primary has no replication backlog: a replica could only full-sync; attach a replica once (or set repl-backlog-size) and save a fresh RDB".into(),
        ));
    }
    let (first, histlen) = (
        repl.num("repl_backlog_first_byte_offset"),
        repl.num("repl_backlog_histlen"),
    );
    let master = repl.num("master_repl_offset");
    let size = repl.num("repl_backlog_size");
    if next < first {
        return Err(RedisError::Precondition(format!(
            "the primary's backlog no longer holds offset {next} (it starts at {first}): {} bytes were written since the save and repl-backlog-size is {size}; save a fresh RDB, or grow repl-backlog-size",
            master.saturating_sub(seq)
        )));
    }
    if next > first + histlen {
        return Err(RedisError::Precondition(format!(
            "the RDB's offset {seq} is ahead of the primary ({master}): it was not saved by this primary"
        )));
    }
    Ok(Preflight {
        backlog_bytes_left: size.saturating_sub(master - seq),
    })
}

/// The rate a seeding is expected to move at: the slowest of the
/// configured expectation, the last served rate and the rate limit (each
/// where there is one).
fn transfer_rate(expected: u64, served: Option<u64>, rate_limit: u64) -> u64 {
    [Some(expected), served, Some(rate_limit).filter(|r| *r > 0)]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(expected)
}

/// What the backlog guard measured on the local primary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sizing {
    /// M+1 is still in the backlog, with this much slack.
    pub checked: Preflight,
    /// The backlog the seeding needs, and the one the primary has.
    pub needed: u64,
    pub size: u64,
    pub foresight: Foresight,
    /// How long the measurement waited for the rate window.
    pub waited: Duration,
}

impl Sizing {
    /// Why the backlog is too small, with the figures behind it.
    pub fn shortfall(&self, rdb_size: u64) -> String {
        let f = &self.foresight;
        format!(
            "the primary writes {:.0} bytes/s; seeding this {rdb_size}-byte RDB is expected to take {:.1} s (transfer at {} bytes/s, load at {} bytes/s), so with a safety factor of {} its backlog must hold {} bytes, and repl-backlog-size is {}",
            f.write_rate,
            f.seconds(rdb_size),
            f.transfer_rate,
            f.load_rate,
            f.safety,
            self.needed,
            self.size
        )
    }
}

/// The primary's replication offset, sampled in the background: enough
/// samples to span the last `window`, so the write rate over it is known
/// whenever an offer asks.
#[derive(Debug)]
pub struct WriteMeter {
    window: Duration,
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

impl WriteMeter {
    pub fn new(window: Duration) -> WriteMeter {
        WriteMeter {
            window,
            samples: Mutex::default(),
        }
    }

    /// How often the meter reads the primary.
    pub fn every(&self) -> Duration {
        (self.window / 4).max(Duration::from_millis(50))
    }

    /// The primary was at `offset` at `at`. An offset that went back (the
    /// primary restarted) starts the meter over; samples older than the
    /// newest one at least a window old are dropped. Returns whether the
    /// samples now span a window and did not before.
    pub fn record(&self, at: Instant, offset: u64) -> bool {
        let mut samples = self.samples.lock().expect("meter lock");
        if samples.back().is_some_and(|(_, o)| *o > offset) {
            samples.clear();
        }
        let spanned = self.spans(&samples);
        samples.push_back((at, offset));
        while samples
            .get(1)
            .is_some_and(|(t, _)| at.saturating_duration_since(*t) >= self.window)
        {
            samples.pop_front();
        }
        !spanned && self.spans(&samples)
    }

    /// Whether `samples` span a window.
    fn spans(&self, samples: &VecDeque<(Instant, u64)>) -> bool {
        match (samples.front(), samples.back()) {
            (Some((first, _)), Some((last, _))) => {
                last.saturating_duration_since(*first) >= self.window
            }
            _ => false,
        }
    }

    /// The primary did not answer: what was measured no longer spans a
    /// gapless window.
    pub fn clear(&self) {
        self.samples.lock().expect("meter lock").clear();
    }

    /// The oldest sample kept: at most a window and one reading old once
    /// the meter has run that long.
    pub fn oldest(&self) -> Option<(Instant, u64)> {
        self.samples.lock().expect("meter lock").front().copied()
    }
}

/// Reads the primary's offset into `meter` every [`WriteMeter::every`]
/// until the meter is dropped.
pub async fn run_meter(meter: Weak<WriteMeter>, cfg: RedisConfig) {
    let every = match meter.upgrade() {
        Some(m) => m.every(),
        None => return,
    };
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let read = info(&cfg.primary_addr, &cfg.auth(), "replication").await;
        let Some(meter) = meter.upgrade() else {
            return;
        };
        match read {
            Ok(repl) => {
                if meter.record(Instant::now(), repl.num("master_repl_offset")) {
                    tracing::info!(
                        rate_window = ?meter.window,
                        "the primary's write rate is measured over the last rate_window: offers need not wait for it"
                    );
                }
            }
            Err(_) => meter.clear(),
        }
    }
}

/// The source's pre-flight measurement of its local primary: M+1 is still
/// in the backlog (or an error says why not), and the backlog a seeding
/// needs to still hold it when the replica asks, at the write rate over
/// the last `rate_window`: from the oldest sample `meter` holds, after
/// waiting out what of the window it does not span yet. `measured` are
/// the transfer and load rates this agent last saw (the rate it served a
/// session at, and the RDB's size over a replica's reported handoff time),
/// where it has them; the configured expectations stand in otherwise. A seeding is never expected to move
/// faster than the slowest of `rate_limit` (the source's own `[sync]
/// rate_limit`, 0: none), the last served rate and the configured
/// expectation. Whether a shortfall is refused or the backlog grown is the
/// guard's business (`backlog`).
pub async fn measure(
    cfg: &RedisConfig,
    snapshot: &SnapshotInfo,
    measured: (Option<u64>, Option<u64>),
    rate_limit: u64,
    meter: &WriteMeter,
) -> Result<Sizing, RedisError> {
    let repl_id = snapshot.repl_id.as_deref().unwrap_or("");
    let (addr, auth) = (&cfg.primary_addr, &cfg.auth());
    let mut repl = info(addr, auth, "replication").await?;
    let mut checked = check_backlog(&repl, repl_id, snapshot.seq)?;
    let now = (Instant::now(), repl.num("master_repl_offset"));
    let since = meter.oldest().filter(|(_, o)| *o <= now.1).unwrap_or(now);
    let wait = cfg.rate_window.saturating_sub(since.0.elapsed());
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
        repl = info(addr, auth, "replication").await?;
        checked = check_backlog(&repl, repl_id, snapshot.seq)?;
    }
    let master = repl.num("master_repl_offset");
    let written = master.saturating_sub(since.1);
    let foresight = Foresight {
        write_rate: written as f64 / since.0.elapsed().as_secs_f64().max(1e-3),
        transfer_rate: transfer_rate(cfg.expected_transfer_rate.as_u64(), measured.0, rate_limit),
        load_rate: measured.1.unwrap_or(cfg.expected_load_rate.as_u64()),
        safety: cfg.backlog_safety,
    };
    Ok(Sizing {
        checked,
        needed: foresight.backlog_needed(master, snapshot.seq, snapshot.size),
        size: repl.num("repl_backlog_size"),
        foresight,
        waited: wait,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backlog_needed_grows_with_the_write_rate_and_the_seeding_time() {
        let quiet = Foresight {
            write_rate: 0.0,
            transfer_rate: 100 << 20,
            load_rate: 100 << 20,
            safety: 2.0,
        };
        // Only what was written since the save.
        assert_eq!(quiet.backlog_needed(1_500, 1_000, 1 << 30), 500);
        assert!((quiet.seconds(1 << 30) - 20.48).abs() < 0.01);
        // 1 MB/s for 20.48 s, twice over.
        let busy = Foresight {
            write_rate: 1e6,
            ..quiet
        };
        assert_eq!(busy.backlog_needed(1_500, 1_000, 1 << 30), 500 + 40_960_000);
    }

    #[test]
    fn a_seeding_is_expected_at_the_slowest_of_the_expectation_the_last_rate_and_the_limit() {
        let mib = 1 << 20;
        assert_eq!(transfer_rate(100 * mib, None, 0), 100 * mib);
        // A source held to 2 MiB/s seeds at 2 MiB/s, whatever it saw before.
        assert_eq!(transfer_rate(100 * mib, None, 2 * mib), 2 * mib);
        assert_eq!(transfer_rate(100 * mib, Some(500 * mib), 2 * mib), 2 * mib);
        assert_eq!(transfer_rate(100 * mib, Some(30 * mib), 0), 30 * mib);
        assert_eq!(transfer_rate(100 * mib, Some(300 * mib), 0), 100 * mib);
    }

    #[test]
    fn the_meter_keeps_one_window_of_samples_and_starts_over_when_the_offset_goes_back() {
        let meter = WriteMeter::new(Duration::from_secs(2));
        assert_eq!(meter.every(), Duration::from_millis(500));
        let t = Instant::now();
        let at = |ms| t + Duration::from_millis(ms);
        assert_eq!(meter.oldest(), None);
        for (ms, offset) in [(0, 100), (500, 200), (1000, 300), (1500, 400)] {
            assert!(!meter.record(at(ms), offset));
        }
        assert!(meter.record(at(2000), 500), "now it spans a window");
        // 2 s spanned: nothing older is needed yet.
        assert_eq!(meter.oldest(), Some((at(0), 100)));
        meter.record(at(2500), 600);
        assert_eq!(
            meter.oldest(),
            Some((at(500), 200)),
            "the newest sample a window old"
        );
        meter.record(at(2600), 650);
        assert_eq!(meter.oldest(), Some((at(500), 200)));
        // The primary restarted: its offset went back.
        meter.record(at(3000), 10);
        assert_eq!(meter.oldest(), Some((at(3000), 10)));
        meter.clear();
        assert_eq!(meter.oldest(), None);
        assert_eq!(
            WriteMeter::new(Duration::from_millis(100)).every(),
            Duration::from_millis(50)
        );
    }

    fn repl(first: u64, histlen: u64, master: u64) -> Info {
        Info::parse(&repl_text(first, histlen, master))
    }

    fn repl_text(first: u64, histlen: u64, master: u64) -> String {
        format!(
            "# Replication\r\nrole:master\r\nmaster_replid:aaaa\r\nmaster_replid2:bbbb\r\nsecond_repl_offset:100\r\nmaster_repl_offset:{master}\r\nrepl_backlog_active:1\r\nrepl_backlog_size:1000\r\nrepl_backlog_first_byte_offset:{first}\r\nrepl_backlog_histlen:{histlen}\r\n"
        )
    }

    #[test]
    fn backlog_holding_the_next_offset_passes_and_reports_slack() {
        let p = check_backlog(&repl(1, 500, 500), "aaaa", 300).unwrap();
        assert_eq!(p.backlog_bytes_left, 800);
        // The previous id still works up to second_repl_offset.
        assert!(check_backlog(&repl(1, 500, 500), "bbbb", 50).is_ok());
        assert!(check_backlog(&repl(1, 500, 500), "bbbb", 200).is_err());
    }

    #[test]
    fn refusals_say_what_to_do() {
        let e = check_backlog(&repl(2000, 1000, 2999), "aaaa", 1500).unwrap_err();
        assert!(e.to_string().contains("grow repl-backlog-size"), "{e}");
        let e = check_backlog(&repl(1, 500, 500), "cccc", 300).unwrap_err();
        assert!(e.to_string().contains("save a fresh RDB"), "{e}");
        let e = check_backlog(&repl(1, 500, 500), "aaaa", 900).unwrap_err();
        assert!(e.to_string().contains("ahead of the primary"), "{e}");
        let no_backlog = Info::parse(
            &repl_text(0, 0, 0).replace("repl_backlog_active:1", "repl_backlog_active:0"),
        );
        assert!(check_backlog(&no_backlog, "aaaa", 0)
            .unwrap_err()
            .to_string()
            .contains("no replication backlog"));
    }
}
