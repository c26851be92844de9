//! Real Redis/Valkey servers for the KV tests: Debian's `redis-server` and
//! `valkey-server` (installed by the test command) started on free ports,
//! clients that work on them until dropped, and agents configured for them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::node::{exposed_auth, Node};
use super::*;

/// A free TCP port on 127.0.0.1 for redis-server, which cannot bind port
/// 0: below the kernel's ephemeral range, so no client connection of the
/// suite can be holding it when the server binds.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let start = 10_000 + (std::process::id() % 1000) as u16 * 16;
    if low < start + 1000 {
        // An unusual port range: any free port.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        return l.local_addr().unwrap().port();
    }
    loop {
        let port = start + NEXT.fetch_add(1, Ordering::Relaxed) % (low - start);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// The servers every test here runs against: Debian's `redis-server`, and
/// `valkey-server` from its backports (both installed by the test command).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Redis,
    Valkey,
}

impl Server {
    pub fn bin(self) -> &'static str {
        match self {
            Server::Redis => "redis-server",
            Server::Valkey => "valkey-server",
        }
    }

    pub fn cli(self) -> &'static str {
        match self {
            Server::Redis => "redis-cli",
            Server::Valkey => "valkey-cli",
        }
    }

    /// A Sentinel of this server's family with the configuration `conf`
    /// (Debian ships `redis-sentinel`; Valkey's server runs as one with
    /// `--sentinel`).
    pub fn sentinel(self, conf: &Path) -> Command {
        let mut command = match self {
            Server::Redis => Command::new("redis-sentinel"),
            Server::Valkey => Command::new("valkey-server"),
        };
        command.arg(conf);
        if self == Server::Valkey {
            command.arg("--sentinel");
        }
        command
    }

    /// The user Debian's package runs the server as.
    pub fn user(self) -> &'static str {
        match self {
            Server::Redis => "redis",
            Server::Valkey => "valkey",
        }
    }
}

/// Runs each named test (a `fn(Server)`) once per server, as
/// `name::redis` and `name::valkey`.
#[macro_export]
macro_rules! on_both_servers {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn redis() {
                super::$name(super::Server::Redis)
            }
            #[test]
            fn valkey() {
                super::$name(super::Server::Valkey)
            }
        }
    )*};
}

/// The `ACL SETUSER` rules docs/REDIS.md gives for its `n`th role (in
/// the order the page lists them), `PASSWORD` replaced by `password`.
pub fn documented_acl(n: usize, password: &str) -> String {
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/REDIS.md")).unwrap();
    let line = page
        .lines()
        .filter_map(|l| l.strip_prefix("    ACL SETUSER "))
        .nth(n)
        .unwrap_or_else(|| panic!("docs/REDIS.md lists no ACL role {n}"));
    line.replace("PASSWORD", password)
}

/// The ACL user and password the harness connects as to a server started
/// with [`Redis::start_acl`].
pub const HARNESS: (&str, &str) = ("harness", "harness-pw");

/// A redis-server or valkey-server: a child process, or a daemonized one
/// found by pidfile.
pub struct Redis {
    pub server: Server,
    pub port: u16,
    pub dir: PathBuf,
    pub child: Option<Child>,
    /// Its `--requirepass`, if it was started with one; or the harness
    /// user's password ([`Redis::start_acl`]).
    pub password: Option<String>,
    /// The ACL user the harness connects as (none: `default`).
    pub user: Option<String>,
}

impl Redis {
    /// Starts a server in `dir` with `extra` arguments and waits for PING.
    pub fn start(server: Server, dir: &Path, extra: &[&str]) -> Redis {
        Redis::start_as(server, dir, extra, None)
    }

    /// Like [`Redis::start`], as `user` when given, the way Debian's unit
    /// runs it: `dir` is `0750 user:user`, and the server's umask 007.
    pub fn start_as(server: Server, dir: &Path, extra: &[&str], user: Option<&str>) -> Redis {
        Redis::start_on(server, dir, extra, user, free_port())
    }

    /// Like [`Redis::start_as`], on `port` (a server started again where it
    /// was).
    pub fn start_on(
        server: Server,
        dir: &Path,
        extra: &[&str],
        user: Option<&str>,
        port: u16,
    ) -> Redis {
        std::fs::create_dir_all(dir).unwrap();
        let bin = server.bin();
        let mut command = Command::new(bin);
        if let Some(user) = user {
            std::os::unix::fs::chown(dir, Some(uid(user)), Some(gid(user))).unwrap();
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o750))
                .unwrap();
            command = Command::new("setpriv");
            command
                .args(["--reuid", user, "--regid", user, "--clear-groups", "--"])
                .args(["sh", "-c", &format!("umask 007 && exec {bin} \"$@\""), bin]);
        }
        let child = command
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--dir",
                dir.to_str().unwrap(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--logfile", dir.join("redis.log").to_str().unwrap()])
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin} (the test command installs it): {e}"));
        let r = Redis {
            server,
            port,
            dir: dir.to_owned(),
            child: Some(child),
            password: extra
                .windows(2)
                .find(|w| w[0] == "--requirepass")
                .map(|w| w[1].to_string())
                .or_else(|| extra.contains(&HARNESS.0).then(|| HARNESS.1.to_string())),
            user: extra
                .windows(2)
                .any(|w| w == ["--user", HARNESS.0])
                .then(|| HARNESS.0.to_string()),
        };
        r.wait_up();
        r
    }

    /// Like [`Redis::start`], with the `default` user off: the harness
    /// connects as its own ACL user ([`HARNESS`]) and `users` are added,
    /// each an `ACL SETUSER` rule list (`"kvsync on >pw ~* +@all"`).
    pub fn start_acl(server: Server, dir: &Path, extra: &[&str], users: &[&str]) -> Redis {
        let harness = format!(">{}", HARNESS.1);
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["--user", HARNESS.0, "on", &harness, "~*", "&*", "+@all"]);
        args.extend(["--user", "default", "off"]);
        for rules in users {
            args.push("--user");
            args.extend(rules.split_whitespace());
        }
        Redis::start(server, dir, &args)
    }

    /// A replica's server, standalone until a handoff seeds it (its pidfile
    /// lets the handoff's start and stop find it).
    pub fn standalone_replica(server: Server, dir: &Path) -> Redis {
        Redis::standalone_replica_on(server, dir, free_port())
    }

    /// [`Redis::standalone_replica`] on `port`.
    pub fn standalone_replica_on(server: Server, dir: &Path, port: u16) -> Redis {
        let pidfile = dir.join("redis.pid");
        Redis::start_on(
            server,
            dir,
            &["--pidfile", pidfile.to_str().unwrap()],
            None,
            port,
        )
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// A URL for the server, with its user and password.
    pub fn url(&self) -> String {
        let user = self.user.as_deref().unwrap_or("");
        let auth = self
            .password
            .as_ref()
            .map_or(String::new(), |p| format!("{user}:{p}@"));
        format!("redis://{auth}{}/", self.addr())
    }

    pub fn con(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    pub fn wait_up(&self) {
        wait_for(
            &format!("redis on {} to answer PING", self.port),
            DEADLINE,
            || {
                let c = redis::Client::open(self.url()).ok()?;
                let mut con = c.get_connection().ok()?;
                redis::cmd("PING").query::<String>(&mut con).ok()
            },
        );
    }

    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        self.try_cmd(args).unwrap()
    }

    /// The command's answer or the server's error (a replica still
    /// loading its master's RDB answers `LOADING`).
    pub fn try_cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut self.con())
    }

    pub fn info(&self, section: &str) -> kvsync::kv::redis::Info {
        kvsync::kv::redis::Info::parse(&self.cmd::<String>(&["INFO", section]))
    }

    /// Creates the replication backlog: a replica attaches once and leaves.
    pub fn make_backlog(&self, root: &Path) {
        let port = self.port.to_string();
        let mut args = vec!["--replicaof", "127.0.0.1", &port];
        if let Some(password) = &self.password {
            args.extend(["--masterauth", password]);
        }
        let helper = Redis::start(self.server, &root.join("helper"), &args);
        wait_for("the helper replica's link", DEADLINE, || {
            (helper.info("replication").get("master_link_status") == Some("up")).then_some(())
        });
        drop(helper);
        assert_eq!(self.info("replication").num("repl_backlog_active"), 1);
        // With diskless sync the replica's link can come up before the
        // primary has reaped the fork that streamed its RDB; a SAVE or
        // BGSAVE issued then is refused.
        wait_for("the primary's replication fork to exit", DEADLINE, || {
            (self.info("persistence").num("rdb_bgsave_in_progress") == 0).then_some(())
        });
    }

    /// Writes `n` string keys `prefix:i` (pipelined).
    pub fn fill(&self, prefix: &str, n: usize, value: &str) {
        let mut con = self.con();
        for chunk in (0..n).collect::<Vec<_>>().chunks(5000) {
            let mut p = redis::pipe();
            for i in chunk {
                p.cmd("SET")
                    .arg(format!("{prefix}:{i}"))
                    .arg(value)
                    .ignore();
            }
            p.query::<()>(&mut con).unwrap();
        }
    }

    /// BGSAVE and wait until it finished well; returns the RDB path.
    pub fn bgsave(&self) -> PathBuf {
        // Once BGSAVE answers, its child is running (in progress = 1); a
        // finished save leaves no change unsaved (the writes happened
        // before it).
        let started: String = self.cmd(&["BGSAVE"]);
        assert_eq!(started, "Background saving started");
        wait_for("BGSAVE to finish", DEADLINE, || {
            let p = self.info("persistence");
            (p.num("rdb_bgsave_in_progress") == 0
                && p.num("rdb_changes_since_last_save") == 0
                && p.get("rdb_last_bgsave_status") == Some("ok"))
            .then_some(())
        });
        self.dir.join("dump.rdb")
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        // Daemonized servers (started by a handoff) are found by pidfile.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("redis.pid")) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                // SAFETY: signalling a process we started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `redis` handoff's `start` array for the server on `port` in
/// `dir` (as Debian's packaging runs it, daemonized), with `extra`
/// arguments (`--replicaof`, cluster mode).
pub fn start_command(server: Server, port: u16, dir: &Path, extra: &[String]) -> String {
    [
        server.bin(),
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--dir",
        "{dir}",
        "--dbfilename",
        "{dbfilename}",
        "--appendonly",
        "no",
        "--save",
        "",
        "--daemonize",
        "yes",
        "--pidfile",
        &dir.join("redis.pid").display().to_string(),
        "--logfile",
        &dir.join("redis.log").display().to_string(),
    ]
    .iter()
    .map(|a| a.to_string())
    .chain(extra.iter().cloned())
    .map(|a| format!("\"{a}\""))
    .collect::<Vec<_>>()
    .join(", ")
}

/// A client thread working on a server until dropped: `step(con, i)` for
/// i = 0, 1, 2, … (a writer, or a reader).
pub struct Client {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Client {
    pub fn start(
        server: &Redis,
        mut step: impl FnMut(&mut redis::Connection, u64) + Send + 'static,
    ) -> Client {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stopped, mut con) = (stop.clone(), server.con());
        let thread = std::thread::spawn(move || {
            let mut i = 0u64;
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                step(&mut con, i);
                i += 1;
            }
        });
        Client {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(Err(panic)) = self.thread.take().map(|t| t.join()) {
            if !std::thread::panicking() {
                std::panic::resume_unwind(panic);
            }
        }
    }
}

/// A kvsync agent with `config` (TOML) in `root/name.toml`.
pub fn agent(
    root: &Path,
    name: &str,
    snapshot_dir: &Path,
    config: &str,
    env: &[(&str, &str)],
) -> Node {
    agent_as(root, name, snapshot_dir, config, env, &[])
}

/// Like [`agent`], run through `wrapper` (e.g. `setpriv` as another user).
pub fn agent_as(
    root: &Path,
    name: &str,
    snapshot_dir: &Path,
    config: &str,
    env: &[(&str, &str)],
    wrapper: &[&str],
) -> Node {
    start_agent(
        root,
        name,
        snapshot_dir,
        config,
        env,
        wrapper,
        ("127.0.0.1", 0),
    )
}

/// Like [`agent`], listening on `ip` (a test host's address, see
/// [`super::netns`]) with gRPC on `grpc_port` (0: any), so that it can be
/// started again at the same address; see [`exposed_auth`].
pub fn agent_at(
    root: &Path,
    name: &str,
    snapshot_dir: &Path,
    config: &str,
    ip: &str,
    grpc_port: u16,
) -> Node {
    start_agent(root, name, snapshot_dir, config, &[], &[], (ip, grpc_port))
}

fn start_agent(
    root: &Path,
    name: &str,
    snapshot_dir: &Path,
    config: &str,
    env: &[(&str, &str)],
    wrapper: &[&str],
    (ip, grpc_port): (&str, u16),
) -> Node {
    let path = root.join(format!("{name}.toml"));
    std::fs::create_dir_all(snapshot_dir).unwrap();
    // `[data]` keys of `config` join the [data] section written here.
    let (data, config) = match config.split_once("[data]\n") {
        Some((before, after)) => {
            let end = after.find("\n[").map_or(after.len(), |i| i + 1);
            (
                after[..end].to_string(),
                format!("{before}{}", &after[end..]),
            )
        }
        None => (String::new(), config.to_string()),
    };
    let (plaintext, auth, token) = exposed_auth(root, name, ip);
    std::fs::write(
        &path,
        format!(
            "node_id = \"{name}\"\ncreate_dirs = true\nsnapshot_dir = \"{}\"\nsnapshot_format = \"redis-rdb\"\n[grpc]\nlisten = \"{ip}:{grpc_port}\"\n{plaintext}[data]\ntcp_listen = \"{ip}:0\"\nrdma_port = 0\n{data}[metrics]\nlisten = \"{ip}:0\"\n[watch]\ndebounce = \"20ms\"\n[sync]\nretries = 0\n{auth}{config}",
            snapshot_dir.display()
        ),
    )
    .unwrap();
    Node {
        proc: AgentProcess::start_wrapped(
            wrapper,
            &["--config", path.to_str().unwrap()],
            env,
            root,
        ),
        dir: snapshot_dir.to_owned(),
        token,
    }
}

fn id(flag: &str, user: &str) -> u32 {
    let out = Command::new("id").args([flag, user]).output().unwrap();
    assert!(out.status.success(), "no user {user}");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

pub fn uid(user: &str) -> u32 {
    id("-u", user)
}

pub fn gid(user: &str) -> u32 {
    id("-g", user)
}

/// Without `right` (taken from `node`'s `kvsync` user, then given back),
/// `live` (a `check-config --live` run) fails and names it on `node`'s
/// line.
pub fn names_missing(node: &Redis, right: &str, live: impl Fn() -> (bool, String, String)) {
    let _: () = node.cmd(&["ACL", "SETUSER", "kvsync", &format!("-{right}")]);
    let (ok, out, err) = live();
    let _: () = node.cmd(&["ACL", "SETUSER", "kvsync", &format!("+{right}")]);
    let said = format!("missing +{right} (docs/REDIS.md gives each role's rights)");
    assert!(
        !ok && out
            .lines()
            .any(|l| l.starts_with(&node.addr()) && l.ends_with(&said)),
        "without +{right}: {out}{err}"
    );
}
