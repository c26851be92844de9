//! Bulk-phase planning: how a snapshot is cut into RDMA Writes, which of
//! them are signalled, how many are in flight, and how long a wait may take.
//!
//! Pure arithmetic over lengths and counts; the drivers post what it plans.

use std::time::Duration;

/// One MiB.
const MIB: u64 = 1 << 20;

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

/// Hands out chains of writes, keeping at most `pipeline` in flight.
#[derive(Debug, Clone)]
pub struct WritePlanner {
    total: u64,
    params: BulkParams,
    writes: u64,
    /// Next write to post.
    next: u64,
    /// Writes known complete (all ids below this).
    completed: u64,
}

impl WritePlanner {
    pub fn new(total: u64, params: BulkParams) -> WritePlanner {
        WritePlanner {
            total,
            params,
            writes: total.div_ceil(params.chunk),
            next: 0,
            completed: 0,
        }
    }

    /// Number of writes in the whole plan.
    pub fn total_writes(&self) -> u64 {
        self.writes
    }

    /// Number of signalled writes in the whole plan.
    pub fn total_signaled(&self) -> u64 {
        (0..self.writes).filter(|&i| self.is_signaled(i)).count() as u64
    }

    fn is_signaled(&self, id: u64) -> bool {
        (id + 1).is_multiple_of(self.params.signal_batch as u64) || id + 1 == self.writes
    }

    /// The writes to post now (one linked chain), filling the pipeline.
    pub fn next_chain(&mut self) -> Vec<WriteOp> {
        let room = self.params.pipeline as u64 - (self.next - self.completed);
        let end = (self.next + room).min(self.writes);
        let chain = (self.next..end)
            .map(|id| {
                let offset = id * self.params.chunk;
                WriteOp {
                    id,
                    offset,
                    len: self.params.chunk.min(self.total - offset),
                    signaled: self.is_signaled(id),
                }
            })
            .collect();
        self.next = end;
        chain
    }

    /// Records the completion of signalled write `id`: on a reliable
    /// connection every earlier write is complete too.
    pub fn complete(&mut self, id: u64) -> Result<(), UnexpectedCompletion> {
        let expected = (self.completed..self.next).find(|&i| self.is_signaled(i));
        if expected != Some(id) {
            return Err(UnexpectedCompletion { id, expected });
        }
        self.completed = id + 1;
        Ok(())
    }

    /// Bytes known written.
    pub fn bytes_done(&self) -> u64 {
        (self.completed * self.params.chunk).min(self.total)
    }

    /// Every write completed.
    pub fn done(&self) -> bool {
        self.completed == self.writes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_plan(total: u64, params: BulkParams) -> (u64, u64, usize) {
        let mut p = WritePlanner::new(total, params);
        let (mut posted, mut signaled, mut max_in_flight) = (0u64, 0u64, 0usize);
        let mut in_flight = std::collections::VecDeque::new();
        let mut expect_offset = 0;
        loop {
            for w in p.next_chain() {
                assert_eq!(w.offset, expect_offset, "contiguous");
                expect_offset += w.len;
                posted += 1;
                signaled += w.signaled as u64;
                in_flight.push_back(w);
            }
            max_in_flight = max_in_flight.max(in_flight.len());
            // Complete through the first signalled write in flight.
            let Some(pos) = in_flight.iter().position(|w| w.signaled) else {
                break;
            };
            let w = in_flight[pos];
            in_flight.drain(..=pos);
            p.complete(w.id).unwrap();
            if p.done() {
                break;
            }
        }
        assert!(p.done());
        assert_eq!(expect_offset, total);
        assert_eq!(p.bytes_done(), total);
        (posted, signaled, max_in_flight)
    }

    #[test]
    fn one_gib_at_defaults_is_256_writes_32_signalled() {
        let p = WritePlanner::new(1 << 30, BulkParams::default());
        assert_eq!((p.total_writes(), p.total_signaled()), (256, 32));
        assert_eq!(run_plan(1 << 30, BulkParams::default()), (256, 32, 32));
    }

    #[test]
    fn odd_sizes_and_uneven_batches() {
        for (total, params) in [
            (1, BulkParams::new(1, 1, 1)),
            (MIB + 1, BulkParams::new(1, 10, 8)),
            (37 * MIB + 5, BulkParams::new(4, 10, 3)),
            (5 * MIB, BulkParams::new(32, 64, 64)),
        ] {
            let (posted, _, max) = run_plan(total, params);
            assert_eq!(posted, total.div_ceil(params.chunk));
            assert!(max <= params.pipeline as usize);
        }
        assert_eq!(
            WritePlanner::new(0, BulkParams::default()).total_writes(),
            0
        );
    }

    #[test]
    fn out_of_order_completion_is_refused() {
        let mut p = WritePlanner::new(64 * MIB, BulkParams::default());
        p.next_chain();
        assert!(p.complete(3).is_err(), "unsignalled write");
        assert!(p.complete(15).is_err(), "skips the first signalled write");
        p.complete(7).unwrap();
        assert!(p.complete(7).is_err(), "twice");
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
