//! The replication stream's log on disk: the bytes a primary sent its
//! replicas, in order, each record checksummed, so an agent can serve any
//! retained offset again (to a replica server that reconnects, to a replica
//! agent that resumes) without asking the primary.
//!
//! Offsets are the primary's own (`master_repl_offset`): a record at offset
//! `o` holds the stream's bytes `o+1 ..= o+len`, so a replica whose offset is
//! `o` continues with it (it asks `PSYNC <id> o+1`). The log is a directory of
//! segment files, `<start offset>.kvslog`, oldest first; each opens with a
//! header (magic, the start offset, the replication id its records belong
//! to, a hash of the header) and holds records `[offset u64][len u32]
//! [BLAKE3 of offset, len and bytes][bytes]`, each following the one before
//! without a gap ([`record`], [`segment`]). Each agent hashes a record as
//! it logs it: the primary's agent what the primary sent, a replica agent
//! what its upstream's frames carried under their MAC; every read checks
//! the hash again, so what the disk damaged is never served.
//!
//! The replication ids the stream has carried, and from which offset each,
//! are the log's [`history`]. A new id starts a new segment, so each
//! segment has exactly one.
//!
//! The log's rules, which its methods keep: a record is appended only
//! where the log ends ([`Log::append`]); a damaged record is marked and
//! readers stop before it until its bytes, fetched again, match its hash
//! and are written back in place ([`Log::mark_damaged`], [`Log::mend`]);
//! a cut removes a damaged record, everything after it and the ids that
//! began after it ([`Log::cut`]);
//! retention removes only whole old segments, never the newest and never
//! what an offered snapshot still needs ([`Log::trim`]); what is
//! acknowledged is what was written ([`Log::synced`] under `always`).
//!
//! On open, the newest segment is checked record by record and cut after
//! its last whole, matching record (a write torn by a crash); older
//! segments are checked as they are read. Reads take a [`ReadPlan`] under
//! the caller's lock and then read without it: segments only grow at their
//! end and are removed whole, so the planned bytes stay put (a removed file
//! reads as "no longer retained").

pub mod history;
pub mod mend;
pub mod record;
pub mod segment;
pub mod tail;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use tracing::warn;

pub use self::history::Epoch;
use self::history::History;
pub use self::mend::Damaged;
pub use self::record::{contiguous, Record, MAX_RECORD, RECORD_HEADER};
use self::segment::{cut_point, scan, Segment, REPLID_LEN, SUFFIX};
pub use self::segment::{read, ReadPlan, HEADER_LEN as SEGMENT_HEADER};
use crate::config::{Fsync, StreamConfig};
use crate::sys::fs::open_regular;

/// How far past its end a log continues a stream of its current id
/// ([`Log::continues`]).
pub const AHEAD: u64 = 64 << 20;

/// What went wrong with the log, for the operator and for the caller's
/// decision (refetch from upstream, answer "too old", stop logging).
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("stream log {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stream log {}: the record at offset {offset} is damaged ({why}); nothing is served past offset {offset} until it is fetched again from upstream", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    /// The offset is not (or no longer) in the log.
    #[error("offset {offset} of replication id {replid} is not in the log, which holds {held}")]
    NotHeld {
        replid: String,
        offset: u64,
        held: String,
    },
    #[error("a record at offset {offset} does not continue the log, which ends at {end}")]
    Gap { offset: u64, end: u64 },
    /// A reader cut the log back under its writer, which starts again.
    #[error("the log was cut back to offset {0} after a damaged record: the stream is fetched again from there")]
    Cut(u64),
    #[error("a record of {0} bytes is larger than a record may be ({MAX_RECORD})")]
    TooLarge(usize),
    #[error("the log holds no stream yet: it starts with the replication id and offset of a full resync")]
    Empty,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LogError + '_ {
    move |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The stream log of one instance. Not shared by itself: callers hold it
/// under a lock and read through [`Log::plan`] and [`read`].
#[derive(Debug)]
pub struct Log {
    cfg: StreamConfig,
    segments: Vec<Segment>,
    history: History,
    file: Option<File>,
    synced: u64,
    /// The newest bytes, for readers at or near the end.
    tail: tail::Tail,
    set_aside: Vec<PathBuf>,
    /// Records found damaged at run time, oldest first: readers stop
    /// before each until it is mended ([`Log::mend`]) or cut.
    damaged: Vec<Damaged>,
}

/// How a damaged file set aside in the log's directory ends.
const SET_ASIDE: &str = ".damaged";

/// Renames the damaged file `path` to `<name>.<unix seconds>.damaged`,
/// where the log no longer reads it, and says so.
fn put_aside(path: &Path, why: &str) -> Result<PathBuf, LogError> {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let aside = path.with_file_name(format!("{name}.{secs}{SET_ASIDE}"));
    std::fs::rename(path, &aside).map_err(io(path))?;
    if let Some(dir) = path.parent() {
        crate::sys::fs::sync_dir(dir).map_err(io(dir))?;
    }
    warn!(file = %path.display(), set_aside = %aside.display(), "a damaged file of the stream log ({why}) is set aside: the log goes on without it (what it held is fetched from upstream when needed); look at it and remove it");
    Ok(aside)
}

impl Log {
    /// Opens (or creates) the log in `cfg.dir`, cutting a torn tail. A
    /// damaged file (a segment whose header or record headers do not
    /// hold, an unreadable history) is set aside, never fails the open:
    /// the log keeps the newest segments that still continue each other,
    /// and the history is made again from their headers.
    pub fn open(cfg: StreamConfig) -> Result<Log, LogError> {
        let dir = cfg.dir.clone();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let mut paths: Vec<(u64, PathBuf)> = Vec::new();
        let mut set_aside = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let p = e.map_err(io(&dir))?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some(start) = name.strip_suffix(SUFFIX).and_then(|s| s.parse().ok()) {
                paths.push((start, p));
            } else if name.ends_with(SET_ASIDE) {
                set_aside.push(p);
            }
        }
        set_aside.sort();
        let history = match History::load(&dir) {
            Ok(history) => Some(history),
            Err(LogError::Corrupt { path, why, .. }) => {
                set_aside.push(put_aside(&path, &why)?);
                None
            }
            Err(e) => return Err(e),
        };
        paths.sort();
        let mut segments: Vec<Segment> = Vec::new();
        let last = paths.len().saturating_sub(1);
        let mut newest_aside = false;
        for (i, (_, path)) in paths.into_iter().enumerate() {
            let seg = match scan(&path, i == last) {
                Ok(seg) => seg,
                Err(LogError::Corrupt { why, .. }) => {
                    set_aside.push(put_aside(&path, &why)?);
                    newest_aside = i == last;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if let Some(prev) = segments.last() {
                if prev.end != seg.start {
                    warn!(
                        log = %dir.display(),
                        "segments before offset {} do not reach it (they end at {}); they are removed",
                        seg.start, prev.end
                    );
                    for old in segments.drain(..) {
                        let _ = std::fs::remove_file(&old.path);
                    }
                }
            }
            segments.push(seg);
        }
        if newest_aside {
            // The one before is the newest now: checked as the newest is.
            if let Some(seg) = segments.pop() {
                segments.push(scan(&seg.path, true)?);
            }
        }
        let ids = segments.iter().map(|s| (s.replid.as_str(), s.start));
        let mut history = match history {
            Some(history) => history,
            None => History::made_again(&dir, ids)?,
        };
        if let Some(seg) = segments.last() {
            history.cut(&dir, seg.end)?;
        }
        let file = match segments.last() {
            Some(s) => {
                Some(open_regular(&s.path, OpenOptions::new().append(true)).map_err(io(&s.path))?)
            }
            None => None,
        };
        let synced = segments.last().map_or(0, |s| s.end);
        let tail = tail::Tail::new(cfg.memory_tail.as_u64() as usize, synced);
        Ok(Log {
            cfg,
            segments,
            history,
            file,
            synced,
            tail,
            set_aside,
            damaged: Vec::new(),
        })
    }

    /// The damaged files set aside in the log's directory, found or set
    /// aside on open, kept for the operator to look at and remove.
    pub fn set_aside(&self) -> &[PathBuf] {
        &self.set_aside
    }

    /// The replication id of the newest record and the log's end offset,
    /// or `None` for a log that holds no stream.
    pub fn position(&self) -> Option<(String, u64)> {
        let seg = self.segments.last()?;
        Some((seg.replid.clone(), seg.end))
    }

    /// The first offset the log holds (records continue it to the end).
    pub fn first(&self) -> Option<u64> {
        self.segments.first().map(|s| s.start)
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.bytes).sum()
    }

    /// The offset up to which records have reached the disk: every record
    /// under `always`, those of the last `sync` under `everysec`.
    pub fn synced(&self) -> u64 {
        self.synced
    }

    pub fn history(&self) -> &[Epoch] {
        self.history.epochs()
    }

    /// The replication id the stream is of at `offset`: the newest epoch
    /// that started at or before it (a change of id at `o` holds from `o`).
    pub fn replid_at(&self, offset: u64) -> Option<&str> {
        self.history.replid_at(offset)
    }

    /// Where `replid`'s history ended in this log because a later id took
    /// over there (a promotion or a restart): `None` while it is the
    /// log's current id, or one the log never held.
    pub fn superseded_at(&self, replid: &str) -> Option<u64> {
        self.history.superseded_at(replid)
    }

    /// Starts the log over at a full resync: `replid` from `offset` (the
    /// RDB's), dropping what it held, which no longer continues.
    pub fn restart(&mut self, replid: &str, offset: u64) -> Result<(), LogError> {
        self.file = None;
        for s in self.segments.drain(..) {
            std::fs::remove_file(&s.path).map_err(io(&s.path))?;
        }
        self.history.clear();
        self.damaged.clear();
        self.tail.reset(offset);
        self.open_segment(replid, offset)?;
        self.synced = offset;
        Ok(())
    }

    /// The primary continues under a new replication id from the log's
    /// end (`+CONTINUE <new id>` after a promotion or restart).
    pub fn switch(&mut self, replid: &str) -> Result<(), LogError> {
        let (old, end) = self.position().ok_or(LogError::Empty)?;
        if old != replid {
            self.tail.reset(end);
            self.open_segment(replid, end)?;
        }
        Ok(())
    }

    fn open_segment(&mut self, replid: &str, start: u64) -> Result<(), LogError> {
        if replid.len() != REPLID_LEN || !replid.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(LogError::Corrupt {
                path: self.cfg.dir.clone(),
                offset: start,
                why: format!("{replid:?} is not a replication id"),
            });
        }
        self.history.begin(&self.cfg.dir, replid, start)?;
        let (seg, file) = Segment::create(&self.cfg.dir, replid, start)?;
        self.segments.push(seg);
        self.file = Some(file);
        Ok(())
    }

    /// Cuts the log back to `offset`, where a reader found a damaged
    /// record: that record and everything after it are removed (from the
    /// whole record before it, when the damage hides where it starts), so
    /// the writer fetches them again from upstream. A cut at or past the
    /// log's end changes nothing (another reader cut it first).
    pub fn cut(&mut self, offset: u64) -> Result<(), LogError> {
        let Some((_, end)) = self.position() else {
            return Ok(());
        };
        if offset >= end {
            return Ok(());
        }
        let Some(i) = self.segments.iter().rposition(|s| s.start <= offset) else {
            return Ok(());
        };
        let (pos, at) = cut_point(&self.segments[i], offset)?;
        self.file = None;
        for s in self.segments.drain(i + 1..) {
            std::fs::remove_file(&s.path).map_err(io(&s.path))?;
        }
        let seg = &mut self.segments[i];
        let file =
            open_regular(&seg.path, OpenOptions::new().append(true)).map_err(io(&seg.path))?;
        file.set_len(pos).map_err(io(&seg.path))?;
        file.sync_all().map_err(io(&seg.path))?;
        seg.end = at;
        seg.bytes = pos;
        seg.index.retain(|&(_, p)| p < pos);
        self.file = Some(file);
        self.synced = self.synced.min(at);
        self.tail.cut(at);
        self.damaged.retain(|d| d.end() <= at);
        self.history.cut(&self.cfg.dir, at)?;
        warn!(log = %self.cfg.dir.display(), "the stream log is cut back to offset {at} (it ended at {end}): what follows is fetched again");
        Ok(())
    }

    /// Takes note that the record at `offset`, which a reader found
    /// damaged, is to be fetched again: readers stop before it until it
    /// is mended ([`Log::mend`]). Returns whether it could be: `false`
    /// when no whole record header starts at `offset` (the damage hides
    /// the record's length), which only a cut ([`Log::cut`]) mends.
    pub fn mark_damaged(&mut self, offset: u64) -> Result<bool, LogError> {
        if self.damaged.iter().any(|d| d.offset == offset) {
            return Ok(true);
        }
        let Some(seg) = self
            .segments
            .iter()
            .find(|s| s.start <= offset && offset < s.end)
        else {
            return Ok(false);
        };
        let Some(d) = Damaged::find(seg, offset)? else {
            return Ok(false);
        };
        self.damaged.push(d);
        self.damaged.sort_by_key(|d| d.offset);
        Ok(true)
    }

    /// The damaged records awaiting their bytes again, oldest first.
    pub fn damaged(&self) -> &[Damaged] {
        &self.damaged
    }

    /// How many bytes from `at` a reader may read before the next
    /// damaged record (none: `u64::MAX`; 0: `at` is in one).
    pub fn readable_from(&self, at: u64) -> u64 {
        self.damaged
            .iter()
            .find(|d| d.end() > at)
            .map_or(u64::MAX, |d| d.offset.saturating_sub(at))
    }

    /// Writes `bytes`, the damaged record at `offset` fetched again from
    /// upstream, back in its place once they match its hash; readers go
    /// on past it. Returns whether it did: `false` when the record is no
    /// longer one to mend (a cut, a trim or a restart took it).
    pub fn mend(&mut self, offset: u64, bytes: &[u8]) -> Result<bool, LogError> {
        let Some(i) = self.damaged.iter().position(|d| d.offset == offset) else {
            return Ok(false);
        };
        self.damaged[i].mend(bytes)?;
        self.damaged.remove(i);
        Ok(true)
    }

    /// The writer's check that the log still ends where it wrote last
    /// (`end`): a reader may have cut it back ([`Log::cut`]).
    pub fn still_ends_at(&self, end: u64) -> Result<(), LogError> {
        match self.position() {
            Some((_, e)) if e != end => Err(LogError::Cut(e)),
            _ => Ok(()),
        }
    }

    /// Appends the stream's `bytes` at `offset`, which must continue the
    /// log, as one record hashed here: the one place a record's hash is
    /// made (a reader of the file checks it; the memory tail holds these
    /// same bytes).
    pub fn append(&mut self, offset: u64, bytes: &[u8]) -> Result<(), LogError> {
        if bytes.len() > MAX_RECORD {
            return Err(LogError::TooLarge(bytes.len()));
        }
        let (_, end) = self.position().ok_or(LogError::Empty)?;
        if offset != end {
            return Err(LogError::Gap { offset, end });
        }
        if bytes.is_empty() {
            // Nothing to log: a record that moved no offset would let a
            // segment fill without its end moving.
            return Ok(());
        }
        if self.rollover_due() {
            let replid = self.segments.last().expect("checked").replid.clone();
            // The segment it closes is flushed first: `synced` then holds
            // for every segment but the newest.
            self.sync()?;
            self.file = None;
            self.open_segment(&replid, end)?;
        }
        let mut buf = Vec::with_capacity(RECORD_HEADER + bytes.len());
        record::encode(offset, bytes, &mut buf);
        let seg = self.segments.last_mut().expect("a segment is open");
        let file = self.file.as_mut().expect("the newest segment is open");
        if let Err(e) = file.write_all(&buf) {
            // A partial record (disk full) is cut, so the file ends whole.
            let _ = file.set_len(seg.bytes);
            return Err(io(&seg.path)(e));
        }
        seg.appended(offset, offset + bytes.len() as u64, buf.len());
        self.tail.push(offset, bytes);
        match self.cfg.fsync {
            Fsync::Always => self.sync(),
            // The writer's once-a-second tick flushes ([`Log::tick`]).
            Fsync::Everysec => Ok(()),
        }
    }

    /// Whether the next append may wait for the disk: each one flushes
    /// (`fsync = "always"`), or the newest segment is full, so the append
    /// flushes it and makes the next. Otherwise an append only writes to
    /// the page cache.
    pub fn append_waits_for_disk(&self) -> bool {
        self.cfg.fsync == Fsync::Always || self.rollover_due()
    }

    /// Whether the newest segment is full: the next record starts another.
    fn rollover_due(&self) -> bool {
        self.segments
            .last()
            .is_some_and(|s| s.bytes >= self.cfg.segment_size.as_u64())
    }

    /// The writer's once-a-second care under the lock: trims to the
    /// retention above `floor` ([`Log::trim`]) and, when records were
    /// appended since the last flush, returns a handle of the newest
    /// segment and the end to flush them to, which the caller flushes off
    /// the lock and then notes ([`Log::flushed`]).
    pub fn tick(&mut self, floor: u64) -> Result<Option<(File, u64, PathBuf)>, LogError> {
        self.trim(floor)?;
        let (Some(file), Some(seg)) = (&self.file, self.segments.last()) else {
            return Ok(None);
        };
        if self.synced >= seg.end {
            return Ok(None);
        }
        let handle = file.try_clone().map_err(io(&seg.path))?;
        Ok(Some((handle, seg.end, seg.path.clone())))
    }

    /// Notes that the log is on the disk up to `end` (a flush off the
    /// lock; a cut meanwhile keeps the lower end).
    pub fn flushed(&mut self, end: u64) {
        let now = self.position().map_or(0, |(_, e)| e);
        self.synced = self.synced.max(end.min(now));
    }

    /// Flushes the newest segment to the disk.
    pub fn sync(&mut self) -> Result<(), LogError> {
        if let (Some(file), Some(seg)) = (&self.file, self.segments.last()) {
            file.sync_data().map_err(io(&seg.path))?;
            self.synced = seg.end;
        }
        Ok(())
    }

    /// Whether a replica at `offset` under `replid` can continue from the
    /// log: that id's span holds the offset and the log still does.
    pub fn covers(&self, replid: &str, offset: u64) -> Result<(), LogError> {
        let not_held = || LogError::NotHeld {
            replid: replid.to_string(),
            offset,
            held: self.describe(),
        };
        let (_, end) = self.position().ok_or_else(not_held)?;
        let first = self.first().unwrap_or(end);
        if !self.history.holds(replid, offset, end) || offset < first || offset > end {
            return Err(not_held());
        }
        Ok(())
    }

    /// Whether a reader of `replid` at `offset` can be continued: the log
    /// covers it, or its current id is `replid` and `offset` is at most
    /// [`AHEAD`] past its end (the reader got that far elsewhere, from
    /// another upstream or the primary itself; under one id an offset
    /// names the same byte everywhere, so it is served once the log has
    /// it).
    pub fn continues(&self, replid: &str, offset: u64) -> Result<(), LogError> {
        let covered = self.covers(replid, offset);
        match self.position() {
            Some((id, end)) if covered.is_err() && id == replid && offset > end => {
                if offset - end <= AHEAD {
                    return Ok(());
                }
                covered
            }
            _ => covered,
        }
    }

    /// What the log holds, for messages.
    pub fn describe(&self) -> String {
        match (self.first(), self.position()) {
            (Some(first), Some((id, end))) => format!("offsets {first}..{end} (now {id})"),
            _ => "nothing".into(),
        }
    }

    /// At most `n` bytes from `offset` out of the newest bytes kept in
    /// memory (checked as they were appended), when they hold `offset`;
    /// `None`: plan a read of the file ([`Log::plan`]). Never past the
    /// current id's span: the memory holds that id's bytes only.
    pub fn read_tail(&self, offset: u64, n: usize) -> Option<Vec<u8>> {
        self.tail.read(offset, n)
    }

    /// Plans a read of the records from `offset` on (the first may start
    /// before it), within one segment.
    pub fn plan(&self, offset: u64) -> Result<ReadPlan, LogError> {
        let seg = self
            .segments
            .iter()
            .find(|s| s.start <= offset && offset < s.end)
            .ok_or_else(|| LogError::NotHeld {
                replid: String::new(),
                offset,
                held: self.describe(),
            })?;
        Ok(seg.plan(offset))
    }

    /// Removes whole old segments past `retain` (bytes or age), never one
    /// holding offsets at or after `floor` (what offered snapshots still
    /// need) and never the newest. Returns how many went.
    pub fn trim(&mut self, floor: u64) -> Result<usize, LogError> {
        let now = SystemTime::now();
        let mut total = self.bytes();
        let mut removed = 0;
        while self.segments.len() > 1 {
            let s = &self.segments[0];
            let old = now
                .duration_since(s.modified)
                .is_ok_and(|age| age > self.cfg.retain_age);
            if s.end > floor || !(total > self.cfg.retain.as_u64() || old) {
                break;
            }
            std::fs::remove_file(&s.path).map_err(io(&s.path))?;
            total -= s.bytes;
            self.segments.remove(0);
            removed += 1;
        }
        let first = self.first().unwrap_or(0);
        self.damaged.retain(|d| d.offset >= first);
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;
    use std::io::Write;

    use super::segment::HEADER_LEN;
    use super::*;

    const ID_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const ID_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn cfg(dir: &Path) -> StreamConfig {
        StreamConfig {
            dir: dir.to_path_buf(),
            segment_size: bytesize::ByteSize::b(4096),
            fsync: Fsync::Always,
            ..StreamConfig::default()
        }
    }

    /// A log in `dir` of id A over 100..200, then of B over 200..300.
    fn two_ids(dir: &Path) -> Log {
        let mut log = Log::open(cfg(dir)).unwrap();
        log.restart(ID_A, 100).unwrap();
        fill(&mut log, 2, 50);
        log.switch(ID_B).unwrap();
        fill(&mut log, 2, 50);
        log
    }

    /// Each segment's start offset and file.
    fn segment_starts(log: &Log) -> Vec<(u64, PathBuf)> {
        let starts = log.segments.iter().map(|s| (s.start, s.path.clone()));
        starts.collect()
    }

    /// Appends `n` records of `len` bytes from the log's end.
    fn fill(log: &mut Log, n: usize, len: usize) -> Vec<u8> {
        let mut all = Vec::new();
        for i in 0..n {
            let (_, end) = log.position().unwrap();
            let bytes: Vec<u8> = (0..len).map(|j| (i * 7 + j) as u8).collect();
            all.extend_from_slice(&bytes);
            log.append(end, &bytes).unwrap();
        }
        all
    }

    /// The stream's bytes from `offset` to the end, read back.
    fn read_all(log: &Log, mut offset: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let (_, end) = log.position().unwrap();
        while offset < end {
            let recs = read(&log.plan(offset).unwrap(), 1000).unwrap();
            for r in recs {
                let skip = (offset - r.offset) as usize;
                out.extend_from_slice(&r.bytes[skip..]);
                offset = r.end();
            }
        }
        out
    }

    #[test]
    fn records_read_back_from_any_offset_across_segments_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.position(), None);
        log.restart(ID_A, 1000).unwrap();
        let all = fill(&mut log, 40, 300);
        assert!(log.segments.len() > 2, "{} segments", log.segments.len());
        assert_eq!(log.position(), Some((ID_A.to_string(), 1000 + 12_000)));
        for from in [1000, 1001, 1299, 1300, 5555, 12_999] {
            assert_eq!(
                read_all(&log, from),
                all[(from - 1000) as usize..],
                "from {from}"
            );
        }
        drop(log);
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.position(), Some((ID_A.to_string(), 13_000)));
        assert_eq!(log.first(), Some(1000));
        assert_eq!(read_all(&log, 4321), all[3321..]);
    }

    #[test]
    fn a_record_that_does_not_continue_the_log_or_is_too_large_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        assert!(matches!(log.append(0, &[1]), Err(LogError::Empty)));
        log.restart(ID_A, 0).unwrap();
        fill(&mut log, 1, 10);
        assert!(matches!(
            log.append(11, &[1]),
            Err(LogError::Gap {
                offset: 11,
                end: 10
            })
        ));
        assert!(matches!(
            log.append(10, &vec![0; MAX_RECORD + 1]),
            Err(LogError::TooLarge(_))
        ));
        assert_eq!(log.position().unwrap().1, 10);
    }

    /// Attack: an upstream's empty frames made records that did not move
    /// the log's end; once they filled a segment the next one was to start
    /// at the same offset, its file already existed, and no append at all
    /// succeeded from then on (a restart kept it so).
    #[test]
    fn empty_appends_change_nothing_and_cannot_jam_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        log.restart(ID_A, 0).unwrap();
        fill(&mut log, 1, 10);
        for _ in 0..200 {
            log.append(10, &[]).unwrap();
        }
        assert_eq!(log.segments.len(), 1, "no record, no segment");
        log.append(10, b"after").unwrap();
        assert_eq!(log.position().unwrap().1, 15);
        assert_eq!(read_all(&log, 10), b"after");
    }

    #[test]
    fn a_rollover_flushes_the_segment_it_closes() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(StreamConfig {
            fsync: Fsync::Everysec,
            ..cfg(dir.path())
        })
        .unwrap();
        log.restart(ID_A, 0).unwrap();
        fill(&mut log, 30, 300);
        assert!(log.segments.len() > 2);
        let closed = log.segments[log.segments.len() - 2].end;
        assert!(log.synced() >= closed, "{} < {closed}", log.synced());
    }

    #[test]
    fn a_torn_tail_is_cut_and_a_damaged_record_is_never_served() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        log.restart(ID_A, 0).unwrap();
        let all = fill(&mut log, 30, 300);
        let newest = log.segments.last().unwrap().path.clone();
        let oldest = log.segments[0].path.clone();
        drop(log);
        // A crash mid-write: half a record at the end of the newest.
        let mut f = OpenOptions::new().append(true).open(&newest).unwrap();
        let mut torn = Vec::new();
        Record::new(9000, vec![5; 300]).encode(&mut torn);
        f.write_all(&torn[..100]).unwrap();
        drop(f);
        // A flipped byte in the middle of an older segment.
        let mut b = std::fs::read(&oldest).unwrap();
        b[HEADER_LEN + RECORD_HEADER + 300 + RECORD_HEADER + 17] ^= 1;
        std::fs::write(&oldest, b).unwrap();
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.position().unwrap().1, 9000, "the torn record is cut");
        assert_eq!(read_all(&log, 6000), all[6000..]);
        // The damaged record (offset 300) is refused; the one before reads.
        let first = read(&log.plan(0).unwrap(), 100).unwrap();
        assert_eq!(first.len(), 1);
        let err = read(&log.plan(0).unwrap(), 1000).unwrap_err();
        assert!(
            matches!(err, LogError::Corrupt { offset: 300, .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("fetched again from upstream"),
            "{err}"
        );
    }

    /// Attack (review): a damaged record cut the log back to it, every
    /// intact segment after it with it.
    #[test]
    fn a_damaged_record_is_mended_in_place_and_the_records_after_it_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        log.restart(ID_A, 0).unwrap();
        let all = fill(&mut log, 30, 300);
        let before = segment_starts(&log);
        let oldest = log.segments[0].path.clone();
        let mut b = std::fs::read(&oldest).unwrap();
        let at = HEADER_LEN + RECORD_HEADER + 300 + RECORD_HEADER + 17;
        b[at] ^= 1;
        std::fs::write(&oldest, &b).unwrap();
        let err = read(&log.plan(0).unwrap(), 1000).unwrap_err();
        assert!(matches!(err, LogError::Corrupt { offset: 300, .. }));
        assert!(log.mark_damaged(300).unwrap());
        assert!(log.mark_damaged(300).unwrap(), "marked once");
        assert_eq!(log.damaged().len(), 1);
        assert_eq!((log.damaged()[0].offset, log.damaged()[0].len), (300, 300));
        assert_eq!(log.readable_from(0), 300, "readers stop before it");
        assert_eq!(log.readable_from(450), 0);
        assert_eq!(log.readable_from(600), u64::MAX, "and go on after it");
        assert_eq!(read_all(&log, 600), all[600..]);
        // Bytes that do not match its hash are never written back.
        let mut wrong = all[300..600].to_vec();
        wrong[5] ^= 1;
        assert!(matches!(
            log.mend(300, &wrong),
            Err(LogError::Corrupt { offset: 300, .. })
        ));
        assert!(log.mend(300, &all[300..599]).is_err(), "nor too few");
        assert_eq!(std::fs::read(&oldest).unwrap(), b, "the file as it was");
        assert!(log.mend(300, &all[300..600]).unwrap());
        assert!(!log.mend(300, &all[300..600]).unwrap(), "once");
        assert!(log.damaged().is_empty());
        assert_eq!(read_all(&log, 0), all, "the log whole again");
        assert_eq!(segment_starts(&log), before, "every segment kept");
        // A record whose header is damaged cannot be marked: its length
        // is not known (the log is cut back to it instead).
        let whole = std::fs::read(&oldest).unwrap();
        let mut b = whole.clone();
        b[HEADER_LEN + RECORD_HEADER + 300 + 2] ^= 1;
        std::fs::write(&oldest, &b).unwrap();
        assert!(!log.mark_damaged(300).unwrap());
        assert!(log.damaged().is_empty());
        // A cut at a damaged record forgets it.
        std::fs::write(&oldest, &whole).unwrap();
        assert!(log.mark_damaged(900).unwrap());
        log.cut(900).unwrap();
        assert!(log.damaged().is_empty());
    }

    /// Attack (review): a flipped bit in a record header's length marked a
    /// "record" far longer than any, which readers then waited before and
    /// the mend fetched, many MiB a try.
    #[test]
    fn a_record_header_longer_than_any_record_is_not_one_to_mend() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(StreamConfig {
            segment_size: bytesize::ByteSize::mib(64),
            fsync: Fsync::Everysec,
            ..cfg(dir.path())
        })
        .unwrap();
        log.restart(ID_A, 0).unwrap();
        fill(&mut log, 4000, 300);
        let path = log.segments[0].path.clone();
        let mut b = std::fs::read(&path).unwrap();
        // The second record's length, 300, with bit 20 set.
        b[HEADER_LEN + RECORD_HEADER + 300 + 8 + 1] ^= 0x10;
        std::fs::write(&path, &b).unwrap();
        assert!(!log.mark_damaged(300).unwrap());
        assert!(log.damaged().is_empty());
    }

    /// Attack (review): one flipped bit in an older segment's record
    /// header failed `Log::open`, and the agent with it, until someone
    /// deleted files by hand.
    #[test]
    fn a_damaged_older_segment_is_set_aside_at_open_and_the_newer_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        log.restart(ID_A, 0).unwrap();
        let all = fill(&mut log, 50, 300);
        let starts = segment_starts(&log);
        assert!(starts.len() > 3);
        drop(log);
        // The offset field of the oldest segment's second record header.
        let oldest = &starts[0].1;
        let mut b = std::fs::read(oldest).unwrap();
        b[HEADER_LEN + RECORD_HEADER + 300 + 3] ^= 1;
        std::fs::write(oldest, b).unwrap();
        let log = Log::open(cfg(dir.path())).unwrap();
        let kept = starts[1].0;
        assert_eq!(log.first(), Some(kept));
        assert_eq!(read_all(&log, kept), all[kept as usize..]);
        let aside = log.set_aside().to_vec();
        assert_eq!(aside.len(), 1, "{aside:?}");
        assert!(aside[0].exists() && !oldest.exists(), "{aside:?}");
        drop(log);
        // Reopened, it says so still (until the operator removes the file).
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.set_aside(), aside);
        assert_eq!(log.first(), Some(kept));
    }

    /// A damaged header of the newest segment, or of one in the middle:
    /// that segment is set aside, the older ones (which no longer reach
    /// the rest) go, and the log continues from the end it still holds.
    #[test]
    fn a_damaged_segment_header_is_set_aside_and_the_log_ends_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        log.restart(ID_A, 0).unwrap();
        let all = fill(&mut log, 50, 300);
        let starts = segment_starts(&log);
        let n = starts.len();
        assert!(n > 3);
        drop(log);
        let flip = |path: &Path, at: usize| {
            let mut b = std::fs::read(path).unwrap();
            b[at] ^= 0x10;
            std::fs::write(path, b).unwrap();
        };
        flip(&starts[n - 1].1, 20);
        let mut log = Log::open(cfg(dir.path())).unwrap();
        let end = starts[n - 1].0;
        assert_eq!(log.position(), Some((ID_A.to_string(), end)));
        assert_eq!(read_all(&log, 0), all[..end as usize]);
        log.append(end, &all[end as usize..]).unwrap();
        drop(log);
        flip(&starts[1].1, 20);
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.first(), Some(starts[2].0));
        assert!(!starts[0].1.exists(), "no longer reaches the rest");
        assert_eq!(log.set_aside().len(), 2);
        assert_eq!(read_all(&log, starts[2].0), all[starts[2].0 as usize..]);
    }

    /// An unreadable `history.json` is set aside and the history made
    /// again from the segments' headers, which each name their id.
    #[test]
    fn an_unreadable_history_is_set_aside_and_made_again_from_the_segments() {
        let dir = tempfile::tempdir().unwrap();
        let log = two_ids(dir.path());
        let epochs = log.history().to_vec();
        drop(log);
        std::fs::write(dir.path().join("history.json"), b"{not json").unwrap();
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.history(), epochs);
        assert_eq!(log.set_aside().len(), 1);
        drop(log);
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.history(), epochs, "saved again");
    }

    #[test]
    fn a_cut_at_damage_removes_it_and_what_follows_and_the_log_continues_there() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(cfg(dir.path())).unwrap();
        log.restart(ID_A, 0).unwrap();
        let all = fill(&mut log, 30, 300);
        let segs = log.segments.len();
        assert!(segs > 2);
        // A flipped byte in the second record of the oldest segment.
        let oldest = log.segments[0].path.clone();
        let mut b = std::fs::read(&oldest).unwrap();
        b[HEADER_LEN + RECORD_HEADER + 300 + RECORD_HEADER + 17] ^= 1;
        std::fs::write(&oldest, b).unwrap();
        let Err(LogError::Corrupt { offset, .. }) = read(&log.plan(0).unwrap(), 1000) else {
            panic!("the damage is found")
        };
        log.cut(offset).unwrap();
        assert_eq!(log.position(), Some((ID_A.to_string(), 300)));
        assert_eq!(log.segments.len(), 1, "the segments after it are gone");
        assert_eq!(read_all(&log, 0), all[..300]);
        log.cut(offset).unwrap();
        assert_eq!(
            log.position().unwrap().1,
            300,
            "a second cut changes nothing"
        );
        // The writer fetches it again: the log continues, and reopens whole.
        log.append(300, &all[300..600]).unwrap();
        drop(log);
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(read_all(&log, 0), all[..600]);
    }

    #[test]
    fn a_cut_before_a_change_of_replication_id_forgets_the_new_id() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = two_ids(dir.path());
        // Damage at B's first record keeps B's (empty) segment and id.
        log.cut(200).unwrap();
        assert_eq!(log.position(), Some((ID_B.to_string(), 200)));
        assert_eq!(log.history().len(), 2);
        // Damage in A's span takes B with it.
        log.cut(150).unwrap();
        assert_eq!(log.position(), Some((ID_A.to_string(), 150)));
        assert_eq!(log.replid_at(150), Some(ID_A));
        assert_eq!(log.history().len(), 1);
        drop(log);
        let log = Log::open(cfg(dir.path())).unwrap();
        assert_eq!(log.history().len(), 1, "the history on disk agrees");
        assert_eq!(log.position(), Some((ID_A.to_string(), 150)));
    }

    #[test]
    fn earlier_replication_ids_continue_within_their_span() {
        let dir = tempfile::tempdir().unwrap();
        let log = two_ids(dir.path());
        assert_eq!(
            log.history(),
            [
                Epoch {
                    replid: ID_A.into(),
                    start: 100
                },
                Epoch {
                    replid: ID_B.into(),
                    start: 200
                }
            ]
        );
        log.covers(ID_A, 150).unwrap();
        log.covers(ID_A, 200).unwrap();
        assert!(log.covers(ID_A, 201).is_err(), "A's stream ended at 200");
        log.covers(ID_B, 250).unwrap();
        assert!(log.covers(ID_B, 150).is_err(), "B started at 200");
        assert!(log.covers(ID_A, 99).is_err());
        assert!(log.covers(ID_B, 301).is_err());
        drop(log);
        let log = Log::open(cfg(dir.path())).unwrap();
        log.covers(ID_A, 150).unwrap();
        assert_eq!(log.position(), Some((ID_B.to_string(), 300)));
    }

    #[test]
    fn a_reader_a_little_ahead_on_the_current_id_is_continued_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let log = two_ids(dir.path());
        log.continues(ID_B, 250).unwrap();
        log.continues(ID_B, 301).unwrap();
        log.continues(ID_B, 300 + AHEAD).unwrap();
        assert!(log.continues(ID_B, 301 + AHEAD).is_err(), "too far ahead");
        assert!(
            log.continues(ID_A, 301).is_err(),
            "A's stream ended at 200: past it is another history"
        );
        assert!(log.continues(ID_A, 99).is_err());
    }

    #[test]
    fn retention_keeps_the_newest_segment_and_what_snapshots_need() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cfg(dir.path());
        c.retain = bytesize::ByteSize::b(10_000);
        let mut log = Log::open(c).unwrap();
        log.restart(ID_A, 0).unwrap();
        fill(&mut log, 100, 300);
        let segs = log.segments.len();
        // A snapshot at offset 1000 keeps everything from it.
        assert_eq!(log.trim(1000).unwrap(), 0);
        assert_eq!(log.segments.len(), segs);
        let removed = log.trim(u64::MAX).unwrap();
        assert!(
            removed > 0 && log.bytes() <= 10_000 + 4096,
            "{} bytes",
            log.bytes()
        );
        let first = log.first().unwrap();
        assert!(log.covers(ID_A, first - 1).is_err());
        log.covers(ID_A, first).unwrap();
        assert!(matches!(log.plan(0), Err(LogError::NotHeld { .. })));
    }
}
