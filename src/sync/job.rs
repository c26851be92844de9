//! The driver of one replica-side full sync: negotiate with the source over
//! gRPC (every offer through one gate) → fetch and check the piece manifest
//! → connect the data plane → run BLK3 into a [`Receiver`] → install →
//! hand off → report, with progress on a watch channel and metrics. What
//! to do at each turn (the transport, falling back to TCP, retrying,
//! another source) is `policy`'s; this module asks it and does the I/O. A
//! failure leaves the previous snapshot and the KV untouched and ends with
//! a typed [`JobError`] in the sync's status.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

use crate::blk3::Outcome;
use crate::config::{Config, HandoffMode, RdmaProvider, TransportMode};
use crate::kv::handoff::{self, HandoffRecord};
use crate::kv::payload::Arriving;
use crate::kv::restart;
use crate::kv::seed::Early;
use crate::metrics::{unix_now, Metrics, Running};
use crate::rpc::dial::{ConnectError, CONNECT_TIMEOUT};
use crate::rpc::{pb, AgentChannel, Dialer};
use crate::snapshot::manifest::{Manifest, MAX_REPL_ID};
use crate::snapshot::{SnapshotId, SnapshotInfo};
use crate::store::catalog::CatalogEntry;
use crate::store::install::{self, InstallError};
use crate::transport::probe::LocalRdma;
use crate::transport::session::{ClientTls, DataLink, DialSpec};
use crate::transport::{ktls, select, TransportKind};

pub use super::error::JobError;
use super::policy::{self, Asked, Attempts, Next, Offer, TransportPlan};
use super::receive::{Received, Receiver};
use crate::store::relay::RelayTable;

/// A Peer client presenting this agent's token.
type PeerClient = pb::peer_client::PeerClient<AgentChannel>;

/// Everything one job needs.
pub struct JobContext {
    pub id: String,
    /// The source of the current attempt.
    pub source: String,
    /// Where to turn when `source` fails, nearest first (a fan-out's
    /// relays up to the origin).
    pub upstream: Vec<String>,
    /// Exactly this snapshot (`None`: the source's latest).
    pub want: Option<SnapshotId>,
    /// The transport mode asked for (`None`: the configured one).
    pub mode: Option<TransportMode>,
    /// The instance it installs into (the `kv_instance` of its metrics).
    pub instance: String,
    /// The source's instance it asks for (empty: the source's only one).
    pub source_instance: String,
    /// Its instance's configuration.
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// This agent's RDMA: the probe (provider, local address, soft
    /// device) and whether its device is still there.
    pub rdma: Arc<LocalRdma>,
    /// How to reach the source's Peer service (TLS, bearer token).
    pub dialer: Dialer,
    pub progress: watch::Sender<pb::SyncProgress>,
    pub cancel: CancellationToken,
    /// Where the snapshot is offered to further replicas as it arrives.
    pub relays: Arc<RelayTable>,
    /// The instance's stream feed (`redis-stream`).
    pub feed: Option<crate::stream::feed::FeedHandle>,
    /// The log that feed serves.
    pub stream: Option<crate::stream::SharedLog>,
}

impl JobContext {
    fn phase(&self, phase: pb::Phase) {
        self.progress.send_modify(|p| p.phase = phase as i32);
    }

    /// Awaits `fut` unless the job is cancelled first.
    async fn or_cancel<T>(&self, fut: impl std::future::Future<Output = T>) -> Result<T, JobError> {
        tokio::select! {
            r = fut => Ok(r),
            _ = self.cancel.cancelled() => Err(JobError::Cancelled),
        }
    }
}

/// Runs the job to its end and returns the final progress record.
pub async fn run(mut ctx: JobContext) -> pb::SyncProgress {
    let span = info_span!("sync", id = %ctx.id, instance = %ctx.instance, source = %ctx.source);
    async {
        let m = ctx.metrics.clone();
        let instance = ctx.instance.clone();
        let _running = Running::start(
            m.fullsync_in_progress
                .with_label_values(&[&instance, "replica"]),
        );
        let started = Instant::now();
        let result = with_retries(&mut ctx).await;
        let transport = match ctx.progress.borrow().transport {
            t if t == pb::Transport::Rdma as i32 => TransportKind::Rdma,
            _ => TransportKind::Tcp,
        }
        .as_str();
        let elapsed = started.elapsed();
        let label = match &result {
            Ok(()) => "ok",
            Err(e) => e.result_label(),
        };
        ctx.progress.send_modify(|p| {
            p.duration_ms = elapsed.as_millis() as u64;
            p.result = label.to_string();
            match &result {
                Ok(()) => p.phase = pb::Phase::Succeeded as i32,
                Err(e) => {
                    p.error = e.to_string();
                    p.phase = if label == "cancelled" {
                        pb::Phase::Cancelled
                    } else {
                        pb::Phase::Failed
                    } as i32;
                }
            }
        });
        match &result {
            Ok(()) => {
                info!(elapsed = ?elapsed, "full sync succeeded");
                m.last_success
                    .with_label_values(&[&instance, "replica"])
                    .set(unix_now());
            }
            Err(e) => warn!(error = %e, "full sync failed"),
        }
        m.fullsync_total
            .with_label_values(&[&instance, "replica", transport, label])
            .inc();
        m.fullsync_duration
            .with_label_values(&[&instance, "replica", transport])
            .observe(elapsed.as_secs_f64());
        let last = ctx.progress.borrow().clone();
        last
    }
    .instrument(span)
    .await
}

/// Runs attempts until one succeeds, a failure is permanent, or the
/// configured retries are used up; waits with exponential backoff and
/// jitter in between. A failure the source is to blame for moves the next
/// attempt to the next upstream source at once, when there is one (a
/// fan-out's failed relay), resuming what was verified. Status shows the
/// attempts, the sources given up and the last error.
async fn with_retries(ctx: &mut JobContext) -> Result<(), JobError> {
    use rand::Rng;
    let mut attempts = Attempts::default();
    loop {
        attempts.made += 1;
        ctx.progress.send_modify(|p| p.attempts = attempts.made);
        let err = match attempt(ctx).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if matches!(err, JobError::Checksum(_)) {
            attempts.checksum_failures += 1;
        }
        let jitter = rand::rng().random_range(0.75..1.25);
        let backoff = match policy::after_failure(
            &err,
            attempts,
            !ctx.upstream.is_empty(),
            &ctx.config.sync,
            jitter,
        ) {
            Next::GiveUp => return Err(err),
            Next::Retry(backoff) => backoff,
            Next::NextSource => {
                let next = ctx.upstream.remove(0);
                let left = std::mem::replace(&mut ctx.source, next.clone());
                warn!(error = %err, from = %left, to = %next, "source failed; pulling from its upstream instead");
                ctx.progress.send_modify(|p| {
                    p.last_error = err.to_string();
                    p.abandoned_sources.push(left);
                    p.source = next;
                    p.phase = pb::Phase::Negotiating as i32;
                    p.bytes_done = 0;
                });
                continue;
            }
        };
        warn!(attempt = attempts.made, error = %err, ?backoff, "sync attempt failed; retrying");
        ctx.progress.send_modify(|p| {
            p.last_error = err.to_string();
            p.phase = pb::Phase::Negotiating as i32;
            p.bytes_done = 0;
        });
        ctx.or_cancel(tokio::time::sleep(backoff)).await?;
    }
}

/// One attempt: negotiate, move the bytes, verify, install, hand off.
async fn attempt(ctx: &JobContext) -> Result<(), JobError> {
    install::check_writable(&ctx.config.snapshot_dir).map_err(JobError::NotWritable)?;
    let plan = transport_plan(ctx)?;
    let channel = ctx
        .or_cancel(ctx.dialer.connect(&ctx.source, CONNECT_TIMEOUT))
        .await?
        .map_err(|e| match e {
            ConnectError::Failed(message) => JobError::Unreachable {
                source_addr: ctx.source.clone(),
                message,
            },
            refused => JobError::WillNotDial(refused),
        })?;
    let mut peer = pb::peer_client::PeerClient::new(channel);
    let mut early = None;
    let (offer, received) = receive(ctx, &mut peer, &plan, &mut early).await?;
    let done = async {
        let installed = install(ctx, &offer, received).await?;
        hand_off(ctx, &offer, installed, early.take()).await
    }
    .await;
    if let (Err(e), Some(early)) = (&done, early) {
        early.abandon(e.to_string()).await;
    }
    // A Redis primary's source holds its backlog until it hears.
    let outcome = done.as_ref().copied().map_err(ToString::to_string);
    let outcome = outcome.as_ref().copied().map_err(String::as_str);
    report(&mut peer, &(&offer).into(), outcome).await;
    done.map(drop)
}

/// The attempt's transport plan (see [`TransportPlan::new`]).
fn transport_plan(ctx: &JobContext) -> Result<TransportPlan, JobError> {
    let t = &ctx.config.transport;
    let plan = TransportPlan::new(ctx.mode, t.mode, t.fallback_to_tcp, ctx.rdma.available())
        .map_err(|policy::NoRdma| JobError::RdmaUnavailable(ctx.rdma.reason()))?;
    if plan.fell_back {
        fell_back(ctx, "unavailable", &ctx.rdma.reason());
    }
    Ok(plan)
}

/// Negotiates and runs the data session: over RDMA when offered, retried
/// over TCP (with a fresh offer) when that fails and the plan allows it.
/// Returns the offer the bytes came under and the verified snapshot; a
/// seeding that began while it arrived is in `early`.
async fn receive(
    ctx: &JobContext,
    peer: &mut PeerClient,
    plan: &TransportPlan,
    early: &mut Option<Early>,
) -> Result<(Offer, Received), JobError> {
    let offer = usable_offer(ctx, peer, plan).await?;
    if offer.transport == TransportKind::Tcp {
        if plan.tcp_offer_is_fallback() {
            fell_back(ctx, "unavailable", "the source cannot serve rdma");
        } else if plan.want_rdma {
            info!("the source offers tcp only; using tcp");
        }
        let received = transfer(ctx, peer, &offer, early).await;
        return settle(peer, offer, received).await;
    }
    match transfer(ctx, peer, &offer, early).await {
        Ok(received) => Ok((offer, received)),
        Err(e) => match plan.fall_back_after(&e) {
            Some(reason) => {
                fell_back(ctx, reason, &e.to_string());
                decline(peer, &(&offer).into(), &e.to_string()).await;
                let offer = negotiate(ctx, peer, false, false).await?;
                let received = transfer(ctx, peer, &offer, early).await;
                settle(peer, offer, received).await
            }
            None => settle(peer, offer, Err(e)).await,
        },
    }
}

/// An offer this agent can take ([`negotiate`] checked it against the
/// limits) that for RDMA also fits the memory it may pin; otherwise the
/// offer goes back to the source and, where the plan allows, a TCP offer
/// is asked for instead.
async fn usable_offer(
    ctx: &JobContext,
    peer: &mut PeerClient,
    plan: &TransportPlan,
) -> Result<Offer, JobError> {
    let offer = negotiate(ctx, peer, plan.want_rdma, plan.insist()).await?;
    let Some(why) = policy::too_large_to_pin(&offer, ctx.config.cache.memory_budget.as_u64())
    else {
        return Ok(offer);
    };
    decline(peer, &(&offer).into(), &why).await;
    if !plan.may_fall_back {
        return Err(JobError::RdmaUnavailable(why));
    }
    fell_back(ctx, "unavailable", &why);
    negotiate(ctx, peer, false, false).await
}

/// Checks an offer against this agent's limits before anything is
/// reserved ([`policy::within_limits`], with the directory's free space).
fn check_offer(ctx: &JobContext, offer: &Offer) -> Result<(), JobError> {
    let config = &ctx.config;
    let dir = &config.snapshot_dir;
    let free = crate::sys::fs::free_bytes(dir).map_err(|source| {
        JobError::NotWritable(InstallError::NotWritable {
            dir: dir.clone(),
            source,
        })
    })?;
    let limits = policy::Limits {
        data_tls: config.data.tls,
        max_snapshot_bytes: config.sync.max_snapshot_bytes.as_u64(),
        min_free_after: config.sync.min_free_after.as_u64(),
        dir,
    };
    policy::within_limits(&limits, &ctx.source, offer, free)
}

/// What names an offered session to its source.
struct Offered {
    session_id: String,
    instance: String,
}

impl From<&Offer> for Offered {
    fn from(o: &Offer) -> Offered {
        Offered {
            session_id: o.session_id.clone(),
            instance: o.instance.clone(),
        }
    }
}

/// Hands an offer back to its source (best effort, briefly), so it
/// releases the snapshot at once instead of when the token expires.
async fn decline(peer: &mut PeerClient, offer: &Offered, why: &str) {
    report(peer, offer, Err(why)).await;
}

/// Tells the source how its offer ended: the handoff's duration, or the
/// error (best effort, briefly).
async fn report(peer: &mut PeerClient, offer: &Offered, outcome: Result<Duration, &str>) {
    let report = peer.report_result(pb::ReportResultRequest {
        session_id: offer.session_id.clone(),
        instance: offer.instance.clone(),
        ok: outcome.is_ok(),
        error: outcome.err().unwrap_or("").chars().take(1024).collect(),
        handoff_ms: outcome.map_or(0, |d| d.as_millis() as u64),
    });
    let _ = tokio::time::timeout(Duration::from_secs(5), report).await;
}

/// The offer and what it delivered; a failed transfer's offer goes back.
async fn settle(
    peer: &mut PeerClient,
    offer: Offer,
    received: Result<Received, JobError>,
) -> Result<(Offer, Received), JobError> {
    match received {
        Ok(received) => Ok((offer, received)),
        Err(e) => {
            decline(peer, &(&offer).into(), &e.to_string()).await;
            Err(e)
        }
    }
}

/// Checks the verified snapshot is the offered one, then installs it
/// durably under a safe name. Returns the installed path.
async fn install(
    ctx: &JobContext,
    offer: &Offer,
    received: Received,
) -> Result<(PathBuf, SnapshotInfo), JobError> {
    let Received {
        staging,
        outcome,
        info,
        manifest,
        relay,
    } = received;
    let offered = offer.snapshot;
    if info.checksum != offered.checksum || info.seq != offered.seq {
        return Err(JobError::Checksum(format!(
            "verified snapshot (seq {}, checksum {:#x}) is not the offered one (seq {}, checksum {:#x})",
            info.seq, info.checksum, offered.seq, offered.checksum
        )));
    }
    if let Outcome::Received { seq, .. } = outcome {
        if seq != info.seq {
            warn!(
                replmeta = seq,
                header = info.seq,
                "REPLMETA differs from the snapshot header; using REPLMETA"
            );
        }
    }
    ctx.phase(pb::Phase::Installing);
    let (dir, format) = (ctx.config.snapshot_dir.clone(), ctx.config.snapshot_format);
    let name = install::install_name(&dir, &offer.name, info.seq, format)?;
    if name != offer.name {
        warn!(offered = ?offer.name.chars().take(300).collect::<String>(), installed = %name,
            "the source's name is not a plain snapshot name, or names a file kvsync did not install; installing under a safe one");
    }
    // Not cancellable: once the rename may have happened, we finish it.
    let installed = tokio::task::spawn_blocking(move || {
        let path = staging.install(&name)?;
        install::remember_installed(&dir, &name)?;
        Ok::<_, InstallError>(path)
    })
    .await
    .map_err(|e| JobError::Panicked(panic_text(e)))??;
    ctx.progress
        .send_modify(|p| p.installed_path = installed.display().to_string());
    info!(path = %installed.display(), seq = info.seq, "snapshot installed");
    if let Some(relay) = relay {
        // Further replicas are now served from the installed file.
        match std::fs::metadata(&installed).and_then(|m| m.modified()) {
            Ok(mtime) => relay.installed(CatalogEntry {
                path: installed.clone(),
                mtime,
                info: info.clone(),
                manifest,
            }),
            Err(e) => {
                warn!(error = %e, "cannot stat the installed snapshot; no longer relaying it")
            }
        }
    }
    Ok((installed, info))
}

/// Hands the installed snapshot to the local KV (finishing `early`, a
/// seeding that began while it arrived) and counts the result.
async fn hand_off(
    ctx: &JobContext,
    offer: &Offer,
    (installed, info): (PathBuf, SnapshotInfo),
    early: Option<Early>,
) -> Result<Duration, JobError> {
    ctx.phase(pb::Phase::HandingOff);
    let start = std::time::Instant::now();
    let config = &ctx.config;
    let record = HandoffRecord {
        path: installed.clone(),
        info,
        source: format!("{}@{}", offer.source_node, ctx.source),
    };
    let mode = config.handoff.mode.as_str();
    // The stream feed serves this RDB to the server's full resync; where
    // the log continuing it ends is what it can fill of a cluster node's gap.
    let log = ctx.feed.as_ref().map(|f| {
        let end = record.info.repl_id.as_ref().and_then(|id| {
            f.seed_with(installed.clone(), id.clone(), record.info.seq);
            let stream = ctx.stream.as_ref()?;
            stream.view(|log| {
                log.continues(id, record.info.seq).ok()?;
                log.position()
            })
        });
        restart::StreamLog {
            feed: f.target(),
            end,
        }
    });
    let work = handoff::hand_off(&config.handoff, &config.redis, &record, log.as_ref(), early);
    // A restart acts on the server step by step and puts back what a
    // failed step leaves: once begun it runs to its end (within its
    // deadline), cancelled or not.
    let handoff = match config.handoff.mode {
        HandoffMode::Redis => work.await,
        _ => ctx.or_cancel(work).await?,
    };
    let result = if handoff.is_ok() { "ok" } else { "failed" };
    ctx.metrics
        .handoff_total
        .with_label_values(&[&ctx.instance, mode, result])
        .inc();
    let done = handoff.map_err(|source| JobError::Handoff { installed, source })?;
    ctx.progress.send_modify(|p| p.handoff = done);
    Ok(start.elapsed())
}

/// Records a fallback to TCP: metric, status, log.
fn fell_back(ctx: &JobContext, reason: &'static str, detail: &str) {
    warn!(
        reason,
        detail, "rdma not used for this sync; falling back to tcp"
    );
    ctx.metrics
        .transport_fallback
        .with_label_values(&[&ctx.instance, reason])
        .inc();
    ctx.progress
        .send_modify(|p| p.fallback_reason = format!("{reason}: {detail}"));
}

/// Whether the local server may continue the snapshot from this agent's
/// stream log rather than from the primary's backlog, so the source checks
/// its own log instead: fed from it (`redis-stream`), or a cluster node
/// whose gap the log fills (`redis` with a log and its feed on a fixed
/// port, the primary in cluster mode; `kv::restart` decides which at the
/// handoff).
async fn continues_from_log(ctx: &JobContext) -> bool {
    let (mode, redis) = (ctx.config.handoff.mode, &ctx.config.redis);
    match mode {
        HandoffMode::RedisStream => true,
        HandoffMode::Redis
            if ctx.feed.is_some() && crate::config::fixed_port(&redis.seed_listen) =>
        {
            crate::kv::cluster::enabled(&redis.primary, &redis.auth())
                .await
                .unwrap_or(false)
        }
        _ => false,
    }
}

/// Asks the source for a session — TCP only, RDMA if it can, or RDMA
/// insisted on — and checks that the offer answers it and fits this
/// agent's limits. An offer that does not goes back to the source.
async fn negotiate(
    ctx: &JobContext,
    peer: &mut PeerClient,
    rdma: bool,
    insist: bool,
) -> Result<Offer, JobError> {
    let format = ctx.config.snapshot_format;
    let mut transports = vec![pb::Transport::Tcp as i32];
    if rdma {
        transports.push(pb::Transport::Rdma as i32);
    }
    let request = pb::OpenFullSyncRequest {
        replica_node_id: ctx.config.node_id.clone(),
        instance: ctx.source_instance.clone(),
        transports,
        rdma_reachable: rdma,
        preference: if !rdma {
            pb::TransportPreference::Tcp
        } else if insist {
            pb::TransportPreference::Rdma
        } else {
            pb::TransportPreference::Auto
        } as i32,
        format: format.as_str().to_string(),
        rdma_provider: if rdma {
            ctx.rdma.probe().provider.to_string()
        } else {
            String::new()
        },
        data_tls: ctx.dialer.data_tls.is_some(),
        snapshot: ctx.want.map(Into::into),
        tcp_streams: ctx.config.data.tcp_streams.most(),
        piece_queue: true,
        from_stream_log: continues_from_log(ctx).await,
    };
    let offer = ctx
        .or_cancel(peer.open_full_sync(request))
        .await?
        .map_err(|s| match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => JobError::Unreachable {
                source_addr: ctx.source.clone(),
                message: s.message().to_string(),
            },
            code => JobError::Refused {
                code,
                message: s.message().to_string(),
            },
        })?
        .into_inner();
    let offered = Offered {
        session_id: offer.session_id.clone(),
        instance: offer.instance.clone(),
    };
    let asked = Asked {
        format,
        snapshot: ctx.want,
        rdma,
        instance: ctx.source_instance.clone(),
    };
    // The one offer gate: every offer, whichever step asked for it (the
    // first, the TCP one after RDMA went back or failed), is checked here.
    let checked = offer_from_wire(offer).and_then(|o| {
        policy::answers(&o, &asked)?;
        check_offer(ctx, &o)?;
        Ok(o)
    });
    let offer = match checked {
        Ok(offer) => offer,
        Err(e) => {
            decline(peer, &offered, &e.to_string()).await;
            return Err(e);
        }
    };
    ctx.progress.send_modify(|p| {
        p.bytes_total = offer.snapshot.size;
        p.seq = offer.snapshot.seq;
        p.transport = match offer.transport {
            TransportKind::Tcp => pb::Transport::Tcp,
            TransportKind::Rdma => pb::Transport::Rdma,
        } as i32;
        p.phase = pb::Phase::Connecting as i32;
    });
    info!(session = %offer.session_id, size = offer.snapshot.size, seq = offer.snapshot.seq, endpoint = %offer.endpoint, transport = offer.transport.as_str(), backlog_bytes_left = offer.backlog_bytes_left, "offer received");
    Ok(offer)
}

/// The offer off the wire, its shape checked: a session token of the
/// right length, node ids that are plain names, an `ip:port` endpoint and
/// a transport this build knows.
fn offer_from_wire(o: pb::SyncOffer) -> Result<Offer, JobError> {
    let bad = |why: String| JobError::BadOffer(why);
    let token = o
        .session_token
        .as_slice()
        .try_into()
        .map_err(|_| bad(format!("session token of {} bytes", o.session_token.len())))?;
    if !crate::peer_text::is_plain_name(&o.source_node_id) {
        return Err(bad(format!(
            "source node id {:?} is not a plain name (letters, digits, '.', '_', '-')",
            o.source_node_id.chars().take(64).collect::<String>()
        )));
    }
    if !o.origin_node_id.is_empty() && !crate::peer_text::is_plain_name(&o.origin_node_id) {
        return Err(bad(
            "origin node id is not a plain name (letters, digits, '.', '_', '-')".into(),
        ));
    }
    let digest = match crate::rpc::digest_from_wire(&o.manifest_digest) {
        Ok(Some(d)) => d,
        Ok(None) => return Err(bad("no manifest digest".into())),
        Err(e) => return Err(bad(e.to_string())),
    };
    let transport = match pb::Transport::try_from(o.transport) {
        Ok(pb::Transport::Tcp) => TransportKind::Tcp,
        Ok(pb::Transport::Rdma) => TransportKind::Rdma,
        _ => {
            return Err(bad(format!(
                "transport {} is not available here",
                o.transport
            )))
        }
    };
    let endpoint: SocketAddr = o.data_endpoint.parse().map_err(|_| {
        bad(format!(
            "data endpoint {:?} is not ip:port",
            o.data_endpoint.chars().take(300).collect::<String>()
        ))
    })?;
    Ok(Offer {
        session_id: o.session_id,
        token,
        transport,
        endpoint,
        format: o.format,
        snapshot: SnapshotId {
            size: o.snapshot_size,
            seq: o.seq,
            checksum: o.checksum,
            digest: Some(digest),
        },
        source_node: o.source_node_id,
        origin_node: Some(o.origin_node_id).filter(|o| !o.is_empty()),
        name: o.snapshot_name,
        piece_size: o.piece_size,
        data_tls: o.data_tls,
        tcp_streams: if o.piece_queue { o.tcp_streams } else { 1 },
        rdma_device: o.rdma_device,
        backlog_bytes_left: o.backlog_bytes_left,
        instance: o.instance,
    })
}

/// Reports bulk progress into the sync's status.
fn progress_reporter(ctx: &JobContext, total: u64) -> impl Fn(u64) + Send + Sync + 'static {
    let progress = ctx.progress.clone();
    let started = Instant::now();
    move |done: u64| {
        let secs = started.elapsed().as_secs_f64().max(1e-6);
        progress.send_modify(|p| {
            p.bytes_done = done;
            p.throughput_bps = done as f64 / secs;
            if done == total {
                p.phase = pb::Phase::Verifying as i32;
            }
        });
    }
}

/// The offered snapshot's piece manifest, fetched from the source and
/// checked against the offer: its digest, piece size and identity.
async fn fetch_manifest(
    ctx: &JobContext,
    peer: &mut PeerClient,
    offer: &Offer,
) -> Result<Manifest, JobError> {
    let bad = |why: String| JobError::BadOffer(format!("piece manifest: {why}"));
    crate::snapshot::manifest::check_piece_size(offer.piece_size)
        .map_err(|e| bad(e.to_string()))?;
    // What a manifest of this snapshot can weigh, and never more than one
    // of the largest snapshot this agent takes in the smallest pieces.
    let weight = |size, piece_size| {
        Manifest::encoded_len(Manifest::count_for(size, piece_size)) + MAX_REPL_ID as u64
    };
    let most = weight(offer.snapshot.size, offer.piece_size).min(weight(
        ctx.config.sync.max_snapshot_bytes.as_u64(),
        crate::snapshot::manifest::MIN_PIECE_SIZE,
    ));
    let request = pb::GetManifestRequest {
        session_id: offer.session_id.clone(),
        instance: offer.instance.clone(),
    };
    let unreachable = |s: tonic::Status| JobError::Unreachable {
        source_addr: ctx.source.clone(),
        message: format!("fetching the piece manifest: {}", s.message()),
    };
    let mut parts = ctx
        .or_cancel(peer.get_manifest(request))
        .await?
        .map_err(unreachable)?
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(part) = ctx.or_cancel(parts.message()).await?.map_err(unreachable)? {
        if (bytes.len() + part.data.len()) as u64 > most {
            return Err(bad(format!("more than the {most} bytes it can hold")));
        }
        bytes.extend_from_slice(&part.data);
    }
    let manifest = Manifest::decode(&bytes).map_err(|e| bad(e.to_string()))?;
    if offer.snapshot != manifest.id()
        || manifest.piece_size != offer.piece_size
        || manifest.info.format.as_str() != offer.format
    {
        return Err(bad(
            "it describes another snapshot than the offer (the source changed it?)".into(),
        ));
    }
    Ok(manifest)
}

/// One BLK3 session on the offered transport, into a staging file that
/// resumes what an earlier attempt verified of the same snapshot.
/// Cancelling stops the session and still waits for its thread, so the
/// staging file is gone by the time the sync reports "cancelled". With the
/// `redis-replicate` handoff the server is seeded from the verified pieces
/// while the rest arrives; that seeding is left in `early` when the
/// snapshot arrived whole, and undone when it did not.
async fn transfer(
    ctx: &JobContext,
    peer: &mut PeerClient,
    offer: &Offer,
    early: &mut Option<Early>,
) -> Result<Received, JobError> {
    let kind = offer.transport;
    let manifest = Arc::new(fetch_manifest(ctx, peer, offer).await?);
    let mut receiver = open_receiver(ctx, offer, manifest.clone()).await?;
    let resumed = receiver.resumed_bytes();
    ctx.progress.send_modify(|p| p.resumed_bytes = resumed);
    let dialed = dial_links(ctx, offer).await?;

    ctx.phase(pb::Phase::Transferring);
    start_over_stranded(ctx, &manifest.info).await?;
    let seeding = start_early(ctx, &receiver, manifest)?;
    let bulk_started = Instant::now();
    let (token, total) = (offer.token, offer.snapshot.size);
    let (mut links, grow, cancel) = (dialed.links, dialed.grow, dialed.cancel);
    let canceller = cancel.clone();
    let mut run = tokio::task::spawn_blocking(move || {
        if links.len() == 1 && grow.is_none() {
            let link = links.pop().expect("one link");
            let (result, memory) = link.run(token, total, &mut receiver);
            (result, memory, receiver, 1)
        } else {
            let (result, receiver, ran) =
                super::streams::run(links, grow, &canceller, token, total, receiver);
            (result, None, receiver, ran)
        }
    });
    let joined = tokio::select! {
        r = &mut run => r,
        _ = ctx.cancel.cancelled() => {
            cancel.cancel();
            run.await
        }
    };
    let (result, memory, receiver, ran) = joined.map_err(|e| JobError::Panicked(panic_text(e)))?;
    let label = &dialed.label;
    if let Some((streams, round_trip)) = dialed.auto {
        let detail = format!(
            "{label}; tcp_streams = auto: {ran} of {streams} streams for a {} ms round trip",
            round_trip.as_millis()
        );
        ctx.progress.send_modify(|p| p.detail = detail);
    }
    count_transfer(ctx, kind, &receiver, resumed, bulk_started);
    if let Some(memory) = memory {
        ctx.progress
            .send_modify(|p| p.detail = format!("{label}; receive memory: {memory}"));
    }
    let received = receiver.finish(result);
    match (&received, seeding) {
        (Ok(_), seeding) => *early = seeding,
        (Err(e), seeding) => {
            warn!(error = %e, "received snapshot rejected");
            if let Some(seeding) = seeding {
                seeding.abandon(e.to_string()).await;
            }
        }
    }
    received
}

/// Opens the staging file for `offer`'s snapshot (resuming what an
/// earlier attempt left), and offers it on as a relay while it arrives
/// when it was asked for by its digest (a fan-out's).
async fn open_receiver(
    ctx: &JobContext,
    offer: &Offer,
    manifest: Arc<Manifest>,
) -> Result<Receiver, JobError> {
    let (origin, name) = (offer.origin().to_string(), offer.name.clone());
    // Only a snapshot asked for by its digest is passed on while it
    // arrives: its manifest is the origin's, checked when it was fetched,
    // so another replica can get from this relay the origin's bytes or none.
    let relays = ctx
        .want
        .is_some_and(|w| w.digest.is_some())
        .then(|| ctx.relays.clone());
    let (dir, id, retries) = (
        ctx.config.snapshot_dir.clone(),
        ctx.id.clone(),
        ctx.config.data.piece_retries,
    );
    let progress = progress_reporter(ctx, offer.snapshot.size);
    let check = Receiver::check_label(&manifest);
    ctx.progress.send_modify(|p| p.check = check);
    ctx.or_cancel(tokio::task::spawn_blocking(move || {
        let mut receiver = Receiver::open(&dir, &id, &origin, manifest, retries, progress)?;
        if let Some(relays) = relays {
            receiver
                .relay_in(&relays, (&origin, &name))
                .map_err(|e| JobError::Panicked(format!("offer the snapshot as a relay: {e}")))?;
        }
        Ok::<_, JobError>(receiver)
    }))
    .await?
    .map_err(|e| JobError::Panicked(panic_text(e)))?
}

/// A session's data connections, dialled.
struct Dialed {
    links: Vec<DataLink>,
    /// Stops them all.
    cancel: super::streams::Cancel,
    /// With `tcp_streams = "auto"`: how to dial more.
    grow: Option<super::streams::Grow>,
    /// With `tcp_streams = "auto"`: the most streams granted and the first
    /// connection's round trip.
    auto: Option<(u32, Duration)>,
    /// The status detail that names the link.
    label: String,
}

/// Dials the data connections `offer` grants: what the source granted and
/// never more than this agent asked for; `auto` dials one and decides on
/// the rest after its first second.
async fn dial_links(ctx: &JobContext, offer: &Offer) -> Result<Dialed, JobError> {
    let kind = offer.transport;
    let spec = dial_spec(ctx, offer, kind)?;
    let count = ctx.config.data.tcp_streams;
    let streams = super::streams::granted(kind, offer.tcp_streams, count.most());
    let auto = count.is_auto() && streams > 1;
    let label = link_label(offer, &spec, if auto { 1 } else { streams });
    ctx.progress.send_modify(|p| p.detail = label.clone());
    let endpoint = spec.endpoint;
    let (first, spec) = ctx
        .or_cancel(tokio::task::spawn_blocking(move || {
            let first = (0..if auto { 1 } else { streams })
                .map(|_| DataLink::dial(&spec))
                .collect::<Result<Vec<_>, _>>();
            (first, spec)
        }))
        .await?
        .map_err(|e| JobError::Panicked(panic_text(e)))?;
    let links = first.map_err(|source| JobError::DataConnect { endpoint, source })?;
    let cancel = super::streams::Cancel::default();
    links.iter().for_each(|link| cancel.add(link));
    let round_trip = links[0].handshake().unwrap_or_default();
    Ok(Dialed {
        links,
        cancel,
        grow: auto.then(|| super::streams::Grow {
            round_trip,
            spec,
            most: streams,
        }),
        auto: auto.then_some((streams, round_trip)),
        label,
    })
}

/// Counts a finished transfer in the metrics and the status: its bulk
/// time (since `bulk_started`), the bytes written and `resumed`, and the
/// pieces fetched again.
fn count_transfer(
    ctx: &JobContext,
    kind: TransportKind,
    receiver: &Receiver,
    resumed: u64,
    bulk_started: Instant,
) {
    let instance = ctx.instance.as_str();
    let m = &ctx.metrics;
    m.bulk_duration
        .with_label_values(&[instance])
        .observe(bulk_started.elapsed().as_secs_f64());
    m.fullsync_bytes
        .with_label_values(&[instance, "replica", kind.as_str()])
        .inc_by(receiver.written());
    m.resumed_bytes
        .with_label_values(&[instance])
        .inc_by(resumed);
    let refetched = receiver.refetched();
    m.piece_refetch
        .with_label_values(&[instance, kind.as_str()])
        .inc_by(refetched as u64);
    ctx.progress
        .send_modify(|p| p.pieces_refetched += refetched);
}

/// For a server fed from a stream log: refused when the server left the
/// feed as a master ([`crate::stream::keep::may_seed`]); when the log no
/// longer continues its upstreams (its writer needs a snapshot), the log
/// starts over at this snapshot ([`crate::stream::Stream::start_over_for_sync`]), so that
/// the feed seeds the server from it and the stream goes on after it.
async fn start_over_stranded(ctx: &JobContext, info: &SnapshotInfo) -> Result<(), JobError> {
    let fed = ctx.feed.is_some() && ctx.config.handoff.mode == HandoffMode::RedisStream;
    let (Some(stream), Some(replid), true) = (ctx.stream.clone(), info.repl_id.clone(), fed) else {
        return Ok(());
    };
    // Checked before anything changes: a server that left the feed keeps
    // what it holds.
    crate::stream::keep::may_seed(&ctx.config.redis, &ctx.config.stream.dir)
        .await
        .map_err(JobError::ServerHeld)?;
    let (source, seq) = (ctx.source.clone(), info.seq);
    let started = tokio::task::spawn_blocking(move || {
        stream.start_over_for_sync(&source, seq, (&replid, seq))
    })
    .await
    .map_err(|e| JobError::Panicked(e.to_string()))?
    .map_err(|e| JobError::StartOver(Arc::new(e)))?;
    if started {
        warn!(seq, "the stream log no longer continued its upstreams: it starts over at this snapshot, which re-seeds the server");
    }
    Ok(())
}

/// Starts seeding the local server from the pieces `receiver` verifies,
/// in order, as they arrive: as its one-shot master (`redis-replicate`),
/// or through the stream feed (`redis-stream`, for an RDB the feed can
/// serve). Other handoffs wait for the install.
fn start_early(
    ctx: &JobContext,
    receiver: &Receiver,
    manifest: Arc<Manifest>,
) -> Result<Option<Early>, JobError> {
    let (mode, feed) = (ctx.config.handoff.mode, ctx.feed.as_ref());
    let announced = manifest.info.clone();
    let streamed = match (mode, feed, &announced.repl_id) {
        (HandoffMode::RedisReplicate, _, _) => None,
        (HandoffMode::RedisStream, Some(feed), Some(id)) => Some((feed, id.clone())),
        _ => return Ok(None),
    };
    let (file, arrivals) = receiver
        .following()
        .map_err(|e| JobError::Panicked(format!("follow the staging file for the seeding: {e}")))?;
    let (arriving, verdict) = Arriving::new(file, manifest, arrivals);
    let (cfg, timeout) = (ctx.config.redis.clone(), ctx.config.handoff.timeout);
    info!("seeding the local server while the snapshot arrives");
    Ok(Some(match streamed {
        None => Early::replicate(
            cfg,
            timeout,
            ctx.config.snapshot_dir.clone(),
            arriving,
            verdict,
        ),
        Some((feed, id)) => {
            feed.seed_arriving(arriving, id, announced.seq);
            Early::attach(cfg, timeout, feed.target(), announced, verdict)
        }
    }))
}

/// Where and how to reach the offer's data endpoint. RDMA cannot use
/// loopback: a loopback source is this host, reached on its RDMA address.
fn dial_spec(ctx: &JobContext, offer: &Offer, kind: TransportKind) -> Result<DialSpec, JobError> {
    let endpoint = offer.endpoint;
    let local = ctx.rdma.probe().local_addr;
    let (endpoint, rdma) = match kind {
        TransportKind::Tcp => (endpoint, None),
        TransportKind::Rdma => (
            SocketAddr::new(
                select::map_peer(endpoint.ip(), local.unwrap_or(endpoint.ip())),
                endpoint.port(),
            ),
            Some(ctx.config.transport.rdma_provider),
        ),
    };
    let tls = match (&ctx.dialer.data_tls, offer.data_tls && rdma.is_none()) {
        (Some(config), true) => Some(ClientTls {
            config: config.clone(),
            name: crate::rpc::dial::tls_name(&ctx.config.tls.server_name, &ctx.source),
            kernel: ktls::use_kernel(ctx.config.data.kernel_tls, offer.snapshot.size),
        }),
        (None, true) => {
            return Err(JobError::BadOffer(
                "the source offered TLS on the data plane, which this replica has no [tls] for"
                    .into(),
            ))
        }
        (_, false) => None,
    };
    Ok(DialSpec {
        endpoint,
        rdma,
        peer_timeout: ctx.config.data.peer_timeout,
        min_rate: (&ctx.config.data).into(),
        local,
        soft: ctx.rdma.probe().soft,
        tls,
    })
}

/// How the status describes the data link.
fn link_label(offer: &Offer, spec: &DialSpec, streams: u32) -> String {
    let tls = match &spec.tls {
        Some(t) if t.kernel => " (TLS in the kernel)",
        Some(_) => " (TLS)",
        None => "",
    };
    let how = match spec.rdma {
        None if streams > 1 => format!("tcp{tls}, {streams} streams, into staging file"),
        None => format!("tcp{tls} stream into staging file"),
        Some(RdmaProvider::Verbs) => format!("rdma verbs via {}", offer.rdma_device),
        Some(RdmaProvider::Emulated) => "rdma EMULATED fabric (not hardware)".to_string(),
    };
    format!("{how} to {}", spec.endpoint)
}

/// What a panicked task said, for the sync's error.
fn panic_text(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into()),
        Err(e) => e.to_string(),
    }
}
