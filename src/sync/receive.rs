//! The replica's receiving end of one data session, for every transport.
//!
//! [`Receiver`] is the [`Sink`] the TCP and RDMA drivers feed: it owns the
//! staging file, the check of every piece against the source's manifest as
//! it lands, the resume journal (queued for a `journal::Writer` every
//! [`JOURNAL_EVERY`] verified pieces), the first local failure (a full
//! disk, a write error), and at the end makes the one install decision
//! ([`Receiver::finish`]): a verified staging file, or the job error that
//! says why not. A failed session that verified pieces keeps its staging
//! file and journal for the next attempt to resume ([`Receiver::open`]
//! finds them); any other failure removes the temp file. The pieces a
//! journal claims are read back and checked on a thread of their own while
//! the session fetches the rest; a journal that claimed what the file does
//! not hold fails the session at its end and is discarded, so the next
//! attempt starts over. A receiver registered as a relay
//! ([`Receiver::relay_in`]) marks each verified piece in its [`Arrivals`],
//! so other replicas can be sent it while the rest still arrives.

use std::path::Path;
use std::sync::Arc;

use tracing::{info, warn};

use crate::arrivals::Arrivals;
use crate::blk3::token::MAX_NEED_RANGES;
use crate::blk3::{need_ranges, Blk3Error, Outcome};
use crate::install::{InstallError, Staging};
use crate::journal::{self, ClaimsCheck, Journal};
use crate::manifest::Manifest;
use crate::snapshot::{Format, SnapshotInfo};
use crate::transport::session::SessionResult;
use crate::transport::{Sink, Want};

use super::error::JobError;
use super::relay::{Registration, RelayTable};

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

/// The piece being received: its index, running CRC32 and bytes so far.
struct Current {
    index: u32,
    crc: crc32fast::Hasher,
    got: u64,
}

/// Takes a session's pieces into a staging file and decides what they are.
pub struct Receiver {
    /// Writes the journal beside the transfer; stopped before the end.
    /// First, so that on drop it stops before the staging file goes.
    journal_writer: Option<journal::Writer>,
    staging: Staging,
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
    refetched: u32,
    /// Bytes handed over by the transport (also after a local failure).
    received: u64,
    progress: Box<dyn Fn(u64) + Send + Sync>,
    failure: Option<InstallError>,
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
                    Err(e) => {
                        warn!(error = %e, "cannot reopen the partial sync; starting over");
                        crate::install::discard(&path);
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
                    crate::install::TEMP_PREFIX,
                    crate::install::TEMP_SUFFIX
                ));
                crate::install::discard(&stale);
                let staging = Staging::create(dir, id).map_err(JobError::NotWritable)?;
                (staging, Journal::new(source, &manifest), None)
            }
        };
        let resumed_bytes = journal.verified_bytes();
        let arrivals = EndArrivals(Arc::new(Arrivals::new(journal.verified.clone())));
        let journal_writer = staging
            .file()
            .try_clone()
            .and_then(|file| journal::Writer::start(file, staging.path().to_owned()))
            .map_err(|e| JobError::Panicked(format!("start the journal writer: {e}")))?;
        Ok(Receiver {
            staging,
            manifest,
            journal,
            current: None,
            unjournaled: 0,
            journal_writer: Some(journal_writer),
            retries,
            resumed_bytes,
            claims,
            lied: false,
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
        let file = self.staging.file().try_clone()?;
        let path = self.staging.path().to_owned();
        self.relay = Some(relays.receiving(
            origin_and_name,
            self.manifest.clone(),
            (path, file),
            self.arrivals.0.clone(),
        ));
        Ok(())
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
    fn claims_checked(&mut self) -> Result<(), String> {
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

    /// Keeps the first local failure and returns its text for the peer.
    fn fail(&mut self, e: InstallError) -> String {
        let reason = e.to_string();
        self.failure.get_or_insert(e);
        reason
    }

    /// Stops the journal writer (writing what it has queued), then syncs the
    /// temp file and records the verified pieces in the journal.
    fn write_journal(&mut self) -> Result<(), String> {
        drop(self.journal_writer.take());
        self.staging.sync_data().map_err(|e| e.to_string())?;
        self.journal
            .write(self.staging.path())
            .map_err(|e| format!("write the resume journal: {e}"))
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

    /// What the status says about how the bytes were verified.
    pub fn check_label(manifest: &Manifest) -> String {
        let info = &manifest.info;
        let own = match info.format {
            Format::Kvr1 => "its KVR1 crc32 trailer",
            Format::RedisRdb if info.checksum == 0 => {
                "no RDB checksum (saved with rdbchecksum no): the manifest is its only check"
            }
            Format::RedisRdb => "its RDB crc64 trailer",
        };
        format!(
            "crc32 of each of {} pieces of {} MiB against the source's manifest; the source verified {own}",
            manifest.pieces(),
            manifest.piece_size >> 20
        )
    }
}

impl Sink for Receiver {
    fn want(&self) -> Want {
        Want {
            piece_size: self.manifest.piece_size,
            need: need_ranges(self.journal.verified.iter().map(|v| !v), MAX_NEED_RANGES),
            retries: self.retries,
        }
    }

    fn prepare(&mut self, len: u64) -> Result<(), String> {
        self.staging.prepare(len).map_err(|e| self.fail(e))
    }

    fn file(&self) -> &std::fs::File {
        self.staging.file()
    }

    fn piece_bytes(&mut self, index: u32, bytes: &[u8], in_file: bool) {
        let current = match &mut self.current {
            Some(c) if c.index == index => c,
            slot => slot.insert(Current {
                index,
                crc: crc32fast::Hasher::new(),
                got: 0,
            }),
        };
        let offset = self.manifest.range(index).0 + current.got;
        current.crc.update(bytes);
        current.got += bytes.len() as u64;
        self.received += bytes.len() as u64;
        if self.failure.is_none() {
            if in_file {
                self.staging.absorbed(bytes.len() as u64);
            } else if let Err(e) = self.staging.write_at(offset, bytes) {
                self.fail(e);
            }
        }
        (self.progress)(self.resumed_bytes + self.received);
    }

    /// After a local failure every piece is passed on unmarked: the
    /// session ends at [`Sink::verify`] with that failure.
    fn piece_done(&mut self, index: u32) -> Result<(), String> {
        let (offset, len) = self.manifest.range(index);
        let current = self.current.take().filter(|c| c.index == index);
        if self.failure.is_some() {
            return Ok(());
        }
        let (got, crc) = current.map_or((0, 0), |c| (c.got, c.crc.finalize()));
        let want = self.manifest.crcs[index as usize];
        if got != len || crc != want {
            self.refetched += 1;
            // Progress counts its bytes again when they come again.
            self.received -= got;
            return Err(format!(
                "piece {index} (bytes {offset}..{}) has crc32 {crc:#010x} over {got} bytes; the manifest says {want:#010x} over {len}",
                offset + len
            ));
        }
        self.journal.verified[index as usize] = true;
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

    fn verify(&mut self) -> Result<(), String> {
        if let Some(e) = &self.failure {
            return Err(e.to_string());
        }
        self.claims_checked().map_err(|why| {
            format!("the resume journal was wrong ({why}); the partial sync was discarded")
        })?;
        let missing = self.journal.verified.iter().filter(|v| !**v).count();
        if missing > 0 {
            return Err(format!("{missing} pieces never verified"));
        }
        self.info = Some(self.manifest.info.clone());
        Ok(())
    }
}
