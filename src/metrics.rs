//! Prometheus metrics: every handle the agent exports, in one struct, and the
//! HTTP endpoint that serves `/metrics` (plus the `/healthz` and `/readyz`
//! probes).
//!
//! Names follow docs/ARCHITECTURE.md ("Metrics"): prefix `kvsync_`, base
//! units, counters end in `_total`, only low-cardinality labels. Modules
//! receive `Arc<Metrics>` and update the handles; nothing here knows when or
//! why they change. Gauges of running work are held by a [`Running`] guard.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The `verdict` labels of `kvsync_instance_health`.
pub const HEALTH_VERDICTS: [&str; 3] = ["ok", "degraded", "stuck"];

/// Histogram buckets for whole syncs and bulk phases: 10 ms up to one hour.
const DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
    1800.0, 3600.0,
];

/// Replication lag buckets: 100 µs (a hop on one host) up to a minute.
const LAG_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// The `reason` labels of `kvsync_data_connections_refused_total`: why the
/// source closed a data connection before serving it: too many
/// still proving their session (in total, or from that address), no proof
/// within `data.hello_timeout`, a first message that is no proof, a
/// proof of no valid session, or of a session whose streams all ended (a
/// replica's late stream; not an authentication failure).
pub const REFUSAL_REASONS: &[&str] = &[
    "pending_total",
    "pending_per_peer",
    "hello_timeout",
    "bad_hello",
    "bad_token",
    "session_over",
];

/// The `reason` labels of `kvsync_transport_fallback_total`.
pub const FALLBACK_REASONS: &[&str] = &[
    "unavailable",
    "connect",
    "rejected",
    "timeout",
    "checksum",
    "peer_failed",
    "protocol",
    "completion_error",
    "disconnected",
    "fabric_error",
    "local_error",
];

/// One unit of running work in a gauge, counted from `start` until the
/// guard drops, on every exit path (errors and panics included).
pub struct Running(IntGauge);

impl Running {
    pub fn start(gauge: IntGauge) -> Running {
        gauge.inc();
        Running(gauge)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The `mode` labels of `kvsync_handoff_total`.
const HANDOFF_MODES: &[&str] = &[
    "file",
    "command",
    "exec",
    "redis",
    "redis-replicate",
    "redis-stream",
];

/// The `result` labels of `kvsync_fullsync_total`.
pub const SYNC_RESULTS: &[&str] = &["ok", "failed", "checksum_mismatch", "cancelled"];

/// All metric handles of one agent.
pub struct Metrics {
    registry: Registry,
    // Snapshot side.
    pub snapshot_latest_seq: IntGaugeVec,
    pub snapshot_latest_bytes: IntGaugeVec,
    pub snapshots_rejected: IntCounterVec,
    pub cache_bytes: IntGauge,
    pub cache_entries: IntGauge,
    pub cache_refs: IntGauge,
    pub cache_loads: IntCounter,
    pub cache_hits: IntCounter,
    // Syncs.
    pub fullsync_total: IntCounterVec,
    pub fullsync_bytes: IntCounterVec,
    pub resumed_bytes: IntCounterVec,
    pub relay_bytes: IntCounterVec,
    pub piece_refetch: IntCounterVec,
    pub fullsync_duration: HistogramVec,
    pub bulk_duration: HistogramVec,
    pub fullsync_in_progress: IntGaugeVec,
    pub handoff_total: IntCounterVec,
    pub data_auth_failures: IntCounter,
    pub data_refused: IntCounterVec,
    pub grpc_refused: IntCounterVec,
    pub grpc_unproved: IntGauge,
    pub grpc_auth_failures: IntCounter,
    pub last_success: GaugeVec,
    pub build_info: IntGaugeVec,
    pub up_since: Gauge,
    pub rdma_available: IntGauge,
    pub rdma_device_info: IntGaugeVec,
    // The local KV's replication health (`kv::health`), by server address:
    // no series at all on an agent without a local KV.
    pub kv_up: IntGaugeVec,
    pub kv_link_up: IntGaugeVec,
    pub kv_replication_offset: IntGaugeVec,
    pub kv_replica_lag_bytes: IntGaugeVec,
    pub kv_full_syncs: IntCounterVec,
    pub kv_partial_syncs: IntCounterVec,
    pub kv_consistency_mismatches: IntCounterVec,
    // The backlog guard (`backlog`), by the primary's address.
    pub kv_backlog_grown_bytes: IntGaugeVec,
    pub kv_backlog_at_risk: IntCounterVec,
    pub transport_fallback: IntCounterVec,
    // The replication stream (`stream`).
    pub stream_bytes: IntCounterVec,
    pub stream_frames: IntCounterVec,
    pub stream_sessions: IntGaugeVec,
    pub stream_refused: IntCounterVec,
    pub stream_lag: HistogramVec,
    pub stream_behind_bytes: IntGaugeVec,
    pub stream_checksum_failures: IntCounterVec,
    pub stream_refetched: IntCounterVec,
    pub stream_set_aside: IntGaugeVec,
    pub stream_read_bytes: IntCounterVec,
    pub stream_write_errors: IntCounterVec,
    pub stream_diverged: IntCounterVec,
    pub stream_snapshots_taken: IntCounterVec,
    pub stream_sentinel_dissent: IntCounterVec,
    pub stream_log_bytes: IntGaugeVec,
    pub stream_log_span: IntGaugeVec,
    pub stream_log_retain: IntGaugeVec,
    pub stream_reconnects: IntCounterVec,
    pub stream_credit_stalls: IntCounterVec,
    pub stream_write_safety_degraded: IntGaugeVec,
    pub stream_ring_sessions: IntCounterVec,
    pub stream_fallback: IntCounterVec,
    pub stream_lagging: IntGaugeVec,
    pub stream_server_repointed: IntCounterVec,
    pub instance_health: IntGaugeVec,
}

/// The `reason` labels `kvsync_stream_fallback_total` can carry (what
/// ended a ring session: below the protocol, a broken rule, the log).
pub const STREAM_FALLBACKS: &[&str] = &[
    "connect",
    "timeout",
    "rejected",
    "device_removed",
    "disconnected",
    "fabric_error",
    "completion_error",
    "protocol",
    "local_error",
    "peer",
    "log",
    "forged",
    "discontinuous",
    "over_window",
    "bad_ack",
    "bad_ring",
    "bad_header",
    "no_credit",
];

/// The `result` labels of `kvsync_stream_refetched_total`: how a damaged
/// record of the stream log was dealt with.
pub const STREAM_REFETCHED: &[&str] = &["mended", "cut"];

/// The `reason` labels of `kvsync_stream_refused_total`: a session ended
/// because its peer broke the stream's rules (a frame that fails its MAC,
/// does not continue the stream, or exceeds the credit window; an
/// acknowledgement of bytes never sent), or a replica asked for an offset
/// the log does not hold, or an upstream still follows a history the
/// replica's log left at a failover, or stands behind it on its history.
pub const STREAM_REFUSALS: &[&str] = &[
    "forged",
    "discontinuous",
    "over_window",
    "bad_ack",
    "too_old",
    "stale_upstream",
    "upstream_behind",
    "bad_ring",
    "bad_header",
    "no_credit",
];

impl Metrics {
    /// Creates and registers every metric. Long on purpose: one
    /// declaration per metric, so every exported name is in one place.
    pub fn new() -> Arc<Metrics> {
        let registry = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("valid metric definition");
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric names are unique");
                m
            }};
        }
        let hist = |name: &str, help: &str| {
            HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec())
        };
        let m = Metrics {
            snapshot_latest_seq: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_snapshot_latest_seq",
                    "Sequence number M of the latest valid snapshot"
                ),
                &["kv_instance", "format"]
            )),
            snapshot_latest_bytes: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_snapshot_latest_bytes",
                    "Size of the latest valid snapshot"
                ),
                &["kv_instance", "format"]
            )),
            snapshots_rejected: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_snapshots_rejected_total",
                    "Snapshot files found invalid and not offered"
                ),
                &["kv_instance", "reason"]
            )),
            cache_bytes: reg!(IntGauge::new(
                "kvsync_snapshot_cache_bytes",
                "Bytes of loaded snapshot buffers"
            )),
            cache_entries: reg!(IntGauge::new(
                "kvsync_snapshot_cache_entries",
                "Loaded snapshot buffers"
            )),
            cache_refs: reg!(IntGauge::new(
                "kvsync_snapshot_cache_refs",
                "Sessions holding a snapshot buffer"
            )),
            cache_loads: reg!(IntCounter::new(
                "kvsync_snapshot_cache_loads_total",
                "Snapshot files read into the cache"
            )),
            cache_hits: reg!(IntCounter::new(
                "kvsync_snapshot_cache_hits_total",
                "Acquisitions served by an already loaded buffer"
            )),
            fullsync_total: reg!(IntCounterVec::new(
                Opts::new("kvsync_fullsync_total", "Finished full syncs"),
                &["kv_instance", "role", "transport", "result"]
            )),
            fullsync_bytes: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_fullsync_bytes_total",
                    "Snapshot bytes moved by full syncs"
                ),
                &["kv_instance", "role", "transport"]
            )),
            resumed_bytes: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_resumed_bytes_total",
                    "Snapshot bytes a replica's sync found verified in place and did not move again"
                ),
                &["kv_instance"]
            )),
            relay_bytes: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_relay_bytes_total",
                    "Snapshot bytes this agent sent of snapshots it received from another agent (relay fan-out)"
                ),
                &["kv_instance"]
            )),
            piece_refetch: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_piece_refetch_total",
                    "Pieces that failed their check on a replica and were fetched again"
                ),
                &["kv_instance", "transport"]
            )),
            fullsync_duration: reg!(HistogramVec::new(
                hist(
                    "kvsync_fullsync_duration_seconds",
                    "Duration of full syncs, negotiation to handoff"
                ),
                &["kv_instance", "role", "transport"]
            )),
            bulk_duration: reg!(HistogramVec::new(
                hist(
                    "kvsync_bulk_duration_seconds",
                    "Duration of the bulk phase of full syncs"
                ),
                &["kv_instance"]
            )),
            fullsync_in_progress: reg!(IntGaugeVec::new(
                Opts::new("kvsync_fullsync_in_progress", "Full syncs running now"),
                &["kv_instance", "role"]
            )),
            handoff_total: reg!(IntCounterVec::new(
                Opts::new("kvsync_handoff_total", "Handoffs to the local KV"),
                &["kv_instance", "mode", "result"]
            )),
            data_auth_failures: reg!(IntCounter::new(
                "kvsync_data_auth_failures_total",
                "Data-plane connections refused for a bad session token"
            )),
            stream_bytes: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_bytes_total",
                    "Replication stream bytes sent to replica agents (role=source) or received from an upstream agent and logged (role=replica)"
                ),
                &["kv_instance", "role"]
            )),
            stream_frames: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_frames_total",
                    "Replication stream data frames sent to replica agents (role=source) or received from an upstream agent (role=replica): bytes over frames is the mean frame, which stays near 1 MiB while a downstream catches up"
                ),
                &["kv_instance", "role"]
            )),
            stream_sessions: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_sessions",
                    "Stream sessions running: served to replica agents (role=source) or followed from an upstream agent (role=replica)"
                ),
                &["kv_instance", "role"]
            )),
            stream_refused: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_refused_total",
                    "Stream sessions ended or refused, by reason: a peer that broke the stream's rules, an offset the log does not hold (too_old), a replica that took nothing for [stream] stall_end (no_progress), a limit on sessions (busy: all of them; busy_host: one host's)"
                ),
                &["kv_instance", "reason"]
            )),
            stream_lag: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "kvsync_stream_lag_seconds",
                    "Replication lag at the agent that follows the primary: seconds from receiving a piece of the stream to the lowest acknowledgement of the servers fed from it (directly or through replica agents) reaching it"
                )
                .buckets(LAG_BUCKETS.to_vec()),
                &["kv_instance"]
            )),
            stream_behind_bytes: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_behind_bytes",
                    "Bytes of the stream log not yet acknowledged by its slowest downstream (its fed server, or a replica agent for the servers fed from it); 0 with none"
                ),
                &["kv_instance"]
            )),
            stream_checksum_failures: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_checksum_failures_total",
                    "Records of the stream log found damaged on reading (disk, memory): never served, fetched again from upstream"
                ),
                &["kv_instance"]
            )),
            stream_refetched: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_refetched_total",
                    "Damaged records of the stream log dealt with: mended (fetched again from upstream alone and written back in place) or cut (nothing upstream held the record: the log was cut back to it and fetched again from there)"
                ),
                &["kv_instance", "result"]
            )),
            stream_set_aside: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_files_set_aside",
                    "Damaged files of the stream log (a segment, its history) set aside in its directory when the agent opened it; the log went on without them (status names them)"
                ),
                &["kv_instance"]
            )),
            stream_read_bytes: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_read_bytes_total",
                    "Stream log bytes its readers (sessions, the feed) got, by where from: memory (the log's newest bytes) or file (a reader further behind)"
                ),
                &["kv_instance", "from"]
            )),
            stream_diverged: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_diverged_bytes_total",
                    "Stream bytes dropped from the log after a failover because the promoted primary never had them: writes the old primary took past the promotion point, lost to the failover (the servers fed from them are re-seeded, never merged)"
                ),
                &["kv_instance"]
            )),
            stream_snapshots_taken: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_snapshots_taken_total",
                    "Snapshots the agent took of its primary (a full resync on a link of its own: a fork of the primary) because a reader needed one that continues into the log and none did"
                ),
                &["kv_instance"]
            )),
            stream_sentinel_dissent: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_sentinel_dissent_total",
                    "Askings of the instance's Sentinels at which one or more named another primary than their majority (a Sentinel cut off from the others, or one that lies): only the majority's word is acted on"
                ),
                &["kv_instance"]
            )),
            stream_write_errors: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_log_write_errors_total",
                    "Sessions into the stream log ended because the log could not be written (a full or failing disk): nothing unwritten was acknowledged, and the agent tries again"
                ),
                &["kv_instance"]
            )),
            stream_log_bytes: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_log_bytes",
                    "Bytes the stream log's segments take on disk"
                ),
                &["kv_instance"]
            )),
            stream_log_span: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_log_span_bytes",
                    "Offsets of the stream the log holds: its end minus its first offset"
                ),
                &["kv_instance"]
            )),
            stream_log_retain: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_log_retain_bytes",
                    "[stream] retain: the bytes the log keeps before it removes its oldest segments"
                ),
                &["kv_instance"]
            )),
            stream_reconnects: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_reconnects_total",
                    "Sessions into the stream log that ended and were started again, by what the log follows (source=primary or agent)"
                ),
                &["kv_instance", "source"]
            )),
            stream_ring_sessions: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_ring_sessions_total",
                    "Stream sessions started over an RDMA ring, by role (source or replica)"
                ),
                &["kv_instance", "role"]
            )),
            stream_fallback: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_fallback_total",
                    "Stream sessions over an RDMA ring that failed, after which the stream went on over TCP from what the log holds, by reason"
                ),
                &["kv_instance", "reason"]
            )),
            stream_lagging: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_lagging_downstreams",
                    "Replica agents served this instance's stream whose credit window has stayed full past [stream] stall_timeout while the log holds more: the log buffers for them, the primary is not slowed"
                ),
                &["kv_instance"]
            )),
            stream_server_repointed: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_server_repointed_total",
                    "Times a redis-stream server that came back a master after a restart (data the log continues) was pointed back at its feed"
                ),
                &["kv_instance"]
            )),
            instance_health: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_instance_health",
                    "1 for the instance's health verdict now (verdict ok, degraded or stuck; kvsync status says why), 0 for the others"
                ),
                &["kv_instance", "verdict"]
            )),
            stream_credit_stalls: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_stream_credit_stalls_total",
                    "Times a stream session served to a replica agent had its whole credit window unacknowledged while the log held more: the replica is the bottleneck"
                ),
                &["kv_instance"]
            )),
            stream_write_safety_degraded: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_stream_write_safety_degraded",
                    "1 while the primary the agent follows has fewer replicas within min-replicas-max-lag than its min-replicas-to-write asks (it refuses writes), else 0"
                ),
                &["kv_instance"]
            )),
            data_refused: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_data_connections_refused_total",
                    "Data connections closed before they were served, by reason"
                ),
                &["reason"]
            )),
            grpc_refused: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_grpc_connections_refused_total",
                    "gRPC connections closed by the agent: over grpc.max_connections (total) or max_connections_per_peer (per_peer) with every connection proved; unproved, for a newcomer at a limit (evicted); without an authenticated request within grpc.handshake_timeout (handshake_timeout)"
                ),
                &["reason"]
            )),
            grpc_unproved: reg!(IntGauge::new(
                "kvsync_grpc_connections_unproved",
                "gRPC connections open that have not yet made an authenticated request"
            )),
            grpc_auth_failures: reg!(IntCounter::new(
                "kvsync_grpc_auth_failures_total",
                "Control-plane requests refused for a missing or bad bearer token"
            )),
            last_success: reg!(GaugeVec::new(
                Opts::new(
                    "kvsync_last_success_timestamp_seconds",
                    "Unix time of the last successful full sync"
                ),
                &["kv_instance", "role"]
            )),
            build_info: reg!(IntGaugeVec::new(
                Opts::new("kvsync_build_info", "Build information (value is always 1)"),
                &["version", "rdma", "faults"]
            )),
            up_since: reg!(Gauge::new(
                "kvsync_start_time_seconds",
                "Unix time the agent started"
            )),
            transport_fallback: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_transport_fallback_total",
                    "RDMA sessions retried over TCP, by reason"
                ),
                &["kv_instance", "reason"]
            )),
            rdma_available: reg!(IntGauge::new(
                "kvsync_rdma_available",
                "1 when RDMA is usable: a device with an ACTIVE port whose address resolves, or the emulated fabric"
            )),
            rdma_device_info: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_rdma_device_info",
                    "RDMA devices found by the probe (value is always 1)"
                ),
                &["device", "soft"]
            )),
            kv_up: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_kv_up",
                    "1 when the local KV server answered the last health poll"
                ),
                &["kv_instance", "server"]
            )),
            kv_link_up: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_kv_link_up",
                    "1 when the local KV server answers in the role it should have and, where that is a replica, its link to its primary is up (a fed or seeded replica that is a master is 0)"
                ),
                &["kv_instance", "server"]
            )),
            kv_replication_offset: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_kv_replication_offset",
                    "The local KV server's replication offset (master_repl_offset on a primary, slave_repl_offset on a replica)"
                ),
                &["kv_instance", "server"]
            )),
            kv_replica_lag_bytes: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_kv_replica_lag_bytes",
                    "Bytes a replica of the local primary has yet to acknowledge"
                ),
                &["kv_instance", "server", "replica"]
            )),
            kv_full_syncs: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_kv_full_syncs_total",
                    "Full resyncs the local primary served (its sync_full)"
                ),
                &["kv_instance", "server"]
            )),
            kv_partial_syncs: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_kv_partial_syncs_total",
                    "Partial resyncs the local primary accepted (its sync_partial_ok)"
                ),
                &["kv_instance", "server"]
            )),
            kv_consistency_mismatches: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_kv_consistency_mismatches_total",
                    "Sampled keys whose value on the local replica differed from its primary's (periodic consistency check)"
                ),
                &["kv_instance", "server"]
            )),
            kv_backlog_grown_bytes: reg!(IntGaugeVec::new(
                Opts::new(
                    "kvsync_kv_backlog_grown_bytes",
                    "The repl-backlog-size this agent set on the local primary for running seedings (0: the operator's own value is in force)"
                ),
                &["kv_instance", "server"]
            )),
            kv_backlog_at_risk: reg!(IntCounterVec::new(
                Opts::new(
                    "kvsync_kv_backlog_at_risk_total",
                    "Seedings during which the local primary's backlog was about to lose, or lost, the offset the replica will ask for"
                ),
                &["kv_instance", "server"]
            )),
            registry,
        };
        m.build_info
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                if cfg!(feature = "rdma") {
                    "true"
                } else {
                    "false"
                },
                if cfg!(feature = "faults") {
                    "true"
                } else {
                    "false"
                },
            ])
            .set(1);
        m.up_since.set(unix_now());
        for reason in REFUSAL_REASONS {
            m.data_refused.with_label_values(&[reason]);
        }
        for reason in ["total", "per_peer", "evicted", "handshake_timeout"] {
            m.grpc_refused.with_label_values(&[reason]);
        }
        Arc::new(m)
    }

    /// Creates instance `name`'s series whose label sets are known, so
    /// that a scrape tells "zero" from "missing" (and dashboards and rates
    /// see zeros) from its start.
    pub fn add_instance(&self, name: &str) {
        for (role, transport, result) in self.instance_series() {
            self.fullsync_in_progress.with_label_values(&[name, role]);
            self.piece_refetch.with_label_values(&[name, transport]);
            self.fullsync_bytes
                .with_label_values(&[name, role, transport]);
            self.fullsync_total
                .with_label_values(&[name, role, transport, result]);
        }
        for reason in FALLBACK_REASONS {
            self.transport_fallback.with_label_values(&[name, reason]);
        }
        for mode in HANDOFF_MODES {
            for result in ["ok", "failed"] {
                self.handoff_total.with_label_values(&[name, mode, result]);
            }
        }
        self.resumed_bytes.with_label_values(&[name]);
        self.relay_bytes.with_label_values(&[name]);
        for role in ["source", "replica"] {
            self.stream_bytes.with_label_values(&[name, role]);
            self.stream_frames.with_label_values(&[name, role]);
            self.stream_sessions.with_label_values(&[name, role]);
            self.stream_ring_sessions.with_label_values(&[name, role]);
        }
        for reason in STREAM_REFUSALS {
            self.stream_refused.with_label_values(&[name, reason]);
        }
        for reason in STREAM_FALLBACKS {
            self.stream_fallback.with_label_values(&[name, reason]);
        }
        self.stream_checksum_failures.with_label_values(&[name]);
        for result in STREAM_REFETCHED {
            self.stream_refetched.with_label_values(&[name, result]);
        }
        for from in ["memory", "file"] {
            self.stream_read_bytes.with_label_values(&[name, from]);
        }
        self.stream_write_errors.with_label_values(&[name]);
        self.stream_diverged.with_label_values(&[name]);
        self.stream_snapshots_taken.with_label_values(&[name]);
        self.stream_sentinel_dissent.with_label_values(&[name]);
        for source in ["primary", "agent"] {
            self.stream_reconnects.with_label_values(&[name, source]);
        }
        self.stream_credit_stalls.with_label_values(&[name]);
        self.stream_lagging.with_label_values(&[name]);
        self.stream_server_repointed.with_label_values(&[name]);
    }

    /// Removes instance `name`'s series (those of its KV's health poll go
    /// when the poll ends; `primary` is its backlog guard's server): a
    /// removed instance leaves nothing behind that dashboards would show
    /// as its state.
    pub fn remove_instance(&self, name: &str, primary: Option<&str>) {
        for (role, transport, result) in self.instance_series() {
            let _ = self.fullsync_in_progress.remove_label_values(&[name, role]);
            let _ = self.piece_refetch.remove_label_values(&[name, transport]);
            let _ = self
                .fullsync_bytes
                .remove_label_values(&[name, role, transport]);
            let _ = self
                .fullsync_total
                .remove_label_values(&[name, role, transport, result]);
        }
        for reason in FALLBACK_REASONS {
            let _ = self.transport_fallback.remove_label_values(&[name, reason]);
        }
        for mode in HANDOFF_MODES {
            for result in ["ok", "failed"] {
                let _ = self
                    .handoff_total
                    .remove_label_values(&[name, mode, result]);
            }
        }
        for (role, transport, _) in self.instance_series() {
            let _ = self
                .fullsync_duration
                .remove_label_values(&[name, role, transport]);
            let _ = self.last_success.remove_label_values(&[name, role]);
        }
        for reason in crate::snapshot::REJECTION_REASONS {
            let _ = self.snapshots_rejected.remove_label_values(&[name, reason]);
        }
        if let Some(primary) = primary {
            let _ = self
                .kv_backlog_grown_bytes
                .remove_label_values(&[name, primary]);
            let _ = self
                .kv_backlog_at_risk
                .remove_label_values(&[name, primary]);
        }
        let _ = self.bulk_duration.remove_label_values(&[name]);
        for format in ["kvr1", "redis-rdb"] {
            let _ = self
                .snapshot_latest_seq
                .remove_label_values(&[name, format]);
            let _ = self
                .snapshot_latest_bytes
                .remove_label_values(&[name, format]);
        }
        let _ = self.resumed_bytes.remove_label_values(&[name]);
        for role in ["source", "replica"] {
            let _ = self.stream_bytes.remove_label_values(&[name, role]);
            let _ = self.stream_frames.remove_label_values(&[name, role]);
            let _ = self.stream_sessions.remove_label_values(&[name, role]);
            let _ = self.stream_ring_sessions.remove_label_values(&[name, role]);
        }
        for reason in STREAM_REFUSALS {
            let _ = self.stream_refused.remove_label_values(&[name, reason]);
        }
        for reason in STREAM_FALLBACKS {
            let _ = self.stream_fallback.remove_label_values(&[name, reason]);
        }
        let _ = self.stream_lag.remove_label_values(&[name]);
        let _ = self.stream_behind_bytes.remove_label_values(&[name]);
        let _ = self.stream_checksum_failures.remove_label_values(&[name]);
        for result in STREAM_REFETCHED {
            let _ = self.stream_refetched.remove_label_values(&[name, result]);
        }
        let _ = self.stream_set_aside.remove_label_values(&[name]);
        for from in ["memory", "file"] {
            let _ = self.stream_read_bytes.remove_label_values(&[name, from]);
        }
        let _ = self.stream_write_errors.remove_label_values(&[name]);
        let _ = self.stream_diverged.remove_label_values(&[name]);
        let _ = self.stream_sentinel_dissent.remove_label_values(&[name]);
        let _ = self.stream_snapshots_taken.remove_label_values(&[name]);
        for source in ["primary", "agent"] {
            let _ = self.stream_reconnects.remove_label_values(&[name, source]);
        }
        let _ = self.stream_credit_stalls.remove_label_values(&[name]);
        let _ = self.stream_lagging.remove_label_values(&[name]);
        let _ = self.stream_server_repointed.remove_label_values(&[name]);
        for verdict in HEALTH_VERDICTS {
            let _ = self.instance_health.remove_label_values(&[name, verdict]);
        }
        let _ = self.stream_log_bytes.remove_label_values(&[name]);
        let _ = self.stream_log_span.remove_label_values(&[name]);
        let _ = self.stream_log_retain.remove_label_values(&[name]);
        let _ = self
            .stream_write_safety_degraded
            .remove_label_values(&[name]);
        let _ = self.relay_bytes.remove_label_values(&[name]);
    }

    /// Every (role, transport, result) of the per-sync series.
    fn instance_series(&self) -> impl Iterator<Item = (&'static str, &'static str, &'static str)> {
        ["source", "replica"].into_iter().flat_map(|role| {
            ["tcp", "rdma"].into_iter().flat_map(move |transport| {
                SYNC_RESULTS
                    .iter()
                    .map(move |result| (role, transport, *result))
            })
        })
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("prometheus text is utf-8")
    }
}

/// Seconds since the unix epoch, as Prometheus wants timestamps.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Whether the agent is ready, and a JSON body that says what is not.
pub type Ready = Arc<dyn Fn() -> (bool, serde_json::Value) + Send + Sync>;

/// Serves `/metrics`, and the HTTP probes for orchestrators that cannot
/// speak gRPC over TLS: `/healthz` (200 while the agent runs) and `/readyz`
/// (200 when `ready` says so, else 503, and 503 once `draining` is
/// cancelled; a JSON body either way). Runs until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    (draining, ready): (tokio_util::sync::CancellationToken, Ready),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::{
        http::{header, StatusCode},
        routing::get,
        Router,
    };
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        metrics.render(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let (ok, body) = match draining.is_cancelled() {
                    true => (
                        false,
                        serde_json::json!({ "ready": false, "draining": true }),
                    ),
                    false => ready(),
                };
                async move {
                    let code = match ok {
                        true => StatusCode::OK,
                        false => StatusCode::SERVICE_UNAVAILABLE,
                    };
                    (
                        code,
                        [(header::CONTENT_TYPE, "application/json")],
                        format!("{body}\n"),
                    )
                }
            }),
        );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Binds the metrics listener (port 0 allowed) and returns its address.
pub async fn bind(addr: &str) -> std::io::Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}
