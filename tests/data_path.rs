//! The failure table: every data-path failure, run against every transport
//! the host can run (TCP in plain text, TCP under TLS, and the emulated RDMA
//! fabric — an emulation of RC queue pairs over TCP; real verbs run in the
//! soft-RoCE VM), through the same code the agents use: the source's serve
//! loop with its session table and cache, the replica's `DataLink` and
//! `Receiver`. Each case expects the same outcome from every transport: the
//! same job error, the same source-side result, and no temp file left
//! behind, except what a failed session keeps for the next one to resume
//! (which each case then resumes).
//!
//! Its faults are injected in this process (`faults::install`): it needs
//! the `faults` feature, as the whole suite does.
#![cfg(feature = "faults")]

mod common;

use kvsync::store::served::{Served, SnapshotFile};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsync::blk3::BulkParams;
use kvsync::config::RdmaProvider;
use kvsync::metrics::Metrics;
use kvsync::snapshot::kvr1::GenSpec;
use kvsync::snapshot::Format;
use kvsync::store::cache::SnapshotCache;
use kvsync::store::catalog::CatalogEntry;
use kvsync::sync::job::JobError;
use kvsync::sync::receive::{Received, Receiver};
use kvsync::sync::serve::{self, DataPlane, Limits, OfferedSession, SessionTable};
use kvsync::sys::ratelimit::RateLimiter;
use kvsync::transport::pace::MinRate;
use kvsync::transport::session::{ClientTls, DataLink, DialSpec};
use kvsync::transport::{faults, ktls, Faults, TransportKind};
use tokio_util::sync::CancellationToken;

const SIZE: u64 = 3 << 20;
const DEADLINE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Case {
    Clean,
    /// One byte flipped on the wire, once: its piece is fetched again.
    CorruptByte,
    /// One byte flipped, and the replica allows no piece a second try.
    CorruptNoRetry,
    /// The source drops the connection after 1.5 MiB.
    Cut,
    /// The replica presents a token the source never offered.
    BadToken,
    /// The replica's disk cannot take the file (RLIMIT_FSIZE → EFBIG).
    NoRoom,
    /// The source's certificate is not from the replica's CA (TLS only).
    UntrustedSource,
}

/// How the bytes travel.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Wire {
    Tcp,
    Tls,
    Emulated,
}

impl Wire {
    fn kind(self) -> TransportKind {
        match self {
            Wire::Tcp | Wire::Tls => TransportKind::Tcp,
            Wire::Emulated => TransportKind::Rdma,
        }
    }
}

/// The data plane's TLS settings, from a CA made for the test: the source
/// is `localhost`.
struct Tls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    /// A client that trusts another CA.
    rogue: Arc<rustls::ClientConfig>,
}

impl Tls {
    fn new(dir: &Path) -> Tls {
        let pki = common::pki::Pki::new(dir, "fleet");
        let (cert, key) = pki.issue("source", &["localhost"]);
        let cfg = kvsync::config::TlsConfig {
            cert_file: Some(cert),
            key_file: Some(key),
            ca_file: Some(pki.ca_file()),
            ..Default::default()
        };
        let rogue = kvsync::config::TlsConfig {
            ca_file: Some(common::pki::Pki::new(dir, "rogue").ca_file()),
            ..Default::default()
        };
        Tls {
            server: kvsync::rpc::tls::data_server(&cfg).unwrap().unwrap(),
            client: kvsync::rpc::tls::data_client(&cfg).unwrap().unwrap(),
            rogue: kvsync::rpc::tls::data_client(&rogue).unwrap().unwrap(),
        }
    }
}

/// The source-side faults that make `case` happen on `kind`.
fn faults_of(case: Case, kind: TransportKind) -> Faults {
    let mut f = Faults::default();
    let (corrupt, cut) = (Some((2 << 20) + 5), Some(3 << 19));
    match (case, kind) {
        (Case::CorruptByte | Case::CorruptNoRetry, TransportKind::Tcp) => f.corrupt_at = corrupt,
        (Case::CorruptByte | Case::CorruptNoRetry, TransportKind::Rdma) => {
            f.emu.corrupt_at = corrupt
        }
        (Case::Cut, TransportKind::Tcp) => f.cut_after = cut,
        (Case::Cut, TransportKind::Rdma) => f.emu.cut_after = cut,
        _ => {}
    }
    f
}

/// Forwards one connection to `to`, recording what the source sends: what
/// an observer on the path sees.
async fn recording_proxy(to: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Mutex<Vec<u8>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        let (replica, _) = listener.accept().await.unwrap();
        let source = tokio::net::TcpStream::connect(to).await.unwrap();
        let (mut from_replica, mut to_replica) = replica.into_split();
        let (mut from_source, mut to_source) = source.into_split();
        let up = async {
            let _ = tokio::io::copy(&mut from_replica, &mut to_source).await;
            let _ = to_source.shutdown().await;
        };
        let down = async {
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n @ 1..) = from_source.read(&mut buf).await {
                record.lock().unwrap().extend_from_slice(&buf[..n]);
                if to_replica.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = to_replica.shutdown().await;
        };
        tokio::join!(up, down);
    });
    (addr, seen)
}

/// What one run of a case produced.
struct Run {
    verdict: Result<Received, JobError>,
    /// The source's `kvsync_fullsync_total` result label (None: refused).
    source_result: Option<&'static str>,
    source_bytes: u64,
    auth_failures: u64,
    refetched: u32,
    resumed_bytes: u64,
    temp_files: Vec<PathBuf>,
    /// What the source sent over TCP, as seen on the path.
    wire: Vec<u8>,
}

fn temp_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with(kvsync::store::install::TEMP_PREFIX)
        })
        .collect()
}

/// Limits the size of files this process may write (None: unlimited).
fn limit_file_size(bytes: Option<u64>) {
    let lim = libc::rlimit {
        rlim_cur: bytes.unwrap_or(libc::RLIM_INFINITY),
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscalls; SIGXFSZ ignored so an oversized write fails
    // with EFBIG instead of killing the test.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
}

/// Runs `case` over `wire` in `dir` (a source and a replica directory; a
/// second run in the same directory finds what the first one kept).
async fn run(case: Case, wire: Wire, dir: &Path, tls: &Tls) -> Run {
    let kind = wire.kind();
    let (src_dir, dst_dir) = (dir.join("source"), dir.join("replica"));
    std::fs::create_dir_all(&src_dir).unwrap();
    std::fs::create_dir_all(&dst_dir).unwrap();
    let path = src_dir.join("s.kvr1");
    GenSpec {
        size: SIZE,
        seq: 9,
        created_ms: 1,
        seed: 9,
    }
    .write_file(&path)
    .unwrap();
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let entry = Arc::new(CatalogEntry::scan(&path, Format::Kvr1, 1 << 20, mtime).unwrap());

    // The source: cache, session table with one offer, the serve loop.
    let metrics = Metrics::new();
    let cache = SnapshotCache::new(1 << 30, DEADLINE, metrics.clone());
    let sessions = Arc::new(SessionTable::new(Limits {
        total: 4,
        per_replica: 4,
    }));
    let offer = OfferedSession {
        id: "s1".into(),
        instance: "default".into(),
        replica: "r".into(),
        replica_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
        entry: entry.clone(),
        // As a source holds them: TCP sends the file, RDMA the cache image.
        snapshot: if kind == TransportKind::Tcp {
            Served::File(SnapshotFile::open(&entry).unwrap())
        } else {
            Served::Image(cache.acquire("default", &entry).await.unwrap())
        },
        transport: kind,
        tls: wire == Wire::Tls,
        expires: Instant::now() + DEADLINE,
        origin: None,
        backlog: None,
        streams: 1,
    };
    let admitted = sessions.admit("replica@127.0.0.1").unwrap();
    let mut token = sessions.insert(offer, admitted);
    if case == Case::BadToken {
        token[0] ^= 0xff;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    faults::install(faults_of(case, kind));
    let plane = DataPlane {
        sessions: sessions.clone(),
        metrics: metrics.clone(),
        bulk: BulkParams::new(1, 8, 2),
        shutdown: shutdown.clone(),
        rate: Arc::new(RateLimiter::new(0)),
        peer_timeout: Duration::from_secs(10),
        min_rate: MinRate::default(),
        hello_timeout: DEADLINE,
        pending: kvsync::rpc::conn_limit::Limits {
            total: 64,
            per_peer: 8,
        },
        // Plain connections are told from TLS ones by their first byte.
        tls: Some(tls.server.clone()),
        kernel_tls: true,
        streams: Arc::default(),
    };
    let conns = serve::tcp_connections(listener, kind == TransportKind::Rdma);
    tokio::spawn(serve::serve(conns, plane));

    // The replica: dial (over TCP through a recording proxy), run into a
    // Receiver, decide.
    let (endpoint, wire_bytes) = match wire {
        Wire::Emulated => (endpoint, Arc::default()),
        Wire::Tcp | Wire::Tls => recording_proxy(endpoint).await,
    };
    let client = match case {
        Case::UntrustedSource => &tls.rogue,
        _ => &tls.client,
    };
    let spec = DialSpec {
        endpoint,
        rdma: (kind == TransportKind::Rdma).then_some(RdmaProvider::Emulated),
        peer_timeout: Duration::from_secs(10),
        min_rate: MinRate::default(),
        local: None,
        soft: false,
        tls: (wire == Wire::Tls).then(|| ClientTls {
            config: client.clone(),
            name: "localhost".to_string(),
            kernel: ktls::use_kernel(true, SIZE),
        }),
    };
    if case == Case::NoRoom {
        limit_file_size(Some(1 << 20));
    }
    let retries = if case == Case::CorruptNoRetry { 0 } else { 3 };
    let manifest = entry.manifest.clone();
    let (verdict, refetched, resumed_bytes) = tokio::task::spawn_blocking(move || {
        let mut receiver = Receiver::open(&dst_dir, "t", "source", manifest, retries, |_| {})?;
        let link = DataLink::dial(&spec).map_err(|source| JobError::DataConnect {
            endpoint: spec.endpoint,
            source,
        })?;
        let (result, _) = link.run(token, SIZE, &mut receiver);
        let (refetched, resumed) = (receiver.refetched(), receiver.resumed_bytes());
        Ok::<_, JobError>((receiver.finish(result), refetched, resumed))
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| (Err(e), 0, 0));
    let dst_dir = dir.join("replica");
    limit_file_size(None);

    // The source's verdict, once its session has ended (a refused
    // connection never becomes a session).
    let labels = ["ok", "failed", "checksum_mismatch", "cancelled"];
    let total = |l: &str| {
        metrics
            .fullsync_total
            .with_label_values(&["default", "source", kind.as_str(), l])
            .get()
    };
    let auth_failures = || metrics.data_auth_failures.get();
    let started = Instant::now();
    let source_result = loop {
        if let Some(l) = labels.iter().find(|l| total(l) > 0) {
            break Some(*l);
        }
        if matches!(case, Case::BadToken | Case::UntrustedSource) && auth_failures() > 0 {
            break None;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{case:?} over {wire:?}: the source never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    shutdown.cancel();
    let captured = wire_bytes.lock().unwrap().clone();
    Run {
        source_bytes: metrics
            .fullsync_bytes
            .with_label_values(&["default", "source", kind.as_str()])
            .get(),
        temp_files: temp_files(&dst_dir),
        auth_failures: auth_failures(),
        refetched,
        resumed_bytes,
        verdict,
        source_result,
        wire: captured,
    }
}

/// Checks that `r` delivered an exact copy of `original`.
fn check_copy(what: &str, r: Run, original: &[u8]) {
    let received = r.verdict.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(received.info.seq, 9, "{what}");
    let installed = received.staging.install("got.kvr1").unwrap();
    assert!(
        std::fs::read(installed).unwrap() == original,
        "{what}: exact copy"
    );
    assert_eq!(r.source_result, Some("ok"), "{what}");
}

/// Checks `run` against what `case` must produce on any transport; a case
/// that kept verified pieces is resumed in `dir` and must move only the rest.
async fn check(case: Case, wire: Wire, r: Run, dir: &Path, tls: &Tls) {
    let original = std::fs::read(dir.join("source/s.kvr1")).unwrap_or_default();
    let what = format!("{case:?} over {wire:?}");
    let kept = matches!(case, Case::Cut | Case::CorruptNoRetry);
    let names: Vec<String> = r
        .temp_files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    if kept {
        // The partial file and its journal, for the next session.
        assert_eq!(
            names.len(),
            2,
            "{what}: {names:?} {:?}",
            r.verdict.as_ref().err()
        );
        assert!(
            names.iter().any(|n| n.ends_with(".journal")),
            "{what}: {names:?}"
        );
    } else {
        // A successful session's staging file waits for its install.
        let ok = matches!(case, Case::Clean | Case::CorruptByte);
        assert!(r.temp_files.is_empty() || ok, "{what}: {names:?}");
    }
    let err = r
        .verdict
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default();
    match case {
        Case::Clean => {
            assert_eq!(r.source_bytes, SIZE, "{what}");
            assert_eq!(r.refetched, 0, "{what}");
            // Snapshot bytes are readable on the path in plain TCP, never
            // under TLS.
            let sample = &original[(2 << 20)..(2 << 20) + 64];
            let seen = r.wire.windows(sample.len()).any(|w| w == sample);
            match wire {
                Wire::Tcp => assert!(seen, "{what}: the capture sees the stream"),
                Wire::Tls => assert!(!seen && r.wire.len() as u64 > SIZE, "{what}: encrypted"),
                Wire::Emulated => {}
            }
            check_copy(&what, r, &original);
        }
        Case::CorruptByte => {
            // Only the damaged piece (the third MiB) moves again.
            assert_eq!(r.refetched, 1, "{what}");
            assert_eq!(r.source_bytes, SIZE + (1 << 20), "{what}");
            check_copy(&what, r, &original);
        }
        Case::CorruptNoRetry => {
            assert!(
                matches!(r.verdict, Err(JobError::Checksum(_))) && err.contains("piece 2"),
                "{what}: {err}"
            );
            assert_eq!(r.source_result, Some("checksum_mismatch"), "{what}");
        }
        Case::Cut => {
            assert!(
                matches!(r.verdict, Err(JobError::Transport(_))),
                "{what}: {err}"
            );
            assert_eq!(r.source_result, Some("failed"), "{what}");
        }
        Case::BadToken => {
            assert!(
                err.contains("unknown, used or expired session token"),
                "{what}: {err}"
            );
            assert_eq!(r.source_result, None, "{what}: no session was served");
            assert_eq!(r.auth_failures, 1, "{what}");
            assert_eq!(r.source_bytes, 0, "{what}");
        }
        Case::UntrustedSource => {
            assert!(
                matches!(r.verdict, Err(JobError::DataConnect { .. }))
                    && err.contains("TLS with the source's data endpoint")
                    && err.contains("UnknownIssuer"),
                "{what}: {err}"
            );
            assert_eq!(r.source_result, None, "{what}: no session was served");
            assert_eq!(r.source_bytes, 0, "{what}");
        }
        Case::NoRoom => {
            assert!(
                matches!(r.verdict, Err(JobError::Install(_))),
                "{what}: {err}"
            );
            assert!(err.contains("File too large"), "{what}: {err}");
            assert_eq!(r.source_result, Some("failed"), "{what}");
            assert_eq!(r.source_bytes, 0, "{what}: no byte moved");
        }
    }
    if kept {
        // Resumed: the verified pieces stay, only the others move.
        let again = run(Case::Clean, wire, dir, tls).await;
        let what = format!("{what}, resumed");
        let resumed = again.resumed_bytes;
        assert!(resumed >= 1 << 20, "{what}: resumed {resumed}");
        assert_eq!(again.source_bytes, SIZE - resumed, "{what}");
        check_copy(&what, again, &original);
    }
}

// One test function: the NoRoom case changes a process-wide limit, so the
// cases run one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_behaves_the_same_on_every_transport() {
    let root = tempfile::tempdir().unwrap();
    let tls = Tls::new(root.path());
    for case in [
        Case::Clean,
        Case::CorruptByte,
        Case::CorruptNoRetry,
        Case::Cut,
        Case::BadToken,
        Case::NoRoom,
    ] {
        for wire in [Wire::Tcp, Wire::Tls, Wire::Emulated] {
            let dir = root.path().join(format!("{case:?}-{wire:?}"));
            let r = run(case, wire, &dir, &tls).await;
            check(case, wire, r, &dir, &tls).await;
        }
    }
    // Only TLS has a certificate to distrust.
    let dir = root.path().join("untrusted");
    let r = run(Case::UntrustedSource, Wire::Tls, &dir, &tls).await;
    check(Case::UntrustedSource, Wire::Tls, r, &dir, &tls).await;
}

/// Sends `send` and then reads `expect` over a handshaken TLS connection,
/// after trying to give its keys to the kernel: where the
/// kernel has TLS (`ktls::available`) the keys must go and the socket
/// itself carries the bytes; where it has not, the connection must come
/// back intact and rustls carries them.
fn exchange_after_offload(
    stream: std::net::TcpStream,
    conn: rustls::Connection,
    send: &[u8],
    expect: &[u8],
) -> &'static str {
    use std::io::{Read, Write};
    let mut got = vec![0u8; expect.len()];
    match ktls::offload(&stream, conn) {
        Ok(early) => {
            assert!(
                ktls::available().is_ok(),
                "keys taken by a kernel without TLS"
            );
            assert!(early.is_empty(), "nothing decrypted before the hand-over");
            (&stream).write_all(send).unwrap();
            (&stream).read_exact(&mut got).unwrap();
            assert_eq!(got, expect);
            "kernel"
        }
        Err(ktls::KtlsError::Refused(_, conn)) => {
            assert!(
                ktls::available().is_err(),
                "kernel TLS refused: {:?}",
                ktls::available()
            );
            let (mut conn, mut sock) = (*conn, &stream);
            conn.writer().write_all(send).unwrap();
            while conn.wants_write() {
                conn.write_tls(&mut sock).unwrap();
            }
            let mut have = 0;
            while have < got.len() {
                match conn.reader().read(&mut got[have..]) {
                    Ok(n) if n > 0 => have += n,
                    _ => {
                        conn.read_tls(&mut sock).unwrap();
                        conn.process_new_packets().unwrap();
                    }
                }
            }
            assert_eq!(got, expect);
            "rustls"
        }
        Err(e) => panic!("{e}"),
    }
}

/// The hand-over to the kernel's TLS on this machine's kernel: both ends of
/// a real handshake (the source's on the runtime, the replica's blocking)
/// either give their keys to the kernel and talk through it, or keep a
/// working rustls connection. The soft-RoCE VM test runs the kernel's side
/// against rustls in real syncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_tls_takes_the_keys_or_leaves_rustls_working() {
    let dir = tempfile::tempdir().unwrap();
    let tls = Tls::new(dir.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = tls.client.clone();
    let replica = std::thread::spawn(move || {
        let s = std::net::TcpStream::connect(addr).unwrap();
        let conn =
            kvsync::transport::tls::connect(&client, "localhost", &s, Duration::from_secs(10))
                .unwrap();
        exchange_after_offload(
            s,
            conn.into(),
            b"hello from the replica",
            b"and from the source",
        )
    });
    let (s, _) = listener.accept().await.unwrap();
    // The source reads the replica's first message through rustls, as it
    // reads the session proof, and only then hands the keys over.
    let mut t = kvsync::transport::tls::accept(&tls.server, s)
        .await
        .unwrap();
    let mut first = [0u8; 22];
    tokio::io::AsyncReadExt::read_exact(&mut t, &mut first)
        .await
        .unwrap();
    assert_eq!(&first, b"hello from the replica");
    let (reader, conn) = t.into_inner();
    let s = reader.into_inner().into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    let source = tokio::task::spawn_blocking(move || {
        exchange_after_offload(s, conn.into(), b"and from the source", b"")
    })
    .await
    .unwrap();
    let replica = replica.join().unwrap();
    let expected = if ktls::available().is_ok() {
        "kernel"
    } else {
        "rustls"
    };
    assert_eq!((source, replica), (expected, expected));
}
