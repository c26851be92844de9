//! The receiver on its own, fed piece by piece as a driver feeds it: a
//! whole snapshot, a corrupt piece, one changed so that its CRC32 stays, a
//! short one, a full disk, a failed session kept and resumed, a resume
//! journal that lies, and sources that lie about their own file.

use std::os::unix::fs::FileExt;

use super::*;
use crate::snapshot::manifest::{PieceHasher, MIN_PIECE_SIZE};
use crate::store::install::{TEMP_PREFIX, TEMP_SUFFIX};
use crate::transport::session::LinkError;
use crate::transport::tcp::TcpError;

const PIECE: u64 = MIN_PIECE_SIZE;

/// A KVR1 snapshot of 3 pieces and 5000 bytes, and its manifest.
fn snapshot() -> (Vec<u8>, Arc<Manifest>) {
    let mut bytes = Vec::new();
    crate::snapshot::kvr1::GenSpec {
        size: 3 * PIECE + 5000,
        seq: 9,
        created_ms: 7,
        seed: 1,
    }
    .write_to(&mut bytes)
    .unwrap();
    let mut check = Verifier::new(Format::Kvr1, bytes.len() as u64).unwrap();
    check.update(&bytes).unwrap();
    (
        bytes.clone(),
        manifest_claiming(&bytes, check.finish().unwrap()),
    )
}

/// The manifest a source computes over `bytes`, saying they are `info`.
fn manifest_claiming(bytes: &[u8], info: SnapshotInfo) -> Arc<Manifest> {
    let mut hasher = PieceHasher::new(PIECE);
    hasher.update(bytes);
    Arc::new(hasher.finish(info))
}

/// Hands `bytes` over as piece `index` in two cuts, and ends the piece.
fn feed(r: &mut Receiver, index: u32, bytes: &[u8]) -> Result<(), SinkError> {
    let (a, b) = bytes.split_at(bytes.len() / 3);
    r.piece_bytes(index, a, false);
    r.piece_bytes(index, b, false);
    r.piece_done(index)
}

fn received(manifest: &Manifest) -> SessionResult {
    Ok(Ok(Outcome::Received {
        len: manifest.info.size,
        seq: manifest.info.seq,
    }))
}

fn link_closed() -> SessionResult {
    Err(LinkError::Tcp(TcpError::Closed("reading a piece")))
}

/// A snapshot, and a directory receiving it.
struct Case {
    dir: tempfile::TempDir,
    bytes: Vec<u8>,
    manifest: Arc<Manifest>,
}

impl Case {
    fn new() -> Case {
        let (bytes, manifest) = snapshot();
        Case {
            dir: tempfile::tempdir().unwrap(),
            bytes,
            manifest,
        }
    }

    /// A receiver for sync `id` of the snapshot from `origin`, prepared.
    fn open(&self, id: &str, origin: &str) -> Receiver {
        let mut r = Receiver::open(
            self.dir.path(),
            id,
            origin,
            self.manifest.clone(),
            3,
            |_| {},
        )
        .unwrap();
        r.prepare(self.manifest.info.size).unwrap();
        r
    }

    /// The bytes of piece `index`.
    fn piece(&self, index: u32) -> &[u8] {
        let (offset, len) = self.manifest.range(index);
        &self.bytes[offset as usize..(offset + len) as usize]
    }

    /// Feeds the right bytes of `pieces`, each verified.
    fn feed_all(&self, r: &mut Receiver, pieces: std::ops::Range<u32>) {
        for i in pieces {
            feed(r, i, self.piece(i)).unwrap();
        }
    }

    /// The rest verifies, and the staging file holds the snapshot.
    fn installs(&self, mut r: Receiver) {
        r.verify().unwrap();
        let done = r.finish(received(&self.manifest)).unwrap();
        assert_eq!(std::fs::read(done.staging.path()).unwrap(), self.bytes);
        assert_eq!(done.info, self.manifest.info);
    }

    /// A session that verified `pieces`, then lost its link.
    fn fails_after(&self, pieces: std::ops::Range<u32>) {
        let mut r = self.open("t1", "src-a");
        self.feed_all(&mut r, pieces);
        let err = r.finish(link_closed()).err().unwrap();
        assert!(matches!(err, JobError::Transport(_)), "{err}");
    }

    /// kvsync's temp files and journals in the directory.
    fn temp_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(TEMP_PREFIX))
            .collect();
        names.sort();
        names
    }
}

#[test]
fn every_piece_verified_gives_a_staging_file_holding_the_snapshot() {
    let c = Case::new();
    let mut r = c.open("t1", "src-a");
    assert_eq!(r.want().need, vec![(0, 4)]);
    c.feed_all(&mut r, 0..c.manifest.pieces());
    c.installs(r);
}

#[test]
fn a_corrupt_piece_is_refused_and_its_second_sending_taken() {
    let c = Case::new();
    let mut r = c.open("t1", "src-a");
    let mut bad = c.piece(1).to_vec();
    bad[1000] ^= 0x40;
    let err = feed(&mut r, 1, &bad).unwrap_err();
    assert!(
        matches!(err, SinkError::BadPiece { index: 1, got, len, .. } if got == len),
        "{err}"
    );
    assert_eq!(r.refetched(), 1);
    c.feed_all(&mut r, 0..c.manifest.pieces());
    c.installs(r);
}

#[test]
fn a_piece_changed_without_changing_its_crc32_is_refused() {
    let c = Case::new();
    let mut r = c.open("t1", "src-a");
    let mut forged = c.piece(1).to_vec();
    for (b, d) in forged[4096..]
        .iter_mut()
        .zip(crate::transport::CRC32_NEUTRAL)
    {
        *b ^= d;
    }
    assert_eq!(crc32fast::hash(&forged), crc32fast::hash(c.piece(1)));
    let err = feed(&mut r, 1, &forged).unwrap_err();
    assert!(matches!(err, SinkError::BadPiece { index: 1, .. }), "{err}");
    c.feed_all(&mut r, 0..c.manifest.pieces());
    c.installs(r);
}

/// A source's manifest that matches its bytes, which are not `c`'s
/// snapshot though its manifest says so: never a staging file to install.
fn refused_as_the_claimed_snapshot(bytes: &[u8], claimed: &SnapshotInfo) -> SinkError {
    let c = Case {
        manifest: manifest_claiming(bytes, claimed.clone()),
        bytes: bytes.to_vec(),
        ..Case::new()
    };
    let mut r = c.open("t1", "src-a");
    c.feed_all(&mut r, 0..c.manifest.pieces());
    let err = r.verify().unwrap_err();
    let failed = r.finish(Ok(Err(Blk3Error::Checksum(err.to_string()))));
    assert!(matches!(failed, Err(JobError::Checksum(_))));
    err
}

#[test]
fn a_source_that_lies_about_its_own_file_gets_nothing_installed() {
    let good = Case::new();
    let claimed = &good.manifest.info;
    // Zeros of the snapshot's length, with a manifest that matches them.
    let zeros = vec![0u8; good.bytes.len()];
    let err = refused_as_the_claimed_snapshot(&zeros, claimed);
    assert!(matches!(err, SinkError::NotSnapshot(_)), "{err}");
    // A record value changed: every piece hash matches the source's own
    // manifest, but the file's CRC32 trailer does not.
    let mut changed = good.bytes.clone();
    changed[2 * PIECE as usize] ^= 1;
    let err = refused_as_the_claimed_snapshot(&changed, claimed);
    assert!(
        matches!(
            &err,
            SinkError::NotSnapshot(Corruption::ChecksumMismatch { .. })
        ),
        "{err}"
    );
    // A valid KVR1 file, but not the seq the manifest says.
    let other = SnapshotInfo {
        seq: claimed.seq + 1,
        ..claimed.clone()
    };
    let err = refused_as_the_claimed_snapshot(&good.bytes, &other);
    assert!(
        matches!(err, SinkError::NotAsOffered("sequence number")),
        "{err}"
    );
    // Truncated at a piece boundary, the manifest claiming that length.
    let cut = &good.bytes[..3 * PIECE as usize];
    let short = SnapshotInfo {
        size: cut.len() as u64,
        ..claimed.clone()
    };
    let err = refused_as_the_claimed_snapshot(cut, &short);
    assert!(matches!(err, SinkError::NotSnapshot(_)), "{err}");
}

#[test]
fn pieces_in_file_memory_are_checked_again_after_the_source_lost_access() {
    let c = Case::new();
    let mut r = c.open("t1", "src-a");
    // Bytes land in the file through a mapping the source can write, as
    // over RDMA: the driver writes them there and reports them in place.
    for i in 0..c.manifest.pieces() {
        let (offset, _) = c.manifest.range(i);
        r.file().write_all_at(c.piece(i), offset).unwrap();
        r.piece_bytes(i, c.piece(i), true);
        r.piece_done(i).unwrap();
    }
    // After piece 0 verified, one more write into it before the revoke.
    r.file().write_all_at(&[0xee], 100).unwrap();
    let err = r.verify().unwrap_err();
    assert!(matches!(err, SinkError::Changed(0)), "{err}");
    // The pieces that did not change are kept for a resume; piece 0 is not.
    drop(r.finish(Ok(Err(Blk3Error::Checksum(err.to_string())))));
    let r = c.open("t2", "src-a");
    assert_eq!(r.want().need, vec![(0, 1)]);
}

#[test]
fn a_short_piece_is_refused_and_the_snapshot_is_not_verified_without_it() {
    let c = Case::new();
    let mut r = c.open("t1", "src-a");
    let whole = c.piece(2);
    let err = feed(&mut r, 2, &whole[..whole.len() - 1]).unwrap_err();
    assert!(
        matches!(err, SinkError::BadPiece { index: 2, got, len, .. } if got + 1 == len),
        "{err}"
    );
    c.feed_all(&mut r, 0..2);
    c.feed_all(&mut r, 3..4);
    assert!(matches!(r.verify(), Err(SinkError::Missing(1))));
}

#[test]
fn a_disk_that_cannot_take_the_snapshot_ends_the_session_and_leaves_nothing() {
    let c = Case::new();
    let mut r = Receiver::open(c.dir.path(), "t1", "src-a", c.manifest.clone(), 3, |_| {}).unwrap();
    // No file system reserves this much: the reservation fails as on a full disk.
    let err = r.prepare(1 << 62).unwrap_err();
    assert!(matches!(err, SinkError::Local(_)), "{err}");
    // Bytes after a local failure are passed on unmarked; the end says why.
    r.piece_bytes(0, &[1, 2, 3], false);
    r.piece_done(0).unwrap();
    assert!(matches!(r.verify(), Err(SinkError::Local(_))));
    let err = r.finish(received(&c.manifest)).err().unwrap();
    assert!(matches!(err, JobError::Install(_)), "{err}");
    assert_eq!(c.temp_files(), Vec::<String>::new());
}

#[test]
fn a_failed_session_keeps_its_verified_pieces_and_the_next_one_resumes() {
    let c = Case::new();
    c.fails_after(0..2);
    let journal = crate::store::install::JOURNAL_SUFFIX;
    assert_eq!(
        c.temp_files(),
        vec![
            format!("{TEMP_PREFIX}t1{journal}"),
            format!("{TEMP_PREFIX}t1{TEMP_SUFFIX}"),
        ]
    );
    // Another sync of the same snapshot from the same origin picks it up.
    let mut r = c.open("t2", "src-a");
    assert_eq!(r.resumed_bytes(), 2 * PIECE);
    assert_eq!(r.want().need, vec![(2, 2)]);
    c.feed_all(&mut r, 2..c.manifest.pieces());
    c.installs(r);
}

#[test]
fn a_journal_that_claims_what_the_file_does_not_hold_fails_and_is_discarded() {
    let c = Case::new();
    c.fails_after(0..2);
    // The kept file loses a claimed byte behind the journal's back.
    let partial = c.dir.path().join(format!("{TEMP_PREFIX}t1{TEMP_SUFFIX}"));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&partial)
        .unwrap();
    f.write_all_at(&[c.bytes[PIECE as usize + 10] ^ 1], PIECE + 10)
        .unwrap();
    drop(f);

    let mut r = c.open("t2", "src-a");
    assert_eq!(r.resumed_bytes(), 2 * PIECE, "trusted until read back");
    c.feed_all(&mut r, 2..c.manifest.pieces());
    let err = r.verify().unwrap_err();
    assert!(
        matches!(err, SinkError::Journal(ClaimsError::Piece(1))),
        "{err}"
    );
    // The session ends with the verdict (RDFL), as the protocol sends it.
    let verdict = Ok(Err(Blk3Error::Checksum(err.to_string())));
    let err = r.finish(verdict).err().unwrap();
    assert!(matches!(err, JobError::Checksum(_)), "{err}");
    assert_eq!(c.temp_files(), Vec::<String>::new(), "nothing kept");
    assert_eq!(
        c.open("t3", "src-a").resumed_bytes(),
        0,
        "the next attempt starts over"
    );
}

#[test]
fn a_journal_from_another_origin_is_not_resumed() {
    let c = Case::new();
    c.fails_after(0..1);
    assert_eq!(c.open("t2", "src-b").resumed_bytes(), 0);
}

#[test]
fn a_partial_file_a_running_sync_holds_is_neither_adopted_nor_swept() {
    let c = Case::new();
    c.fails_after(0..2);
    // Sync t2 resumes the kept pieces and holds the file while it runs.
    let running = c.open("t2", "src-a");
    assert_eq!(running.resumed_bytes(), 2 * PIECE);
    // A second sync of the same snapshot starts its own file.
    let second = c.open("t3", "src-a");
    assert_eq!(second.resumed_bytes(), 0);
    assert_eq!(
        crate::store::journal::sweep(c.dir.path(), std::time::Duration::ZERO, true),
        0,
        "both are held"
    );
    assert_eq!(c.temp_files().len(), 3, "{:?}", c.temp_files());
    drop(second);
    let mut running = running;
    c.feed_all(&mut running, 2..c.manifest.pieces());
    c.installs(running);
}
