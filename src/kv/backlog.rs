//! The backlog guard's hold on the local Redis/Valkey primary while
//! seedings run (source side; docs/ARCHITECTURE.md, "Backlog guard").
//!
//! Every offer of an RDB, when `[redis] primary_addr` is set, takes a
//! [`Lease`] here. The primary is measured (`preflight::measure`): when its
//! backlog cannot hold what the seeding needs, the offer is refused with the
//! size needed — or, with `[redis] grow_backlog`, `repl-backlog-size` is
//! raised to it (up to `max_backlog`, and only on servers that keep the
//! backlog's history when it is resized). The operator's value is written to
//! `[redis] backlog_record` (by default `<snapshot_dir>/.kvsync-redis-backlog`)
//! before the first raise and put
//! back when the last lease ends; an agent killed while holding one puts it
//! back when it starts again. While a lease lives its backlog is watched:
//! with `grow_backlog`, writes faster than the offer foresaw raise the
//! backlog again (up to `max_backlog`) as soon as what is left before M+1
//! falls below what the rest of the seeding writes; a burst about to push
//! M+1 out that cannot be met so (or one that did) is logged, shown in the
//! status and counted. A lease ends when the replica reports how its
//! sync ended, or a grace time after its session ended without a report.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::config::RedisConfig;
use crate::kv::preflight::{self, Foresight, Preflight, WriteMeter};
use crate::kv::redis::{self, Info, RedisError};
use crate::metrics::Metrics;
use crate::snapshot::SnapshotInfo;
use crate::sys::ratelimit::RateLimiter;

/// The default record of the operator's `repl-backlog-size`, in the
/// snapshot dir (hidden, so the watcher skips it).
pub const RECORD: &str = ".kvsync-redis-backlog";

/// How often a leased backlog is read.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// Shortest wait for a replica's report after its session ended.
const MIN_GRACE: Duration = Duration::from_secs(60);

/// The operator's backlog size, remembered while kvsync has raised it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Record {
    server: String,
    repl_backlog_size: u64,
}

struct Leases {
    /// The operator's value while kvsync's is in force.
    original: Option<Record>,
    /// Live leases by session id.
    leases: HashMap<String, Leased>,
}

/// A live lease: its RDB's size and its watcher.
struct Leased {
    size: u64,
    watch: tokio::task::AbortHandle,
}

/// The guard of one agent's local primary.
pub struct BacklogGuard {
    cfg: RedisConfig,
    record: PathBuf,
    metrics: Arc<Metrics>,
    /// The instance whose primary this is (its `kv_instance` label).
    instance: String,
    /// Held across the server conversations that raise or restore.
    state: tokio::sync::Mutex<Leases>,
    /// What the watchers found, by session, for the status.
    warnings: Mutex<BTreeMap<String, String>>,
    /// What the last seedings showed, bytes per second (0: not yet): the
    /// rate a session was served at, and the RDB's size over a replica's
    /// reported handoff time.
    served_rate: AtomicU64,
    loaded_rate: AtomicU64,
    /// The source's own bandwidth limit (`[sync] rate_limit`): no seeding
    /// moves faster.
    rate_limit: Arc<RateLimiter>,
    /// The primary's write rate, measured in the background.
    meter: Arc<WriteMeter>,
    runtime: tokio::runtime::Handle,
}

/// One seeding's claim on the backlog; its end starts the grace time.
pub struct Lease {
    guard: Arc<BacklogGuard>,
    session: String,
    grace: Duration,
}

impl Lease {
    /// Its session was served: `bytes` in `took`.
    pub fn served(&self, bytes: u64, took: Duration) {
        learn(&self.guard.served_rate, bytes, took);
    }
}

/// A learned rate, once there is one.
fn known(rate: &AtomicU64) -> Option<u64> {
    Some(rate.load(Ordering::Relaxed)).filter(|r| *r > 0)
}

/// Learns the rate of `bytes` in `took` (a zero time teaches nothing).
fn learn(rate: &AtomicU64, bytes: u64, took: Duration) {
    if !took.is_zero() {
        rate.store(
            (bytes as f64 / took.as_secs_f64()) as u64,
            Ordering::Relaxed,
        );
    }
}

/// The load rates a reported handoff may teach, at least and at most: the
/// time comes from any peer-token holder (`ReportResult.handoff_ms`), so
/// it can make the guard neither think a load instant nor endless.
const MIN_LOAD_RATE: f64 = 1024.0 * 1024.0;
const MAX_LOAD_RATE: f64 = 4.0 * 1024.0 * 1024.0 * 1024.0;

/// Learns the load rate of `bytes` loaded in `took`, clamped to a plausible
/// range.
fn learn_load(rate: &AtomicU64, bytes: u64, took: Duration) {
    let b = bytes as f64;
    let took = took
        .as_secs_f64()
        .clamp(b / MAX_LOAD_RATE, (b / MIN_LOAD_RATE).max(1e-9));
    learn(rate, bytes, Duration::from_secs_f64(took));
}

impl Drop for Lease {
    fn drop(&mut self) {
        let (guard, session, grace) = (self.guard.clone(), self.session.clone(), self.grace);
        self.guard.runtime.spawn(async move {
            tokio::time::sleep(grace).await;
            guard.release(&session, None).await;
        });
    }
}

/// A watched backlog that is about to lose, or lost, the replica's offset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Risk {
    /// The backlog starts after M+1.
    Lost { first: u64 },
    /// At `rate` bytes/s, the `left` bytes before M+1 goes are written
    /// before the seeding's expected end.
    Soon { left: u64, rate: f64 },
}

/// Whether a backlog (`INFO replication`) still holding an RDB saved at
/// `seq` is at risk, when the primary writes `rate` bytes/s for another
/// `remaining` seconds.
pub fn risk(repl: &Info, seq: u64, rate: f64, remaining: f64) -> Option<Risk> {
    let first = repl.num("repl_backlog_first_byte_offset");
    if seq + 1 < first {
        return Some(Risk::Lost { first });
    }
    let written = repl.num("master_repl_offset").saturating_sub(seq);
    let left = repl.num("repl_backlog_size").saturating_sub(written);
    (rate * remaining > left as f64).then_some(Risk::Soon { left, rate })
}

impl BacklogGuard {
    /// The guard of the primary at `cfg.primary_addr`, its record at
    /// `cfg.backlog_record` or in `snapshot_dir`, for a source whose sends
    /// are held to `rate_limit`. A record left by a killed agent is loaded,
    /// and the operator's value put back at once (or at the next release,
    /// if the primary does not answer now).
    pub async fn start(
        (instance, cfg): (&str, RedisConfig),
        snapshot_dir: &Path,
        metrics: Arc<Metrics>,
        rate_limit: Arc<RateLimiter>,
    ) -> Arc<BacklogGuard> {
        let record = if cfg.backlog_record.as_os_str().is_empty() {
            snapshot_dir.join(RECORD)
        } else {
            cfg.backlog_record.clone()
        };
        let original = read_record(&record);
        let meter = Arc::new(WriteMeter::new(cfg.rate_window));
        if !cfg.rate_window.is_zero() {
            tokio::spawn(preflight::run_meter(Arc::downgrade(&meter), cfg.clone()));
        }
        // Both series exist from the start, at zero.
        metrics
            .kv_backlog_grown_bytes
            .with_label_values(&[instance, &cfg.primary_addr]);
        metrics
            .kv_backlog_at_risk
            .with_label_values(&[instance, &cfg.primary_addr]);
        let guard = Arc::new(BacklogGuard {
            cfg,
            record,
            metrics,
            instance: instance.to_string(),
            state: tokio::sync::Mutex::new(Leases {
                original,
                leases: HashMap::new(),
            }),
            warnings: Mutex::new(BTreeMap::new()),
            served_rate: AtomicU64::new(0),
            loaded_rate: AtomicU64::new(0),
            rate_limit,
            meter,
            runtime: tokio::runtime::Handle::current(),
        });
        guard.restore(&mut *guard.state.lock().await).await;
        guard
    }

    /// Measures the primary for a seeding of `snapshot` in session
    /// `session`, refuses or raises the backlog as the configuration says,
    /// and leases it for the seeding.
    pub async fn lease(
        self: &Arc<Self>,
        session: &str,
        snapshot: &SnapshotInfo,
    ) -> Result<(Lease, Preflight), RedisError> {
        let measured = (known(&self.served_rate), known(&self.loaded_rate));
        let limit = self.rate_limit.rate();
        let sizing = preflight::measure(&self.cfg, snapshot, measured, limit, &self.meter).await?;
        let mut state = self.state.lock().await;
        if sizing.needed > sizing.size {
            let shortfall = sizing.shortfall(snapshot.size);
            if !self.cfg.grow_backlog {
                return Err(RedisError::Precondition(format!(
                    "{shortfall}: raise repl-backlog-size to at least {needed} (CONFIG SET repl-backlog-size {needed}), or let kvsync raise it while seedings run ([redis] grow_backlog = true), and retry",
                    needed = sizing.needed
                )));
            }
            self.grow(&mut state, sizing.needed, &shortfall).await?;
        }
        info!(
            session,
            write_rate = sizing.foresight.write_rate,
            needed = sizing.needed,
            backlog = sizing.size.max(sizing.needed),
            waited_ms = sizing.waited.as_millis() as u64,
            "backlog guard passed"
        );
        let watch = self.runtime.spawn(self.clone().watch(
            session.to_string(),
            snapshot.clone(),
            sizing.foresight,
        ));
        let leased = Leased {
            size: snapshot.size,
            watch: watch.abort_handle(),
        };
        if let Some(old) = state.leases.insert(session.to_string(), leased) {
            old.watch.abort();
        }
        let load = snapshot.size as f64 / sizing.foresight.load_rate.max(1) as f64;
        let lease = Lease {
            guard: self.clone(),
            session: session.to_string(),
            grace: Duration::from_secs_f64(load * sizing.foresight.safety).max(MIN_GRACE),
        };
        Ok((lease, sizing.checked))
    }

    /// Raises the backlog to `needed`, remembering the operator's value
    /// durably first.
    async fn grow(&self, state: &mut Leases, needed: u64, why: &str) -> Result<(), RedisError> {
        let (addr, auth) = (&self.cfg.primary_addr, &self.cfg.auth());
        let max = self.cfg.max_backlog.as_u64();
        if needed > max {
            return Err(RedisError::Precondition(format!(
                "{why}; that is above [redis] max_backlog ({max} bytes): raise max_backlog (the primary needs that much memory for its backlog), or seed when the primary writes less"
            )));
        }
        let server = redis::info(addr, auth, "server").await?;
        if !redis::resize_keeps_history(&server) {
            return Err(RedisError::Precondition(format!(
                "{why}; the primary runs Redis {}, which empties its backlog when repl-backlog-size changes (before 7.0), so kvsync does not grow it: raise repl-backlog-size to at least {needed} yourself and save a fresh RDB",
                server.get("redis_version").unwrap_or("(unknown)")
            )));
        }
        if state.original.is_none() {
            let original = Record {
                server: addr.clone(),
                repl_backlog_size: redis::backlog_size(addr, auth).await?,
            };
            write_record(&self.record, &original).map_err(|e| {
                RedisError::Precondition(format!(
                    "cannot record the primary's repl-backlog-size in {} before raising it: {e}",
                    self.record.display()
                ))
            })?;
            state.original = Some(original);
        }
        redis::set_backlog_size(addr, auth, needed).await?;
        self.metrics
            .kv_backlog_grown_bytes
            .with_label_values(&[&self.instance, addr])
            .set(needed as i64);
        info!(
            needed,
            "raised the primary's repl-backlog-size for a seeding"
        );
        Ok(())
    }

    /// Ends the lease of `session` (once; later calls do nothing), with
    /// the replica's handoff time when it reported a success; the last
    /// lease puts the operator's backlog size back.
    pub async fn release(&self, session: &str, handoff: Option<Duration>) {
        let mut state = self.state.lock().await;
        if let Some(leased) = state.leases.remove(session) {
            leased.watch.abort();
            self.warnings.lock().expect("warnings lock").remove(session);
            if let Some(took) = handoff {
                learn_load(&self.loaded_rate, leased.size, took);
            }
        }
        if state.leases.is_empty() {
            self.restore(&mut state).await;
        }
    }

    /// Puts the operator's value back, if kvsync's is in force.
    async fn restore(&self, state: &mut Leases) {
        let Some(original) = &state.original else {
            return;
        };
        let size = original.repl_backlog_size;
        match redis::set_backlog_size(&original.server, &self.cfg.auth(), size).await {
            Ok(()) => {
                info!(server = %original.server, repl_backlog_size = size, "restored the primary's repl-backlog-size");
                self.metrics
                    .kv_backlog_grown_bytes
                    .with_label_values(&[&self.instance, &original.server])
                    .set(0);
                if let Err(e) = std::fs::remove_file(&self.record) {
                    warn!(record = %self.record.display(), error = %e, "cannot remove the backlog record");
                }
                state.original = None;
            }
            Err(e) => warn!(
                error = %e,
                repl_backlog_size = size,
                "cannot restore the primary's repl-backlog-size; kvsync retries when the next seeding ends or the agent starts, or set it back yourself"
            ),
        }
    }

    /// What the watchers currently warn about.
    pub fn warnings(&self) -> Vec<String> {
        let warnings = self.warnings.lock().expect("warnings lock");
        warnings.values().cloned().collect()
    }

    /// Reads the backlog until the lease ends (its task is aborted): raises
    /// it when M+1 is at risk and `grow_backlog` allows, and reports when
    /// it cannot (counted once per lease).
    async fn watch(self: Arc<Self>, session: String, snapshot: SnapshotInfo, foresight: Foresight) {
        let (addr, auth) = (&self.cfg.primary_addr, &self.cfg.auth());
        let (start, expected) = (Instant::now(), foresight.seconds(snapshot.size));
        let mut last: Option<(Instant, u64)> = None;
        let mut counted = false;
        let mut ticks = tokio::time::interval(WATCH_EVERY);
        loop {
            ticks.tick().await;
            let Ok(repl) = redis::info(addr, auth, "replication").await else {
                continue;
            };
            let (now, master) = (Instant::now(), repl.num("master_repl_offset"));
            let rate = last.map_or(foresight.write_rate, |(t, m)| {
                master.saturating_sub(m) as f64 / (now - t).as_secs_f64().max(1e-3)
            });
            last = Some((now, master));
            let remaining =
                (expected - start.elapsed().as_secs_f64()).max(WATCH_EVERY.as_secs_f64());
            let Some(risk) = risk(&repl, snapshot.seq, rate, remaining) else {
                continue;
            };
            let next = snapshot.seq + 1;
            let grown = match risk {
                Risk::Soon { rate, .. } if self.cfg.grow_backlog => {
                    let written = repl.num("master_repl_offset").saturating_sub(snapshot.seq);
                    let needed = written + (rate * remaining * foresight.safety).ceil() as u64;
                    let why = format!(
                        "session {session}: the primary writes {rate:.0} bytes/s during the seeding, so with a safety factor of {} its backlog must hold {needed} bytes for the seeding's expected {remaining:.1} s more",
                        foresight.safety
                    );
                    let mut state = self.state.lock().await;
                    Some(self.grow(&mut state, needed, &why).await.map(|()| needed))
                }
                _ => None,
            };
            if let Some(Ok(needed)) = grown {
                info!(session, needed, "the primary writes faster than the offer foresaw: raised its repl-backlog-size during the seeding");
                continue;
            }
            let text = match risk {
                Risk::Lost { first } => format!(
                    "session {session}: the primary's backlog lost offset {next} (it now starts at {first}); the replica's PSYNC will be answered with a full resync. Raise repl-backlog-size (or [redis] backlog_safety, or turn on [redis] grow_backlog) and seed again"
                ),
                Risk::Soon { left, rate } => format!(
                    "session {session}: the primary writes {rate:.0} bytes/s and its backlog holds {left} more bytes before offset {next} is lost, less than the seeding's expected {remaining:.1} s more; the replica's PSYNC may be answered with a full resync{}",
                    match grown {
                        Some(Err(e)) => format!(" ({e})"),
                        _ => String::new(),
                    }
                ),
            };
            warn!("{text}");
            self.warnings
                .lock()
                .expect("warnings lock")
                .insert(session.clone(), text);
            if !counted {
                counted = true;
                self.metrics
                    .kv_backlog_at_risk
                    .with_label_values(&[&self.instance, addr])
                    .inc();
            }
            if matches!(risk, Risk::Lost { .. }) {
                return;
            }
        }
    }
}

fn read_record(path: &Path) -> Option<Record> {
    let text = match crate::sys::fs::read_regular(path, 64 << 10) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            warn!(record = %path.display(), error = %e, "cannot read the backlog record");
            return None;
        }
    };
    match serde_json::from_slice(&text) {
        Ok(record) => Some(record),
        Err(e) => {
            warn!(record = %path.display(), error = %e, "the backlog record is damaged; set the primary's repl-backlog-size back yourself");
            None
        }
    }
}

/// Writes the record atomically and durably (temp file, fsync, rename,
/// fsync of the directory).
fn write_record(path: &Path, record: &Record) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut temp = tempfile::NamedTempFile::new_in(dir)?;
    serde_json::to_writer(&mut temp, record)?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    crate::store::install::sync_dir(dir).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repl(first: u64, master: u64, size: u64) -> Info {
        Info::parse(&format!(
            "repl_backlog_first_byte_offset:{first}\r\nmaster_repl_offset:{master}\r\nrepl_backlog_size:{size}\r\n"
        ))
    }

    #[test]
    fn a_backlog_is_at_risk_when_the_rest_of_the_seeding_writes_more_than_it_has_left() {
        // Saved at 1000; 400 of the 1000-byte backlog used: 600 left.
        let r = repl(1, 1_400, 1_000);
        assert_eq!(risk(&r, 1_000, 100.0, 5.0), None);
        assert_eq!(
            risk(&r, 1_000, 100.0, 7.0),
            Some(Risk::Soon {
                left: 600,
                rate: 100.0
            })
        );
        // The backlog already starts after M+1.
        assert_eq!(
            risk(&repl(1_500, 2_400, 1_000), 1_000, 0.0, 1.0),
            Some(Risk::Lost { first: 1_500 })
        );
    }

    #[test]
    fn a_reported_handoff_time_teaches_only_a_plausible_load_rate() {
        let rate = AtomicU64::new(0);
        learn_load(&rate, 1 << 30, Duration::from_millis(1));
        assert!(known(&rate).unwrap() as f64 <= MAX_LOAD_RATE * 1.01);
        learn_load(&rate, 1 << 30, Duration::from_secs(86400 * 365));
        assert!(known(&rate).unwrap() as f64 >= MIN_LOAD_RATE * 0.99);
        learn_load(&rate, 1 << 30, Duration::from_secs(32));
        assert_eq!(known(&rate), Some(32 << 20));
    }

    #[test]
    fn the_record_survives_a_round_trip_and_a_damaged_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(RECORD);
        assert_eq!(read_record(&path), None);
        let record = Record {
            server: "127.0.0.1:6379".into(),
            repl_backlog_size: 1 << 20,
        };
        write_record(&path, &record).unwrap();
        assert_eq!(read_record(&path), Some(record));
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(read_record(&path), None);
    }
}
