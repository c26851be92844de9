//! A segment file of the stream log, `<start offset>.kvslog`: its header
//! (magic, the start offset, the one replication id its records belong
//! to, a hash of the header), the scan that checks it on open and cuts a
//! torn tail, its index of record positions, and reads of its records
//! ([`ReadPlan`], [`read`]), each checked against its hash.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use tracing::warn;

use super::record::{Record, MAX_RECORD, RECORD_HEADER};
use super::{io, LogError};
use crate::sys::fs::{open_regular, sync_dir};

/// Segment file header: magic, start offset, replication id, header hash.
const MAGIC: &[u8; 8] = b"KVSLOG01";
pub(super) const REPLID_LEN: usize = 40;
pub const HEADER_LEN: usize = 8 + 8 + REPLID_LEN + 16;
/// An index entry at least every this many bytes of a segment.
const INDEX_EVERY: u64 = 64 << 10;
pub(super) const SUFFIX: &str = ".kvslog";

#[derive(Debug)]
pub(super) struct Segment {
    pub(super) path: PathBuf,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) replid: String,
    /// The file's length.
    pub(super) bytes: u64,
    pub(super) modified: SystemTime,
    /// `(offset, file position)` of a record at least every `INDEX_EVERY`.
    pub(super) index: Vec<(u64, u64)>,
}

/// Where a read of the log starts and what it may read, taken under the
/// log's lock and carried out without it ([`read`]).
#[derive(Debug, Clone)]
pub struct ReadPlan {
    path: PathBuf,
    pos: u64,
    /// The offset the plan reads from, and the end of the records planned.
    from: u64,
    end: u64,
}

impl Segment {
    /// Creates the segment of `replid` from `start` in `dir`, its header
    /// on disk, and opens it to append.
    pub(super) fn create(
        dir: &Path,
        replid: &str,
        start: u64,
    ) -> Result<(Segment, File), LogError> {
        let path = dir.join(format!("{start:020}{SUFFIX}"));
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&start.to_be_bytes());
        header.extend_from_slice(replid.as_bytes());
        let hash = blake3::hash(&header);
        header.extend_from_slice(&hash.as_bytes()[..16]);
        let mut file = open_regular(
            &path,
            OpenOptions::new().create_new(true).append(true).mode(0o600),
        )
        .map_err(io(&path))?;
        if let Err(e) = file.write_all(&header).and_then(|()| file.sync_all()) {
            // A full disk: no half-made segment stays to block the next try.
            let _ = std::fs::remove_file(&path);
            return Err(io(&path)(e));
        }
        sync_dir(dir).map_err(io(dir))?;
        let seg = Segment {
            path,
            start,
            end: start,
            replid: replid.to_string(),
            bytes: HEADER_LEN as u64,
            modified: SystemTime::now(),
            index: Vec::new(),
        };
        Ok((seg, file))
    }

    /// Takes note of the record of `offset..end`, written at the file's
    /// end as `len` bytes.
    pub(super) fn appended(&mut self, offset: u64, end: u64, len: usize) {
        if self
            .index
            .last()
            .is_none_or(|&(_, pos)| self.bytes - pos >= INDEX_EVERY)
        {
            self.index.push((offset, self.bytes));
        }
        self.bytes += len as u64;
        self.end = end;
        self.modified = SystemTime::now();
    }

    /// Plans a read of the records from `offset` on (the first may start
    /// before it).
    pub(super) fn plan(&self, offset: u64) -> ReadPlan {
        let at = self.index.partition_point(|&(o, _)| o <= offset);
        let pos = if at == 0 {
            HEADER_LEN as u64
        } else {
            self.index[at - 1].1
        };
        ReadPlan {
            path: self.path.clone(),
            pos,
            from: offset,
            end: self.end,
        }
    }
}

/// Reads whole records of `plan`, from the one holding its offset, up to
/// about `max` bytes; each is checked against its hash.
pub fn read(plan: &ReadPlan, max: usize) -> Result<Vec<Record>, LogError> {
    let gone = |offset| LogError::NotHeld {
        replid: String::new(),
        offset,
        held: "no segment with it any more".into(),
    };
    let file = match File::open(&plan.path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(gone(plan.from)),
        Err(e) => return Err(io(&plan.path)(e)),
    };
    let mut r = BufReader::with_capacity(256 << 10, file);
    r.seek(SeekFrom::Start(plan.pos)).map_err(io(&plan.path))?;
    let (mut out, mut size) = (Vec::new(), 0);
    // The offset the next record must start at (`None`: the first read,
    // at an index entry at or before the plan's offset).
    let mut next: Option<u64> = None;
    while size < max && next.is_none_or(|n| n < plan.end) {
        let at = next.unwrap_or(plan.from);
        let mut h = [0u8; RECORD_HEADER];
        r.read_exact(&mut h)
            .map_err(|e| damaged(&plan.path, at, e))?;
        let (offset, len, hash) = Record::parse_header(&h);
        let in_order = next.map_or(offset <= plan.from, |n| n == offset);
        if len > MAX_RECORD || !in_order {
            return Err(damaged(&plan.path, at, "a record header out of order"));
        }
        next = Some(offset + len as u64);
        if offset + (len as u64) <= plan.from {
            r.seek_relative(len as i64).map_err(io(&plan.path))?;
            continue;
        }
        let mut bytes = vec![0u8; len];
        r.read_exact(&mut bytes)
            .map_err(|e| damaged(&plan.path, offset, e))?;
        let rec = Record {
            offset,
            bytes,
            hash,
        };
        if !rec.verify() {
            return Err(damaged(
                &plan.path,
                offset,
                "its bytes do not match their hash",
            ));
        }
        size += len;
        out.push(rec);
    }
    Ok(out)
}

/// The file position and offset of the last whole record boundary of
/// `seg` at or before `offset`, walking record headers from an index entry.
pub(super) fn cut_point(seg: &Segment, offset: u64) -> Result<(u64, u64), LogError> {
    let at = seg.index.partition_point(|&(o, _)| o <= offset);
    let (mut o, mut pos) = match at {
        0 => (seg.start, HEADER_LEN as u64),
        _ => seg.index[at - 1],
    };
    let mut r = BufReader::new(File::open(&seg.path).map_err(io(&seg.path))?);
    r.seek(SeekFrom::Start(pos)).map_err(io(&seg.path))?;
    while o < offset {
        let mut h = [0u8; RECORD_HEADER];
        if r.read_exact(&mut h).is_err() {
            break;
        }
        let (ro, len, _) = Record::parse_header(&h);
        if ro != o || len > MAX_RECORD || ro + len as u64 > offset {
            break;
        }
        r.seek_relative(len as i64).map_err(io(&seg.path))?;
        pos += (RECORD_HEADER + len) as u64;
        o = ro + len as u64;
    }
    Ok((pos, o))
}

fn damaged(path: &Path, offset: u64, why: impl std::fmt::Display) -> LogError {
    LogError::Corrupt {
        path: path.to_path_buf(),
        offset,
        why: why.to_string(),
    }
}

/// Reads a segment's header and walks its records; `check` hashes each
/// and cuts the file after the last good one (the newest segment).
pub(super) fn scan(path: &Path, check: bool) -> Result<Segment, LogError> {
    let mut file =
        open_regular(path, OpenOptions::new().read(true).write(check)).map_err(io(path))?;
    let meta = file.metadata().map_err(io(path))?;
    let mut r = BufReader::with_capacity(256 << 10, &mut file);
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header)
        .map_err(|e| damaged(path, 0, format!("no whole header: {e}")))?;
    let hash = blake3::hash(&header[..HEADER_LEN - 16]);
    if &header[..8] != MAGIC || header[HEADER_LEN - 16..] != hash.as_bytes()[..16] {
        return Err(damaged(
            path,
            0,
            "not a kvsync stream segment, or its header is damaged",
        ));
    }
    let start = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let replid = String::from_utf8_lossy(&header[16..16 + REPLID_LEN]).into_owned();
    let (mut end, mut pos, mut index) = (start, HEADER_LEN as u64, Vec::new());
    let mut bad = None;
    loop {
        let mut h = [0u8; RECORD_HEADER];
        match r.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                if pos != meta.len() {
                    bad = Some("a torn record header");
                }
                break;
            }
            Err(e) => return Err(io(path)(e)),
        }
        let (o, len, hash) = Record::parse_header(&h);
        if o != end || len > MAX_RECORD || pos + (RECORD_HEADER + len) as u64 > meta.len() {
            bad = Some("a torn or out-of-order record");
            break;
        }
        if check {
            let mut bytes = vec![0u8; len];
            r.read_exact(&mut bytes).map_err(io(path))?;
            if !(Record {
                offset: o,
                bytes,
                hash,
            })
            .verify()
            {
                bad = Some("a record whose bytes do not match their hash");
                break;
            }
        } else {
            r.seek_relative(len as i64).map_err(io(path))?;
        }
        if index.last().is_none_or(|&(_, p)| pos - p >= INDEX_EVERY) {
            index.push((o, pos));
        }
        pos += (RECORD_HEADER + len) as u64;
        end = o + len as u64;
    }
    drop(r);
    if let Some(why) = bad {
        if !check {
            return Err(damaged(path, end, why));
        }
        warn!(segment = %path.display(), "the log's newest segment ends in {why} at offset {end}; it is cut there");
        file.set_len(pos).map_err(io(path))?;
        file.sync_all().map_err(io(path))?;
    }
    Ok(Segment {
        path: path.to_path_buf(),
        start,
        end,
        replid,
        bytes: pos,
        modified: meta.modified().unwrap_or(SystemTime::now()),
        index,
    })
}
