//! What a source session sends its bytes from: its image in the shared cache
//! ([`CacheRef`]; RDMA registers it, a relay fills it), or for a TCP session
//! of a file on disk, the file itself ([`SnapshotFile`], sent from the page
//! cache with `sendfile`). A file's descriptor is opened while it has the
//! catalog's size and mtime, and its identity (device, inode, size, mtime,
//! ctime) is checked around every range sent: a file rewritten in place fails
//! the session instead of being served as the offered one.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::store::cache::{open_checked, CacheError, CacheRef};
use crate::store::catalog::CatalogEntry;

/// The bytes an offer holds for its session.
pub enum Served {
    /// An image in the shared cache.
    Image(CacheRef),
    /// The snapshot file (TCP only).
    File(SnapshotFile),
}

impl Served {
    /// The snapshot's length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Served::Image(image) => image.len() as u64,
            Served::File(file) => file.len,
        }
    }

    /// Whether the snapshot is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache image, where the bytes are in memory.
    pub fn image(&self) -> Option<&CacheRef> {
        match self {
            Served::Image(image) => Some(image),
            Served::File(_) => None,
        }
    }
}

/// What identifies one version of a file's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Identity {
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether `now` is still this version. The ctime also moves when the
    /// file is unlinked (a new snapshot renamed over it, as every Redis
    /// save does), which leaves the contents alone: once no name is left,
    /// size and mtime must hold, the ctime not.
    fn holds(&self, now: &std::fs::Metadata) -> bool {
        let now_id = Identity::of(now);
        let unlinked = now.nlink() == 0;
        Identity {
            ctime: if unlinked { self.ctime } else { now_id.ctime },
            ..now_id
        } == *self
    }
}

/// An open snapshot file, as the catalog validated it.
pub struct SnapshotFile {
    file: std::fs::File,
    path: PathBuf,
    len: u64,
    identity: Identity,
}

impl SnapshotFile {
    /// Opens `entry`'s file, which must still have the catalog's size and
    /// mtime, and records its identity.
    pub fn open(entry: &CatalogEntry) -> Result<SnapshotFile, CacheError> {
        let file = open_checked(entry)?;
        let meta = file.metadata().map_err(|source| CacheError::Io {
            path: entry.path.clone(),
            source,
        })?;
        Ok(SnapshotFile {
            file,
            path: entry.path.clone(),
            len: entry.info.size,
            identity: Identity::of(&meta),
        })
    }

    /// The descriptor to send from.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The file's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `Ok` while the file is unchanged since it was opened: call before
    /// and after sending a range of it.
    pub fn check(&self) -> Result<(), CacheError> {
        let meta = self.file.metadata().map_err(|source| CacheError::Io {
            path: self.path.clone(),
            source,
        })?;
        if !self.identity.holds(&meta) {
            return Err(CacheError::Changed {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` (for a send that needs the
    /// bytes themselves, such as a fault hook's damaged copy).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), CacheError> {
        use std::os::unix::fs::FileExt;
        self.file
            .read_exact_at(buf, offset)
            .map_err(|source| CacheError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::kvr1::GenSpec;
    use crate::snapshot::Format;

    fn generated(path: &Path, seed: u64) -> CatalogEntry {
        GenSpec {
            size: 64 << 10,
            seq: 1,
            created_ms: 1,
            seed,
        }
        .write_file(path)
        .unwrap();
        let mtime = std::fs::metadata(path).unwrap().modified().unwrap();
        CatalogEntry::scan(path, Format::Kvr1, 1 << 20, mtime).unwrap()
    }

    fn head(f: &SnapshotFile) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        f.read_at(&mut buf, 0).unwrap();
        buf
    }

    #[test]
    fn a_rewrite_in_place_is_seen_and_a_replacement_is_not_the_file_sent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.kvr1");
        let e = generated(&path, 1);
        let f = SnapshotFile::open(&e).unwrap();
        let offered = head(&f);
        f.check().unwrap();

        // Replaced by rename: the descriptor still reads the offered bytes.
        let other = dir.path().join("new.kvr1");
        generated(&other, 2);
        std::fs::rename(&other, &path).unwrap();
        f.check().unwrap();
        assert_eq!(head(&f), offered);

        // The catalog's old entry no longer opens: its mtime is not the file's.
        if std::fs::metadata(&path).unwrap().modified().unwrap() != e.mtime {
            assert!(matches!(
                SnapshotFile::open(&e),
                Err(CacheError::Changed { .. })
            ));
        }

        // Rewritten in place, same size: the identity check fails.
        let g = SnapshotFile::open(&generated(&path, 3)).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut w| std::io::Write::write_all(&mut w, b"X"))
            .unwrap();
        assert!(matches!(g.check(), Err(CacheError::Changed { .. })));
    }
}
