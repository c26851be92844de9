//! The replica's receiving end of one data session, for every transport.
//!
//! [`Receiver`] is the [`Sink`] the drivers feed: it owns the staging file,
//! the check of every piece against the manifest as it lands (hashed on
//! the [`Checker`]'s thread while the next bytes arrive), the format's
//! own check of the whole (its trailer CRC and structure, recomputed here
//! over the verified pieces in order), the re-check of every piece after
//! an RDMA source lost its access to the receive memory, the resume
//! journal (written beside the transfer every [`JOURNAL_EVERY`] pieces), the
//! first local failure, and the one install decision ([`Receiver::finish`]).
//! A failed session that verified pieces keeps them for the next attempt;
//! a journal that lied is discarded. As a relay it reports in its
//! [`Arrivals`] the bytes of each piece as they land, each piece it
//! verified and each that failed its check; the streams of one session
//! feed it through a [`Share`] each. docs/ARCHITECTURE.md, "Receiving" and
//! "Pieces and resume".

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tracing::{info, warn};

use crate::blk3::share::Take;
use crate::blk3::token::MAX_NEED_RANGES;
use crate::blk3::{need_ranges, runs, size_scaled_timeout, Blk3Error, Outcome, PieceQueue};
use crate::snapshot::manifest::Manifest;
use crate::snapshot::{Corruption, Format, SnapshotInfo, Verifier};
use crate::store::arrivals::Arrivals;
use crate::store::install::{InstallError, Staging};
use crate::store::journal::{self, ClaimsCheck, ClaimsError, Journal};
use crate::sys::splice::Pipe;
use crate::transport::session::SessionResult;
use crate::transport::{Sink, SinkError, Want};

use super::error::JobError;
use crate::store::relay::{Registration, RelayTable};

/// Verified pieces between two journal updates.
pub const JOURNAL_EVERY: u32 = 8;

/// A verified snapshot in its staging file, ready to install.
pub struct Received {
    pub staging: Staging,
    pub outcome: Outcome,
    pub info: SnapshotInfo,
    pub manifest: Arc<Manifest>,
    /// Its entry in the relay table, while other replicas may pull it.
    pub relay: Option<Registration>,
}

/// Ends the arrivals when the receiver goes, however it goes: a relay
/// image waiting for a piece that will not come stops waiting.
struct EndArrivals(Arc<Arrivals>);

impl Drop for EndArrivals {
    fn drop(&mut self) {
        self.0.end("the relay's own sync of this snapshot stopped");
    }
}

/// The piece being received: its index and bytes so far (the
/// [`Checker`] hashes them).
struct Current {
    index: u32,
    got: u64,
}

/// What the checker is told, in the order bytes land.
enum Check {
    /// Piece `index` starts; when it is the format check's next piece, its
    /// bytes continue `format` (kept only if the piece verifies).
    Start {
        index: u32,
        format: Option<Result<Verifier, Corruption>>,
    },
    /// The next `len` bytes of piece `index`, at `offset` in the file.
    Bytes { index: u32, offset: u64, len: u64 },
    /// Piece `index` ended: its hash and format check go back.
    Finish {
        index: u32,
        reply: std::sync::mpsc::SyncSender<Checked>,
    },
}

/// A piece's bytes as the checker saw them.
struct Checked {
    hash: blake3::Hash,
    format: Option<Result<Verifier, Corruption>>,
}

/// Hashes the bytes that landed in the staging file on a thread of its
/// own, reading them through the read-only mapping in the order they came,
/// while the receiving thread takes the next ones: the check at a piece's
/// end waits only for its last bytes.
struct Checker {
    jobs: Option<std::sync::mpsc::Sender<Check>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Unmaps `[offset, offset + len)` of the read-only mapping of the staging
/// file: its pages stay in the page cache, but leave this process's RSS,
/// and the kernel can write them back and reclaim them like any unmapped
/// file page.
fn unmap(map: &memmap2::Mmap, offset: u64, len: u64) {
    // SAFETY: a shared, read-only mapping of the staging file, read only
    // through slices that do not outlive a call; after MADV_DONTNEED a read
    // faults the same file pages back in.
    let _ = unsafe {
        map.unchecked_advise_range(
            memmap2::UncheckedAdvice::DontNeed,
            offset as usize,
            len as usize,
        )
    };
}

impl Checker {
    fn start(landed: Arc<memmap2::Mmap>) -> std::io::Result<Checker> {
        let (jobs, inbox) = std::sync::mpsc::channel::<Check>();
        let thread = std::thread::Builder::new()
            .name("kvsync-check".into())
            .spawn(move || {
                let mut pieces = std::collections::HashMap::new();
                for job in inbox {
                    match job {
                        Check::Start { index, format } => {
                            pieces.insert(index, (blake3::Hasher::new(), format));
                        }
                        Check::Bytes { index, offset, len } => {
                            let Some((hash, format)) = pieces.get_mut(&index) else {
                                continue;
                            };
                            let bytes = &landed[offset as usize..(offset + len) as usize];
                            hash.update(bytes);
                            if let Some(Ok(v)) = format {
                                if let Err(e) = v.update(bytes) {
                                    *format = Some(Err(e));
                                }
                            }
                            // Hashed bytes leave this process's RSS at
                            // once, not at the piece's end: a session
                            // keeps a chunk mapped, not a piece.
                            unmap(&landed, offset, len);
                        }
                        Check::Finish { index, reply } => {
                            let (hash, format) = pieces
                                .remove(&index)
                                .unwrap_or_else(|| (blake3::Hasher::new(), None));
                            let _ = reply.send(Checked {
                                hash: hash.finalize(),
                                format,
                            });
                        }
                    }
                }
            })?;
        Ok(Checker {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    fn send(&self, job: Check) {
        if let Some(jobs) = &self.jobs {
            // The thread only ends when this sender goes.
            let _ = jobs.send(job);
        }
    }

    /// Piece `index`'s hash (and format check), once all its bytes are
    /// hashed.
    fn finish(&self, index: u32) -> Checked {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.send(Check::Finish { index, reply });
        answer.recv().unwrap_or_else(|_| Checked {
            hash: blake3::hash(b"the checker thread is gone"),
            format: None,
        })
    }
}

impl Drop for Checker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The snapshot format's own check, fed every verified piece in order:
/// the next piece's bytes as they arrive (still in cache), and pieces that
/// verified out of order from the staging file once their turn comes.
struct FormatCheck {
    /// The verifier after every piece before `next`, or why the bytes so
    /// far cannot be a snapshot.
    at: Result<Verifier, Corruption>,
    next: u32,
}

impl FormatCheck {
    fn new(info: &SnapshotInfo) -> FormatCheck {
        FormatCheck {
            at: Verifier::new(info.format, info.size),
            next: 0,
        }
    }

    /// Feeds `bytes`, the whole of piece `next`.
    fn feed(&mut self, bytes: &[u8]) {
        if let Ok(v) = &mut self.at {
            if let Err(e) = v.update(bytes) {
                self.at = Err(e);
            }
        }
        self.next += 1;
    }

    /// The verdict once every piece was fed: the snapshot the bytes are,
    /// which must be the one the manifest describes.
    fn verdict(&self, claimed: &SnapshotInfo) -> Result<SnapshotInfo, SinkError> {
        let info = match &self.at {
            Ok(v) => v.clone().finish().map_err(SinkError::NotSnapshot)?,
            Err(e) => return Err(SinkError::NotSnapshot(e.clone())),
        };
        let differs = if info.seq != claimed.seq {
            Some("sequence number")
        } else if info.checksum != claimed.checksum {
            Some("checksum")
        } else if info.records != claimed.records {
            Some("record count")
        } else if info.created_ms != claimed.created_ms {
            Some("creation time")
        } else if info.repl_id != claimed.repl_id {
            Some("replication id")
        } else {
            None
        };
        match differs {
            Some(what) => Err(SinkError::NotAsOffered(what)),
            None => Ok(info),
        }
    }
}

/// Takes a session's pieces into a staging file and decides what they are.
pub struct Receiver {
    /// Writes the journal beside the transfer; stopped before the end.
    /// First, so that on drop it stops before the staging file goes.
    journal_writer: Option<journal::Writer>,
    staging: Staging,
    /// The staging file, mapped read-only once prepared: where bytes
    /// that landed in it are checked.
    landed: Option<Arc<memmap2::Mmap>>,
    /// Hashes what lands, once prepared.
    checker: Option<Checker>,
    manifest: Arc<Manifest>,
    /// Which pieces are verified (resumed ones included); the journal's bitmap.
    journal: Journal,
    current: Option<Current>,
    /// Pieces verified since the journal was last queued for writing.
    unjournaled: u32,
    retries: u32,
    resumed_bytes: u64,
    /// The read-back check of the resumed pieces, while it runs.
    claims: Option<ClaimsCheck>,
    /// The journal claimed what the file does not hold: never keep it.
    lied: bool,
    format: FormatCheck,
    /// Pieces arrived through memory the source could write until the
    /// end (RDMA into the file mapping): re-checked after the revoke.
    exposed: bool,
    refetched: u32,
    /// Bytes handed over by the transport (also after a local failure).
    received: u64,
    progress: Box<dyn Fn(u64) + Send + Sync>,
    failure: Option<Arc<InstallError>>,
    info: Option<SnapshotInfo>,
    /// The verified pieces, for other replicas this agent relays them to.
    arrivals: EndArrivals,
    relay: Option<Registration>,
}

impl Receiver {
    /// A receiver for `manifest`'s snapshot from `source` (the source
    /// agent's node id) into `dir`: it resumes the partial sync a journal
    /// there describes (checking the pieces it claims beside the transfer),
    /// or starts a temp file for sync `id`. Bytes received so far go to
    /// `progress`.
    pub fn open(
        dir: &Path,
        id: &str,
        source: &str,
        manifest: Arc<Manifest>,
        retries: u32,
        progress: impl Fn(u64) + Send + Sync + 'static,
    ) -> Result<Receiver, JobError> {
        let resumed =
            journal::find(dir, source, &manifest).and_then(
                |(path, journal)| match Staging::reopen(&path) {
                    Ok(staging) => Some((staging, journal)),
                    // Taken by a sync that started since the lookup.
                    Err(InstallError::InUse(_)) => None,
                    Err(e) => {
                        warn!(error = %e, "cannot reopen the partial sync; starting over");
                        crate::store::install::discard(&path);
                        None
                    }
                },
            );
        let (staging, journal, claims) = match resumed {
            Some((staging, journal)) => {
                info!(path = %staging.path().display(), bytes = journal.verified_bytes(), "resuming a partial sync");
                let check = ClaimsCheck::start(staging.path(), &manifest, &journal)
                    .map_err(|e| JobError::Panicked(format!("start the resume check: {e}")))?;
                (staging, journal, Some(check))
            }
            None => {
                let stale = dir.join(format!(
                    "{}{id}{}",
                    crate::store::install::TEMP_PREFIX,
                    crate::store::install::TEMP_SUFFIX
                ));
                crate::store::install::discard(&stale);
                let staging = Staging::create(dir, id).map_err(JobError::NotWritable)?;
                (staging, Journal::new(source, &manifest), None)
            }
        };
        let resumed_bytes = journal.verified_bytes();
        let format = FormatCheck::new(&manifest.info);
        let arrivals = EndArrivals(Arc::new(Arrivals::new(journal.verified.clone())));
        let journal_writer = staging
            .file()
            .try_clone()
            .and_then(|file| journal::Writer::start(file, staging.path().to_owned()))
            .map_err(|e| JobError::Panicked(format!("start the journal writer: {e}")))?;
        Ok(Receiver {
            staging,
            landed: None,
            checker: None,
            manifest,
            journal,
            current: None,
            unjournaled: 0,
            journal_writer: Some(journal_writer),
            retries,
            resumed_bytes,
            claims,
            lied: false,
            format,
            exposed: false,
            refetched: 0,
            received: 0,
            progress: Box::new(progress),
            failure: None,
            info: None,
            arrivals,
            relay: None,
        })
    }

    /// Offers the snapshot to other replicas while it arrives: registers it
    /// in `relays` as agent `origin`'s (`name` there), until this receiver
    /// fails or the snapshot is installed.
    pub fn relay_in(
        &mut self,
        relays: &Arc<RelayTable>,
        origin_and_name: (&str, &str),
    ) -> std::io::Result<()> {
        let (file, arrivals) = self.following()?;
        let path = self.staging.path().to_owned();
        self.relay = Some(relays.receiving(
            origin_and_name,
            self.manifest.clone(),
            (path, file),
            arrivals,
        ));
        Ok(())
    }

    /// The staging file (a handle of its own, readable after the install
    /// renames it) and the arrivals that say which of its bytes are there
    /// and verified: what a reader that follows the receive needs.
    pub fn following(&self) -> std::io::Result<(std::fs::File, Arc<Arrivals>)> {
        Ok((self.staging.file().try_clone()?, self.arrivals.0.clone()))
    }

    /// Bytes written to the staging file in this session.
    pub fn written(&self) -> u64 {
        self.staging.written()
    }

    /// Bytes of verified pieces found in place when the session began.
    pub fn resumed_bytes(&self) -> u64 {
        self.resumed_bytes
    }

    /// Pieces that failed their check and were asked for again.
    pub fn refetched(&self) -> u32 {
        self.refetched
    }

    /// Waits for the read-back check of the resumed pieces, once; `Err`
    /// when the journal claimed what the file does not hold.
    fn claims_checked(&mut self) -> Result<(), ClaimsError> {
        let Some(check) = self.claims.take() else {
            return Ok(());
        };
        let verdict = check.wait();
        if let Err(why) = &verdict {
            warn!(path = %self.staging.path().display(), "the resume journal is wrong ({why}); discarding the partial sync, the next attempt starts over");
            self.lied = true;
        }
        verdict
    }

    /// Keeps the first local failure and returns it.
    fn fail(&mut self, e: InstallError) -> SinkError {
        SinkError::Local(self.failure.get_or_insert(Arc::new(e)).clone())
    }

    /// Stops the journal writer (writing what it has queued), then syncs the
    /// temp file and records the verified pieces in the journal.
    fn write_journal(&mut self) -> Result<(), InstallError> {
        drop(self.journal_writer.take());
        self.staging.sync_data()?;
        let path = self.staging.path();
        self.journal.write(path).map_err(|source| InstallError::Io {
            op: "write the resume journal of",
            path: path.to_owned(),
            source,
        })
    }

    /// The install decision for a session that ended with `result`.
    pub fn finish(mut self, result: SessionResult) -> Result<Received, JobError> {
        let verdict = match result {
            Err(e) if e.is_cancelled() => return Err(JobError::Cancelled),
            Err(e) => Err(JobError::Transport(e)),
            Ok(v) => Ok(v),
        };
        let err = match (verdict, self.failure.take()) {
            (Ok(Ok(outcome)), None) => {
                // Nothing may write the journal once the install removes it.
                drop(self.journal_writer.take());
                return Ok(Received {
                    outcome,
                    info: self.info.expect("a verified session has its snapshot info"),
                    staging: self.staging,
                    manifest: self.manifest,
                    relay: self.relay,
                });
            }
            // This host could not take them (disk full, I/O error).
            (_, Some(local)) => {
                self.arrivals
                    .0
                    .end(format!("the relay cannot store it: {local}"));
                return Err(JobError::Install(local));
            }
            // The bytes were bad: the source or the wire is to blame.
            (Ok(Err(e @ (Blk3Error::Checksum(_) | Blk3Error::PieceRetries { .. }))), None) => {
                JobError::Checksum(e.to_string())
            }
            (Ok(Err(e)), None) => JobError::Protocol(e),
            (Err(e), None) => e,
        };
        self.arrivals
            .0
            .end(format!("the relay's own sync failed: {err}"));
        self.keep_for_resume();
        Err(err)
    }

    /// After a failed session: keeps the staging file and its journal when
    /// it holds verified pieces, so the next attempt moves only the rest.
    fn keep_for_resume(mut self) {
        let verified = self.journal.verified_bytes();
        if verified == 0 || self.claims_checked().is_err() || self.lied {
            return;
        }
        match self.write_journal() {
            Ok(()) => {
                info!(path = %self.staging.path().display(), bytes = verified, "kept the verified pieces for the sync to resume");
                self.staging.keep();
            }
            Err(e) => warn!(error = %e, "cannot keep the partial sync for resuming"),
        }
    }

    /// Where the next bytes of piece `index` go (starting the piece when
    /// they are its first).
    fn next_offset(&mut self, index: u32) -> u64 {
        let got = match &self.current {
            Some(c) if c.index == index => c.got,
            _ => {
                let format =
                    (index == self.format.next && !self.exposed).then(|| self.format.at.clone());
                if let Some(checker) = &self.checker {
                    checker.send(Check::Start { index, format });
                }
                self.current = Some(Current { index, got: 0 });
                0
            }
        };
        self.manifest.range(index).0 + got
    }

    /// Unmaps a piece's pages from the read-only mapping ([`unmap`]).
    fn unmap_landed(&self, offset: u64, len: u64) {
        if let Some(map) = &self.landed {
            unmap(map, offset, len);
        }
    }

    /// Feeds the format check the verified pieces whose turn has come,
    /// from the staging file (pieces that verified out of order, resumed
    /// ones). Not while the source can still write them.
    fn catch_up_format(&mut self) {
        if self.exposed {
            return;
        }
        while let Some(true) = self.journal.verified.get(self.format.next as usize) {
            let piece = landed_piece(&self.landed, &self.manifest, self.format.next);
            self.format.feed(piece);
        }
    }

    /// Hashes every piece again from the staging file, now that the source
    /// can no longer write it, and runs the format check over it from the
    /// start: what is installed is what was checked. A changed piece is no
    /// longer verified (a resume fetches it again).
    fn recheck(&mut self) -> Result<(), SinkError> {
        let (landed, manifest) = (&self.landed, &self.manifest);
        let pieces = manifest.pieces();
        let mut format = FormatCheck::new(&manifest.info);
        // The source is idle now: the hashes on one thread per core but
        // one, the format check (in order) on this one, at the same time.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let per = pieces.div_ceil(threads.saturating_sub(1).max(1)).max(1);
        let changed: Vec<u32> = std::thread::scope(|scope| {
            let hashers: Vec<_> = (0..pieces)
                .step_by(per as usize)
                .map(|first| {
                    scope.spawn(move || {
                        (first..(first + per).min(pieces))
                            .filter(|&i| {
                                let piece = landed_piece(landed, manifest, i);
                                !manifest.piece_is(i, &blake3::hash(piece))
                            })
                            .collect::<Vec<u32>>()
                    })
                })
                .collect();
            for index in 0..pieces {
                format.feed(landed_piece(landed, manifest, index));
            }
            hashers
                .into_iter()
                .flat_map(|h| h.join().expect("a hashing thread panicked"))
                .collect()
        });
        self.format = format;
        self.exposed = false;
        for &index in &changed {
            self.journal.verified[index as usize] = false;
        }
        changed
            .first()
            .map_or(Ok(()), |&index| Err(SinkError::Changed(index)))
    }

    /// Counts the current piece's next `len` bytes, now in the staging
    /// file, and has the checker hash them there.
    fn took(&mut self, len: u64) {
        let current = self.current.as_mut().expect("a piece is being received");
        let offset = self.manifest.range(current.index).0 + current.got;
        if let Some(checker) = &self.checker {
            checker.send(Check::Bytes {
                index: current.index,
                offset,
                len,
            });
        }
        current.got += len;
        let (index, got) = (current.index, current.got);
        self.received += len;
        (self.progress)(self.resumed_bytes + self.received);
        // A relay passes these bytes on before the piece is checked.
        self.arrivals
            .0
            .landed(index, got, self.manifest.range(index).1);
    }

    /// What the status says about how the bytes were verified.
    pub fn check_label(manifest: &Manifest) -> String {
        let info = &manifest.info;
        let own = match info.format {
            Format::Kvr1 => "its KVR1 crc32 trailer",
            Format::RedisRdb if info.checksum == 0 => {
                "the RDB structure (saved with rdbchecksum no: no CRC)"
            }
            Format::RedisRdb => "its RDB crc64 trailer",
        };
        format!(
            "blake3 of each of {} pieces of {} MiB against manifest {}; {own}, recomputed here",
            manifest.pieces(),
            manifest.piece_size >> 20,
            manifest.digest()
        )
    }
}

impl Sink for Receiver {
    fn want(&self) -> Want {
        Want {
            piece_size: self.manifest.piece_size,
            need: need_ranges(self.journal.verified.iter().map(|v| !v), MAX_NEED_RANGES),
            retries: self.retries,
            refill: None,
        }
    }

    /// Once per receiver: the streams of a session each ask.
    fn prepare(&mut self, len: u64) -> Result<(), SinkError> {
        if self.landed.is_some() {
            return Ok(());
        }
        self.staging.prepare(len).map_err(|e| self.fail(e))?;
        if len > 0 {
            // SAFETY: the staging file is this session's alone and stays
            // `len` long until the receiver is dropped; the map is only read.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .len(len as usize)
                    .map(self.staging.file())
            };
            let map = map.map_err(|source| {
                self.fail(InstallError::Io {
                    op: "map",
                    path: self.staging.path().to_owned(),
                    source,
                })
            })?;
            let map = Arc::new(map);
            let checker = Checker::start(map.clone()).map_err(|source| {
                self.fail(InstallError::Io {
                    op: "start the piece checker for",
                    path: self.staging.path().to_owned(),
                    source,
                })
            })?;
            self.landed = Some(map);
            self.checker = Some(checker);
        }
        Ok(())
    }

    fn file(&self) -> &std::fs::File {
        self.staging.file()
    }

    fn piece_bytes(&mut self, index: u32, bytes: &[u8], in_file: bool) {
        self.exposed |= in_file;
        let offset = self.next_offset(index);
        if self.failure.is_none() {
            if in_file {
                self.staging.absorbed(bytes.len() as u64);
            } else if let Err(e) = self.staging.write_at(offset, bytes) {
                self.fail(e);
            }
        }
        self.took(bytes.len() as u64);
    }

    /// The bytes go from the pipe into the staging file inside the kernel,
    /// and are checked through the read-only mapping, still in cache. After
    /// a local failure they are thrown away.
    fn piece_from_pipe(&mut self, index: u32, pipe: &Pipe, n: usize) -> std::io::Result<()> {
        let offset = self.next_offset(index);
        if self.failure.is_some() {
            pipe.discard(n)?;
        } else if let Err(e) = self.staging.splice_at(offset, pipe, n) {
            self.fail(e);
        }
        if self.failure.is_none() {
            self.took(n as u64);
        } else {
            self.received += n as u64;
        }
        Ok(())
    }

    /// After a local failure every piece is passed on unmarked: the
    /// session ends at [`Sink::verify`] with that failure.
    fn piece_done(&mut self, index: u32) -> Result<(), SinkError> {
        let (offset, len) = self.manifest.range(index);
        let current = self.current.take().filter(|c| c.index == index);
        if self.failure.is_some() {
            self.unmap_landed(offset, len);
            return Ok(());
        }
        let (got, Checked { hash, format }) = match (current, &self.checker) {
            (Some(c), Some(checker)) => (c.got, checker.finish(index)),
            _ => (
                0,
                Checked {
                    hash: blake3::hash(&[]),
                    format: None,
                },
            ),
        };
        if got != len || !self.manifest.piece_is(index, &hash) {
            self.unmap_landed(offset, len);
            self.arrivals.0.dropped(index);
            self.refetched += 1;
            // Progress counts its bytes again when they come again.
            self.received -= got;
            return Err(SinkError::BadPiece {
                index,
                offset,
                len,
                got,
                hash,
                want: self.manifest.hashes[index as usize],
            });
        }
        self.journal.verified[index as usize] = true;
        if let Some(format) = format {
            self.format.at = format;
            self.format.next += 1;
        }
        self.catch_up_format();
        self.unmap_landed(offset, len);
        self.arrivals.0.mark(index);
        self.unjournaled += 1;
        if self.unjournaled >= JOURNAL_EVERY {
            self.unjournaled = 0;
            if let Some(writer) = &self.journal_writer {
                writer.update(self.journal.clone());
            }
        }
        Ok(())
    }

    /// After every piece verified (and, for RDMA, after the source's
    /// access was revoked): the re-check of pieces the source could still
    /// write, then the format's verdict on the whole.
    fn verify(&mut self) -> Result<(), SinkError> {
        if let Some(e) = &self.failure {
            return Err(SinkError::Local(e.clone()));
        }
        self.claims_checked().map_err(SinkError::Journal)?;
        let missing = self.journal.verified.iter().filter(|v| !**v).count();
        if missing > 0 {
            return Err(SinkError::Missing(missing));
        }
        if self.exposed {
            self.recheck()?;
        }
        self.catch_up_format();
        self.info = Some(self.format.verdict(&self.manifest.info)?);
        Ok(())
    }
}

/// The staging file's bytes of piece `index` through its read-only
/// mapping (empty before it is prepared, or for an empty snapshot).
fn landed_piece<'m>(
    landed: &'m Option<Arc<memmap2::Mmap>>,
    manifest: &Manifest,
    index: u32,
) -> &'m [u8] {
    let (offset, len) = manifest.range(index);
    landed
        .as_ref()
        .map_or(&[][..], |m| &m[offset as usize..(offset + len) as usize])
}

/// A receiver that the streams of one session feed, and the queue they
/// take its missing pieces from ([`PieceQueue`]).
pub struct Shared {
    fed: Mutex<Fed>,
    /// A piece verified or handed back, or a local failure.
    changed: Condvar,
}

struct Fed {
    receiver: Receiver,
    queue: PieceQueue,
}

impl Shared {
    /// The queue of `streams` streams holds the pieces `receiver` lacks.
    pub fn new(receiver: Receiver, streams: u32) -> Shared {
        let verified = &receiver.journal.verified;
        let missing = (0..verified.len() as u32).filter(|&i| !verified[i as usize]);
        let queue = PieceQueue::new(missing, receiver.manifest.piece_size, streams);
        Shared {
            fed: Mutex::new(Fed { receiver, queue }),
            changed: Condvar::new(),
        }
    }

    /// Waits until `deadline` or until every piece is verified; returns
    /// the bytes this session received so far and the bytes still to come.
    pub fn progress_by(&self, deadline: Instant) -> (u64, u64) {
        let mut fed = self.lock();
        loop {
            let now = Instant::now();
            if fed.queue.left() == 0 || now >= deadline {
                let left = fed.queue.left() as u64 * fed.receiver.manifest.piece_size;
                return (fed.receiver.received, left);
            }
            fed = self
                .changed
                .wait_timeout(fed, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The receiver, once every stream has ended.
    pub fn into_inner(self) -> Receiver {
        self.fed
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .receiver
    }

    /// The receiver and queue, also after another stream panicked holding
    /// them (that stream's session then fails; their state stays consistent).
    fn lock(&self) -> MutexGuard<'_, Fed> {
        self.fed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One stream's view of a [`Shared`] receiver: the pieces it took from the
/// queue and has not verified, and the piece it is taking. Every step runs
/// on the receiver under its lock, so a piece's bytes, check and journal
/// entry are handled exactly as for a single stream. Dropped, however its
/// session ended, it hands its unverified pieces back to the queue.
pub struct Share<'a> {
    shared: &'a Shared,
    held: Vec<u32>,
    current: Option<Current>,
    file: std::fs::File,
}

impl<'a> Share<'a> {
    /// A stream of the session `shared` receives.
    pub fn new(shared: &'a Shared) -> std::io::Result<Share<'a>> {
        let file = shared.lock().receiver.staging.file().try_clone()?;
        Ok(Share {
            shared,
            held: Vec::new(),
            current: None,
            file,
        })
    }

    /// Runs `f` on the receiver and queue with this stream's piece as the
    /// receiver's current one.
    fn with<T>(&mut self, f: impl FnOnce(&mut Fed) -> T) -> T {
        let mut fed = self.shared.lock();
        std::mem::swap(&mut fed.receiver.current, &mut self.current);
        let out = f(&mut fed);
        std::mem::swap(&mut fed.receiver.current, &mut self.current);
        out
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        let mut fed = self.shared.lock();
        fed.queue.hand_back(self.held.drain(..));
        if let Some(current) = self.current.take() {
            // Its bytes count again when another stream takes the piece.
            fed.receiver.received -= current.got;
        }
        drop(fed);
        self.shared.changed.notify_all();
    }
}

impl Sink for Share<'_> {
    fn want(&self) -> Want {
        let fed = self.shared.lock();
        Want {
            piece_size: fed.receiver.manifest.piece_size,
            need: Vec::new(),
            retries: fed.receiver.retries,
            refill: Some(fed.queue.batch()),
        }
    }

    fn prepare(&mut self, len: u64) -> Result<(), SinkError> {
        self.with(|f| f.receiver.prepare(len))
    }

    fn file(&self) -> &std::fs::File {
        &self.file
    }

    fn piece_bytes(&mut self, index: u32, bytes: &[u8], in_file: bool) {
        self.with(|f| f.receiver.piece_bytes(index, bytes, in_file))
    }

    fn piece_from_pipe(&mut self, index: u32, pipe: &Pipe, n: usize) -> std::io::Result<()> {
        self.with(|f| f.receiver.piece_from_pipe(index, pipe, n))
    }

    fn piece_done(&mut self, index: u32) -> Result<(), SinkError> {
        let (result, verified) = self.with(|f| {
            let result = f.receiver.piece_done(index);
            let verified = f.receiver.journal.verified[index as usize];
            if verified {
                f.queue.verified(index);
            }
            (result, verified)
        });
        if verified {
            self.held.retain(|&i| i != index);
        }
        self.shared.changed.notify_all();
        result
    }

    fn more_pieces(&mut self, wait: bool) -> Result<Vec<(u32, u32)>, SinkError> {
        let mut fed = self.shared.lock();
        let limit = size_scaled_timeout(fed.receiver.manifest.info.size);
        let until = Instant::now() + limit;
        loop {
            if let Some(e) = &fed.receiver.failure {
                return Err(SinkError::Local(e.clone()));
            }
            match fed.queue.take() {
                Take::Pieces(pieces) => {
                    self.held.extend(&pieces);
                    return Ok(runs(pieces));
                }
                Take::Wait if wait => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(SinkError::QueueWait(limit));
                    }
                    fed = self
                        .shared
                        .changed
                        .wait_timeout(fed, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                Take::Wait | Take::Done => return Ok(Vec::new()),
            }
        }
    }

    /// This stream's end: every piece of the session verified (its last
    /// NEED said so), and nothing failed here. The whole is verified once
    /// every stream has ended.
    fn verify(&mut self) -> Result<(), SinkError> {
        let fed = self.shared.lock();
        if let Some(e) = &fed.receiver.failure {
            return Err(SinkError::Local(e.clone()));
        }
        match fed.queue.left() {
            0 => Ok(()),
            left => Err(SinkError::Missing(left)),
        }
    }
}

#[cfg(test)]
mod tests;
