//! Starting a source's data plane: the TCP serve loop on the bound
//! listener, the RDMA listener on the chosen interface when the probe says
//! RDMA is usable (falling back to TCP, said in the probe, when it cannot
//! bind), the offers' expiry, and what the data plane then offers
//! ([`DataEndpoints`]); the [`DataPlane`] a configuration sets up.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tracing::{info, warn};

use tokio_util::sync::CancellationToken;

use super::serve::{self, DataEndpoints, DataPlane, SessionTable};
use crate::config::{Config, RdmaProvider};
use crate::metrics::Metrics;
use crate::rpc::conn_limit;
use crate::sys::ratelimit::RateLimiter;
use crate::transport::ktls;
use crate::transport::probe::{LocalRdma, Probe};

/// Starts the serve loops (TCP always, RDMA when the probe says it is
/// usable) and the offer expiry, and records what the data plane offers.
pub async fn start(
    config: &Config,
    mut probe: Probe,
    plane: &DataPlane,
    (tcp, tcp_addr): (TcpListener, SocketAddr),
    tasks: &mut JoinSet<()>,
) -> Arc<DataEndpoints> {
    let bound = bind_rdma_listener(config, &probe)
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "rdma listener could not start; this agent uses tcp");
            probe.fall_back_to_tcp(format!("no RDMA: {e}"));
            None
        });
    let local_rdma = Arc::new(LocalRdma::new(probe));
    let rdma = match bound {
        Some((listener, addr)) => match serve_rdma(listener, &local_rdma, plane, tasks) {
            Ok(()) => Some(addr),
            Err(e) => {
                local_rdma.set_lost(Some(format!("no RDMA: {e}")));
                None
            }
        },
        None => None,
    };
    let probe = local_rdma.probe();
    info!(choice = %probe.choice, provider = %probe.provider, device = ?probe.device, interface = ?probe.interface, endpoint = ?rdma, "transport selection: {}", local_rdma.reason());
    plane
        .metrics
        .rdma_available
        .set(local_rdma.available() as i64);
    for d in &probe.devices {
        let soft = if d.soft { "true" } else { "false" };
        plane
            .metrics
            .rdma_device_info
            .with_label_values(&[d.name.as_str(), soft])
            .set(1);
    }
    tasks.spawn(plane.sessions.clone().expire(plane.shutdown.clone()));
    tasks.spawn(serve::serve(
        serve::tcp_connections(tcp, false),
        plane.clone(),
    ));
    Arc::new(DataEndpoints {
        tcp: tcp_addr,
        rdma,
        local_rdma,
        tls: if config.data_tls() {
            ktls::describe(config.data.kernel_tls)
        } else {
            "off".into()
        },
    })
}

impl DataPlane {
    /// The data plane `config` sets up around the agent's `sessions`,
    /// `metrics` and `shutdown`: its limits, the TCP listener's `tls`, and
    /// RDMA bulk parameters for the probed device (`soft`).
    pub fn new(
        config: &Config,
        sessions: Arc<SessionTable>,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
        tls: Option<Arc<rustls::ServerConfig>>,
        soft: bool,
    ) -> DataPlane {
        DataPlane {
            sessions,
            metrics,
            bulk: Probe::bulk_params(&config.transport, soft),
            shutdown,
            rate: Arc::new(RateLimiter::new(config.sync.rate_limit.as_u64())),
            peer_timeout: config.data.peer_timeout,
            min_rate: (&config.data).into(),
            hello_timeout: config.data.hello_timeout,
            tls,
            kernel_tls: config.data.kernel_tls,
            streams: Arc::default(),
            pending: conn_limit::Limits {
                total: config.data.max_pending_connections,
                per_peer: config.data.max_pending_per_peer,
            },
        }
    }
}

/// A bound RDMA listener, not yet serving.
enum RdmaListener {
    Emulated(TcpListener),
    #[cfg(feature = "rdma")]
    Verbs(crate::transport::verbs::VerbsListener),
}

/// Binds the RDMA listener on the chosen interface address (never a
/// wildcard) when RDMA is usable.
async fn bind_rdma_listener(
    config: &Config,
    probe: &Probe,
) -> std::io::Result<Option<(RdmaListener, SocketAddr)>> {
    let Some(ip) = probe.local_addr.filter(|_| probe.rdma_available) else {
        return Ok(None);
    };
    let addr = SocketAddr::new(ip, config.data.rdma_port);
    let bind_err =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("data.rdma_port {addr}: {e}"));
    match config.transport.rdma_provider {
        RdmaProvider::Emulated => {
            warn!("transport uses the EMULATED rdma fabric: an emulation over TCP for tests and hosts without RDMA, not hardware");
            let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
            let local = listener.local_addr().map_err(bind_err)?;
            Ok(Some((RdmaListener::Emulated(listener), local)))
        }
        #[cfg(feature = "rdma")]
        RdmaProvider::Verbs => {
            let listener = crate::transport::verbs::VerbsListener::bind(addr)
                .map_err(|e| bind_err(std::io::Error::other(e)))?;
            let local = listener.local_addr();
            Ok(Some((RdmaListener::Verbs(listener), local)))
        }
        #[cfg(not(feature = "rdma"))]
        RdmaProvider::Verbs => Ok(None),
    }
}

/// Starts serving a bound RDMA listener.
fn serve_rdma(
    listener: RdmaListener,
    local_rdma: &Arc<LocalRdma>,
    plane: &DataPlane,
    tasks: &mut JoinSet<()>,
) -> std::io::Result<()> {
    match listener {
        RdmaListener::Emulated(l) => {
            let conns = serve::tcp_connections(l, true);
            tasks.spawn(serve::serve(conns, plane.clone()));
        }
        #[cfg(feature = "rdma")]
        RdmaListener::Verbs(l) => {
            let conns = serve::verbs_connections(
                l,
                local_rdma.clone(),
                plane.metrics.clone(),
                plane.shutdown.clone(),
            )?;
            tasks.spawn(serve::serve(conns, plane.clone()));
        }
    }
    Ok(())
}
