//! The orchestrator-facing service, served by every agent: start, watch and
//! cancel full syncs into this agent, read its status and its catalog.
//! Thin: requests are checked and handed to the sync manager and catalog.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status};

use crate::catalog::{Catalog, CatalogEntry};
use crate::rpc::{is_terminal, pb};
use crate::snapshot::Format;
use crate::sync::source::{DataEndpoints, SessionTable};
use crate::sync::SyncManager;

/// The orchestrator-facing service, with the handles it needs.
pub struct OrchestratorService {
    pub node_id: String,
    /// `transport.fallback_to_tcp`: whether a sync may ask for RDMA that
    /// this agent cannot do.
    pub fallback_to_tcp: bool,
    pub catalog: Arc<Catalog>,
    pub syncs: Arc<SyncManager>,
    /// Served sessions, for the status.
    pub sessions: Arc<SessionTable>,
    pub data: Arc<DataEndpoints>,
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

/// Catalog entry → wire form.
pub fn entry_to_pb(e: &CatalogEntry) -> pb::SnapshotEntry {
    pb::SnapshotEntry {
        path: e.path.display().to_string(),
        format: e.format().as_str().into(),
        size: e.info.size,
        seq: e.info.seq,
        mtime_unix_ms: (e.mtime_ns() / 1_000_000).max(0) as u64,
        checksum: e.info.checksum,
    }
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::SyncProgress, Status>> + Send>>;

#[tonic::async_trait]
impl pb::orchestrator_server::Orchestrator for OrchestratorService {
    async fn start_full_sync(
        &self,
        request: Request<pb::StartFullSyncRequest>,
    ) -> Result<Response<pb::StartFullSyncResponse>, Status> {
        let req = request.into_inner();
        let preference = pb::TransportPreference::try_from(req.transport).map_err(|_| {
            Status::invalid_argument(format!("unknown transport preference {}", req.transport))
        })?;
        let probe = &self.data.probe;
        if preference == pb::TransportPreference::Rdma
            && !probe.rdma_available
            && !self.fallback_to_tcp
        {
            return Err(Status::failed_precondition(format!(
                "rdma is not usable on this agent ({}); use tcp or auto, or set transport.fallback_to_tcp",
                probe.reason
            )));
        }
        let (sync_id, created) = self.syncs.start(&req.source, preference)?;
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
        // The current state first, then every change, ending after the
        // terminal state.
        let stream =
            futures::stream::unfold((rx, true, false), |(mut rx, first, ended)| async move {
                if ended || (!first && rx.changed().await.is_err()) {
                    return None;
                }
                let p = rx.borrow_and_update().clone();
                let end = is_terminal(p.phase);
                Some((Ok(p), (rx, false, end)))
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_status(
        &self,
        _: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::AgentStatus>, Status> {
        let (data, probe) = (&self.data, &self.data.probe);
        let latest_snapshots = [Format::Kvr1, Format::RedisRdb]
            .into_iter()
            .filter_map(|f| self.catalog.latest(f))
            .map(|e| entry_to_pb(&e))
            .collect();
        Ok(Response::new(pb::AgentStatus {
            node_id: self.node_id.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            latest_snapshots,
            running: self.syncs.running(),
            recent: self.syncs.recent(),
            serving_sessions: self.sessions.serving() as u32,
            transports: if data.rdma.is_some() {
                vec!["tcp".into(), format!("rdma ({})", probe.provider)]
            } else {
                vec!["tcp".into()]
            },
            rdma_available: probe.rdma_available,
            rdma_detail: probe.reason.clone(),
            data_tcp_endpoint: data.tcp.to_string(),
        }))
    }

    async fn list_snapshots(
        &self,
        _: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let snapshots = self.catalog.list().iter().map(|e| entry_to_pb(e)).collect();
        Ok(Response::new(pb::ListSnapshotsResponse { snapshots }))
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
