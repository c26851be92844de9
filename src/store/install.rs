//! Durable install of a received snapshot (replica side, docs/ARCHITECTURE.md, "Receiving").
//!
//! Owns the temp file in the destination directory: created (and sized)
//! before bytes arrive, written piece by piece at their offsets, then
//! fsync → rename into place → fsync of the directory. Until
//! [`Staging::install`] succeeds, dropping the staging removes the temp
//! file (and its resume journal), so a failed or cancelled sync leaves the
//! previous snapshot untouched and no debris, unless the staging was kept
//! for a sync to resume ([`Staging::keep`]; `journal` sweeps what is not
//! resumed in time).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::snapshot::Format;
use crate::sys::fs;

/// Mode of the files kvsync writes: owner and group only (the KV's
/// group may read them; nobody else).
pub const SNAPSHOT_MODE: u32 = 0o640;

/// Prefix of kvsync's temp files (hidden, so watchers skip them).
pub const TEMP_PREFIX: &str = ".kvsync-recv-";
/// Suffix of kvsync's temp files.
pub const TEMP_SUFFIX: &str = ".partial";
/// Suffix of a temp file's resume journal (`journal`), which takes the
/// temp file's name with this in place of [`TEMP_SUFFIX`].
pub const JOURNAL_SUFFIX: &str = ".journal";
/// Bytes per write into a staging file. Writes of megabytes into the page
/// cache sometimes cost three times the CPU of the same bytes in 64 KiB
/// writes on the benchmark machine (all of it in the kernel's copy into the
/// file's pages); 64 KiB writes were steady.
const WRITE_SLICE: usize = 64 << 10;

/// Why staging or installing failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The destination directory cannot take a temp file.
    #[error("snapshot_dir {dir} is not writable: {source}")]
    NotWritable {
        dir: PathBuf,
        source: std::io::Error,
    },
    /// Writing, syncing or renaming failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// Installing would replace a file kvsync did not write.
    #[error("{0} exists and was not installed by kvsync; refusing to replace it (move it away, or install elsewhere)")]
    Foreign(PathBuf),
    /// Another sync holds this temp file.
    #[error("{0} is being received by another sync")]
    InUse(PathBuf),
}

/// Locks a temp file for the sync that opened it: an exclusive `flock`,
/// held until the last descriptor of this open goes, which every other
/// lookup and sweep (in this process or another) respects.
fn lock(file: &File, path: &Path) -> Result<(), InstallError> {
    file.try_lock().map_err(|e| match e {
        std::fs::TryLockError::WouldBlock => InstallError::InUse(path.to_owned()),
        std::fs::TryLockError::Error(source) => InstallError::Io {
            op: "lock",
            path: path.to_owned(),
            source,
        },
    })
}

/// Whether a running sync holds the temp file `partial`.
pub fn in_use(partial: &Path) -> bool {
    // Dropping the file releases a lock the probe took.
    fs::open_read(partial)
        .is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)))
}

/// A temp file receiving one snapshot.
pub struct Staging {
    dir: PathBuf,
    path: PathBuf,
    file: File,
    written: u64,
    /// Installed, or kept for a sync to resume: not removed on drop.
    keep: bool,
}

impl Staging {
    /// Creates the temp file for sync `id` in `dir` (proves the directory
    /// is writable before any byte moves).
    pub fn create(dir: &Path, id: &str) -> Result<Staging, InstallError> {
        let path = dir.join(format!("{TEMP_PREFIX}{id}{TEMP_SUFFIX}"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(SNAPSHOT_MODE)
            .open(&path)
            .map_err(|source| InstallError::NotWritable {
                dir: dir.to_owned(),
                source,
            })?;
        lock(&file, &path)?;
        Ok(Staging {
            dir: dir.to_owned(),
            path,
            file,
            written: 0,
            keep: false,
        })
    }

    /// Opens the existing temp file `path` (a partial sync to resume);
    /// [`InstallError::InUse`] while another sync holds it.
    pub fn reopen(path: &Path) -> Result<Staging, InstallError> {
        let dir = path.parent().unwrap_or(Path::new(".")).to_owned();
        let file = fs::open_regular(path, OpenOptions::new().read(true).write(true)).map_err(
            |source| InstallError::Io {
                op: "open",
                path: path.to_owned(),
                source,
            },
        )?;
        lock(&file, path)?;
        Ok(Staging {
            dir,
            path: path.to_owned(),
            file,
            written: 0,
            keep: false,
        })
    }

    /// Temp file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sizes the file for `len` bytes (reserving the disk space up front, so
    /// a full disk fails here rather than mid-transfer where possible).
    /// Bytes already in the file stay.
    pub fn prepare(&mut self, len: u64) -> Result<(), InstallError> {
        if len > 0 {
            // SAFETY: plain syscall on an owned fd.
            let r = unsafe {
                use std::os::fd::AsRawFd;
                libc::posix_fallocate(self.file.as_raw_fd(), 0, len as libc::off_t)
            };
            match r {
                0 => {}
                libc::EOPNOTSUPP | libc::EINVAL => {
                    self.file.set_len(len).map_err(|e| self.io("size", e))?
                }
                errno => {
                    return Err(self.io(
                        "reserve space for",
                        std::io::Error::from_raw_os_error(errno),
                    ))
                }
            }
        }
        // A resumed file that was longer keeps nothing past the snapshot.
        if self.file.metadata().map(|m| m.len()).unwrap_or(len) != len {
            self.file.set_len(len).map_err(|e| self.io("size", e))?;
        }
        Ok(())
    }

    /// Writes received bytes at `offset`, [`WRITE_SLICE`] at a time.
    pub fn write_at(&mut self, offset: u64, bytes: &[u8]) -> Result<(), InstallError> {
        for (i, part) in bytes.chunks(WRITE_SLICE).enumerate() {
            self.file
                .write_all_at(part, offset + (i * WRITE_SLICE) as u64)
                .map_err(|e| self.io("write", e))?;
        }
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Moves the `n` received bytes waiting in `pipe` into the file at
    /// `offset`, inside the kernel.
    pub fn splice_at(
        &mut self,
        offset: u64,
        pipe: &crate::sys::splice::Pipe,
        n: usize,
    ) -> Result<(), InstallError> {
        pipe.drain_to(&self.file, offset, n)
            .map_err(|e| self.io("write", e))?;
        self.written += n as u64;
        Ok(())
    }

    /// Counts bytes that reached the file through a shared mapping of it.
    pub fn absorbed(&mut self, len: u64) {
        self.written += len;
    }

    /// The temp file (for a shared mapping of its prepared length).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Bytes written in this session.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Makes what was written durable (before a journal may claim it).
    pub fn sync_data(&self) -> Result<(), InstallError> {
        self.file.sync_data().map_err(|e| self.io("fdatasync", e))
    }

    /// Leaves the temp file in place when dropped, for a sync to resume.
    pub fn keep(mut self) {
        self.keep = true;
    }

    /// fsync → rename to `dir/name` → fsync dir. Returns the final path.
    pub fn install(mut self, name: &str) -> Result<PathBuf, InstallError> {
        self.file.sync_all().map_err(|e| self.io("fsync", e))?;
        let dest = self.dir.join(name);
        std::fs::rename(&self.path, &dest).map_err(|e| self.io("rename", e))?;
        self.keep = true;
        let _ = std::fs::remove_file(journal_path(&self.path));
        sync_dir(&self.dir)?;
        Ok(dest)
    }

    fn io(&self, op: &'static str, source: std::io::Error) -> InstallError {
        InstallError::Io {
            op,
            path: self.path.clone(),
            source,
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.keep {
            discard(&self.path);
        }
    }
}

/// The journal file of the temp file `partial`.
pub fn journal_path(partial: &Path) -> PathBuf {
    let name = partial
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(TEMP_SUFFIX).unwrap_or(&name);
    partial.with_file_name(format!("{stem}{JOURNAL_SUFFIX}"))
}

/// Removes a temp file and its journal.
pub fn discard(partial: &Path) {
    let _ = std::fs::remove_file(partial);
    let _ = std::fs::remove_file(journal_path(partial));
}

/// fsync a directory so a rename in it is durable.
pub fn sync_dir(dir: &Path) -> Result<(), InstallError> {
    fs::sync_dir(dir).map_err(|source| InstallError::Io {
        op: "fsync directory",
        path: dir.to_owned(),
        source,
    })
}

/// Writes `contents` to `path` atomically and durably, through a temp file
/// the watcher and the sweeps know as kvsync's.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), InstallError> {
    fs::write_atomic(path, contents, (TEMP_PREFIX, TEMP_SUFFIX), SNAPSHOT_MODE).map_err(|source| {
        InstallError::Io {
            op: "write atomically",
            path: path.to_owned(),
            source,
        }
    })
}

/// Hidden file in a snapshot directory listing, one per line, the names
/// kvsync installed there: the only existing files an install may replace.
pub const INSTALLED_LIST: &str = ".kvsync-installed";

/// The largest installed list read.
const MAX_INSTALLED_LIST: u64 = 1 << 20;

/// Serialises installs' read-modify-write of the installed list in this process.
static INSTALLED_LIST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The names kvsync installed in `dir`.
fn installed_names(dir: &Path) -> Vec<String> {
    fs::read_regular(&dir.join(INSTALLED_LIST), MAX_INSTALLED_LIST)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The name to install a snapshot under in `dir`: the source's name when it
/// is a plain name with the format's extension (`peer_text::is_plain_name`)
/// that is free or was installed by kvsync, else `snapshot-<seq>.<ext>`.
/// Never a file kvsync did not write: that is refused.
pub fn install_name(
    dir: &Path,
    offered: &str,
    seq: u64,
    format: Format,
) -> Result<String, InstallError> {
    let ours = installed_names(dir);
    let free = |name: &str| ours.iter().any(|n| n == name) || !dir.join(name).exists();
    let ext = format.extension();
    let plain = crate::peer_text::is_plain_name(offered)
        && offered.ends_with(&format!(".{ext}"))
        && !crate::store::watch::is_ignored_name(offered);
    if plain && free(offered) {
        return Ok(offered.to_string());
    }
    let fallback = format!("snapshot-{seq}.{ext}");
    if free(&fallback) {
        Ok(fallback)
    } else {
        Err(InstallError::Foreign(dir.join(fallback)))
    }
}

/// Records `name` in `dir`'s list of installed names (durably).
pub fn remember_installed(dir: &Path, name: &str) -> Result<(), InstallError> {
    let _guard = INSTALLED_LIST_LOCK
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut names = installed_names(dir);
    if names.iter().any(|n| n == name) {
        return Ok(());
    }
    names.push(name.to_string());
    write_atomic(
        &dir.join(INSTALLED_LIST),
        (names.join("\n") + "\n").as_bytes(),
    )
}

/// Checks that a sync could install into `dir` (a temp file can be made).
pub fn check_writable(dir: &Path) -> Result<(), InstallError> {
    tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .suffix(TEMP_SUFFIX)
        .tempfile_in(dir)
        .map(drop)
        .map_err(|source| InstallError::NotWritable {
            dir: dir.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(size: u64, seq: u64) -> Vec<u8> {
        let mut v = Vec::new();
        crate::snapshot::kvr1::GenSpec {
            size,
            seq,
            created_ms: 0,
            seed: 1,
        }
        .write_to(&mut v)
        .unwrap();
        v
    }

    #[test]
    fn staged_snapshot_installs_durably() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = snapshot(300_000, 8);
        let mut s = Staging::create(dir.path(), "abc").unwrap();
        let tmp = s.path().to_owned();
        s.prepare(bytes.len() as u64).unwrap();
        // Writes smaller than a write slice, then larger and not a multiple.
        for size in [7777, WRITE_SLICE + 4465] {
            s.write_at(0, &vec![0xa5; bytes.len()]).unwrap();
            for (i, c) in bytes.chunks(size).enumerate().rev() {
                s.write_at((i * size) as u64, c).unwrap();
            }
        }
        let dest = s.install("snap.kvr1").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dest).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o007, 0, "not world-readable: {mode:o}");
        assert!(!tmp.exists());
    }

    #[test]
    fn dropped_staging_removes_its_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Staging::create(dir.path(), "x").unwrap();
        s.prepare(1000).unwrap();
        s.write_at(0, &[1, 2, 3]).unwrap();
        let tmp = s.path().to_owned();
        assert!(tmp.exists());
        drop(s);
        assert!(!tmp.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn unwritable_dir_is_reported() {
        let err = Staging::create(Path::new("/proc/kvsync-nope"), "x")
            .err()
            .unwrap();
        assert!(err.to_string().contains("not writable"), "{err}");
    }

    #[test]
    fn a_kept_staging_stays_and_reopens_with_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Staging::create(dir.path(), "k").unwrap();
        s.prepare(10).unwrap();
        s.write_at(2, b"abc").unwrap();
        let path = s.path().to_owned();
        s.keep();
        let mut again = Staging::reopen(&path).unwrap();
        again.prepare(10).unwrap();
        assert_eq!(&std::fs::read(&path).unwrap()[2..5], b"abc");
        drop(again);
        assert!(!path.exists());
    }

    #[test]
    fn install_names_are_sanitised() {
        let dir = tempfile::tempdir().unwrap();
        let name = |offered: &str| install_name(dir.path(), offered, 5, Format::Kvr1).unwrap();
        assert_eq!(name("snap-5.kvr1"), "snap-5.kvr1");
        for bad in [
            "",
            "../etc/passwd",
            ".hidden",
            "a/b",
            "temp-1.kvr1",
            "x.replmeta",
            "x.kvr1\r\nFLUSHALL\r\nSET owned 1",
            "nodes.conf",
            "snap.rdb",
        ] {
            assert_eq!(name(bad), "snapshot-5.kvr1", "{bad:?}");
        }
    }

    #[test]
    fn only_files_kvsync_installed_are_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let name = |offered: &str| install_name(dir.path(), offered, 5, Format::Kvr1);
        std::fs::write(dir.path().join("kv.kvr1"), b"the operator's").unwrap();
        assert_eq!(name("kv.kvr1").unwrap(), "snapshot-5.kvr1");
        std::fs::write(dir.path().join("snapshot-5.kvr1"), b"also theirs").unwrap();
        assert!(matches!(name("kv.kvr1"), Err(InstallError::Foreign(_))));
        remember_installed(dir.path(), "kv.kvr1").unwrap();
        remember_installed(dir.path(), "kv.kvr1").unwrap();
        assert_eq!(name("kv.kvr1").unwrap(), "kv.kvr1", "ours may be replaced");
        assert_eq!(installed_names(dir.path()), ["kv.kvr1"]);
    }

    #[test]
    fn a_partial_or_list_that_is_a_link_is_never_opened() {
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"root's own bytes").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join(format!("{TEMP_PREFIX}r{TEMP_SUFFIX}"));
        std::os::unix::fs::symlink(&victim, &partial).unwrap();
        let err = Staging::reopen(&partial).err().expect("a link is refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert!(!in_use(&partial));
        assert_eq!(std::fs::read(&victim).unwrap(), b"root's own bytes");
        // An installed list that is a link is not read.
        let big = outside.path().join("big");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        std::os::unix::fs::symlink(&big, dir.path().join(INSTALLED_LIST)).unwrap();
        assert!(installed_names(dir.path()).is_empty());
    }
}
