//! Whether a snapshot of a given size may be written into a directory:
//! at most `sync.max_snapshot_bytes`, leaving `sync.min_free_after` free.
//! Checked before a byte is written, whoever announced the size (a
//! source's offer, a primary's full resync).

use std::path::{Path, PathBuf};

/// What a snapshot written into `dir` may take.
#[derive(Debug, Clone, Copy)]
pub struct Room<'a> {
    pub max_snapshot_bytes: u64,
    pub min_free_after: u64,
    pub dir: &'a Path,
}

/// Why a snapshot may not be written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoomError {
    /// Larger than this agent accepts.
    #[error("the snapshot of {size} bytes is more than sync.max_snapshot_bytes ({max}); raise it to accept this snapshot")]
    TooLarge { size: u64, max: u64 },
    /// The directory's file system cannot take it and keep its headroom.
    #[error("not enough free space in {}: the snapshot needs {size} bytes, {free} are free and sync.min_free_after keeps {keep} free; free space or lower sync.min_free_after", dir.display())]
    NoRoom {
        dir: PathBuf,
        size: u64,
        free: u64,
        keep: u64,
    },
}

impl Room<'_> {
    /// That a snapshot of `size` bytes fits, the file system having
    /// `free` bytes.
    pub fn fits(&self, size: u64, free: u64) -> Result<(), RoomError> {
        let max = self.max_snapshot_bytes;
        if size > max {
            return Err(RoomError::TooLarge { size, max });
        }
        let keep = self.min_free_after;
        if size.saturating_add(keep) > free {
            return Err(RoomError::NoRoom {
                dir: self.dir.to_owned(),
                size,
                free,
                keep,
            });
        }
        Ok(())
    }
}
