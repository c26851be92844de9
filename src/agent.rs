//! The running agent: binds the listeners and starts the long-running tasks
//! (snapshot watcher, gRPC control plane with its TLS and request limits,
//! TCP and RDMA data listeners, metrics endpoint) with one shutdown signal.
//!
//! Owns start-up order, the "ready" announcement, the drain before a
//! shutdown and what a reload changes; each task's behaviour belongs to its
//! own module.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tracing::{info, warn};

use crate::cache::SnapshotCache;
use crate::catalog::Catalog;
use crate::config::{Config, RdmaProvider};
use crate::control::orchestrator::OrchestratorService;
use crate::control::pb;
use crate::control::peer::PeerService;
use crate::metrics::{self, Metrics};
use crate::sync::source::{self as source_role, DataPlane, SessionTable};
use crate::sync::SyncManager;
use crate::transport::probe::Probe;
use crate::transport::ratelimit::RateLimiter;
use crate::transport::Faults;
use crate::watch::DirWatcher;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A listener could not bind its address.
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    /// The snapshot directory cannot be created.
    #[error("cannot create snapshot_dir {path}: {source}")]
    SnapshotDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `KVSYNC_FAULTS` is malformed.
    #[error("KVSYNC_FAULTS: {0}")]
    Faults(String),
    /// `[auth] token_file` is unusable.
    #[error("auth.token_file: {0}")]
    Tokens(String),
    /// `[tls]` is unusable.
    #[error("tls: {0}")]
    Tls(#[from] crate::control::tls::TlsError),
    /// The gRPC server refused the TLS settings.
    #[error("tls: {0}")]
    TlsServer(String),
    /// The gRPC reflection service could not be built.
    #[error("grpc reflection: {0}")]
    Reflection(String),
}

/// Largest gRPC request an agent decodes; every request is a few short
/// fields, so anything bigger is refused before it is parsed.
const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// The shared parts of one agent.
pub struct Shared {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    pub catalog: Arc<Catalog>,
    pub cache: Arc<SnapshotCache>,
    /// Sessions offered to replicas (source role).
    pub sessions: Arc<SessionTable>,
    /// Where the TCP data listener is bound.
    pub data_tcp_addr: SocketAddr,
    /// What the RDMA probe found at start (and whether the listener is up).
    pub rdma: Arc<Probe>,
    /// Where the RDMA listener is bound, when RDMA is usable.
    pub rdma_endpoint: Option<SocketAddr>,
    /// Cancelled when the agent starts draining for shutdown.
    pub draining: CancellationToken,
    /// Accepted control-plane tokens (reloaded on SIGHUP).
    pub tokens: Arc<crate::control::auth::Tokens>,
    /// Bandwidth limit of what this agent sends (reloaded on SIGHUP).
    pub rate: Arc<RateLimiter>,
    /// Sessions this source serves at once (reloaded on SIGHUP).
    pub max_outgoing: AtomicUsize,
}

/// A started agent: its bound addresses and a handle to stop it.
pub struct RunningAgent {
    pub shared: Arc<Shared>,
    pub syncs: Arc<SyncManager>,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    health: tonic_health::server::HealthReporter,
}

impl RunningAgent {
    /// Binds every listener and starts every task.
    pub async fn start(config: Config) -> Result<RunningAgent, AgentError> {
        if let Err(source) = std::fs::create_dir_all(&config.snapshot_dir) {
            return Err(AgentError::SnapshotDir {
                path: config.snapshot_dir.clone(),
                source,
            });
        }
        let faults = Faults::from_env().map_err(AgentError::Faults)?;
        let tokens = crate::control::auth::Tokens::load(config.auth.token_file.as_deref())
            .map_err(AgentError::Tokens)?;
        let server_tls = crate::control::tls::server(&config.tls)?;
        let client_tls = crate::control::tls::agent_client(&config.tls)?;
        if faults.any() {
            warn!(?faults, "FAULT INJECTION ACTIVE (KVSYNC_FAULTS): this agent corrupts or stalls transfers on purpose");
        }
        let swept = crate::install::sweep_stale(&config.snapshot_dir);
        if swept > 0 {
            info!(count = swept, "removed stale temp files of an earlier run");
        }
        let bind = |what: &'static str, addr: &str| {
            let addr = addr.to_string();
            async move {
                let l = tokio::net::TcpListener::bind(&addr)
                    .await
                    .map_err(|source| AgentError::Bind {
                        what,
                        addr: addr.clone(),
                        source,
                    })?;
                let local =
                    l.local_addr()
                        .map_err(|source| AgentError::Bind { what, addr, source })?;
                Ok::<_, AgentError>((l, local))
            }
        };
        let (grpc_listener, grpc_addr) = bind("grpc.listen", &config.grpc.listen).await?;
        let (data_listener, data_tcp_addr) =
            bind("data.tcp_listen", &config.data.tcp_listen).await?;

        let metrics = Metrics::new();
        let catalog = Catalog::new(metrics.clone());
        let cache = SnapshotCache::new(
            config.cache.memory_budget.as_u64(),
            config.cache.acquire_timeout,
            metrics.clone(),
        );
        let sessions = Arc::new(SessionTable::default());
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();

        // Transport selection, and the RDMA listener when RDMA is usable.
        let mut rdma = crate::transport::probe::probe(&config.transport);
        let plane = DataPlane {
            sessions: sessions.clone(),
            metrics: metrics.clone(),
            faults: faults.clone(),
            bulk: Probe::bulk_params(&config.transport, rdma.soft),
            shutdown: shutdown.clone(),
            rate: Arc::new(RateLimiter::new(config.sync.rate_limit.as_u64())),
            peer_timeout: config.data.peer_timeout,
        };
        let rdma_endpoint = match start_rdma_listener(&config, &rdma, &plane, &mut tasks).await {
            Ok(endpoint) => endpoint,
            Err(e) => {
                warn!(error = %e, "rdma listener could not start; this agent uses tcp");
                rdma.rdma_available = false;
                rdma.choice = "tcp";
                rdma.reason = format!("no RDMA: {e}");
                None
            }
        };
        info!(choice = rdma.choice, provider = rdma.provider, device = ?rdma.device, interface = ?rdma.interface, endpoint = ?rdma_endpoint, "transport selection: {}", rdma.reason);
        metrics.rdma_available.set(rdma.rdma_available as i64);
        for d in &rdma.devices {
            let soft = if d.soft { "true" } else { "false" };
            metrics
                .rdma_device_info
                .with_label_values(&[d.name.as_str(), soft])
                .set(1);
        }
        let rdma = Arc::new(rdma);
        let shared = Arc::new(Shared {
            max_outgoing: AtomicUsize::new(config.sync.max_outgoing_syncs),
            config,
            metrics,
            catalog,
            cache,
            sessions,
            data_tcp_addr,
            rdma: rdma.clone(),
            rdma_endpoint,
            draining: CancellationToken::new(),
            tokens,
            rate: plane.rate.clone(),
        });
        let syncs = SyncManager::new(
            shared.config.clone(),
            shared.metrics.clone(),
            rdma,
            faults,
            crate::control::Dialer {
                tls: client_tls,
                tokens: shared.tokens.clone(),
            },
            shutdown.clone(),
            shared.draining.clone(),
        );

        let metrics_addr = if shared.config.metrics.listen.is_empty() {
            None
        } else {
            let addr = &shared.config.metrics.listen;
            let (listener, local) =
                metrics::bind(addr)
                    .await
                    .map_err(|source| AgentError::Bind {
                        what: "metrics.listen",
                        addr: addr.clone(),
                        source,
                    })?;
            let stop = shutdown.clone();
            let m = shared.metrics.clone();
            let draining = shared.draining.clone();
            tasks.spawn(async move {
                let stopped = async move { stop.cancelled().await };
                if let Err(e) = metrics::serve(listener, m, draining, stopped).await {
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

        // Data plane.
        tasks.spawn(source_role::serve_tcp(
            data_listener,
            plane,
            shutdown.clone(),
        ));

        // Control plane.
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<pb::orchestrator_server::OrchestratorServer<OrchestratorService>>()
            .await;
        health
            .set_serving::<pb::peer_server::PeerServer<PeerService>>()
            .await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|e| AgentError::Reflection(e.to_string()))?;
        let orchestrator = OrchestratorService {
            shared: shared.clone(),
            syncs: syncs.clone(),
        };
        let peer = PeerService {
            shared: shared.clone(),
            data_addr: data_tcp_addr,
        };
        let auth = crate::control::auth::ServerAuth {
            tokens: shared.tokens.clone(),
            metrics: shared.metrics.clone(),
        };
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = server_tls {
            server = server
                .tls_config(tls)
                .map_err(|e| AgentError::TlsServer(e.to_string()))?;
        }
        let router = server
            .add_service(health_service)
            .add_service(reflection)
            .add_service(InterceptedService::new(
                pb::orchestrator_server::OrchestratorServer::new(orchestrator)
                    .max_decoding_message_size(MAX_REQUEST_BYTES),
                auth.clone(),
            ))
            .add_service(InterceptedService::new(
                pb::peer_server::PeerServer::new(peer).max_decoding_message_size(MAX_REQUEST_BYTES),
                auth,
            ));
        let stop = shutdown.clone();
        tasks.spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc_listener);
            if let Err(e) = router
                .serve_with_incoming_shutdown(incoming, stop.cancelled())
                .await
            {
                warn!(error = %e, "grpc server stopped");
            }
        });

        info!(
            node_id = %shared.config.node_id,
            snapshot_dir = %shared.config.snapshot_dir.display(),
            grpc = %grpc_addr,
            tls = shared.config.tls.enabled(),
            client_auth = shared.config.tls.client_auth,
            data = %data_tcp_addr,
            metrics = ?metrics_addr,
            "agent started"
        );
        Ok(RunningAgent {
            shared,
            syncs,
            grpc_addr,
            metrics_addr,
            shutdown,
            tasks,
            health,
        })
    }

    /// The line printed on stdout once every listener is up; tests and
    /// scripts read it to learn the bound ports.
    pub fn ready_line(&self) -> String {
        let metrics = self
            .metrics_addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into());
        let rdma = match self.shared.rdma_endpoint {
            Some(a) => format!("{}:{a}", self.shared.rdma.provider),
            None => "-".into(),
        };
        format!(
            "kvsync agent ready node={} grpc={} data={} metrics={metrics} rdma={rdma}",
            self.shared.config.node_id, self.grpc_addr, self.shared.data_tcp_addr
        )
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Applies what a SIGHUP reloads from a re-read configuration: the
    /// token file, the bandwidth limit, the admission limits and the cache
    /// budget.
    pub fn reload(&self, config: &Config) -> Result<(), String> {
        self.shared.rate.set_rate(config.sync.rate_limit.as_u64());
        self.shared
            .max_outgoing
            .store(config.sync.max_outgoing_syncs, Ordering::Relaxed);
        self.syncs.set_max_incoming(config.sync.max_incoming_syncs);
        self.shared
            .cache
            .set_budget(config.cache.memory_budget.as_u64());
        let tokens = self.shared.tokens.reload()?;
        info!(
            rate_limit = config.sync.rate_limit.as_u64(),
            memory_budget = config.cache.memory_budget.as_u64(),
            max_incoming_syncs = config.sync.max_incoming_syncs,
            max_outgoing_syncs = config.sync.max_outgoing_syncs,
            tokens,
            "configuration reloaded"
        );
        Ok(())
    }

    /// Graceful shutdown, step one: refuse new syncs and offers (health
    /// NOT_SERVING), then wait up to `timeout` for running syncs and served
    /// sessions to finish. Returns whether everything finished; `stop`
    /// cancels what is left.
    pub async fn drain(&self, timeout: Duration) -> bool {
        self.shared.draining.cancel();
        self.health
            .set_not_serving::<pb::orchestrator_server::OrchestratorServer<OrchestratorService>>()
            .await;
        self.health
            .set_not_serving::<pb::peer_server::PeerServer<PeerService>>()
            .await;
        self.health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let busy = || self.syncs.running_count() + self.shared.sessions.serving();
        info!(
            running = busy(),
            ?timeout,
            "draining: no new syncs; waiting for running transfers"
        );
        let deadline = tokio::time::Instant::now() + timeout;
        while busy() > 0 {
            if tokio::time::Instant::now() >= deadline {
                warn!(
                    running = busy(),
                    "drain timeout: cancelling the remaining transfers"
                );
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    /// Cancelled syncs remove their temp files before they end; this is how
    /// long `stop` waits for that.
    const CANCEL_GRACE: Duration = Duration::from_secs(10);

    /// Stops every task and waits for them, and for cancelled syncs to clean up.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        self.syncs.cancel_all();
        self.shared.sessions.clear();
        while self.tasks.join_next().await.is_some() {}
        let deadline = tokio::time::Instant::now() + Self::CANCEL_GRACE;
        while self.syncs.running_count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Binds the RDMA listener on the chosen interface address (never a
/// wildcard) when RDMA is usable, and starts serving it.
async fn start_rdma_listener(
    config: &Config,
    rdma: &Probe,
    plane: &DataPlane,
    tasks: &mut JoinSet<()>,
) -> Result<Option<SocketAddr>, AgentError> {
    let Some(ip) = rdma.local_addr.filter(|_| rdma.rdma_available) else {
        return Ok(None);
    };
    let addr = SocketAddr::new(ip, config.data.rdma_port);
    let bind_err = |source| AgentError::Bind {
        what: "data.rdma_port",
        addr: addr.to_string(),
        source,
    };
    match config.transport.rdma_provider {
        RdmaProvider::Emulated => {
            warn!("transport uses the EMULATED rdma fabric: an emulation over TCP for tests and hosts without RDMA, not hardware");
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(bind_err)?;
            let local = listener.local_addr().map_err(bind_err)?;
            tasks.spawn(source_role::serve_emulated(
                listener,
                plane.clone(),
                plane.shutdown.clone(),
            ));
            Ok(Some(local))
        }
        #[cfg(feature = "rdma")]
        RdmaProvider::Verbs => {
            let listener = crate::transport::verbs::VerbsListener::bind(addr)
                .map_err(|e| bind_err(std::io::Error::other(e.to_string())))?;
            let local = listener.local_addr();
            let (plane, soft) = (plane.clone(), rdma.soft);
            std::thread::Builder::new()
                .name("kvsync-rdma-listen".into())
                .spawn(move || source_role::serve_verbs(listener, soft, plane))
                .map_err(bind_err)?;
            Ok(Some(local))
        }
        #[cfg(not(feature = "rdma"))]
        RdmaProvider::Verbs => Ok(None),
    }
}
