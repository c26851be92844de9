//! The shared snapshot cache (source side, DESIGN.md §4).
//!
//! Owns loading a snapshot file into one page-aligned heap buffer and sharing
//! it between every session that serves the same file. Entries are keyed by
//! (path, size, mtime): the first acquirer reads the file with `pread`
//! (no `mmap`, no memset), verifies the loaded bytes with the snapshot's own
//! checksum, and concurrent acquirers wait for that one load. A replaced file
//! is a new key, so holders of the old buffer keep reading consistent bytes.
//! The last [`CacheRef`] dropped frees the memory. A memory budget makes new
//! loads wait for space (up to `acquire_timeout`) or fail with a clear error.
//! Registering the buffer with a NIC is the transports' job.

use std::collections::HashMap;
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OnceCell};
use tracing::info;

use crate::buf::AlignedBuf;
use crate::catalog::{system_time_ns, CatalogEntry};
use crate::metrics::Metrics;
use crate::snapshot::{Corruption, Format, Verifier};

/// `pread` size while loading.
const LOAD_CHUNK: usize = 8 << 20;

/// Identity of a loaded snapshot file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i128,
}

impl CacheKey {
    pub fn of(entry: &CatalogEntry) -> CacheKey {
        CacheKey { path: entry.path.clone(), size: entry.info.size, mtime_ns: entry.mtime_ns() }
    }
}

/// Why a snapshot could not be handed out.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The snapshot alone is bigger than the whole budget.
    #[error("snapshot of {size} bytes exceeds the cache memory budget of {budget} bytes (raise cache.memory_budget)")]
    TooLarge { size: u64, budget: u64 },
    /// Other snapshots hold the budget and none was released in time.
    #[error("cache memory budget exhausted: {size} bytes needed, {in_use} of {budget} in use after waiting {waited:?}; retry later")]
    OverBudget { size: u64, in_use: u64, budget: u64, waited: Duration },
    /// The file is no longer the one the catalog offered.
    #[error("{path}: snapshot file changed since it was offered")]
    Changed { path: PathBuf },
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The loaded bytes do not verify.
    #[error("{path}: loaded bytes are not a valid snapshot: {corruption}")]
    Corrupt { path: PathBuf, corruption: Corruption },
}

/// A loaded snapshot image: page aligned, immutable once shared.
pub type SnapshotBuffer = AlignedBuf;

struct Slot {
    refs: usize,
    buffer: Arc<OnceCell<Arc<SnapshotBuffer>>>,
}

#[derive(Default)]
struct State {
    slots: HashMap<CacheKey, Slot>,
    /// Bytes reserved by all slots (loaded or loading).
    reserved: u64,
}

/// The cache. Cheap to share as `Arc<SnapshotCache>`.
pub struct SnapshotCache {
    state: Mutex<State>,
    released: Notify,
    budget: AtomicU64,
    acquire_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl SnapshotCache {
    pub fn new(budget: u64, acquire_timeout: Duration, metrics: Arc<Metrics>) -> Arc<SnapshotCache> {
        Arc::new(SnapshotCache {
            state: Mutex::default(),
            released: Notify::new(),
            budget: AtomicU64::new(budget),
            acquire_timeout,
            metrics,
        })
    }

    /// Changes the memory budget (applies to new loads).
    pub fn set_budget(&self, budget: u64) {
        self.budget.store(budget, Ordering::Relaxed);
        self.released.notify_waiters();
    }

    /// Returns a reference to the loaded snapshot, loading it if needed.
    pub async fn acquire(self: &Arc<Self>, entry: &CatalogEntry) -> Result<CacheRef, CacheError> {
        let key = CacheKey::of(entry);
        let size = key.size;
        let started = tokio::time::Instant::now();
        let deadline = started + self.acquire_timeout;
        let (cell, refs) = loop {
            let released = self.released.notified();
            {
                let mut st = self.state.lock().expect("cache lock");
                if let Some(slot) = st.slots.get_mut(&key) {
                    slot.refs += 1;
                    break (slot.buffer.clone(), slot.refs);
                }
                let budget = self.budget.load(Ordering::Relaxed);
                if size > budget {
                    return Err(CacheError::TooLarge { size, budget });
                }
                if st.reserved + size <= budget {
                    let cell = Arc::new(OnceCell::new());
                    st.slots.insert(key.clone(), Slot { refs: 1, buffer: cell.clone() });
                    st.reserved += size;
                    break (cell, 1);
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(CacheError::OverBudget {
                        size,
                        in_use: st.reserved,
                        budget,
                        waited: started.elapsed(),
                    });
                }
            }
            let _ = tokio::time::timeout_at(deadline, released).await;
        };
        // From here on the reference is counted; dropping `guard` undoes it.
        let guard = Held { cache: self.clone(), key };
        self.publish();
        let loaded_here = std::sync::atomic::AtomicBool::new(false);
        let buffer = cell
            .get_or_try_init(|| {
                loaded_here.store(true, Ordering::Relaxed);
                load(entry.clone())
            })
            .await?
            .clone();
        if loaded_here.into_inner() {
            self.metrics.cache_loads.inc();
        } else {
            self.metrics.cache_hits.inc();
            info!(path = %entry.path.display(), "reusing snapshot buffer ref={refs}");
        }
        Ok(CacheRef { buffer, _held: guard })
    }

    /// Number of loaded or loading entries.
    pub fn entries(&self) -> usize {
        self.state.lock().expect("cache lock").slots.len()
    }

    /// Total references held.
    pub fn refs(&self) -> usize {
        self.state.lock().expect("cache lock").slots.values().map(|s| s.refs).sum()
    }

    fn release(&self, key: &CacheKey) {
        {
            let mut st = self.state.lock().expect("cache lock");
            let slot = st.slots.get_mut(key).expect("released key is present");
            slot.refs -= 1;
            if slot.refs == 0 {
                st.slots.remove(key);
                st.reserved -= key.size;
            }
        }
        self.publish();
        self.released.notify_waiters();
    }

    fn publish(&self) {
        let st = self.state.lock().expect("cache lock");
        self.metrics.cache_bytes.set(st.reserved as i64);
        self.metrics.cache_entries.set(st.slots.len() as i64);
        self.metrics.cache_refs.set(st.slots.values().map(|s| s.refs as i64).sum());
    }
}

/// Counts one reference until dropped.
struct Held {
    cache: Arc<SnapshotCache>,
    key: CacheKey,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.cache.release(&self.key);
    }
}

/// A session's hold on a loaded snapshot; the memory lives while any exists.
pub struct CacheRef {
    buffer: Arc<SnapshotBuffer>,
    _held: Held,
}

impl CacheRef {
    pub fn buffer(&self) -> &Arc<SnapshotBuffer> {
        &self.buffer
    }
}

impl Deref for CacheRef {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buffer
    }
}

/// Reads the file into a new buffer and verifies it.
async fn load(entry: CatalogEntry) -> Result<Arc<SnapshotBuffer>, CacheError> {
    tokio::task::spawn_blocking(move || {
        let path = entry.path.clone();
        let io = |source| CacheError::Io { path: path.clone(), source };
        let file = std::fs::File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let mtime_ns = meta.modified().map(system_time_ns).unwrap_or_default();
        if meta.len() != entry.info.size || mtime_ns != entry.mtime_ns() {
            return Err(CacheError::Changed { path });
        }
        let buffer = AlignedBuf::read_file(&file, entry.info.size as usize, LOAD_CHUNK).map_err(io)?;
        let checksum = verify(entry.format(), &buffer)
            .map_err(|corruption| CacheError::Corrupt { path: path.clone(), corruption })?;
        // Same size and mtime but other bytes: rewritten in place.
        if checksum != entry.info.checksum {
            return Err(CacheError::Changed { path });
        }
        info!(path = %path.display(), bytes = buffer.len(), "snapshot loaded into cache");
        Ok(Arc::new(buffer))
    })
    .await
    .expect("load task does not panic")
}

/// Verifies an in-memory snapshot image; returns its checksum.
fn verify(format: Format, bytes: &[u8]) -> Result<u64, Corruption> {
    let mut v = Verifier::new(format, bytes.len() as u64)?;
    v.update(bytes)?;
    v.finish().map(|info| info.checksum)
}
