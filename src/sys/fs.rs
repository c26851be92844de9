//! File-system steps that make writes durable, opening files in a
//! directory others may write, and free space.
//!
//! Owns fsync of a directory (so a rename in it survives a crash), writing
//! a small file atomically and durably (temp file, fsync, rename, fsync of
//! the directory), opening and reading only regular files and never
//! through a symbolic link at the last component (or, for the operator's
//! own files, through links but still only regular ones), and how many bytes an
//! unprivileged writer may still use. Errors are plain `io::Error`s;
//! callers name the file and the step.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` with `options`, refusing a symbolic link at the last
/// component (`O_NOFOLLOW`) and anything that is not a regular file (a
/// FIFO or device is not waited on: `O_NONBLOCK`, which regular files
/// ignore). For files in `snapshot_dir`, which the KV's user may write:
/// a planted link never makes the agent read or write elsewhere. A file
/// that `options` creates is created in place, never through a link.
pub fn open_regular(path: &Path, options: &mut OpenOptions) -> std::io::Result<File> {
    let file = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => std::io::Error::other(format!(
                "{} is a symbolic link, which kvsync does not follow",
                path.display()
            )),
            _ => e,
        })?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    Ok(file)
}

/// Opens the regular file `path` to read (see [`open_regular`]).
pub fn open_read(path: &Path) -> std::io::Result<File> {
    open_regular(path, OpenOptions::new().read(true))
}

/// The contents of the regular file `path` (see [`open_regular`]), which
/// must hold at most `max` bytes.
pub fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    read_bounded(open_read(path)?, max)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// The contents of the regular file `file`, which must hold at most `max`
/// bytes.
fn read_bounded(file: File, max: u64) -> std::io::Result<Vec<u8>> {
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let len = meta.len();
    if len > max {
        return Err(std::io::Error::other(format!(
            "holds {len} bytes, more than the {max} it may"
        )));
    }
    let mut out = Vec::with_capacity(len as usize);
    file.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// The contents of `path`, a file the operator names (a password, a
/// certificate), which may be reached through symbolic links (a
/// Kubernetes Secret's `..data` link) but must be a regular file of at
/// most `max` bytes: a FIFO or a device is refused, never waited on or
/// read without end.
pub fn read_operator_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    read_bounded(file, max)
}

/// Whether `path` itself (not what a link names) is a regular file.
pub fn is_regular(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// fsync a directory so a rename in it is durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Bytes an unprivileged writer can still use on `dir`'s file system.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a valid C string and a struct for the kernel to fill.
    if unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs succeeded and filled the struct.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Writes `contents` to `path` atomically and durably, with `mode`: a temp
/// file named `<temp_prefix>…<temp_suffix>` in the same directory, fsync,
/// rename, fsync of the directory.
pub fn write_atomic(
    path: &Path,
    contents: &[u8],
    temp: (&str, &str),
    mode: u32,
) -> std::io::Result<()> {
    write_atomic_as(path, contents, temp, mode, None)
}

/// [`write_atomic`], the file given to `owner` (uid, gid) before it takes
/// its name, when one is given.
pub fn write_atomic_as(
    path: &Path,
    contents: &[u8],
    (temp_prefix, temp_suffix): (&str, &str),
    mode: u32,
    owner: Option<(u32, u32)>,
) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(temp_prefix)
        .suffix(temp_suffix)
        .tempfile_in(dir)?;
    tmp.write_all(contents)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(tmp.as_file(), Some(uid), Some(gid))?;
    }
    tmp.as_file()
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_atomically_with_the_mode_and_leaves_no_temp_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("record");
        write_atomic(&path, b"one", (".tmp-", ".part"), 0o640).unwrap();
        write_atomic(&path, b"two", (".tmp-", ".part"), 0o640).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(free_bytes(dir.path()).unwrap() > 0);
        sync_dir(dir.path()).unwrap();
    }
}
