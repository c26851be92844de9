//! The agent-to-agent service, served by every agent in its source role:
//! `OpenFullSync` turns a replica's request into a session offer (holding the
//! snapshot in the cache from that moment) — of this agent's own snapshot,
//! or of one it relays from another agent — `GetManifest` streams the offered
//! snapshot's piece manifest, and `ReportResult` records how it ended. Which
//! bytes move, and how, is the data plane's business.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::ApiError;
use crate::config::{Config, DataTls};
use crate::kv::backlog::{BacklogGuard, Lease};
use crate::rpc::pb;
use crate::snapshot::{Format, SnapshotInfo};
use crate::store::cache::{CacheError, RelayFeed, SnapshotCache};
use crate::store::catalog::{Catalog, CatalogEntry};
use crate::store::served::{Served, SnapshotFile};
use crate::sync::relay::{is_snapshot, RelaySource, RelayTable};
use crate::sync::source::{replica_key, DataEndpoints, Offer, Refusal, SessionTable};
use crate::sync::{new_id, unix_ms};
use crate::transport::TransportKind;
use tokio_util::sync::CancellationToken;

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
    } else if req.format.len() > MAX_NAME || req.rdma_provider.len() > MAX_NAME {
        format!("format and rdma_provider are names of at most {MAX_NAME} bytes")
    } else {
        return Ok(());
    };
    Err(ApiError::InvalidArgument(problem))
}

/// The agent-to-agent service, with the handles it needs.
pub struct PeerService {
    pub config: Config,
    /// What this agent can offer.
    pub catalog: Arc<Catalog>,
    pub cache: Arc<SnapshotCache>,
    pub sessions: Arc<SessionTable>,
    pub data: Arc<DataEndpoints>,
    /// Cancelled when the agent starts draining: no new offers.
    pub draining: CancellationToken,
    /// What this agent relays from other agents.
    pub relays: Arc<RelayTable>,
    /// The local primary's backlog, when `[redis] primary_addr` is set.
    pub backlog: Option<Arc<BacklogGuard>>,
}

impl PeerService {
    /// For an RDB, when the local primary is configured: the backlog guard's
    /// lease for session `id` (refused with what to do when the backlog
    /// cannot hold M+1 through the seeding), and the slack it has now.
    async fn lease_backlog(
        &self,
        id: &str,
        info: &SnapshotInfo,
    ) -> Result<(Option<Lease>, u64), ApiError> {
        let Some(guard) = self
            .backlog
            .as_ref()
            .filter(|_| info.format == Format::RedisRdb)
        else {
            return Ok((None, 0));
        };
        match guard.lease(id, info).await {
            Ok((lease, p)) => {
                info!(
                    seq = info.seq,
                    backlog_bytes_left = p.backlog_bytes_left,
                    "redis pre-flight passed"
                );
                Ok((Some(lease), p.backlog_bytes_left))
            }
            Err(e @ crate::kv::redis::RedisError::Precondition(_)) => {
                Err(ApiError::FailedPrecondition(e.to_string()))
            }
            Err(e) => Err(ApiError::FailedPrecondition(format!(
                "cannot check the primary's replication backlog: {e}"
            ))),
        }
    }

    /// `local` is the address the replica reached us on, `remote` the
    /// replica's.
    async fn offer(
        &self,
        req: pb::OpenFullSyncRequest,
        local: Option<SocketAddr>,
        remote: Option<SocketAddr>,
    ) -> Result<pb::SyncOffer, ApiError> {
        let config = &self.config;
        let format = config.snapshot_format;
        check_request(&req)?;
        if !req.format.is_empty() && req.format != format.as_str() {
            return Err(ApiError::InvalidArgument(format!(
                "this source serves {format} snapshots, the replica asked for {:?}",
                req.format
            )));
        }
        let tls = data_tls(config, &req)?;
        let transport = choose_transport(&self.data, &req)?;
        let tls = tls && transport == TransportKind::Tcp;
        if self.draining.is_cancelled() {
            return Err(ApiError::Unavailable(
                "this source is shutting down; retry against it after its restart".into(),
            ));
        }
        let replica_key = replica_key(&req.replica_node_id, remote.map(|a| a.ip()));
        let admitted = self.sessions.admit(&replica_key).map_err(|refusal| {
            ApiError::Busy(match refusal {
                Refusal::Busy(limit) => format!(
                    "this source already serves {limit} sessions (sync.max_outgoing_syncs); retry in a few seconds"
                ),
                Refusal::ReplicaBusy(limit) => format!(
                    "replica {replica_key} already holds {limit} sessions of this source (sync.max_sessions_per_replica); retry when one has ended"
                ),
            })
        })?;
        let mut chosen = self.choose(format, req.snapshot.as_ref())?;
        let id = new_id();
        let (backlog, backlog_bytes_left) = self.lease_backlog(&id, &chosen.entry.info).await?;
        let snapshot = self.hold(&mut chosen, transport).await?;
        let ttl = config.sync.session_token_ttl;
        let replica = if req.replica_node_id.is_empty() {
            "unnamed".to_string()
        } else {
            req.replica_node_id.clone()
        };
        let streams = crate::sync::streams::granted(transport, req.tcp_streams);
        let offer = Offer {
            id: id.clone(),
            replica,
            entry: chosen.entry.clone(),
            snapshot,
            transport,
            tls,
            expires: Instant::now() + ttl,
            origin: chosen.origin.clone(),
            backlog,
            streams,
        };
        let token = self.sessions.insert(offer, admitted);
        let endpoint = match (transport, self.data.rdma_endpoint()) {
            (TransportKind::Rdma, Some(rdma)) => rdma,
            _ => advertised(self.data.tcp, local),
        };
        info!(session = %id, replica = %req.replica_node_id, path = %chosen.entry.path.display(), seq = chosen.entry.info.seq, transport = transport.as_str(), tls, streams, %endpoint, relayed_from = ?chosen.origin, "offered snapshot");
        Ok(self.offer_message(
            id,
            token,
            &chosen,
            (transport, tls, streams),
            endpoint,
            backlog_bytes_left,
        ))
    }

    /// The snapshot to offer: `want`, or the newest (this agent's own, or
    /// one it relays, whichever is newer).
    fn choose(&self, format: Format, want: Option<&pb::SnapshotId>) -> Result<Chosen, ApiError> {
        let own = match want {
            Some(id) => self
                .catalog
                .list()
                .into_iter()
                .filter(|e| e.format() == format && is_snapshot(&e.info, id))
                .max_by_key(|e| e.mtime),
            None => self.catalog.latest(format),
        };
        // A relayed snapshot keeps its origin even once installed here (the
        // watcher then lists it too), so that partial syncs resume across
        // relays.
        let relayed = self.relays.find(format, want).filter(|r| {
            own.as_ref()
                .is_none_or(|e| r.manifest.info.seq >= e.info.seq)
        });
        let Some(relayed) = relayed else {
            let entry = own.ok_or_else(|| match want {
                Some(id) => ApiError::NoSnapshot(format!(
                    "this agent does not have {format} snapshot seq {} ({} bytes, checksum {:#x}), or no longer: it was superseded",
                    id.seq, id.size, id.checksum
                )),
                None => ApiError::NoSnapshot(format!(
                    "no valid {format} snapshot in {} yet; save one on the primary first",
                    self.config.snapshot_dir.display()
                )),
            })?;
            let name = entry
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            return Ok(Chosen {
                entry,
                name,
                origin: None,
                feed: None,
            });
        };
        let (entry, feed) = match relayed.source {
            RelaySource::Feed(feed) => {
                let entry = CatalogEntry {
                    path: feed.path.clone(),
                    mtime: std::time::SystemTime::UNIX_EPOCH,
                    info: relayed.manifest.info.clone(),
                    manifest: relayed.manifest.clone(),
                };
                (entry, Some(feed))
            }
            RelaySource::File(entry) => (entry, None),
        };
        Ok(Chosen {
            entry: Arc::new(entry),
            name: relayed.name,
            origin: Some(relayed.origin),
            feed,
        })
    }

    /// Holds the chosen snapshot's bytes for a session over `transport`:
    /// a TCP session of a file on disk sends the file itself (the kernel's
    /// page cache is the shared copy); RDMA and a relay still receiving
    /// take a reference in the cache (loading it, or starting its relay
    /// image). A relayed file that changed is no longer relayed.
    async fn hold(
        &self,
        chosen: &mut Chosen,
        transport: TransportKind,
    ) -> Result<Served, ApiError> {
        let held = match chosen.feed.take() {
            Some(feed) => self.cache.acquire_relay(feed).await.map(Served::Image),
            None if transport == TransportKind::Tcp => {
                SnapshotFile::open(&chosen.entry).map(Served::File)
            }
            None => self.cache.acquire(&chosen.entry).await.map(Served::Image),
        };
        if let (Err(CacheError::Changed { .. }), Some(_)) = (&held, &chosen.origin) {
            self.relays.withdraw(&chosen.entry.info);
        }
        Ok(held?)
    }

    /// The offer as the replica receives it.
    fn offer_message(
        &self,
        id: String,
        token: [u8; crate::blk3::token::SESSION_TOKEN_LEN],
        chosen: &Chosen,
        (transport, tls, streams): (TransportKind, bool, u32),
        endpoint: SocketAddr,
        backlog_bytes_left: u64,
    ) -> pb::SyncOffer {
        let (config, format) = (&self.config, self.config.snapshot_format);
        let ttl = config.sync.session_token_ttl;
        let entry = &chosen.entry;
        pb::SyncOffer {
            session_id: id,
            session_token: token.to_vec(),
            token_expires_unix_ms: unix_ms() + ttl.as_millis() as u64,
            format: format.as_str().into(),
            snapshot_size: entry.info.size,
            seq: entry.info.seq,
            checksum: entry.info.checksum,
            transport: match transport {
                TransportKind::Rdma => pb::Transport::Rdma,
                TransportKind::Tcp => pb::Transport::Tcp,
            } as i32,
            data_endpoint: endpoint.to_string(),
            rdma_provider: match transport {
                TransportKind::Rdma => self.data.local_rdma.probe().provider.to_string(),
                TransportKind::Tcp => String::new(),
            },
            rdma_device: self
                .data
                .local_rdma
                .probe()
                .device
                .clone()
                .unwrap_or_default(),
            backlog_bytes_left,
            source_node_id: config.node_id.clone(),
            snapshot_name: chosen.name.clone(),
            data_tls: tls,
            piece_size: entry.manifest.piece_size,
            manifest_digest: entry.manifest.digest(),
            origin_node_id: chosen.origin.clone().unwrap_or_default(),
            tcp_streams: streams,
        }
    }
}

/// The snapshot an offer is for.
struct Chosen {
    entry: Arc<CatalogEntry>,
    /// Its file name at its origin.
    name: String,
    /// The agent that made it, when this agent relays it.
    origin: Option<String>,
    /// Its relay image's source, while this agent still receives it.
    feed: Option<RelayFeed>,
}

/// Bytes per part of a streamed manifest.
const MANIFEST_PART: usize = 1 << 20;

/// Whether the TCP data path is encrypted: when both ends can. A source
/// that requires it refuses a replica that cannot.
fn data_tls(config: &Config, req: &pb::OpenFullSyncRequest) -> Result<bool, ApiError> {
    if config.data.tls == DataTls::Required && !req.data_tls {
        return Err(ApiError::FailedPrecondition(
            "this source requires an encrypted data plane ([data] tls = \"required\"); give the replica a [tls] configuration with the fleet's CA".into(),
        ));
    }
    Ok(config.data_tls() && req.data_tls)
}

/// RDMA when both sides can and the replica did not ask for TCP; TCP
/// otherwise. A replica that requires RDMA is told why it cannot have it.
fn choose_transport(
    data: &DataEndpoints,
    req: &pb::OpenFullSyncRequest,
) -> Result<TransportKind, ApiError> {
    let probe = data.local_rdma.probe();
    let offers =
        |t: pb::Transport| req.transports.is_empty() || req.transports.contains(&(t as i32));
    let asked_rdma = offers(pb::Transport::Rdma) && !req.transports.is_empty();
    let preference = req.preference;
    let why_not = if !asked_rdma || preference == pb::TransportPreference::Tcp as i32 {
        Some("the replica did not ask for it".to_string())
    } else if data.rdma_endpoint().is_none() {
        Some(data.local_rdma.reason())
    } else if req.rdma_provider != probe.provider.as_str() {
        Some(format!(
            "this source uses the {} rdma provider, the replica {:?}",
            probe.provider, req.rdma_provider
        ))
    } else {
        None
    };
    match why_not {
        None => Ok(TransportKind::Rdma),
        Some(why) if preference == pb::TransportPreference::Rdma as i32 => {
            Err(ApiError::FailedPrecondition(format!(
                "rdma required but this source cannot serve it: {why}"
            )))
        }
        Some(_) if offers(pb::Transport::Tcp) => Ok(TransportKind::Tcp),
        Some(why) => Err(ApiError::FailedPrecondition(format!(
            "no transport in common: the replica offers no tcp and rdma is not possible ({why})"
        ))),
    }
}

/// The data address a replica should dial: the listener's, or — when it is
/// bound to a wildcard — the address the replica reached us on.
fn advertised(data: SocketAddr, local: Option<SocketAddr>) -> SocketAddr {
    match local {
        Some(l) if data.ip().is_unspecified() => SocketAddr::new(l.ip(), data.port()),
        _ => data,
    }
}

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    async fn open_full_sync(
        &self,
        request: Request<pb::OpenFullSyncRequest>,
    ) -> Result<Response<pb::SyncOffer>, Status> {
        let (local, remote) = (request.local_addr(), request.remote_addr());
        let req = request.into_inner();
        match self.offer(req, local, remote).await {
            Ok(offer) => Ok(Response::new(offer)),
            Err(e) => {
                warn!(error = %e, "offer refused");
                Err(e.into())
            }
        }
    }

    type GetManifestStream =
        futures::stream::Iter<std::vec::IntoIter<Result<pb::ManifestPart, Status>>>;

    async fn get_manifest(
        &self,
        request: Request<pb::GetManifestRequest>,
    ) -> Result<Response<Self::GetManifestStream>, Status> {
        let id = request.into_inner().session_id;
        if id.len() > MAX_NAME {
            return Err(ApiError::InvalidArgument(format!(
                "session_id longer than {MAX_NAME} bytes"
            ))
            .into());
        }
        let manifest = self.sessions.manifest(&id).ok_or_else(|| {
            Status::not_found("no such offered session (it expired, or its data connection already began); ask for a new offer")
        })?;
        let parts: Vec<_> = manifest
            .encode()
            .chunks(MANIFEST_PART)
            .map(|c| Ok(pb::ManifestPart { data: c.to_vec() }))
            .collect();
        Ok(Response::new(futures::stream::iter(parts)))
    }

    async fn report_result(
        &self,
        request: Request<pb::ReportResultRequest>,
    ) -> Result<Response<pb::ReportResultResponse>, Status> {
        let r = request.into_inner();
        if r.session_id.len() > MAX_NAME {
            return Err(ApiError::InvalidArgument(format!(
                "session_id longer than {MAX_NAME} bytes"
            ))
            .into());
        }
        if let Some(guard) = &self.backlog {
            let handoff = Duration::from_millis(r.handoff_ms);
            guard.release(&r.session_id, r.ok.then_some(handoff)).await;
        }
        if r.ok {
            info!(session = %r.session_id, "replica reports success");
        } else {
            // A replica that will not use its offer gives it back at once.
            let withdrawn = self.sessions.withdraw(&r.session_id);
            warn!(session = %r.session_id, withdrawn, error = %crate::peer_text::escape_controls(&r.error.chars().take(1024).collect::<String>()), "replica reports failure");
        }
        Ok(Response::new(pb::ReportResultResponse {}))
    }
}
