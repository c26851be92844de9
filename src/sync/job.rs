//! One replica-side full sync, end to end: choose the transport → negotiate
//! with the source over gRPC → connect the data plane → run BLK3 into a
//! staging file (over RDMA, or TCP with the checksum computed on the way) →
//! verify → fsync, rename, fsync dir → handoff → report. An RDMA session
//! that fails (connect, completion error, timeout, RDFL) is retried over TCP
//! within the same job when the mode allows it, counted by reason and shown
//! in the status. Progress goes to a watch channel; every failure (and
//! cancel) drops the staging file, so the previous snapshot and the KV stay
//! untouched, and ends with a typed [`JobError`] in the sync's status.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::{Blk3Error, Outcome};
use crate::config::{Config, RdmaProvider, TransportMode};
use crate::control::{self, pb, AgentChannel, Dialer};
use crate::handoff::{self, HandoffError, HandoffRecord};
use crate::install::{self, InstallError, Staging};
use crate::metrics::{unix_now, Metrics};
use crate::snapshot::SnapshotInfo;
use crate::transport::probe::Probe;
use crate::transport::rdma::{self, RdmaError};
use crate::transport::tcp::{self, Link, TcpError};
use crate::transport::{select, Faults, TransportKind};

/// A Peer client presenting this agent's token.
type PeerClient = pb::peer_client::PeerClient<AgentChannel>;

/// How long connecting to the source (gRPC and data) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a sync failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The destination directory cannot receive.
    #[error(transparent)]
    NotWritable(InstallError),
    /// The source agent could not be reached.
    #[error("source {source_addr} unreachable: {message}")]
    Unreachable {
        source_addr: String,
        message: String,
    },
    /// The source refused to offer a session.
    #[error("source refused the sync ({code:?}): {message}")]
    Refused { code: tonic::Code, message: String },
    /// The offer cannot be used by this agent.
    #[error("unusable offer from the source: {0}")]
    BadOffer(String),
    /// The data endpoint could not be reached.
    #[error("cannot connect to data endpoint {endpoint}: {message}")]
    DataConnect { endpoint: String, message: String },
    /// The data connection failed.
    #[error("data transfer failed: {0}")]
    Transport(#[from] TcpError),
    /// The RDMA session failed below the protocol.
    #[error("rdma transfer failed: {0}")]
    Rdma(#[from] RdmaError),
    /// RDMA was required but cannot be used, and fallback is off.
    #[error("rdma required but unavailable: {0} (set transport.fallback_to_tcp = true or use mode auto)")]
    RdmaUnavailable(String),
    /// BLK3 ended the session.
    #[error("{0}")]
    Protocol(Blk3Error),
    /// The received bytes are not the snapshot (RDFL sent, nothing installed).
    #[error("received snapshot failed verification: {0}")]
    Checksum(String),
    /// Verified, but the disk refused it.
    #[error("install failed: {0}")]
    Install(#[from] InstallError),
    /// Installed, but the KV did not take it.
    #[error("snapshot installed at {} but the handoff failed: {source}", installed.display())]
    Handoff {
        installed: PathBuf,
        source: HandoffError,
    },
    /// Cancelled by an operator or shutdown.
    #[error("cancelled")]
    Cancelled,
}

impl JobError {
    /// The `result` label of `kvsync_fullsync_total`.
    pub fn result_label(&self) -> &'static str {
        match self {
            JobError::Checksum(_) => "checksum_mismatch",
            JobError::Cancelled
            | JobError::Transport(TcpError::Cancelled)
            | JobError::Rdma(RdmaError::Cancelled) => "cancelled",
            _ => "failed",
        }
    }

    /// Worth another attempt: the source or network may recover. Checksum
    /// mismatches count too (the caller gives up on the second).
    fn is_transient(&self) -> bool {
        match self {
            JobError::Unreachable { .. }
            | JobError::DataConnect { .. }
            | JobError::Checksum(_)
            | JobError::Rdma(RdmaError::Fabric(_) | RdmaError::Completion { .. }) => true,
            JobError::Transport(e) => !matches!(e, TcpError::Cancelled),
            JobError::Protocol(e) => !matches!(
                e,
                Blk3Error::MrinfoLength { .. } | Blk3Error::AnnouncedLength { .. }
            ),
            JobError::Refused { code, .. } => matches!(
                code,
                tonic::Code::Unavailable
                    | tonic::Code::ResourceExhausted
                    | tonic::Code::Aborted
                    | tonic::Code::NotFound // no snapshot yet
            ),
            _ => false,
        }
    }

    /// Why an RDMA attempt that failed this way is retried over TCP
    /// (`kvsync_transport_fallback_total{reason}`), or `None` when the
    /// failure is not the transport's (cancel, local disk, handoff).
    fn fallback_reason(&self) -> Option<&'static str> {
        Some(match self {
            JobError::Rdma(RdmaError::Cancelled | RdmaError::Receive(_)) => return None,
            JobError::Rdma(e) => e.fallback_reason(),
            JobError::DataConnect { .. } => "connect",
            JobError::Checksum(_) => "checksum",
            JobError::Protocol(Blk3Error::Timeout { .. }) => "timeout",
            JobError::Protocol(Blk3Error::PeerFailed(_)) => "peer_failed",
            JobError::Protocol(_) => "protocol",
            _ => return None,
        })
    }
}

/// Everything one job needs.
pub struct JobContext {
    pub id: String,
    pub source: String,
    pub preference: pb::TransportPreference,
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// This agent's RDMA probe (provider, local address, soft device).
    pub rdma: Arc<Probe>,
    pub faults: Faults,
    /// How to reach the source's Peer service (TLS, bearer token).
    pub dialer: Dialer,
    pub progress: watch::Sender<pb::SyncProgress>,
    pub cancel: CancellationToken,
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

/// Checks that a sync could install into `dir` (a temp file can be made).
pub fn check_writable(dir: &Path) -> Result<(), InstallError> {
    tempfile::Builder::new()
        .prefix(install::TEMP_PREFIX)
        .suffix(install::TEMP_SUFFIX)
        .tempfile_in(dir)
        .map(drop)
        .map_err(|source| InstallError::NotWritable {
            dir: dir.to_owned(),
            source,
        })
}

/// Runs the job to its end and returns the final progress record.
pub async fn run(ctx: JobContext) -> pb::SyncProgress {
    let span = info_span!("sync", id = %ctx.id, source = %ctx.source);
    async {
        let m = ctx.metrics.clone();
        m.fullsync_in_progress.with_label_values(&["replica"]).inc();
        let started = Instant::now();
        let result = with_retries(&ctx).await;
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
                    .with_label_values(&["replica"])
                    .set(unix_now());
            }
            Err(e) => warn!(error = %e, "full sync failed"),
        }
        m.fullsync_total
            .with_label_values(&["replica", transport, label])
            .inc();
        m.fullsync_duration
            .with_label_values(&["replica", transport])
            .observe(elapsed.as_secs_f64());
        m.fullsync_in_progress.with_label_values(&["replica"]).dec();
        let last = ctx.progress.borrow().clone();
        last
    }
    .instrument(span)
    .await
}

/// Runs attempts until one succeeds, a failure is permanent, or the
/// configured retries are used up; waits with exponential backoff and
/// jitter in between. Status shows the attempts and the last error.
async fn with_retries(ctx: &JobContext) -> Result<(), JobError> {
    let sync = &ctx.config.sync;
    let mut checksum_failures = 0;
    let mut attempt_no = 0u32;
    loop {
        attempt_no += 1;
        ctx.progress.send_modify(|p| p.attempts = attempt_no);
        let err = match attempt(ctx).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if matches!(err, JobError::Checksum(_)) {
            checksum_failures += 1;
        }
        let retry = err.is_transient() && checksum_failures < 2 && attempt_no <= sync.retries;
        if !retry {
            return Err(err);
        }
        let backoff = backoff(sync.retry_backoff, sync.retry_backoff_max, attempt_no);
        warn!(attempt = attempt_no, error = %err, ?backoff, "sync attempt failed; retrying");
        ctx.progress.send_modify(|p| {
            p.last_error = err.to_string();
            p.phase = pb::Phase::Negotiating as i32;
            p.bytes_done = 0;
        });
        ctx.or_cancel(tokio::time::sleep(backoff)).await?;
    }
}

/// `base × 2^(attempt-1)`, capped at `max`, with ±25 % jitter.
fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    use rand::Rng;
    let exp = base.saturating_mul(1u32 << (attempt - 1).min(16)).min(max);
    exp.mul_f64(rand::rng().random_range(0.75..1.25))
}

/// What one data-plane session delivered into its staging file.
struct Transfer {
    staging: Staging,
    outcome: Outcome,
    info: SnapshotInfo,
}

async fn attempt(ctx: &JobContext) -> Result<(), JobError> {
    let config = &ctx.config;
    check_writable(&config.snapshot_dir).map_err(JobError::NotWritable)?;
    let mode = match ctx.preference {
        pb::TransportPreference::Tcp => TransportMode::Tcp,
        pb::TransportPreference::Rdma => TransportMode::Rdma,
        pb::TransportPreference::Auto => config.transport.mode,
    };
    let may_fall_back = mode == TransportMode::Auto || config.transport.fallback_to_tcp;
    let want_rdma = mode != TransportMode::Tcp && ctx.rdma.rdma_available;
    if mode == TransportMode::Rdma && !ctx.rdma.rdma_available {
        if !may_fall_back {
            return Err(JobError::RdmaUnavailable(ctx.rdma.reason.clone()));
        }
        fell_back(ctx, "unavailable", &ctx.rdma.reason);
    }

    // Negotiate.
    let channel = ctx
        .or_cancel(ctx.dialer.connect(&ctx.source, CONNECT_TIMEOUT))
        .await?
        .map_err(|e| JobError::Unreachable {
            source_addr: ctx.source.clone(),
            message: e,
        })?;
    let mut peer = pb::peer_client::PeerClient::new(channel);
    // Only a sync that cannot fall back insists on RDMA with the source.
    let insist = mode == TransportMode::Rdma && !may_fall_back;
    let mut offer = negotiate(ctx, &mut peer, want_rdma, insist).await?;
    let transfer = if offer.transport == pb::Transport::Rdma as i32 {
        match transfer_rdma(ctx, &offer).await {
            Ok(t) => t,
            Err(e) => match e.fallback_reason() {
                Some(reason) if may_fall_back => {
                    fell_back(ctx, reason, &e.to_string());
                    offer = negotiate(ctx, &mut peer, false, false).await?;
                    transfer_tcp(ctx, &offer).await?
                }
                _ => return Err(e),
            },
        }
    } else {
        if want_rdma && mode == TransportMode::Rdma {
            fell_back(ctx, "unavailable", "the source cannot serve rdma");
        } else if want_rdma {
            info!("the source offers tcp only; using tcp");
        }
        transfer_tcp(ctx, &offer).await?
    };
    let Transfer {
        staging,
        outcome,
        info,
    } = transfer;
    if info.checksum != offer.checksum || info.seq != offer.seq {
        return Err(JobError::Checksum(format!(
            "verified snapshot (seq {}, checksum {:#x}) is not the offered one (seq {}, checksum {:#x})",
            info.seq, info.checksum, offer.seq, offer.checksum
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

    // Install durably.
    ctx.phase(pb::Phase::Installing);
    let name = install::install_name(&offer.snapshot_name, info.seq, config.snapshot_format);
    if name != offer.snapshot_name {
        warn!(offered = ?offer.snapshot_name.chars().take(300).collect::<String>(), installed = %name,
            "the source offered a name that is not a plain file name; installing under a safe one");
    }
    // Not cancellable: once the rename may have happened, we finish it.
    let installed = tokio::task::spawn_blocking(move || staging.install(&name))
        .await
        .expect("install thread does not panic")?;
    ctx.progress
        .send_modify(|p| p.installed_path = installed.display().to_string());
    info!(path = %installed.display(), seq = info.seq, "snapshot installed");

    // Hand off to the local KV.
    ctx.phase(pb::Phase::HandingOff);
    let record = HandoffRecord {
        path: installed.clone(),
        info,
        source: format!("{}@{}", offer.source_node_id, ctx.source),
    };
    let mode = format!("{:?}", config.handoff.mode).to_lowercase();
    let handoff = ctx
        .or_cancel(handoff::hand_off(&config.handoff, &config.redis, &record))
        .await?;
    let result = if handoff.is_ok() { "ok" } else { "failed" };
    ctx.metrics
        .handoff_total
        .with_label_values(&[mode.as_str(), result])
        .inc();
    let done = handoff.map_err(|source| JobError::Handoff { installed, source })?;
    ctx.progress.send_modify(|p| p.handoff = done.clone());

    // Tell the source (best effort; the sync already succeeded).
    let _ = peer
        .report_result(pb::ReportResultRequest {
            session_id: offer.session_id,
            ok: true,
            error: String::new(),
        })
        .await;
    Ok(())
}

/// Records a fallback to TCP: metric, status, log.
fn fell_back(ctx: &JobContext, reason: &'static str, detail: &str) {
    warn!(
        reason,
        detail, "rdma not used for this sync; falling back to tcp"
    );
    ctx.metrics
        .transport_fallback
        .with_label_values(&[reason])
        .inc();
    ctx.progress
        .send_modify(|p| p.fallback_reason = format!("{reason}: {detail}"));
}

/// Asks the source for a session — TCP only, RDMA if it can, or RDMA
/// insisted on — and checks the offer.
async fn negotiate(
    ctx: &JobContext,
    peer: &mut PeerClient,
    rdma: bool,
    insist: bool,
) -> Result<pb::SyncOffer, JobError> {
    let format = ctx.config.snapshot_format;
    let mut transports = vec![pb::Transport::Tcp as i32];
    if rdma {
        transports.push(pb::Transport::Rdma as i32);
    }
    let request = pb::OpenFullSyncRequest {
        replica_node_id: ctx.config.node_id.clone(),
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
            ctx.rdma.provider.to_string()
        } else {
            String::new()
        },
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
    if offer.session_token.len() != SESSION_TOKEN_LEN {
        return Err(JobError::BadOffer(format!(
            "session token of {} bytes",
            offer.session_token.len()
        )));
    }
    if offer.format != format.as_str() {
        return Err(JobError::BadOffer(format!(
            "format {} but this agent installs {format}",
            offer.format
        )));
    }
    let rdma_offered = offer.transport == pb::Transport::Rdma as i32;
    if !(offer.transport == pb::Transport::Tcp as i32 || (rdma && rdma_offered)) {
        return Err(JobError::BadOffer(format!(
            "transport {} is not available here",
            offer.transport
        )));
    }
    ctx.progress.send_modify(|p| {
        p.bytes_total = offer.snapshot_size;
        p.seq = offer.seq;
        p.transport = offer.transport;
        p.phase = pb::Phase::Connecting as i32;
    });
    info!(session = %offer.session_id, size = offer.snapshot_size, seq = offer.seq, endpoint = %offer.data_endpoint, transport = %control::transport_name(offer.transport), backlog_bytes_left = offer.backlog_bytes_left, "offer received");
    Ok(offer)
}

fn session_token(offer: &pb::SyncOffer) -> [u8; SESSION_TOKEN_LEN] {
    offer
        .session_token
        .as_slice()
        .try_into()
        .expect("negotiate checked the token length")
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

/// Maps a session's verdict to the job's terms.
fn verdict(
    result: Result<Outcome, Blk3Error>,
    info: Option<SnapshotInfo>,
) -> Result<(Outcome, SnapshotInfo), JobError> {
    match result {
        Err(Blk3Error::Checksum(reason)) => Err(JobError::Checksum(reason)),
        Err(e) => Err(JobError::Protocol(e)),
        Ok(outcome) => Ok((
            outcome,
            info.expect("a verified session has its snapshot info"),
        )),
    }
}

/// One BLK3 session over TCP.
async fn transfer_tcp(ctx: &JobContext, offer: &pb::SyncOffer) -> Result<Transfer, JobError> {
    let mut staging = Staging::create(
        &ctx.config.snapshot_dir,
        &format!("{}-tcp", ctx.id),
        ctx.config.snapshot_format,
    )
    .map_err(JobError::NotWritable)?;
    ctx.progress
        .send_modify(|p| p.detail = "tcp stream into staging file".into());
    let connect = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(&offer.data_endpoint),
    );
    let stream = ctx
        .or_cancel(connect)
        .await?
        .map_err(|_| format!("no answer within {CONNECT_TIMEOUT:?}"))
        .and_then(|r| r.map_err(|e| e.to_string()))
        .and_then(|s| {
            crate::transport::blocking_data_socket(s, ctx.config.data.peer_timeout)
                .map_err(|e| e.to_string())
        })
        .map_err(|message| JobError::DataConnect {
            endpoint: offer.data_endpoint.clone(),
            message,
        })?;
    let mut link = Link::new(stream).map_err(|source| TcpError::Io {
        op: "configure socket",
        source,
    })?;
    let cancel = link.cancel_handle();

    // Move the bytes on a blocking thread; cancelling shuts the socket.
    ctx.phase(pb::Phase::Transferring);
    let bulk_started = Instant::now();
    let (token, total) = (session_token(offer), offer.snapshot_size);
    let report = progress_reporter(ctx, total);
    let mut transfer = tokio::task::spawn_blocking(move || {
        let run = tcp::run_replica(&mut link, token, total, &mut staging, &report);
        (run, staging)
    });
    // On cancel, shut the socket and still wait for the thread, so the
    // staging file is gone by the time the sync reports "cancelled".
    let (run, staging) = tokio::select! {
        r = &mut transfer => r,
        _ = ctx.cancel.cancelled() => {
            cancel.cancel();
            transfer.await
        }
    }
    .expect("transfer thread does not panic");
    bulk_done(ctx, TransportKind::Tcp, bulk_started, staging.written());
    let result = match run.result {
        Err(TcpError::Cancelled) => return Err(JobError::Cancelled),
        Err(e) => return Err(e.into()),
        Ok(r) => r,
    };
    let (outcome, info) = verdict(result, run.info)?;
    Ok(Transfer {
        staging,
        outcome,
        info,
    })
}

fn bulk_done(ctx: &JobContext, kind: TransportKind, started: Instant, bytes: u64) {
    ctx.metrics
        .bulk_duration
        .observe(started.elapsed().as_secs_f64());
    ctx.metrics
        .fullsync_bytes
        .with_label_values(&["replica", kind.as_str()])
        .inc_by(bytes);
}

/// One BLK3 session over RDMA (verbs or the emulated fabric).
async fn transfer_rdma(ctx: &JobContext, offer: &pb::SyncOffer) -> Result<Transfer, JobError> {
    let mut staging = Staging::create(
        &ctx.config.snapshot_dir,
        &format!("{}-rdma", ctx.id),
        ctx.config.snapshot_format,
    )
    .map_err(JobError::NotWritable)?;
    let endpoint: std::net::SocketAddr = offer.data_endpoint.parse().map_err(|_| {
        JobError::BadOffer(format!(
            "rdma endpoint {:?} is not ip:port",
            offer.data_endpoint
        ))
    })?;
    let local = ctx.rdma.local_addr;
    // RDMA cannot use loopback: a loopback source is this host.
    let dest = std::net::SocketAddr::new(
        select::map_peer(endpoint.ip(), local.unwrap_or(endpoint.ip())),
        endpoint.port(),
    );
    let provider = ctx.config.transport.rdma_provider;
    let label = match provider {
        RdmaProvider::Verbs => format!("rdma verbs via {}", offer.rdma_device),
        RdmaProvider::Emulated => "rdma EMULATED fabric (not hardware)".to_string(),
    };
    ctx.progress
        .send_modify(|p| p.detail = format!("{label} to {dest}"));
    ctx.phase(pb::Phase::Transferring);
    let bulk_started = Instant::now();
    let (token, total) = (session_token(offer), offer.snapshot_size);
    let report = progress_reporter(ctx, total);
    let cancel = ctx.cancel.child_token();
    let (faults, soft) = (ctx.faults.clone(), ctx.rdma.soft);
    let peer_timeout = ctx.config.data.peer_timeout;
    let run = tokio::task::spawn_blocking(move || {
        let run = match provider {
            RdmaProvider::Emulated => crate::transport::emulated::EmuQp::dial(
                dest,
                rdma::CONNECT_TIMEOUT,
                faults.emu.clone(),
            )
            .and_then(|qp| qp.set_peer_timeout(peer_timeout).map(|_| qp))
            .map(|qp| {
                rdma::run_replica(
                    qp,
                    token,
                    total,
                    &mut staging,
                    &faults.rdma,
                    &report,
                    cancel,
                )
            }),
            #[cfg(feature = "rdma")]
            RdmaProvider::Verbs => {
                crate::transport::verbs::VerbsQp::dial(dest, local, soft).map(|qp| {
                    rdma::run_replica(
                        qp,
                        token,
                        total,
                        &mut staging,
                        &faults.rdma,
                        &report,
                        cancel,
                    )
                })
            }
            #[cfg(not(feature = "rdma"))]
            RdmaProvider::Verbs => {
                let _ = (soft, local, cancel);
                unreachable!("the probe never offers verbs without the rdma feature")
            }
        };
        (run, staging)
    });
    let (run, staging) = run.await.expect("transfer thread does not panic");
    let run = run.map_err(|e| JobError::DataConnect {
        endpoint: dest.to_string(),
        message: e.to_string(),
    })?;
    bulk_done(ctx, TransportKind::Rdma, bulk_started, staging.written());
    if let Some(memory) = run.memory {
        ctx.progress
            .send_modify(|p| p.detail = format!("{label} to {dest}; receive memory: {memory}"));
    }
    if let Some(e) = run.failure.as_ref() {
        warn!(error = %e, "received snapshot rejected");
    }
    let (outcome, info) = verdict(run.result?, run.info)?;
    Ok(Transfer {
        staging,
        outcome,
        info,
    })
}
