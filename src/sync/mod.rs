//! Sync jobs: what drives a full sync end to end, for each role.
//!
//! [`SyncManager`] owns the replica-side jobs of this agent, for every
//! [`crate::instance`] it serves: starting one (or returning the running one for
//! the same instance and source), their progress as a
//! watchable [`pb::SyncProgress`], cancellation, and the list of recent
//! finished syncs (kept across restarts by [`history`]). The job itself is driven by [`job`] and decided by
//! [`policy`], its receiving end is [`receive`] (run on several TCP
//! streams at once by [`streams`]), why it failed is [`error`]. The source
//! role: [`offer`] turns a replica's request into an offered session,
//! [`serve`] holds the sessions and serves their data connections
//! (what this agent passes on to other replicas is
//! [`crate::store::relay`]).

pub mod error;
pub mod history;
pub mod job;
pub mod offer;
pub mod plane;
pub mod policy;
pub mod receive;
pub mod serve;
pub mod streams;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::rpc::{pb, Dialer};
use crate::transport::probe::LocalRdma;

/// Why a sync request was refused.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No sync with this id.
    #[error("no sync with id {0:?}")]
    NoSuchSync(String),
    /// This agent cannot start it now (its snapshot_dir is not writable;
    /// a fan-out without a snapshot).
    #[error("{0}")]
    CannotStart(String),
    /// Too many syncs running.
    #[error("{0}")]
    Busy(String),
    /// The agent is shutting down.
    #[error("{0}")]
    ShuttingDown(String),
    /// The source is not in `sync.allowed_sources`.
    #[error("{0}")]
    SourceNotAllowed(String),
}

struct Running {
    instance: String,
    source: String,
    /// The manifest digest the sync was asked for, if any.
    digest: Option<blake3::Hash>,
    progress: watch::Receiver<pb::SyncProgress>,
    cancel: CancellationToken,
}

#[derive(Default)]
struct Jobs {
    running: HashMap<String, Running>,
    recent: VecDeque<pb::SyncProgress>,
}

/// The replica-side jobs of one agent.
pub struct SyncManager {
    /// The agent's configuration: its shared sections are what the manager
    /// reads (each job gets its instance's).
    config: Config,
    metrics: Arc<Metrics>,
    rdma: Arc<LocalRdma>,
    /// How jobs reach their sources.
    dialer: Dialer,
    /// Syncs running at once (reloaded on SIGHUP).
    max_incoming: AtomicUsize,
    jobs: Mutex<Jobs>,
    /// Serialises the writes of the history kept in `state_dir`.
    history: Mutex<()>,
    shutdown: CancellationToken,
    /// Cancelled when the agent starts draining: no new syncs.
    draining: CancellationToken,
}

/// What to pull, and from where.
#[derive(Debug, Clone, Default)]
pub struct Pull {
    /// The source's gRPC address (`host:port`).
    pub source: String,
    /// Where to turn when the source fails, nearest first.
    pub upstream: Vec<String>,
    /// Exactly this snapshot (`None`: the source's latest).
    pub want: Option<crate::snapshot::SnapshotId>,
    /// The transport mode asked for (`None`: the configured one).
    pub mode: Option<crate::config::TransportMode>,
    /// The source's instance to ask for (empty: its only one).
    pub source_instance: String,
}

/// Most upstream sources of one sync (a fan-out tree's depth).
const MAX_UPSTREAM: usize = 16;

impl SyncManager {
    pub fn new(
        config: Config,
        metrics: Arc<Metrics>,
        rdma: Arc<LocalRdma>,
        dialer: Dialer,
        shutdown: CancellationToken,
        draining: CancellationToken,
    ) -> Arc<SyncManager> {
        Arc::new(SyncManager {
            metrics,
            rdma,
            max_incoming: AtomicUsize::new(config.sync.max_incoming_syncs),
            jobs: Mutex::new(Jobs {
                running: HashMap::new(),
                recent: match &config.state_dir {
                    Some(dir) => history::load(dir, config.sync.keep_recent.max(1)).into(),
                    None => VecDeque::new(),
                },
            }),
            config,
            dialer,
            history: Mutex::new(()),
            shutdown,
            draining,
        })
    }

    /// Checks what `pull` names: its source and upstreams allowed, at most
    /// [`MAX_UPSTREAM`] of them, and a plain instance name. Returns the
    /// source and the upstreams.
    fn check_pull<'a>(&self, pull: &'a Pull) -> Result<(&'a str, Vec<String>), SyncError> {
        let source = self.check_source(&pull.source)?;
        let upstream = pull
            .upstream
            .iter()
            .map(|u| self.check_source(u).map(str::to_string))
            .collect::<Result<Vec<_>, _>>()?;
        if upstream.len() > MAX_UPSTREAM {
            return Err(SyncError::BadRequest(format!(
                "at most {MAX_UPSTREAM} upstream sources"
            )));
        }
        if !pull.source_instance.is_empty()
            && !crate::peer_text::is_plain_name(&pull.source_instance)
        {
            return Err(SyncError::BadRequest(format!(
                "source_instance must be a plain name, got {:?}",
                pull.source_instance
            )));
        }
        Ok((source, upstream))
    }

    /// Starts a pull into `instance`, or returns the sync already running
    /// into it from the same source. Returns (id, created).
    pub fn start(
        self: &Arc<Self>,
        instance: &Arc<crate::instance::Instance>,
        pull: Pull,
    ) -> Result<(String, bool), SyncError> {
        let (source, upstream) = self.check_pull(&pull)?;
        let mut jobs = self.jobs.lock().expect("jobs lock");
        // Per instance, one sync per source, and one per snapshot asked for
        // by digest (from whichever source): never two receiving the same
        // bytes.
        let digest = pull.want.and_then(|w| w.digest);
        if let Some((id, _)) = jobs.running.iter().find(|(_, r)| {
            r.instance == instance.name
                && (r.source == source || (digest.is_some() && r.digest == digest))
        }) {
            return Ok((id.clone(), false));
        }
        let limit = self.max_incoming.load(Ordering::Relaxed);
        if jobs.running.len() >= limit {
            return Err(SyncError::Busy(format!(
                "{limit} syncs are running on this agent (sync.max_incoming_syncs); retry when one has finished"
            )));
        }
        // Refuse before anything moves when we could not install the result.
        crate::store::install::check_writable(&instance.config.snapshot_dir)
            .map_err(|e| SyncError::CannotStart(e.to_string()))?;
        let id = new_id();
        let initial = pb::SyncProgress {
            sync_id: id.clone(),
            source: source.to_string(),
            phase: pb::Phase::Negotiating as i32,
            started_unix_ms: unix_ms(),
            format: instance.config.snapshot_format.as_str().into(),
            instance: instance.name.clone(),
            ..Default::default()
        };
        let (tx, rx) = watch::channel(initial);
        // Removing the instance (or stopping the agent) cancels it.
        let cancel = instance.stop.child_token();
        jobs.running.insert(
            id.clone(),
            Running {
                instance: instance.name.clone(),
                source: source.to_string(),
                digest,
                progress: rx,
                cancel: cancel.clone(),
            },
        );
        drop(jobs);

        let ctx = job::JobContext {
            id: id.clone(),
            source: source.to_string(),
            upstream,
            want: pull.want,
            mode: pull.mode,
            instance: instance.name.clone(),
            source_instance: pull.source_instance,
            relays: instance.relays.clone(),
            feed: instance.feed.clone(),
            stream: instance.stream.clone(),
            config: instance.config.clone(),
            metrics: self.metrics.clone(),
            rdma: self.rdma.clone(),
            dialer: self.dialer.clone(),
            progress: tx,
            cancel,
        };
        let me = self.clone();
        tokio::spawn(async move {
            let id = ctx.id.clone();
            let last = job::run(ctx).await;
            me.finish(&id, last);
            if me.config.state_dir.is_some() {
                let kept = tokio::task::spawn_blocking(move || me.keep_history()).await;
                if let Ok(Err(e)) = kept {
                    tracing::warn!(error = %e, "cannot keep the sync history: status forgets it at a restart");
                }
            }
        });
        Ok((id, true))
    }

    /// The trimmed source address, if a sync may pull from it now.
    fn check_source<'a>(&self, source: &'a str) -> Result<&'a str, SyncError> {
        let source = source.trim();
        if !crate::rpc::dial::is_agent_addr(source) {
            return Err(SyncError::BadRequest(format!(
                "source must be the source agent's gRPC address host:port, got {source:?}"
            )));
        }
        if self.shutdown.is_cancelled() || self.draining.is_cancelled() {
            return Err(SyncError::ShuttingDown(
                "agent is shutting down; start the sync on another agent or after the restart"
                    .into(),
            ));
        }
        if !crate::rpc::dial::allowed(&self.config.sync.allowed_sources, source) {
            return Err(SyncError::SourceNotAllowed(format!(
                "{source} is not in sync.allowed_sources of this agent; add it there to pull from it"
            )));
        }
        Ok(source)
    }

    fn finish(&self, id: &str, last: pb::SyncProgress) {
        let mut jobs = self.jobs.lock().expect("jobs lock");
        jobs.running.remove(id);
        jobs.recent.push_front(last);
        jobs.recent.truncate(self.config.sync.keep_recent.max(1));
    }

    /// A receiver of the sync's progress; for a finished sync it holds the
    /// final state.
    pub fn watch(&self, id: &str) -> Result<watch::Receiver<pb::SyncProgress>, SyncError> {
        let jobs = self.jobs.lock().expect("jobs lock");
        if let Some(r) = jobs.running.get(id) {
            return Ok(r.progress.clone());
        }
        jobs.recent
            .iter()
            .find(|p| p.sync_id == id)
            .map(|p| watch::channel(p.clone()).1)
            .ok_or_else(|| SyncError::NoSuchSync(id.to_string()))
    }

    /// Writes the recent syncs, as they stand now, to the history in
    /// `state_dir` (when there is one).
    fn keep_history(&self) -> std::io::Result<()> {
        let Some(dir) = &self.config.state_dir else {
            return Ok(());
        };
        let _one_writer = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let recent: Vec<_> = self.jobs.lock().expect("jobs lock").recent.clone().into();
        history::save(dir, &recent)
    }

    /// Changes how many syncs may run at once (running ones continue).
    pub fn set_max_incoming(&self, limit: usize) {
        self.max_incoming.store(limit, Ordering::Relaxed);
    }

    /// Cancels a running sync; false when it already finished.
    pub fn cancel(&self, id: &str) -> Result<bool, SyncError> {
        let jobs = self.jobs.lock().expect("jobs lock");
        if let Some(r) = jobs.running.get(id) {
            r.cancel.cancel();
            return Ok(true);
        }
        if jobs.recent.iter().any(|p| p.sync_id == id) {
            return Ok(false);
        }
        Err(SyncError::NoSuchSync(id.to_string()))
    }

    /// Progress of every running sync into `instance`.
    pub fn running(&self, instance: &str) -> Vec<pb::SyncProgress> {
        let jobs = self.jobs.lock().expect("jobs lock");
        jobs.running
            .values()
            .filter(|r| r.instance == instance)
            .map(|r| r.progress.borrow().clone())
            .collect()
    }

    /// Finished syncs into `instance`, newest first.
    pub fn recent(&self, instance: &str) -> Vec<pb::SyncProgress> {
        self.jobs
            .lock()
            .expect("jobs lock")
            .recent
            .iter()
            .filter(|p| p.instance == instance)
            .cloned()
            .collect()
    }

    /// Number of syncs running (into `instance`; `None`: into any).
    pub fn running_count_of(&self, instance: Option<&str>) -> usize {
        let jobs = self.jobs.lock().expect("jobs lock");
        jobs.running
            .values()
            .filter(|r| instance.is_none_or(|i| r.instance == i))
            .count()
    }

    /// Number of syncs running.
    pub fn running_count(&self) -> usize {
        self.running_count_of(None)
    }

    /// Cancels every running sync (shutdown).
    pub fn cancel_all(&self) {
        for r in self.jobs.lock().expect("jobs lock").running.values() {
            r.cancel.cancel();
        }
    }
}

/// A short random id (hex).
pub fn new_id() -> String {
    use rand::RngCore;
    let mut b = [0u8; 8];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Milliseconds since the unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
