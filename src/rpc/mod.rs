//! gRPC plumbing that both ends of the control plane share: the generated
//! `kvsync.v1` types ([`pb`]) with a few helpers to name their enums,
//! bearer tokens ([`auth`]), TLS settings ([`tls`]) and how a process
//! reaches an agent ([`dial`]), and connections counted in total and per
//! address ([`conn_limit`]). The services themselves live in `control`;
//! this module knows nothing of syncs, catalogs or caches.

pub mod auth;
pub mod conn_limit;
pub mod dial;
pub mod tls;

pub use dial::{AgentChannel, Dialer};

/// Generated protobuf and gRPC code.
pub mod pb {
    tonic::include_proto!("kvsync.v1");

    /// Encoded descriptors, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/kvsync_descriptor.bin"));
}

/// Maps a phase to its lowercase name for humans.
pub fn phase_name(phase: i32) -> &'static str {
    match pb::Phase::try_from(phase).unwrap_or(pb::Phase::Unspecified) {
        pb::Phase::Unspecified => "unknown",
        pb::Phase::Negotiating => "negotiating",
        pb::Phase::Connecting => "connecting",
        pb::Phase::Transferring => "transferring",
        pb::Phase::Verifying => "verifying",
        pb::Phase::Installing => "installing",
        pb::Phase::HandingOff => "handing off",
        pb::Phase::Succeeded => "succeeded",
        pb::Phase::Failed => "failed",
        pb::Phase::Cancelled => "cancelled",
    }
}

/// True for the phases a sync ends in.
pub fn is_terminal(phase: i32) -> bool {
    [
        pb::Phase::Succeeded as i32,
        pb::Phase::Failed as i32,
        pb::Phase::Cancelled as i32,
    ]
    .contains(&phase)
}

/// Transport label for humans and JSON.
pub fn transport_name(t: i32) -> &'static str {
    match pb::Transport::try_from(t).unwrap_or(pb::Transport::Unspecified) {
        pb::Transport::Tcp => "tcp",
        pb::Transport::Rdma => "rdma",
        pb::Transport::Unspecified => "",
    }
}

impl From<crate::snapshot::SnapshotId> for pb::SnapshotId {
    fn from(id: crate::snapshot::SnapshotId) -> pb::SnapshotId {
        pb::SnapshotId {
            size: id.size,
            seq: id.seq,
            checksum: id.checksum,
            manifest_digest: id.digest.map_or(Vec::new(), |d| d.as_bytes().to_vec()),
        }
    }
}

/// A manifest digest on the wire that is not 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a manifest digest is 32 bytes (BLAKE3), not {0}")]
pub struct BadDigest(pub usize);

/// A digest field: empty for none, else exactly 32 bytes.
pub fn digest_from_wire(bytes: &[u8]) -> Result<Option<blake3::Hash>, BadDigest> {
    match bytes.len() {
        0 => Ok(None),
        32 => Ok(Some(blake3::Hash::from_bytes(
            bytes.try_into().expect("32 bytes"),
        ))),
        n => Err(BadDigest(n)),
    }
}

impl TryFrom<pb::SnapshotId> for crate::snapshot::SnapshotId {
    type Error = BadDigest;
    fn try_from(id: pb::SnapshotId) -> Result<crate::snapshot::SnapshotId, BadDigest> {
        Ok(crate::snapshot::SnapshotId {
            size: id.size,
            seq: id.seq,
            checksum: id.checksum,
            digest: digest_from_wire(&id.manifest_digest)?,
        })
    }
}
