//! Moving received bytes from a socket into a file inside the kernel.
//!
//! Owns the pipe a plain TCP replica session receives through: `splice`
//! takes the socket's buffers into the pipe and the pipe's pages into the
//! staging file, so the bytes are copied once (into the page cache) instead
//! of twice (`recv` into a buffer, `pwrite` out of it). The replica then
//! checks them where they landed (see `sync::receive`).

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Bytes the pipe holds at most: one splice's worth, small enough that the
/// page-cache pages just written are still in the CPU's cache when checked.
pub const PIPE_BYTES: usize = 1 << 20;

/// A pipe between a socket and a file.
pub struct Pipe {
    read: File,
    write: OwnedFd,
    /// What the kernel granted (at least a page).
    capacity: usize,
}

impl Pipe {
    /// A pipe of up to [`PIPE_BYTES`] (less when the system's pipe limit is lower).
    pub fn new() -> std::io::Result<Pipe> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 fills the two descriptors, which we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: just created and owned by nothing else.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: plain fcntl on our descriptor. A refusal (over
        // /proc/sys/fs/pipe-max-size for an unprivileged user) keeps the default.
        let granted = unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int) };
        let capacity = match granted {
            n if n > 0 => n as usize,
            // SAFETY: as above.
            _ => unsafe { libc::fcntl(fds[1], libc::F_GETPIPE_SZ) }.max(4096) as usize,
        };
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }

    /// Bytes one [`Pipe::fill_from`] may take.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Moves up to `max` bytes (at most the capacity) from `socket` into
    /// the empty pipe; blocks like `recv` (the socket's receive timeout
    /// applies). `Ok(0)` is the peer's orderly close.
    pub fn fill_from(&self, socket: RawFd, max: usize) -> std::io::Result<usize> {
        let want = max.min(self.capacity);
        // SAFETY: both descriptors are open; no offsets (a socket and a pipe).
        let n = unsafe {
            libc::splice(
                socket,
                std::ptr::null_mut(),
                self.write.as_raw_fd(),
                std::ptr::null_mut(),
                want,
                libc::SPLICE_F_MOVE,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Moves the `n` bytes the pipe holds into `file` at `offset`. The
    /// pipe is empty afterwards also when this fails (what the file did not
    /// take is thrown away).
    pub fn drain_to(&self, file: &File, offset: u64, n: usize) -> std::io::Result<()> {
        let mut off = offset as libc::off_t;
        let mut left = n;
        while left > 0 {
            // SAFETY: both descriptors are open; the kernel advances `off`.
            let m = unsafe {
                libc::splice(
                    self.read.as_raw_fd(),
                    std::ptr::null_mut(),
                    file.as_raw_fd(),
                    &mut off,
                    left,
                    libc::SPLICE_F_MOVE,
                )
            };
            let e = match m {
                m if m > 0 => {
                    left -= m as usize;
                    continue;
                }
                0 => std::io::ErrorKind::WriteZero.into(),
                _ => std::io::Error::last_os_error(),
            };
            if e.kind() != std::io::ErrorKind::Interrupted {
                self.discard(left)?;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Reads the `n` bytes the pipe holds into `buf` (which must be that long).
    pub fn read_into(&self, buf: &mut [u8]) -> std::io::Result<()> {
        (&self.read).read_exact(buf)
    }

    /// Throws away `n` bytes the pipe holds.
    pub fn discard(&self, mut n: usize) -> std::io::Result<()> {
        let mut scratch = [0u8; 64 << 10];
        while n > 0 {
            let k = n.min(scratch.len());
            (&self.read).read_exact(&mut scratch[..k])?;
            n -= k;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    #[test]
    fn socket_bytes_reach_the_file_at_the_offset_through_the_pipe() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let sender = {
            let data = data.clone();
            std::thread::spawn(move || tx.write_all(&data).unwrap())
        };
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        let pipe = Pipe::new().unwrap();
        let mut got = 0;
        while got < data.len() {
            let n = pipe.fill_from(rx.as_raw_fd(), data.len() - got).unwrap();
            assert!(n > 0 && n <= pipe.capacity());
            pipe.drain_to(&file, 7 + got as u64, n).unwrap();
            got += n;
        }
        sender.join().unwrap();
        let mut back = vec![0u8; data.len()];
        file.read_exact_at(&mut back, 7).unwrap();
        assert_eq!(back, data);
    }
}
