//! `[redis]` and `[handoff]`: the local Redis/Valkey servers and how a
//! received snapshot reaches the local KV; and their checks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use super::addr::is_host_port;
use super::{Config, Problems, ServerAuth, TlsFiles};
use crate::snapshot::Format;

/// Redis/Valkey: the local primary (source role, pre-flight check) and the
/// local server a `redis` handoff seeds (replica role).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RedisConfig {
    /// Source: the local primary (`host:port`) whose backlog must still hold
    /// M+1 before a snapshot is offered; empty skips the check.
    pub primary_addr: String,
    /// The ACL user kvsync is to the servers (`AUTH <user> <password>`;
    /// empty: the `default` user).
    pub user: String,
    /// The servers' password (`AUTH`), if they require one. Prefer
    /// `password_file`: a password written here ends up wherever the
    /// configuration goes (`check-config` warns).
    pub password: String,
    /// A file holding the servers' password (its line ending left out),
    /// read at every connection: a rotated file is used from the next one.
    pub password_file: PathBuf,
    /// Reach the servers over TLS (their `tls-port`): every connection the
    /// agent makes to them, its replication link to the primary included.
    pub tls: bool,
    /// The CA certificates (PEM) the servers' certificates must chain to,
    /// for the name or IP address the agent reaches them by.
    pub tls_ca_file: PathBuf,
    /// A client certificate and key (PEM), for servers with
    /// `tls-auth-clients yes` (both or neither).
    pub tls_cert_file: PathBuf,
    pub tls_key_file: PathBuf,
    /// Replica: the local server (`host:port`).
    pub server_addr: String,
    /// Replica: the server's `dir` and `dbfilename`.
    pub dir: PathBuf,
    pub dbfilename: String,
    /// Replica: the primary to follow (`host:port`).
    pub primary: String,
    /// Replica: the command that (re)starts the server with `replicaof
    /// <primary>` and `appendonly no`, and returns once it is started
    /// (e.g. `systemctl restart redis-replica`, or `redis-server … --daemonize
    /// yes`). `{primary_host}`, `{primary_port}`, `{dir}`, `{dbfilename}` are
    /// replaced.
    pub start: Vec<String>,
    /// Replica, cluster mode (`redis` handoff into a Redis Cluster or Valkey
    /// cluster node, found from the primary's `INFO cluster`): the
    /// server's `cluster-config-file`, relative to `dir` or absolute.
    pub cluster_config_file: PathBuf,
    /// Replica: the command that stops the server; empty sends
    /// `SHUTDOWN NOSAVE` to `server_addr`.
    pub stop: Vec<String>,
    /// How often the local server's replication state is read into the
    /// `kvsync_kv_*` metrics (`0s` turns it off).
    #[serde(with = "humantime_serde")]
    pub health_interval: Duration,
    /// Source: the backlog guard. The primary's write rate is measured over
    /// the last `rate_window`, sampled in the background (`0s`: not
    /// measured); a seeding is estimated to take
    /// the RDB's size at the slowest of `expected_transfer_rate`, the rate
    /// this agent last served a session at and its `[sync] rate_limit`,
    /// plus its size at the rate a replica last
    /// reported loading one (else `expected_load_rate`); the
    /// backlog must hold what was written since the save plus that rate
    /// over that time, times `backlog_safety`, or the offer is refused.
    #[serde(with = "humantime_serde")]
    pub rate_window: Duration,
    pub expected_transfer_rate: ByteSize,
    pub expected_load_rate: ByteSize,
    pub backlog_safety: f64,
    /// Source: instead of refusing, raise the primary's `repl-backlog-size`
    /// (`CONFIG SET`) to what a seeding needs, up to `max_backlog`, at the
    /// offer and again whenever the primary writes faster during the
    /// seeding than foreseen, and put the operator's value back once no
    /// seeding needs it (Redis 7.0 and later, Valkey: older servers lose
    /// the backlog on a resize).
    pub grow_backlog: bool,
    pub max_backlog: ByteSize,
    /// Source: where the operator's `repl-backlog-size` is remembered while
    /// kvsync's is in force; empty means `<snapshot_dir>/.kvsync-redis-backlog`.
    /// Set it when the agent may only read the primary's directory.
    pub backlog_record: PathBuf,
    /// Replica (handoff mode `redis`): how often a sample of keys is
    /// compared with `primary` (`0s`: never), and how many keys.
    #[serde(with = "humantime_serde")]
    pub consistency_interval: Duration,
    pub consistency_sample: usize,
    /// Replica (handoff mode `redis-replicate`): where the agent listens,
    /// for one connection from the local server, while it serves it the
    /// RDB as its master (a fresh port per sync with port 0).
    pub seed_listen: String,
}

impl RedisConfig {
    /// How the agent reaches and logs in to the instance's servers.
    pub fn auth(&self) -> ServerAuth {
        let tls = self.tls.then(|| self.tls_file_set());
        ServerAuth::new(&self.user, &self.password, &self.password_file).with_tls(tls)
    }

    /// The TLS files as set, on or not (the Sentinels' `sentinel_tls`
    /// uses them too).
    pub fn tls_file_set(&self) -> TlsFiles {
        TlsFiles {
            ca: self.tls_ca_file.clone(),
            cert: self.tls_cert_file.clone(),
            key: self.tls_key_file.clone(),
        }
    }

    /// The local server whose replication health the agent reports: the
    /// primary it pre-flights, or the replica a `redis` handoff seeds.
    pub fn local_server(&self, handoff: HandoffMode) -> Option<&str> {
        if !self.primary_addr.is_empty() {
            Some(&self.primary_addr)
        } else if handoff.is_redis() {
            Some(&self.server_addr)
        } else {
            None
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            primary_addr: String::new(),
            user: String::new(),
            password: String::new(),
            password_file: PathBuf::new(),
            tls: false,
            tls_ca_file: PathBuf::new(),
            tls_cert_file: PathBuf::new(),
            tls_key_file: PathBuf::new(),
            server_addr: "127.0.0.1:6379".into(),
            dir: PathBuf::from("/var/lib/redis"),
            dbfilename: "dump.rdb".into(),
            primary: String::new(),
            start: Vec::new(),
            cluster_config_file: PathBuf::from("nodes.conf"),
            stop: Vec::new(),
            health_interval: Duration::from_secs(5),
            rate_window: Duration::from_secs(2),
            expected_transfer_rate: ByteSize::mib(100),
            expected_load_rate: ByteSize::mib(32),
            backlog_safety: 2.0,
            grow_backlog: false,
            max_backlog: ByteSize::gib(1),
            backlog_record: PathBuf::new(),
            consistency_interval: Duration::ZERO,
            consistency_sample: 1000,
            seed_listen: "127.0.0.1:0".into(),
        }
    }
}

/// How a received snapshot is handed to the local KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HandoffMode {
    /// Only the `.replmeta` record.
    File,
    /// Send a templated line to the KV's admin address, expect `+OK`.
    Command,
    /// Run a program with `KVSYNC_*` variables.
    Exec,
    /// Redis/Valkey restart with `replicaof`.
    Redis,
    /// Redis/Valkey seeded over the replication protocol by the agent,
    /// without a restart.
    #[serde(rename = "redis-replicate")]
    RedisReplicate,
    /// Redis/Valkey fed by the agent as its master from the stream log
    /// (`[stream]`), seeded with the snapshot first, without a restart.
    #[serde(rename = "redis-stream")]
    RedisStream,
}

/// Whether `listen` (an `ip:port`, as `[redis] seed_listen`) names a
/// fixed port, one the next run listens on again.
pub fn fixed_port(listen: &str) -> bool {
    listen.parse::<SocketAddr>().is_ok_and(|a| a.port() != 0)
}

impl HandoffMode {
    /// The name in the configuration and the `mode` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffMode::File => "file",
            HandoffMode::Command => "command",
            HandoffMode::Exec => "exec",
            HandoffMode::Redis => "redis",
            HandoffMode::RedisReplicate => "redis-replicate",
            HandoffMode::RedisStream => "redis-stream",
        }
    }

    /// Whether an instance in this mode, with a stream log or not
    /// (`stream`), runs the stream feed: `redis-stream` feeds its server
    /// from the log, and `redis` a cluster node the gap its primary's
    /// backlog no longer holds.
    pub fn runs_feed(self, stream: bool) -> bool {
        self == HandoffMode::RedisStream || (self == HandoffMode::Redis && stream)
    }

    /// A mode that seeds a Redis/Valkey server.
    pub fn is_redis(self) -> bool {
        matches!(
            self,
            HandoffMode::Redis | HandoffMode::RedisReplicate | HandoffMode::RedisStream
        )
    }
}

/// Handoff settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HandoffConfig {
    pub mode: HandoffMode,
    /// `command` mode: the KV's admin address (`host:port`).
    pub command_addr: String,
    /// `command` mode: the line sent; `{seq}`, `{path}`, `{source}` are replaced.
    pub command_template: String,
    /// `exec` mode: program and arguments.
    pub exec: Vec<String>,
    /// Deadline for the KV to accept the handoff.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for HandoffConfig {
    fn default() -> Self {
        HandoffConfig {
            mode: HandoffMode::File,
            command_addr: String::new(),
            command_template: "REPLMETA {seq} {path}".into(),
            exec: Vec::new(),
            timeout: Duration::from_secs(30),
        }
    }
}

impl Config {
    /// `[handoff]`, and `[redis]` for the redis mode and the pre-flight.
    pub(super) fn check_handoff(&self, p: &mut Problems) {
        let h = &self.handoff;
        match h.mode {
            HandoffMode::Command if h.command_addr.parse::<SocketAddr>().is_err() => p.bad(
                "handoff.command_addr",
                format!(
                    "mode \"command\" needs the KV admin address ip:port, got {:?}",
                    h.command_addr
                ),
            ),
            HandoffMode::Exec if h.exec.is_empty() => p.bad(
                "handoff.exec",
                "mode \"exec\" needs a program to run".into(),
            ),
            _ => {}
        }
        if h.mode == HandoffMode::Command && h.command_template.trim().is_empty() {
            p.bad("handoff.command_template", "must not be empty".into());
        }
        if h.timeout.is_zero() {
            p.bad("handoff.timeout", "must be greater than zero".into());
        }
        let r = &self.redis;
        if !r.primary_addr.is_empty() && !is_host_port(&r.primary_addr) {
            p.bad(
                "redis.primary_addr",
                format!("expected host:port, got {:?}", r.primary_addr),
            );
        }
        if !(r.backlog_safety.is_finite() && r.backlog_safety >= 1.0) {
            p.bad(
                "redis.backlog_safety",
                format!("must be at least 1, got {}", r.backlog_safety),
            );
        }
        for (key, rate) in [
            ("redis.expected_transfer_rate", r.expected_transfer_rate),
            ("redis.expected_load_rate", r.expected_load_rate),
        ] {
            if rate.as_u64() == 0 {
                p.bad(key, "must be greater than zero".into());
            }
        }
        if !r.backlog_record.as_os_str().is_empty() && !r.backlog_record.is_absolute() {
            p.bad(
                "redis.backlog_record",
                format!("must be an absolute path, got {:?}", r.backlog_record),
            );
        }
        if r.grow_backlog && r.max_backlog.as_u64() == 0 {
            p.bad(
                "redis.max_backlog",
                "must be greater than zero when redis.grow_backlog is on".into(),
            );
        }
        if h.mode.is_redis() {
            self.check_redis_handoff(p);
        }
    }

    /// `[redis]` as the redis handoff needs it.
    pub(super) fn check_redis_handoff(&self, p: &mut Problems) {
        let r = &self.redis;
        let mode = self.handoff.mode.as_str();
        if self.snapshot_format != Format::RedisRdb {
            p.bad(
                "handoff.mode",
                format!("mode \"{mode}\" needs snapshot_format = \"redis-rdb\""),
            );
        }
        let streams = self.handoff.mode == HandoffMode::RedisStream;
        for (key, value) in [
            ("redis.server_addr", &r.server_addr),
            ("redis.primary", &r.primary),
        ] {
            // The stream handoff's server follows the agent, not a primary.
            if streams && key == "redis.primary" && value.is_empty() {
                continue;
            }
            if !is_host_port(value) {
                p.bad(
                    key,
                    format!("mode \"{mode}\" needs host:port, got {value:?}"),
                );
            }
        }
        if streams && !self.stream.enabled() {
            p.bad(
                "handoff.mode",
                "mode \"redis-stream\" feeds the server from the stream log: set [stream] dir (and upstream)".into(),
            );
        }
        let mode = self.handoff.mode;
        let listens = mode == HandoffMode::RedisReplicate || mode.runs_feed(self.stream.enabled());
        if listens && r.seed_listen.parse::<SocketAddr>().is_err() {
            p.bad(
                "redis.seed_listen",
                format!("expected ip:port, got {:?}", r.seed_listen),
            );
        }
        if matches!(mode, HandoffMode::RedisReplicate | HandoffMode::RedisStream) {
            return;
        }
        if !r.dir.is_absolute() {
            p.bad(
                "redis.dir",
                format!("must be the server's absolute data dir, got {:?}", r.dir),
            );
        }
        if r.dbfilename.is_empty() || r.dbfilename.contains('/') {
            p.bad(
                "redis.dbfilename",
                format!("must be a file name, got {:?}", r.dbfilename),
            );
        }
        if r.cluster_config_file.as_os_str().is_empty() {
            p.bad(
                "redis.cluster_config_file",
                "must name the server's cluster-config-file".into(),
            );
        }
        if r.start.is_empty() {
            p.bad("redis.start", "mode \"redis\" needs the command that (re)starts the server with replicaof and appendonly no".into());
        }
    }
}
