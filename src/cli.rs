//! The `kvsync` command line: argument parsing (clap; doc comments are the
//! help text) and the glue that runs each subcommand.
//!
//! Owns exit codes and what is printed for humans and for `--json`. The work
//! itself is done by the library modules; the gRPC client commands and the
//! demo live in [`client`].

mod client;
mod shards;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use bytesize::ByteSize;
use clap::{Parser, Subcommand};

use crate::agent::RunningAgent;
use crate::config::{Config, ConfigError, MAX_SERVED_STREAMS};
use crate::snapshot::{self, kvr1::GenSpec, Format};

/// kvsync — replication sidecar for key-value servers.
///
/// Moves full snapshots between hosts (BLK3 over RDMA, or TCP), verifies them,
/// installs them durably and hands their sequence number to the local KV.
#[derive(Debug, Parser)]
#[command(name = "kvsync", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Client commands: a file whose first token is sent as the bearer
    /// token (agents with `[auth] token_file` require one).
    #[arg(long, global = true, env = "KVSYNC_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Client commands: reach the agent over TLS, verifying its certificate
    /// against these CA certificates (PEM).
    #[arg(long, global = true, env = "KVSYNC_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client commands: the certificate (PEM) to present to agents that
    /// require client certificates (`[tls] client_auth`); needs --tls-key.
    #[arg(long, global = true, env = "KVSYNC_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// Client commands: the private key (PEM) of --tls-cert.
    #[arg(long, global = true, env = "KVSYNC_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Client commands: the name to verify in the agent's certificate
    /// instead of the host part of --agent.
    #[arg(
        long,
        global = true,
        env = "KVSYNC_TLS_SERVER_NAME",
        requires = "tls_ca"
    )]
    pub tls_server_name: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (snapshot watcher, cache, metrics endpoint).
    Agent(AgentArgs),
    /// Write a deterministic snapshot of an exact size (tests, benchmarks).
    GenSnapshot(GenArgs),
    /// Verify a snapshot file's structure and checksum.
    ///
    /// Exit status 0 when valid, 1 when corrupt or unreadable (reason on stderr).
    Verify(VerifyArgs),
    /// Ask an agent to pull a full snapshot from a source agent.
    ///
    /// With --wait, follow the sync to its end; exit status 0 only when it
    /// succeeded.
    Sync(SyncArgs),
    /// Seed many replicas with the source's latest snapshot through a tree
    /// of relays: each replica pulls from its parent, which passes on
    /// verified pieces while it still receives them.
    ///
    /// With --wait, follow the fan-out to its end; exit status 0 only when
    /// every replica succeeded.
    Fanout(FanoutArgs),
    /// Show an agent's status: snapshots, running and recent syncs.
    Status(StatusArgs),
    /// List the snapshots an agent offers.
    Snapshots(StatusArgs),
    /// Cancel a running sync.
    Cancel(CancelArgs),
    /// Hand a server fed from an agent's stream log (`redis-stream`) to its
    /// primary, or take it back, each without a full resync.
    #[command(subcommand)]
    Stream(StreamCommand),
    /// Compare a sample of a Redis/Valkey replica's keys with its primary,
    /// without trusting the replication link (writes in flight are not
    /// mismatches).
    ///
    /// Exit status 0 when they agree, 1 with the differing keys otherwise.
    CheckReplica(CheckReplicaArgs),
    /// Check a configuration file and print every problem in it.
    ///
    /// Exit status 0 when the file is valid, 1 otherwise.
    CheckConfig(CheckConfigArgs),
    /// Show whether this host can use RDMA and what `auto` would choose.
    ///
    /// Lists verbs devices, their port states and whether they are soft
    /// devices; exits 0 whether or not RDMA is available.
    Probe(ProbeArgs),
    /// Run a complete local demo: two agents, one generated snapshot, one
    /// full sync with progress, then clean up.
    Demo(DemoArgs),
}

#[derive(Debug, clap::Args)]
pub struct SyncArgs {
    /// gRPC address of the agent that receives the snapshot (host:port).
    #[arg(long)]
    pub agent: String,
    /// gRPC address of the source agent (host:port).
    #[arg(long)]
    pub source: String,
    /// Pull exactly this snapshot: its manifest digest (64 hex digits, as
    /// `kvsync snapshots` prints it on the agent that made it). Whoever
    /// serves it, a snapshot whose manifest does not hash to it is refused.
    #[arg(long, value_name = "DIGEST", value_parser = parse_digest)]
    pub snapshot: Option<blake3::Hash>,
    #[command(flatten)]
    pub instance: InstanceArg,
    /// The source's instance to pull from (default: the one --instance
    /// names, or the source's only one).
    #[arg(long, value_name = "NAME")]
    pub source_instance: Option<String>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Which of an agent's KV instances a command is about.
#[derive(Debug, Clone, clap::Args)]
pub struct InstanceArg {
    /// The agent's instance (`[[instance]] name`); may be left out when it
    /// serves one.
    #[arg(long = "instance", value_name = "NAME", env = "KVSYNC_INSTANCE")]
    pub name: Option<String>,
}

impl InstanceArg {
    /// The name as a request carries it (empty: the agent's only one).
    pub fn wire(&self) -> String {
        self.name.clone().unwrap_or_default()
    }
}

fn parse_digest(s: &str) -> Result<blake3::Hash, String> {
    blake3::Hash::from_hex(s).map_err(|_| format!("{s:?} is not a manifest digest (64 hex digits)"))
}

/// How a started sync or fan-out runs and is shown.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Transport preference (of every sync).
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: TransportArg,
    /// Follow it until it ends.
    #[arg(long)]
    pub wait: bool,
    /// Print a JSON summary instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct FanoutArgs {
    /// gRPC address of the origin agent (host:port): it runs the fan-out,
    /// and the replicas reach it at this address. With `--cluster`, one
    /// per shard: the agent beside each shard primary.
    #[arg(long = "source", required = true)]
    pub sources: Vec<String>,
    /// One fan-out per shard of a Redis Cluster or Valkey cluster: each
    /// replica agent's instance is seeded from the source whose primary
    /// (`[redis] primary_addr`) is the one it is to replicate (`[redis]
    /// primary`); every replica is matched to a source before anything
    /// starts.
    #[arg(long)]
    pub cluster: bool,
    /// gRPC address of a replica agent (host:port); repeat for each.
    #[arg(long = "replica", required = true)]
    pub replicas: Vec<String>,
    /// Replicas each node (the origin too) serves.
    #[arg(long, default_value_t = 2)]
    pub degree: u32,
    /// Also make each replica's stream log follow the same tree: its
    /// parent, then the rest of the way up to the origin, which it turns
    /// to when the parent fails, continuing from its log's end.
    #[arg(long)]
    pub stream: bool,
    /// The origin's instance; each replica installs into its instance of
    /// the same name (or its only one).
    #[command(flatten)]
    pub instance: InstanceArg,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum TransportArg {
    Tcp,
    Rdma,
    Auto,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// gRPC address of the agent (host:port).
    #[arg(long)]
    pub agent: String,
    /// Only this instance (`status`: default every one).
    #[command(flatten)]
    pub instance: InstanceArg,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum StreamCommand {
    /// Make the server a direct replica of the primary (`REPLICAOF`), by a
    /// partial resync: the stream it was fed is the primary's own. Refused,
    /// with nothing changed, when the primary's backlog no longer holds the
    /// server's offset.
    Release(StreamReleaseArgs),
    /// Take a replica of the primary back onto the agent's stream log,
    /// continued from its offset. Refused, with nothing changed, when the
    /// log does not hold that offset.
    Attach(StreamAttachArgs),
    /// Make the agent's stream log follow these agents from now on,
    /// nearest first; a session that fails turns to the next, from the
    /// log's end. Kept across the agent's restarts.
    Upstream(StreamUpstreamArgs),
    /// After a failover: make the agent's stream log follow the new
    /// primary from now on. The promoted server's own agent follows it as
    /// its replica (call it first: the server must be a primary); every
    /// other agent follows the peer agent whose log follows it. The log
    /// continues from its end, without a full resync, when the new
    /// primary's history holds it. Kept across the agent's restarts.
    Follow(StreamFollowArgs),
}

#[derive(Debug, clap::Args)]
pub struct StreamFollowArgs {
    /// gRPC address of the agent whose log follows (host:port).
    #[arg(long)]
    pub agent: String,
    #[command(flatten)]
    pub instance: InstanceArg,
    /// The new primary (host:port, as its agent's [redis] config names it).
    #[arg(long)]
    pub primary: String,
    /// gRPC address of an agent to look among for the one that follows the
    /// new primary; repeat (default: the instance's [stream] peers).
    #[arg(long = "peer")]
    pub peers: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct StreamUpstreamArgs {
    /// gRPC address of the agent whose log follows (host:port).
    #[arg(long)]
    pub agent: String,
    #[command(flatten)]
    pub instance: InstanceArg,
    /// gRPC address of an upstream agent (host:port); repeat, nearest first.
    #[arg(long = "upstream", required = true)]
    pub upstreams: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct StreamReleaseArgs {
    /// gRPC address of the agent that feeds the server (host:port).
    #[arg(long)]
    pub agent: String,
    #[command(flatten)]
    pub instance: InstanceArg,
    /// The primary (host:port; default: the instance's `[redis] primary`).
    #[arg(long)]
    pub primary: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct StreamAttachArgs {
    /// gRPC address of the agent whose log takes the server back (host:port).
    #[arg(long)]
    pub agent: String,
    #[command(flatten)]
    pub instance: InstanceArg,
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    /// gRPC address of the agent running the sync (host:port).
    #[arg(long)]
    pub agent: String,
    /// The sync id `kvsync sync` printed.
    pub sync_id: String,
}

#[derive(Debug, clap::Args)]
pub struct CheckReplicaArgs {
    /// The primary server (host:port).
    #[arg(long)]
    pub primary: String,
    /// The replica server (host:port).
    #[arg(long)]
    pub replica: String,
    /// Keys to compare, at most: every key when the primary holds no more, else a random sample.
    #[arg(long, default_value_t = 1000)]
    pub sample: usize,
    /// The ACL user to authenticate as (empty: the servers' `default`).
    #[arg(long, env = "KVSYNC_REDIS_USER", default_value = "")]
    pub user: String,
    /// The servers' password (AUTH), if they require one.
    #[arg(
        long,
        env = "KVSYNC_REDIS_PASSWORD",
        hide_env_values = true,
        default_value = ""
    )]
    pub password: String,
    /// A file holding the servers' password (instead of --password).
    #[arg(long)]
    pub password_file: Option<PathBuf>,
    /// Reach both servers over TLS, their certificates chaining to this CA
    /// (PEM).
    #[arg(long)]
    pub server_tls_ca: Option<PathBuf>,
    /// The client certificate (PEM) for servers with `tls-auth-clients`.
    #[arg(long, requires_all = ["server_tls_key", "server_tls_ca"])]
    pub server_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --server-tls-cert.
    #[arg(long, requires = "server_tls_cert")]
    pub server_tls_key: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct CheckConfigArgs {
    /// Configuration file (TOML).
    pub file: PathBuf,
    /// Also log in to every server and Sentinel the configuration names,
    /// as the agent would, and check that each login holds the rights its
    /// role needs (docs/REDIS.md); a missing one is named.
    #[arg(long)]
    pub live: bool,
}

#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// Configuration file whose `[transport]` section to apply (mode,
    /// provider, interface); defaults otherwise.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Size of the generated snapshot.
    #[arg(long, default_value = "256MiB")]
    pub size: ByteSize,
    /// Print a JSON summary instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Configuration file (TOML); defaults apply to everything not set.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Override `node_id`.
    #[arg(long)]
    pub node_id: Option<String>,
    /// Override `snapshot_dir`.
    #[arg(long)]
    pub snapshot_dir: Option<PathBuf>,
    /// Override `[metrics] listen` (empty disables the endpoint).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Override `[grpc] listen`.
    #[arg(long)]
    pub grpc_listen: Option<String>,
    /// Override `[data] tcp_listen`.
    #[arg(long)]
    pub data_listen: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct GenArgs {
    /// Snapshot format to write.
    #[arg(long, value_enum, default_value = "kvr1")]
    pub format: Format,
    /// Exact file size, trailer included: `256MiB`, `1GiB` or plain bytes.
    #[arg(long)]
    pub size: ByteSize,
    /// Sequence number M stored in the header.
    #[arg(long)]
    pub seq: u64,
    /// Seed of the record contents (defaults to the seq).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Creation time stored in the header, unix ms (fixed, so equal
    /// arguments give byte-identical files).
    #[arg(long, default_value_t = 0)]
    pub created_ms: u64,
    /// Output file (written through a temp file and renamed into place).
    pub out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Snapshot file.
    pub file: PathBuf,
    /// Format (detected from the file's first bytes when omitted).
    #[arg(long, value_enum)]
    pub format: Option<Format>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How client commands reach agents: the global TLS and token options.
fn client_dialer(cli: &Cli) -> anyhow::Result<crate::rpc::Dialer> {
    let tokens =
        crate::rpc::auth::Tokens::load(cli.token_file.as_deref()).map_err(anyhow::Error::msg)?;
    let tls = match &cli.tls_ca {
        Some(ca) => Some(crate::rpc::tls::client(
            ca,
            cli.tls_cert.as_deref().zip(cli.tls_key.as_deref()),
            cli.tls_server_name.as_deref().unwrap_or(""),
        )?),
        None => None,
    };
    // The operator chose where to send the token they passed.
    Ok(crate::rpc::Dialer {
        tls,
        tokens,
        token_in_clear: true,
        listed: Vec::new(),
        data_tls: None,
    })
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // Client commands and the demo keep the terminal for their own output.
    let quiet = !matches!(cli.command, Command::Agent(_));
    init_logging(if quiet { "warn" } else { "info" });
    match client_dialer(&cli) {
        Ok(dialer) => client::set_dialer(dialer, cli.tls_cert.is_some()),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Agent(args) => run_agent(args),
        Command::GenSnapshot(args) => gen_snapshot(args),
        Command::Verify(args) => return verify(args),
        Command::Sync(args) => runtime().and_then(|rt| rt.block_on(client::sync(args))),
        Command::Fanout(args) => runtime().and_then(|rt| rt.block_on(client::fanout(args))),
        Command::Status(args) => runtime().and_then(|rt| rt.block_on(client::status(args))),
        Command::Snapshots(args) => runtime().and_then(|rt| rt.block_on(client::snapshots(args))),
        Command::Cancel(args) => runtime().and_then(|rt| rt.block_on(client::cancel(args))),
        Command::Stream(c) => runtime().and_then(|rt| rt.block_on(client::stream(c))),
        Command::Probe(args) => probe(args),
        Command::CheckConfig(args) => check_config(args),
        Command::CheckReplica(args) => runtime().and_then(|rt| rt.block_on(check_replica(args))),
        Command::Demo(args) => runtime().and_then(|rt| rt.block_on(client::demo(args))),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KVSYNC_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// The runtime of every command. For the agent, its blocking pool has a
/// thread for every stream the source may serve at once
/// ([`MAX_SERVED_STREAMS`]), and room for its other blocking work
/// (receiving, installing, loading, scanning); threads start only when
/// needed, so the other commands pay nothing for the room.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(MAX_SERVED_STREAMS + 256)
        .build()
        .context("cannot start the async runtime")
}

/// Loads the config file (if any) and applies command-line overrides.
fn load_config(args: &AgentArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::read(path)?,
        None => Config::default(),
    };
    if let Some(v) = &args.node_id {
        config.node_id = v.clone();
    }
    if let Some(v) = &args.snapshot_dir {
        if !config.instance.is_empty() {
            anyhow::bail!("--snapshot-dir sets the directory of a single-instance configuration; this file has [[instance]] tables, each with its own snapshot_dir");
        }
        config.snapshot_dir = v.clone();
    }
    if let Some(v) = &args.metrics_listen {
        config.metrics.listen = v.clone();
    }
    if let Some(v) = &args.grpc_listen {
        config.grpc.listen = v.clone();
    }
    if let Some(v) = &args.data_listen {
        config.data.tcp_listen = v.clone();
    }
    config.validate().map_err(ConfigError::Invalid)?;
    Ok(config)
}

fn run_agent(args: AgentArgs) -> anyhow::Result<ExitCode> {
    let config = load_config(&args)?;
    let drain_timeout = config.sync.drain_timeout;
    let runtime = runtime()?;
    let code = runtime.block_on(async move {
        let agent = RunningAgent::start(config).await?;
        println!("{}", agent.ready_line());
        // systemd (Type=notify): ready once every listener is up, then
        // watchdog pings at half the configured interval.
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
        if let Some(interval) = sd_notify::watchdog_enabled() {
            let every = interval / 2;
            let stop = agent.shutdown_token();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                while tokio::select! {
                    _ = stop.cancelled() => false,
                    _ = tick.tick() => true,
                } {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
            });
        }
        // SIGHUP re-reads the configuration: tokens, rate limit, cache
        // budget, instances.
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("SIGHUP handler")?;
        let reloads = async {
            while hup.recv().await.is_some() {
                let reloaded = match load_config(&args) {
                    Ok(c) => agent.reload(&c).await,
                    Err(e) => Err(format!("{e:#}")),
                };
                match reloaded {
                    Ok(()) => tracing::info!("SIGHUP: reloaded"),
                    Err(e) => tracing::warn!(error = %e, "SIGHUP: not reloaded; the previous settings stay"),
                }
            }
        };
        let stopped = agent.shutdown_token();
        tokio::select! {
            _ = wait_for_signal() => {}
            _ = stopped.cancelled() => {}
            _ = reloads => {}
        }
        tracing::info!("shutdown requested");
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        agent.drain(drain_timeout).await;
        agent.stop().await;
        tracing::info!("agent stopped");
        Ok::<_, anyhow::Error>(ExitCode::SUCCESS)
    })?;
    // Never hang on a blocking call that outlived its task.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    Ok(code)
}

/// Resolves on SIGINT or SIGTERM.
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn gen_snapshot(args: GenArgs) -> anyhow::Result<ExitCode> {
    if args.format != Format::Kvr1 {
        anyhow::bail!(
            "gen-snapshot writes only the kvr1 format (RDB files come from the server: BGSAVE)"
        );
    }
    let spec = GenSpec {
        size: args.size.as_u64(),
        seq: args.seq,
        created_ms: args.created_ms,
        seed: args.seed.unwrap_or(args.seq),
    };
    let crc = spec.write_file(&args.out)?;
    println!(
        "wrote {} ({} bytes, seq {}, crc32 {crc:#010x})",
        args.out.display(),
        spec.size,
        spec.seq
    );
    Ok(ExitCode::SUCCESS)
}

/// `kvsync check-replica`.
async fn check_replica(args: CheckReplicaArgs) -> anyhow::Result<ExitCode> {
    if args.password_file.is_some() && !args.password.is_empty() {
        anyhow::bail!(
            "give the password by --password-file or --password (KVSYNC_REDIS_PASSWORD), not both"
        );
    }
    let file = args.password_file.clone().unwrap_or_default();
    let tls = args
        .server_tls_ca
        .clone()
        .map(|ca| crate::config::TlsFiles {
            ca,
            cert: args.server_tls_cert.clone().unwrap_or_default(),
            key: args.server_tls_key.clone().unwrap_or_default(),
        });
    let auth = crate::config::ServerAuth::new(&args.user, &args.password, &file).with_tls(tls);
    let report = crate::kv::check::check(&args.primary, &args.replica, &auth, args.sample).await?;
    let escape = |keys: &[String]| -> Vec<String> {
        keys.iter()
            .map(|k| crate::peer_text::escape_controls(k).into_owned())
            .collect()
    };
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "checked": report.checked,
                "mismatches": escape(&report.mismatches),
                "unsettled": escape(&report.unsettled),
            })
        );
    } else {
        println!(
            "checked {} keys: {} differ, {} changed on the primary in every round (not compared)",
            report.checked,
            report.mismatches.len(),
            report.unsettled.len()
        );
        for k in escape(&report.mismatches) {
            println!("  differs: {k}");
        }
    }
    Ok(if report.mismatches.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn check_config(args: CheckConfigArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(&args.file)?;
    for w in config.warnings() {
        eprintln!("warning: {w}");
    }
    println!("{}: ok", args.file.display());
    if !args.live {
        return Ok(ExitCode::SUCCESS);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut ok = true;
    for ic in config.instances() {
        let config = config.for_instance(&ic);
        for login in crate::kv::rights::logins(&config) {
            let found = rt.block_on(crate::kv::rights::missing(
                &login,
                &config.stream.master_name,
            ));
            let (addr, role, auth) = (&login.addr, login.role, &login.auth);
            let verdict = match found {
                Ok(m) if m.is_empty() => "ok".to_string(),
                Ok(m) => format!(
                    "missing {} (docs/REDIS.md gives each role's rights)",
                    m.join(", ")
                ),
                Err(e) => format!("cannot check: {e}"),
            };
            ok &= verdict == "ok";
            println!("{addr} ({role}), as {auth}: {verdict}");
        }
    }
    Ok(match ok {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    })
}

fn probe(args: ProbeArgs) -> anyhow::Result<ExitCode> {
    let config = match &args.config {
        Some(file) => Config::load(file)?,
        None => Default::default(),
    };
    let p = crate::transport::probe::probe_agent(&config);
    if args.json {
        println!("{}", serde_json::to_string(&p)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}", p.reason);
    for d in &p.devices {
        let soft = if d.soft { " (soft)" } else { "" };
        println!("  device {}{soft}", d.name);
        for port in &d.ports {
            let netdev = port.netdev.as_deref().unwrap_or("-");
            println!(
                "    port {}: {} ({}, netdev {netdev})",
                port.port, port.state, port.link_layer
            );
        }
    }
    if let (Some(i), Some(a)) = (&p.interface, p.local_addr) {
        println!("  interface {i}, local address {a}");
    }
    println!("  provider {}", p.provider);
    if p.rdma_available {
        println!(
            "  bulk: chunk {} MiB, pipeline {}, signal every {}",
            p.chunk_mb, p.pipeline, p.signal_batch
        );
    }
    println!("transport mode \"{}\" would use: {}", p.mode, p.choice);
    Ok(ExitCode::SUCCESS)
}

fn verify(args: VerifyArgs) -> ExitCode {
    match snapshot::verify_file(&args.file, args.format) {
        Ok(info) => {
            if args.json {
                let mut v = serde_json::to_value(&info).expect("info serialises");
                v["checksum_ok"] = true.into();
                v["path"] = args.file.display().to_string().into();
                println!("{v}");
            } else if let Some(id) = &info.repl_id {
                let checksum = match info.checksum {
                    0 => "checksum disabled (rdbchecksum no)".to_string(),
                    c => format!("CRC-64 {c:#x} ok"),
                };
                println!(
                    "{}: {} snapshot, {} bytes, repl-id {id}, repl-offset (M) {}, {checksum}",
                    args.file.display(),
                    info.format,
                    info.size,
                    info.seq,
                );
            } else {
                println!(
                    "{}: {} snapshot, {} bytes, seq {}, {} records, checksum {:#x} ok",
                    args.file.display(),
                    info.format,
                    info.size,
                    info.seq,
                    info.records,
                    info.checksum
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            if args.json {
                let v = serde_json::json!({
                    "path": args.file.display().to_string(),
                    "checksum_ok": false,
                    "error": e.to_string(),
                    "reason": e.reason(),
                });
                println!("{v}");
            }
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
