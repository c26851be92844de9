//! The stream's quick start and walkthrough (docs/STREAM.md) as a newcomer
//! runs them, with Redis and with Valkey: the page's configuration files
//! and commands taken from the page itself and run as written, but on one
//! host (each `10.0.0.x` address becomes a loopback port, each path a
//! temporary one, and each agent's metrics its own port, which separate
//! hosts would not need). The primary's agent follows the primary; both
//! replicas are seeded with the page's `kvsync sync`; then the three
//! steps: a replica agent killed while the primary takes writes and started
//! again, its server restarted from its own config, and a failover to it
//! with the page's `REPLICAOF NO ONE` and `kvsync stream follow` lines.
//! Each step ends with every replica synced and `health: ok`, and nothing
//! synced in full: the primary served only its agent's first full resync,
//! the promoted server none, and each fed server was sent an RDB once.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::kv::*;
use common::pki::Pki;
use common::*;

const PAGE: &str = include_str!("../docs/STREAM.md");

/// One of the page's hosts, here.
struct Host {
    /// Its name on the page (`kv-primary-1`, `kv-replica-1`, …).
    name: &'static str,
    /// Its address on the page.
    ip: &'static str,
    /// Its server (none while it restarts).
    redis: Option<Redis>,
    grpc: u16,
    data: u16,
    /// Its `/var/lib/kvsync`.
    var: PathBuf,
    config: PathBuf,
}

impl Host {
    fn server(&self) -> &Redis {
        self.redis.as_ref().expect("its server runs")
    }
}

/// The page, made to run on this host.
struct Page {
    server: Server,
    root: PathBuf,
    pki: Pki,
    tokens: PathBuf,
    hosts: Vec<Host>,
}

impl Page {
    /// `text` with the page's addresses, files and client made this
    /// host's.
    fn here(&self, text: &str) -> String {
        let mut text = text.replace("/etc/kvsync/tls/ca.crt", path(&self.pki.ca_file()));
        text = text.replace("/etc/kvsync/tokens", path(&self.tokens));
        text = text.replace("redis-cli ", &format!("{} ", self.server.cli()));
        for h in &self.hosts {
            let ip = h.ip;
            let port = h.server().port;
            for (from, to) in [
                (format!("{ip}:35101"), format!("127.0.0.1:{}", h.grpc)),
                (format!("{ip}:35102"), format!("127.0.0.1:{}", h.data)),
                (format!("{ip}:6379"), h.server().addr()),
                (
                    format!("-h {ip} -p 6379"),
                    format!("-h 127.0.0.1 -p {port}"),
                ),
            ] {
                text = text.replace(&from, &to);
            }
        }
        text
    }

    fn host(&self, name: &str) -> &Host {
        self.hosts.iter().find(|h| h.name == name).unwrap()
    }

    /// Runs one of the page's command lines (after its `export` line) in
    /// a shell; returns whether it succeeded, and what it printed.
    fn run(&self, line: &str) -> (bool, String) {
        let export = commands()
            .into_iter()
            .find(|l| l.starts_with("export "))
            .expect("the quick start's export line");
        shell(&self.here(&format!("{export}\n{line}")), &[])
    }

    /// Runs `line`, which must succeed.
    fn ok(&self, line: &str) -> String {
        let (ok, out) = self.run(line);
        assert!(ok, "{}\n{out}", self.here(line));
        out
    }

    /// Waits until `line` prints each of `expect`.
    fn until(&self, line: &str, expect: &[&str]) {
        let mut last = String::new();
        let end = std::time::Instant::now() + DEADLINE;
        while std::time::Instant::now() < end {
            last = self.run(line).1;
            if expect.iter().all(|e| last.contains(e)) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("`{line}` did not say {expect:?} within {DEADLINE:?}; last:\n{last}");
    }

    /// Starts `host`'s agent from its configuration.
    fn start(&self, host: &str) -> AgentProcess {
        let config = &self.host(host).config;
        AgentProcess::start_env(&["--config", path(config)], &[], &self.root)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The command lines of the page's quick start and walkthrough: its
/// indented lines that run `export`, `kvsync` or `redis-cli`.
fn commands() -> Vec<&'static str> {
    let start = PAGE.find("## Quick start").expect("a quick start");
    let end = start + PAGE[start..].find("**Set up.**").expect("its end");
    PAGE[start..end]
        .lines()
        .map(str::trim_start)
        .filter(|l| {
            ["export ", "kvsync ", "redis-cli "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .collect()
}

/// The page's configuration files: the primary's, then the replica's.
fn configs() -> (String, String) {
    let blocks = config_blocks(PAGE);
    let [primary, replica]: [String; 2] = blocks.try_into().expect("two configuration files");
    (primary, replica)
}

/// kv-replica-2's file: kv-replica-1's with its own name and address.
fn second_replica(config: &str) -> String {
    config
        .lines()
        .map(|l| {
            match [
                "node_id",
                "listen",
                "tcp_listen",
                "cert_file",
                "key_file",
                "server_addr",
            ]
            .iter()
            .any(|k| l.starts_with(k))
            {
                true => l
                    .replace("kv-replica-1", "kv-replica-2")
                    .replace("10.0.0.2", "10.0.0.3"),
                false => l.to_string(),
            }
        })
        .map(|l| l + "\n")
        .collect()
}

/// The page's line that starts with `prefix`.
fn line(prefix: &str) -> &'static str {
    commands()
        .into_iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("the page has no line {prefix:?}"))
}

/// What the primary served in full.
fn full_syncs(server: &Redis) -> u64 {
    server.info("stats").num("sync_full")
}

/// How many RDBs a replica's agent sent its server.
fn rdbs_sent(agent: &AgentProcess) -> usize {
    agent.log().matches("sent its server the RDB").count()
}

fn walkthrough(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let tokens = root.join("tokens");
    std::fs::write(&tokens, "walkthrough-token-0123456789abcdef\n").unwrap();
    let (primary_file, replica_file) = configs();
    let files = [
        ("kv-primary-1", "10.0.0.1", primary_file.clone()),
        ("kv-replica-1", "10.0.0.2", replica_file.clone()),
        ("kv-replica-2", "10.0.0.3", second_replica(&replica_file)),
    ];
    let pki = Pki::new(root, "walk");
    let hosts = files
        .iter()
        .map(|(name, ip, _)| {
            let var = root.join(name).join("var");
            // deploy/install.sh makes these (tested in operations.rs).
            for d in ["snapshots", "stream"] {
                std::fs::create_dir_all(var.join(d)).unwrap();
            }
            Host {
                name,
                ip,
                redis: Some(Redis::standalone_replica(
                    server,
                    &root.join(name).join("redis"),
                )),
                grpc: free_port(),
                data: free_port(),
                var,
                config: root.join(format!("{name}.toml")),
            }
        })
        .collect();
    let mut page = Page {
        server,
        root: root.to_path_buf(),
        pki,
        tokens,
        hosts,
    };
    for (name, _, file) in &files {
        let (cert, key) = page.pki.issue(name, &["localhost", "127.0.0.1"]);
        let host = page.host(name);
        let text = page
            .here(file)
            .replace(&format!("/etc/kvsync/tls/{name}.crt"), path(&cert))
            .replace(&format!("/etc/kvsync/tls/{name}.key"), path(&key))
            .replace("/var/lib/kvsync", path(&host.var));
        let text = format!("{text}[metrics]\nlisten = \"127.0.0.1:0\"\n");
        std::fs::write(&host.config, text).unwrap();
    }
    let (p, a, b) = (0, 1, 2);

    // The quick start: the agents run, the primary's follows, both
    // replicas are seeded, each healthy.
    let _p_agent = page.start("kv-primary-1");
    let mut a_agent = page.start("kv-replica-1");
    let b_agent = page.start("kv-replica-2");
    page.until("kvsync status --agent 10.0.0.1:35101", &["following"]);
    page.hosts[p].server().fill("before", 2000, "v");
    let seed = line("kvsync sync ");
    page.ok(seed);
    page.ok(&seed.replace("10.0.0.2:35101", "10.0.0.3:35101"));
    let status = line("kvsync status ");
    // What the page says it prints, `…` standing for what varies.
    let (said, expect) = status.split_once('#').unwrap();
    let expect: Vec<_> = expect.trim().split('…').collect();
    assert_eq!(expect[0], "health: ok (stream: following agent ");
    let synced = |page: &Page, what: &str| {
        for (i, agent) in [(a, "10.0.0.2"), (b, "10.0.0.3")] {
            page.until(&said.replace("10.0.0.2", agent), &expect);
            common::stream::converged(page.hosts[i].server(), page.hosts[p].server(), what);
        }
    };
    synced(&page, "both replicas to be seeded");
    let primary_full = full_syncs(page.hosts[p].server());
    assert_eq!(primary_full, 1, "only its agent's first");

    // 1. kv-replica-1's agent killed while the primary takes writes.
    a_agent.signal(libc::SIGKILL);
    a_agent.wait_exit();
    drop(a_agent);
    page.hosts[p]
        .server()
        .fill("while-away", 3000, &"v".repeat(1000));
    let a_agent = page.start("kv-replica-1");
    synced(&page, "the killed agent's server to catch up");
    assert_eq!(full_syncs(page.hosts[p].server()), primary_full);

    // 2. kv-replica-1's server restarted from its own config.
    let old = page.hosts[a].redis.take().unwrap();
    let (dir, port) = (old.dir.clone(), old.port);
    let _ = old.try_cmd::<()>(&["SHUTDOWN", "SAVE"]);
    drop(old);
    page.hosts[a].redis = Some(Redis::standalone_replica_on(server, &dir, port));
    page.hosts[p].server().fill("while-restarting", 500, "v");
    synced(&page, "the restarted server to be fed again");
    let repointed = "kvsync_stream_server_repointed_total{kv_instance=\"default\"}";
    wait_for("the move to be counted", DEADLINE, || {
        (metric_value(&a_agent.metrics(), repointed) == Some(1.0)).then_some(())
    });
    assert_eq!(full_syncs(page.hosts[p].server()), primary_full);
    assert_eq!(rdbs_sent(&a_agent), 0, "the restarted agent sent none");

    // 3. A failover to kv-replica-1, the primary's writers stopped.
    let failover: Vec<_> = commands()
        .into_iter()
        .filter(|l| l.starts_with("redis-cli ") || l.starts_with("kvsync stream follow "))
        .collect();
    assert_eq!(failover.len(), 4, "{failover:?}");
    for l in &failover {
        page.ok(l);
    }
    let (new, old) = (page.hosts[a].server(), page.hosts[p].server());
    new.fill("after-failover", 2000, "v");
    common::stream::converged(
        page.hosts[b].server(),
        new,
        "kv-replica-2 to follow the new primary",
    );
    wait_for(
        "the old primary to be a replica of the new one",
        DEADLINE,
        || {
            let r = old.info("replication");
            (r.get("role") == Some("slave") && r.get("master_link_status") == Some("up"))
                .then_some(())
        },
    );
    common::stream::converged(old, new, "the old primary to follow the new one");
    assert_eq!(
        full_syncs(new),
        0,
        "the promoted server served no full sync"
    );
    assert_eq!(
        rdbs_sent(&b_agent),
        1,
        "kv-replica-2's only RDB is its seeding"
    );
    for agent in ["10.0.0.1", "10.0.0.2", "10.0.0.3"] {
        page.until(&said.replace("10.0.0.2", agent), &["health: ok"]);
    }
}

on_both_servers!(walkthrough);

const README: &str = include_str!("../README.md");

/// README's production checklist.
fn checklist() -> &'static str {
    let start = README.find("## Production checklist").expect("a checklist");
    &README[start..]
}

/// The checklist's indented block that opens with `first`, its lines
/// without their indentation.
fn checklist_block(first: &str) -> String {
    let lines: Vec<&str> = checklist().lines().map(str::trim_start).collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with(first))
        .unwrap_or_else(|| panic!("the checklist has no block {first:?}"));
    lines[at..]
        .iter()
        .take_while(|l| !l.is_empty())
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Runs `script` in bash with the built `kvsync` first on the PATH;
/// returns whether it succeeded, and what it printed.
fn shell(script: &str, env: &[(&str, &str)]) -> (bool, String) {
    let bin = Path::new(kvsync_bin()).parent().unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .envs(env.iter().copied())
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// README's quick start with its production checklist followed on top,
/// as written: the servers on TLS ports with `tls-auth-clients` and
/// `tls-replication`, each with the `kvsync` user of its role exactly as
/// docs/REDIS.md gives it and `default` off; the agents with `[data] tls =
/// "required"` and the checklist's `[redis]` lines, the password made a
/// file by the checklist's two lines; `check-config --live` finds every
/// right. Then the quick start's seeding: the replica server is seeded
/// and fed over TLS, continues after its link is cut, and no log holds
/// the password. (Paths and addresses become this host's, as in
/// [`walkthrough`]; the password file belongs to the user running the
/// test, there being no `kvsync` group here.)
fn production_checklist(server: Server) {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let password = "pr0d:p@ss/w0rd";
    let pki = Pki::new(root, "prod");
    let tokens = root.join("tokens");
    std::fs::write(&tokens, "checklist-token-0123456789abcdef\n").unwrap();
    let pass = root.join("redis.pass");
    let (agent_cert, agent_key) = pki.issue("kvsync", &["kvsync-agent"]);
    // Steps 2 and 3: TLS ports, replication over TLS, one user per role.
    let tls_server = |name: &str, role: usize| {
        let (args, port) = pki.server_tls(name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let acl = common::kv::documented_acl(role, password);
        let redis = Redis::start_acl(server, &root.join(name).join("redis"), &args, &[&acl]);
        (redis, format!("127.0.0.1:{port}"))
    };
    let (primary, primary_tls) = tls_server("kv-primary-1", 0);
    let (replica, replica_tls) = tls_server("kv-replica-1", 1);
    let (grpc, data) = ([free_port(), free_port()], [free_port(), free_port()]);
    let here = |text: &str| {
        let mut text = text
            .replace("/etc/kvsync/redis-tls/ca.crt", path(&pki.ca_file()))
            .replace("/etc/kvsync/redis-tls/kvsync.crt", path(&agent_cert))
            .replace("/etc/kvsync/redis-tls/kvsync.key", path(&agent_key))
            .replace("/etc/kvsync/redis.pass", path(&pass))
            .replace("/etc/kvsync/tls/ca.crt", path(&pki.ca_file()))
            .replace("/etc/kvsync/tokens", path(&tokens))
            .replace("10.0.0.1:6379", &primary_tls)
            .replace("10.0.0.2:6379", &replica_tls);
        for (i, ip) in ["10.0.0.1", "10.0.0.2"].iter().enumerate() {
            text = text
                .replace(&format!("{ip}:35101"), &format!("127.0.0.1:{}", grpc[i]))
                .replace(&format!("{ip}:35102"), &format!("127.0.0.1:{}", data[i]));
        }
        text
    };

    // Step 4: the password in its file, by the checklist's lines.
    let file_lines: String = checklist()
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with("install ") || l.starts_with("printf "))
        .map(|l| format!("{}\n", l.replace(" -o root -g kvsync", "")))
        .collect();
    let (ok, out) = shell(&here(&file_lines), &[("KVSYNC_REDIS_PASSWORD", password)]);
    assert!(ok, "{file_lines}{out}");
    assert_eq!(
        std::fs::read_to_string(&pass).unwrap(),
        format!("{password}\n")
    );

    // Steps 1 and 2 on the quick start's files.
    let redis_lines = checklist_block("# add to [redis]");
    let blocks = config_blocks(README);
    let [primary_file, replica_file]: [String; 2] = blocks.try_into().expect("two files");
    let mut configs = Vec::new();
    for (name, file) in [
        ("kv-primary-1", primary_file),
        ("kv-replica-1", replica_file),
    ] {
        let (cert, key) = pki.issue(name, &["localhost", "127.0.0.1"]);
        let var = root.join(name).join("var");
        for d in ["snapshots", "stream"] {
            std::fs::create_dir_all(var.join(d)).unwrap();
        }
        let text = here(&file)
            .replace("[data]\n", "[data]\ntls = \"required\"\n")
            .replace("[redis]\n", &format!("[redis]\n{}", here(&redis_lines)))
            .replace(&format!("/etc/kvsync/tls/{name}.crt"), path(&cert))
            .replace(&format!("/etc/kvsync/tls/{name}.key"), path(&key))
            .replace("/var/lib/kvsync", path(&var));
        let config = root.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!("{text}[metrics]\nlisten = \"127.0.0.1:0\"\n"),
        )
        .unwrap();
        configs.push(config);
    }

    // Step 5: every login holds its role's rights.
    let live = checklist_block("kvsync check-config --live");
    for config in &configs {
        let line = live.replace("/etc/kvsync/kvsync.toml", path(config));
        let (ok, out) = shell(&line, &[]);
        assert!(ok, "{line}{out}");
        assert!(
            out.lines().all(|l| l.ends_with(": ok")) && out.lines().count() == 2,
            "{out}"
        );
    }

    // The quick start's seeding, over TLS everywhere.
    let start = |config: &Path| AgentProcess::start_env(&["--config", path(config)], &[], root);
    let p_agent = start(&configs[0]);
    let r_agent = start(&configs[1]);
    let quick_start = README.find("## Quick start").unwrap();
    let quick: Vec<&str> = README[quick_start..README.find("## Production checklist").unwrap()]
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with("export ") || l.starts_with("kvsync "))
        .collect();
    let [export, sync, status]: [&str; 3] = quick.try_into().expect("export, sync, status");
    primary.fill("before", 2000, "v");
    wait_for("the primary's agent to follow it", DEADLINE, || {
        let (_, out) = shell(&here(&format!("{export}\n{status}")), &[]);
        out.contains("following").then_some(())
    });
    let (ok, out) = shell(&here(&format!("{export}\n{sync}")), &[]);
    assert!(ok, "{sync}\n{out}");
    wait_for("health: ok", DEADLINE, || {
        let (_, out) = shell(&here(&format!("{export}\n{status}")), &[]);
        out.contains("health: ok").then_some(())
    });
    common::stream::converged(&replica, &primary, "the replica to be seeded over TLS");
    let killed: i64 = replica.cmd(&["CLIENT", "KILL", "TYPE", "master"]);
    assert_eq!(killed, 1, "the replica server's TLS link to its agent");
    primary.fill("after-cut", 2000, "v");
    common::stream::converged(&replica, &primary, "the replica to continue after the cut");
    assert_eq!(full_syncs(&primary), 1, "only its agent's first");
    assert_eq!(
        rdbs_sent(&r_agent),
        1,
        "the replica server's only RDB is its seeding"
    );
    for agent in [&p_agent, &r_agent] {
        assert!(!agent.log().contains(password), "the password in a log");
    }
}

on_both_servers!(production_checklist);
