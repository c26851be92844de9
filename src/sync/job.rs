//! One replica-side full sync, end to end: negotiate with the source over
//! gRPC → connect the data plane → run BLK3 into a staging file with the
//! checksum computed on the way → fsync, rename, fsync dir → handoff →
//! report. Progress goes to a watch channel; every failure (and cancel)
//! drops the staging file, so the previous snapshot and the KV stay
//! untouched, and ends with a typed [`JobError`] in the sync's status.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::Blk3Error;
use crate::config::Config;
use crate::control::{self, pb};
use crate::handoff::{self, HandoffError, HandoffRecord};
use crate::install::{self, InstallError, Staging};
use crate::metrics::{unix_now, Metrics};
use crate::transport::tcp::{self, Link, TcpError};
use crate::transport::TransportKind;

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
            JobError::Cancelled | JobError::Transport(TcpError::Cancelled) => "cancelled",
            _ => "failed",
        }
    }
}

/// Everything one job needs.
pub struct JobContext {
    pub id: String,
    pub source: String,
    pub preference: pb::TransportPreference,
    pub config: Config,
    pub metrics: Arc<Metrics>,
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
        let result = attempt(&ctx).await;
        let transport = TransportKind::Tcp.as_str();
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

async fn attempt(ctx: &JobContext) -> Result<(), JobError> {
    let config = &ctx.config;
    let format = config.snapshot_format;
    let mut staging =
        Staging::create(&config.snapshot_dir, &ctx.id, format).map_err(JobError::NotWritable)?;

    // Negotiate.
    let channel = ctx
        .or_cancel(control::connect(&ctx.source, CONNECT_TIMEOUT))
        .await?
        .map_err(|e| JobError::Unreachable {
            source_addr: ctx.source.clone(),
            message: e,
        })?;
    let mut peer = pb::peer_client::PeerClient::new(channel);
    let request = pb::OpenFullSyncRequest {
        replica_node_id: config.node_id.clone(),
        transports: vec![pb::Transport::Tcp as i32],
        rdma_reachable: false,
        preference: ctx.preference as i32,
        format: format.as_str().to_string(),
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
        })?;
    let offer = offer.into_inner();
    let token: [u8; SESSION_TOKEN_LEN] =
        offer.session_token.as_slice().try_into().map_err(|_| {
            JobError::BadOffer(format!(
                "session token of {} bytes",
                offer.session_token.len()
            ))
        })?;
    if offer.format != format.as_str() {
        return Err(JobError::BadOffer(format!(
            "format {} but this agent installs {format}",
            offer.format
        )));
    }
    if offer.transport != pb::Transport::Tcp as i32 {
        return Err(JobError::BadOffer(format!(
            "transport {} is not available here",
            offer.transport
        )));
    }
    ctx.progress.send_modify(|p| {
        p.bytes_total = offer.snapshot_size;
        p.seq = offer.seq;
        p.transport = pb::Transport::Tcp as i32;
        p.phase = pb::Phase::Connecting as i32;
        p.detail = "tcp stream into staging file".into();
    });
    info!(session = %offer.session_id, size = offer.snapshot_size, seq = offer.seq, endpoint = %offer.data_endpoint, "offer received");

    // Connect the data plane.
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
            s.into_std()
                .and_then(|s| s.set_nonblocking(false).map(|_| s))
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
    let progress = ctx.progress.clone();
    let total = offer.snapshot_size;
    let mut transfer = tokio::task::spawn_blocking(move || {
        let report = move |done: u64| {
            let secs = bulk_started.elapsed().as_secs_f64().max(1e-6);
            progress.send_modify(|p| {
                p.bytes_done = done;
                p.throughput_bps = done as f64 / secs;
                if done == total {
                    p.phase = pb::Phase::Verifying as i32;
                }
            });
        };
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
    ctx.metrics
        .bulk_duration
        .observe(bulk_started.elapsed().as_secs_f64());
    ctx.metrics
        .fullsync_bytes
        .with_label_values(&["replica", "tcp"])
        .inc_by(staging.written());
    let outcome = match run.result {
        Err(TcpError::Cancelled) => return Err(JobError::Cancelled),
        Err(e) => return Err(e.into()),
        Ok(Err(Blk3Error::Checksum(reason))) => return Err(JobError::Checksum(reason)),
        Ok(Err(e)) => return Err(JobError::Protocol(e)),
        Ok(Ok(outcome)) => outcome,
    };
    let info = run.info.expect("a verified session has its snapshot info");
    if info.checksum != offer.checksum || info.seq != offer.seq {
        return Err(JobError::Checksum(format!(
            "verified snapshot (seq {}, checksum {:#x}) is not the offered one (seq {}, checksum {:#x})",
            info.seq, info.checksum, offer.seq, offer.checksum
        )));
    }
    if let crate::blk3::Outcome::Received { seq, .. } = outcome {
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
    let name = install::install_name(&offer.snapshot_name, info.seq, format);
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
        .or_cancel(handoff::hand_off(&config.handoff, &record))
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
