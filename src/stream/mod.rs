//! The replication stream: the incremental half of replication, after a
//! snapshot's M. An agent follows its primary ([`follow`]) or another
//! agent ([`pull`]) into a checksummed log on disk ([`log`]) and serves
//! that log on to other agents ([`serve`]) and to its local server as its
//! master ([`feed`]), which can hand the server to the primary and take it
//! back ([`hand`]). Whom the log follows, and the switch from one to the
//! other at a failover, is [`source`]'s; a failover is taken by
//! [`crate::instance::failover`], told by an orchestrator, by Redis
//! Sentinel ([`sentinel`]) or by the local node of a cluster ([`shard`]),
//! and taken again until done ([`named`]). The agent that follows a primary
//! also watches its write safety ([`safety`]). [`Stream`] is one instance's
//! log as its writer and its readers share it, with what the servers fed
//! from it acknowledged ([`Downstream`]) and a reader's check that stops
//! readers before a damaged record while [`mend`] fetches it again.

pub mod feed;
pub mod follow;
pub mod hand;
pub mod keep;
pub mod log;
pub mod mend;
pub mod named;
pub mod policy;
pub mod proof;
pub mod pull;
pub mod reader;
pub mod safety;
pub mod sentinel;
pub mod serve;
pub mod shard;
pub mod source;
pub mod start;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use self::log::{Log, LogError};
use crate::metrics::Metrics;

/// A server or agent fed from a log, whose acknowledgements the log's
/// agent passes on upstream.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Downstream {
    /// The local server the feed is the master of (`redis-stream`): its
    /// `REPLCONF ACK`, kept after it disconnects (it holds what it had).
    Server,
    /// A replica agent's session: the lowest offset the servers fed from
    /// it applied, forgotten when the session ends.
    Agent { node: String, session: String },
}

impl std::fmt::Display for Downstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Downstream::Server => f.write_str("server"),
            Downstream::Agent { node, session } => write!(f, "agent {node} (session {session})"),
        }
    }
}

/// One instance's stream log, shared by the task that writes it and the
/// sessions that read it, with what the writer last reported.
pub struct Stream {
    log: Mutex<Log>,
    /// Bumped after every write: readers wait on it for more stream.
    changed: watch::Sender<u64>,
    /// Where the stream comes from.
    source: Mutex<source::Source>,
    /// The writer's state, for status (following, or why not).
    state: Mutex<WriterState>,
    /// What each downstream acknowledged; bumped on every change.
    acks: Mutex<BTreeMap<Downstream, u64>>,
    /// The replica agents whose credit window stayed full past
    /// `[stream] stall_timeout`.
    lagging: Mutex<std::collections::BTreeSet<Downstream>>,
    acks_changed: watch::Sender<u64>,
    /// The offset last acknowledged upstream: to the primary (`REPLCONF
    /// ACK`), or to the upstream agent as applied downstream (`SAPP`).
    upstream_acked: AtomicU64,
    /// At an agent that follows a primary: since when the oldest stretch of
    /// the stream its slowest downstream has not applied was logged (none:
    /// every downstream has all of it, or none reports).
    behind_since: Mutex<Option<std::time::Instant>>,
    /// What the primary's `min-replicas-to-write` condition is now, at an
    /// agent that follows a primary ([`follow::write_safety`]).
    write_safety: Mutex<String>,
    /// The last failover's divergence: what the log dropped because the
    /// promoted primary never had it (empty: none).
    diverged: Mutex<String>,
    /// With `[stream] sentinels`: their last verdict ([`sentinel::Verdict`]).
    sentinels: Mutex<String>,
    /// Beside a cluster node: the shard primary its table names
    /// ([`shard::watch`]).
    cluster: Mutex<String>,
    /// A `redis-stream` server's health ([`keep`]; none: not kept).
    server: Mutex<Option<keep::Health>>,
    /// That server left the feed as a master ([`keep::Decision::Left`]):
    /// no re-seeding may replace what it holds.
    server_left: std::sync::atomic::AtomicBool,
    /// A reader needs a snapshot that continues into the log, and none
    /// does ([`follow::snapshots_on_demand`] takes one).
    snapshot_wanted: tokio::sync::Notify,
    /// A reader found a damaged record ([`mend`] fetches it again).
    damage_found: tokio::sync::Notify,
    gauges: Gauges,
}

/// The instance's stream metrics a [`Stream`] keeps current.
struct Gauges {
    /// Records found damaged on reading (`kvsync_stream_checksum_failures_total`).
    damaged: prometheus::IntCounter,
    /// Damaged records mended, and cut (`kvsync_stream_refetched_total`).
    mended: prometheus::IntCounter,
    cut: prometheus::IntCounter,
    /// Bytes readers got from the log's newest bytes in memory, and from
    /// its files (`kvsync_stream_read_bytes_total`).
    read_from_memory: prometheus::IntCounter,
    read_from_file: prometheus::IntCounter,
    log_bytes: prometheus::IntGauge,
    span: prometheus::IntGauge,
    behind: prometheus::IntGauge,
    /// Downstreams marked lagging (`kvsync_stream_lagging_downstreams`).
    lagging: prometheus::IntGauge,
    /// Sessions refused at a limit (`kvsync_stream_refused_total`,
    /// `busy` and `busy_host`).
    busy: prometheus::IntCounter,
    busy_host: prometheus::IntCounter,
}

/// What a stream's writer is doing (status shows it as text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriterState {
    /// No session has started yet.
    Starting,
    /// Following its primary.
    FollowingPrimary,
    /// Following an upstream agent.
    FollowingAgent { upstream: String, over: Over },
    /// A session ended (`reason`); the writer asks again.
    Reconnecting { reason: String },
    /// An RDMA ring session failed (`reason`); the stream goes on over TCP.
    RingFailed { reason: String },
    /// A damaged record was cut off at `offset`; the log is fetched again
    /// from there.
    Refetching { offset: u64, reason: String },
    /// The log started over at an upstream's snapshot, which is synced
    /// from it.
    Reseeding { upstream: String, seq: u64 },
    /// The upstreams no longer hold the log's offset (`reason` names the
    /// snapshot that continues into theirs) and it is not re-seeded on its
    /// own (`[stream] reseed = false`, or starting over failed): stuck
    /// until a sync of a snapshot starts the log over.
    NeedsSnapshot { reason: String },
}

/// How a replica agent's session with its upstream runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    Tcp,
    /// Over TCP until the RDMA ring is tried again.
    TcpFallback,
    Ring,
}

impl std::fmt::Display for WriterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriterState::Starting => write!(f, "starting"),
            WriterState::FollowingPrimary => write!(f, "following"),
            WriterState::FollowingAgent { upstream, over } => match over {
                Over::Tcp => write!(f, "following agent {upstream}"),
                Over::TcpFallback => write!(
                    f,
                    "following agent {upstream} over TCP until the RDMA ring is tried again"
                ),
                Over::Ring => write!(f, "following agent {upstream} through an RDMA ring"),
            },
            WriterState::Reconnecting { reason } => write!(f, "reconnecting: {reason}"),
            WriterState::RingFailed { reason } => write!(
                f,
                "reconnecting over TCP after the RDMA ring failed: {reason}"
            ),
            WriterState::Refetching { offset, reason } => {
                write!(f, "refetching from offset {offset}: {reason}")
            }
            WriterState::Reseeding { upstream, seq } => {
                write!(f, "re-seeding from {upstream}'s snapshot of seq {seq}")
            }
            WriterState::NeedsSnapshot { reason } => write!(f, "needs a snapshot: {reason}"),
        }
    }
}

/// A stream log shared by its writer and its readers.
pub type SharedLog = Arc<Stream>;

/// The data frames a session sent (`role = "source"`) or took
/// (`"replica"`) and their bytes (`kvsync_stream_frames_total`,
/// `kvsync_stream_bytes_total`).
#[derive(Clone)]
pub struct Traffic {
    bytes: prometheus::IntCounter,
    frames: prometheus::IntCounter,
}

impl Traffic {
    pub fn of(metrics: &Metrics, instance: &str, role: &str) -> Traffic {
        Traffic {
            bytes: metrics.stream_bytes.with_label_values(&[instance, role]),
            frames: metrics.stream_frames.with_label_values(&[instance, role]),
        }
    }

    /// One frame of `len` bytes.
    pub fn frame(&self, len: usize) {
        self.frames.inc();
        self.bytes.inc_by(len as u64);
    }
}

impl Stream {
    /// The stream of `log`, from `source`, with `instance`'s metrics.
    pub fn new(log: Log, source: source::Source, metrics: &Metrics, instance: &str) -> SharedLog {
        let name = [instance];
        let gauges = Gauges {
            damaged: metrics.stream_checksum_failures.with_label_values(&name),
            mended: metrics
                .stream_refetched
                .with_label_values(&[instance, "mended"]),
            cut: metrics
                .stream_refetched
                .with_label_values(&[instance, "cut"]),
            read_from_memory: metrics
                .stream_read_bytes
                .with_label_values(&[instance, "memory"]),
            read_from_file: metrics
                .stream_read_bytes
                .with_label_values(&[instance, "file"]),
            log_bytes: metrics.stream_log_bytes.with_label_values(&name),
            span: metrics.stream_log_span.with_label_values(&name),
            behind: metrics.stream_behind_bytes.with_label_values(&name),
            lagging: metrics.stream_lagging.with_label_values(&name),
            busy: metrics
                .stream_refused
                .with_label_values(&[instance, "busy"]),
            busy_host: metrics
                .stream_refused
                .with_label_values(&[instance, "busy_host"]),
        };
        let set_aside = log.set_aside().len() as i64;
        metrics
            .stream_set_aside
            .with_label_values(&name)
            .set(set_aside);
        let stream = Arc::new(Stream {
            log: Mutex::new(log),
            changed: watch::Sender::new(0),
            source: Mutex::new(source),
            state: Mutex::new(WriterState::Starting),
            acks: Mutex::default(),
            lagging: Mutex::default(),
            acks_changed: watch::Sender::new(0),
            upstream_acked: AtomicU64::new(0),
            behind_since: Mutex::default(),
            write_safety: Mutex::default(),
            diverged: Mutex::default(),
            sentinels: Mutex::default(),
            cluster: Mutex::default(),
            server: Mutex::default(),
            server_left: Default::default(),
            snapshot_wanted: tokio::sync::Notify::new(),
            damage_found: tokio::sync::Notify::new(),
            gauges,
        });
        stream.export();
        stream
    }

    /// Sets the log's gauges: its size and span, and how far its slowest
    /// downstream is behind its end.
    fn export(&self) {
        let figures = log_figures(&self.lock());
        self.set_gauges(figures);
    }

    /// Sets the gauges from the log's `(bytes, first, end)`.
    fn set_gauges(&self, (bytes, first, end): (u64, u64, u64)) {
        let g = &self.gauges;
        g.log_bytes.set(bytes as i64);
        g.span.set(end.saturating_sub(first) as i64);
        let behind = self.applied().map_or(0, |a| end.saturating_sub(a));
        g.behind.set(behind as i64);
    }

    /// Looks at the log under its lock, which is never held across a wait
    /// (readers of the stream go through [`Stream::next`], writers through
    /// [`Stream::write`]).
    pub fn view<T>(&self, f: impl FnOnce(&Log) -> T) -> T {
        f(&self.lock())
    }

    /// The log's replication id and end ([`Log::position`]).
    pub fn position(&self) -> Option<(String, u64)> {
        self.lock().position()
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().expect("stream log lock")
    }

    /// Changes the log and wakes its readers.
    pub fn write<T>(&self, f: impl FnOnce(&mut Log) -> T) -> T {
        let mut log = self.lock();
        let out = f(&mut log);
        self.wrote(log);
        out
    }

    /// After a change under `log`'s lock: its figures read there, the lock
    /// released, then the gauges set and the readers woken.
    fn wrote(&self, log: MutexGuard<'_, Log>) {
        let figures = log_figures(&log);
        drop(log);
        self.set_gauges(figures);
        self.changed.send_modify(|n| *n += 1);
    }

    /// An append (`f`, which appends and nothing else that waits for the
    /// disk) from the runtime: on the caller's thread when it writes to
    /// the page cache only (`fsync = "everysec"`: the flush is the
    /// writer's once-a-second tick, on the blocking pool), so the live
    /// stream takes no thread hand-off; on the blocking pool when it waits
    /// for the disk ([`Log::append_waits_for_disk`]: `"always"`, or a
    /// segment to close and make).
    pub async fn append<T: Send + 'static>(
        self: &SharedLog,
        f: impl FnOnce(&mut Log) -> T + Send + 'static,
    ) -> T {
        let f = {
            let mut log = self.lock();
            if !log.append_waits_for_disk() {
                let out = f(&mut log);
                self.wrote(log);
                return out;
            }
            f
        };
        let stream = self.clone();
        tokio::task::spawn_blocking(move || stream.write(f))
            .await
            .expect("log append task")
    }

    /// The writer's once-a-second care, on a thread that may block: the
    /// log must still end at `end` (a reader may have cut it back), it is
    /// trimmed to its retention above `floor`, and what was appended since
    /// the last flush is flushed (`everysec`), off the log's lock so that
    /// appends and readers go on meanwhile.
    pub fn tick(&self, end: u64, floor: u64) -> Result<(), LogError> {
        let due = self.write(|l| {
            l.still_ends_at(end)?;
            l.tick(floor)
        })?;
        if let Some((file, at, path)) = due {
            file.sync_data()
                .map_err(|source| LogError::Io { path, source })?;
            self.lock().flushed(at);
        }
        Ok(())
    }

    /// Wakes after the next write.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The oldest offset a snapshot of `offered` (replication id, M)
    /// continues from, which the log's retention keeps (`u64::MAX`: none
    /// continues into the log).
    pub fn floor(&self, offered: &[(String, u64)]) -> u64 {
        let log = self.lock();
        offered
            .iter()
            .filter(|(id, m)| log.covers(id, *m).is_ok())
            .map(|(_, m)| *m)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Says that a reader needs a snapshot that continues into the log
    /// and none does.
    pub fn want_snapshot(&self) {
        self.snapshot_wanted.notify_one();
    }

    /// Wakes when a reader has found a damaged record (one found before
    /// the wait wakes it at once).
    pub async fn damage_found(&self) {
        self.damage_found.notified().await
    }

    /// Wakes when a reader needs a snapshot ([`Stream::want_snapshot`]).
    pub async fn snapshot_wanted(&self) {
        self.snapshot_wanted.notified().await
    }

    /// Where the stream comes from now ([`source::Source`]'s text).
    pub fn source(&self) -> source::Source {
        self.source.lock().expect("source lock").clone()
    }

    pub fn set_source(&self, source: source::Source) {
        *self.source.lock().expect("source lock") = source;
    }

    /// Starts the log over at a full resync's (`replid`, `m`), dropping
    /// what it held, and sets the writer's `state`, both under the log's
    /// lock: a writer that sees the new start (a pull that reconnects from
    /// it) sets its own state after this one, never before.
    pub fn start_over(
        &self,
        replid: &str,
        m: u64,
        state: WriterState,
    ) -> Result<(), log::LogError> {
        self.write(|l| {
            l.restart(replid, m)?;
            self.set_state(state);
            Ok(())
        })
    }

    /// A sync from `upstream` installs the snapshot of `seq` (`replid`,
    /// `m`) for the server fed from this log: when the writer is stuck
    /// ([`WriterState::NeedsSnapshot`]) and the log does not hold the
    /// snapshot's M (nor can it reach it: its upstreams no longer serve
    /// what follows its end), the log starts over at it, as a re-seeding
    /// would (the sync, an operator's or an orchestrator's, is the
    /// consent), so that the feed seeds the server from it and the stream
    /// goes on after it. Returns whether it did.
    pub fn start_over_for_sync(
        &self,
        upstream: &str,
        seq: u64,
        (replid, m): (&str, u64),
    ) -> Result<bool, log::LogError> {
        if !matches!(self.state(), WriterState::NeedsSnapshot { .. })
            || self.view(|l| l.covers(replid, m).is_ok())
        {
            return Ok(false);
        }
        let upstream = upstream.to_string();
        self.start_over(replid, m, WriterState::Reseeding { upstream, seq })?;
        Ok(true)
    }

    pub fn set_server_health(&self, health: keep::Health) {
        *self.server.lock().expect("server health lock") = Some(health);
    }

    pub fn set_server_left(&self, left: bool) {
        self.server_left.store(left, Ordering::Relaxed);
    }

    /// The fed server left the feed as a master ([`keep::Decision::Left`]).
    pub fn server_left(&self) -> bool {
        self.server_left.load(Ordering::Relaxed)
    }

    /// The fed server's health, when [`keep`] keeps one.
    pub fn server_health(&self) -> Option<keep::Health> {
        self.server.lock().expect("server health lock").clone()
    }

    /// How the log's writer is, by its state: stuck when it needs a
    /// snapshot, degraded until it follows.
    pub fn writer_health(&self) -> keep::Health {
        let state = self.state();
        let text = state.to_string();
        match state {
            WriterState::FollowingPrimary | WriterState::FollowingAgent { .. } => {
                keep::Health::ok(text)
            }
            WriterState::NeedsSnapshot { .. } => keep::Health::stuck(text),
            _ => keep::Health::degraded(text),
        }
    }

    pub fn set_state(&self, state: WriterState) {
        *self.state.lock().expect("stream state lock") = state;
    }

    pub fn state(&self) -> WriterState {
        self.state.lock().expect("stream state lock").clone()
    }

    /// Records what `who` acknowledged and wakes those who pass it on.
    pub fn acked(&self, who: Downstream, offset: u64) {
        let before = self.lock_acks().insert(who, offset);
        if before != Some(offset) {
            self.acks_changed.send_modify(|n| *n += 1);
            self.export();
        }
    }

    /// Forgets a downstream that is gone.
    pub fn forget(&self, who: &Downstream) {
        self.set_lagging(who, false);
        if self.lock_acks().remove(who).is_some() {
            self.acks_changed.send_modify(|n| *n += 1);
            self.export();
        }
    }

    /// Marks `who` lagging or not.
    pub fn set_lagging(&self, who: &Downstream, lagging: bool) {
        let mut set = self.lagging.lock().expect("stream lagging lock");
        match lagging {
            true => set.insert(who.clone()),
            false => set.remove(who),
        };
        self.gauges.lagging.set(set.len() as i64);
    }

    /// Whether `who` is marked lagging.
    pub fn is_lagging(&self, who: &Downstream) -> bool {
        self.lagging
            .lock()
            .expect("stream lagging lock")
            .contains(who)
    }

    /// The downstreams marked lagging.
    pub fn lagging(&self) -> Vec<Downstream> {
        let set = self.lagging.lock().expect("stream lagging lock");
        set.iter().cloned().collect()
    }

    /// The lowest offset the downstreams acknowledged (`None`: none has).
    pub fn applied(&self) -> Option<u64> {
        self.lock_acks().values().copied().min()
    }

    /// What `who` acknowledged last.
    pub fn acked_by(&self, who: &Downstream) -> Option<u64> {
        self.lock_acks().get(who).copied()
    }

    /// Every downstream with what it acknowledged.
    pub fn downstreams(&self) -> Vec<(Downstream, u64)> {
        self.lock_acks()
            .iter()
            .map(|(d, o)| (d.clone(), *o))
            .collect()
    }

    /// Wakes after the next change of an acknowledgement.
    pub fn watch_acks(&self) -> watch::Receiver<u64> {
        self.acks_changed.subscribe()
    }

    pub fn set_upstream_acked(&self, offset: u64) {
        self.upstream_acked.store(offset, Ordering::Relaxed);
    }

    pub fn upstream_acked(&self) -> u64 {
        self.upstream_acked.load(Ordering::Relaxed)
    }

    /// The follower's record of when the oldest stretch not yet applied
    /// downstream was logged.
    pub fn set_behind_since(&self, since: Option<std::time::Instant>) {
        *self.behind_since.lock().expect("behind lock") = since;
    }

    /// How long the slowest downstream has been behind the primary's
    /// stream: the age of the oldest stretch it has not applied (zero when
    /// it has everything, or where this agent does not follow a primary).
    pub fn behind(&self) -> std::time::Duration {
        self.behind_since
            .lock()
            .expect("behind lock")
            .map_or(std::time::Duration::ZERO, |t| t.elapsed())
    }

    /// A session was refused at a limit.
    pub fn refused(&self, busy: &serve::Busy) {
        match busy {
            serve::Busy::Full => self.gauges.busy.inc(),
            serve::Busy::Host(_) => self.gauges.busy_host.inc(),
        }
    }

    /// Records found damaged on reading since the agent started.
    pub fn damaged(&self) -> u64 {
        self.gauges.damaged.get()
    }

    pub fn set_write_safety(&self, state: String) {
        *self.write_safety.lock().expect("write safety lock") = state;
    }

    /// Reports what a failover made the log drop.
    pub fn set_diverged(&self, what: String) {
        *self.diverged.lock().expect("diverged lock") = what;
    }

    pub fn set_sentinels(&self, verdict: String) {
        *self.sentinels.lock().expect("sentinels lock") = verdict;
    }

    pub fn sentinels(&self) -> String {
        self.sentinels.lock().expect("sentinels lock").clone()
    }

    pub fn set_cluster(&self, named: String) {
        *self.cluster.lock().expect("cluster lock") = named;
    }

    pub fn cluster(&self) -> String {
        self.cluster.lock().expect("cluster lock").clone()
    }

    /// The last failover's divergence (empty: none).
    pub fn diverged(&self) -> String {
        self.diverged.lock().expect("diverged lock").clone()
    }

    /// The primary's `min-replicas-to-write` condition (empty: not
    /// watched, the log follows an agent).
    pub fn write_safety(&self) -> String {
        self.write_safety.lock().expect("write safety lock").clone()
    }

    fn lock_acks(&self) -> MutexGuard<'_, BTreeMap<Downstream, u64>> {
        self.acks.lock().expect("stream acks lock")
    }
}

/// A log's size, first offset and end, for its gauges.
fn log_figures(log: &Log) -> (u64, u64, u64) {
    let end = log.position().map_or(0, |(_, end)| end);
    (log.bytes(), log.first().unwrap_or(end), end)
}
