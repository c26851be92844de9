//! Starting one KV instance: its snapshot directory, catalog and watcher,
//! its primary's backlog guard, its stream (with the feed its server reads
//! and the Sentinel majority it may follow) and its KV's tasks, all on the
//! instance's own stop signal.

use std::path::PathBuf;
use std::sync::Arc;

use tracing::info;

use super::{failover, Instance, Instances};
use crate::config::{Config, HandoffMode, InstanceConfig};
use crate::kv::backlog::BacklogGuard;
use crate::metrics::Metrics;
use crate::rpc::dial::Dialer;
use crate::store::catalog::Catalog;
use crate::store::watch::DirWatcher;
use crate::stream::pull::Reseed;
use crate::stream::start::StreamDeps;
use crate::stream::{named, sentinel, shard, SharedLog};
use crate::sys::ratelimit::RateLimiter;
use crate::transport::probe::LocalRdma;

/// Why an instance could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A directory it needs is missing and `create_dirs` is off.
    #[error("{key} {} does not exist: a mistyped path? Create it (deploy/install.sh creates the default ones), or set create_dirs = true to have the agent create it", .path.display())]
    MissingDir { key: &'static str, path: PathBuf },
    /// A directory it needs cannot be created.
    #[error("cannot create {key} {}: {source}", .path.display())]
    Dir {
        key: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The snapshot directory a stream that follows a primary writes its
    /// RDBs to is not writable.
    #[error("{0}: a stream that follows a primary saves the primary's RDB there (give the agent's user write access, or set snapshot_dir to a directory it owns)")]
    NotWritable(crate::store::install::InstallError),
    /// Its stream feed cannot start.
    #[error(transparent)]
    StreamFeed(#[from] crate::stream::feed::FeedError),
    /// Its stream log cannot be opened.
    #[error("{0}")]
    StreamLog(#[from] crate::stream::log::LogError),
}

/// What every instance of an agent shares.
pub struct Parts {
    pub metrics: Arc<Metrics>,
    /// The agent's bandwidth limit (the backlog guard's reads count).
    pub rate: Arc<RateLimiter>,
    /// The agent's shutdown: each instance stops on a child of it.
    pub shutdown: tokio_util::sync::CancellationToken,
    /// How an instance's stream and failovers reach peer agents.
    pub dialer: Dialer,
    /// `[stream] reseed`: the sync an instance (by name) starts of a
    /// snapshot an upstream names.
    pub reseed: Arc<dyn Fn(&str) -> Reseed + Send + Sync>,
    /// The agent's instances, as a Sentinel's failover looks its own up.
    pub instances: Arc<Instances>,
    /// This agent's RDMA, for streams followed through a ring.
    pub local_rdma: Arc<LocalRdma>,
}

/// Checks that directory `path` (setting `key`) exists, creating it when
/// `create` (`create_dirs`) says so.
pub fn ensure_dir(
    key: &'static str,
    path: &std::path::Path,
    create: bool,
) -> Result<(), StartError> {
    if path.is_dir() {
        return Ok(());
    }
    if !create {
        return Err(StartError::MissingDir {
            key,
            path: path.to_path_buf(),
        });
    }
    std::fs::create_dir_all(path).map_err(|source| StartError::Dir {
        key,
        path: path.to_path_buf(),
        source,
    })?;
    info!(key, path = %path.display(), "created the missing directory (create_dirs)");
    Ok(())
}

/// Makes instance `ic`'s parts and starts its tasks: its snapshot
/// directory (refused when missing unless `create_dirs`, and swept of temp
/// files that cannot be resumed), its
/// catalog and watcher, its primary's backlog guard, its stream (with
/// `[stream] dir`) and its KV's seeding recovery, health poll and
/// consistency check.
pub async fn start(
    agent: &Config,
    ic: &InstanceConfig,
    parts: &Parts,
) -> Result<Arc<Instance>, StartError> {
    let config = agent.for_instance(ic);
    let (name, dir, redis) = (ic.name.as_str(), &config.snapshot_dir, &config.redis);
    let stream_dir = config.stream.enabled().then_some(&config.stream.dir);
    for (key, path) in [("snapshot_dir", Some(dir)), ("[stream] dir", stream_dir)] {
        if let Some(path) = path {
            ensure_dir(key, path, agent.create_dirs)?;
        }
    }
    // A stream that follows a primary saves its full resyncs' RDBs there:
    // refused now, not with a fork of the primary per failed write.
    if config.stream.enabled() && !redis.primary_addr.is_empty() {
        crate::store::install::check_writable(dir).map_err(StartError::NotWritable)?;
    }
    let swept = crate::store::journal::sweep(dir, config.data.resume_ttl, true);
    if swept > 0 {
        info!(
            instance = name,
            count = swept,
            "removed temp files of an earlier run that cannot be resumed"
        );
    }
    let metrics = &parts.metrics;
    metrics.add_instance(name);
    let catalog = Catalog::new(metrics.clone(), name);
    let backlog = match redis.primary_addr.is_empty() {
        true => None,
        false => Some(
            BacklogGuard::start(
                (name, redis.clone()),
                dir,
                metrics.clone(),
                parts.rate.clone(),
            )
            .await,
        ),
    };
    let stop = parts.shutdown.child_token();
    let mut instance = Instance::new(config.clone(), catalog.clone(), backlog, stop.clone());
    if config.stream.enabled() {
        start_stream(&mut instance, parts).await?;
    }
    instance.spawn(crate::kv::rights::warn_missing(name.to_string(), config));
    start_tasks(&instance, metrics);
    Ok(Arc::new(instance))
}

/// Starts `instance`'s stream: its log and the writer that follows its
/// source, the Sentinel majority or cluster it may follow, and the feed
/// its server reads when the handoff is `redis-stream` (or a cluster node
/// its gap, `redis`).
async fn start_stream(instance: &mut Instance, parts: &Parts) -> Result<(), StartError> {
    let (config, catalog, stop) = (
        instance.config.clone(),
        instance.catalog.clone(),
        instance.stop.clone(),
    );
    let (name, redis) = (instance.name.clone(), &config.redis);
    let name = name.as_str();
    let deps = StreamDeps {
        metrics: parts.metrics.clone(),
        dialer: parts.dialer.clone(),
        local_rdma: parts.local_rdma.clone(),
        reseed: config.stream.reseed.then(|| (parts.reseed)(name)),
    };
    let started = crate::stream::start::start(name, &config, &catalog, deps).await?;
    let stream = started.log;
    instance.upstreams = Some(started.upstreams.clone());
    instance.spawn(crate::stream::source::run(
        started.writers,
        started.upstreams,
        stream.clone(),
        stop.clone(),
    ));
    if !config.stream.sentinels.is_empty() {
        follow_sentinels(name, &config, instance, parts, &stream);
    } else if let Some(local) = redis.local_server(config.handoff.mode) {
        follow_cluster(local, &config, instance, parts, &stream);
    }
    let mode = config.handoff.mode;
    if mode.runs_feed(true) {
        let (listener, feed) =
            crate::stream::feed::bind(&redis.seed_listen, &config.stream.dir).await?;
        instance.spawn(crate::stream::feed::run(
            listener,
            feed.clone(),
            (redis.server_addr.clone(), redis.tls_file_set()),
            stream.clone(),
            stop.clone(),
        ));
        instance.feed = Some(feed);
    }
    if let (HandoffMode::Redis, Some(feed)) = (mode, &instance.feed) {
        instance.spawn(crate::kv::cluster::left_mid_gap(
            redis.clone(),
            feed.target(),
            stop.clone(),
        ));
    }
    if let (HandoffMode::RedisStream, Some(feed)) = (mode, instance.feed.clone()) {
        instance.spawn(crate::kv::seed::repoint(
            redis.clone(),
            feed.addr,
            feed.secret.clone(),
            stop.clone(),
        ));
        instance.spawn(crate::stream::keep::run(
            name.to_string(),
            redis.clone(),
            (feed.clone(), stream.clone(), config.stream.dir.clone()),
            config.handoff.timeout,
            (config.stream.ready_behind.as_u64(), config.stream.ready_lag),
            parts.metrics.clone(),
            stop.clone(),
        ));
    }
    instance.stream = Some(stream);
    Ok(())
}

/// Starts `instance`'s snapshot and KV tasks: the sweep of old temp
/// files, the seeding recovery (`redis-replicate`), the local server's
/// health poll, the consistency check and the snapshot directory's
/// watcher.
fn start_tasks(instance: &Instance, metrics: &Arc<Metrics>) {
    let (config, stop) = (&instance.config, instance.stop.clone());
    let (name, dir, redis) = (instance.name.as_str(), &config.snapshot_dir, &config.redis);
    instance.spawn(crate::store::journal::sweep_every(
        dir.clone(),
        config.data.resume_ttl,
        stop.clone(),
    ));
    instance.spawn(super::export_health(
        name.to_string(),
        instance.stream.clone(),
        metrics.clone(),
        stop.clone(),
    ));
    let mode = config.handoff.mode;
    if mode == HandoffMode::RedisReplicate {
        instance.spawn(crate::kv::seed::recover(
            redis.clone(),
            dir.clone(),
            stop.clone(),
        ));
    }
    if let Some(addr) = redis.local_server(mode) {
        if !redis.health_interval.is_zero() {
            instance.spawn(crate::kv::health::watch(
                (
                    name.to_string(),
                    addr.to_string(),
                    redis.primary_addr.is_empty(),
                ),
                redis.auth(),
                redis.health_interval,
                metrics.clone(),
                stop.clone(),
            ));
        }
    }
    if mode.is_redis() && !redis.consistency_interval.is_zero() && !redis.primary.is_empty() {
        instance.spawn(crate::kv::check::every(
            name.to_string(),
            (redis.primary.clone(), redis.server_addr.clone()),
            redis.auth(),
            (redis.consistency_interval, redis.consistency_sample),
            metrics.clone(),
            stop.clone(),
        ));
    }
    instance.spawn(
        DirWatcher::new(
            dir.clone(),
            (config.snapshot_format, config.data.piece_size.as_u64()),
            instance.catalog.clone(),
            metrics.clone(),
            config.watch.clone(),
        )
        .run(stop),
    );
}

/// Follows the primary a majority of instance `name`'s Sentinels name:
/// the watch of their word (its verdict in status and the dissent
/// counter), and its take as `kvsync stream follow` would.
fn follow_sentinels(
    name: &str,
    config: &Config,
    instance: &Instance,
    parts: &Parts,
    stream: &SharedLog,
) {
    let sentinels = sentinel::Sentinels {
        addrs: config.stream.sentinels.clone(),
        master_name: config.stream.master_name.clone(),
        auth: config.sentinel_auth(),
    };
    let (primary, named) = tokio::sync::watch::channel(None);
    let (reported, dissent) = (
        stream.clone(),
        parts
            .metrics
            .stream_sentinel_dissent
            .with_label_values(&[name]),
    );
    let report = move |v: &sentinel::Verdict| {
        if !v.dissent.is_empty() {
            dissent.inc();
        }
        reported.set_sentinels(v.to_string());
    };
    instance.spawn(sentinel::watch(
        sentinels,
        primary,
        report,
        instance.stop.clone(),
    ));
    take_named("the Sentinels'", instance, parts, named);
}

/// Follows the shard primary the local cluster node at `local` names
/// (a server not in cluster mode names none): the table's word in
/// status, and its take as `kvsync stream follow` would.
fn follow_cluster(
    local: &str,
    config: &Config,
    instance: &Instance,
    parts: &Parts,
    stream: &SharedLog,
) {
    let (primary, named) = tokio::sync::watch::channel(None);
    let reported = stream.clone();
    instance.spawn(shard::watch(
        local.to_string(),
        config.redis.auth(),
        primary,
        move |said| reported.set_cluster(said),
        instance.stop.clone(),
    ));
    take_named("the cluster's", instance, parts, named);
}

/// Takes every primary `named` names for `instance` as `kvsync stream
/// follow --primary` does ([`failover::follow_primary`], with the
/// configured peers), until it is taken ([`named::apply`]).
fn take_named(
    voice: &'static str,
    instance: &Instance,
    parts: &Parts,
    named: tokio::sync::watch::Receiver<Option<named::Known>>,
) {
    let (instances, name) = (parts.instances.clone(), instance.name.clone());
    let ask = failover::peer_asker(parts.dialer.clone(), instance, None);
    let follow = move |addr: String| {
        let (instances, name, ask) = (instances.clone(), name.clone(), ask.clone());
        async move {
            let i = instances.resolve(&name).map_err(|e| e.to_string())?;
            let followed = failover::follow_primary(&i, &addr, &[], ask)
                .await
                .map_err(|e| e.to_string())?;
            let said = match followed.local_server {
                Some(local) => format!("{}; {local}", followed.source),
                None => followed.source.to_string(),
            };
            Ok::<_, String>(match followed.re_attach_pending {
                true => named::Taken::Pending(said),
                false => named::Taken::Done(said),
            })
        }
    };
    instance.spawn(named::apply(voice, named, follow, instance.stop.clone()));
}
