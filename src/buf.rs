//! Page-aligned heap buffers.
//!
//! Owns the one `unsafe` allocation pattern the data path needs: memory that
//! is page aligned (what memory registration wants, and what makes the
//! kernel's copies fast) and, for snapshot images, filled straight from a file
//! with `pread` without zeroing it first. Nothing here knows about snapshots.

use std::alloc::{self, Layout};
use std::fs::File;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;

/// Page size used for alignment.
pub const PAGE: usize = 4096;

/// A page-aligned, heap-allocated byte buffer whose bytes are always
/// initialised.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    layout: Layout,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), PAGE).expect("buffer size fits a layout")
    }

    /// A zero-filled buffer of `len` bytes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len, layout }
    }

    /// Reads `len` bytes of `file` from offset 0 with `pread`, into memory
    /// that is never zeroed (the kernel writes every byte first).
    pub fn read_file(file: &File, len: usize, chunk: usize) -> std::io::Result<AlignedBuf> {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        // Owned from here on, so an error frees it; bytes are exposed only
        // after every one of them was written.
        let buf = AlignedBuf { ptr, len, layout };
        let mut done = 0usize;
        while done < len {
            let want = (len - done).min(chunk);
            // SAFETY: `ptr + done .. + want` lies inside the allocation.
            let n = unsafe {
                libc::pread(file.as_raw_fd(), ptr.add(done).cast(), want, done as libc::off_t)
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(buf)
    }

    /// Start address (for memory registration).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Mutable start address (for memory registration).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes live at `ptr` (see constructors).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in a constructor.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn aligned_zeroed_and_read() {
        let b = AlignedBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        assert!(b.iter().all(|&x| x == 0));

        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        f.write_all(&data).unwrap();
        let b = AlignedBuf::read_file(&f, data.len(), 4096).unwrap();
        assert_eq!(&b[..], &data[..]);
        assert!(AlignedBuf::read_file(&f, data.len() + 1, 4096).is_err());
        assert_eq!(AlignedBuf::read_file(&f, 0, 4096).unwrap().len(), 0);
    }
}
