//! One agent, many KV instances (`[[instance]]`): every request names its
//! instance (or none, against an agent that has one), a session offered for
//! one instance proves nothing for another, each instance's snapshots and
//! syncs are its own in status and metrics, and SIGHUP adds an instance
//! while another instance's sync runs without touching it. Real agent
//! processes; the Redis instances are in `tests/redis.rs`.

mod common;

use std::path::Path;

use common::node::*;
use common::*;
use kvsync::rpc::pb;

/// The common part of a test agent's file, without any instance.
fn agent_head(name: &str, extra: &str) -> String {
    format!(
        "node_id = \"{name}\"\n[grpc]\nlisten = \"127.0.0.1:0\"\n[data]\ntcp_listen = \"127.0.0.1:0\"\nrdma_port = 0\npeer_timeout = \"5s\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n[watch]\ndebounce = \"20ms\"\n[transport]\nmode = \"tcp\"\n{extra}"
    )
}

/// An `[[instance]]` table of KVR1 snapshots in `root/<agent>-<name>`.
fn kvr1_instance(root: &Path, agent: &str, name: &str) -> String {
    let dir = root.join(format!("{agent}-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    format!(
        "\n[[instance]]\nname = \"{name}\"\nsnapshot_dir = \"{}\"\nsnapshot_format = \"kvr1\"\n",
        dir.display()
    )
}

/// Starts agent `name` with `instances` (KVR1 tables); `extra` goes into
/// the agent-wide part. The node's `dir` is the first instance's.
fn multi(root: &Path, name: &str, instances: &[&str], extra: &str) -> Node {
    let mut text = agent_head(name, extra);
    for i in instances {
        text.push_str(&kvr1_instance(root, name, i));
    }
    let config = root.join(format!("{name}.toml"));
    std::fs::write(&config, text).unwrap();
    let proc = AgentProcess::start(&["--config", config.to_str().unwrap()], root);
    Node {
        proc,
        dir: root.join(format!("{name}-{}", instances[0])),
        token: None,
    }
}

fn instance_dir(root: &Path, agent: &str, name: &str) -> std::path::PathBuf {
    root.join(format!("{agent}-{name}"))
}

fn peer(
    node: &Node,
) -> impl std::future::Future<Output = pb::peer_client::PeerClient<tonic::transport::Channel>> {
    let addr = format!("http://{}", node.grpc());
    async move { pb::peer_client::PeerClient::connect(addr).await.unwrap() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_offered_for_one_instance_proves_nothing_for_another() {
    let root = tempfile::tempdir().unwrap();
    let source = multi(root.path(), "source", &["a", "b"], "");
    put_snapshot(
        &instance_dir(root.path(), "source", "a"),
        "s.kvr1",
        1 << 20,
        10,
    );
    // b's snapshot is newer and bigger: a mix-up would be seen.
    put_snapshot(
        &instance_dir(root.path(), "source", "b"),
        "s.kvr1",
        3 << 20,
        20,
    );
    source.offered_in("a", 10).await;
    source.offered_in("b", 20).await;
    let mut peer = peer(&source).await;

    // Among several instances, an unnamed or unknown one is refused with
    // the names to choose from.
    for (named, says) in [
        ("", "serves 2 instances (a, b)"),
        ("c", "no instance \"c\"; it serves a, b"),
    ] {
        let err = peer
            .open_full_sync(pb::OpenFullSyncRequest {
                instance: named.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(says), "{err:?}");
    }

    let offer = peer
        .open_full_sync(pb::OpenFullSyncRequest {
            instance: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((offer.instance.as_str(), offer.seq), ("a", 10));
    // a's session presented for b: its manifest is not handed out, and
    // its result is not taken (the offer stays).
    let err = peer
        .get_manifest(pb::GetManifestRequest {
            session_id: offer.session_id.clone(),
            instance: "b".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    let err = peer
        .report_result(pb::ReportResultRequest {
            session_id: offer.session_id.clone(),
            instance: "b".into(),
            ok: false,
            error: "withdraw it".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    let mut parts = peer
        .get_manifest(pb::GetManifestRequest {
            session_id: offer.session_id.clone(),
            instance: "a".into(),
        })
        .await
        .expect("the offer is still there for its own instance")
        .into_inner();
    assert!(parts.message().await.unwrap().is_some());

    // A replica pulling a gets a's bytes, b's stay b's.
    let replica = multi(root.path(), "replica", &["a", "b"], "");
    let p = sync_into(&replica, &source.grpc(), "a").await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{}", p.error);
    assert_eq!(
        (p.instance.as_str(), p.seq, p.bytes_total),
        ("a", 10, 1 << 20)
    );
    assert!(p.installed_path.starts_with(
        &instance_dir(root.path(), "replica", "a")
            .display()
            .to_string()
    ));
    assert_eq!(
        std::fs::read(&p.installed_path).unwrap(),
        std::fs::read(instance_dir(root.path(), "source", "a").join("s.kvr1")).unwrap()
    );
    assert!(std::fs::read_dir(instance_dir(root.path(), "replica", "b"))
        .unwrap()
        .next()
        .is_none());
    // Each instance's series are its own.
    let m = |node: &Node, series: &str| metric_value(&node.proc.metrics(), series).unwrap_or(-1.0);
    for (node, role) in [(&replica, "replica"), (&source, "source")] {
        assert_eq!(
            m(
                node,
                &format!(
                    r#"kvsync_fullsync_total{{kv_instance="a",result="ok",role="{role}",transport="tcp"}}"#
                )
            ),
            1.0
        );
        assert_eq!(
            m(
                node,
                &format!(
                    r#"kvsync_fullsync_total{{kv_instance="b",result="ok",role="{role}",transport="tcp"}}"#
                )
            ),
            0.0
        );
    }
    assert_eq!(
        m(
            &source,
            r#"kvsync_snapshot_latest_seq{format="kvr1",kv_instance="b"}"#
        ),
        20.0
    );
    // The CLI: a verb needs --instance among several; status lists them.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(kvsync_bin())
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, _, err) = cli(&["snapshots", "--agent", &source.grpc()]);
    assert!(!ok && err.contains("serves 2 instances (a, b)"), "{err}");
    let (ok, out, err) = cli(&[
        "snapshots",
        "--agent",
        &source.grpc(),
        "--instance",
        "b",
        "--json",
    ]);
    assert!(ok, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (list[0]["instance"].as_str(), list[0]["seq"].as_u64()),
        (Some("b"), Some(20))
    );
    let (ok, out, err) = cli(&["status", "--agent", &replica.grpc(), "--json"]);
    assert!(ok, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["instances"][0]["name"], "a");
    assert_eq!(status["instances"][0]["recent"][0]["status"], "succeeded");
    assert_eq!(status["instances"][1]["name"], "b");
    let (ok, out, _) = cli(&["status", "--agent", &replica.grpc()]);
    assert!(
        ok && out.contains("instance a: kvr1 snapshots in") && out.contains("instance b:"),
        "{out}"
    );
    // Status groups by instance.
    let status = replica.status().await;
    let names: Vec<_> = status.instances.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(status.instances[0].recent.len(), 1);
    assert!(status.instances[1].recent.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_adds_an_instance_while_another_instances_sync_runs_untouched() {
    let root = tempfile::tempdir().unwrap();
    // A single-instance source whose sends are slow enough to reload
    // during one; it becomes the `[[instance]]` file below.
    let source = Node::start(
        root.path(),
        "source",
        "[sync]\nrate_limit = \"4MiB\"\n",
        &[],
    );
    put_snapshot(&source.dir, "s.kvr1", 16 << 20, 7);
    source.offered(7).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    let id = start_sync(&replica, &source).await;
    wait_bytes(&replica, &id, 1 << 20).await;

    // Both agents' files now list the old instance as `default`, with the
    // same settings, and a new one.
    for (node, name, extra) in [
        (
            &source,
            "source",
            "[sync]\nretries = 0\nrate_limit = \"4MiB\"\n",
        ),
        (&replica, "replica", "[sync]\nretries = 0\n"),
    ] {
        let text = format!(
            "{}\n[[instance]]\nname = \"default\"\nsnapshot_dir = \"{}\"\n{}",
            agent_head(name, extra),
            node.dir.display(),
            kvr1_instance(root.path(), name, "new")
        );
        std::fs::write(root.path().join(format!("{name}.toml")), text).unwrap();
        node.reload();
        assert!(node.proc.log().contains("instance started"));
    }
    let running = replica.status().await.running;
    assert!(
        running.iter().any(|p| p.sync_id == id),
        "both reloads happened while the sync ran"
    );
    put_snapshot(
        &instance_dir(root.path(), "source", "new"),
        "n.kvr1",
        1 << 20,
        8,
    );
    source.offered_in("new", 8).await;
    let p = sync_into(&replica, &source.grpc(), "new").await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{}", p.error);

    // The sync that ran through both reloads went on as it was.
    let first = wait_done(&replica, &id).await;
    assert_eq!(first.phase, pb::Phase::Succeeded as i32, "{}", first.error);
    assert_eq!((first.instance.as_str(), first.attempts), ("default", 1));
    assert_eq!(first.seq, 7);
    for node in [&source, &replica] {
        assert!(!node.proc.log().contains("instance removed"));
        assert!(!node.proc.log().contains("restarting it"));
    }

    // Removing the new instance again: its series go, the old one's stay.
    let text = format!(
        "{}\n[[instance]]\nname = \"default\"\nsnapshot_dir = \"{}\"\n",
        agent_head("replica", "[sync]\nretries = 0\n"),
        replica.dir.display()
    );
    std::fs::write(root.path().join("replica.toml"), text).unwrap();
    replica.proc.signal(libc::SIGHUP);
    wait_for("the instance's removal", DEADLINE, || {
        replica
            .proc
            .log()
            .contains("instance removed")
            .then_some(())
    });
    let scrape = replica.proc.metrics();
    assert!(!scrape.contains(r#"kv_instance="new""#), "{scrape}");
    assert!(scrape.contains(r#"kv_instance="default""#));
    let err = replica
        .client()
        .await
        .list_snapshots(pb::ListSnapshotsRequest {
            instance: "new".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_session_limit_counts_per_instance_of_the_source() {
    let root = tempfile::tempdir().unwrap();
    let source = multi(
        root.path(),
        "source",
        &["a", "b"],
        "[sync]\nmax_sessions_per_replica = 1\n",
    );
    for (i, name) in ["a", "b"].iter().enumerate() {
        put_snapshot(
            &instance_dir(root.path(), "source", name),
            "s.kvr1",
            1 << 20,
            i as u64 + 1,
        );
        source.offered_in(name, i as u64 + 1).await;
    }
    let mut peer = peer(&source).await;
    let ask = |instance: &str| pb::OpenFullSyncRequest {
        replica_node_id: "replica-1".into(),
        instance: instance.into(),
        ..Default::default()
    };
    // One replica agent pulls both instances at once.
    let held: Vec<_> = ["a", "b"].iter().map(|i| ask(i)).collect();
    let mut offers = Vec::new();
    for a in held {
        offers.push(
            peer.open_full_sync(a)
                .await
                .expect("one session per instance")
                .into_inner(),
        );
    }
    let err = peer.open_full_sync(ask("a")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("replica-1@127.0.0.1/a"), "{err:?}");
}
