//! A damaged record of the log awaiting its bytes again ([`Damaged`]):
//! where it lies in its segment, the hash its bytes must match, and
//! writing the bytes fetched again from upstream back in its place, so
//! the damage costs the damaged record alone and the records after it
//! stay as they are.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::record::{hashes_to, Record, MAX_RECORD, RECORD_HEADER};
use super::segment::{cut_point, Segment};
use super::{io, LogError};
use crate::sys::fs::open_regular;

/// A record whose bytes no longer match their hash: readers stop before
/// it until it is mended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damaged {
    /// The stream's bytes `offset+1 ..= offset+len`.
    pub offset: u64,
    pub len: u64,
    hash: [u8; 32],
    path: PathBuf,
    /// Where its bytes start in the file.
    pos: u64,
}

impl Damaged {
    /// The record of `seg` that starts at `offset`, found by walking the
    /// record headers; `None` when no whole header starts there (the
    /// damage hides where the record starts).
    pub(super) fn find(seg: &Segment, offset: u64) -> Result<Option<Damaged>, LogError> {
        let (pos, at) = cut_point(seg, offset)?;
        if at != offset {
            return Ok(None);
        }
        let file = std::fs::File::open(&seg.path).map_err(io(&seg.path))?;
        let mut h = [0u8; RECORD_HEADER];
        if file.read_exact_at(&mut h, pos).is_err() {
            return Ok(None);
        }
        let (o, len, hash) = Record::parse_header(&h);
        if o != offset || len > MAX_RECORD || offset + len as u64 > seg.end {
            return Ok(None);
        }
        Ok(Some(Damaged {
            offset,
            len: len as u64,
            hash,
            path: seg.path.clone(),
            pos: pos + RECORD_HEADER as u64,
        }))
    }

    /// The offset after its last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// Writes `bytes`, fetched again, in the record's place, once they
    /// match the record's hash, and reads them back to check that they
    /// hold there.
    pub(super) fn mend(&self, bytes: &[u8]) -> Result<(), LogError> {
        let holds = |bytes: &[u8]| {
            bytes.len() as u64 == self.len && hashes_to(self.offset, bytes, &self.hash)
        };
        let wrong = |why: &str| LogError::Corrupt {
            path: self.path.clone(),
            offset: self.offset,
            why: why.to_string(),
        };
        if !holds(bytes) {
            return Err(wrong(
                "the bytes fetched again do not match the record's hash",
            ));
        }
        let file = open_regular(&self.path, OpenOptions::new().read(true).write(true))
            .map_err(io(&self.path))?;
        file.write_all_at(bytes, self.pos)
            .and_then(|()| file.sync_data())
            .map_err(io(&self.path))?;
        let mut back = vec![0u8; bytes.len()];
        file.read_exact_at(&mut back, self.pos)
            .map_err(io(&self.path))?;
        match holds(&back) {
            true => Ok(()),
            false => Err(wrong("the disk does not keep the bytes written back")),
        }
    }
}
