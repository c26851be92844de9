//! Page-aligned buffers for the data path.
//!
//! Owns how large byte buffers are allocated: anonymous memory mappings.
//! They are page aligned (what memory registration wants, and what makes the
//! kernel's copies fast), zero-filled lazily by the kernel (a multi-GB
//! snapshot image costs no memset), advised as transparent huge pages when
//! large (much cheaper to fill), and returned to the system when dropped.
//! Heap blocks were not: glibc kept freed multi-MB aligned blocks, and an
//! agent's RSS grew by a buffer with every sync (found by the soak test).
//! Nothing here knows about snapshots.

use std::ops::{Deref, DerefMut};

/// Page size: the alignment of every buffer.
pub const PAGE: usize = 4096;
/// From this size on, buffers are advised as transparent huge pages.
const HUGE: usize = 2 << 20;

/// A page-aligned, zero-initialised byte buffer of its own mapping.
pub struct AlignedBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl AlignedBuf {
    /// A zero-filled buffer of `len` bytes (memory is committed as it is
    /// touched); fails only when the system refuses the mapping.
    pub fn new(len: usize) -> std::io::Result<AlignedBuf> {
        let map = memmap2::MmapMut::map_anon(len.max(1))?;
        if len >= HUGE {
            // Advice only: refused, it just means 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(AlignedBuf { map, len })
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
        self.map.as_ptr()
    }

    /// Mutable start address (for memory registration, and for writers that
    /// fill the buffer while readers see the part already written).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::new(10_000).unwrap();
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        assert_eq!(b.len(), 10_000);
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        let big = AlignedBuf::new(3 << 20).unwrap();
        assert!(big.iter().all(|&x| x == 0));
        assert!(AlignedBuf::new(0).unwrap().is_empty());
    }
}
