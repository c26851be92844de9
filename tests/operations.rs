//! Running kvsync as a service: the systemd unit, readiness and watchdog
//! notifications, graceful shutdown on SIGTERM (drain, then a clean cancel)
//! and admission limits — against real agent processes.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;

use common::node::*;
use common::pki;
use common::*;
use kvsync::rpc::pb;

#[test]
fn systemd_unit_verifies_and_has_what_rdma_and_draining_need() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/kvsync.service"
    ))
    .unwrap();
    for line in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "LimitMEMLOCK=infinity",
        "DeviceAllow=char-infiniband_verbs rw",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK",
        "TimeoutStopSec=150s",
    ] {
        assert!(
            unit.lines().any(|l| l.starts_with(line)),
            "unit lacks {line}"
        );
    }
    let k8s = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/kubernetes/daemonset.yaml"
    ))
    .unwrap();
    for needle in [
        "hostNetwork: true",
        "IPC_LOCK",
        "/dev/infiniband",
        "kind: ConfigMap",
        "path: /readyz",
        "secretName: kvsync-tls",
        "terminationGracePeriodSeconds",
    ] {
        assert!(k8s.contains(needle), "daemonset lacks {needle}");
    }
    // The ConfigMap's config is valid but for the mounted secrets.
    let embedded: String = k8s
        .split("kvsync.toml: |\n")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| l.starts_with("    "))
        .map(|l| format!("{}\n", &l[4..]))
        .collect();
    valid_but_for_certificates("the DaemonSet's ConfigMap", &embedded);
    let Ok(out) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        return skip("systemd-analyze", "systemd-analyze is not installed");
    };
    assert!(out.status.success());
    // Verify with ExecStart pointing at the built binary (verify checks it).
    // The Redis drop-in beside it, where systemd looks for drop-ins.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvsync.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/kvsync", kvsync_bin())).unwrap();
    let dropins = dir.path().join("kvsync.service.d");
    std::fs::create_dir(&dropins).unwrap();
    std::fs::write(
        dropins.join("redis.conf"),
        include_str!("../deploy/kvsync-redis.conf"),
    )
    .unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.path().display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && !stderr.contains("kvsync.service:")
            && !stderr.contains("redis.conf:"),
        "systemd-analyze verify:\n{stderr}"
    );
}

/// `setpriv` as `user` (its own group only): runs `args`, says whether
/// it succeeded.
fn as_user(user: &str, group: &str, args: &[&str]) -> bool {
    std::process::Command::new("setpriv")
        .args(["--reuid", user, "--regid", group, "--clear-groups", "--"])
        .args(args)
        .status()
        .unwrap()
        .success()
}

#[test]
fn the_install_script_leaves_a_config_only_the_agents_group_reads_and_dirs_its_user_writes() {
    // Installed into a temporary root for Debian's `redis` system user
    // (the suite's servers bring it), as root would install it.
    if !nix_is_root() {
        return skip("install.sh", "needs root, as the install does");
    }
    let root = tempfile::tempdir().unwrap();
    install_into(root.path());
    let r = root.path();
    let config = r.join("etc/kvsync/kvsync.toml");
    let config = config.to_str().unwrap();
    assert!(
        as_user("redis", "redis", &["cat", config]),
        "the agent reads its config"
    );
    assert!(
        !as_user("nobody", "nogroup", &["cat", config]),
        "no one else does"
    );
    for dir in [
        "var/lib/kvstore/snapshots",
        "var/lib/kvsync",
        "var/lib/kvsync/snapshots",
        "var/lib/kvsync/stream",
    ] {
        let probe = r.join(dir).join("probe");
        assert!(
            as_user("redis", "redis", &["touch", probe.to_str().unwrap()]),
            "the agent writes {dir}"
        );
    }
    let unit = std::fs::read_to_string(r.join("etc/systemd/system/kvsync.service")).unwrap();
    assert_eq!(unit, include_str!("../deploy/kvsync.service"));
    // The example config is one the agent accepts.
    let out = std::process::Command::new(kvsync_bin())
        .args(["check-config", config])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    // Run again: the config an operator edited stays.
    std::fs::write(config, "# edited\n").unwrap();
    install_into(root.path());
    assert_eq!(std::fs::read_to_string(config).unwrap(), "# edited\n");
}

/// Runs `deploy/install.sh` into `root` for Debian's `redis` user.
fn install_into(root: &Path) {
    let out = std::process::Command::new("sh")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/install.sh"))
        .env("DESTDIR", root)
        .env("KVSYNC_USER", "redis")
        .env("KVSYNC_BIN", kvsync_bin())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "install.sh: {stderr}");
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn the_daemonset_runs_the_image_the_dockerfile_builds_as_its_user_on_a_dir_it_owns() {
    let docker = include_str!("../Dockerfile");
    let k8s = include_str!("../deploy/kubernetes/daemonset.yaml");
    let tag = docker
        .lines()
        .find_map(|l| {
            l.trim_start_matches('#')
                .trim()
                .strip_prefix("docker build -t ")
        })
        .and_then(|l| l.split_whitespace().next())
        .expect("the Dockerfile says how to build it");
    assert!(docker.contains("USER 10001:10001"), "a non-root image");
    assert_eq!(
        k8s.matches(&format!("image: {tag}")).count(),
        2,
        "the agent and its init container run the image the Dockerfile builds"
    );
    assert!(k8s.contains("runAsUser: 10001") && k8s.contains("runAsGroup: 10001"));
    assert!(
        k8s.contains("[\"/bin/chown\", \"10001:10001\", \"/var/lib/kvstore/snapshots\"]"),
        "the hostPath is handed to the agent's user"
    );
    assert!(k8s.contains("hostPath: {path: /var/lib/kvstore/snapshots"));
    // The runtime stage installs the libraries the binary links.
    let ldd = std::process::Command::new("ldd")
        .arg(kvsync_bin())
        .output()
        .unwrap();
    let linked = String::from_utf8_lossy(&ldd.stdout);
    for (lib, package) in [
        ("libibverbs.so.1", "libibverbs1"),
        ("librdmacm.so.1", "librdmacm1"),
    ] {
        if linked.contains(lib) {
            assert!(
                docker.contains(package),
                "the image lacks {package} for {lib}"
            );
        }
    }
}

/// `config` (from `what`) is valid but for the TLS files it names, which
/// are not on this host.
fn valid_but_for_certificates(what: &str, config: &str) {
    let problems = kvsync::config::Config::parse(config)
        .unwrap_or_else(|e| panic!("{what}: {e}\n{config}"))
        .validate()
        .err()
        .unwrap_or_default();
    assert!(
        problems
            .iter()
            .all(|p| p.key.starts_with("tls.") && p.message.contains("cannot read")),
        "{what}: {problems:?}\n{config}"
    );
}

#[test]
fn the_quick_start_configurations_are_valid_but_for_the_certificates_they_name() {
    for (doc, text) in [
        ("README.md", include_str!("../README.md")),
        ("docs/STREAM.md", include_str!("../docs/STREAM.md")),
    ] {
        let blocks = config_blocks(text);
        assert_eq!(
            blocks.len(),
            2,
            "{doc}: a primary's and a replica's configuration"
        );
        for block in blocks {
            valid_but_for_certificates(doc, &block);
        }
    }
}

fn agent_config(root: &Path, name: &str, sync: &str) -> String {
    agent_config_with(root, name, "mode = \"tcp\"", sync)
}

/// The emulated RDMA fabric: sessions served from the snapshot cache.
const EMULATED: &str = "mode = \"auto\"\nrdma_provider = \"emulated\"";

/// [`agent_config`] with its own `[transport]` section.
fn agent_config_with(root: &Path, name: &str, transport: &str, sync: &str) -> String {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let path = root.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "node_id = \"{name}\"\ncreate_dirs = true\nsnapshot_dir = \"{}\"\n[grpc]\nlisten = \"127.0.0.1:0\"\n[data]\ntcp_listen = \"127.0.0.1:0\"\nrdma_port = 0\n[metrics]\nlisten = \"127.0.0.1:0\"\n[transport]\n{transport}\n[sync]\n{sync}\n",
            dir.display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// An agent started from `agent_config(root, name, sync)`, with `args`
/// appended to its command line and `env` set.
fn config_node(root: &Path, name: &str, sync: &str, args: &[&str], env: &[(&str, &str)]) -> Node {
    let config = agent_config(root, name, sync);
    let mut all = vec!["--config", config.as_str()];
    all.extend_from_slice(args);
    Node {
        proc: AgentProcess::start_env(&all, env, root),
        dir: root.join(name),
        token: None,
    }
}

#[test]
fn notifies_systemd_ready_watchdog_and_stopping_then_exits_zero_on_sigterm() {
    let root = tempfile::tempdir().unwrap();
    let socket_path = root.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket.set_read_timeout(Some(DEADLINE)).unwrap();
    let config = agent_config(root.path(), "a", "");
    let mut agent = AgentProcess::start_env(
        &["--config", &config],
        &[
            ("NOTIFY_SOCKET", socket_path.to_str().unwrap()),
            ("WATCHDOG_USEC", "200000"),
        ],
        root.path(),
    );
    let next = || {
        let mut buf = [0u8; 256];
        let n = socket
            .recv(&mut buf)
            .expect("a notification within the deadline");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert_eq!(next(), "READY=1\n");
    assert_eq!(next(), "WATCHDOG=1\n");
    agent.signal(libc::SIGTERM);
    while next() != "STOPPING=1\n" {}
    assert_eq!(agent.wait_exit(), Some(0), "{}", agent.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_transfer_drains_then_cancels_cleanly() {
    let root = tempfile::tempdir().unwrap();
    let source = stalling_source(root.path(), 3).await;
    // Long enough for the checks below on a loaded machine, so the drain
    // cannot end under them; the test still waits it out, to see the cancel.
    let mut replica = config_node(root.path(), "replica", "drain_timeout = \"8s\"", &[], &[]);
    let metrics = replica.proc.addr("metrics");
    let (code, body) = http_status(&metrics, "/readyz");
    assert_eq!(code, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["ready"], true, "{body}");
    assert_eq!(body["instances"][0]["health"], "ok", "{body}");
    sync_in_flight(&replica, &source).await;
    replica.proc.signal(libc::SIGTERM);
    // While draining, new syncs are refused as unavailable.
    let refused = wait_for_async("a refusal while draining", DEADLINE, || {
        let (r, s) = (&replica, &source);
        async move {
            let mut c = pb::orchestrator_client::OrchestratorClient::connect(format!(
                "http://{}",
                r.grpc()
            ))
            .await
            .ok()?;
            match c
                .start_full_sync(pb::StartFullSyncRequest {
                    source: s.grpc(),
                    transport: 0,
                    ..Default::default()
                })
                .await
            {
                Err(status) if status.code() == tonic::Code::Unavailable => Some(status),
                _ => None,
            }
        }
    })
    .await;
    assert!(refused.message().contains("shutting down"), "{refused:?}");
    // gRPC health says NOT_SERVING, and offers are refused too.
    assert_eq!(
        grpc_health(&replica.grpc()).await,
        tonic_health::pb::health_check_response::ServingStatus::NotServing
    );
    let offer = pb::peer_client::PeerClient::connect(format!("http://{}", replica.grpc()))
        .await
        .unwrap()
        .open_full_sync(pb::OpenFullSyncRequest::default())
        .await
        .unwrap_err();
    assert_eq!(offer.code(), tonic::Code::Unavailable, "{offer:?}");
    // HTTP probes (for orchestrators that cannot probe gRPC over TLS) agree.
    assert_eq!(http_status(&metrics, "/readyz").0, 503);
    assert_eq!(http_status(&metrics, "/healthz").0, 200);
    assert_eq!(replica.proc.wait_exit(), Some(0), "{}", replica.proc.log());
    assert!(
        replica.proc.log().contains("drain timeout: cancelling"),
        "{}",
        replica.proc.log()
    );
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    // The source notices the replica left and releases the snapshot.
    wait_for(
        "the source to release its cache reference",
        DEADLINE,
        || (source.metric("kvsync_snapshot_cache_refs") == 0.0).then_some(()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_running_transfer_finish_within_the_drain_timeout() {
    let root = tempfile::tempdir().unwrap();
    // 8 MiB at 4 MiB/s: a transfer that takes about two seconds.
    let source = config_node(root.path(), "source", "rate_limit = \"4MiB\"", &[], &[]);
    let bytes = put_snapshot(&source.dir, "s.kvr1", 8 << 20, 12);
    source.offered(12).await;
    let mut replica = config_node(root.path(), "replica", "drain_timeout = \"60s\"", &[], &[]);
    sync_in_flight(&replica, &source).await;
    replica.proc.signal(libc::SIGTERM);
    assert_eq!(replica.proc.wait_exit(), Some(0), "{}", replica.proc.log());
    let log = replica.proc.log();
    assert!(!log.contains("drain timeout"), "{log}");
    assert!(log.contains("full sync succeeded"), "{log}");
    assert!(std::fs::read(replica.dir.join("s.kvr1")).unwrap() == bytes);
    assert_eq!(
        kvsync::kv::handoff::read_replmeta_seq(&replica.dir.join("s.kvr1.replmeta")),
        Some(12)
    );
}

/// What a restarted agent's status says of the syncs before it: the
/// finished ones, kept in its `state_dir` (the harness gives every agent
/// one), none of it in the KV's directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sync_history_is_kept_across_a_restart_in_the_agents_state_dir() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", "", &[]);
    put_snapshot(&source.dir, "s.kvr1", 1 << 20, 5);
    source.offered(5).await;
    let mut replica = Node::start(root.path(), "replica", "", &[]);
    let done = sync_ok(&replica, &source).await;
    let recent = |s: &kvsync::rpc::pb::AgentStatus| {
        s.instances[0]
            .recent
            .iter()
            .map(|p| (p.sync_id.clone(), p.phase))
            .collect::<Vec<_>>()
    };
    let before = recent(&replica.status().await);
    assert_eq!(before.first().map(|r| &r.0), Some(&done.sync_id));
    // The write follows the sync's end: wait for the file.
    let kept = root
        .path()
        .join("replica-state")
        .join(kvsync::sync::history::FILE);
    wait_for("the history to be kept", DEADLINE, || {
        kept.exists().then_some(())
    });
    let in_kv_dir: Vec<_> = std::fs::read_dir(&replica.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !in_kv_dir.iter().any(|n| n.contains("history")),
        "none of it in the KV's directory: {in_kv_dir:?}"
    );
    replica.proc.signal(libc::SIGTERM);
    assert_eq!(replica.proc.wait_exit(), Some(0));
    drop(replica);
    let replica = Node::start(root.path(), "replica", "", &[]);
    assert_eq!(recent(&replica.status().await), before);
}

/// A mistyped directory is refused at start, not created empty, unless
/// `create_dirs = true` asks for it.
#[test]
fn a_missing_directory_is_refused_unless_create_dirs_says_to_create_it() {
    let root = tempfile::tempdir().unwrap();
    let start = |config: &str| {
        let path = root.path().join("agent.toml");
        std::fs::write(
            &path,
            format!("{config}[grpc]\nlisten = \"127.0.0.1:0\"\n[data]\ntcp_listen = \"127.0.0.1:0\"\nrdma_port = 0\n[metrics]\nlisten = \"\"\n"),
        )
        .unwrap();
        let mut child = std::process::Command::new(kvsync_bin())
            .args(["agent", "--config", path.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        (ready, String::from_utf8_lossy(&out.stderr).to_string())
    };
    let snaps = root.path().join("snapshts");
    let (ready, log) = start(&format!("snapshot_dir = \"{}\"\n", snaps.display()));
    assert!(ready.is_empty(), "{ready}");
    assert!(
        log.contains(&format!("snapshot_dir {} does not exist", snaps.display())),
        "{log}"
    );
    assert!(!snaps.exists(), "nothing created");
    std::fs::create_dir(&snaps).unwrap();
    let state = root.path().join("stat");
    let (ready, log) = start(&format!(
        "snapshot_dir = \"{}\"\nstate_dir = \"{}\"\n",
        snaps.display(),
        state.display()
    ));
    assert!(ready.is_empty(), "{ready}");
    assert!(
        log.contains(&format!("state_dir {} does not exist", state.display())),
        "{log}"
    );
    assert!(!state.exists(), "nothing created");
    let log_dir = root.path().join("strem");
    let stream = format!(
        "snapshot_dir = \"{}\"\n[stream]\ndir = \"{}\"\nupstream = \"127.0.0.1:1\"\n",
        snaps.display(),
        log_dir.display()
    );
    let (ready, log) = start(&stream);
    assert!(ready.is_empty(), "{ready}");
    assert!(
        log.contains(&format!(
            "[stream] dir {} does not exist",
            log_dir.display()
        )),
        "{log}"
    );
    assert!(!log_dir.exists(), "nothing created");
    let (ready, log) = start(&format!(
        "create_dirs = true\nstate_dir = \"{}\"\n{stream}",
        state.display()
    ));
    assert!(ready.contains("kvsync agent ready"), "{ready}{log}");
    assert!(log_dir.is_dir() && state.is_dir());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_limits_refuse_the_next_sync_with_retry_advice() {
    let root = tempfile::tempdir().unwrap();
    let source = stalling_source(root.path(), 3).await;
    let replica = config_node(root.path(), "replica", "max_incoming_syncs = 1", &[], &[]);
    let id = sync_in_flight(&replica, &source).await;
    // A second source: the replica is at its limit.
    let other = Node::start(root.path(), "other", "", &[]);
    let mut c = replica.client().await;
    let err = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: other.grpc(),
            transport: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("max_incoming_syncs") && err.message().contains("retry"),
        "{err:?}"
    );
    // Raised by a SIGHUP reload, the limit admits it; the running sync goes on.
    agent_config(root.path(), "replica", "max_incoming_syncs = 2");
    replica.reload();
    let second = start_sync(&replica, &other).await;
    assert_ne!(second, id);
    let status = replica.status().await;
    let first = status.running.iter().find(|p| p.sync_id == id);
    assert!(
        first.is_some_and(|p| p.phase == pb::Phase::Transferring as i32),
        "the running sync goes on: {status:?}"
    );

    // A source at its limit of outgoing sessions refuses the next offer.
    let tight = config_node(
        root.path(),
        "tight",
        "max_outgoing_syncs = 1",
        &[],
        &[STALL_AFTER_1MIB],
    );
    put_snapshot(&tight.dir, "t.kvr1", 4 << 20, 5);
    tight.offered(5).await;
    let first = Node::start(root.path(), "r1", "", &[]);
    sync_in_flight(&first, &tight).await;
    let second = Node::start(root.path(), "r2", "", &[]);
    let id = start_sync(&second, &tight).await;
    let p = wait_done(&second, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(p.error.contains("max_outgoing_syncs"), "{}", p.error);
    // Raised by a SIGHUP reload, the source serves the next one too.
    agent_config(root.path(), "tight", "max_outgoing_syncs = 2");
    tight.reload();
    let third = Node::start(root.path(), "r3", "", &[]);
    sync_in_flight(&third, &tight).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_budget_and_linger_reload_on_sighup_and_the_budget_refuses_what_does_not_fit() {
    let root = tempfile::tempdir().unwrap();
    let budget = |b: &str| format!("[cache]\nmemory_budget = \"{b}\"");
    // Over the emulated fabric: RDMA sends from the cache (TCP from the file).
    let emulated = |name: &str, sync: &str| {
        let config = agent_config_with(root.path(), name, EMULATED, sync);
        Node {
            proc: AgentProcess::start_env(&["--config", &config], &[], root.path()),
            dir: root.path().join(name),
            token: None,
        }
    };
    let source = emulated("source", &budget("1MiB"));
    let bytes = put_snapshot(&source.dir, "s.kvr1", 4 << 20, 7);
    source.offered(7).await;
    let replica = emulated("replica", "");
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(
        p.error.contains("exceeds the cache memory budget") && p.error.contains("memory_budget"),
        "{}",
        p.error
    );
    assert!(!replica.dir.join("s.kvr1").exists());
    assert_eq!(source.metric("kvsync_snapshot_cache_loads_total"), 0.0);

    // Raised by a reload (and the linger time with it, to none).
    let raised = format!("{}\nlinger = \"0s\"", budget("64MiB"));
    agent_config_with(root.path(), "source", EMULATED, &raised);
    source.reload();
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    assert_eq!(std::fs::read(replica.dir.join("s.kvr1")).unwrap(), bytes);
    wait_for("the buffer freed at once (no linger)", DEADLINE, || {
        (source.metric("kvsync_snapshot_cache_entries") == 0.0).then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_retries_with_backoff_until_a_late_source_comes_up() {
    let root = tempfile::tempdir().unwrap();
    let retries = "retries = 20\nretry_backoff = \"50ms\"\nretry_backoff_max = \"200ms\"";
    let replica = config_node(root.path(), "replica", retries, &[], &[]);
    // The source's address, with nothing listening yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let source_addr = format!("127.0.0.1:{port}");
    let mut c = replica.client().await;
    let id = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: source_addr.clone(),
            transport: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sync_id;
    // Wait until at least two attempts failed, then bring the source up.
    let mut stream = c
        .watch_sync(pb::WatchSyncRequest {
            sync_id: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let seen = tokio::time::timeout(DEADLINE, async {
        while let Some(p) = futures::StreamExt::next(&mut stream).await {
            let p = p.unwrap();
            if p.attempts >= 3 {
                return p;
            }
        }
        panic!("the sync ended before retrying");
    })
    .await
    .expect("retries in time");
    assert!(
        seen.last_error.contains("unreachable"),
        "{}",
        seen.last_error
    );
    let source = config_node(
        root.path(),
        "source",
        "",
        &["--grpc-listen", &source_addr],
        &[],
    );
    let bytes = put_snapshot(&source.dir, "late.kvr1", 1 << 20, 8);
    source.offered(8).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    assert!(p.attempts >= 3, "{p:?}");
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_are_required_counted_and_reloaded_on_sighup() {
    let root = tempfile::tempdir().unwrap();
    let tokens = root.path().join("tokens");
    std::fs::write(&tokens, "# fleet\nfirst-fleet-token-0001\n").unwrap();
    // Agent to agent on loopback: nothing proves which process answers,
    // so presenting the token in clear is the operator's explicit choice.
    let auth = format!(
        "\n[auth]\ntoken_file = \"{}\"\nsend_token_in_clear = true",
        tokens.display()
    );
    let start = |name: &str| config_node(root.path(), name, &auth, &[], &[]);
    let (source, replica) = (start("source"), start("replica"));
    put_snapshot(&source.dir, "s.kvr1", 1 << 20, 4);

    let cli = |token_file: Option<&Path>| {
        let mut c = std::process::Command::new(kvsync_bin());
        if let Some(f) = token_file {
            c.arg("--token-file").arg(f);
        }
        c.args(["snapshots", "--agent", &source.grpc(), "--json"])
            .output()
            .unwrap()
    };
    // Health stays open without a token, for probes.
    assert_eq!(
        grpc_health(&source.grpc()).await,
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
    // KVSYNC_TOKEN_FILE stands in for --token-file.
    let out = std::process::Command::new(kvsync_bin())
        .env("KVSYNC_TOKEN_FILE", &tokens)
        .args(["status", "--agent", &source.grpc(), "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = cli(None);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("missing bearer token"),
        "{out:?}"
    );
    let wrong = root.path().join("wrong");
    std::fs::write(&wrong, "not-the-fleet-token-0001\n").unwrap();
    assert!(String::from_utf8_lossy(&cli(Some(&wrong)).stderr).contains("not accepted"));
    assert_eq!(source.metric("kvsync_grpc_auth_failures_total"), 2.0);
    wait_for("the snapshot offered", DEADLINE, || {
        String::from_utf8_lossy(&cli(Some(&tokens)).stdout)
            .contains("\"seq\":4")
            .then_some(())
    });

    // Agent to agent: the replica presents the fleet token to the source.
    let token_file = tokens.display().to_string();
    let sync = || {
        let out = cli_sync(&["--token-file", &token_file], &replica, &source);
        assert!(out.status.success(), "{out:?}");
    };
    sync();

    // A new token, reloaded by both agents on SIGHUP: the old one stops working.
    std::fs::write(&tokens, "second-fleet-token-0002\n").unwrap();
    source.reload();
    replica.reload();
    let old = root.path().join("old");
    std::fs::write(&old, "first-fleet-token-0001\n").unwrap();
    assert!(String::from_utf8_lossy(&cli(Some(&old)).stderr).contains("not accepted"));
    sync();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_holds_and_reloads_on_sighup() {
    let root = tempfile::tempdir().unwrap();
    let source = config_node(root.path(), "source", "rate_limit = \"32MiB\"", &[], &[]);
    put_snapshot(&source.dir, "s.kvr1", 32 << 20, 6);
    source.offered(6).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    // Never faster than the limit allows, minus 10 % for the burst.
    let at_least = |p: pb::SyncProgress, ms: u64| {
        assert!(
            p.duration_ms >= ms,
            "the limit was exceeded: {} ms",
            p.duration_ms
        );
    };
    // 32 MiB at 32 MiB/s.
    at_least(sync_ok(&replica, &source).await, 900);

    // Lowered by a reload: 16 MiB at 8 MiB/s (0.5 s at the old limit).
    agent_config(root.path(), "source", "rate_limit = \"8MiB\"");
    source.reload();
    put_snapshot(&source.dir, "t.kvr1", 16 << 20, 7);
    source.offered(7).await;
    at_least(sync_ok(&replica, &source).await, 1800);
}

#[test]
fn grpc_over_tls_and_mutual_tls_with_a_ca_made_in_the_test() {
    let root = tempfile::tempdir().unwrap();
    let fleet = pki::Pki::new(root.path(), "fleet");
    let rogue = pki::Pki::new(root.path(), "rogue");
    let s = |p: &Path| p.display().to_string();
    let tls = |cert: &(std::path::PathBuf, std::path::PathBuf), extra: &str| {
        format!(
            "\n[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n{extra}\n",
            cert.0.display(),
            cert.1.display(),
            fleet.ca_file().display()
        )
    };
    // The source requires client certificates and is known by name only;
    // the replica serves TLS to anyone and checks the source by that name.
    let source_cert = fleet.issue("source", &["source.kvsync.test"]);
    let replica_cert = fleet.issue("replica", &["localhost", "127.0.0.1"]);
    let source = Node::start(
        root.path(),
        "source",
        &tls(&source_cert, "client_auth = true"),
        &[],
    );
    let replica = Node::start(
        root.path(),
        "replica",
        &tls(&replica_cert, "server_name = \"source.kvsync.test\""),
        &[],
    );
    put_snapshot(&source.dir, "s.kvr1", 3 << 20, 9);
    let (ca, rogue_ca) = (s(&fleet.ca_file()), s(&rogue.ca_file()));

    // TLS: plaintext and an untrusted CA fail; the fleet CA works.
    let (ok, _, err) = cli(&["status", "--agent", &replica.grpc()]);
    assert!(!ok && err.contains("pass --tls-ca"), "{err}");
    let (ok, _, err) = cli(&["--tls-ca", &rogue_ca, "status", "--agent", &replica.grpc()]);
    assert!(!ok && err.contains("certificate"), "{err}");
    let (ok, out, err) = cli(&[
        "--tls-ca",
        &ca,
        "status",
        "--agent",
        &replica.grpc(),
        "--json",
    ]);
    assert!(ok && out.contains("\"node_id\":\"replica\""), "{out}{err}");

    // The source's certificate names source.kvsync.test, not 127.0.0.1.
    let to_source = |extra: &[&str]| {
        let mut args = vec!["--tls-ca", ca.as_str()];
        args.extend_from_slice(extra);
        let grpc = source.grpc();
        args.extend_from_slice(&["snapshots", "--agent", &grpc, "--json"]);
        cli(&args)
    };
    let (fleet_cert, fleet_key) = fleet.issue("operator", &["operator"]);
    let (rogue_cert, rogue_key) = rogue.issue("intruder", &["operator"]);
    let (fleet_cert, fleet_key) = (s(&fleet_cert), s(&fleet_key));
    let (ok, _, err) = to_source(&["--tls-cert", &fleet_cert, "--tls-key", &fleet_key]);
    assert!(!ok && err.contains("certificate"), "{err}");
    let name = ["--tls-server-name", "source.kvsync.test"];
    // mTLS: no client certificate, or one from another CA, is refused.
    let (ok, _, err) = to_source(&name);
    assert!(
        !ok && err.contains("--tls-cert"),
        "no client certificate: {err}"
    );
    let (ok, _, err) = to_source(
        &[
            &name[..],
            &["--tls-cert", &s(&rogue_cert), "--tls-key", &s(&rogue_key)],
        ]
        .concat(),
    );
    assert!(
        !ok && err.contains("refused this client certificate"),
        "the source accepted a certificate of another CA: {err}"
    );
    let with_cert = [
        &name[..],
        &["--tls-cert", &fleet_cert, "--tls-key", &fleet_key],
    ]
    .concat();
    wait_for("the snapshot offered over mTLS", DEADLINE, || {
        let (ok, out, _) = to_source(&with_cert);
        (ok && out.contains("\"seq\":9")).then_some(())
    });
    // The same settings from the environment, as a service unit sets them.
    let (ok, out, err) = cli_env(
        &["snapshots", "--agent", &source.grpc(), "--json"],
        &[
            ("KVSYNC_TLS_CA", &ca),
            ("KVSYNC_TLS_CERT", &fleet_cert),
            ("KVSYNC_TLS_KEY", &fleet_key),
            ("KVSYNC_TLS_SERVER_NAME", "source.kvsync.test"),
        ],
    );
    assert!(ok && out.contains("\"seq\":9"), "{out}{err}");

    // Agent to agent: the replica dials the source over mTLS with its own
    // certificate and verifies the source by its configured name.
    // Both have [tls], so the data path is encrypted too, and the source's
    // certificate is checked by the same name.
    // The records go through the kernel where it has the tls module (not
    // on this build host; the soft-RoCE VM test covers the kernel's TLS).
    let out = cli_sync(&["--tls-ca", &ca], &replica, &source);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let link = match kvsync::transport::ktls::available() {
        Ok(()) => "tcp (TLS in the kernel) stream",
        Err(_) => "tcp (TLS) stream",
    };
    assert!(
        out.status.success() && stdout.contains("\"seq\":9") && stdout.contains(link),
        "{out:?}"
    );
    assert_eq!(
        std::fs::read(replica.dir.join("s.kvr1")).unwrap(),
        std::fs::read(source.dir.join("s.kvr1")).unwrap()
    );

    // `[data] tls = "required"` on one end and "off" on the other: refused
    // before any byte moves, with the reason and what to do.
    let plain = |name: &str, data: &str, cert| {
        Node::start(
            root.path(),
            name,
            &format!("{}[data]\ntls = \"{data}\"\n", tls(cert, "")),
            &[],
        )
    };
    let replica_cert = fleet.issue("agent", &["localhost", "127.0.0.1"]);
    for (source_tls, replica_tls, why) in [
        (
            "required",
            "off",
            "this source requires an encrypted data plane",
        ),
        (
            "off",
            "required",
            "offered the data plane without TLS and this replica requires it",
        ),
    ] {
        let source = plain(&format!("src-{source_tls}"), source_tls, &replica_cert);
        let replica = plain(&format!("dst-{replica_tls}"), replica_tls, &replica_cert);
        put_snapshot(&source.dir, "s.kvr1", 1 << 20, 4);
        wait_for("the snapshot offered", DEADLINE, || {
            let grpc = source.grpc();
            let (ok, out, _) = cli(&["--tls-ca", &ca, "snapshots", "--agent", &grpc, "--json"]);
            (ok && out.contains("\"seq\":4")).then_some(())
        });
        let out = cli_sync(&["--tls-ca", &ca], &replica, &source);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success() && stdout.contains(why), "{out:?}");
        assert!(!replica.dir.join("s.kvr1").exists());
        assert!(replica.temp_files().is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traversal_attempts_and_oversize_fields_are_refused_without_harm() {
    let root = tempfile::tempdir().unwrap();
    let (agent, bytes) = offering_source(root.path(), 1 << 20, 6, &[]).await;
    let before: Vec<_> = std::fs::read_dir(&agent.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    fn invalid<T>(r: Result<T, tonic::Status>, what: &str) {
        let status = r.err().unwrap_or_else(|| panic!("{what} was accepted"));
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{what}: {status:?}"
        );
    }

    // Orchestrator fields: a source is an address, a sync id is an id.
    let mut c = agent.client().await;
    let long = "x".repeat(5000);
    for source in [
        "../../etc/passwd",
        "/var/lib/kvstore/snapshots/s.kvr1:1",
        "file:///etc/shadow",
        long.as_str(),
    ] {
        let req = pb::StartFullSyncRequest {
            source: source.into(),
            transport: 0,
            ..Default::default()
        };
        invalid(c.start_full_sync(req).await, source);
    }
    let req = pb::StartFullSyncRequest {
        source: "127.0.0.1:1".into(),
        transport: 99,
        ..Default::default()
    };
    invalid(c.start_full_sync(req).await, "transport 99");
    for id in ["../../etc/passwd", "", long.as_str(), "a\0b"] {
        invalid(
            c.watch_sync(pb::WatchSyncRequest { sync_id: id.into() })
                .await,
            id,
        );
        invalid(
            c.cancel_sync(pb::CancelSyncRequest { sync_id: id.into() })
                .await,
            id,
        );
    }
    // A request larger than any valid one is refused before it is parsed.
    let huge = pb::StartFullSyncRequest {
        source: "y".repeat(1 << 20),
        transport: 0,
        ..Default::default()
    };
    let status = c.start_full_sync(huge).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");

    // Peer fields: a replica cannot name a path, a foreign format, or flood
    // the transport list.
    let mut peer = pb::peer_client::PeerClient::connect(format!("http://{}", agent.grpc()))
        .await
        .unwrap();
    let open = |f: &dyn Fn(&mut pb::OpenFullSyncRequest)| {
        let mut r = pb::OpenFullSyncRequest {
            replica_node_id: "r".into(),
            transports: vec![pb::Transport::Tcp as i32],
            ..Default::default()
        };
        f(&mut r);
        r
    };
    for (what, req) in [
        (
            "node id path",
            open(&|r| r.replica_node_id = "../../etc".into()),
        ),
        (
            "node id control",
            open(&|r| r.replica_node_id = "a\nb".into()),
        ),
        (
            "node id length",
            open(&|r| r.replica_node_id = long.clone()),
        ),
        (
            "format path",
            open(&|r| r.format = "../../etc/passwd".into()),
        ),
        ("format length", open(&|r| r.format = long.clone())),
        ("provider length", open(&|r| r.rdma_provider = long.clone())),
        ("transports", open(&|r| r.transports = vec![1; 1000])),
    ] {
        invalid(peer.open_full_sync(req).await, what);
    }
    invalid(
        peer.report_result(pb::ReportResultRequest {
            session_id: long.clone(),
            ok: false,
            error: "e".into(),
            handoff_ms: 0,
            ..Default::default()
        })
        .await,
        "session id length",
    );

    // Nothing moved, nothing was written, and the agent still works.
    let after: Vec<_> = std::fs::read_dir(&agent.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after);
    assert_eq!(agent.metric("kvsync_snapshot_cache_refs"), 0.0);
    let offer = peer
        .open_full_sync(open(&|_| ()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(offer.snapshot_size, bytes.len() as u64);
}

#[test]
fn required_tls_keeps_rdma_off_unless_the_fabric_is_declared_trusted() {
    let root = tempfile::tempdir().unwrap();
    let fleet = pki::Pki::new(root.path(), "fleet");
    let (cert, key) = fleet.issue("agent", &["localhost"]);
    let probe = |extra: &str| {
        let config = root.path().join("probe.toml");
        std::fs::write(
            &config,
            format!(
                "[data]\ntls = \"required\"\n[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n[transport]\nmode = \"auto\"\nrdma_provider = \"emulated\"\n{extra}",
                cert.display(),
                key.display(),
                fleet.ca_file().display()
            ),
        )
        .unwrap();
        let (ok, out, err) = cli(&["probe", "--config", config.to_str().unwrap()]);
        assert!(ok, "{err}");
        out
    };
    let out = probe("");
    assert!(
        out.contains("RDMA has no TLS") && out.contains("would use: tcp"),
        "{out}"
    );
    let out = probe("rdma_unencrypted_ok = true\n");
    assert!(out.contains("would use: rdma"), "{out}");
}
