//! Starting one instance's stream from its configuration: opening its log,
//! reading whom it follows (`upstreams.json`, else the configuration), and
//! building the writer that follows that source into the log (the primary
//! through [`super::follow`], an upstream agent through [`super::pull`]).
//! The instance runs what this returns.

use std::sync::Arc;

use super::follow::Follow;
use super::log::{Log, LogError};
use super::pull::{Offered, Pull, Reseed, RingAsk};
use super::source::{Source, Upstreams, Writers};
use super::{SharedLog, Stream};
use crate::config::{Config, TransportMode};
use crate::metrics::Metrics;
use crate::rpc::dial::Dialer;
use crate::store::catalog::Catalog;
use crate::transport::probe::LocalRdma;

/// What a stream needs of its agent besides its configuration.
pub struct StreamDeps {
    pub metrics: Arc<Metrics>,
    /// How it reaches upstream agents.
    pub dialer: Dialer,
    /// This agent's RDMA, for a stream followed through a ring.
    pub local_rdma: Arc<LocalRdma>,
    /// `[stream] reseed`'s sync of a snapshot an upstream names.
    pub reseed: Option<Reseed>,
}

/// A stream ready to run: its log, whom it follows, and the writer to run
/// (with [`super::source::run`]).
pub struct Started {
    pub log: SharedLog,
    pub upstreams: Arc<Upstreams>,
    pub writers: Writers,
}

/// Opens instance `name`'s stream log (`config` is the instance's) and
/// makes the writer that follows its source: the upstream agent, or else
/// the primary, unless a fan-out or a failover set another.
pub async fn start(
    name: &str,
    config: &Config,
    catalog: &Arc<Catalog>,
    deps: StreamDeps,
) -> Result<Started, LogError> {
    let st = config.stream.clone();
    let log = tokio::task::spawn_blocking(move || Log::open(st))
        .await
        .expect("log open task")?;
    let offered: Offered = {
        let catalog = catalog.clone();
        Arc::new(move || {
            catalog
                .list()
                .iter()
                .filter_map(|e| Some((e.info.repl_id.clone()?, e.info.seq)))
                .collect()
        })
    };
    deps.metrics
        .stream_log_retain
        .with_label_values(&[name])
        .set(config.stream.retain.as_u64() as i64);
    let configured = match config.stream.upstream.as_str() {
        "" => Source::Primary(config.redis.primary_addr.clone()),
        upstream => Source::Agents(vec![upstream.to_string()]),
    };
    let upstreams = Upstreams::open(&config.stream.dir, configured);
    let log = Stream::new(log, upstreams.source(), &deps.metrics, name);
    let pull = Pull {
        instance: name.to_string(),
        upstreams: upstreams.clone(),
        upstream_instance: config.stream.upstream_instance_of(name),
        node_id: config.node_id.clone(),
        dialer: deps.dialer,
        tls_server_name: config.tls.server_name.clone(),
        reseed: deps.reseed,
        peer_timeout: config.data.peer_timeout,
        metrics: deps.metrics.clone(),
        offered: offered.clone(),
        ring: (config.stream.rdma_ring.as_u64() > 0 && config.transport.mode != TransportMode::Tcp)
            .then(|| RingAsk {
                rdma: deps.local_rdma,
                provider: config.transport.rdma_provider,
                size: config.stream.rdma_ring.as_u64(),
                retry: config.stream.rdma_retry,
                spin: config.stream.rdma_spin,
            }),
    };
    let follow = Follow {
        instance: name.to_string(),
        primary: String::new(),
        auth: config.redis.auth(),
        snapshot_dir: config.snapshot_dir.clone(),
        max_rdb: config.sync.max_snapshot_bytes.as_u64(),
        min_free_after: config.sync.min_free_after.as_u64(),
        offered,
        ack: config.stream.ack,
        metrics: deps.metrics,
    };
    let writers = Writers {
        follow,
        pull: Arc::new(pull),
        local_server: config
            .redis
            .local_server(config.handoff.mode)
            .unwrap_or_default()
            .to_string(),
    };
    Ok(Started {
        log,
        upstreams,
        writers,
    })
}
