//! File-system steps that make writes durable, and free space.
//!
//! Owns fsync of a directory (so a rename in it survives a crash), writing
//! a small file atomically and durably (temp file, fsync, rename, fsync of
//! the directory), and how many bytes an unprivileged writer may still use.
//! Errors are plain `io::Error`s; callers name the file and the step.

use std::fs::File;
use std::io::Write;
use std::path::Path;

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
    (temp_prefix, temp_suffix): (&str, &str),
    mode: u32,
) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(temp_prefix)
        .suffix(temp_suffix)
        .tempfile_in(dir)?;
    tmp.write_all(contents)?;
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
