//! The chaos run, on real `redis-server` and `valkey-server` processes,
//! their Sentinels and agent processes: one primary P and its agent
//! (`ack = "replicas"`), a replica Q of P that three Sentinels may promote
//! (its agent's log follows P's agent, handoff `redis-replicate`), three
//! replica agents in two tiers (one following P's agent, two following
//! it), each feeding its own server (`redis-stream`), a writer of mixed
//! commands (`SET`, `INCR`, `LPUSH`, `HSET`, `EXPIRE`, `DEL`) that asks
//! the Sentinels where the master is and records which of its marker
//! writes `WAIT 2` acknowledged, and a seeded random schedule of faults
//! for a while: an agent killed (`SIGKILL`) and
//! started again where it was, an agent frozen (`SIGSTOP`, its links gone
//! silent) and thawed, a record of a relay's log damaged on disk just
//! ahead of a reader killed meanwhile, an agent's log disk (a tmpfs of its
//! own) full for a while, a replica server killed and started again
//! from its own configuration (its data saved every 2 s, a replica of its
//! agent's feed), a host's link cut (each agent with its server on a
//! host of its own, a network namespace) for up to twice the agents'
//! `peer_timeout`, and a planned Sentinel failover between P and Q (the
//! master's writes paused until Q has them, `SENTINEL FAILOVER`, every
//! agent following the promoted server's history). After the faults stop
//! and the stream is quiet: every server's whole keyspace equals the
//! master's (`DUMP` of every key), every acknowledged marker is on every
//! server, neither P nor Q served a full resync past Q's first, no
//! server took one past its seeding, no log lost a byte to a failover,
//! each damaged record was mended,
//! and the agents' memory and descriptors stay bounded. It prints the seed
//! and what it injected; `CHAOS_SEED` replays a schedule.
//!
//! The suite runs a short fixed schedule (`CHAOS_SECONDS`, 30 by default);
//! `scripts/chaos.sh` runs the same test for as long as asked.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use common::kv::*;
use common::netns::{block_on, Hosts};
use common::node::*;
use common::sentinel::*;
use common::stream::*;
use common::*;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One agent of the run: where it listens (its host and port), so that
/// it starts again at the same address and its downstreams find it.
struct Agent {
    name: &'static str,
    host: usize,
    config: String,
    port: u16,
    log_dir: PathBuf,
    /// The disk its log is on.
    disk: SmallFs,
    node: Node,
    /// Its [`Agent::counters`] by its runs before this one.
    counted_before: [f64; 3],
}

/// The room each agent's log disk has, but while a fault fills it.
const LOG_DISK: u64 = 4 << 30;

/// `name`'s log disk, mounted, and its log's directory there (`None`:
/// this process may not mount one).
fn log_disk(root: &Path, name: &str) -> Option<(SmallFs, PathBuf)> {
    let disk = SmallFs::mount(&root.join(format!("{name}-disk")), &format!("{LOG_DISK}"))?;
    let dir = disk.0.join("log");
    Some((disk, dir))
}

impl Agent {
    fn start(
        (root, hosts): (&Path, &Hosts),
        (name, host): (&'static str, usize),
        config: String,
        port: u16,
        (disk, log_dir): (SmallFs, PathBuf),
    ) -> Agent {
        let node = start_at((root, hosts), (name, host), &config, port);
        hosts.run_in(host, || wait_following(&node));
        Agent {
            name,
            host,
            config,
            port,
            log_dir,
            disk,
            node,
            counted_before: [0.0; 3],
        }
    }

    /// Fills its log disk (64 KiB of room left) until the agent fails
    /// a write to its log.
    fn fill_disk(&self, hosts: &Hosts) {
        let errors = "kvsync_stream_log_write_errors_total{kv_instance=\"default\"}";
        let metric = || hosts.run_in(self.host, || self.node.metric(errors));
        let before = metric();
        // The log grows meanwhile: a size below what the disk holds by
        // then is refused, and tried again.
        wait_for("the log disk to be filled", DEADLINE, || {
            self.disk.resize(self.disk.used_bytes() + (64 << 10)).ok()
        });
        wait_for("a write to the full log disk to fail", DEADLINE, || {
            (metric() > before).then_some(())
        });
    }

    fn kill(&mut self, hosts: &Hosts) {
        let now = self.counters(hosts);
        for (before, now) in self.counted_before.iter_mut().zip(now) {
            *before += now;
        }
        self.node.proc.signal(libc::SIGKILL);
        self.node.proc.wait_exit();
    }

    fn restart(&mut self, (root, hosts): (&Path, &Hosts)) {
        let at = (self.name, self.host);
        self.node = start_at((root, hosts), at, &self.config, self.port);
    }

    /// Its damaged records mended and cut, and the bytes its log dropped
    /// as lost to a failover, by this run of it.
    fn counters(&self, hosts: &Hosts) -> [f64; 3] {
        let refetched = |result: &str| {
            format!("kvsync_stream_refetched_total{{kv_instance=\"default\",result=\"{result}\"}}")
        };
        let series = [
            refetched("mended"),
            refetched("cut"),
            "kvsync_stream_diverged_bytes_total{kv_instance=\"default\"}".to_string(),
        ];
        series.map(|series| hosts.run_in(self.host, || self.node.metric(&series)))
    }

    fn pid(&self) -> u32 {
        self.node.proc.child.id()
    }
}

/// A fed server as its operator's configuration starts it: its data
/// saved every 2 s of changes, and once seeded (`feed`: the port and
/// password of its agent's feed) a replica of that feed.
fn fed_server(server: Server, dir: &Path, port: u16, feed: Option<&(u16, String)>) -> Redis {
    let pidfile = dir.join("redis.pid");
    let mut args = vec![
        "--pidfile".to_string(),
        pidfile.display().to_string(),
        "--save".to_string(),
        "2 1".to_string(),
    ];
    if let Some((port, secret)) = feed {
        args.extend(
            [
                "--replicaof",
                "127.0.0.1",
                &port.to_string(),
                "--masterauth",
                secret,
            ]
            .map(String::from),
        );
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Redis::start_on(server, dir, &args, None, port)
}

/// How many full syncs `rs` took from its master, by its log.
fn full_syncs(rs: &Redis) -> usize {
    std::fs::read_to_string(rs.dir.join("redis.log"))
        .unwrap_or_default()
        .matches("REPLICA sync: Finished with success")
        .count()
}

fn start_at(
    (root, hosts): (&Path, &Hosts),
    (name, host): (&str, usize),
    config: &str,
    port: u16,
) -> Node {
    let snaps = root.join(format!("{name}-snaps"));
    hosts.run_in(host, || {
        agent_at(root, name, &snaps, config, &hosts.ip(host), port)
    })
}

/// What every agent's configuration adds: a peer whose link is cut is
/// given up after 5 s, as in the link-cut test.
const DATA: &str = "[data]\npeer_timeout = \"5s\"\n";

/// How long a fault lasts: 0.5 s to `max_ms`.
fn pause(rng: &mut impl Rng, max_ms: u64) -> Duration {
    Duration::from_millis(500 + rng.random_range(0..max_ms - 500))
}

/// The replica agents, each with its server.
const NAMES: [&str; 3] = ["a", "b", "c"];

/// The hosts (and indices among the agents) of the two servers Sentinel
/// may make the master, P and Q, each with its agent.
const SIDES: [usize; 2] = [0, 4];

/// The kinds of fault the schedule draws from.
const KINDS: usize = 7;

/// The `[stream]` lines every agent of the run has: every reader reads
/// the log's files (so damage on disk is met), in segments of 1 MiB (so
/// the run rolls many).
const STREAM: &str = "memory_tail = \"0\"\nsegment_size = \"1MiB\"\n";

/// How many replicas `WAIT` asks for: the master's agent and the other
/// server (P's agent, with `ack = "replicas"`, once a fed server has it).
const WAITED: i64 = 2;

/// The writer: mixed commands on a small keyspace at the master the
/// Sentinel at `sentinel` names (asked again after any failure: a
/// demoted master refuses writes, or Sentinel killed the connection), and
/// every round a marker `SET ack:<n>` followed by `WAIT`; the markers
/// acknowledged.
fn writer(sentinel: String, seed: u64, stop: Arc<AtomicBool>, acked: Arc<Mutex<Vec<u64>>>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5752_4954_4552);
    let (mut n, mut con) = (0u64, None);
    while !stop.load(Ordering::Relaxed) {
        let Some(c) = con.as_mut() else {
            con = master_con(&sentinel).ok();
            // The writer's pace while the master cannot be reached.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let mut p = redis::pipe();
        for _ in 0..20 {
            let k = rng.random_range(0..500);
            match rng.random_range(0..6) {
                0 => p.cmd("SET").arg(format!("s:{k}")).arg(rng.random::<u64>()),
                1 => p.cmd("INCR").arg(format!("c:{k}")),
                2 => p
                    .cmd("LPUSH")
                    .arg(format!("l:{k}"))
                    .arg(rng.random::<u64>())
                    .ignore()
                    .cmd("LTRIM")
                    .arg(format!("l:{k}"))
                    .arg(0)
                    .arg(20),
                3 => p
                    .cmd("HSET")
                    .arg(format!("h:{k}"))
                    .arg(rng.random_range(0..10))
                    .arg(rng.random::<u64>()),
                4 => p
                    .cmd("EXPIRE")
                    .arg(format!("s:{k}"))
                    .arg(1 + rng.random_range(0..5)),
                _ => p.cmd("DEL").arg(format!("c:{k}")),
            }
            .ignore();
        }
        n += 1;
        p.cmd("SET").arg(format!("ack:{n}")).arg(n).ignore();
        let counted = p
            .query::<()>(c)
            .and_then(|()| redis::cmd("WAIT").arg(WAITED).arg(200).query::<i64>(c));
        match counted {
            Ok(counted) if counted >= WAITED => acked.lock().unwrap().push(n),
            Ok(_) => {}
            Err(_) => con = None,
        }
    }
}

/// Where the Sentinels and the agents know side `i`'s server.
fn side_addr(hosts: &Hosts, sides: &[Redis; 2], i: usize) -> String {
    format!("{}:{}", hosts.ip(SIDES[i]), sides[i].port)
}

/// The sides' servers and the Sentinels that watch them.
struct Sentineled<'a> {
    hosts: &'a Hosts,
    sides: [Redis; 2],
    sentinels: Vec<Redis>,
}

impl Sentineled<'_> {
    /// Runs `f` on the host of side `i`'s server.
    fn on<T: Send>(&self, i: usize, f: impl FnOnce(&Redis) -> T + Send) -> T {
        self.hosts.run_in(SIDES[i], || f(&self.sides[i]))
    }

    /// Waits until every Sentinel knows the others and side `i`'s server
    /// as a healthy replica it could promote.
    fn ready_to_promote(&self, i: usize) {
        let port = self.sides[i].port;
        wait_for(
            "every Sentinel to know the replica as one it could promote",
            DEADLINE * 2,
            || {
                self.hosts
                    .run_in(0, || self.sentinels.iter().all(|s| sentinel_ready(s, port)))
                    .then_some(())
            },
        );
    }

    /// A planned failover from side `m`, the master, to side `r`, once
    /// the Sentinels would promote `r` (asked before the pause: a paused
    /// master holds their hellos and looks down to them): the master's
    /// writes paused until `r` and its agent's log hold all it wrote,
    /// `SENTINEL FAILOVER`, and once the promoted server's agent follows
    /// it, the other agent follows that agent, the old master replicates
    /// from the promoted one (re-attached by its agent: Sentinel cannot
    /// convert a paused one) and every Sentinel names it, its writes are
    /// resumed.
    fn fail_over(&self, agents: &[Agent], (m, r): (usize, usize)) {
        self.ready_to_promote(r);
        // A pause holds clients' writes, not the master's pings to its
        // replicas (every `repl-ping-replica-period`): a ping past the
        // promotion point is history the promoted server never had, and
        // costs the old master a full sync and the fed servers a seeding.
        const PING: &str = "repl-ping-replica-period";
        let was: Vec<String> = self.on(m, |s| s.cmd(&["CONFIG", "GET", PING]));
        let period = |s: &Redis, to: &str| s.cmd::<String>(&["CONFIG", "SET", PING, to]);
        self.on(m, |s| period(s, "3600"));
        let paused: String = self.on(m, |s| s.cmd(&["CLIENT", "PAUSE", "120000", "WRITE"]));
        assert_eq!(paused, "OK");
        let at = self.on(m, |s| s.info("replication").num("master_repl_offset"));
        let (promoted, demoted) = (&agents[SIDES[r]], &agents[SIDES[m]]);
        wait_for(
            "the replica and its agent's log to hold all the paused master wrote",
            DEADLINE,
            || {
                self.on(r, |s| {
                    s.info("replication").num("master_repl_offset") == at
                        && stream_status(&promoted.node).end_offset == at
                })
                .then_some(())
            },
        );
        self.hosts.run_in(0, || fail_over(&self.sentinels[0]));
        let new = side_addr(self.hosts, &self.sides, r);
        let (follows_new, follows_agent) = (
            format!("primary {new}"),
            format!("agent {}", promoted.node.grpc()),
        );
        wait_for(
            "the agents to follow the promoted server's history",
            DEADLINE * 2,
            || {
                let status =
                    |a: &Agent| self.hosts.run_in(a.host, || stream_status(&a.node).source);
                (status(promoted) == follows_new && status(demoted) == follows_agent).then_some(())
            },
        );
        let port = self.sides[r].port;
        self.on(m, |s| {
            replicates_from(s, port, "the old master to replicate from the new")
        });
        wait_for("every Sentinel to name the new master", DEADLINE, || {
            self.hosts
                .run_in(0, || self.sentinels.iter().all(|s| master_of(s) == new))
                .then_some(())
        });
        wait_for("the old master's writes to be resumed", DEADLINE, || {
            self.on(m, |s| s.try_cmd::<String>(&["CLIENT", "UNPAUSE"]).ok())
        });
        self.on(m, |s| period(s, &was[1]));
    }
}

/// The whole records of `dir`'s log: each one's segment, the position of
/// its bytes there, its offset and length.
fn records(dir: &Path) -> Vec<(PathBuf, usize, u64, usize)> {
    use kvsync::stream::log::{RECORD_HEADER, SEGMENT_HEADER};
    let mut out = Vec::new();
    for path in segment_files(dir) {
        let bytes = std::fs::read(&path).unwrap();
        // The segment's header, then records: a header (offset u64, len
        // u32, hash), then the bytes.
        let mut pos = SEGMENT_HEADER;
        while pos + RECORD_HEADER <= bytes.len() {
            let at = u64::from_be_bytes(bytes[pos..pos + 8].try_into().unwrap());
            let len = u32::from_be_bytes(bytes[pos + 8..pos + 12].try_into().unwrap()) as usize;
            if pos + RECORD_HEADER + len > bytes.len() {
                break;
            }
            out.push((path.clone(), pos + RECORD_HEADER, at, len));
            pos += RECORD_HEADER + len;
        }
    }
    out
}

/// The first record of `dir`'s log that starts past `offset`, one bit of
/// its bytes flipped on disk: its offset (`None`: the log holds none).
fn damage_after(dir: &Path, offset: u64) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let (path, pos, at, _) = records(dir)
        .into_iter()
        .find(|&(_, _, at, len)| at > offset && len > 0)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, pos as u64).unwrap();
    file.write_all_at(&[byte[0] ^ 0x20], pos as u64).unwrap();
    Some(at)
}

/// Where `dir`'s log ends: the end of its last whole record.
fn log_end(dir: &Path) -> u64 {
    records(dir)
        .last()
        .map_or(0, |&(_, _, at, len)| at + len as u64)
}

/// Every key of `server` with its `DUMP`, sorted.
fn keyspace(server: &Redis) -> Vec<(String, Vec<u8>)> {
    let mut con = server.con();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    let mut all = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(1000) {
        let mut p = redis::pipe();
        for k in chunk {
            p.cmd("DUMP").arg(k);
        }
        let dumps: Vec<Option<Vec<u8>>> = p.query(&mut con).unwrap();
        let present = chunk
            .iter()
            .zip(dumps)
            .filter_map(|(k, d)| Some((k.clone(), d?)));
        all.extend(present);
    }
    all.sort();
    all
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[derive(Default, Debug)]
struct Injected {
    killed: usize,
    frozen: usize,
    /// Damage faults, and the records they damaged (none when the
    /// reader's log already held all the relay's).
    tried: usize,
    damaged: usize,
    filled: usize,
    servers_killed: usize,
    cut: usize,
    failovers: usize,
}

impl Injected {
    fn total(&self) -> usize {
        self.killed
            + self.frozen
            + self.tried
            + self.filled
            + self.servers_killed
            + self.cut
            + self.failovers
    }
}

fn chaos_run(server: Server) {
    let seed = env_u64("CHAOS_SEED", 20261207);
    let seconds = env_u64("CHAOS_SECONDS", 30);
    eprintln!("chaos: {server:?}, seed {seed}, {seconds} s of faults");
    // A schedule is its seed.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Host 0: the primary P, its agent and the Sentinels; hosts 1 to 3: a
    // replica agent and its server each; host 4: Q and its agent.
    let Some(hosts) = Hosts::create_n("chaos run", 5) else {
        return;
    };
    let hosts = &hosts;
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let side = |name: &str, host: usize, more: &[&str]| {
        let ip = hosts.ip(host);
        let mut args = vec![
            "--repl-backlog-size",
            "1mb",
            "--bind",
            "127.0.0.1",
            &ip,
            "--protected-mode",
            "no",
        ];
        args.extend(more);
        hosts.run_in(host, || Redis::start(server, &root.join(name), &args))
    };
    let primary = side("p", 0, &[]);
    hosts.run_in(0, || primary.fill("before", 500, "v"));
    let p_addr = format!("{}:{}", hosts.ip(0), primary.port);
    let offset = |rs: &Redis, host: usize| {
        hosts.run_in(host, || rs.info("replication").num("master_repl_offset"))
    };
    // Never down in the Sentinels' eyes for as long as a fault lasts:
    // only the schedule fails over.
    let sentinels: Vec<Redis> = (0..3)
        .map(|i| {
            hosts.run_in(0, || {
                let dir = root.join(format!("sentinel-{i}"));
                start_sentinel(server, &dir, (&hosts.ip(0), &p_addr), DEADLINE)
            })
        })
        .collect();
    let sentinel_addrs: Vec<String> = sentinels
        .iter()
        .map(|s| format!("{}:{}", hosts.ip(0), s.port))
        .collect();

    // P's agent, the three replica agents and their servers, then Q and
    // its agent: P's and Q's agents name each other.
    let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
    let agent_addr = |host: usize| format!("{}:{}", hosts.ip(host), ports[host]);
    let Some(disk) = log_disk(root, "src") else {
        return;
    };
    let src_config = format!(
        "{}ack = \"replicas\"\n{STREAM}{}{DATA}",
        follower_config(&primary, &disk.1).replace(&primary.addr(), &p_addr),
        sentinel_lines(&sentinel_addrs, &[agent_addr(SIDES[1])])
    );
    let mut agents = vec![Agent::start(
        (root, hosts),
        ("src", 0),
        src_config,
        ports[0],
        disk,
    )];
    let (mut servers, mut feeds) = (Vec::new(), Vec::new());
    for (i, (name, upstream)) in NAMES.into_iter().zip([0, 1, 1]).enumerate() {
        let host = i + 1;
        let dir = root.join(format!("{name}-server"));
        std::fs::create_dir_all(&dir).unwrap();
        let rs = hosts.run_in(host, || fed_server(server, &dir, free_port(), None));
        let disk = log_disk(root, name).unwrap();
        // The feed at a port of its own, where the server's configuration
        // names it.
        let feed_port = free_port();
        let config = format!(
            "{}seed_listen = \"127.0.0.1:{feed_port}\"\n{DATA}",
            feeding_puller_config(&disk.1, &agents[upstream].node, &rs).replacen(
                "[handoff]",
                &format!("{STREAM}[handoff]"),
                1
            )
        );
        let a = Agent::start((root, hosts), (name, host), config, ports[host], disk);
        let source = agents[0].node.grpc();
        let p = hosts.run_in(host, || block_on(sync_from(&a.node, &source)));
        assert_eq!(p.phase, kvsync::rpc::pb::Phase::Succeeded as i32, "{p:?}");
        wait_for("the fed server to converge after seeding", DEADLINE, || {
            (offset(&rs, host) == offset(&primary, 0)).then_some(())
        });
        let secret =
            std::fs::read_to_string(a.log_dir.join(kvsync::stream::feed::SECRET_FILE)).unwrap();
        feeds.push((feed_port, secret.trim().to_string()));
        agents.push(a);
        servers.push(rs);
    }
    let q_host = SIDES[1];
    let pport = primary.port.to_string();
    let q = side("q", q_host, &["--replicaof", &hosts.ip(0), &pport]);
    let disk = log_disk(root, "q").unwrap();
    let q_config = format!(
        "[stream]\ndir = \"{}\"\nupstream = \"{}\"\n{STREAM}{}[handoff]\nmode = \"redis-replicate\"\n[redis]\nserver_addr = \"{}:{}\"\nprimary = \"{p_addr}\"\n{DATA}",
        disk.1.display(),
        agent_addr(0),
        sentinel_lines(&sentinel_addrs, &[agent_addr(0)]),
        hosts.ip(q_host),
        q.port,
    );
    agents.push(Agent::start(
        (root, hosts),
        ("q", q_host),
        q_config,
        ports[q_host],
        disk,
    ));
    let cast = Sentineled {
        hosts,
        sides: [primary, q],
        sentinels,
    };
    cast.ready_to_promote(1);
    let syncs_full = || {
        (0..2)
            .map(|i| cast.on(i, |s| s.info("stats").num("sync_full")))
            .sum::<u64>()
    };
    let full_before = syncs_full();
    // The side that is the master.
    let mut master = 0;

    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writing = {
        let sentinel = format!("127.0.0.1:{}", cast.sentinels[0].port);
        let (stop, acked) = (stop.clone(), acked.clone());
        hosts.spawn_in(0, move || writer(sentinel, seed, stop, acked))
    };

    let mut injected = Injected::default();
    let end = Instant::now() + Duration::from_secs(seconds);
    // Each kind once at least, so that even a short run has them all.
    while Instant::now() < end || injected.total() < KINDS {
        // The gap before the next fault: 0.5 to 3 s of writes.
        std::thread::sleep(Duration::from_millis(500 + rng.random_range(0..2500)));
        let n = injected.total();
        match if n < KINDS {
            n
        } else {
            rng.random_range(0..KINDS)
        } {
            0 => {
                let i = rng.random_range(0..agents.len());
                eprintln!("chaos: kill -9 {} and start it again", agents[i].name);
                agents[i].kill(hosts);
                agents[i].restart((root, hosts));
                injected.killed += 1;
            }
            1 => {
                let i = rng.random_range(0..agents.len());
                let pause = pause(&mut rng, 3500);
                eprintln!("chaos: freeze {} for {pause:?}", agents[i].name);
                agents[i].node.proc.signal(libc::SIGSTOP);
                std::thread::sleep(pause);
                agents[i].node.proc.signal(libc::SIGCONT);
                injected.frozen += 1;
            }
            2 => {
                // A record of the relay's log damaged just ahead of one of
                // its readers, killed meanwhile: started again, it asks
                // the relay for the stream from its log's end, through the
                // damaged record.
                let relay_log = agents[1].log_dir.clone();
                let reader = &mut agents[2 + rng.random_range(0..2usize)];
                reader.kill(hosts);
                let damaged = damage_after(&relay_log, log_end(&reader.log_dir));
                eprintln!(
                    "chaos: damage the relay's record at {damaged:?}, ahead of {} (killed and started again)",
                    reader.name
                );
                reader.restart((root, hosts));
                injected.tried += 1;
                injected.damaged += usize::from(damaged.is_some());
            }
            3 => {
                let i = rng.random_range(0..agents.len());
                let pause = pause(&mut rng, 3500);
                eprintln!("chaos: fill {}'s log disk for {pause:?}", agents[i].name);
                agents[i].fill_disk(hosts);
                std::thread::sleep(pause);
                agents[i].disk.resize(LOG_DISK).unwrap();
                injected.filled += 1;
            }
            4 => {
                let i = rng.random_range(0..servers.len());
                eprintln!(
                    "chaos: kill -9 server {} and start it again from its configuration",
                    NAMES[i]
                );
                let (dir, port) = (servers[i].dir.clone(), servers[i].port);
                drop(servers.remove(i));
                let rs = hosts.run_in(i + 1, || fed_server(server, &dir, port, Some(&feeds[i])));
                servers.insert(i, rs);
                injected.servers_killed += 1;
            }
            5 => {
                // Longer than `peer_timeout` at times: sessions are given
                // up and asked for again once the link is back.
                let host = rng.random_range(0..agents.len());
                let pause = pause(&mut rng, 10_000);
                eprintln!("chaos: cut {}'s link for {pause:?}", agents[host].name);
                hosts.set_link(host, false);
                std::thread::sleep(pause);
                hosts.set_link(host, true);
                injected.cut += 1;
            }
            _ => {
                let to = 1 - master;
                eprintln!(
                    "chaos: fail over from {} to {} (Sentinel, planned)",
                    agents[SIDES[master]].name, agents[SIDES[to]].name
                );
                cast.fail_over(&agents, (master, to));
                master = to;
                injected.failovers += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    writing.join().unwrap();

    // Quiet: every server holds the master's keyspace, byte for byte; at
    // the end of the stream when the last converged, every log holds it.
    let (mh, m) = (SIDES[master], &cast.sides[master]);
    let master_keys = || hosts.run_in(mh, || keyspace(m));
    let other = 1 - master;
    let replicas: Vec<(&str, usize, &Redis)> = servers
        .iter()
        .zip(NAMES)
        .enumerate()
        .map(|(i, (rs, name))| (name, i + 1, rs))
        .chain([(["P", "Q"][other], SIDES[other], &cast.sides[other])])
        .collect();
    let mut end = 0;
    for &(name, host, rs) in &replicas {
        let what = format!("server {name} to hold the master's keyspace");
        end = wait_for(&what, DEADLINE * 4, || {
            let end = offset(m, mh);
            (offset(rs, host) == end && hosts.run_in(host, || keyspace(rs)) == master_keys())
                .then_some(end)
        });
    }
    for a in &agents {
        wait_for(
            "every log to hold the stream the servers hold",
            DEADLINE,
            || (hosts.run_in(a.host, || stream_status(&a.node).end_offset) >= end).then_some(()),
        );
    }
    let acked = acked.lock().unwrap().clone();
    for &(name, host, rs) in replicas.iter().chain([&(["P", "Q"][master], mh, m)]) {
        let mut con = hosts.run_in(host, || rs.con());
        for chunk in acked.chunks(1000) {
            let mut p = redis::pipe();
            for n in chunk {
                p.cmd("GET").arg(format!("ack:{n}"));
            }
            let got: Vec<Option<u64>> = p.query(&mut con).unwrap();
            for (n, v) in chunk.iter().zip(got) {
                assert_eq!(v, Some(*n), "acknowledged marker {n} missing on {name}");
            }
        }
    }
    let full = syncs_full() - full_before;
    let servers_full: Vec<usize> = servers.iter().map(full_syncs).collect();
    let sides_full: Vec<usize> = cast.sides.iter().map(full_syncs).collect();
    let [mended, cut, diverged] = agents.iter().fold([0.0; 3], |sum, a| {
        let now = a.counters(hosts);
        [0, 1, 2].map(|k| sum[k] + now[k] + a.counted_before[k])
    });
    let (mut rss, mut fds) = (0, 0);
    for a in &agents {
        rss = rss.max(peak_rss(a.pid()));
        fds = fds.max(open_fds(a.pid()));
    }
    eprintln!(
        "chaos summary: {server:?} seed {seed}, {seconds} s; faults: {} agents killed, {} frozen, {} records damaged, \
         {} log disks full, {} servers killed, {} links cut, {} failovers; full resyncs served by P and Q: {full}; \
         full syncs taken by P and Q: {sides_full:?}, by each fed server (the seeding included): {servers_full:?}; \
         bytes lost to failovers: {diverged}; damaged records mended {mended}, cut {cut}; keyspaces equal on 5 servers \
         ({} keys); {} acknowledged markers kept on every server; agents' peak RSS {} MiB, fds {fds}",
        injected.killed,
        injected.frozen,
        injected.damaged,
        injected.filled,
        injected.servers_killed,
        injected.cut,
        injected.failovers,
        master_keys().len(),
        acked.len(),
        rss >> 20,
    );
    // Every agent's log, each record checked against its hash as it is
    // read, is the primary's agent's, byte for byte, at least as far as
    // the servers converged (the master's pings may have gone on past it
    // into some logs): no damage is left.
    let dirs: Vec<PathBuf> = agents.iter().map(|a| a.log_dir.clone()).collect();
    // The agents stopped, their disks still mounted.
    let _disks: Vec<SmallFs> = agents.into_iter().map(|a| a.disk).collect();
    let (first, src) = log_bytes(&dirs[0]);
    assert!(
        first + src.len() as u64 >= end,
        "the source's log ends before {end}"
    );
    for dir in &dirs[1..] {
        let (at, bytes) = log_bytes(dir);
        let n = bytes.len().min(src.len());
        let what = dir.display();
        assert_eq!(at, first, "{what} starts where the source's log does");
        assert!(first + n as u64 >= end, "{what} ends before {end}");
        let differs = (0..n).find(|&i| bytes[i] != src[i]);
        assert_eq!(differs, None, "{what} differs from the source's log");
    }
    assert_eq!(full, 0, "no fault here costs P or Q a full resync");
    assert_eq!(sides_full, [0, 1], "Q's only full sync is its first");
    assert_eq!(
        servers_full,
        [1, 1, 1],
        "no fault here costs a server a full sync past its seeding"
    );
    assert_eq!(diverged, 0.0, "a planned failover loses no byte");
    assert_eq!(cut, 0.0, "every damaged record is mended from upstream");
    assert!(!acked.is_empty(), "the writer was acknowledged");
    assert!(rss < 512 << 20, "an agent's peak RSS: {rss}");
    assert!(fds < 512, "an agent's descriptors: {fds}");
}

on_both_servers!(chaos_run);
