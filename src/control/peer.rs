//! The agent-to-agent service, served by every agent in its source role:
//! `OpenFullSync` checks a replica's request fields and hands it to the
//! source's offers (`sync::offer`, where every decision is), then sends the
//! offer back; `GetManifest` streams the offered snapshot's piece manifest;
//! `ReportResult` records how the session ended and releases its backlog
//! lease. Both name the session's instance, and a session of another
//! instance is refused. `OpenStream` answers a replica agent that follows
//! the replication stream, and `GetStreamSource` a peer that looks for the
//! agent following a new primary. This module only translates between the wire
//! and the domain.

use std::time::Duration;

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::ApiError;
use crate::config::TransportMode;
use crate::rpc::pb;
use crate::sync::offer::{Ask, Offered, Offers, StreamAnswer, StreamAsk};
use crate::sync::unix_ms;
use crate::transport::TransportKind;

/// Longest accepted format, provider or session id.
const MAX_NAME: usize = 64;
/// Most transports a replica can list (there are two).
const MAX_TRANSPORTS: usize = 4;

/// The field limits of an offer request, checked before anything else.
fn check_request(req: &pb::OpenFullSyncRequest) -> Result<(), ApiError> {
    let node = &req.replica_node_id;
    let problem = if !node.is_empty() && !crate::peer_text::is_plain_name(node) {
        format!(
            "replica_node_id must be a plain name: at most {} letters, digits, '.', '_' or '-'",
            crate::peer_text::MAX_NAME
        )
    } else if req.transports.len() > MAX_TRANSPORTS {
        format!(
            "at most {MAX_TRANSPORTS} transports, got {}",
            req.transports.len()
        )
    } else if req.format.len() > MAX_NAME
        || req.rdma_provider.len() > MAX_NAME
        || req.instance.len() > MAX_NAME
    {
        format!("format, rdma_provider and instance are names of at most {MAX_NAME} bytes")
    } else {
        return Ok(());
    };
    Err(ApiError::InvalidArgument(problem))
}

/// The agent-to-agent service: the source's offers and their sessions.
pub struct PeerService {
    pub offers: Offers,
}

/// A request as the source's offers take it.
fn ask_from_wire(req: pb::OpenFullSyncRequest) -> Result<Ask, ApiError> {
    let listed = |t: pb::Transport| req.transports.contains(&(t as i32));
    let snapshot = req
        .snapshot
        .map(TryInto::try_into)
        .transpose()
        .map_err(|e: crate::rpc::BadDigest| ApiError::InvalidArgument(e.to_string()))?;
    Ok(Ask {
        tcp: req.transports.is_empty() || listed(pb::Transport::Tcp),
        rdma: listed(pb::Transport::Rdma),
        preference: match pb::TransportPreference::try_from(req.preference) {
            Ok(pb::TransportPreference::Tcp) => Some(TransportMode::Tcp),
            Ok(pb::TransportPreference::Rdma) => Some(TransportMode::Rdma),
            _ => None,
        },
        snapshot,
        replica_node: req.replica_node_id,
        rdma_provider: req.rdma_provider,
        format: req.format,
        data_tls: req.data_tls,
        tcp_streams: req.tcp_streams,
        piece_queue: req.piece_queue,
        instance: req.instance,
        from_stream_log: req.from_stream_log,
    })
}

impl PeerService {
    /// The offer as the replica receives it.
    fn offer_message(&self, o: Offered) -> pb::SyncOffer {
        let (config, probe) = (&o.instance.config, self.offers.data.local_rdma.probe());
        let ttl = config.sync.session_token_ttl;
        let info = &o.entry.info;
        pb::SyncOffer {
            session_id: o.id,
            session_token: o.token.to_vec(),
            token_expires_unix_ms: unix_ms() + ttl.as_millis() as u64,
            format: config.snapshot_format.as_str().into(),
            snapshot_size: info.size,
            seq: info.seq,
            checksum: info.checksum,
            transport: match o.transport {
                TransportKind::Rdma => pb::Transport::Rdma,
                TransportKind::Tcp => pb::Transport::Tcp,
            } as i32,
            data_endpoint: o.endpoint.to_string(),
            rdma_provider: match o.transport {
                TransportKind::Rdma => probe.provider.to_string(),
                TransportKind::Tcp => String::new(),
            },
            rdma_device: probe.device.clone().unwrap_or_default(),
            backlog_bytes_left: o.backlog_bytes_left,
            source_node_id: config.node_id.clone(),
            snapshot_name: o.name,
            data_tls: o.tls,
            piece_size: o.entry.manifest.piece_size,
            manifest_digest: o.entry.manifest.digest().as_bytes().to_vec(),
            origin_node_id: o.origin.unwrap_or_default(),
            tcp_streams: o.streams,
            piece_queue: o.streams > 1,
            instance: o.instance.name.clone(),
        }
    }

    /// Checks that session `id` (if it is still offered) belongs to the
    /// instance a request names: a session proves nothing for another
    /// instance. Returns that instance's name.
    fn session_of(&self, id: &str, instance: &str) -> Result<String, Status> {
        if id.len() > MAX_NAME || instance.len() > MAX_NAME {
            return Err(ApiError::InvalidArgument(format!(
                "session_id and instance are at most {MAX_NAME} bytes"
            ))
            .into());
        }
        let named = self
            .offers
            .instances
            .resolve(instance)
            .map_err(|e| ApiError::InvalidArgument(e.to_string()))?
            .name
            .clone();
        match self.offers.sessions.offered(id) {
            Some((owner, _)) if owner != named => Err(ApiError::PermissionDenied(format!(
                "session {id} was not offered for instance {named:?}"
            ))
            .into()),
            _ => Ok(named),
        }
    }
}

/// Bytes per part of a streamed manifest.
const MANIFEST_PART: usize = 1 << 20;

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    async fn open_full_sync(
        &self,
        request: Request<pb::OpenFullSyncRequest>,
    ) -> Result<Response<pb::SyncOffer>, Status> {
        let (local, remote) = (request.local_addr(), request.remote_addr());
        let req = request.into_inner();
        check_request(&req)?;
        match self.offers.offer(&ask_from_wire(req)?, local, remote).await {
            Ok(offered) => Ok(Response::new(self.offer_message(offered))),
            Err(e) => {
                warn!(error = %e, "offer refused");
                Err(ApiError::from(e).into())
            }
        }
    }

    type GetManifestStream =
        futures::stream::Iter<std::vec::IntoIter<Result<pb::ManifestPart, Status>>>;

    async fn get_manifest(
        &self,
        request: Request<pb::GetManifestRequest>,
    ) -> Result<Response<Self::GetManifestStream>, Status> {
        let req = request.into_inner();
        self.session_of(&req.session_id, &req.instance)?;
        let (_, manifest) = self.offers.sessions.offered(&req.session_id).ok_or_else(|| {
            Status::not_found("no such offered session (it expired, or its data connection already began); ask for a new offer")
        })?;
        let parts: Vec<_> = manifest
            .encode()
            .chunks(MANIFEST_PART)
            .map(|c| Ok(pb::ManifestPart { data: c.to_vec() }))
            .collect();
        Ok(Response::new(futures::stream::iter(parts)))
    }

    async fn get_stream_source(
        &self,
        request: Request<pb::StreamSourceRequest>,
    ) -> Result<Response<pb::StreamSourceResponse>, Status> {
        let name = request.into_inner().instance;
        let (source, instance) = self.offers.stream_source(&name).map_err(ApiError::from)?;
        let r = crate::instance::failover::own_report(&instance.config, source).await;
        Ok(Response::new(pb::StreamSourceResponse {
            source: r.source,
            server: r.server,
            server_run_id: r.run_id,
        }))
    }

    async fn open_stream(
        &self,
        request: Request<pb::OpenStreamRequest>,
    ) -> Result<Response<pb::StreamOffer>, Status> {
        let (local, remote) = (request.local_addr(), request.remote_addr());
        let r = request.into_inner();
        let node = &r.replica_node_id;
        if (!node.is_empty() && !crate::peer_text::is_plain_name(node))
            || r.instance.len() > MAX_NAME
            || r.replid.len() > MAX_NAME
            || r.rdma_provider.len() > MAX_NAME
        {
            return Err(ApiError::InvalidArgument(format!(
                "replica_node_id must be a plain name; instance, replid and rdma_provider at most {MAX_NAME} bytes"
            ))
            .into());
        }
        let ask = StreamAsk {
            replica_node: r.replica_node_id,
            instance: r.instance,
            replid: r.replid,
            offset: r.offset,
            data_tls: r.data_tls,
            rdma_provider: r.rdma_provider,
        };
        let answer = self.offers.open_stream(&ask, local, remote).map_err(|e| {
            warn!(error = %e, "stream refused");
            Status::from(ApiError::from(e))
        })?;
        Ok(Response::new(match answer {
            StreamAnswer::Continue(o) => pb::StreamOffer {
                answer: pb::stream_offer::Answer::Continue as i32,
                session_id: o.id,
                session_token: o.token.to_vec(),
                stream_key: o.key.to_vec(),
                data_endpoint: o.endpoint.to_string(),
                data_tls: o.tls,
                replid: o.replid,
                offset: o.offset,
                window: o.window,
                rdma_endpoint: o.rdma_endpoint.map(|e| e.to_string()).unwrap_or_default(),
                ..Default::default()
            },
            StreamAnswer::TooOld {
                held,
                snapshot,
                diverged_at,
                current,
            } => {
                info!(replica = %ask.replica_node, replid = %crate::peer_text::escape_controls(&ask.replid), offset = ask.offset, %held, "stream asked from an offset the log does not hold");
                let continues = snapshot
                    .as_ref()
                    .and_then(|e| Some((e.info.repl_id.clone()?, e.info.seq)));
                let (replid, offset) = continues.unwrap_or_default();
                pb::StreamOffer {
                    answer: pb::stream_offer::Answer::TooOld as i32,
                    held,
                    snapshot: snapshot.map(|e| e.manifest.id().into()),
                    replid,
                    offset,
                    diverged_at: diverged_at.unwrap_or(0),
                    log_replid: current.as_ref().map(|c| c.0.clone()).unwrap_or_default(),
                    log_end: current.map_or(0, |c| c.1),
                    ..Default::default()
                }
            }
        }))
    }

    async fn report_result(
        &self,
        request: Request<pb::ReportResultRequest>,
    ) -> Result<Response<pb::ReportResultResponse>, Status> {
        let r = request.into_inner();
        let instance = self.session_of(&r.session_id, &r.instance)?;
        let backlog = self
            .offers
            .instances
            .resolve(&instance)
            .ok()
            .and_then(|i| i.backlog.clone());
        if let Some(guard) = &backlog {
            let handoff = Duration::from_millis(r.handoff_ms);
            guard.release(&r.session_id, r.ok.then_some(handoff)).await;
        }
        if r.ok {
            info!(session = %r.session_id, "replica reports success");
        } else {
            // A replica that will not use its offer gives it back at once.
            let withdrawn = self.offers.sessions.withdraw(&r.session_id);
            warn!(session = %r.session_id, withdrawn, error = %crate::peer_text::escape_controls(&r.error.chars().take(1024).collect::<String>()), "replica reports failure");
        }
        Ok(Response::new(pb::ReportResultResponse {}))
    }
}
