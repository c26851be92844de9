//! BLK3 over the emulated fabric, in one process: two real queue-pair
//! endpoints on loopback, the real cache on the source, a real temp file on
//! the replica. Covers the byte-exact transfer on both receive-memory
//! paths, the WR counts of the plan, and each failure the fabric can cause.

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::blk3::{BulkParams, Replica};
use crate::metrics::Metrics;
use crate::snapshot::kvr1::GenSpec;
use crate::snapshot::manifest::Manifest;
use crate::snapshot::Format;
use crate::store::catalog::CatalogEntry;
use crate::sync::receive::Receiver;
use crate::sys::ratelimit::RateLimiter;
use crate::transport::emulated::{EmuFaults, EmuQp};

const T: Duration = Duration::from_secs(30);
const TOKEN: [u8; SESSION_TOKEN_LEN] = [7; SESSION_TOKEN_LEN];

/// A generated snapshot in pieces of 1 MiB.
fn snapshot(dir: &Path, size: u64, seq: u64) -> CatalogEntry {
    snapshot_in(dir, size, seq, 1 << 20)
}

fn snapshot_in(dir: &Path, size: u64, seq: u64, piece: u64) -> CatalogEntry {
    let path = dir.join(format!("src-{size}.kvr1"));
    GenSpec {
        size,
        seq,
        created_ms: 1,
        seed: size ^ seq,
    }
    .write_file(&path)
    .unwrap();
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    CatalogEntry::scan(&path, Format::Kvr1, piece, mtime).unwrap()
}

/// The entry's cached image and its manifest.
async fn cached(entry: &CatalogEntry) -> (CacheRef, Arc<Manifest>) {
    let image = crate::store::cache::SnapshotCache::new(8 << 30, T, Metrics::new())
        .acquire("default", entry)
        .await
        .unwrap();
    (image, entry.manifest.clone())
}

struct Pair {
    source: SourceRun,
    replica: ReplicaRun,
    receiver: Receiver,
}

/// One session: the source side accepts on a thread (checking the private
/// data), the replica side runs `replica` over its dialled queue pair.
fn session(
    (snap, manifest): (CacheRef, Arc<Manifest>),
    params: BulkParams,
    fabric: EmuFaults,
    driver: RdmaFaults,
    dir: &Path,
    replica: impl FnOnce(EmuQp, &mut Receiver) -> ReplicaRun,
) -> Pair {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let piece_size = manifest.piece_size;
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
                snapshot: &crate::store::served::Served::Image(snap),
                seq: 42,
                piece_size,
                params,
                faults: &faults,
                rate: &RateLimiter::new(0),
                progress: &progress,
                cancel: Default::default(),
                reply_wait: T,
                asked: &Default::default(),
                stream: 0,
                queued: false,
            },
        )
    });
    let mut receiver = Receiver::open(dir, "t", "source", manifest, 3, |_| {}).unwrap();
    let qp = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
    let replica = replica(qp, &mut receiver);
    Pair {
        source: source.join().unwrap(),
        replica,
        receiver,
    }
}

fn plain(qp: EmuQp, sink: &mut Receiver, len: u64, faults: &RdmaFaults) -> ReplicaRun {
    run_replica(qp, TOKEN, len, sink, faults, Default::default(), |_| T)
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
    let piece = if size >= 1 << 30 { 16 << 20 } else { 1 << 20 };
    let entry = snapshot_in(dir, size, 7, piece);
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
async fn one_gib_in_16_mib_pieces_at_defaults_posts_256_writes_64_signalled() {
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
    let replica = p.replica.result.unwrap();
    assert!(replica.is_ok(), "{replica:?}");
    assert_eq!((p.source.stats.posted, p.source.stats.signaled), (256, 64));
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
        private: Vec::new(),
        token: TOKEN,
        sink,
        faults,
        damage: faults.damage_piece,
    }
}

/// Runs a replica machine expecting `len` bytes in 1 MiB pieces, all of
/// them needed, over a tampering executor.
fn tampered(mut io: impl Executor<Error = RdmaError>, len: u64) -> ReplicaRun {
    let need = crate::blk3::need_ranges((0..len.div_ceil(1 << 20)).map(|_| true), 60);
    let mut machine = Replica::new(len, 1 << 20, need, 3);
    machine.start(io.now());
    ReplicaRun {
        result: drive(&mut machine, &mut io),
        memory: None,
    }
}

/// Runs the real replica executor but never posts a PDON receive.
struct NoPdonWindow<'a, F: Fabric>(ReplicaIo<'a, F>);

impl<F: Fabric> Executor for NoPdonWindow<'_, F> {
    type Error = RdmaError;
    fn now(&self) -> Duration {
        self.0.now()
    }
    fn execute(&mut self, cmd: Command) -> Result<Option<Input>, RdmaError> {
        if cmd == Command::PostRecv(crate::blk3::Kind::Pdon) {
            return Ok(None);
        }
        self.0.execute(cmd)
    }
    fn next_input(&mut self, deadline: Option<Duration>) -> Result<Option<Input>, RdmaError> {
        self.0.next_input(deadline)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_its_pdon_window_hits_rnr() {
    // Receives are not typed on a queue pair: the first PDON takes the
    // receive posted for BDON, and BDON then finds none.
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
                tampered(NoPdonWindow(replica_io(qp, sink, &faults)), 4096)
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
        other => panic!("expected RNR on a send, got {other:?}"),
    }
    assert!(
        p.replica.result.is_err(),
        "the replica sees the broken connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_is_fetched_again_alone_over_rdma() {
    let dir = tempfile::tempdir().unwrap();
    let fabric = EmuFaults {
        corrupt_at: Some((2 << 20) + 5),
        ..Default::default()
    };
    // Damaged on the wire (the fabric), or in the receive memory (the
    // replica driver's fault, which also runs on real verbs).
    let damaged = RdmaFaults {
        damage_piece: Some(2),
        ..Default::default()
    };
    for (no_file_mr, fabric, replica) in [
        (false, fabric.clone(), RdmaFaults::default()),
        (true, fabric, RdmaFaults::default()),
        (false, EmuFaults::default(), damaged.clone()),
        (true, EmuFaults::default(), damaged),
    ] {
        let replica = RdmaFaults {
            no_file_mr,
            ..replica
        };
        let (entry, p) = plain_session(
            dir.path(),
            3 << 20,
            BulkParams::new(1, 8, 2),
            fabric,
            RdmaFaults::default(),
            replica,
        )
        .await;
        let outcome = p.replica.result.unwrap().unwrap();
        assert_eq!(
            p.source.result.unwrap().unwrap(),
            Outcome::Sent { len: 3 << 20 }
        );
        assert_eq!(p.receiver.refetched(), 1, "piece 2 once more");
        assert_eq!(p.source.stats.posted, 4, "three pieces and piece 2 again");
        let received = p.receiver.finish(Ok(Ok(outcome))).unwrap();
        let installed = received.staging.install("got.kvr1").unwrap();
        assert!(std::fs::read(&installed).unwrap() == std::fs::read(&entry.path).unwrap());
    }
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
