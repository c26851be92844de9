//! Peers are not trusted: names a source sends never become syntax in a KV
//! command, a record or a file path; a source cannot make a replica reserve
//! more than it allows; an exposed listener must authenticate its callers;
//! a replica only pulls from the sources it allows; idle, slow or malformed
//! connections cost a source no thread and cannot crowd out real syncs;
//! concurrent offers never pass the source's limits; one session token
//! fetches the snapshot once, however many streams it opens. Real agent
//! processes.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::node::*;
use common::*;
use kvsync::rpc::pb;

/// Every file in `dir` with its contents, except kvsync's own manifest.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(n, _)| n != kvsync::store::install::INSTALLED_LIST)
        .map(|(n, p)| (n, std::fs::read(p).unwrap()))
        .collect()
}

/// A KV admin port that records every line and answers each with `+OK`.
async fn kv_admin() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let kv = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = kv.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = kv.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let (r, mut w) = s.into_split();
                let mut lines = tokio::io::BufReader::new(r).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let _ = tx.send(line);
                    let _ = w.write_all(b"+OK\r\n").await;
                }
            });
        }
    });
    (addr, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_snapshot_names_reach_neither_the_kv_nor_other_files() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", "", &[]);
    let (kv, mut lines) = kv_admin().await;
    let replica = Node::start(
        root.path(),
        "replica",
        &format!(
            "[handoff]\nmode = \"command\"\ncommand_addr = \"{kv}\"\ncommand_template = \"REPLMETA {{seq}} {{path}} {{source}}\"\n"
        ),
        &[],
    );
    // Files of the KV's own that a source's name must not replace.
    std::fs::write(replica.dir.join("nodes.conf"), b"cluster state").unwrap();
    std::fs::write(replica.dir.join("x.kvr1"), b"the operator's").unwrap();

    let hostile = [
        "x.kvr1\r\nFLUSHALL\r\nSET owned 1\r\nREPLMETA 1 y.kvr1",
        "with space.kvr1",
        "tab\there.kvr1",
        "snap\u{2215}5.kvr1", // a look-alike of '/'
        "nodes.conf",
        "x.kvr1",
    ];
    for (i, name) in hostile.into_iter().enumerate() {
        let seq = 100 + i as u64;
        put_snapshot(&source.dir, name, 4096 + i as u64, seq);
        source.offered(seq).await;
        let before = files(&replica.dir);
        let p = sync_ok(&replica, &source).await;
        let installed = Path::new(&p.installed_path);
        assert_eq!(
            installed.file_name().unwrap().to_string_lossy(),
            format!("snapshot-{seq}.kvr1"),
            "{name:?}"
        );
        // Exactly one well-formed line reached the KV.
        let line = lines.recv().await.unwrap();
        assert_eq!(
            line,
            format!(
                "REPLMETA {seq} {} source@{}",
                p.installed_path,
                source.grpc()
            ),
            "{name:?}"
        );
        assert!(lines.try_recv().is_err(), "{name:?}: one line only");
        // The record has exactly its fields, with the installed snapshot's
        // values.
        let record = std::fs::read_to_string(format!("{}.replmeta", p.installed_path)).unwrap();
        let fields: Vec<(&str, &str)> =
            record.lines().map(|l| l.split_once(' ').unwrap()).collect();
        let keys: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "REPLMETA",
                "snapshot",
                "source",
                "format",
                "size",
                "checksum",
                "time_unix_ms"
            ],
            "{name:?}"
        );
        let info = kvsync::snapshot::verify_file(installed, None).unwrap();
        let seq_text = seq.to_string();
        let source_text = format!("source@{}", source.grpc());
        let size_text = info.size.to_string();
        let checksum_text = format!("{:#x}", info.checksum);
        let expected = [
            seq_text.as_str(),
            p.installed_path.as_str(),
            source_text.as_str(),
            "kvr1",
            size_text.as_str(),
            checksum_text.as_str(),
        ];
        for ((key, value), want) in fields.iter().zip(expected) {
            assert_eq!(*value, want, "{name:?}: {key}");
        }
        // Nothing but the snapshot and its record changed.
        let mut after = files(&replica.dir);
        let new = format!("snapshot-{seq}.kvr1");
        assert!(after.remove(&new).is_some());
        assert!(after.remove(&format!("{new}.replmeta")).is_some());
        assert_eq!(after, before, "{name:?}");
        std::fs::remove_file(source.dir.join(name)).unwrap();
    }
    assert_eq!(
        std::fs::read(replica.dir.join("nodes.conf")).unwrap(),
        b"cluster state"
    );
    assert_eq!(
        std::fs::read(replica.dir.join("x.kvr1")).unwrap(),
        b"the operator's"
    );
}

/// Whoever can write `snapshot_dir` plants a link to a valid snapshot
/// outside it, with a higher sequence: the watcher says so and never
/// offers it, and a sync still gets the real one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_in_snapshot_dir_is_never_offered() {
    let root = tempfile::tempdir().unwrap();
    let (source, bytes) = offering_source(root.path(), 2 << 20, 5, &[]).await;
    let outside = root.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let elsewhere = put_snapshot(&outside, "root-only.kvr1", 1 << 20, 9);
    std::os::unix::fs::symlink(outside.join("root-only.kvr1"), source.dir.join("evil.kvr1"))
        .unwrap();
    wait_for("the watcher to decide on the link", DEADLINE, || {
        source.proc.log().contains("evil.kvr1").then_some(())
    });
    let log = source.proc.log();
    let line = log.lines().find(|l| l.contains("evil.kvr1")).unwrap();
    assert!(
        line.contains("symbolic link") && line.contains("not offered"),
        "{line}"
    );
    let replica = Node::start(root.path(), "replica", "", &[]);
    let done = sync_ok(&replica, &source).await;
    assert_eq!(done.seq, 5, "{done:?}");
    assert_eq!(std::fs::read(replica.dir.join("s.kvr1")).unwrap(), bytes);
    assert_eq!(
        std::fs::read(outside.join("root-only.kvr1")).unwrap(),
        elsewhere
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_over_the_limit_is_refused_before_anything_is_reserved() {
    let root = tempfile::tempdir().unwrap();
    let (source, _) = offering_source(root.path(), 3 << 20, 7, &[]).await;
    let small = Node::start(
        root.path(),
        "small",
        "[sync]\nmax_snapshot_bytes = \"1MiB\"\n",
        &[],
    );
    let crowded = Node::start(
        root.path(),
        "crowded",
        "[sync]\nmin_free_after = \"1PiB\"\n",
        &[],
    );
    for (replica, setting) in [
        (&small, "sync.max_snapshot_bytes"),
        (&crowded, "sync.min_free_after"),
    ] {
        let id = start_sync(replica, &source).await;
        let p = wait_done(replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        assert!(p.error.contains(setting), "{}", p.error);
        assert!(
            std::fs::read_dir(&replica.dir).unwrap().next().is_none(),
            "nothing reserved or written"
        );
    }
    assert_eq!(
        source.metric("kvsync_fullsync_bytes_total{role=\"source\",transport=\"tcp\"}"),
        0.0
    );
    // The refused offers went back: the source holds no snapshot for them.
    source.wait_released();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_pulls_only_from_allowed_sources() {
    let root = tempfile::tempdir().unwrap();
    let (source, bytes) = offering_source(root.path(), 4096, 3, &[]).await;
    let strict = Node::start(
        root.path(),
        "strict",
        "[sync]\nallowed_sources = [\"127.0.0.1:1\"]\n",
        &[],
    );
    let err = strict
        .client()
        .await
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.grpc(),
            transport: pb::TransportPreference::Auto as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("sync.allowed_sources"), "{err:?}");

    // Listed by address, it is the source.
    let listed = Node::start(
        root.path(),
        "listed",
        &format!("[sync]\nallowed_sources = [\"{}\"]\n", source.grpc()),
        &[],
    );
    let p = sync_ok(&listed, &source).await;
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
}

#[test]
fn a_source_is_never_admitted_by_the_node_id_it_claims() {
    // A fake source on loopback can claim any node id (here, "source" is
    // just its config). Without [tls] nothing proves a name, so an agent
    // whose allowed_sources lists one does not start; before, it pulled
    // from whoever said that name.
    let err = refused_config("[sync]\nallowed_sources = [\"source\"]\n");
    assert!(
        err.contains("sync.allowed_sources") && err.contains("only a certificate proves one"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_token_goes_only_to_a_source_something_proves() {
    // A listener on loopback, as any local user can open: it records
    // whether anyone connected to it.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    fake.set_nonblocking(true).unwrap();
    let fake_addr = fake.local_addr().unwrap().to_string();
    let root = tempfile::tempdir().unwrap();
    let (orch, peer) = (root.path().join("orch"), root.path().join("peer"));
    std::fs::write(&orch, "orchestrator-token-0123456789\n").unwrap();
    std::fs::write(&peer, "fleet-peer-token-0123456789\n").unwrap();
    let mut replica = Node::start(
        root.path(),
        "replica",
        &format!(
            "[auth]\ntoken_file = \"{}\"\npeer_token_file = \"{}\"\n",
            orch.display(),
            peer.display()
        ),
        &[],
    );
    replica.token = Some("orchestrator-token-0123456789".into());
    let p = sync_from(&replica, &fake_addr).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(
        p.error.contains("refusing to present this agent's token") && p.error.contains(&fake_addr),
        "{}",
        p.error
    );
    // This agent's own policy refused: said as such, not as a source that
    // could not be reached, and not tried again (it would refuse again).
    assert!(!p.error.contains("unreachable"), "{}", p.error);
    assert_eq!(p.attempts, 1, "{p:?}");
    assert!(
        matches!(fake.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the replica connected to a source nothing proves"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_cannot_take_every_session_of_a_source() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(
        root.path(),
        "source",
        "[sync]\nmax_sessions_per_replica = 1\n",
        &[],
    );
    put_snapshot(&source.dir, "s.kvr1", 4096, 3);
    source.offered(3).await;
    let held = source.open_offer().await;
    let err = pb::peer_client::PeerClient::connect(format!("http://{}", source.grpc()))
        .await
        .unwrap()
        .open_full_sync(pb::OpenFullSyncRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("sync.max_sessions_per_replica"),
        "{err:?}"
    );
    // Giving the offer back frees the slot.
    pb::peer_client::PeerClient::connect(format!("http://{}", source.grpc()))
        .await
        .unwrap()
        .report_result(pb::ReportResultRequest {
            session_id: held.session_id,
            ok: false,
            error: "not needed".into(),
            handoff_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    source.open_offer().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_offers_never_exceed_max_outgoing_syncs() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(
        root.path(),
        "source",
        "[sync]\nmax_outgoing_syncs = 4\nsession_token_ttl = \"5m\"\n",
        &[],
    );
    put_snapshot(&source.dir, "s.kvr1", 4096, 3);
    source.offered(3).await;
    // 32 replicas ask at once, each on its own connection.
    let asks = (0..32).map(|i| {
        let addr = format!("http://{}", source.grpc());
        async move {
            pb::peer_client::PeerClient::connect(addr)
                .await
                .unwrap()
                .open_full_sync(pb::OpenFullSyncRequest {
                    format: "kvr1".into(),
                    replica_node_id: format!("replica-{i}"),
                    ..Default::default()
                })
                .await
        }
    });
    let answers = futures::future::join_all(asks).await;
    let admitted = answers.iter().filter(|a| a.is_ok()).count();
    assert_eq!(admitted, 4, "{answers:?}");
    for refused in answers.iter().filter_map(|a| a.as_ref().err()) {
        assert_eq!(
            refused.code(),
            tonic::Code::ResourceExhausted,
            "{refused:?}"
        );
        assert!(
            refused.message().contains("sync.max_outgoing_syncs")
                && refused.message().contains("retry"),
            "{refused:?}"
        );
    }
    // The source's own count of what it admitted.
    let status = source
        .client()
        .await
        .get_status(pb::GetStatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.admitted_sessions, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orchestrator_and_peer_tokens_are_separate() {
    use kvsync::rpc::auth::ClientAuth;
    use tonic::service::interceptor::InterceptedService;
    let root = tempfile::tempdir().unwrap();
    let (orch, peer) = (
        "orchestrator-token-0123456789",
        "peer-token-0123456789abcdef",
    );
    let (orch_file, peer_file) = (root.path().join("orch"), root.path().join("peer"));
    std::fs::write(&orch_file, orch).unwrap();
    std::fs::write(&peer_file, peer).unwrap();
    let agent = Node::start(
        root.path(),
        "agent",
        &format!(
            "[auth]\ntoken_file = \"{}\"\npeer_token_file = \"{}\"\n",
            orch_file.display(),
            peer_file.display()
        ),
        &[],
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", agent.grpc()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let with = |t: &str| InterceptedService::new(channel.clone(), ClientAuth::new(Some(t.into())));
    let orchestrator = |t| pb::orchestrator_client::OrchestratorClient::new(with(t));
    let peer_client = |t| pb::peer_client::PeerClient::new(with(t));

    orchestrator(orch)
        .get_status(pb::GetStatusRequest::default())
        .await
        .unwrap();
    let denied = orchestrator(peer)
        .start_full_sync(pb::StartFullSyncRequest {
            source: "127.0.0.1:1".into(),
            transport: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    // A peer token passes the Peer service's check (no snapshot yet).
    let none = peer_client(peer)
        .open_full_sync(pb::OpenFullSyncRequest::default())
        .await
        .unwrap_err();
    assert_eq!(none.code(), tonic::Code::NotFound, "{none:?}");
    let denied = peer_client(orch)
        .open_full_sync(pb::OpenFullSyncRequest::default())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    assert_eq!(agent.metric("kvsync_grpc_auth_failures_total"), 2.0);
}

/// The error of an agent started with `config` after its snapshot_dir,
/// which must refuse to start.
fn refused_config(config: &str) -> String {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("agent.toml");
    let dir = root.path().join("snap");
    std::fs::write(
        &file,
        format!(
            "create_dirs = true\nsnapshot_dir = \"{}\"\n{config}",
            dir.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(kvsync_bin())
        .args(["agent", "--config", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn an_exposed_listener_without_authentication_does_not_start() {
    let err = refused_config("[grpc]\nlisten = \"0.0.0.0:0\"\nplaintext = true\n");
    assert!(
        err.contains("grpc.listen") && err.contains("token_file") && err.contains("client_auth"),
        "{err}"
    );
}

/// The data-plane floor of these tests: 1 MiB/s over 2 s.
const FLOOR: &str = "[data]\nmin_rate = \"1MiB\"\nmin_rate_window = \"2s\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_stops_sending_loses_the_session_within_the_window() {
    let root = tempfile::tempdir().unwrap();
    let source = stalling_source(root.path(), 40).await;
    let replica = Node::start(root.path(), "replica", FLOOR, &[]);
    let started = std::time::Instant::now();
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(p.error.contains("data.min_rate"), "{}", p.error);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "within the window, not the size-scaled timeout"
    );
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    source.wait_released();
}

/// A replica's sink that asks for every piece, takes whatever it is sent
/// without a check and counts it; with `stall`, it stops taking bytes
/// until that is released or dropped (a replica that stops reading).
struct Taker {
    file: std::fs::File,
    want: kvsync::transport::Want,
    /// A stream of a session with a piece queue: what it takes, once.
    queue: Option<Vec<(u32, u32)>>,
    bytes: u64,
    stall: Option<std::sync::mpsc::Receiver<()>>,
}

impl kvsync::transport::Sink for Taker {
    fn want(&self) -> kvsync::transport::Want {
        self.want.clone()
    }
    fn prepare(&mut self, _len: u64) -> Result<(), kvsync::transport::SinkError> {
        Ok(())
    }
    fn file(&self) -> &std::fs::File {
        &self.file
    }
    fn piece_bytes(&mut self, _index: u32, bytes: &[u8], _in_file: bool) {
        if let Some(stall) = &self.stall {
            let _ = stall.recv();
        }
        self.bytes += bytes.len() as u64;
    }
    fn piece_done(&mut self, _index: u32) -> Result<(), kvsync::transport::SinkError> {
        Ok(())
    }
    fn more_pieces(
        &mut self,
        _wait: bool,
    ) -> Result<Vec<(u32, u32)>, kvsync::transport::SinkError> {
        Ok(self.queue.take().unwrap_or_default())
    }
    fn verify(&mut self) -> Result<(), kvsync::transport::SinkError> {
        Ok(())
    }
}

/// On a thread: one raw TCP stream of `offer`'s session asking for every
/// piece into a [`Taker`] (in its first NEED, or as what it takes from the
/// queue of a session on several streams); why it failed (`None`: it
/// completed) and the bytes it got.
fn take_all(
    offer: &pb::SyncOffer,
    stall: Option<std::sync::mpsc::Receiver<()>>,
) -> std::thread::JoinHandle<(Option<String>, u64)> {
    let token: [u8; 32] = offer.session_token.as_slice().try_into().unwrap();
    let (endpoint, size, piece_size, queued) = (
        offer.data_endpoint.clone(),
        offer.snapshot_size,
        offer.piece_size,
        offer.piece_queue,
    );
    std::thread::spawn(move || {
        let all = vec![(0, size.div_ceil(piece_size) as u32)];
        let mut sink = Taker {
            file: tempfile::tempfile().unwrap(),
            want: kvsync::transport::Want {
                piece_size,
                need: if queued { Vec::new() } else { all.clone() },
                retries: 0,
                refill: queued.then_some(1),
            },
            queue: queued.then_some(all),
            bytes: 0,
            stall,
        };
        let mut link = kvsync::transport::tcp::Link::new(
            std::net::TcpStream::connect(endpoint).unwrap(),
            Default::default(),
        )
        .unwrap();
        let end = kvsync::transport::tcp::run_replica(&mut link, token, size, &mut sink);
        let failed = match end {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        (failed, sink.bytes)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_reading_loses_the_session_within_the_window() {
    let root = tempfile::tempdir().unwrap();
    // A 1 s window: the floor (at most two windows) ends the session well
    // before the 5 s peer_timeout of test agents would.
    let floor = "[data]\nmin_rate = \"1MiB\"\nmin_rate_window = \"1s\"\n";
    let source = Node::start(root.path(), "source", floor, &[]);
    put_snapshot(&source.dir, "s.kvr1", 64 << 20, 5);
    source.offered(5).await;
    let offer = source.open_offer().await;
    let (release, stuck) = std::sync::mpsc::channel();
    let reader = take_all(&offer, Some(stuck));
    let started = std::time::Instant::now();
    wait_for("the source to end the session", DEADLINE, || {
        (source.metric(r#"kvsync_fullsync_total{result="failed",role="source",transport="tcp"}"#)
            == 1.0)
            .then_some(())
    });
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    assert!(
        source.proc.log().contains("data.min_rate"),
        "{}",
        source.proc.log()
    );
    source.wait_released();
    drop(release);
    let (failed, _) = reader.join().unwrap();
    assert!(failed.is_some(), "the stuck replica never completes");
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A TCP connection to `addr` from the loopback address `from`.
fn connect_from(from: &str, addr: &str) -> std::net::TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(
        &format!("{from}:0")
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    s.connect(&addr.parse::<std::net::SocketAddr>().unwrap().into())
        .unwrap();
    s.into()
}

/// gRPC connections the agent closed, for every reason.
fn grpc_closed(node: &Node) -> f64 {
    ["total", "per_peer", "evicted", "handshake_timeout"]
        .iter()
        .map(|r| {
            node.metric(&format!(
                "kvsync_grpc_connections_refused_total{{reason=\"{r}\"}}"
            ))
        })
        .sum()
}

/// Waits until the peer closes `s` (read returns 0 or an error).
fn closed_by_peer(s: &mut std::net::TcpStream) {
    use std::io::Read;
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return,
            Ok(_) => {} // a refusal frame, then the close
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_malformed_connections_get_no_thread_and_cannot_stop_a_real_sync() {
    let root = tempfile::tempdir().unwrap();
    // TCP and the emulated fabric: both listeners of one source.
    let source = Node::start_with(
        root.path(),
        "source",
        "mode = \"auto\"\nrdma_provider = \"emulated\"",
        "[data]\nhello_timeout = \"1s\"\nmax_pending_per_peer = 8\n",
        &[],
    );
    let bytes = put_snapshot(&source.dir, "s.kvr1", 8 << 20, 3);
    source.offered(3).await;
    let pid = source.proc.child.id();
    let baseline = open_fds(pid);
    let data = source.data();
    let fabric = source.proc.addr("rdma");
    let fabric = fabric
        .strip_prefix("emulated:")
        .expect("an emulated listener")
        .to_string();
    let refused = |reason: &str| {
        source.metric(&format!(
            "kvsync_data_connections_refused_total{{reason=\"{reason}\"}}"
        ))
    };

    // 800 idle connections from another address, held open: 8 at a time
    // may wait for their proof (the per-address cap), the rest are closed
    // at once. Without the cap every one would wait out hello_timeout.
    let flood: Vec<_> = (0..800).map(|_| connect_from("127.0.0.2", &data)).collect();
    wait_for("the flood to be sorted", DEADLINE, || {
        (refused("pending_per_peer") + refused("hello_timeout") == 800.0).then_some(())
    });
    assert!(refused("hello_timeout") <= 80.0, "most were closed at once");
    // And 200 idle gRPC connections: 64 from one address are open at once
    // (the default grpc.max_connections_per_peer), each newcomer closing
    // the oldest, and none outlives grpc.handshake_timeout.
    let grpc_flood: Vec<_> = (0..200)
        .map(|_| connect_from("127.0.0.2", &source.grpc()))
        .collect();
    wait_for("the gRPC flood to be sorted", DEADLINE, || {
        (grpc_closed(&source) + source.metric("kvsync_grpc_connections_unproved") == 200.0)
            .then_some(())
    });
    assert!(source.metric("kvsync_grpc_connections_unproved") <= 64.0);
    // A real sync during the flood: an exact copy.
    let replica = Node::start(root.path(), "replica", "", &[]);
    sync_ok(&replica, &source).await;
    assert_eq!(std::fs::read(replica.dir.join("s.kvr1")).unwrap(), bytes);
    // The source holds none of the data connections and only the capped
    // gRPC ones, though every one is still open here.
    wait_for("the source to close the flood", DEADLINE, || {
        (open_fds(pid) <= baseline + 64 + 8).then_some(())
    });
    assert_eq!(refused("pending_total"), 0.0);
    drop((flood, grpc_flood));

    // On each listener: a proof sent a byte at a time is cut at
    // hello_timeout (one deadline for the whole proof, not per read) ...
    let tcp_hello = kvsync::blk3::Token::Sess { token: [7; 32] }.encode_frame();
    let mut connect_request = vec![1u8]; // CONNECT, no work request, 32 bytes
    connect_request.extend_from_slice(&[0; 20]);
    connect_request.extend_from_slice(&32u32.to_be_bytes());
    connect_request.extend_from_slice(&[7; 32]);
    for (addr, hello) in [(&data, tcp_hello), (&fabric, connect_request)] {
        let before = refused("hello_timeout");
        let mut slow = connect_from("127.0.0.3", addr);
        let mut drip = slow.try_clone().unwrap();
        let dripping = std::thread::spawn(move || {
            use std::io::Write;
            for byte in hello {
                if drip.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        closed_by_peer(&mut slow);
        dripping.join().unwrap();
        wait_for("the slow proof to be counted", DEADLINE, || {
            (refused("hello_timeout") == before + 1.0).then_some(())
        });
    }
    // ... and a message that is no proof, or announces 1 GiB, is refused
    // at once.
    let no_token = b"\0\0\0\x08GARBAGE!".to_vec();
    let huge = (1u32 << 30).to_be_bytes().to_vec();
    let mut huge_request = vec![1u8];
    huge_request.extend_from_slice(&[0; 20]);
    huge_request.extend_from_slice(&(1u32 << 30).to_be_bytes());
    for (addr, first) in [
        (&data, no_token),
        (&data, huge),
        (&fabric, b"GARBAGE!".repeat(4)),
        (&fabric, huge_request),
    ] {
        use std::io::Write;
        let before = refused("bad_hello");
        let mut s = connect_from("127.0.0.4", addr);
        s.write_all(&first).unwrap();
        closed_by_peer(&mut s);
        wait_for("the refusal to be counted", DEADLINE, || {
            (refused("bad_hello") == before + 1.0).then_some(())
        });
    }
    // Nothing was served to any of them.
    assert_eq!(
        source.metric(r#"kvsync_fullsync_total{result="ok",role="source",transport="tcp"}"#),
        1.0
    );
    assert_eq!(
        source.metric(r#"kvsync_fullsync_total{result="ok",role="source",transport="rdma"}"#),
        0.0
    );
}

/// A source that lies about everything it can: a well-formed offer of a
/// snapshot as large as the replica takes, then a manifest that never
/// ends, 1 MiB a part, as fast as the replica reads.
struct FloodingSource;

#[tonic::async_trait]
impl pb::peer_server::Peer for FloodingSource {
    async fn open_full_sync(
        &self,
        _: tonic::Request<pb::OpenFullSyncRequest>,
    ) -> Result<tonic::Response<pb::SyncOffer>, tonic::Status> {
        Ok(tonic::Response::new(pb::SyncOffer {
            session_id: "flood".into(),
            session_token: vec![7; 32],
            format: "kvr1".into(),
            snapshot_size: 1 << 30,
            seq: 1,
            checksum: 1,
            transport: pb::Transport::Tcp as i32,
            data_endpoint: "127.0.0.1:9".into(),
            source_node_id: "flood".into(),
            piece_size: 1 << 20,
            manifest_digest: vec![0; 32],
            tcp_streams: 1,
            ..Default::default()
        }))
    }

    async fn report_result(
        &self,
        _: tonic::Request<pb::ReportResultRequest>,
    ) -> Result<tonic::Response<pb::ReportResultResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::ReportResultResponse {}))
    }

    async fn open_stream(
        &self,
        _: tonic::Request<pb::OpenStreamRequest>,
    ) -> Result<tonic::Response<pb::StreamOffer>, tonic::Status> {
        Err(tonic::Status::unimplemented("this source serves no stream"))
    }

    async fn get_stream_source(
        &self,
        _: tonic::Request<pb::StreamSourceRequest>,
    ) -> Result<tonic::Response<pb::StreamSourceResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("this source keeps no stream"))
    }

    type GetManifestStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<pb::ManifestPart, tonic::Status>> + Send>,
    >;

    async fn get_manifest(
        &self,
        _: tonic::Request<pb::GetManifestRequest>,
    ) -> Result<tonic::Response<Self::GetManifestStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(
            futures::stream::repeat_with(|| {
                Ok(pb::ManifestPart {
                    data: vec![0xab; 1 << 20],
                })
            }),
        )))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_that_never_ends_is_cut_off_at_what_the_offer_can_weigh() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::peer_server::PeerServer::new(FloodingSource))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let root = tempfile::tempdir().unwrap();
    let replica = Node::start(
        root.path(),
        "replica",
        "[sync]\nmax_snapshot_bytes = \"1GiB\"\nmin_free_after = \"0B\"\n",
        &[],
    );
    let before = peak_rss(replica.proc.child.id());
    let p = sync_from(&replica, &fake).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(
        p.error.contains("piece manifest: more than the"),
        "{}",
        p.error
    );
    // A 1 GiB snapshot in 1 MiB pieces has a 32 KiB manifest: the replica
    // stops at the first part that passes it.
    let grew = peak_rss(replica.proc.child.id()).saturating_sub(before);
    assert!(grew < 32 << 20, "peak RSS grew by {grew} bytes");
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
}

/// Unauthenticated gRPC connections held open: 200 from the replica's own
/// address and 64 from each of 17 others (enough to fill every slot
/// before). A real sync still gets in, on its first attempt: a
/// connection that has not made an authenticated request within
/// `grpc.handshake_timeout` is closed, and the oldest such one makes room
/// for a newcomer at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_grpc_connections_cannot_lock_out_a_real_replica() {
    let root = tempfile::tempdir().unwrap();
    let (source, bytes) = offering_source(root.path(), 4 << 20, 3, &[]).await;
    let grpc = source.grpc();
    let mut held: Vec<_> = (0..200).map(|_| connect_from("127.0.0.1", &grpc)).collect();
    for a in 1..=17 {
        held.extend((0..64).map(|_| connect_from(&format!("127.0.1.{a}"), &grpc)));
    }
    // Every connection reached the agent (accepted or refused).
    wait_for("the flood to be accepted", DEADLINE, || {
        (grpc_closed(&source) + source.metric("kvsync_grpc_connections_unproved") >= 1288.0)
            .then_some(())
    });
    let replica = Node::start(root.path(), "replica", "", &[]);
    let done = sync_ok(&replica, &source).await;
    assert_eq!(done.attempts, 1, "{done:?}");
    assert_eq!(std::fs::read(replica.dir.join("s.kvr1")).unwrap(), bytes);
    drop(held);
}

/// Eight addresses reconnect to the data port the moment the source
/// drops them, keeping every pending slot full. A replica the source
/// offered a session is expected: its connections have slots of their
/// own, and its sync is an exact copy on the first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churning_data_connections_cannot_delay_an_expected_replica() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(
        root.path(),
        "source",
        "[data]\nmax_pending_connections = 64\nmax_pending_per_peer = 8\n",
        &[],
    );
    let bytes = put_snapshot(&source.dir, "s.kvr1", 4 << 20, 3);
    source.offered(3).await;
    let data = source.data();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churners: Vec<_> = (1..=8)
        .flat_map(|a| (0..8).map(move |_| a))
        .map(|a| {
            let (stop, data) = (stop.clone(), data.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut s = connect_from(&format!("127.0.2.{a}"), &data);
                    closed_by_peer(&mut s);
                }
            })
        })
        .collect();
    wait_for("the pending slots to be full", DEADLINE, || {
        let over = r#"kvsync_data_connections_refused_total{reason="pending_total"}"#;
        let per_peer = r#"kvsync_data_connections_refused_total{reason="pending_per_peer"}"#;
        (source.metric(over) + source.metric(per_peer) > 0.0).then_some(())
    });
    let replica = Node::start(root.path(), "replica", "", &[]);
    let done = sync_ok(&replica, &source).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(done.attempts, 1, "{done:?}");
    assert_eq!(std::fs::read(replica.dir.join("s.kvr1")).unwrap(), bytes);
    for c in churners {
        c.join().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_fetches_the_snapshot_once_however_many_streams_it_opens() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(
        root.path(),
        "source",
        "[data]\ntcp_streams = 4\npiece_size = \"1MiB\"\n",
        &[],
    );
    let size = 8u64 << 20;
    put_snapshot(&source.dir, "s.kvr1", size, 3);
    source.offered(3).await;
    let offer = pb::peer_client::PeerClient::connect(format!("http://{}", source.grpc()))
        .await
        .unwrap()
        .open_full_sync(pb::OpenFullSyncRequest {
            tcp_streams: 4,
            piece_queue: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(offer.tcp_streams, 4);
    assert!(offer.piece_queue);
    // Every stream asks for every piece, instead of what it took from the
    // queue.
    let streams: Vec<_> = (0..4).map(|_| take_all(&offer, None)).collect();
    let ends: Vec<_> = streams.into_iter().map(|s| s.join().unwrap()).collect();
    let total: u64 = ends.iter().map(|(_, bytes)| bytes).sum();
    assert!(
        total <= size,
        "one token fetched {total} bytes of a {size}-byte snapshot: {ends:?}"
    );
    // One stream fetches the snapshot; each other one is refused: for a
    // piece another stream holds, or (when it connects late, on a loaded
    // machine) because the session's other streams have all ended.
    let fetched = ends.iter().filter(|(failed, _)| failed.is_none()).count();
    assert_eq!(fetched, 1, "{ends:?}");
    let refused = ends
        .iter()
        .filter(|(failed, bytes)| {
            *bytes == 0
                && failed.as_ref().is_some_and(|why| {
                    why.contains("another stream") || why.contains("other streams have all ended")
                })
        })
        .count();
    assert_eq!(refused, 3, "{ends:?}");
    source.wait_released();
}
