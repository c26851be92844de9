//! The `redis` handoff into a Redis Cluster or Valkey cluster node
//! (docs/REDIS.md, "Cluster mode"). A cluster node refuses `REPLICAOF`
//! and takes its role from its `nodes.conf`, loaded before its data: a
//! node started on its shard primary's RDB with a `nodes.conf` that says
//! `myself,slave <primary>` continues with a partial resync, where
//! `CLUSTER REPLICATE` would full-sync it.
//!
//! This module decides everything first ([`plan`]): what the primary says
//! of its shard (its id, address, slots, config epoch, shard id), and who
//! the local node is. A running server says it itself, and must read the
//! `nodes.conf` kvsync writes; a stopped one by its `nodes.conf`, else by
//! the id the primary's table holds at its address (a node rebuilt after
//! a loss, whose `dir` must then hold no data), else it is new. Only a
//! node with nothing of its own to lose passes (`check_local`): no slot,
//! no open migration, no keys as a primary, not the primary, not another
//! shard's replica. Nothing is stopped before that. Then [`Plan::write`]
//! writes the `nodes.conf` (the node a slot-less replica at epoch 0),
//! [`Plan::hold_failover`] keeps the started node from a failover,
//! [`Plan::join`] makes it known with `CLUSTER MEET` (never `CLUSTER
//! REPLICATE`) and waits until it caught up, and
//! [`Plan::give_failover_back`] restores the failover whatever happened.

use std::path::PathBuf;
use std::time::Duration;

use tracing::info;

use crate::config::{HostPort, RedisConfig, ServerAuth};
use crate::kv::redis::{connect, info as server_info, server_err, until, RedisError};
use crate::kv::seed::{self, Feed};
use crate::snapshot::SnapshotInfo;

/// One line of `CLUSTER NODES` (or of a `nodes.conf`).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeLine {
    pub id: String,
    /// `ip:port@cport[,hostname[,aux…]]` as written.
    pub address: String,
    pub flags: Vec<String>,
    /// The id of the node's primary, or `-`.
    pub master: String,
    pub config_epoch: u64,
    /// Slot ranges owned (`0-5460`, `7`).
    pub slots: Vec<String>,
    /// Open slot migrations, in or out (`[93->-<id>]`, `[93-<-<id>]`).
    pub migrations: Vec<String>,
    /// The link state: `connected` or `disconnected`.
    pub link: String,
}

impl NodeLine {
    /// Parses a node line; `None` for anything else (a `vars` line).
    pub fn parse(line: &str) -> Option<NodeLine> {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[0] == "vars" || !f[1].contains('@') {
            return None;
        }
        Some(NodeLine {
            id: f[0].to_string(),
            address: f[1].to_string(),
            flags: f[2].split(',').map(str::to_string).collect(),
            master: f[3].to_string(),
            config_epoch: f[6].parse().ok()?,
            link: f[7].to_string(),
            slots: f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .map(|s| s.to_string())
                .collect(),
            migrations: f[8..]
                .iter()
                .filter(|s| s.starts_with('['))
                .map(|s| s.to_string())
                .collect(),
        })
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    pub fn is_myself(&self) -> bool {
        self.has("myself")
    }

    pub fn is_master(&self) -> bool {
        self.has("master")
    }

    /// The node is gone in the eyes of the table's owner: failed, without
    /// an address, or its link down.
    pub fn is_lost(&self) -> bool {
        self.has("fail") || self.has("fail?") || self.has("noaddr") || self.link != "connected"
    }

    /// The IP and port clients reach the node at (the IP empty for a node
    /// that never met another).
    pub fn ip_port(&self) -> (&str, u16) {
        let base = self.address.split(['@', ',']).next().unwrap_or("");
        let (ip, port) = base.rsplit_once(':').unwrap_or(("", ""));
        (ip, port.parse().unwrap_or(0))
    }

    /// The cluster bus port.
    pub fn cport(&self) -> Option<u16> {
        let after = self.address.split_once('@')?.1;
        after.split(',').next()?.parse().ok()
    }
}

/// The nodes of a `CLUSTER NODES` reply or a `nodes.conf`.
pub fn parse_nodes(text: &str) -> Vec<NodeLine> {
    text.lines().filter_map(NodeLine::parse).collect()
}

/// The local node's identity, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Identity {
    /// The running server's own `myself` line (`CLUSTER NODES`).
    Running(String),
    /// The `myself` line of the server's `nodes.conf`.
    Config(String),
    /// The id the primary's table holds at the local server's address
    /// (a node rebuilt after losing its files).
    Table(String),
    /// A fresh id: the node is new to the cluster.
    New(String),
}

impl Identity {
    pub fn id(&self) -> &str {
        match self {
            Identity::Running(id)
            | Identity::Config(id)
            | Identity::Table(id)
            | Identity::New(id) => id,
        }
    }

    fn source(&self) -> &'static str {
        match self {
            Identity::Running(_) => "kept from the running server",
            Identity::Config(_) => "kept from its nodes.conf",
            Identity::Table(_) => "kept from the cluster's table at its address",
            Identity::New(_) => "new",
        }
    }
}

/// Everything the cluster handoff does, decided before it acts.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The shard primary's own line, as it answered.
    pub primary: NodeLine,
    /// Its `CLUSTER MYSHARDID` (Redis 7.2+, Valkey); `None` on Redis 7.0.
    pub shard_id: Option<String>,
    /// Its `cluster_current_epoch`.
    pub current_epoch: u64,
    pub me: Identity,
    /// The local server's port, and where its `nodes.conf` goes.
    pub port: u16,
    pub nodes_conf: PathBuf,
    /// The `nodes.conf` there before the handoff, if any.
    pub previous: Option<Vec<u8>>,
    /// This agent's stream feed, when it fills the gap the primary's
    /// backlog no longer holds ([`Plan::fill_gap`]): the `nodes.conf`
    /// gives it as the primary's address until the node meets the cluster.
    pub via: Option<std::net::SocketAddr>,
}

fn refuse(message: String) -> RedisError {
    RedisError::Cluster(message)
}

/// `e`'s text, without the `cluster:` its variant adds (for wrapping).
pub fn message(e: &RedisError) -> String {
    match e {
        RedisError::Cluster(m) => m.clone(),
        e => e.to_string(),
    }
}

/// A fresh node id: 40 random hex digits, as the servers make them.
fn fresh_id() -> String {
    use rand::Rng;
    let bytes: [u8; 20] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn query<T: redis::FromRedisValue>(
    addr: &str,
    con: &mut redis::aio::MultiplexedConnection,
    args: &[&str],
) -> Result<T, RedisError> {
    redis::cmd(args[0])
        .arg(&args[1..])
        .query_async(con)
        .await
        .map_err(|e| server_err(addr, e))
}

/// Where the server's `cluster-config-file` is.
fn nodes_conf_path(cfg: &RedisConfig) -> PathBuf {
    cfg.dir.join(&cfg.cluster_config_file)
}

/// At the start of a `redis` instance with a stream feed: a node whose
/// `masterauth` is the feed's password was left midway through a gap fill
/// ([`Plan::fill_gap`]) by an agent that stopped; it follows the feed,
/// outside the cluster. Says so and what to do, once the server answers
/// (asked every few seconds until it does, or `stop`).
pub async fn left_mid_gap(cfg: RedisConfig, feed: Feed, stop: tokio_util::sync::CancellationToken) {
    let server = cfg.server_addr.as_str();
    loop {
        let asked = async {
            let mut con = connect(server, &cfg.auth()).await?;
            seed::config_get(&mut con, server, "masterauth").await
        };
        if let Ok(auth) = asked.await {
            if auth == feed.secret {
                tracing::warn!(
                    server,
                    kept = %feed.server_auth.display(),
                    "the local cluster node was left midway through a seeding whose gap this agent's stream log fills: it follows this agent's feed, outside the cluster, with the feed's password as its masterauth (its own is kept in the file named); sync it again to finish its seeding"
                );
            }
            return;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// Whether the server at `addr` runs in cluster mode (`INFO cluster`).
pub async fn enabled(addr: &str, auth: &ServerAuth) -> Result<bool, RedisError> {
    let cluster = server_info(addr, auth, "cluster").await?;
    Ok(cluster.get("cluster_enabled") == Some("1"))
}

/// Decides the cluster handoff: `None` when the primary does not run in
/// cluster mode; a refusal when acting would hurt the cluster. Reads only.
pub async fn plan(cfg: &RedisConfig) -> Result<Option<Plan>, RedisError> {
    let auth = cfg.auth();
    if !enabled(&cfg.primary, &auth).await? {
        return Ok(None);
    }
    let spelled = |a: &String| {
        let a = a.to_ascii_lowercase();
        a.contains("replicaof") || a.contains("slaveof")
    };
    if cfg.start.iter().any(spelled) {
        return Err(refuse(
            "the primary runs in cluster mode, where a server refuses to start with replicaof: remove it from [redis] start (the node follows its primary from its nodes.conf)".into(),
        ));
    }
    let addr = &cfg.primary;
    let mut con = connect(addr, &auth).await?;
    let nodes: String = query(addr, &mut con, &["CLUSTER", "NODES"]).await?;
    let table = parse_nodes(&nodes);
    let Some(primary) = table.iter().find(|n| n.is_myself()).cloned() else {
        return Err(server_err(addr, "CLUSTER NODES has no myself line"));
    };
    if !primary.is_master() || primary.slots.is_empty() {
        return Err(refuse(format!(
            "[redis] primary {addr} is not a shard primary owning slots (flags {}): point it at the primary of the shard the node is to replicate",
            primary.flags.join(",")
        )));
    }
    let shard_id = match query::<String>(addr, &mut con, &["CLUSTER", "MYSHARDID"]).await {
        Ok(id) => Some(id),
        // Redis 7.0 has no shard ids.
        Err(e)
            if e.to_string()
                .to_ascii_lowercase()
                .contains("unknown subcommand") =>
        {
            None
        }
        Err(e) => return Err(e),
    };
    let info: String = query(addr, &mut con, &["CLUSTER", "INFO"]).await?;
    let current_epoch = crate::kv::redis::Info::parse(&info).num("cluster_current_epoch");
    let port = cfg
        .server_addr
        .parse::<HostPort>()
        .map(|a| a.port)
        .map_err(|e| refuse(format!("[redis] server_addr: {e}")))?;
    let me = identity(cfg, &auth, &mut con, (&table, &primary.id), port).await?;
    let nodes_conf = nodes_conf_path(cfg);
    writable(&nodes_conf)?;
    writable(&cfg.dir.join(&cfg.dbfilename))?;
    let previous = match std::fs::read(&nodes_conf) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(refuse(format!("reading {}: {e}", nodes_conf.display()))),
    };
    Ok(Some(Plan {
        primary,
        shard_id,
        current_epoch,
        me,
        port,
        nodes_conf,
        previous,
        via: None,
    }))
}

/// Refuses a node that the handoff must not make `primary`'s replica: a
/// primary owning slots or with a slot migration open (its keys are the
/// cluster's only copy), the primary itself, or a replica of another
/// shard (moving it is the operator's call; it may be that shard's last).
fn check_local(node: &NodeLine, primary: &str, said_by: &str) -> Result<(), RedisError> {
    let why = if node.id == primary {
        "the shard primary itself".to_string()
    } else if !node.slots.is_empty() || !node.migrations.is_empty() {
        format!(
            "a primary owning slots {} (open migrations: {})",
            node.slots.join(" "),
            node.migrations.join(" ")
        )
    } else if !node.is_master() && node.master != "-" && node.master != primary {
        format!(
            "a replica of {}, another shard's primary: moving it is the operator's call (CLUSTER RESET it first)",
            node.master
        )
    } else {
        return Ok(());
    };
    Err(refuse(format!(
        "{said_by}: the local server is node {}, {why}; kvsync seeds only a new node, one rebuilt after a loss, or a replica of this shard",
        node.id
    )))
}

/// Fails unless a file can be created beside `path` (the write that
/// would follow the server's stop).
fn writable(path: &std::path::Path) -> Result<(), RedisError> {
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    tempfile::Builder::new()
        .prefix(crate::store::install::TEMP_PREFIX)
        .tempfile_in(dir)
        .map(drop)
        .map_err(|e| refuse(format!("cannot write in {}: {e}", dir.display())))
}

/// The data a server left in `dir`, if any: its RDB, or any `.rdb` or
/// `.aof` file, at the top or one directory down (`appenddirname`). A
/// directory that cannot be read is a refusal, not "no data".
fn data_in(dir: &std::path::Path, dbfilename: &str) -> Result<Option<String>, RedisError> {
    let cannot = |p: &std::path::Path, e: std::io::Error| {
        refuse(format!(
            "cannot tell whether {} holds data: {e}",
            p.display()
        ))
    };
    if dir
        .join(dbfilename)
        .try_exists()
        .map_err(|e| cannot(dir, e))?
    {
        return Ok(Some(dbfilename.to_string()));
    }
    let entries = |d: &std::path::Path| -> Result<Vec<std::path::PathBuf>, RedisError> {
        match std::fs::read_dir(d) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(cannot(d, e)),
            Ok(r) => r
                .map(|e| e.map(|e| e.path()).map_err(|e| cannot(d, e)))
                .collect(),
        }
    };
    for p in entries(dir)? {
        let inside = match p.is_dir() {
            true => entries(&p)?,
            false => vec![p],
        };
        if let Some(p) = inside
            .into_iter()
            .find(|p| p.extension().is_some_and(|e| e == "rdb" || e == "aof"))
        {
            return Ok(Some(p.display().to_string()));
        }
    }
    Ok(None)
}

/// The keys in every database of an `INFO keyspace` reply.
fn keys_in(keyspace: &str) -> u64 {
    keyspace
        .lines()
        .filter_map(|l| {
            l.split_once("keys=")?
                .1
                .split(',')
                .next()?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Whether a server listens at `addr`: refused is "no"; an error that
/// proves nothing either way is a refusal of the handoff.
async fn answers(addr: &str) -> Result<bool, RedisError> {
    match tokio::net::TcpStream::connect(addr).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(false),
        Err(e) => Err(refuse(format!(
            "cannot tell whether the local server at {addr} is running: {e}"
        ))),
    }
}

/// Who the local node is, or a refusal. A server that answers at the
/// address says it itself (its `CLUSTER NODES`), and must read the
/// `nodes.conf` kvsync would write; one that answers but cannot say is
/// refused. A stopped server: its `nodes.conf`'s `myself`; without one,
/// its `dir` must hold no data (kvsync cannot tell which node owned it),
/// and the id the primary's table holds at this host's address is kept
/// (a node rebuilt after a loss); else a fresh one.
async fn identity(
    cfg: &RedisConfig,
    auth: &ServerAuth,
    primary_con: &mut redis::aio::MultiplexedConnection,
    (table, primary): (&[NodeLine], &str),
    port: u16,
) -> Result<Identity, RedisError> {
    let local = cfg.server_addr.as_str();
    // What the cluster says of a node that says who it is.
    let in_table = |id: &str| match table.iter().find(|n| n.id == id) {
        Some(n) => check_local(n, primary, "the cluster's table"),
        None => Ok(()),
    };
    if answers(local).await? {
        if let Some(me) = running_node(cfg, auth, primary).await? {
            in_table(&me.id)?;
            return Ok(Identity::Running(me.id));
        }
    }
    let path = nodes_conf_path(cfg);
    let data = data_in(&cfg.dir, &cfg.dbfilename)?;
    match std::fs::read_to_string(&path) {
        Ok(text) => match parse_nodes(&text).into_iter().find(NodeLine::is_myself) {
            Some(me) => {
                check_local(&me, primary, &path.display().to_string())?;
                in_table(&me.id)?;
                if let Some(n) = table.iter().find(|n| n.id == me.id && !n.is_lost()) {
                    return Err(refuse(format!(
                        "{}: the local server is node {}, which the cluster sees alive at {}: another server has its id, or it stopped only now (retry once the cluster marks it down)",
                        path.display(),
                        me.id,
                        n.address
                    )));
                }
                if let Some(data) = data.filter(|_| me.is_master()) {
                    return Err(refuse(format!(
                        "{}: the local server is node {}, a primary, stopped with {data}: kvsync cannot count its keys; start it, or empty {}",
                        path.display(),
                        me.id,
                        cfg.dir.display()
                    )));
                }
                return Ok(Identity::Config(me.id));
            }
            None => return Err(refuse(format!("{} names no myself node", path.display()))),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(refuse(format!("reading {}: {e}", path.display()))),
    }
    if let Some(data) = data {
        return Err(refuse(format!(
            "kvsync cannot ask the local server which node it is, and {} holds {data} but no {}: kvsync cannot tell which node's data it is; start the server, or set [redis] cluster_config_file to its cluster-config-file",
            cfg.dir.display(),
            cfg.cluster_config_file.display()
        )));
    }
    // The address this host has in the primary's eyes: its own view of
    // the agent's connection, which comes from the same host.
    let client: String = query(&cfg.primary, primary_con, &["CLIENT", "INFO"]).await?;
    let ip = client
        .split_whitespace()
        .find_map(|f| f.strip_prefix("addr="))
        .and_then(|a| a.rsplit_once(':'))
        .map(|(ip, _)| ip.to_string())
        .ok_or_else(|| {
            server_err(
                &cfg.primary,
                format!("CLIENT INFO names no addr= kvsync can read: {client:?}"),
            )
        })?;
    let said_by = format!("the cluster's table at {ip}:{port}");
    let mut at_address = table
        .iter()
        .filter(|n| !n.is_myself() && n.ip_port() == (ip.as_str(), port));
    match at_address.next() {
        None => Ok(Identity::New(fresh_id())),
        Some(n) => {
            for n in std::iter::once(n).chain(at_address) {
                check_local(n, primary, &said_by)?;
                if !n.is_lost() {
                    return Err(refuse(format!(
                        "{said_by}: node {} there is alive, but the local server does not answer: another server has this address in the cluster's eyes (a shared egress address?); kvsync will not give its id to a second node",
                        n.id
                    )));
                }
            }
            Ok(Identity::Table(n.id.clone()))
        }
    }
}

/// The running local server's own node line; `None` for a server without
/// cluster mode that holds no key (the start command brings it up in
/// cluster mode). A server that cannot say who it is, one whose
/// `cluster-config-file` is not the one kvsync would write, and one that
/// holds keys as a primary are refused.
async fn running_node(
    cfg: &RedisConfig,
    auth: &ServerAuth,
    primary: &str,
) -> Result<Option<NodeLine>, RedisError> {
    let local = cfg.server_addr.as_str();
    let cannot = |e: RedisError| {
        refuse(format!(
            "the local server answers at {local} but cannot be asked which node it is: {e}"
        ))
    };
    let mut con = connect(local, auth).await.map_err(cannot)?;
    let keyspace: String = query(local, &mut con, &["INFO", "keyspace"])
        .await
        .map_err(cannot)?;
    let keys = keys_in(&keyspace);
    let (me, its_primary) = match query::<String>(local, &mut con, &["CLUSTER", "NODES"]).await {
        Ok(nodes) => {
            let nodes = parse_nodes(&nodes);
            let its_primary = nodes.iter().find(|n| n.id == primary).cloned();
            (nodes.into_iter().find(NodeLine::is_myself), its_primary)
        }
        Err(e) if e.to_string().contains("cluster support disabled") => {
            if keys > 0 {
                return Err(refuse(format!(
                    "the local server at {local} runs without cluster mode and holds {keys} keys: kvsync will not replace them with a shard's data; empty or stop it first"
                )));
            }
            return Ok(None);
        }
        Err(e) => return Err(cannot(e)),
    };
    let me = me.ok_or_else(|| cannot(server_err(local, "CLUSTER NODES has no myself line")))?;
    check_local(&me, primary, "the running server")?;
    if let Some(p) = its_primary.filter(|p| !me.is_master() && me.master == p.id && p.is_lost()) {
        return Err(refuse(format!(
            "the running server: the local server is node {}, a replica of {} which it sees as {} ({}): it may be the shard's standby; kvsync will not stop it now",
            me.id,
            p.id,
            p.flags.join(","),
            p.link
        )));
    }
    if me.is_master() && keys > 0 {
        return Err(refuse(format!(
            "the running server: the local server is node {}, a primary holding {keys} keys; kvsync will not replace them with a shard's data",
            me.id
        )));
    }
    let mut config_get = async |name: &str| {
        let pair: Vec<String> = query(local, &mut con, &["CONFIG", "GET", name])
            .await
            .map_err(cannot)?;
        Ok::<_, RedisError>(pair.get(1).cloned().unwrap_or_default())
    };
    let (dir, file) = (
        config_get("dir").await?,
        config_get("cluster-config-file").await?,
    );
    let (appendonly, dbfilename) = (
        config_get("appendonly").await?,
        config_get("dbfilename").await?,
    );
    if appendonly != "no" || dbfilename != cfg.dbfilename {
        return Err(refuse(format!(
            "the local server runs with appendonly {appendonly} and dbfilename {dbfilename}: it would not load the RDB kvsync places as {}; start it with appendonly no and that dbfilename",
            cfg.dbfilename
        )));
    }
    let canonical =
        |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let theirs = canonical(std::path::Path::new(&dir)).join(&file);
    if theirs != canonical(&cfg.dir).join(&cfg.cluster_config_file) {
        return Err(refuse(format!(
            "the local server reads its node from {}, not {}: set [redis] dir and cluster_config_file to its dir and cluster-config-file",
            theirs.display(),
            nodes_conf_path(cfg).display()
        )));
    }
    Ok(Some(me))
}

impl Plan {
    /// The `nodes.conf` that makes the node a slot-less replica of the
    /// shard primary at config epoch 0 (it can claim no slot), with the
    /// primary as the one node it knows. With [`Plan::via`], the primary's
    /// line gives the feed's address, and bus port 0: the node replicates
    /// from the feed and reaches no node on the cluster bus until the
    /// `CLUSTER MEET`, whose answer gives it the primary's own address.
    pub fn nodes_conf_text(&self) -> String {
        let p = &self.primary;
        let aux = |address: String| match &self.shard_id {
            None => address,
            // Valkey and Redis 7.2+ write `address,hostname,aux=…`; the
            // node and its primary must agree on the shard.
            Some(sid) => {
                let hostname_given = address.contains(',');
                format!(
                    "{address}{}shard-id={sid}",
                    if hostname_given { "," } else { ",," }
                )
            }
        };
        let cport = u32::from(self.port) + 10000;
        format!(
            "{} {} myself,slave {} 0 0 0 connected\n{} {} master - 0 0 {} connected {}\nvars currentEpoch {} lastVoteEpoch 0\n",
            self.me.id(),
            aux(format!(":{}@{cport}", self.port)),
            p.id,
            p.id,
            aux(match self.via {
                None => p.address.clone(),
                Some(feed) => {
                    let after_cport = p.address.find(',').map_or("", |i| &p.address[i..]);
                    format!("{}:{}@0{after_cport}", feed.ip(), feed.port())
                }
            }),
            p.config_epoch,
            p.slots.join(" "),
            self.current_epoch,
        )
    }

    /// Writes the node's `nodes.conf` atomically (the server is stopped).
    ///
    /// The server opens the file for writing (its lock): it gets the old
    /// file's mode and owner, else mode 0660 and, when the agent runs as
    /// root, its directory's owner.
    pub fn write(&self) -> std::io::Result<()> {
        self.write_text(self.nodes_conf_text().as_bytes())
    }

    /// Puts back the `nodes.conf` there was before the handoff, or
    /// removes the one written if there was none.
    pub fn restore(&self) -> std::io::Result<()> {
        match self.previous.as_deref() {
            Some(text) => self.write_text(text),
            None => match std::fs::remove_file(&self.nodes_conf) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
    }

    fn write_text(&self, text: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let path = &self.nodes_conf;
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        let like = std::fs::metadata(path).ok();
        let mode = like.as_ref().map_or(0o660, |m| m.mode() & 0o777);
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let owner = match (root, like.or_else(|| std::fs::metadata(dir).ok())) {
            (true, Some(m)) => Some((m.uid(), m.gid())),
            _ => None,
        };
        let temp = (
            crate::store::install::TEMP_PREFIX,
            crate::store::install::TEMP_SUFFIX,
        );
        crate::sys::fs::write_atomic_as(path, text, temp, mode, owner)
    }

    /// Whether the server was running when the plan was made.
    pub fn was_running(&self) -> bool {
        matches!(self.me, Identity::Running(_))
    }

    /// Refuses, right before the stop, a server that started since the
    /// plan found it stopped: what it is now was not checked.
    pub async fn still_as_planned(&self, cfg: &RedisConfig) -> Result<(), RedisError> {
        if !self.was_running() && answers(&cfg.server_addr).await? {
            return Err(refuse(format!(
                "the local server at {} started after kvsync found it stopped: nothing was changed; try again",
                cfg.server_addr
            )));
        }
        Ok(())
    }

    /// Keeps the started node from starting a failover until it has
    /// caught up; returns the operator's `cluster-replica-no-failover`.
    pub async fn hold_failover(
        &self,
        cfg: &RedisConfig,
        timeout: Duration,
    ) -> Result<String, RedisError> {
        let (local, auth) = (cfg.server_addr.clone(), cfg.auth());
        let mut con = until("the started server to answer", timeout, || {
            let (local, auth) = (local.clone(), auth.clone());
            async move { connect(&local, &auth).await.ok() }
        })
        .await?;
        let pair: Vec<String> = query(
            &local,
            &mut con,
            &["CONFIG", "GET", "cluster-replica-no-failover"],
        )
        .await?;
        query::<()>(
            &local,
            &mut con,
            &["CONFIG", "SET", "cluster-replica-no-failover", "yes"],
        )
        .await?;
        Ok(pair.get(1).cloned().unwrap_or_else(|| "no".into()))
    }

    /// Feeds the started node from this agent's stream `feed` (the
    /// primary's address in its `nodes.conf`, [`Plan::via`]) until it
    /// holds an offset the primary's backlog holds: the feed's password
    /// as its `masterauth` (its own kept in the feed's file) until the
    /// feed continues it past the RDB and it has caught up with where the
    /// primary was then; its own `masterauth` back before anything else,
    /// on failure too. The primary is never asked for the gap. Returns
    /// the offset the node was fed to.
    pub async fn fill_gap(
        &self,
        cfg: &RedisConfig,
        timeout: Duration,
        feed: &Feed,
        snapshot: &SnapshotInfo,
    ) -> Result<u64, RedisError> {
        let (local, auth) = (cfg.server_addr.as_str(), cfg.auth());
        let mut con = connect(local, &auth).await?;
        let was = server_info(local, &auth, "replication").await?;
        let (_, own) = seed::take_auth(&mut con, local, &was, feed).await?;
        // Left with the feed's by an earlier agent: its own is the kept one.
        let own = match own == feed.secret {
            false => own,
            true => seed::own_auth(feed)?.ok_or_else(|| {
                refuse(format!(
                    "the node's masterauth is this agent's feed's and its own was not kept in {}: set it back yourself",
                    feed.server_auth.display()
                ))
            })?,
        };
        // Linked to the feed's port at the feed's IP, not at another host
        // the cluster bus gossiped meanwhile.
        let from_feed = |what: &'static str, from: u64| async move {
            let i = seed::following(cfg, timeout, what, feed.addr.port(), from).await?;
            let host = i.get("master_host").unwrap_or("");
            match host == feed.addr.ip().to_string() {
                true => Ok(i.num("master_repl_offset")),
                false => Err(refuse(format!(
                    "the node follows {host}:{}, not this agent's feed {}: something on the cluster bus gave it another address for its primary; it was not joined",
                    feed.addr.port(),
                    feed.addr
                ))),
            }
        };
        let fed = async {
            seed::config_set(&mut con, local, "masterauth", &feed.secret).await?;
            from_feed("the node to follow this agent's stream feed", snapshot.seq).await?;
            let target = server_info(&cfg.primary, &auth, "replication")
                .await?
                .num("master_repl_offset");
            let what = "the node to catch up with the primary through the feed";
            let at = from_feed(what, target).await?;
            let repl = server_info(&cfg.primary, &auth, "replication").await?;
            match repl.backlog() {
                Some(held) if held.contains(&(at + 1)) => Ok(at),
                _ => Err(refuse(format!(
                    "the node caught up to offset {at} through this agent's stream log, but the primary's backlog no longer holds {}: it writes faster than its repl-backlog-size covers the hand-over. Grow it and sync again; the node was not joined",
                    at + 1
                ))),
            }
        }
        .await;
        let back = seed::config_set(&mut con, local, "masterauth", &own).await;
        if back.is_ok() {
            let _ = std::fs::remove_file(&feed.server_auth);
        }
        match (fed, back) {
            (Ok(at), Ok(())) => {
                info!(from = snapshot.seq + 1, to = at, "the node was fed the gap from the stream log");
                Ok(at)
            }
            (Ok(_), Err(e)) => Err(refuse(format!(
                "the node was fed the gap, but its masterauth is still this agent's feed's (set it back yourself; it is kept in {}): {e}",
                feed.server_auth.display()
            ))),
            (Err(e), Ok(())) => Err(e),
            (Err(e), Err(back)) => Err(refuse(format!(
                "{} (and its masterauth is still this agent's feed's: set it back yourself, it is kept in {}: {back})",
                message(&e),
                feed.server_auth.display()
            ))),
        }
    }

    /// Makes the node known to the cluster (`CLUSTER MEET` to the primary
    /// from the node), then waits until the primary lists it as its
    /// replica and until it holds the primary's offset.
    pub async fn join(&self, cfg: &RedisConfig, timeout: Duration) -> Result<String, RedisError> {
        let (local, auth) = (cfg.server_addr.as_str(), cfg.auth());
        let (ip, port) = self.primary.ip_port();
        let ip = match ip {
            "" => cfg
                .primary
                .parse::<HostPort>()
                .map(|a| a.host)
                .unwrap_or_default(),
            ip => ip.to_string(),
        };
        let mut con = connect(local, &auth).await?;
        let port = port.to_string();
        let mut meet = vec!["CLUSTER", "MEET", ip.as_str(), port.as_str()];
        let cport = self.primary.cport().map(|c| c.to_string());
        meet.extend(cport.as_deref());
        query::<()>(local, &mut con, &meet).await?;
        let me = self.me.id().to_string();
        let primary_id = self.primary.id.clone();
        until(
            "the primary to list the node as its replica",
            timeout,
            || {
                let (auth, me, primary_id) = (auth.clone(), me.clone(), primary_id.clone());
                async move {
                    let mut con = connect(&cfg.primary, &auth).await.ok()?;
                    let nodes: String = query(&cfg.primary, &mut con, &["CLUSTER", "NODES"])
                        .await
                        .ok()?;
                    parse_nodes(&nodes)
                        .iter()
                        .any(|n| n.id == me && !n.is_master() && n.master == primary_id)
                        .then_some(())
                }
            },
        )
        .await?;
        let target = server_info(&cfg.primary, &auth, "replication")
            .await?
            .num("master_repl_offset");
        until("the node to catch up with its primary", timeout, || {
            let auth = auth.clone();
            async move {
                let repl = server_info(local, &auth, "replication").await.ok()?;
                (repl.get("master_link_status") == Some("up")
                    && repl.num("slave_repl_offset") >= target)
                    .then_some(())
            }
        })
        .await?;
        info!(node = %me, primary = %primary_id, "cluster node joined as a replica");
        Ok(format!(
            "; cluster node {me} ({}) joined as a replica of {primary_id} by CLUSTER MEET, caught up at offset {target}",
            self.me.source()
        ))
    }

    /// Gives the node its own `cluster-replica-no-failover` back, whatever
    /// `outcome` was; a failure says whether that worked.
    pub async fn give_failover_back(
        &self,
        cfg: &RedisConfig,
        no_failover: &str,
        outcome: Result<String, RedisError>,
    ) -> Result<String, RedisError> {
        let local = cfg.server_addr.as_str();
        let back = async {
            let mut con = connect(local, &cfg.auth()).await?;
            query::<()>(
                local,
                &mut con,
                &["CONFIG", "SET", "cluster-replica-no-failover", no_failover],
            )
            .await
        }
        .await;
        match (outcome, back) {
            (Ok(done), Ok(())) => Ok(done),
            (Ok(_), Err(e)) => Err(refuse(format!(
                "the node joined, but its cluster-replica-no-failover is still yes (set it back to {no_failover}): {e}"
            ))),
            (Err(e), Ok(())) => Err(refuse(format!(
                "{} (the node's cluster-replica-no-failover is back to {no_failover})",
                message(&e)
            ))),
            (Err(e), Err(back)) => Err(refuse(format!(
                "{} (the node's cluster-replica-no-failover is still yes, set it back to {no_failover}: {back})",
                message(&e)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const VALKEY: &str = "\
c9d8 127.0.0.1:7001@17001,,tls-port=0,shard-id=f980 myself,master - 0 0 1 connected 0-5460 [93->-b6f2]
7c9e 127.0.0.1:7004@17004,,tls-port=0,shard-id=f980 slave,fail c9d8 0 1796664268871 1 connected
b6f2 10.0.0.2:7002@17002,host-b master - 0 1796664268568 2 connected 5461-10922
vars currentEpoch 3 lastVoteEpoch 0
";

    #[test]
    fn node_lines_are_read_with_their_addresses_flags_and_slots() {
        let nodes = parse_nodes(VALKEY);
        assert_eq!(nodes.len(), 3, "the vars line is not a node");
        let me = &nodes[0];
        assert!(me.is_myself() && me.is_master());
        assert_eq!(
            me.slots,
            ["0-5460"],
            "an open migration is not a slot owned"
        );
        assert_eq!(me.ip_port(), ("127.0.0.1", 7001));
        assert_eq!(me.cport(), Some(17001));
        assert_eq!(nodes[1].master, "c9d8");
        assert!(!nodes[1].is_master());
        assert_eq!(nodes[2].ip_port(), ("10.0.0.2", 7002));
        assert_eq!(nodes[2].config_epoch, 2);
        assert_eq!(NodeLine::parse(":7005@17005 myself"), None);
    }

    fn plan(shard_id: Option<&str>, primary: &str) -> Plan {
        Plan {
            primary: NodeLine::parse(primary).unwrap(),
            shard_id: shard_id.map(str::to_string),
            current_epoch: 3,
            me: Identity::New("beef".into()),
            port: 7005,
            nodes_conf: PathBuf::from("nodes.conf"),
            previous: None,
            via: None,
        }
    }

    /// The written file makes the node a slot-less replica at epoch 0 of
    /// the primary, in the same shard, and is read back as such.
    #[test]
    fn the_written_nodes_conf_makes_a_slotless_replica_of_the_shard_primary() {
        let p = plan(
            Some("f980"),
            "c9d8 127.0.0.1:7001@17001 myself,master - 0 0 0 connected 0-5460 [93->-b6f2]",
        );
        let text = p.nodes_conf_text();
        assert_eq!(
            text,
            "beef :7005@17005,,shard-id=f980 myself,slave c9d8 0 0 0 connected\n\
             c9d8 127.0.0.1:7001@17001,,shard-id=f980 master - 0 0 0 connected 0-5460\n\
             vars currentEpoch 3 lastVoteEpoch 0\n"
        );
        let back = parse_nodes(&text);
        assert!(back[0].is_myself() && !back[0].is_master() && back[0].slots.is_empty());
        assert_eq!(back[0].config_epoch, 0);
        // Redis 7.0 has no shard id, and a hostname is kept.
        let p = plan(
            None,
            "c9d8 10.0.0.1:7001@17001,host-a myself,master - 0 0 4 connected 0-5460",
        );
        assert_eq!(
            p.nodes_conf_text().lines().nth(1),
            Some("c9d8 10.0.0.1:7001@17001,host-a master - 0 0 4 connected 0-5460")
        );
        let p = plan(
            Some("f980"),
            "c9d8 10.0.0.1:7001@17001,host-a myself,master - 0 0 4 connected 0-5460",
        );
        assert!(p
            .nodes_conf_text()
            .contains("@17001,host-a,shard-id=f980 master"));
    }

    /// Filling a gap, the primary's line gives the feed's address and no
    /// bus port, with the primary's id, hostname, shard, epoch and slots.
    #[test]
    fn a_gap_filled_by_the_agent_points_the_nodes_primary_at_the_feed() {
        let mut p = plan(
            Some("f980"),
            "c9d8 10.0.0.1:7001@17001,host-a myself,master - 0 0 4 connected 0-5460",
        );
        p.via = Some("127.0.0.1:6400".parse().unwrap());
        let text = p.nodes_conf_text();
        assert_eq!(
            text.lines().nth(1),
            Some("c9d8 127.0.0.1:6400@0,host-a,shard-id=f980 master - 0 0 4 connected 0-5460"),
            "{text}"
        );
        let back = parse_nodes(&text);
        assert_eq!(
            (back[1].ip_port(), back[1].cport()),
            (("127.0.0.1", 6400), Some(0))
        );
        assert_eq!(back[0].master, "c9d8");
    }

    /// Only a node with nothing of its own to lose may be made the
    /// primary's replica: a new or empty one, or a replica of this shard.
    #[test]
    fn only_a_node_with_nothing_to_lose_passes_the_local_check() {
        let node = |line: &str| NodeLine::parse(line).unwrap();
        let passes = |line: &str| check_local(&node(line), "c9d8", "test").is_ok();
        assert!(passes("beef :7005@17005 myself,master - 0 0 0 connected"));
        assert!(passes("beef :7005@17005 myself,slave c9d8 0 0 1 connected"));
        assert!(passes("beef :7005@17005 slave,fail - 0 0 0 disconnected"));
        for (refused, why) in [
            (
                "c9d8 :7001@17001 myself,master - 0 0 1 connected",
                "the shard primary itself",
            ),
            (
                "beef :7005@17005 myself,master - 0 0 2 connected 5461-10922",
                "owning slots 5461-10922",
            ),
            (
                "beef :7005@17005 myself,master - 0 0 0 connected [6000-<-b6f2]",
                "open migrations: [6000-<-b6f2]",
            ),
            (
                "beef :7005@17005 myself,slave b6f2 0 0 2 connected",
                "a replica of b6f2, another shard's primary",
            ),
        ] {
            let said = check_local(&node(refused), "c9d8", "test")
                .unwrap_err()
                .to_string();
            assert!(
                said.contains(why) && said.contains("kvsync seeds only a new node"),
                "{said}"
            );
        }
    }

    /// A rewritten `nodes.conf` keeps the mode and owner of the one it
    /// replaces: the server, another user, opens it for writing.
    #[test]
    fn the_nodes_conf_keeps_the_old_files_mode_and_owner() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nodes.conf");
        let mut p = plan(
            None,
            "c9d8 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460",
        );
        p.nodes_conf = path.clone();
        p.write().unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o660);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if root {
            std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        }
        p.write().unwrap();
        assert_eq!(mode(&path), 0o600);
        if root {
            let m = std::fs::metadata(&path).unwrap();
            assert_eq!((m.uid(), m.gid()), (65534, 65534));
        } else {
            eprintln!("not root: the owner half of this test is not run");
        }
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .contains("myself,slave c9d8"));
    }

    /// A server's data is found in its `dir` under any name it uses; its
    /// log and pid file are not data.
    #[test]
    fn a_servers_data_is_found_under_any_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("redis.log"), b"log").unwrap();
        std::fs::write(dir.path().join("redis.pid"), b"1").unwrap();
        assert_eq!(data_in(dir.path(), "dump.rdb").unwrap(), None);
        let aof = dir.path().join("my-aof-dir");
        std::fs::create_dir(&aof).unwrap();
        std::fs::write(aof.join("appendonly.aof.1.incr.aof"), b"*1").unwrap();
        assert!(data_in(dir.path(), "dump.rdb")
            .unwrap()
            .is_some_and(|d| d.ends_with("incr.aof")));
        std::fs::write(dir.path().join("dump.rdb"), b"REDIS").unwrap();
        assert_eq!(
            data_in(dir.path(), "dump.rdb").unwrap().as_deref(),
            Some("dump.rdb")
        );
    }

    #[test]
    fn keys_are_counted_in_every_database() {
        let keyspace = "# Keyspace\r\ndb0:keys=0,expires=0,avg_ttl=0\r\ndb1:keys=100,expires=0,avg_ttl=0\r\ndb9:keys=7,expires=1,avg_ttl=5\r\n";
        assert_eq!(keys_in(keyspace), 107);
        assert_eq!(keys_in("# Keyspace\r\n"), 0);
    }

    #[test]
    fn a_node_is_lost_when_failed_addressless_or_disconnected() {
        let lost = |line: &str| NodeLine::parse(line).unwrap().is_lost();
        assert!(!lost(
            "beef 127.0.0.1:7005@17005 slave c9d8 0 0 1 connected"
        ));
        assert!(lost(
            "beef 127.0.0.1:7005@17005 slave,fail c9d8 0 0 1 connected"
        ));
        assert!(lost(
            "beef 127.0.0.1:7005@17005 slave,fail? c9d8 0 0 1 connected"
        ));
        assert!(lost("beef :0@0 slave,noaddr c9d8 0 0 1 connected"));
        assert!(lost(
            "beef 127.0.0.1:7005@17005 slave c9d8 0 0 1 disconnected"
        ));
    }

    /// A handoff that cannot place its RDB puts the old `nodes.conf`
    /// back, or removes the one it wrote.
    #[test]
    fn the_old_nodes_conf_is_put_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = plan(
            None,
            "c9d8 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460",
        );
        p.nodes_conf = dir.path().join("nodes.conf");
        p.write().unwrap();
        p.restore().unwrap();
        assert!(!p.nodes_conf.exists());
        p.restore().unwrap();
        p.previous = Some(b"the node's own".to_vec());
        p.write().unwrap();
        p.restore().unwrap();
        assert_eq!(std::fs::read(&p.nodes_conf).unwrap(), b"the node's own");
    }

    #[test]
    fn a_fresh_id_is_forty_hex_digits() {
        let (a, b) = (fresh_id(), fresh_id());
        assert_eq!(a.len(), 40);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
