//! Helpers shared by the integration tests: real agent processes on port 0,
//! waiting for events with deadlines (never sleeping for a state), scraping
//! `/metrics` over HTTP.
#![allow(dead_code)]

pub mod fake;
pub mod kv;
pub mod netns;
pub mod node;
pub mod pki;
pub mod sentinel;
pub mod stream;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Default deadline for waits in tests.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Records that `test` could not run here, and why. The skip is written
/// past the harness's capture and to `$KVSYNC_SKIP_LOG` (which
/// `scripts/test.sh` counts and names in its summary). Under CI
/// (`CI=true`) a skip fails the test unless `tests/SKIPS.md` allows it.
pub fn skip(test: &str, why: &str) {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let allowed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/SKIPS.md"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with(&format!("- `{test}`")));
    if ci && !allowed {
        panic!("{test} must run in CI, but: {why} (allow it in tests/SKIPS.md, with the reason, if it truly cannot)");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    if let Ok(log) = std::env::var("KVSYNC_SKIP_LOG") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("skip log");
        writeln!(f, "{test}: {why}").expect("write skip log");
    }
}

/// Path of the `kvsync` binary the tests run: the one built with them, or
/// `$KVSYNC_TEST_BIN` (another build, e.g. to see an attack test succeed
/// against the code before its fix).
pub fn kvsync_bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        std::env::var("KVSYNC_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvsync").into())
    })
}

/// Polls `cond` until it returns `Some` or the deadline passes (then panics
/// with `what`). Polling is paced at 10 ms; the deadline keeps a bug from
/// hanging CI.
pub fn wait_for<T>(what: &str, deadline: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = cond() {
            return v;
        }
        if Instant::now() > end {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Async version of [`wait_for`].
pub async fn wait_for_async<T, F, Fut>(what: &str, deadline: Duration, mut cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        if tokio::time::Instant::now() > end {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A `kvsync agent` child process, killed on drop.
pub struct AgentProcess {
    pub child: Child,
    /// The agent's ready line, split into `key=value` fields.
    pub ready: Vec<(String, String)>,
    pub stderr_log: PathBuf,
}

impl AgentProcess {
    /// Starts `kvsync agent` with `args` and waits for its ready line.
    pub fn start(args: &[&str], log_dir: &Path) -> AgentProcess {
        AgentProcess::start_env(args, &[], log_dir)
    }

    /// Like [`AgentProcess::start`], with extra environment variables.
    pub fn start_env(args: &[&str], env: &[(&str, &str)], log_dir: &Path) -> AgentProcess {
        AgentProcess::start_wrapped(&[], args, env, log_dir)
    }

    /// Like [`AgentProcess::start_env`], run through `wrapper` (a command
    /// and its arguments, e.g. `setpriv` to run as another user) when it
    /// is not empty.
    pub fn start_wrapped(
        wrapper: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
        log_dir: &Path,
    ) -> AgentProcess {
        let stderr_log = log_dir.join(format!("agent-{}.log", std::process::id() ^ rand_u32()));
        let mut command = match wrapper {
            [] => Command::new(kvsync_bin()),
            [program, rest @ ..] => {
                let mut c = Command::new(program);
                c.args(rest).arg(kvsync_bin());
                c
            }
        };
        let child = command
            .arg("agent")
            .args(args)
            .env("KVSYNC_LOG", "info,kvsync=debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).expect("log file"))
            .spawn()
            .expect("spawn kvsync agent");
        let mut agent = AgentProcess {
            child,
            ready: Vec::new(),
            stderr_log,
        };
        let stdout = agent.child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(Ok(line)) = lines.next() {
                if line.starts_with("kvsync agent ready") {
                    let _ = tx.send(line);
                }
            }
        });
        match rx.recv_timeout(DEADLINE) {
            Ok(line) => {
                agent.ready = line
                    .split_whitespace()
                    .filter_map(|f| f.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
            }
            Err(_) => panic!("agent did not become ready; log:\n{}", agent.log()),
        }
        agent
    }

    /// A field of the ready line (`grpc`, `data`, `metrics`, `node`).
    pub fn addr(&self, key: &str) -> String {
        self.ready
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("ready line has no {key}: {:?}", self.ready))
    }

    /// The agent's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Scrapes `/metrics`.
    pub fn metrics(&self) -> String {
        http_get(&self.addr("metrics"), "/metrics")
    }

    /// Sends `signal` to the agent.
    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits (with the deadline) for the agent to exit; its exit code.
    pub fn wait_exit(&mut self) -> Option<i32> {
        let end = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                Instant::now() < end,
                "the agent did not exit; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Lines of each agent's log a failed test prints (info and above).
const LOG_TAIL: usize = 40;

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A failed test shows what its agents said last.
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().filter(|l| !l.contains(" DEBUG ")).collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL)..];
            eprintln!(
                "--- the last {} lines of agent {} (grpc {}):\n{}",
                tail.len(),
                self.child.id(),
                self.ready
                    .iter()
                    .find(|(k, _)| k == "grpc")
                    .map_or("?", |(_, v)| v.as_str()),
                tail.join("\n")
            );
        }
    }
}

fn rand_u32() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(2_654_435_761)
}

/// A plain HTTP/1.1 GET; returns the body. Panics on a non-200 answer.
pub fn http_get(addr: &str, path: &str) -> String {
    let (status, body) = http_status(addr, path);
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// A plain HTTP/1.1 GET; returns the status code and the body.
pub fn http_status(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect metrics");
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("http response");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("unexpected response: {head}"));
    (status, body.to_string())
}

/// The value of a series selector `name{labels}` in a Prometheus scrape,
/// as PromQL's `sum(name{labels})` reads it: the sum over every sample of
/// that name with those labels (others free, like an agent's
/// `kv_instance`); `None` when no sample matches.
pub fn metric_value(scrape: &str, name_and_labels: &str) -> Option<f64> {
    let (name, want) = series(name_and_labels);
    let mut found = None;
    for l in scrape.lines().filter(|l| !l.starts_with('#')) {
        let Some((k, v)) = l.rsplit_once(' ') else {
            continue;
        };
        let (n, labels) = series(k);
        if n == name && want.iter().all(|w| labels.contains(w)) {
            *found.get_or_insert(0.0) += v.parse::<f64>().ok()?;
        }
    }
    found
}

/// A series' name and its `label="value"` pairs.
fn series(text: &str) -> (&str, Vec<(String, String)>) {
    let Some((name, rest)) = text.split_once('{') else {
        return (text, Vec::new());
    };
    let mut labels = Vec::new();
    let mut chars = rest.trim_end_matches('}').chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        chars.next(); // the opening quote
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => value.extend(chars.next()),
                '"' => break,
                c => value.push(c),
            }
        }
        chars.next_if_eq(&',');
        labels.push((key.trim().to_string(), value));
    }
    (name, labels)
}

/// Writes a generated KVR1 snapshot with the CLI.
pub fn gen_snapshot(out: &Path, size: u64, seq: u64) {
    let status = Command::new(kvsync_bin())
        .args([
            "gen-snapshot",
            "--format",
            "kvr1",
            "--size",
            &size.to_string(),
            "--seq",
            &seq.to_string(),
        ])
        .arg(out)
        .stdout(Stdio::null())
        .status()
        .expect("run gen-snapshot");
    assert!(status.success(), "gen-snapshot failed");
}

/// Runs `bash scripts/<script> args` from the project root with `env`, and
/// then checks that nothing it started outlives it: every run carries its
/// own `KVSYNC_SCRIPT_RUN` value, which each process it starts inherits
/// (daemons too), and a process still holding it once the script has
/// exited (and a short grace for `SIGTERM`ed servers to exit) fails the test.
pub fn run_script(script: &str, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    use std::sync::atomic::{AtomicU64, Ordering};
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let run = format!(
        "{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    );
    let out = Command::new("bash")
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("scripts")
                .join(script),
        )
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs(env.iter().copied())
        .env("KVSYNC_SCRIPT_RUN", &run)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let needle = format!("KVSYNC_SCRIPT_RUN={run}");
    let left = || -> Vec<(i32, String)> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|e| Some((e.file_name().to_str()?.parse::<i32>().ok()?, e.path())))
            .filter(|(_, p)| {
                std::fs::read(p.join("environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
            })
            .map(|(pid, p)| {
                let cmd = std::fs::read(p.join("cmdline")).unwrap_or_default();
                (pid, String::from_utf8_lossy(&cmd).replace('\0', " "))
            })
            .collect()
    };
    let grace = Instant::now() + Duration::from_secs(10);
    loop {
        let survivors = left();
        if survivors.is_empty() {
            break;
        }
        if Instant::now() > grace {
            for (pid, _) in &survivors {
                // SAFETY: kill(2) on a pid that carries this run's marker.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            panic!("{script} exited but left running: {survivors:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    out
}

/// Output of a command run in the soft-RoCE VM.
pub struct VmRun {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` inside the soft-RoCE VM (`scripts/rxe-vm.sh`) with `env` set
/// there. Returns `None`
/// (after printing why) where the VM cannot run here — not root, or the
/// harness cannot install what it needs; under CI (`CI=true`) that is a
/// failure instead, because CI must run the verbs tests.
pub fn run_in_vm(cmd: &[&str], env: &[(&str, &str)], timeout_s: u32) -> Option<VmRun> {
    vm_run(1, cmd, env, timeout_s)
}

/// Runs `cmd` in each of two soft-RoCE VMs joined by one link
/// (`rxe-vm.sh --hosts 2`): the output is VM a's, then VM b's, each after
/// a `=== vm a` / `=== vm b` line. Skips as [`run_in_vm`] does.
pub fn run_in_two_vms(cmd: &[&str], env: &[(&str, &str)], timeout_s: u32) -> Option<VmRun> {
    vm_run(2, cmd, env, timeout_s)
}

fn vm_run(hosts: u8, cmd: &[&str], env: &[(&str, &str)], timeout_s: u32) -> Option<VmRun> {
    let skip = |why: String| {
        skip("soft-RoCE VM", &why);
        None
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("the VM harness needs root".into());
    }
    let timeout = timeout_s.to_string();
    let hosts = hosts.to_string();
    let mut args = vec!["--hosts", hosts.as_str(), "--timeout", timeout.as_str()];
    for (name, _) in env {
        args.extend(["--env", name]);
    }
    args.push("--");
    args.extend(cmd);
    let out = run_script("rxe-vm.sh", &args, env);
    let run = VmRun {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    if run.code == 3 {
        return skip(format!(
            "the harness cannot run here: {}",
            run.stderr.trim()
        ));
    }
    Some(run)
}

/// A small tmpfs, unmounted when dropped.
pub struct SmallFs(pub PathBuf);

impl SmallFs {
    /// Mounts a tmpfs of `size` at `dir`; `None` (with the reason printed)
    /// when this process may not mount.
    pub fn mount(dir: &Path, size: &str) -> Option<SmallFs> {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "kvsync-test"])
            .arg(dir)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallFs(dir.to_owned())),
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr);
                skip(
                    "disk-full tmpfs",
                    &format!("cannot mount a tmpfs ({}); run as root", why.trim()),
                );
                None
            }
            Err(e) => {
                skip("disk-full tmpfs", &format!("no mount command ({e})"));
                None
            }
        }
    }

    /// Gives the filesystem `bytes` of room in all (rounded up to a page;
    /// less than it holds is refused): a disk that fills, or frees up.
    pub fn resize(&self, bytes: u64) -> Result<(), String> {
        let size = format!("remount,size={}k", bytes.div_ceil(4096) * 4);
        let out = std::process::Command::new("mount")
            .args(["-o", &size])
            .arg(&self.0)
            .output()
            .map_err(|e| e.to_string())?;
        match out.status.success() {
            true => Ok(()),
            false => Err(format!(
                "mount -o {size}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
        }
    }

    pub fn used_bytes(&self) -> u64 {
        // SAFETY: statvfs is plain old data; zero is a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let path = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string and a zeroed struct to fill.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut st) }, 0);
        (st.f_blocks - st.f_bfree) * st.f_frsize
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Runs the CLI with `args`; returns (success, stdout, stderr).
pub fn cli(args: &[&str]) -> (bool, String, String) {
    cli_env(args, &[])
}

/// Runs the CLI with `args` and `env`; returns (success, stdout, stderr).
pub fn cli_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = std::process::Command::new(kvsync_bin())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The indented blocks of `doc` that are configuration files (those that
/// begin with a `# /etc/kvsync/kvsync.toml` comment).
pub fn config_blocks(doc: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in doc.lines().chain([""]) {
        match (line.strip_prefix("    "), current.as_mut()) {
            (Some(l), Some(block)) => {
                block.push_str(l);
                block.push('\n');
            }
            (Some(l), None) if l.starts_with("# /etc/kvsync/kvsync.toml") => {
                current = Some(format!("{l}\n"));
            }
            (None, Some(_)) if line.is_empty() => blocks.extend(current.take()),
            _ => {}
        }
    }
    blocks
}

/// The most memory the process `pid` has held (VmHWM), in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}
