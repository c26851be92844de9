//! `[data]` and `[transport]`: the data plane (its listener, TLS, TCP
//! streams) and the transport's choice and tuning (RDMA provider, BLK3
//! bulk phase); and their checks.

use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use super::{Config, Problems};
use crate::blk3::plan::MAX_CHUNK_MB;

/// Data plane settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct DataConfig {
    /// Address of the TCP data listener (`host:port`).
    pub tcp_listen: String,
    /// Port of the RDMA listener, bound to the chosen interface address
    /// (never a wildcard); 0 picks a free port.
    pub rdma_port: u16,
    /// A data connection whose peer stops answering (link cut, host gone)
    /// fails after this long.
    #[serde(with = "humantime_serde")]
    pub peer_timeout: Duration,
    /// The least a bulk transfer must move per second, averaged over
    /// `min_rate_window`, or the session ends (`0` turns the floor off).
    pub min_rate: ByteSize,
    #[serde(with = "humantime_serde")]
    pub min_rate_window: Duration,
    /// How long a new data connection may take to prove its session; until
    /// it has, it holds no thread and no memory beyond its socket.
    #[serde(with = "humantime_serde")]
    pub hello_timeout: Duration,
    /// Data connections still proving their session, at most, in total and
    /// from one address; more are closed at once.
    pub max_pending_connections: usize,
    pub max_pending_per_peer: usize,
    /// TLS on the TCP data path (with the `[tls]` files).
    pub tls: DataTls,
    /// After rustls's handshake, hand the records to the kernel (kTLS)
    /// where it has the `tls` module: the source then sends with
    /// `sendfile` as without TLS, and the replica reads decrypted bytes.
    pub kernel_tls: bool,
    /// Source: the size of the pieces its snapshots are checked and
    /// resumed in (a power of two, 1 MiB to 256 MiB).
    pub piece_size: ByteSize,
    /// Replica: how often one damaged piece is fetched again before the
    /// session fails (0 to 8).
    pub piece_retries: u32,
    /// Replica: how long a partly received snapshot with its journal is
    /// kept for a sync to resume.
    #[serde(with = "humantime_serde")]
    pub resume_ttl: Duration,
    /// Replica: TCP connections one sync runs on at once, each taking
    /// its pieces from the session's queue (1 to [`MAX_TCP_STREAMS`]), or
    /// `"auto"`: one, and more once its first second shows a long link
    /// (`sync::streams::auto_count`). More than one helps where one stream
    /// is limited by its window: long, fat links. Source: the most it
    /// grants one session (`"auto"`: [`AUTO_TCP_STREAMS`]).
    pub tcp_streams: TcpStreams,
}

/// The most TCP streams one sync runs on.
pub const MAX_TCP_STREAMS: u32 = 16;

/// The most TCP streams `tcp_streams = "auto"` asks for and grants.
pub const AUTO_TCP_STREAMS: u32 = 8;

/// `[data] tcp_streams`: a count, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TcpStreams {
    /// This many, as far as the source grants them.
    Fixed(u32),
    /// One to start with; the count from its measured round trip and
    /// first second.
    Auto(Auto),
}

/// The word `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Auto {
    Auto,
}

impl TcpStreams {
    pub const AUTO: TcpStreams = TcpStreams::Auto(Auto::Auto);

    /// The most streams this setting asks for (replica) or grants (source).
    pub fn most(self) -> u32 {
        match self {
            TcpStreams::Fixed(n) => n,
            TcpStreams::Auto(_) => AUTO_TCP_STREAMS,
        }
    }

    pub fn is_auto(self) -> bool {
        matches!(self, TcpStreams::Auto(_))
    }
}

impl std::fmt::Display for TcpStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TcpStreams::Fixed(n) => write!(f, "{n}"),
            TcpStreams::Auto(_) => f.write_str("\"auto\""),
        }
    }
}

/// The most data connections a source serves at once: each of the
/// `sync.max_outgoing_syncs` sessions on up to `data.tcp_streams` streams,
/// each stream on a thread of its own (the agent's thread pool has room
/// for these and its other blocking work).
pub const MAX_SERVED_STREAMS: usize = 1024;

/// Whether the TCP data path is encrypted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataTls {
    /// On when `[tls]` is configured on both ends.
    Auto,
    /// Always: a peer without TLS is refused, and RDMA (which has no TLS)
    /// is not used unless `[transport] rdma_unencrypted_ok`.
    Required,
    /// Never.
    Off,
}

/// Which data transport a sync uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportMode {
    /// Never probe RDMA.
    Tcp,
    /// Require RDMA (fail unless `fallback_to_tcp`).
    Rdma,
    /// Probe; RDMA if usable, else TCP.
    Auto,
}

impl std::fmt::Display for TransportMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportMode::Tcp => "tcp",
            TransportMode::Rdma => "rdma",
            TransportMode::Auto => "auto",
        })
    }
}

/// Transport and BLK3 bulk-phase tuning.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct TransportConfig {
    pub mode: TransportMode,
    /// RDMA Write chunk size in MiB (1..=32).
    pub chunk_mb: u32,
    /// RDMA Writes in flight, posted as one linked list (1..=1024).
    pub pipeline: u32,
    /// Signal every n-th Write (1..=pipeline).
    pub signal_batch: u32,
    /// With `mode = "rdma"`, retry a failed RDMA session over TCP (`auto`
    /// always does).
    pub fallback_to_tcp: bool,
    /// With `[data] tls = "required"`, RDMA (unencrypted) may still be used:
    /// the fabric is trusted (isolated, or IPsec/MACsec below it).
    pub rdma_unencrypted_ok: bool,
    /// RDMA implementation: real verbs, or the userspace emulation.
    pub rdma_provider: RdmaProvider,
    /// Interface (name or address) for RDMA; empty picks one by score.
    pub interface: String,
}

/// Which RDMA implementation moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RdmaProvider {
    /// libibverbs + librdmacm (a NIC, or soft-RoCE).
    Verbs,
    /// The emulated RC fabric over TCP: an emulation for tests and hosts
    /// without RDMA, not a fast path.
    Emulated,
}

impl RdmaProvider {
    pub fn as_str(self) -> &'static str {
        match self {
            RdmaProvider::Verbs => "verbs",
            RdmaProvider::Emulated => "emulated",
        }
    }
}

impl std::fmt::Display for RdmaProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            tcp_listen: "127.0.0.1:35102".into(),
            rdma_port: 35201,
            peer_timeout: Duration::from_secs(30),
            min_rate: ByteSize::mib(1),
            min_rate_window: Duration::from_secs(30),
            hello_timeout: Duration::from_secs(5),
            max_pending_connections: 4096,
            max_pending_per_peer: 64,
            tls: DataTls::Auto,
            kernel_tls: true,
            piece_size: ByteSize::b(crate::snapshot::manifest::DEFAULT_PIECE_SIZE),
            piece_retries: 3,
            resume_ttl: Duration::from_secs(3600),
            tcp_streams: TcpStreams::Fixed(1),
        }
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            mode: TransportMode::Auto,
            chunk_mb: 4,
            pipeline: 32,
            signal_batch: 8,
            fallback_to_tcp: true,
            rdma_unencrypted_ok: false,
            rdma_provider: RdmaProvider::Verbs,
            interface: String::new(),
        }
    }
}

impl Config {
    /// Whether this agent encrypts its TCP data path (when its peer can).
    pub fn data_tls(&self) -> bool {
        self.data.tls != DataTls::Off && self.tls.enabled()
    }

    /// Whether this agent may use RDMA, which has no TLS: not when the data
    /// plane must be encrypted, unless the fabric is declared trusted.
    pub fn rdma_allowed_unencrypted(&self) -> bool {
        self.data.tls != DataTls::Required || self.transport.rdma_unencrypted_ok
    }

    /// `[data]`: timeouts, connection limits, TLS (and RDMA beside it),
    /// pieces and streams, and a floor the agent's own rate limit allows.
    pub(super) fn check_data(&self, p: &mut Problems) {
        if self.data.peer_timeout < Duration::from_secs(1) {
            p.bad("data.peer_timeout", "must be at least 1s".into());
        }
        if self.data.min_rate_window < Duration::from_secs(1) {
            p.bad("data.min_rate_window", "must be at least 1s".into());
        }
        if self.data.tls == DataTls::Required && !self.tls.enabled() {
            p.bad(
                "data.tls",
                "\"required\" needs [tls] cert_file, key_file and ca_file".into(),
            );
        }
        if self.data.tls == DataTls::Required
            && self.transport.mode == TransportMode::Rdma
            && !self.transport.rdma_unencrypted_ok
        {
            p.bad(
                "transport.mode",
                "\"rdma\" with [data] tls = \"required\": RDMA has no TLS; use \"auto\" or \"tcp\", or set [transport] rdma_unencrypted_ok = true on a trusted fabric".into(),
            );
        }
        if self.data.hello_timeout.is_zero() {
            p.bad("data.hello_timeout", "must be greater than zero".into());
        }
        if self.data.max_pending_connections == 0 {
            p.bad("data.max_pending_connections", "must be at least 1".into());
        }
        if self.data.max_pending_per_peer == 0
            || self.data.max_pending_per_peer > self.data.max_pending_connections
        {
            p.bad(
                "data.max_pending_per_peer",
                "must be between 1 and data.max_pending_connections".into(),
            );
        }
        if let Err(why) = crate::snapshot::manifest::check_piece_size(self.data.piece_size.as_u64())
        {
            p.bad("data.piece_size", why.to_string());
        }
        if self.data.piece_retries > crate::blk3::MAX_PIECE_SENDS - 1 {
            p.bad(
                "data.piece_retries",
                format!("must be at most {}", crate::blk3::MAX_PIECE_SENDS - 1),
            );
        }
        if let TcpStreams::Fixed(n) = self.data.tcp_streams {
            if !(1..=MAX_TCP_STREAMS).contains(&n) {
                p.bad(
                    "data.tcp_streams",
                    format!("must be \"auto\" or between 1 and {MAX_TCP_STREAMS}"),
                );
            }
        }
        let limit = self.sync.rate_limit.as_u64();
        if limit > 0 && self.data.min_rate.as_u64() > limit {
            p.bad(
                "data.min_rate",
                format!("{} is above sync.rate_limit ({}): this agent's own sends would fail it; lower it", self.data.min_rate, self.sync.rate_limit),
            );
        }
    }

    /// `[transport]`: the RDMA bulk parameters.
    pub(super) fn check_transport(&self, p: &mut Problems) {
        let t = &self.transport;
        if !(1..=MAX_CHUNK_MB).contains(&t.chunk_mb) {
            p.bad(
                "transport.chunk_mb",
                format!("must be 1..={MAX_CHUNK_MB}, got {}", t.chunk_mb),
            );
        }
        if !(1..=1024).contains(&t.pipeline) {
            p.bad(
                "transport.pipeline",
                format!("must be 1..=1024, got {}", t.pipeline),
            );
        }
        if t.signal_batch == 0 || t.signal_batch > t.pipeline {
            p.bad(
                "transport.signal_batch",
                format!(
                    "must be 1..=pipeline ({}), got {}",
                    t.pipeline, t.signal_batch
                ),
            );
        }
    }
}
