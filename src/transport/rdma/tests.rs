//! BLK3 over the emulated fabric, in one process: two real queue-pair
//! endpoints on loopback, the real cache on the source, a real temp file on
//! the replica. Covers the byte-exact transfer on both receive-memory
//! paths, the WR counts of the plan, and each failure the fabric can cause.

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::*;
use crate::catalog::CatalogEntry;
use crate::install::Staging;
use crate::metrics::Metrics;
use crate::snapshot::kvr1::GenSpec;
use crate::snapshot::Format;
use crate::sync::job::JobError;
use crate::sync::receive::Receiver;
use crate::transport::emulated::{EmuFaults, EmuQp};
use crate::transport::ratelimit::RateLimiter;

const T: Duration = Duration::from_secs(30);
const TOKEN: [u8; SESSION_TOKEN_LEN] = [7; SESSION_TOKEN_LEN];

fn snapshot(dir: &Path, size: u64, seq: u64) -> CatalogEntry {
    let path = dir.join(format!("src-{size}.kvr1"));
    GenSpec {
        size,
        seq,
        created_ms: 1,
        seed: size ^ seq,
    }
    .write_file(&path)
    .unwrap();
    CatalogEntry {
        info: crate::snapshot::verify_file(&path, None).unwrap(),
        mtime: std::fs::metadata(&path).unwrap().modified().unwrap(),
        path,
    }
}

async fn cached(entry: &CatalogEntry) -> CacheRef {
    crate::cache::SnapshotCache::new(8 << 30, T, Metrics::new())
        .acquire(entry)
        .await
        .unwrap()
}

struct Pair {
    source: SourceRun,
    replica: ReplicaRun,
    receiver: Receiver,
}

/// One session: the source side accepts on a thread (checking the private
/// data), the replica side runs `replica` over its dialled queue pair.
fn session(
    snap: CacheRef,
    params: BulkParams,
    fabric: EmuFaults,
    driver: RdmaFaults,
    dir: &Path,
    replica: impl FnOnce(EmuQp, &mut Receiver) -> ReplicaRun,
) -> Pair {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let source = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let qp = EmuQp::incoming(s, T, fabric).unwrap();
        assert_eq!(
            qp.private_data(),
            TOKEN,
            "the token travels in the private data"
        );
        let progress = AtomicU64::new(0);
        let faults = crate::transport::Faults {
            rdma: driver,
            ..Default::default()
        };
        run_source(
            qp,
            Serve {
                snapshot: &snap,
                seq: 42,
                params,
                faults: &faults,
                rate: &RateLimiter::new(0),
                progress: &progress,
                cancel: Default::default(),
            },
        )
    });
    let staging = Staging::create(dir, "t", Format::Kvr1).unwrap();
    let mut receiver = Receiver::new(staging, |_| {});
    let qp = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
    let replica = replica(qp, &mut receiver);
    Pair {
        source: source.join().unwrap(),
        replica,
        receiver,
    }
}

fn plain(qp: EmuQp, sink: &mut Receiver, len: u64, faults: &RdmaFaults) -> ReplicaRun {
    run_replica(qp, TOKEN, len, sink, faults, Default::default())
}

/// A session of a generated `size`-byte snapshot with the real replica
/// executor; `replica` are the replica driver's faults.
async fn plain_session(
    dir: &Path,
    size: u64,
    params: BulkParams,
    fabric: EmuFaults,
    driver: RdmaFaults,
    replica: RdmaFaults,
) -> (CatalogEntry, Pair) {
    let entry = snapshot(dir, size, 7);
    let snap = cached(&entry).await;
    let d = dir.to_owned();
    let pair = tokio::task::spawn_blocking(move || {
        session(snap, params, fabric, driver, &d, |qp, st| {
            plain(qp, st, size, &replica)
        })
    })
    .await
    .unwrap();
    (entry, pair)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_arrive_byte_identical_on_both_memory_paths() {
    let dir = tempfile::tempdir().unwrap();
    // Header + trailer only, an odd size, and one past several chunks.
    for (size, no_file_mr) in [
        (36, false),
        ((1 << 20) + 13, true),
        (9 << 20, false),
        (9 << 20, true),
    ] {
        let faults = RdmaFaults {
            no_file_mr,
            ..Default::default()
        };
        let (entry, p) = plain_session(
            dir.path(),
            size,
            BulkParams::new(1, 4, 2),
            EmuFaults::default(),
            RdmaFaults::default(),
            faults,
        )
        .await;
        assert_eq!(
            p.source.result.unwrap().unwrap(),
            Outcome::Sent { len: size }
        );
        let outcome = p.replica.result.unwrap().unwrap();
        assert_eq!(outcome, Outcome::Received { len: size, seq: 42 });
        let expected = if no_file_mr {
            "anonymous"
        } else {
            "registered temp-file"
        };
        assert!(
            p.replica.memory.unwrap().starts_with(expected),
            "{:?}",
            p.replica.memory
        );
        let received = p.receiver.finish(Ok(Ok(outcome))).unwrap();
        assert_eq!(received.info.seq, 7);
        let installed = received.staging.install("got.kvr1").unwrap();
        assert!(std::fs::read(&installed).unwrap() == std::fs::read(&entry.path).unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_at_defaults_posts_256_writes_32_signalled() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p) = plain_session(
        dir.path(),
        1 << 30,
        BulkParams::default(),
        EmuFaults::default(),
        RdmaFaults::default(),
        RdmaFaults::default(),
    )
    .await;
    assert!(p.replica.result.unwrap().is_ok());
    assert_eq!((p.source.stats.posted, p.source.stats.signaled), (256, 32));
    assert!(p.source.stats.bulk_mb_s(1 << 30).unwrap() > 0.0);
}

/// The real replica executor over `qp`, for tests that tamper with it.
fn replica_io<'a>(
    qp: EmuQp,
    sink: &'a mut Receiver,
    faults: &'a RdmaFaults,
) -> ReplicaIo<'a, EmuQp> {
    ReplicaIo {
        link: Link::new(qp, Default::default()),
        memory: None,
        region: None,
        token: TOKEN,
        sink,
        faults,
    }
}

/// Runs a replica machine expecting `len` bytes over a tampering executor.
fn tampered(mut io: impl Executor<Error = RdmaError>, len: u64) -> ReplicaRun {
    let mut machine = Replica::new(len, BulkMode::Rdma(BulkParams::default()));
    machine.start(io.now());
    ReplicaRun {
        result: drive(&mut machine, &mut io),
        memory: None,
    }
}

/// Runs the real replica executor but posts the BDON receive late: only
/// after MRINFO is out and something else has happened.
struct LateBdon<'a, F: Fabric> {
    io: ReplicaIo<'a, F>,
    deferred: bool,
}

impl<F: Fabric> Executor for LateBdon<'_, F> {
    type Error = RdmaError;
    fn now(&self) -> Duration {
        self.io.now()
    }
    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, RdmaError> {
        if cmd == Command::PostRecv(crate::blk3::Kind::Bdon) {
            self.deferred = true;
            return Ok(None);
        }
        self.io.execute(cmd)
    }
    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, RdmaError> {
        let input = self.io.next_input(deadline)?;
        if self.deferred && self.io.memory.is_some() {
            self.deferred = false;
            self.io.link.post_recv()?;
        }
        Ok(input)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bdon_receive_posted_after_mrinfo_hits_rnr() {
    let dir = tempfile::tempdir().unwrap();
    let entry = snapshot(dir.path(), 4096, 3);
    let snap = cached(&entry).await;
    let d = dir.path().to_owned();
    let p = tokio::task::spawn_blocking(move || {
        session(
            snap,
            BulkParams::default(),
            EmuFaults::default(),
            RdmaFaults::default(),
            &d,
            |qp, sink| {
                let faults = RdmaFaults::default();
                let late = LateBdon {
                    io: replica_io(qp, sink, &faults),
                    deferred: false,
                };
                tampered(late, 4096)
            },
        )
    })
    .await
    .unwrap();
    match p.source.result {
        Err(RdmaError::Completion {
            kind: WorkKind::Send,
            status: WcStatus::RnrRetryExceeded,
            ..
        }) => {}
        other => panic!("expected RNR on the BDON send, got {other:?}"),
    }
    assert!(
        p.replica.result.is_err(),
        "the replica sees the broken connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_chunk_is_caught_by_the_checksum_and_reported_with_rdfl() {
    let dir = tempfile::tempdir().unwrap();
    let fabric = EmuFaults {
        corrupt_at: Some((2 << 20) + 5),
        ..Default::default()
    };
    let (_, p) = plain_session(
        dir.path(),
        3 << 20,
        BulkParams::new(1, 8, 2),
        fabric,
        RdmaFaults::default(),
        RdmaFaults::default(),
    )
    .await;
    let result = p.replica.result.unwrap();
    assert!(matches!(result, Err(Blk3Error::Checksum(_))), "{result:?}");
    match p.source.result {
        Ok(Err(e)) => assert!(e.is_checksum_report(), "{e}"),
        other => panic!("{other:?}"),
    }
    let verdict = p.receiver.finish(Ok(result));
    assert!(
        matches!(verdict, Err(JobError::Checksum(_))),
        "the bytes are blamed, not the disk"
    );
    let temps = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy()
                .starts_with(crate::install::TEMP_PREFIX)
        })
        .count();
    assert_eq!(temps, 0, "temp file removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_rkey_is_a_remote_access_error_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let driver = RdmaFaults {
        bad_rkey: true,
        ..Default::default()
    };
    let (_, p) = plain_session(
        dir.path(),
        1 << 20,
        BulkParams::default(),
        EmuFaults::default(),
        driver,
        RdmaFaults::default(),
    )
    .await;
    assert!(
        matches!(
            p.source.result,
            Err(RdmaError::Completion {
                status: WcStatus::RemoteAccess,
                ..
            })
        ),
        "{:?}",
        p.source.result
    );
    assert!(p.replica.result.is_err());
    let mut on_disk = Vec::new();
    std::io::Read::read_to_end(&mut p.receiver.file(), &mut on_disk).unwrap();
    assert_eq!(on_disk.len(), 1 << 20, "the temp file was sized");
    assert!(on_disk.iter().all(|&b| b == 0), "no byte was written");
}

/// The real replica executor, but MRINFO advertises one byte less.
struct ShortMrinfo<'a, F: Fabric>(ReplicaIo<'a, F>);

impl<F: Fabric> Executor for ShortMrinfo<'_, F> {
    type Error = RdmaError;
    fn now(&self) -> Duration {
        self.0.now()
    }
    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, RdmaError> {
        match cmd {
            Command::Send(Token::Mrin { addr, rkey, len }) => {
                self.0.execute(Command::Send(Token::Mrin {
                    addr,
                    rkey,
                    len: len - 1,
                }))
            }
            c => self.0.execute(c),
        }
    }
    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, RdmaError> {
        self.0.next_input(deadline)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mrinfo_length_mismatch_is_refused_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let entry = snapshot(dir.path(), 1 << 20, 3);
    let snap = cached(&entry).await;
    let d = dir.path().to_owned();
    let p = tokio::task::spawn_blocking(move || {
        session(
            snap,
            BulkParams::default(),
            EmuFaults::default(),
            RdmaFaults::default(),
            &d,
            |qp, sink| {
                let faults = RdmaFaults::default();
                tampered(ShortMrinfo(replica_io(qp, sink, &faults)), 1 << 20)
            },
        )
    })
    .await
    .unwrap();
    assert!(
        matches!(p.source.result, Ok(Err(Blk3Error::MrinfoLength { .. }))),
        "{:?}",
        p.source.result
    );
    assert_eq!(p.source.stats.posted, 0, "no write was posted");
    match p.replica.result {
        Ok(Err(Blk3Error::PeerFailed(reason))) => {
            assert!(reason.contains("MRINFO length"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connection_fails_both_sides_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fabric = EmuFaults {
        cut_after: Some(3 << 20),
        ..Default::default()
    };
    let (_, p) = plain_session(
        dir.path(),
        4 << 20,
        BulkParams::new(1, 8, 2),
        fabric,
        RdmaFaults::default(),
        RdmaFaults::default(),
    )
    .await;
    assert!(
        matches!(p.source.result, Err(RdmaError::Completion { .. })),
        "{:?}",
        p.source.result
    );
    assert!(p.replica.result.is_err());
}
