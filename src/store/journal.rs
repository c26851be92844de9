//! The resume journal of a partly received snapshot (replica side,
//! docs/ARCHITECTURE.md, "Pieces and resume").
//!
//! Next to each temp file `.kvsync-recv-<id>.partial` that may be resumed
//! lies `.kvsync-recv-<id>.journal`: the source it came from, the identity
//! of the snapshot (size, seq, checksum, piece size, manifest digest) and
//! a bitmap of the pieces verified in it, with a CRC32 of its own. It is
//! replaced atomically (write, fsync, rename), always after the temp file
//! itself was synced, so it never claims bytes that are not on disk; a
//! [`Writer`] does that off the receiving thread. This module owns the
//! format, writing it, finding the journal a sync can resume, checking what
//! it claims against the file ([`ClaimsCheck`]), and the sweep that removes
//! what cannot be resumed.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::snapshot::manifest::Manifest;
use crate::store::install::{
    discard, in_use, journal_path, JOURNAL_SUFFIX, SNAPSHOT_MODE, TEMP_PREFIX, TEMP_SUFFIX,
};

const MAGIC: &[u8; 4] = b"KVSJ";
const VERSION: u8 = 2;
/// The largest journal read: a source address and a bitmap of 128 Mi pieces.
pub const MAX_JOURNAL: u64 = 16 << 20;

/// Why a journal cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    #[error("not a kvsync journal")]
    Magic,
    #[error("journal version {0} is not one this build reads")]
    Version(u8),
    #[error("journal truncated")]
    Truncated,
    #[error("journal checksum does not match its bytes")]
    Checksum,
    #[error("journal is inconsistent: {0}")]
    Inconsistent(&'static str),
}

/// What a temp file holds of which snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Journal {
    /// The source agent's node id.
    pub source: String,
    pub size: u64,
    pub seq: u64,
    pub checksum: u64,
    pub piece_size: u64,
    /// [`Manifest::digest`] of the snapshot's manifest.
    pub digest: blake3::Hash,
    /// Per piece: verified and synced in the temp file.
    pub verified: Vec<bool>,
}

impl Journal {
    /// An empty journal for `manifest`'s snapshot from `source`.
    pub fn new(source: &str, manifest: &Manifest) -> Journal {
        Journal {
            source: source.to_string(),
            size: manifest.info.size,
            seq: manifest.info.seq,
            checksum: manifest.info.checksum,
            piece_size: manifest.piece_size,
            digest: manifest.digest(),
            verified: vec![false; manifest.pieces() as usize],
        }
    }

    /// Whether this journal is of `manifest`'s snapshot from `source`.
    pub fn matches(&self, source: &str, manifest: &Manifest) -> bool {
        let info = &manifest.info;
        self.source == source
            && (self.size, self.seq, self.checksum) == (info.size, info.seq, info.checksum)
            && (self.piece_size, self.digest) == (manifest.piece_size, manifest.digest())
            && self.verified.len() == manifest.pieces() as usize
    }

    /// Bytes of the verified pieces.
    pub fn verified_bytes(&self) -> u64 {
        self.verified
            .iter()
            .enumerate()
            .filter(|(_, v)| **v)
            .map(|(i, _)| self.piece_size.min(self.size - i as u64 * self.piece_size))
            .sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.source.len() + self.verified.len() / 8);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        let source = &self.source.as_bytes()[..self.source.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(source.len() as u16).to_be_bytes());
        out.extend_from_slice(source);
        for v in [self.size, self.seq, self.checksum, self.piece_size] {
            out.extend_from_slice(&v.to_be_bytes());
        }
        out.extend_from_slice(self.digest.as_bytes());
        out.extend_from_slice(&(self.verified.len() as u32).to_be_bytes());
        let mut bits = vec![0u8; self.verified.len().div_ceil(8)];
        for (i, v) in self.verified.iter().enumerate() {
            if *v {
                bits[i / 8] |= 1 << (i % 8);
            }
        }
        out.extend_from_slice(&bits);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    pub fn decode(b: &[u8]) -> Result<Journal, JournalError> {
        if b.len() < 4 || &b[..4] != MAGIC {
            return Err(JournalError::Magic);
        }
        if b.len() < 9 {
            return Err(JournalError::Truncated);
        }
        let (body, tail) = b.split_at(b.len() - 4);
        if crc32fast::hash(body) != u32::from_be_bytes(tail.try_into().expect("4 bytes")) {
            return Err(JournalError::Checksum);
        }
        let mut r = &body[4..];
        let mut take = |n: usize| -> Result<&[u8], JournalError> {
            if r.len() < n {
                return Err(JournalError::Truncated);
            }
            let (head, rest) = r.split_at(n);
            r = rest;
            Ok(head)
        };
        let version = take(1)?[0];
        if version != VERSION {
            return Err(JournalError::Version(version));
        }
        let n = u16::from_be_bytes(take(2)?.try_into().expect("2")) as usize;
        let source = std::str::from_utf8(take(n)?)
            .map_err(|_| JournalError::Inconsistent("source is not UTF-8"))?
            .to_string();
        let mut u64s = [0u64; 4];
        for v in &mut u64s {
            *v = u64::from_be_bytes(take(8)?.try_into().expect("8"));
        }
        let [size, seq, checksum, piece_size] = u64s;
        let digest = blake3::Hash::from_bytes(take(32)?.try_into().expect("32"));
        let count = u32::from_be_bytes(take(4)?.try_into().expect("4")) as u64;
        if piece_size == 0 || count != size.div_ceil(piece_size) {
            return Err(JournalError::Inconsistent(
                "piece count does not fit the size",
            ));
        }
        let bits = take(count.div_ceil(8) as usize)?;
        if !r.is_empty() {
            return Err(JournalError::Inconsistent("bytes after the bitmap"));
        }
        let verified = (0..count as usize)
            .map(|i| bits[i / 8] & (1 << (i % 8)) != 0)
            .collect();
        Ok(Journal {
            source,
            size,
            seq,
            checksum,
            piece_size,
            digest,
            verified,
        })
    }

    /// Replaces the journal of the temp file `partial` atomically and
    /// durably. The caller has synced the temp file first.
    pub fn write(&self, partial: &Path) -> std::io::Result<()> {
        use std::io::Write;
        let path = journal_path(partial);
        let mut next = path.clone().into_os_string();
        next.push(".new");
        let next = PathBuf::from(next);
        // Created afresh (a leftover or planted `.new` goes first), never
        // through a link.
        let _ = std::fs::remove_file(&next);
        let mut f = crate::sys::fs::open_regular(
            &next,
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(SNAPSHOT_MODE),
        )?;
        f.write_all(&self.encode())?;
        f.sync_data()?;
        std::fs::rename(&next, &path)
    }

    /// The journal of the temp file `partial`, when it has one that reads
    /// (a regular file, not a link, of at most [`MAX_JOURNAL`] bytes).
    pub fn read(partial: &Path) -> Option<Journal> {
        let bytes = crate::sys::fs::read_regular(&journal_path(partial), MAX_JOURNAL).ok()?;
        Journal::decode(&bytes).ok()
    }
}

/// Keeps a temp file's journal up to date on a thread of its own: each
/// update syncs the temp file, then replaces the journal; updates that
/// queue up while one is written are coalesced into the newest. The
/// receiving thread never waits for the disk.
pub struct Writer {
    updates: Option<std::sync::mpsc::Sender<Journal>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// A writer for the temp file `partial`, open as `file`.
    pub fn start(file: std::fs::File, partial: PathBuf) -> std::io::Result<Writer> {
        let (updates, queued) = std::sync::mpsc::channel::<Journal>();
        let thread = std::thread::Builder::new()
            .name("kvsync-journal".into())
            .spawn(move || {
                while let Ok(mut journal) = queued.recv() {
                    while let Ok(newer) = queued.try_recv() {
                        journal = newer;
                    }
                    if let Err(e) = file.sync_data().and_then(|_| journal.write(&partial)) {
                        tracing::warn!(error = %e, "resume journal not updated");
                    }
                }
            })?;
        Ok(Writer {
            updates: Some(updates),
            thread: Some(thread),
        })
    }

    /// Queues `journal` to be written once the temp file is synced.
    pub fn update(&self, journal: Journal) {
        if let Some(updates) = &self.updates {
            let _ = updates.send(journal);
        }
    }
}

impl Drop for Writer {
    /// Writes what is queued, then stops: nothing is written after.
    fn drop(&mut self) {
        drop(self.updates.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Why the pieces a journal claims are not trusted.
#[derive(Debug, thiserror::Error)]
pub enum ClaimsError {
    #[error("{op} the temp file: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("read piece {index} of the temp file: {source}")]
    Read { index: u32, source: std::io::Error },
    #[error("the temp file has {len} bytes, the snapshot {size}")]
    Length { len: u64, size: u64 },
    #[error("piece {0} is not what the manifest says")]
    Piece(u32),
    #[error("stopped")]
    Stopped,
    #[error("the resume check panicked")]
    Panicked,
}

/// The read-back check of the pieces a journal claims, on a thread of its
/// own (a resumed session runs beside it); dropped unfinished, it stops at
/// its next piece.
pub struct ClaimsCheck {
    thread: Option<JoinHandle<Result<(), ClaimsError>>>,
    stop: Arc<AtomicBool>,
}

impl ClaimsCheck {
    pub fn start(
        partial: &Path,
        manifest: &Arc<Manifest>,
        journal: &Journal,
    ) -> std::io::Result<ClaimsCheck> {
        let stop = Arc::new(AtomicBool::new(false));
        let (path, manifest, journal, flag) = (
            partial.to_owned(),
            manifest.clone(),
            journal.clone(),
            stop.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("kvsync-claims".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let verdict = check_claims(&path, &manifest, &journal, &flag);
                tracing::info!(bytes = journal.verified_bytes(), elapsed = ?started.elapsed(), ok = verdict.is_ok(), "resumed pieces read back and checked");
                verdict
            })?;
        Ok(ClaimsCheck {
            thread: Some(thread),
            stop,
        })
    }

    /// The check's verdict, once it is done.
    pub fn wait(mut self) -> Result<(), ClaimsError> {
        let thread = self.thread.take().expect("joined once");
        thread.join().unwrap_or(Err(ClaimsError::Panicked))
    }
}

impl Drop for ClaimsCheck {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads back every piece `journal` claims from `partial` and checks it
/// against the manifest: a journal that claims what the file does not hold
/// is not trusted at all.
fn check_claims(
    partial: &Path,
    manifest: &Manifest,
    journal: &Journal,
    stop: &AtomicBool,
) -> Result<(), ClaimsError> {
    let io = |op| move |source| ClaimsError::Io { op, source };
    let file = crate::sys::fs::open_read(partial).map_err(io("open"))?;
    let len = file.metadata().map_err(io("stat"))?.len();
    let size = manifest.info.size;
    if len != size && journal.verified_bytes() > 0 {
        return Err(ClaimsError::Length { len, size });
    }
    // Page-aligned: the kernel's copy into an unaligned buffer is several
    // times slower (BENCHMARKS.md, verification).
    let mut buf = crate::sys::buf::AlignedBuf::new((4 << 20).min(manifest.piece_size as usize))
        .map_err(io("allocate a buffer to read"))?;
    for (index, _) in journal.verified.iter().enumerate().filter(|(_, v)| **v) {
        if stop.load(Ordering::Relaxed) {
            return Err(ClaimsError::Stopped);
        }
        let (offset, plen) = manifest.range(index as u32);
        let mut hash = blake3::Hasher::new();
        let mut at = 0;
        while at < plen {
            let n = (plen - at).min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..n], offset + at)
                .map_err(|source| ClaimsError::Read {
                    index: index as u32,
                    source,
                })?;
            hash.update(&buf[..n]);
            at += n as u64;
        }
        if !manifest.piece_is(index as u32, &hash.finalize()) {
            return Err(ClaimsError::Piece(index as u32));
        }
    }
    Ok(())
}

/// kvsync's temp files in `dir`.
fn partials(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| n.starts_with(TEMP_PREFIX) && n.ends_with(TEMP_SUFFIX))
                && crate::sys::fs::is_regular(p)
        })
        .collect()
}

/// The temp file in `dir` holding part of `manifest`'s snapshot from
/// `source`, with its journal. A journal of the same source for another
/// snapshot (the source's snapshot changed) is discarded with its temp
/// file: never a mix of two snapshots. Temp files a running sync holds
/// are left alone.
pub fn find(dir: &Path, source: &str, manifest: &Manifest) -> Option<(PathBuf, Journal)> {
    let mut found = None;
    for partial in partials(dir).into_iter().filter(|p| !in_use(p)) {
        let Some(journal) = Journal::read(&partial) else {
            continue;
        };
        if journal.source != source {
            continue;
        }
        if found.is_none() && journal.matches(source, manifest) {
            found = Some((partial, journal));
        } else {
            tracing::info!(path = %partial.display(), "the source's snapshot changed since this partial sync; discarding it");
            discard(&partial);
        }
    }
    found
}

/// Removes temp files that cannot be resumed: at start (`at_start`), those
/// without a valid journal; always, those whose journal is older than
/// `ttl`; and journals without a temp file. Never one a running sync
/// holds. Returns how many temp files went.
pub fn sweep(dir: &Path, ttl: Duration, at_start: bool) -> usize {
    let now = SystemTime::now();
    let age = |p: &Path| {
        std::fs::symlink_metadata(p)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| now.duration_since(t).ok())
    };
    let mut removed = 0;
    for partial in partials(dir).into_iter().filter(|p| !in_use(p)) {
        let journal = journal_path(&partial);
        let keep = match Journal::read(&partial) {
            Some(_) => {
                age(&journal).is_some_and(|a| a < ttl) || age(&partial).is_some_and(|a| a < ttl)
            }
            // No journal yet: a running sync's, unless this is a start.
            None => !at_start && age(&partial).is_some_and(|a| a < ttl),
        };
        if !keep {
            discard(&partial);
            removed += 1;
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name
                .strip_prefix(TEMP_PREFIX)
                .and_then(|n| n.strip_suffix(JOURNAL_SUFFIX))
            {
                let partial = dir.join(format!("{TEMP_PREFIX}{stem}{TEMP_SUFFIX}"));
                if std::fs::symlink_metadata(&partial).is_err() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
    removed
}

/// Sweeps `dir` (see [`sweep`]) every quarter of `ttl` (1 s to 10 min)
/// until `shutdown`, so partial syncs nobody resumed go after `ttl`.
pub async fn sweep_every(
    dir: PathBuf,
    ttl: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let period = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
    let mut tick = tokio::time::interval(period);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {
                let dir = dir.clone();
                let removed = tokio::task::spawn_blocking(move || sweep(&dir, ttl, false))
                    .await
                    .unwrap_or(0);
                if removed > 0 {
                    tracing::info!(count = removed, ?ttl, "removed partial syncs not resumed within data.resume_ttl");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::manifest::PieceHasher;
    use crate::snapshot::{Format, SnapshotInfo};
    use proptest::prelude::*;

    fn manifest(size: u64, seq: u64) -> Manifest {
        let mut h = PieceHasher::new(1 << 20);
        h.update(&vec![1u8; size as usize]);
        h.finish(SnapshotInfo {
            format: Format::Kvr1,
            size,
            seq,
            checksum: 5,
            records: 1,
            created_ms: 0,
            repl_id: None,
        })
    }

    #[test]
    fn round_trip_and_damage() {
        let mut j = Journal::new("10.0.0.1:7000", &manifest(5 << 20, 9));
        j.verified[0] = true;
        j.verified[3] = true;
        let enc = j.encode();
        assert_eq!(Journal::decode(&enc).unwrap(), j);
        assert_eq!(j.verified_bytes(), 2 << 20);
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 0x10;
            assert!(Journal::decode(&bad).is_err(), "flip at {i}");
        }
        for cut in 0..enc.len() {
            assert!(Journal::decode(&enc[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn find_resumes_the_same_snapshot_and_drops_another() {
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join(format!("{TEMP_PREFIX}a{TEMP_SUFFIX}"));
        std::fs::write(&partial, b"x").unwrap();
        let m = manifest(3 << 20, 1);
        Journal::new("src:1", &m).write(&partial).unwrap();
        assert!(find(dir.path(), "other:1", &m).is_none());
        assert!(partial.exists(), "another source's partial stays");
        assert_eq!(find(dir.path(), "src:1", &m).unwrap().0, partial);
        // The source's snapshot changed: the partial goes.
        assert!(find(dir.path(), "src:1", &manifest(3 << 20, 2)).is_none());
        assert!(!partial.exists() && !journal_path(&partial).exists());
    }

    #[test]
    fn sweep_keeps_only_what_can_be_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let with = dir.path().join(format!("{TEMP_PREFIX}w{TEMP_SUFFIX}"));
        let without = dir.path().join(format!("{TEMP_PREFIX}n{TEMP_SUFFIX}"));
        let orphan = dir.path().join(format!("{TEMP_PREFIX}o{JOURNAL_SUFFIX}"));
        std::fs::write(&with, b"x").unwrap();
        std::fs::write(&without, b"x").unwrap();
        std::fs::write(&orphan, b"x").unwrap();
        Journal::new("s", &manifest(1 << 20, 1))
            .write(&with)
            .unwrap();
        let hour = Duration::from_secs(3600);
        assert_eq!(sweep(dir.path(), hour, false), 0, "a running sync's");
        assert_eq!(sweep(dir.path(), hour, true), 1);
        assert!(with.exists() && !without.exists() && !orphan.exists());
        assert_eq!(sweep(dir.path(), Duration::ZERO, false), 1, "past the ttl");
        assert!(!with.exists() && !journal_path(&with).exists());
    }

    /// A file outside the directory, and links to it planted where the
    /// journal goes: nothing is written through them, nothing read.
    #[test]
    fn planted_links_and_fifos_are_never_followed() {
        use std::os::unix::fs::PermissionsExt;
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"root's own bytes").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join(format!("{TEMP_PREFIX}l{TEMP_SUFFIX}"));
        std::fs::write(&partial, b"x").unwrap();
        let m = manifest(1 << 20, 1);
        let journal = journal_path(&partial);
        let mut next = journal.clone().into_os_string();
        next.push(".new");
        std::os::unix::fs::symlink(&victim, &next).unwrap();
        let _ = Journal::new("s", &m).write(&partial);
        assert_eq!(std::fs::read(&victim).unwrap(), b"root's own bytes");
        // A journal that is a link to a valid journal elsewhere is not read.
        let _ = std::fs::remove_file(&next);
        let elsewhere = outside.path().join(format!("{TEMP_PREFIX}e{TEMP_SUFFIX}"));
        std::fs::write(&elsewhere, b"x").unwrap();
        Journal::new("s", &m).write(&elsewhere).unwrap();
        let _ = std::fs::remove_file(&journal);
        std::os::unix::fs::symlink(journal_path(&elsewhere), &journal).unwrap();
        assert!(Journal::read(&partial).is_none());
        // A FIFO as journal: read at once, not waited on.
        std::fs::remove_file(&journal).unwrap();
        let c = std::ffi::CString::new(journal.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let p = partial.clone();
        std::thread::spawn(move || tx.send(Journal::read(&p).is_none()).unwrap());
        assert!(rx
            .recv_timeout(Duration::from_secs(10))
            .expect("read returns"));
        // A temp file that is a link is not a partial sync.
        let linked = dir.path().join(format!("{TEMP_PREFIX}k{TEMP_SUFFIX}"));
        std::os::unix::fs::symlink(&elsewhere, &linked).unwrap();
        assert!(!partials(dir.path()).contains(&linked));
        sweep(dir.path(), Duration::ZERO, true);
        assert!(elsewhere.exists(), "the link's target stays");
        assert!(journal_path(&elsewhere).exists());
    }

    #[test]
    fn a_journal_is_private_to_the_agent_and_its_group() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join(format!("{TEMP_PREFIX}m{TEMP_SUFFIX}"));
        std::fs::write(&partial, b"x").unwrap();
        Journal::new("s", &manifest(1 << 20, 1))
            .write(&partial)
            .unwrap();
        let mode = std::fs::metadata(journal_path(&partial))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640);
    }

    proptest! {
        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Journal::decode(&bytes);
        }
    }
}
