//! The running agent: binds the listeners and starts the long-running tasks
//! (snapshot watcher, metrics endpoint) with one shutdown signal.
//!
//! Owns start-up order and the "ready" announcement; each task's behaviour
//! belongs to its own module.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cache::SnapshotCache;
use crate::catalog::Catalog;
use crate::config::Config;
use crate::metrics::{self, Metrics};
use crate::watch::DirWatcher;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A listener could not bind its address.
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    /// The snapshot directory cannot be created.
    #[error("cannot create snapshot_dir {path}: {source}")]
    SnapshotDir { path: PathBuf, source: std::io::Error },
}

/// The shared parts of one agent.
pub struct Shared {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    pub catalog: Arc<Catalog>,
    pub cache: Arc<SnapshotCache>,
}

/// A started agent: its bound addresses and a handle to stop it.
pub struct RunningAgent {
    pub shared: Arc<Shared>,
    pub metrics_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
}

impl RunningAgent {
    /// Binds every listener and starts every task.
    pub async fn start(config: Config) -> Result<RunningAgent, AgentError> {
        if let Err(source) = std::fs::create_dir_all(&config.snapshot_dir) {
            return Err(AgentError::SnapshotDir { path: config.snapshot_dir.clone(), source });
        }
        let metrics = Metrics::new();
        let catalog = Catalog::new(metrics.clone());
        let cache = SnapshotCache::new(
            config.cache.memory_budget.as_u64(),
            config.cache.acquire_timeout,
            metrics.clone(),
        );
        let shared = Arc::new(Shared { config, metrics, catalog, cache });
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();

        let metrics_addr = if shared.config.metrics.listen.is_empty() {
            None
        } else {
            let addr = &shared.config.metrics.listen;
            let (listener, local) = metrics::bind(addr)
                .await
                .map_err(|source| AgentError::Bind { what: "metrics.listen", addr: addr.clone(), source })?;
            let stop = shutdown.clone();
            let m = shared.metrics.clone();
            tasks.spawn(async move {
                if let Err(e) = metrics::serve(listener, m, async move { stop.cancelled().await }).await {
                    warn!(error = %e, "metrics endpoint stopped");
                }
            });
            Some(local)
        };

        let watcher = DirWatcher::new(
            shared.config.snapshot_dir.clone(),
            shared.config.snapshot_format,
            shared.catalog.clone(),
            shared.metrics.clone(),
            shared.config.watch.clone(),
        );
        tasks.spawn(watcher.run(shutdown.clone()));

        info!(
            node_id = %shared.config.node_id,
            snapshot_dir = %shared.config.snapshot_dir.display(),
            metrics = ?metrics_addr,
            "agent started"
        );
        Ok(RunningAgent { shared, metrics_addr, shutdown, tasks })
    }

    /// The line printed on stdout once every listener is up; tests and
    /// scripts read it to learn the bound ports.
    pub fn ready_line(&self) -> String {
        let metrics = self.metrics_addr.map(|a| a.to_string()).unwrap_or_else(|| "-".into());
        format!("kvsync agent ready node={} metrics={metrics}", self.shared.config.node_id)
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops every task and waits for them.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
    }

    /// Runs until the shutdown token is cancelled, then stops.
    pub async fn run_until_stopped(self) {
        self.shutdown.cancelled().await;
        self.stop().await;
    }
}
