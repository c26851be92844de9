//! Bulk-phase planning: how pieces are cut into RDMA Writes, which of
//! them are signalled, how many are in flight, how a replica asks for the
//! pieces it lacks, and how long a wait may take.
//!
//! Pure arithmetic over lengths and counts; the drivers post what it plans.

use std::collections::VecDeque;
use std::time::Duration;

/// One MiB.
const MIB: u64 = 1 << 20;
/// `[transport] chunk_mb` at most: no RDMA Write is ever larger, so a peer
/// that declares more is breaking the protocol.
pub const MAX_CHUNK_MB: u32 = 32;
/// The largest RDMA Write in bytes.
pub const MAX_CHUNK: u64 = MAX_CHUNK_MB as u64 * MIB;

/// Bulk tuning (from `[transport]`, possibly capped for soft devices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BulkParams {
    /// Bytes per RDMA Write.
    pub chunk: u64,
    /// Writes in flight at most.
    pub pipeline: u32,
    /// Signal every n-th Write (and always the last).
    pub signal_batch: u32,
}

impl BulkParams {
    /// From config values (`chunk_mb` in MiB).
    pub fn new(chunk_mb: u32, pipeline: u32, signal_batch: u32) -> BulkParams {
        BulkParams {
            chunk: (chunk_mb.max(1) as u64) * MIB,
            pipeline: pipeline.max(1),
            signal_batch: signal_batch.clamp(1, pipeline.max(1)),
        }
    }

    /// Caps for soft devices (`rxe*`, `siw*`): chunk ≤ 32 MiB, pipeline ≤ 64,
    /// signal batch ≤ 64. The configuration itself is not changed.
    pub fn capped_for_soft(self) -> BulkParams {
        let pipeline = self.pipeline.min(64);
        BulkParams {
            chunk: self.chunk.min(32 * MIB),
            pipeline,
            signal_batch: self.signal_batch.min(64).min(pipeline),
        }
    }
}

impl Default for BulkParams {
    fn default() -> Self {
        BulkParams::new(4, 32, 8)
    }
}

/// Timeout for waits that scale with the snapshot (MRINFO, BDON, RDOK, bulk
/// completion): 300 s plus 1 s per 16 MiB, the extra capped at 3300 s.
pub fn size_scaled_timeout(len: u64) -> Duration {
    Duration::from_secs(300 + (len / (16 * MIB)).min(3300))
}

/// One RDMA Write of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOp {
    /// Index of the write in the plan (also its work-request id).
    pub id: u64,
    /// Offset in the snapshot and in the remote region.
    pub offset: u64,
    pub len: u64,
    /// Whether this write produces a completion.
    pub signaled: bool,
}

/// A completion the plan did not expect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("completion for write {id} out of plan (next signalled write in flight: {expected:?})")]
pub struct UnexpectedCompletion {
    pub id: u64,
    pub expected: Option<u64>,
}

/// Cuts the pieces handed to it into chains of writes, keeping at most
/// `pipeline` writes in flight. Every `signal_batch`-th write and the last
/// write of each piece are signalled, so the last write posted always is.
#[derive(Debug, Clone)]
pub struct WritePlanner {
    params: BulkParams,
    /// Pieces not fully posted: index, next offset, end.
    pieces: VecDeque<(u32, u64, u64)>,
    /// Next write id.
    next: u64,
    /// Writes known complete (all ids below this).
    completed: u64,
    /// Signalled writes in flight, oldest first.
    signaled: VecDeque<u64>,
}

impl WritePlanner {
    pub fn new(params: BulkParams) -> WritePlanner {
        WritePlanner {
            params,
            pieces: VecDeque::new(),
            next: 0,
            completed: 0,
            signaled: VecDeque::new(),
        }
    }

    /// Queues the `len` bytes of piece `index` at `offset`.
    pub fn push(&mut self, index: u32, offset: u64, len: u64) {
        self.pieces.push_back((index, offset, offset + len));
    }

    /// The writes to post now, filling the pipeline: one linked chain per
    /// piece, each with the piece's index when the chain ends it (so its
    /// PDON can follow at once).
    pub fn next_chains(&mut self) -> Vec<(Vec<WriteOp>, Option<u32>)> {
        let mut room = self.params.pipeline as u64 - (self.next - self.completed);
        let mut chains = Vec::new();
        let mut chain = Vec::new();
        while room > 0 {
            let Some((index, offset, end)) = self.pieces.front_mut() else {
                break;
            };
            let len = self.params.chunk.min(*end - *offset);
            let last = *offset + len == *end;
            let id = self.next;
            chain.push(WriteOp {
                id,
                offset: *offset,
                len,
                signaled: last || (id + 1).is_multiple_of(self.params.signal_batch as u64),
            });
            *offset += len;
            if chain.last().is_some_and(|w: &WriteOp| w.signaled) {
                self.signaled.push_back(id);
            }
            self.next += 1;
            room -= 1;
            if last {
                chains.push((std::mem::take(&mut chain), Some(*index)));
                self.pieces.pop_front();
            }
        }
        if !chain.is_empty() {
            chains.push((chain, None));
        }
        chains
    }

    /// Records the completion of signalled write `id`: on a reliable
    /// connection every earlier write is complete too.
    pub fn complete(&mut self, id: u64) -> Result<(), UnexpectedCompletion> {
        let expected = self.signaled.front().copied();
        if expected != Some(id) {
            return Err(UnexpectedCompletion { id, expected });
        }
        self.signaled.pop_front();
        self.completed = id + 1;
        Ok(())
    }

    /// Nothing queued and nothing in flight.
    pub fn idle(&self) -> bool {
        self.pieces.is_empty() && self.completed == self.next
    }
}

/// The ranges `(first, count)` of the pieces `wanted` says are needed, at
/// most `max` of them: beyond that, the closest ranges are merged (asking
/// again for the few verified pieces between them, which is harmless).
pub fn need_ranges(wanted: impl IntoIterator<Item = bool>, max: usize) -> Vec<(u32, u32)> {
    let wanted = wanted.into_iter().enumerate().filter(|&(_, w)| w);
    let mut ranges = runs(wanted.map(|(i, _)| i as u32));
    while ranges.len() > max.max(1) {
        // Merge across the smallest gap.
        let k = (1..ranges.len())
            .min_by_key(|&k| ranges[k].0 - (ranges[k - 1].0 + ranges[k - 1].1))
            .expect("at least two ranges");
        let (first, _) = ranges[k - 1];
        let (f, c) = ranges.remove(k);
        ranges[k - 1].1 = f + c - first;
    }
    ranges
}

/// Pieces (ascending) as NEED ranges, one range per run of consecutive
/// pieces.
pub fn runs(pieces: impl IntoIterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for i in pieces {
        match ranges.last_mut() {
            Some((first, count)) if *first + *count == i => *count += 1,
            _ => ranges.push((i, 1)),
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `pieces` of `size` bytes (the last `total % size`), completes
    /// each signalled write as soon as it is posted's turn; returns (writes,
    /// signalled, most in flight) and checks the bytes are covered once.
    fn run_plan(total: u64, size: u64, params: BulkParams) -> (u64, u64, usize) {
        let mut p = WritePlanner::new(params);
        let count = total.div_ceil(size);
        for i in 0..count {
            p.push(i as u32, i * size, size.min(total - i * size));
        }
        let (mut posted, mut signaled, mut max_in_flight) = (0u64, 0u64, 0usize);
        let mut in_flight = VecDeque::new();
        let mut expect_offset = 0;
        let mut done_pieces = Vec::new();
        loop {
            let chains = p.next_chains();
            done_pieces.extend(chains.iter().filter_map(|(_, piece)| *piece));
            for w in chains.into_iter().flat_map(|(chain, _)| chain) {
                assert_eq!(w.offset, expect_offset, "contiguous");
                expect_offset += w.len;
                posted += 1;
                signaled += w.signaled as u64;
                in_flight.push_back(w);
            }
            max_in_flight = max_in_flight.max(in_flight.len());
            let Some(pos) = in_flight.iter().position(|w| w.signaled) else {
                break;
            };
            let w = in_flight[pos];
            in_flight.drain(..=pos);
            p.complete(w.id).unwrap();
        }
        assert!(
            p.idle() && in_flight.is_empty(),
            "the last write is signalled"
        );
        assert_eq!(expect_offset, total);
        assert_eq!(done_pieces, (0..count as u32).collect::<Vec<_>>());
        (posted, signaled, max_in_flight)
    }

    #[test]
    fn one_gib_in_16_mib_pieces_at_defaults() {
        // 256 writes; every 8th and every piece's 4th: 64 signalled.
        assert_eq!(
            run_plan(1 << 30, 16 * MIB, BulkParams::default()),
            (256, 64, 32)
        );
    }

    #[test]
    fn odd_sizes_and_uneven_batches() {
        for (total, size, params) in [
            (1, MIB, BulkParams::new(1, 1, 1)),
            (MIB + 1, MIB, BulkParams::new(1, 10, 8)),
            (37 * MIB + 5, 2 * MIB, BulkParams::new(4, 10, 3)),
            (5 * MIB, 16 * MIB, BulkParams::new(32, 64, 64)),
        ] {
            let (posted, _, max) = run_plan(total, size, params);
            let per_piece = size.div_ceil(params.chunk.min(size));
            assert!(posted >= total.div_ceil(params.chunk));
            assert!(posted <= total.div_ceil(size) * per_piece);
            assert!(max <= params.pipeline as usize);
        }
        let mut empty = WritePlanner::new(BulkParams::default());
        assert!(empty.next_chains().is_empty());
        assert!(empty.idle());
    }

    #[test]
    fn out_of_order_completion_is_refused() {
        let mut p = WritePlanner::new(BulkParams::default());
        p.push(0, 0, 64 * MIB);
        p.next_chains();
        assert!(p.complete(3).is_err(), "unsignalled write");
        assert!(p.complete(15).is_err(), "skips the first signalled write");
        p.complete(7).unwrap();
        assert!(p.complete(7).is_err(), "twice");
    }

    #[test]
    fn each_chain_ends_at_most_one_piece() {
        let mut p = WritePlanner::new(BulkParams::new(1, 8, 8));
        p.push(0, 0, 2 * MIB);
        p.push(1, 2 * MIB, 3 * MIB);
        p.push(2, 5 * MIB, 4 * MIB);
        let chains = p.next_chains();
        let shape: Vec<(usize, Option<u32>)> =
            chains.iter().map(|(c, piece)| (c.len(), *piece)).collect();
        // Pipeline of 8: pieces 0 and 1 whole, three writes of piece 2.
        assert_eq!(shape, vec![(2, Some(0)), (3, Some(1)), (3, None)]);
    }

    #[test]
    fn need_ranges_are_exact_until_merged() {
        let bits = |s: &str| s.chars().map(|c| c == '1').collect::<Vec<_>>();
        assert_eq!(need_ranges(bits("0110011"), 8), vec![(1, 2), (5, 2)]);
        assert_eq!(need_ranges(bits("0000"), 8), vec![]);
        assert_eq!(need_ranges(bits("1111"), 8), vec![(0, 4)]);
        // Three ranges into two: the smallest gap (one piece) goes.
        assert_eq!(need_ranges(bits("1000101"), 2), vec![(0, 1), (4, 3)]);
        let many: Vec<bool> = (0..1000).map(|i| i % 3 == 0).collect();
        let r = need_ranges(many.iter().copied(), 60);
        assert_eq!(r.len(), 60);
        for (i, want) in many.iter().enumerate() {
            if *want {
                assert!(r.iter().any(|&(f, c)| (f..f + c).contains(&(i as u32))));
            }
        }
    }

    #[test]
    fn soft_caps_and_timeouts() {
        let big = BulkParams::new(32, 1024, 512);
        assert_eq!(
            big.capped_for_soft(),
            BulkParams {
                chunk: 32 * MIB,
                pipeline: 64,
                signal_batch: 64
            }
        );
        assert_eq!(
            BulkParams::default().capped_for_soft(),
            BulkParams::default()
        );
        assert_eq!(size_scaled_timeout(0), Duration::from_secs(300));
        assert_eq!(size_scaled_timeout(1 << 30), Duration::from_secs(364));
        assert_eq!(size_scaled_timeout(u64::MAX), Duration::from_secs(3600));
    }
}
