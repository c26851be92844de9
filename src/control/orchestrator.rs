//! The orchestrator-facing service, served by every agent: start, watch and
//! cancel full syncs into this agent, start and watch fan-outs of its
//! snapshot to many replicas, read its status and its catalog, each for
//! the instance a request names. Thin: requests are checked and handed to
//! the sync manager, the fan-out manager and the instance's catalog.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status};

use crate::config::TransportMode;
use crate::fanout::FanoutManager;
use crate::instance::failover::{self, FailoverError};
use crate::instance::{Instance, Instances};
use crate::rpc::auth::ClientAuth;
use crate::rpc::{is_terminal, pb};
use crate::snapshot::Format;
use crate::store::catalog::CatalogEntry;
use crate::stream::feed::FeedHandle;
use crate::stream::hand::{self, HandError};
use crate::stream::source::{ChainError, Source};
use crate::stream::{Downstream, SharedLog};
use crate::sync::serve::{DataEndpoints, SessionTable};
use crate::sync::{Pull, SyncManager};

/// The orchestrator-facing service, with the handles it needs.
pub struct OrchestratorService {
    pub node_id: String,
    /// `transport.fallback_to_tcp`: whether a sync may ask for RDMA that
    /// this agent cannot do.
    pub fallback_to_tcp: bool,
    /// The instances whose snapshots and syncs requests name.
    pub instances: Arc<Instances>,
    pub syncs: Arc<SyncManager>,
    /// Served sessions, for the status.
    pub sessions: Arc<SessionTable>,
    pub data: Arc<DataEndpoints>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The fan-outs this agent runs as their origin.
    pub fanouts: Arc<FanoutManager>,
    /// Dials the peers a failover asks what they follow.
    pub dialer: crate::rpc::dial::Dialer,
}

impl OrchestratorService {
    /// The instance a request names ([`Instances::resolve`]).
    fn instance(&self, name: &str) -> Result<Arc<Instance>, Status> {
        self.instances
            .resolve(name)
            .map_err(|e| Status::invalid_argument(e.to_string()))
    }

    /// The instance a request names, with its stream feed and log; an
    /// instance that does not feed its server from a log is refused.
    fn fed(&self, name: &str) -> Result<(Arc<Instance>, FeedHandle, SharedLog), Status> {
        let i = self.instance(name)?;
        let fed = i.config.handoff.mode == crate::config::HandoffMode::RedisStream;
        match (i.feed.clone().filter(|_| fed), i.stream.clone()) {
            (Some(feed), Some(stream)) => Ok((i, feed, stream)),
            _ => Err(Status::failed_precondition(format!(
                "instance {} does not feed its server from a stream log ([handoff] mode = \"redis-stream\" with [stream] dir)",
                i.name
            ))),
        }
    }

    /// Releases the server of the instance `req` names to its primary, or
    /// attaches it back to the stream log (`stream::hand`).
    async fn hand(
        &self,
        req: pb::HandStreamRequest,
        release: bool,
    ) -> Result<Response<pb::HandStreamResponse>, Status> {
        let (i, feed, stream) = self.fed(&req.instance)?;
        let (redis, timeout) = (&i.config.redis, i.config.handoff.timeout);
        let done = match release {
            true => {
                let ask = failover::peer_asker(self.dialer.clone(), &i, None);
                hand::release(&i.config, req.primary.trim(), ask, &feed, &stream).await
            }
            false => hand::attach(redis, timeout, &feed, &stream).await,
        };
        done.map(|message| Response::new(pb::HandStreamResponse { message }))
            .map_err(|e| match e {
                HandError::Unproved(_) | HandError::NotTheServer { .. } => {
                    Status::permission_denied(e.to_string())
                }
                _ => Status::failed_precondition(e.to_string()),
            })
    }

    /// What one instance holds and does now.
    fn instance_status(&self, i: &Instance) -> pb::InstanceStatus {
        let health = i.health();
        pb::InstanceStatus {
            health: health.verdict.as_str().into(),
            health_reason: health.reason,
            primary_addr: i.config.redis.primary_addr.clone(),
            primary: i.config.redis.primary.clone(),
            name: i.name.clone(),
            snapshot_dir: i.config.snapshot_dir.display().to_string(),
            format: i.config.snapshot_format.as_str().into(),
            handoff: i.config.handoff.mode.as_str().into(),
            latest_snapshots: [Format::Kvr1, Format::RedisRdb]
                .into_iter()
                .filter_map(|f| i.catalog.latest(f))
                .map(|e| entry_to_pb(&i.name, &e))
                .collect(),
            running: self.syncs.running(&i.name),
            recent: self.syncs.recent(&i.name),
            relaying: i.relays.list(&i.name),
            relay_bytes: self.metrics.relay_bytes.with_label_values(&[&i.name]).get(),
            warnings: i.backlog.as_ref().map(|b| b.warnings()).unwrap_or_default(),
            stream: i.stream.as_ref().map(|s| {
                let (replid, first, end, synced, bytes) = s.view(|log| {
                    let (replid, end) = log.position().unwrap_or_default();
                    (
                        replid,
                        log.first().unwrap_or(end),
                        end,
                        log.synced(),
                        log.bytes(),
                    )
                });
                pb::StreamStatus {
                    source: s.source().to_string(),
                    state: s.state().to_string(),
                    replid,
                    first_offset: first,
                    end_offset: end,
                    synced_offset: synced,
                    log_bytes: bytes,
                    serving: self
                        .metrics
                        .stream_sessions
                        .with_label_values(&[&i.name, "source"])
                        .get() as u32,
                    fed_offset: s.acked_by(&Downstream::Server).unwrap_or(0),
                    downstreams: s
                        .downstreams()
                        .into_iter()
                        .map(|(d, offset)| pb::StreamDownstream {
                            name: d.to_string(),
                            offset,
                        })
                        .collect(),
                    ack: match s.source() {
                        Source::Primary(_) => i.config.stream.ack.name().to_string(),
                        Source::Agents(_) => String::new(),
                    },
                    lagging: s.lagging().iter().map(ToString::to_string).collect(),
                    acked_offset: s.upstream_acked(),
                    damaged: s.damaged(),
                    upstreams: i.upstreams.as_ref().map(|u| u.chain()).unwrap_or_default(),
                    reconnects: ["primary", "agent"]
                        .iter()
                        .map(|source| {
                            self.metrics
                                .stream_reconnects
                                .with_label_values(&[i.name.as_str(), source])
                                .get()
                        })
                        .sum(),
                    write_safety: s.write_safety(),
                    diverged: s.diverged(),
                    sentinels: s.sentinels(),
                    cluster: s.cluster(),
                    integrity: crate::stream::serve::integrity(i.config.tls.enabled()).into(),
                    behind_seconds: s.behind().as_secs_f64(),
                    set_aside: s.view(|l| {
                        l.set_aside()
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect()
                    }),
                    mending: s.view(|l| {
                        l.damaged()
                            .iter()
                            .map(|d| format!("offsets {}..{}", d.offset, d.end()))
                            .collect()
                    }),
                }
            }),
        }
    }
}

/// Longest accepted sync id.
const MAX_ID: usize = 64;

fn check_id(id: &str) -> Result<(), Status> {
    if id.is_empty() || id.len() > MAX_ID || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(Status::invalid_argument(format!(
            "sync_id must be 1..={MAX_ID} letters and digits, as StartFullSync returned it"
        )));
    }
    Ok(())
}

/// A request's transport preference, if it is one.
fn preference(t: i32) -> Result<pb::TransportPreference, Status> {
    pb::TransportPreference::try_from(t)
        .map_err(|_| Status::invalid_argument(format!("unknown transport preference {t}")))
}

/// A request's preference as the job's plan takes it (`None`: the agent's
/// configured mode).
fn asked_mode(p: pb::TransportPreference) -> Option<TransportMode> {
    match p {
        pb::TransportPreference::Tcp => Some(TransportMode::Tcp),
        pb::TransportPreference::Rdma => Some(TransportMode::Rdma),
        pb::TransportPreference::Auto => None,
    }
}

/// Instance `instance`'s catalog entry → wire form.
fn entry_to_pb(instance: &str, e: &CatalogEntry) -> pb::SnapshotEntry {
    pb::SnapshotEntry {
        instance: instance.to_string(),
        path: e.path.display().to_string(),
        format: e.format().as_str().into(),
        size: e.info.size,
        seq: e.info.seq,
        mtime_unix_ms: (e.mtime_ns() / 1_000_000).max(0) as u64,
        checksum: e.info.checksum,
        manifest_digest: e.manifest.digest().as_bytes().to_vec(),
    }
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::SyncProgress, Status>> + Send>>;
type FanoutStream = Pin<Box<dyn Stream<Item = Result<pb::FanoutStatus, Status>> + Send>>;

/// A watched value as a stream: the current state first, then every
/// change, ending after the state `last` says is the final one.
fn follow<T: Clone + Send + Sync + 'static>(
    rx: tokio::sync::watch::Receiver<T>,
    last: fn(&T) -> bool,
) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
    Box::pin(futures::stream::unfold(
        (rx, true, false),
        move |(mut rx, first, ended)| async move {
            if ended || (!first && rx.changed().await.is_err()) {
                return None;
            }
            let v = rx.borrow_and_update().clone();
            let end = last(&v);
            Some((Ok(v), (rx, false, end)))
        },
    ))
}

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for OrchestratorService {
    async fn start_full_sync(
        &self,
        request: Request<pb::StartFullSyncRequest>,
    ) -> Result<Response<pb::StartFullSyncResponse>, Status> {
        let req = request.into_inner();
        let preference = preference(req.transport)?;
        let rdma = &self.data.local_rdma;
        if preference == pb::TransportPreference::Rdma && !rdma.available() && !self.fallback_to_tcp
        {
            return Err(Status::failed_precondition(format!(
                "rdma is not usable on this agent ({}); use tcp or auto, or set transport.fallback_to_tcp",
                rdma.reason()
            )));
        }
        let instance = self.instance(&req.instance)?;
        let source_instance = match req.source_instance.as_str() {
            "" => req.instance.clone(),
            named => named.to_string(),
        };
        let (sync_id, created) =
            self.syncs.start(
                &instance,
                Pull {
                    source: req.source,
                    upstream: req.upstream,
                    want: req.snapshot.map(TryInto::try_into).transpose().map_err(
                        |e: crate::rpc::BadDigest| Status::invalid_argument(e.to_string()),
                    )?,
                    mode: asked_mode(preference),
                    source_instance,
                },
            )?;
        Ok(Response::new(pb::StartFullSyncResponse {
            sync_id,
            created,
        }))
    }

    type WatchSyncStream = ProgressStream;

    async fn watch_sync(
        &self,
        request: Request<pb::WatchSyncRequest>,
    ) -> Result<Response<ProgressStream>, Status> {
        let id = request.into_inner().sync_id;
        check_id(&id)?;
        let rx = self.syncs.watch(&id)?;
        Ok(Response::new(follow(rx, |p| is_terminal(p.phase))))
    }

    async fn start_fanout(
        &self,
        request: Request<pb::StartFanoutRequest>,
    ) -> Result<Response<pb::StartFanoutResponse>, Status> {
        let auth = ClientAuth::of(&request);
        let local = request.local_addr();
        let req = request.into_inner();
        let transport = preference(req.transport)?;
        // Unless told otherwise, replicas reach the origin where the caller did.
        let origin = match (req.origin.trim(), local) {
            ("", Some(local)) => local.to_string(),
            (origin, _) => origin.to_string(),
        };
        let fanout_id = self.fanouts.start(crate::fanout::Request {
            origin,
            replicas: req.replicas.iter().map(|r| r.trim().to_string()).collect(),
            degree: req.degree,
            transport,
            auth,
            instance: req.instance,
            stream: req.stream,
        })?;
        Ok(Response::new(pb::StartFanoutResponse { fanout_id }))
    }

    type WatchFanoutStream = FanoutStream;

    async fn watch_fanout(
        &self,
        request: Request<pb::WatchFanoutRequest>,
    ) -> Result<Response<FanoutStream>, Status> {
        let id = request.into_inner().fanout_id;
        check_id(&id)?;
        let rx = self.fanouts.watch(&id)?;
        Ok(Response::new(follow(rx, |s| s.done)))
    }

    async fn get_status(
        &self,
        request: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::AgentStatus>, Status> {
        let (data, rdma) = (&self.data, &self.data.local_rdma);
        let named = request.into_inner().instance;
        let instances: Vec<pb::InstanceStatus> = match named.as_str() {
            "" => self.instances.all(),
            name => vec![self.instance(name)?],
        }
        .iter()
        .map(|i| self.instance_status(i))
        .collect();
        let syncs = |f: fn(&pb::InstanceStatus) -> &Vec<pb::SyncProgress>| {
            instances.iter().flat_map(f).cloned().collect::<Vec<_>>()
        };
        let mut recent = syncs(|i| &i.recent);
        recent.sort_by_key(|p| std::cmp::Reverse(p.started_unix_ms));
        Ok(Response::new(pb::AgentStatus {
            node_id: self.node_id.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            latest_snapshots: instances
                .iter()
                .flat_map(|i| i.latest_snapshots.clone())
                .collect(),
            running: syncs(|i| &i.running),
            recent,
            serving_sessions: self.sessions.serving() as u32,
            admitted_sessions: self.sessions.admitted() as u32,
            transports: if data.rdma_endpoint().is_some() {
                vec!["tcp".into(), format!("rdma ({})", rdma.probe().provider)]
            } else {
                vec!["tcp".into()]
            },
            rdma_available: rdma.available(),
            rdma_detail: rdma.reason(),
            data_tcp_endpoint: data.tcp.to_string(),
            data_tls: data.tls.clone(),
            relaying: instances.iter().flat_map(|i| i.relaying.clone()).collect(),
            relay_bytes: instances.iter().map(|i| i.relay_bytes).sum(),
            warnings: instances
                .iter()
                .flat_map(|i| i.warnings.iter().map(|w| format!("{}: {w}", i.name)))
                .collect(),
            instances,
        }))
    }

    async fn list_snapshots(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let instance = self.instance(&request.into_inner().instance)?;
        let snapshots = instance
            .catalog
            .list()
            .iter()
            .map(|e| entry_to_pb(&instance.name, e))
            .collect();
        let rejected = instance
            .catalog
            .rejected()
            .into_iter()
            .map(|(path, reason)| pb::RejectedSnapshot {
                path: path.display().to_string(),
                reason,
            })
            .collect();
        Ok(Response::new(pb::ListSnapshotsResponse {
            snapshots,
            rejected,
        }))
    }

    async fn release_stream(
        &self,
        request: Request<pb::HandStreamRequest>,
    ) -> Result<Response<pb::HandStreamResponse>, Status> {
        self.hand(request.into_inner(), true).await
    }

    async fn attach_stream(
        &self,
        request: Request<pb::HandStreamRequest>,
    ) -> Result<Response<pb::HandStreamResponse>, Status> {
        self.hand(request.into_inner(), false).await
    }

    async fn set_stream_upstream(
        &self,
        request: Request<pb::SetStreamUpstreamRequest>,
    ) -> Result<Response<pb::SetStreamUpstreamResponse>, Status> {
        let req = request.into_inner();
        let i = self.instance(&req.instance)?;
        let upstreams = i
            .upstreams
            .as_ref()
            .filter(|u| !u.chain().is_empty())
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "instance {}'s stream log does not follow agents ([stream] dir and upstream); after a failover, `kvsync stream follow` names its new primary",
                    i.name
                ))
            })?;
        let chain = req.upstreams.iter().map(|u| u.trim().to_string()).collect();
        upstreams
            .set(chain, &i.config.sync.allowed_sources)
            .map_err(|e| match e {
                ChainError::Keep { .. } => Status::internal(e.to_string()),
                _ => Status::invalid_argument(e.to_string()),
            })?;
        tracing::info!(instance = %i.name, chain = ?upstreams.chain(), "the stream log follows a new chain of upstreams");
        Ok(Response::new(pb::SetStreamUpstreamResponse {}))
    }

    async fn follow_primary(
        &self,
        request: Request<pb::FollowPrimaryRequest>,
    ) -> Result<Response<pb::FollowPrimaryResponse>, Status> {
        let auth = ClientAuth::of(&request);
        let req = request.into_inner();
        let i = self.instance(&req.instance)?;
        let ask = failover::peer_asker(self.dialer.clone(), &i, Some(auth));
        let followed = failover::follow_primary(&i, &req.primary, &req.peers, ask)
            .await
            .map_err(|e| match e {
                FailoverError::NotAnAddress(_) => Status::invalid_argument(e.to_string()),
                FailoverError::Unproved(_) | FailoverError::NotTheServer { .. } => {
                    Status::permission_denied(e.to_string())
                }
                FailoverError::Source(ChainError::Keep { .. }) => Status::internal(e.to_string()),
                _ => Status::failed_precondition(e.to_string()),
            })?;
        let source = followed.source.to_string();
        tracing::info!(instance = %i.name, primary = %req.primary, %source, local_server = ?followed.local_server, "a failover: the stream log follows the new primary");
        Ok(Response::new(pb::FollowPrimaryResponse {
            source,
            local_server: followed.local_server.unwrap_or_default(),
        }))
    }

    async fn cancel_sync(
        &self,
        request: Request<pb::CancelSyncRequest>,
    ) -> Result<Response<pb::CancelSyncResponse>, Status> {
        let id = request.into_inner().sync_id;
        check_id(&id)?;
        let cancelled = self.syncs.cancel(&id)?;
        Ok(Response::new(pb::CancelSyncResponse { cancelled }))
    }
}
