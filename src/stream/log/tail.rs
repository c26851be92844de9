//! The log's newest bytes in memory: a copy of what was last appended
//! under the current replication id (checked against its hash as it was
//! appended), so readers at or near the log's end are served without a
//! file read or the blocking pool. Bounded: it keeps at least the newest
//! `[stream] memory_tail` bytes and never more than twice that; the files
//! serve readers further behind.

/// A copy of the log's newest bytes, `start..start + bytes.len()` (the
/// log's end), all under one replication id.
#[derive(Debug)]
pub struct Tail {
    /// The newest bytes it keeps at least (0: none).
    keep: usize,
    start: u64,
    bytes: Vec<u8>,
}

impl Tail {
    /// An empty tail at `end` that keeps at least the newest `keep` bytes.
    pub fn new(keep: usize, end: u64) -> Tail {
        Tail {
            keep,
            start: end,
            bytes: Vec::new(),
        }
    }

    /// An empty tail at `end`: what follows is appended from there (a new
    /// id, a log started over, or cut back).
    pub fn reset(&mut self, end: u64) {
        self.start = end;
        self.bytes.clear();
    }

    /// Appends `bytes`, which start at the tail's end; drops the oldest
    /// beyond the bound.
    pub fn push(&mut self, offset: u64, bytes: &[u8]) {
        if offset != self.end() {
            // Not contiguous: a caller's slip, never served wrong.
            self.reset(offset);
        }
        if self.keep == 0 {
            self.start += bytes.len() as u64;
            return;
        }
        self.bytes.extend_from_slice(bytes);
        if self.bytes.len() > 2 * self.keep {
            let drop = self.bytes.len() - self.keep;
            self.bytes.drain(..drop);
            self.start += drop as u64;
        }
    }

    /// Cuts the tail back to `offset` (empty from there when it held
    /// nothing before it).
    pub fn cut(&mut self, offset: u64) {
        match offset.checked_sub(self.start) {
            Some(keep) if keep as usize <= self.bytes.len() => self.bytes.truncate(keep as usize),
            _ => self.reset(offset),
        }
    }

    /// The offset after the newest byte.
    pub fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    /// At most `n` bytes from `at`, when the tail holds `at` (`None`: read
    /// the file).
    pub fn read(&self, at: u64, n: usize) -> Option<Vec<u8>> {
        let from = at.checked_sub(self.start)? as usize;
        if from >= self.bytes.len() {
            return None;
        }
        let to = self.bytes.len().min(from.saturating_add(n));
        Some(self.bytes[from..to].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_serves_what_it_holds_and_nothing_else() {
        let mut t = Tail::new(1 << 20, 100);
        assert_eq!(t.read(100, 10), None, "empty");
        t.push(100, b"0123456789");
        assert_eq!(t.read(103, 4).as_deref(), Some(&b"3456"[..]));
        assert_eq!(t.read(105, 100).as_deref(), Some(&b"56789"[..]));
        assert_eq!(t.read(99, 4), None, "before it: the file's");
        assert_eq!(t.read(110, 4), None, "at the end: nothing yet");
        t.cut(104);
        assert_eq!(t.end(), 104);
        assert_eq!(t.read(102, 10).as_deref(), Some(&b"23"[..]));
        t.cut(50);
        assert_eq!((t.end(), t.read(50, 1)), (50, None));
        t.push(60, b"x");
        assert_eq!(
            t.read(60, 1).as_deref(),
            Some(&b"x"[..]),
            "a gap starts it over"
        );
    }

    #[test]
    fn the_tail_keeps_at_least_the_newest_bound_and_at_most_twice_it() {
        const KEEP: usize = 8 << 20;
        let mut t = Tail::new(KEEP, 0);
        let chunk = vec![7u8; 1 << 20];
        let mut at = 0;
        for _ in 0..40 {
            t.push(at, &chunk);
            at += chunk.len() as u64;
            assert!(t.bytes.len() >= KEEP.min(at as usize) && t.bytes.len() <= 2 * KEEP);
            assert_eq!(t.end(), at);
        }
        assert!(t.read(at - KEEP as u64, 1).is_some());
        assert!(t.read(at - 2 * KEEP as u64 - 1, 1).is_none());
        let mut none = Tail::new(0, 5);
        none.push(5, b"abc");
        assert_eq!((none.end(), none.read(5, 3)), (8, None), "0 keeps nothing");
    }
}
