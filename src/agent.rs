//! The running agent: binds the listeners and starts the long-running tasks
//! (gRPC control plane with its TLS and request limits, the data plane
//! through [`crate::sync::plane`], the metrics endpoint, and each KV
//! instance through [`crate::instance::start`]) with one shutdown signal.
//!
//! Owns start-up order, the "ready" announcement, the drain before a
//! shutdown and what a reload changes (instances added, removed or
//! changed among them); each part builds itself from its own section of
//! the configuration, and each service gets only the handles it needs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::ServerTlsConfig;
use tracing::{info, warn};

use crate::config::Config;
use crate::control::orchestrator::OrchestratorService;
use crate::control::peer::PeerService;
use crate::fanout::FanoutManager;
use crate::instance::{self, start::Parts, Instance, Instances};
use crate::metrics::{self, Metrics};
use crate::rpc::auth::{ServerAuth, Tokens};
use crate::rpc::conn_limit;
use crate::rpc::{pb, tls, Dialer};
use crate::store::cache::SnapshotCache;
use crate::store::catalog::Catalog;
use crate::stream::pull::Reseed;
use crate::sync::offer::Offers;
use crate::sync::serve::{DataEndpoints, DataPlane, SessionTable};
use crate::sync::{plane, SyncManager};
use crate::sys::ratelimit::RateLimiter;
use crate::transport::faults;
use crate::transport::probe;

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
    /// `KVSYNC_FAULTS` is malformed.
    #[error("KVSYNC_FAULTS: {0}")]
    Faults(#[from] crate::transport::faults::FaultsError),
    /// `[auth] token_file` is unusable.
    #[error("auth.token_file: {0}")]
    Tokens(String),
    /// `[tls]` is unusable.
    #[error("tls: {0}")]
    Tls(#[from] tls::TlsError),
    /// The gRPC server refused the TLS settings.
    #[error("tls: {0}")]
    TlsServer(String),
    /// An instance cannot start.
    #[error(transparent)]
    Instance(#[from] instance::start::StartError),
    /// The gRPC reflection service could not be built.
    #[error("grpc reflection: {0}")]
    Reflection(String),
}

/// Largest gRPC request an agent decodes; every request is a few short
/// fields, so anything bigger is refused before it is parsed.
const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// Cancelled syncs remove their temp files before they end; this is how
/// long `stop` waits for that.
const CANCEL_GRACE: Duration = Duration::from_secs(10);

/// A started agent: its bound addresses and a handle to stop it.
pub struct RunningAgent {
    config: Config,
    instances: Arc<Instances>,
    /// What every instance's parts are made with.
    parts: Parts,
    cache: Arc<SnapshotCache>,
    sessions: Arc<SessionTable>,
    streams: Arc<crate::stream::serve::StreamOffers>,
    data: Arc<DataEndpoints>,
    tokens: Arc<Tokens>,
    peer_tokens: Option<Arc<Tokens>>,
    rate: Arc<RateLimiter>,
    pub syncs: Arc<SyncManager>,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// Cancelled when the agent starts draining: no new syncs or offers.
    draining: CancellationToken,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    health: tonic_health::server::HealthReporter,
}

/// What is read and checked before anything binds.
struct Prepared {
    /// Orchestrator tokens (and peer tokens unless those are separate).
    tokens: Arc<Tokens>,
    /// Peer tokens, when `[auth] peer_token_file` separates them.
    peer_tokens: Option<Arc<Tokens>>,
    server_tls: Option<ServerTlsConfig>,
    /// TLS of the TCP data listener, when the data plane is encrypted.
    data_tls: Option<Arc<rustls::ServerConfig>>,
    dialer: Dialer,
}

impl RunningAgent {
    /// Binds every listener and starts every task, in order: checks
    /// ([`prepare`]), listeners, shared state, the data plane, sync jobs,
    /// metrics, the watcher, the gRPC services. Most of its length is the
    /// wiring of which service gets which handle.
    pub async fn start(config: Config) -> Result<RunningAgent, AgentError> {
        let prepared = prepare(&config)?;
        for w in config.warnings() {
            warn!("{w}");
        }
        crate::sys::raise_open_files();
        let (grpc_listener, grpc_addr) = bind("grpc.listen", &config.grpc.listen).await?;
        let (data_listener, data_addr) = bind("data.tcp_listen", &config.data.tcp_listen).await?;
        let metrics = Metrics::new();
        let grpc_connections = grpc_connections(&config, &metrics);
        let shutdown = CancellationToken::new();
        let cache = SnapshotCache::new(
            config.cache.memory_budget.as_u64(),
            config.cache.acquire_timeout,
            metrics.clone(),
        );
        cache.set_linger(config.cache.linger);
        let mut tasks = JoinSet::new();
        tasks.spawn(cache.clone().expire(shutdown.clone()));
        let sessions = Arc::new(SessionTable::new((&config.sync).into()));
        let draining = CancellationToken::new();
        let probe = probe::probe_agent(&config);
        let plane = DataPlane::new(
            &config,
            sessions.clone(),
            metrics.clone(),
            shutdown.clone(),
            prepared.data_tls.clone(),
            probe.soft,
        );
        let data = plane::start(
            &config,
            probe,
            &plane,
            (data_listener, data_addr),
            &mut tasks,
        )
        .await;
        let syncs = SyncManager::new(
            config.clone(),
            metrics.clone(),
            data.local_rdma.clone(),
            prepared.dialer.clone(),
            shutdown.clone(),
            draining.clone(),
        );
        let instances = Arc::new(Instances::default());
        let parts = Parts {
            metrics: metrics.clone(),
            rate: plane.rate.clone(),
            shutdown: shutdown.clone(),
            dialer: prepared.dialer.clone(),
            reseed: reseeder(&syncs, &instances),
            instances: instances.clone(),
            local_rdma: data.local_rdma.clone(),
        };
        for ic in config.instances() {
            instances.insert(instance::start::start(&config, &ic, &parts).await?);
        }
        cache.set_instances(instances.len());
        let fanouts = FanoutManager::new(
            instances.clone(),
            metrics.clone(),
            prepared.dialer.clone(),
            config.fanout.allowed_replicas.clone(),
            shutdown.clone(),
        );
        let metrics_addr = start_metrics(
            &config,
            (&metrics, &instances),
            &draining,
            &shutdown,
            &mut tasks,
        )
        .await?;
        let services = Services {
            orchestrator: OrchestratorService {
                node_id: config.node_id.clone(),
                fallback_to_tcp: config.transport.fallback_to_tcp,
                instances: instances.clone(),
                syncs: syncs.clone(),
                sessions: sessions.clone(),
                data: data.clone(),
                metrics: metrics.clone(),
                fanouts,
                dialer: prepared.dialer,
            },
            peer: PeerService {
                offers: Offers {
                    instances: instances.clone(),
                    cache: cache.clone(),
                    sessions: sessions.clone(),
                    data: data.clone(),
                    draining: draining.clone(),
                    streams: plane.streams.clone(),
                },
            },
            auth: ServerAuth::pair(
                &prepared.tokens,
                prepared.peer_tokens.as_ref(),
                &metrics,
                &grpc_connections,
            ),
        };
        let health = start_grpc(
            services,
            prepared.server_tls,
            (grpc_listener, &config.grpc, grpc_connections),
            metrics.clone(),
            &shutdown,
            &mut tasks,
        )
        .await?;
        info!(
            node_id = %config.node_id,
            instances = %config.instances().iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(","),
            grpc = %grpc_addr,
            tls = config.tls.enabled(),
            client_auth = config.tls.client_auth,
            data = %data.tcp,
            data_tls = %data.tls,
            metrics = ?metrics_addr,
            "agent started"
        );
        Ok(RunningAgent {
            config,
            instances,
            parts,
            cache,
            sessions,
            streams: plane.streams.clone(),
            data,
            tokens: prepared.tokens,
            peer_tokens: prepared.peer_tokens,
            rate: plane.rate,
            syncs,
            grpc_addr,
            metrics_addr,
            draining,
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
        let rdma = match self.data.rdma {
            Some(a) => format!("{}:{a}", self.data.local_rdma.probe().provider),
            None => "-".into(),
        };
        format!(
            "kvsync agent ready node={} grpc={} data={} metrics={metrics} rdma={rdma}",
            self.config.node_id, self.grpc_addr, self.data.tcp
        )
    }

    /// Where the TCP data listener is bound.
    pub fn data_addr(&self) -> SocketAddr {
        self.data.tcp
    }

    /// The snapshots instance `name` offers (`""`: the only instance's).
    pub fn catalog(&self, name: &str) -> Option<Arc<Catalog>> {
        self.instances.resolve(name).ok().map(|i| i.catalog.clone())
    }

    /// The configuration the agent runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Applies what a SIGHUP reloads from a re-read configuration: the
    /// token file, the bandwidth limit, the admission limits (incoming,
    /// outgoing, per replica), the cache budget and its linger time, and
    /// the instances: new ones start, removed ones stop (their running
    /// syncs are cancelled), and one whose own settings changed restarts
    /// with them; the others, and their running syncs, are not touched.
    pub async fn reload(&self, config: &Config) -> Result<(), String> {
        self.reload_instances(config).await?;
        self.rate.set_rate(config.sync.rate_limit.as_u64());
        self.sessions.set_limits((&config.sync).into());
        self.syncs.set_max_incoming(config.sync.max_incoming_syncs);
        self.cache.set_budget(config.cache.memory_budget.as_u64());
        self.cache.set_linger(config.cache.linger);
        let mut tokens = self.tokens.reload()?;
        if let Some(peer) = &self.peer_tokens {
            tokens += peer.reload()?;
        }
        info!(
            rate_limit = config.sync.rate_limit.as_u64(),
            memory_budget = config.cache.memory_budget.as_u64(),
            max_incoming_syncs = config.sync.max_incoming_syncs,
            max_outgoing_syncs = config.sync.max_outgoing_syncs,
            max_sessions_per_replica = config.sync.max_sessions_per_replica,
            tokens,
            "configuration reloaded"
        );
        Ok(())
    }

    /// Starts, stops and restarts instances so that they are `config`'s:
    /// new ones first (one that cannot start leaves every instance as it
    /// was), then removed ones, then changed ones, each stopped before its
    /// new settings start (two watchers or backlog guards never share a
    /// directory or a primary).
    async fn reload_instances(&self, config: &Config) -> Result<(), String> {
        let wanted = config.instances();
        let (mut added, mut changed) = (Vec::new(), Vec::new());
        for ic in &wanted {
            match self.instances.resolve(&ic.name) {
                Ok(current) if current.has_settings(ic) => {}
                Ok(current) => changed.push((current, ic)),
                Err(_) => added.push(ic),
            }
        }
        let mut started = Vec::new();
        for ic in added {
            match instance::start::start(config, ic, &self.parts).await {
                Ok(instance) => started.push(instance),
                Err(e) => {
                    for instance in started {
                        instance.end().await;
                        self.forget(&instance);
                    }
                    return Err(format!("instance {}: {e}", ic.name));
                }
            }
        }
        for instance in started {
            info!(instance = %instance.name, snapshot_dir = %instance.config.snapshot_dir.display(), "instance started");
            self.instances.insert(instance);
        }
        for old in self.instances.all() {
            if !wanted.iter().any(|ic| ic.name == old.name) {
                let cancelled = self.stop_instance(&old).await;
                self.forget(&old);
                info!(instance = %old.name, cancelled_syncs = cancelled, "instance removed (its running syncs were cancelled)");
            }
        }
        let mut failed = None;
        for (old, ic) in changed {
            let cancelled = self.stop_instance(&old).await;
            info!(instance = %old.name, cancelled_syncs = cancelled, "instance settings changed: restarting it (its running syncs were cancelled)");
            match instance::start::start(config, ic, &self.parts).await {
                Ok(instance) => {
                    self.instances.insert(instance);
                }
                Err(e) => {
                    self.forget(&old);
                    failed = Some(format!(
                        "instance {} is stopped until a reload can start it: {e}",
                        ic.name
                    ));
                }
            }
        }
        self.cache.set_instances(self.instances.len());
        failed.map_or(Ok(()), Err)
    }

    /// Takes `instance` out of service: removed from the table, its syncs
    /// cancelled, its tasks ended. Returns how many syncs were running.
    async fn stop_instance(&self, instance: &Instance) -> usize {
        self.instances.remove(&instance.name);
        let running = self.syncs.running_count_of(Some(&instance.name));
        instance.end().await;
        running
    }

    /// Drops the series of an instance that is gone.
    fn forget(&self, instance: &Instance) {
        let primary = &instance.config.redis.primary_addr;
        let primary = (!primary.is_empty()).then_some(primary.as_str());
        self.parts.metrics.remove_instance(&instance.name, primary);
    }

    /// Graceful shutdown, step one: refuse new syncs and offers (health
    /// NOT_SERVING), then wait up to `timeout` for running syncs and served
    /// sessions to finish. Returns whether everything finished; `stop`
    /// cancels what is left.
    pub async fn drain(&self, timeout: Duration) -> bool {
        self.draining.cancel();
        self.health
            .set_not_serving::<pb::orchestrator_server::OrchestratorServer<OrchestratorService>>()
            .await;
        self.health
            .set_not_serving::<pb::peer_server::PeerServer<PeerService>>()
            .await;
        self.health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let busy = || self.syncs.running_count() + self.sessions.serving();
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

    /// Stops every task and waits for them, and for cancelled syncs to clean up.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        self.syncs.cancel_all();
        self.sessions.clear();
        self.streams.clear();
        while self.tasks.join_next().await.is_some() {}
        for instance in self.instances.all() {
            instance.end().await;
        }
        let deadline = tokio::time::Instant::now() + CANCEL_GRACE;
        while self.syncs.running_count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Reads and checks what must be right before anything binds: fault
/// injection, the agent's state directory, tokens and TLS files.
fn prepare(config: &Config) -> Result<Prepared, AgentError> {
    let faults = faults::load()?;
    if faults.any() {
        warn!(?faults, "FAULT INJECTION ACTIVE (KVSYNC_FAULTS): this agent corrupts or stalls transfers on purpose");
    }
    if let Some(dir) = &config.state_dir {
        instance::start::ensure_dir("state_dir", dir, config.create_dirs)?;
    }
    let tokens = Tokens::load(config.auth.token_file.as_deref()).map_err(AgentError::Tokens)?;
    let peer_tokens = match &config.auth.peer_token_file {
        Some(file) => Some(Tokens::load(Some(file)).map_err(AgentError::Tokens)?),
        None => None,
    };
    let server_tls = tls::server(&config.tls)?;
    let dialer = Dialer {
        tls: tls::agent_client(&config.tls)?,
        tokens: peer_tokens.clone().unwrap_or_else(|| tokens.clone()),
        token_in_clear: config.auth.send_token_in_clear,
        listed: config
            .sync
            .allowed_sources
            .iter()
            .filter(|a| a.contains(':'))
            .cloned()
            .collect(),
        data_tls: if config.data_tls() {
            tls::data_client(&config.tls)?
        } else {
            None
        },
    };
    Ok(Prepared {
        tokens,
        peer_tokens,
        server_tls,
        data_tls: if config.data_tls() {
            tls::data_server(&config.tls)?
        } else {
            None
        },
        dialer,
    })
}

/// `[stream] reseed` of an instance (by name): syncs the snapshot an
/// upstream names from it, into that instance (its handoff re-seeds the
/// server).
fn reseeder(
    syncs: &Arc<SyncManager>,
    instances: &Arc<Instances>,
) -> Arc<dyn Fn(&str) -> Reseed + Send + Sync> {
    let (syncs, instances) = (syncs.clone(), instances.clone());
    Arc::new(move |name: &str| -> Reseed {
        let (syncs, instances, name) = (syncs.clone(), instances.clone(), name.to_string());
        Box::new(move |upstream: &str, id: crate::rpc::pb::SnapshotId| {
            let started = instances
                .resolve(&name)
                .map_err(|e| e.to_string())
                .and_then(|i| {
                    let want = id
                        .try_into()
                        .map_err(|e: crate::rpc::BadDigest| e.to_string())?;
                    let pull = crate::sync::Pull {
                        source: upstream.to_string(),
                        upstream: Vec::new(),
                        want: Some(want),
                        mode: None,
                        source_instance: i.config.stream.upstream_instance_of(&name),
                    };
                    syncs.start(&i, pull).map_err(|e| e.to_string())
                });
            match started {
                Ok((sync, _)) => {
                    info!(instance = %name, %upstream, %sync, "re-seeding from the upstream's snapshot")
                }
                Err(e) => {
                    warn!(instance = %name, %upstream, error = %e, "cannot start the re-seeding sync; sync a snapshot yourself")
                }
            }
        })
    })
}

/// The gRPC listener's connection counter, reporting connections not yet
/// proved in `kvsync_grpc_connections_unproved`.
fn grpc_connections(config: &Config, metrics: &Metrics) -> Arc<conn_limit::Counter> {
    let unproved = metrics.grpc_unproved.clone();
    conn_limit::Counter::reporting(
        conn_limit::Limits {
            total: config.grpc.max_connections,
            per_peer: config.grpc.max_connections_per_peer,
        },
        move |n| unproved.set(n as i64),
    )
}

/// Binds a TCP listener for the setting `what`.
async fn bind(what: &'static str, addr: &str) -> Result<(TcpListener, SocketAddr), AgentError> {
    let err = |source| AgentError::Bind {
        what,
        addr: addr.to_string(),
        source,
    };
    let listener = TcpListener::bind(addr).await.map_err(err)?;
    let local = listener.local_addr().map_err(err)?;
    Ok((listener, local))
}

/// Starts `/metrics`, `/healthz` and `/readyz` unless disabled.
async fn start_metrics(
    config: &Config,
    (metrics, instances): (&Arc<Metrics>, &Arc<Instances>),
    draining: &CancellationToken,
    shutdown: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<Option<SocketAddr>, AgentError> {
    let addr = &config.metrics.listen;
    if addr.is_empty() {
        return Ok(None);
    }
    let (listener, local) = metrics::bind(addr)
        .await
        .map_err(|source| AgentError::Bind {
            what: "metrics.listen",
            addr: addr.clone(),
            source,
        })?;
    let (m, draining, stop) = (metrics.clone(), draining.clone(), shutdown.clone());
    let ready = readiness(instances.clone());
    tasks.spawn(async move {
        let stopped = async move { stop.cancelled().await };
        if let Err(e) = metrics::serve(listener, m, (draining, ready), stopped).await {
            warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(Some(local))
}

/// `/readyz`: ready when every instance's health is ok (its stream
/// follows, its fed server is on its feed), with each one's verdict.
fn readiness(instances: Arc<Instances>) -> metrics::Ready {
    Arc::new(move || {
        let all: Vec<_> = instances
            .all()
            .iter()
            .map(|i| (i.name.clone(), i.health()))
            .collect();
        let ready = all
            .iter()
            .all(|(_, h)| h.verdict == crate::stream::keep::Verdict::Ok);
        let body = serde_json::json!({
            "ready": ready,
            "instances": all.iter().map(|(name, h)| serde_json::json!({
                "instance": name,
                "health": h.verdict.as_str(),
                "reason": h.reason,
            })).collect::<Vec<_>>(),
        });
        (ready, body)
    })
}

/// The gRPC services an agent hosts, and who may call them.
struct Services {
    orchestrator: OrchestratorService,
    peer: PeerService,
    /// (orchestrator, peer) authentication.
    auth: (ServerAuth, ServerAuth),
}

/// Starts the gRPC server (health, reflection, and the two services behind
/// bearer-token auth and the request size limit).
async fn start_grpc(
    services: Services,
    server_tls: Option<ServerTlsConfig>,
    (listener, limits, counter): (
        TcpListener,
        &crate::config::GrpcConfig,
        Arc<conn_limit::Counter>,
    ),
    metrics: Arc<Metrics>,
    shutdown: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<tonic_health::server::HealthReporter, AgentError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::orchestrator_server::OrchestratorServer<OrchestratorService>>()
        .await;
    health
        .set_serving::<pb::peer_server::PeerServer<PeerService>>()
        .await;
    // Reflection in both versions clients speak: v1 (grpcurl) and
    // v1alpha (grpcio-reflection, older tools).
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| AgentError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| AgentError::Reflection(e.to_string()))?;
    // Slow or idle clients cannot starve others: bounded streams per
    // connection, HTTP/2 keepalive to find dead ones, and (below) bounded
    // connections in total and per address.
    let mut server = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_streams_per_connection)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)));
    if let Some(tls) = server_tls {
        server = server
            .tls_config(tls)
            .map_err(|e| AgentError::TlsServer(e.to_string()))?;
    }
    let Services {
        orchestrator,
        peer,
        auth: (orchestrator_auth, peer_auth),
    } = services;
    let router = server
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(InterceptedService::new(
            pb::orchestrator_server::OrchestratorServer::new(orchestrator)
                .max_decoding_message_size(MAX_REQUEST_BYTES),
            orchestrator_auth,
        ))
        .add_service(InterceptedService::new(
            pb::peer_server::PeerServer::new(peer).max_decoding_message_size(MAX_REQUEST_BYTES),
            peer_auth,
        ));
    let stop = shutdown.clone();
    let incoming = counted(listener, counter, limits.handshake_timeout, metrics);
    tasks.spawn(async move {
        if let Err(e) = router
            .serve_with_incoming_shutdown(incoming, stop.cancelled())
            .await
        {
            warn!(error = %e, "grpc server stopped");
        }
    });
    Ok(health)
}

/// The gRPC listener's connections, counted: one over a limit is closed
/// at once (dropped), unless an unproved one can make room, and every one
/// must prove itself within `handshake`; refusals are counted by reason.
fn counted(
    listener: TcpListener,
    counter: Arc<conn_limit::Counter>,
    handshake: Duration,
    metrics: Arc<Metrics>,
) -> impl futures::Stream<Item = std::io::Result<conn_limit::Counted<tokio::net::TcpStream>>> {
    let closed: Arc<dyn Fn(conn_limit::Closed) + Send + Sync> = {
        let metrics = metrics.clone();
        Arc::new(move |why| {
            let reason = match why {
                conn_limit::Closed::Evicted => "evicted",
                conn_limit::Closed::Deadline => "handshake_timeout",
            };
            metrics.grpc_refused.with_label_values(&[reason]).inc();
        })
    };
    futures::StreamExt::filter_map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        move |accepted| {
            let admitted = accepted.and_then(|s| {
                let addr = s.peer_addr()?;
                Ok(counter.admit_evicting(addr).map(|slot| {
                    conn_limit::Counted::new(s, slot).proving_within(handshake, closed.clone())
                }))
            });
            std::future::ready(match admitted {
                Ok(Ok(conn)) => Some(Ok(conn)),
                Ok(Err(over)) => {
                    let reason = match over {
                        conn_limit::Over::Total => "total",
                        conn_limit::Over::PerPeer => "per_peer",
                    };
                    metrics.grpc_refused.with_label_values(&[reason]).inc();
                    None
                }
                Err(e) => Some(Err(e)),
            })
        },
    )
}
