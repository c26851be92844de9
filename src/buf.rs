//! Page-aligned heap buffers.
//!
//! Owns the one `unsafe` allocation pattern the data path needs: memory that
//! is page aligned (what memory registration wants, and what makes the
//! kernel's copies fast) and, for snapshot images, memory that is not zeroed
//! first because a file is read straight into it. Nothing here knows about
//! snapshots.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};

/// Page size used for alignment.
pub const PAGE: usize = 4096;
/// Huge-page size: alignment of large buffers.
const HUGE: usize = 2 << 20;

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

    /// A buffer of `len` bytes whose contents are NOT initialised (no
    /// memset of a multi-GB image). Large buffers are 2 MiB aligned and
    /// advised as huge pages, which makes filling them much cheaper.
    ///
    /// # Safety
    /// No byte may be read (through `Deref`, or `as_ptr`) before it was
    /// written through `as_mut_ptr`.
    pub unsafe fn uninit(len: usize) -> AlignedBuf {
        let align = if len >= HUGE { HUGE } else { PAGE };
        let layout = Layout::from_size_align(len.max(1), align).expect("buffer size fits a layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        if len >= HUGE {
            // Advice only: failure just means 4 KiB pages.
            // SAFETY: the range is our own allocation.
            unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
        }
        AlignedBuf { ptr, len, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    #[test]
    fn aligned_zeroed_and_uninit() {
        let b = AlignedBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        assert!(b.iter().all(|&x| x == 0));
        // SAFETY: written before read.
        let mut big = unsafe { AlignedBuf::uninit(3 << 20) };
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        unsafe { std::ptr::write_bytes(big.as_mut_ptr(), 7, big.len()) };
        assert!(big.iter().all(|&x| x == 7));
    }
}
