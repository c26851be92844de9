//! The shared snapshot cache (source side, docs/ARCHITECTURE.md, "The shared snapshot cache").
//!
//! Owns loading a snapshot file into one page-aligned heap buffer and sharing
//! it between every session that serves the same file. Entries are keyed by
//! (path, size, mtime). The first acquirer opens the file (so a file deleted
//! or replaced after the offer is still read as offered) and starts one
//! background load with `pread` (no `mmap`, no memset); the load verifies the
//! bytes with the snapshot's own checksum as it goes. Sessions do not wait
//! for the whole load: they send each range as soon as it is loaded
//! ([`CacheRef::wait_loaded`]) and wait for the final verdict
//! ([`CacheRef::wait_complete`]) before declaring the transfer done, so
//! loading and sending overlap. Concurrent acquirers share the load
//! (refcount; "reusing snapshot buffer ref=N"). When the last [`CacheRef`]
//! drops, a verified image lingers for `cache.linger` so that a straggler
//! replica reuses it instead of paying for another load; then (or at once,
//! when a new load needs its room in the budget) the memory is freed. A
//! replaced file is a new key, so holders of the old buffer keep reading
//! consistent bytes. A memory budget makes new loads wait for space (up to
//! `acquire_timeout`) or fail with a clear error.
//! Registering the buffer with a NIC is the transports' job.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{info, warn};

use crate::buf::AlignedBuf;
use crate::catalog::{system_time_ns, CatalogEntry};
use crate::metrics::Metrics;
use crate::snapshot::{Corruption, Verifier};

/// `pread` size while loading (also the granularity readers wait on).
const LOAD_CHUNK: usize = 4 << 20;

/// Identity of a loaded snapshot file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i128,
}

impl CacheKey {
    pub fn of(entry: &CatalogEntry) -> CacheKey {
        CacheKey {
            path: entry.path.clone(),
            size: entry.info.size,
            mtime_ns: entry.mtime_ns(),
        }
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
    OverBudget {
        size: u64,
        in_use: u64,
        budget: u64,
        waited: Duration,
    },
    /// The file is no longer the one the catalog offered.
    #[error("{path}: snapshot file changed since it was offered")]
    Changed { path: PathBuf },
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The loaded bytes do not verify.
    #[error("{path}: loaded bytes are not a valid snapshot: {corruption}")]
    Corrupt {
        path: PathBuf,
        corruption: Corruption,
    },
    /// The shared load failed (for every holder).
    #[error(transparent)]
    Load(Arc<CacheError>),
}

/// How far the background load got.
enum LoadState {
    Loading,
    Verified,
    Failed(Arc<CacheError>),
}

/// A snapshot image being (or done being) loaded.
pub struct Image {
    buf: AlignedBuf,
    /// Bytes `[0, loaded)` are written and never change again.
    loaded: AtomicUsize,
    state: Mutex<LoadState>,
    progress: Condvar,
}

impl Image {
    fn len(&self) -> usize {
        self.buf.len()
    }

    /// Blocks until `[0, end)` is loaded; returns that prefix.
    fn wait_loaded(&self, end: usize) -> Result<&[u8], CacheError> {
        let end = end.min(self.len());
        let mut state = self.state.lock().expect("image lock");
        loop {
            if self.loaded.load(Ordering::Acquire) >= end {
                // SAFETY: the loader wrote every byte below `loaded` before
                // publishing it with Release, and never writes them again.
                return Ok(unsafe { std::slice::from_raw_parts(self.buf.as_ptr(), end) });
            }
            if let LoadState::Failed(e) = &*state {
                return Err(CacheError::Load(e.clone()));
            }
            state = self.progress.wait(state).expect("image lock");
        }
    }

    /// Blocks until the load finished and verified.
    fn wait_complete(&self) -> Result<&[u8], CacheError> {
        let mut state = self.state.lock().expect("image lock");
        loop {
            match &*state {
                LoadState::Verified => {
                    // SAFETY: fully loaded, as above.
                    return Ok(unsafe {
                        std::slice::from_raw_parts(self.buf.as_ptr(), self.len())
                    });
                }
                LoadState::Failed(e) => return Err(CacheError::Load(e.clone())),
                LoadState::Loading => state = self.progress.wait(state).expect("image lock"),
            }
        }
    }

    fn publish(&self, loaded: usize, end: Option<LoadState>) {
        let mut state = self.state.lock().expect("image lock");
        self.loaded.store(loaded, Ordering::Release);
        if let Some(s) = end {
            *state = s;
        }
        self.progress.notify_all();
    }
}

struct Slot {
    refs: usize,
    image: Arc<Image>,
    /// Held by nobody since then, lingering.
    idle_since: Option<Instant>,
}

impl Image {
    fn verified(&self) -> bool {
        matches!(*self.state.lock().expect("image lock"), LoadState::Verified)
    }
}

impl State {
    /// Frees lingering images, oldest first, until `size` more bytes fit
    /// in `budget`; false when they cannot.
    fn make_room(&mut self, size: u64, budget: u64) -> bool {
        while self.reserved + size > budget {
            let oldest = self
                .slots
                .iter()
                .filter_map(|(k, s)| s.idle_since.map(|t| (t, k.clone())))
                .min_by_key(|(t, _)| *t);
            let Some((_, key)) = oldest else {
                return false;
            };
            self.slots.remove(&key);
            self.reserved -= key.size;
        }
        true
    }
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
    /// How long an image nobody holds stays loaded.
    linger: Mutex<Duration>,
    metrics: Arc<Metrics>,
}

impl SnapshotCache {
    pub fn new(
        budget: u64,
        acquire_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Arc<SnapshotCache> {
        Arc::new(SnapshotCache {
            state: Mutex::default(),
            released: Notify::new(),
            budget: AtomicU64::new(budget),
            acquire_timeout,
            linger: Mutex::new(Duration::ZERO),
            metrics,
        })
    }

    /// How long an image nobody holds stays loaded (zero: freed at once).
    pub fn set_linger(&self, linger: Duration) {
        *self.linger.lock().expect("linger lock") = linger;
    }

    /// Returns a reference to the snapshot, starting its load if it is not
    /// loaded or loading yet. Does not wait for the load.
    pub async fn acquire(self: &Arc<Self>, entry: &CatalogEntry) -> Result<CacheRef, CacheError> {
        let key = CacheKey::of(entry);
        let size = key.size;
        let started = tokio::time::Instant::now();
        let deadline = started + self.acquire_timeout;
        loop {
            let released = self.released.notified();
            {
                let mut st = self.state.lock().expect("cache lock");
                if let Some(slot) = st.slots.get_mut(&key) {
                    slot.refs += 1;
                    slot.idle_since = None;
                    let (image, refs) = (slot.image.clone(), slot.refs);
                    drop(st);
                    self.publish();
                    self.metrics.cache_hits.inc();
                    info!(path = %entry.path.display(), "reusing snapshot buffer ref={refs}");
                    return Ok(CacheRef {
                        image,
                        cache: self.clone(),
                        key,
                    });
                }
                let budget = self.budget.load(Ordering::Relaxed);
                if size > budget {
                    return Err(CacheError::TooLarge { size, budget });
                }
                if st.make_room(size, budget) {
                    // Open now: from here the inode is ours even if the file
                    // is deleted or replaced before the load reads it.
                    let file = open_checked(entry)?;
                    let buf = AlignedBuf::new(size as usize).map_err(|source| CacheError::Io {
                        path: entry.path.clone(),
                        source,
                    })?;
                    let image = Arc::new(Image {
                        buf,
                        loaded: AtomicUsize::new(0),
                        state: Mutex::new(LoadState::Loading),
                        progress: Condvar::new(),
                    });
                    st.slots.insert(
                        key.clone(),
                        Slot {
                            refs: 1,
                            image: image.clone(),
                            idle_since: None,
                        },
                    );
                    st.reserved += size;
                    drop(st);
                    self.publish();
                    self.metrics.cache_loads.inc();
                    let (img, e) = (image.clone(), entry.clone());
                    tokio::task::spawn_blocking(move || load(&img, file, &e));
                    return Ok(CacheRef {
                        image,
                        cache: self.clone(),
                        key,
                    });
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
        }
    }

    /// Changes the memory budget (new acquires see it; loaded buffers stay).
    pub fn set_budget(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::Relaxed);
        self.released.notify_waiters();
    }

    /// Number of loaded or loading entries.
    pub fn entries(&self) -> usize {
        self.state.lock().expect("cache lock").slots.len()
    }

    /// Total references held.
    pub fn refs(&self) -> usize {
        self.state
            .lock()
            .expect("cache lock")
            .slots
            .values()
            .map(|s| s.refs)
            .sum()
    }

    fn release(&self, key: &CacheKey) {
        let linger = *self.linger.lock().expect("linger lock");
        {
            let mut st = self.state.lock().expect("cache lock");
            let slot = st.slots.get_mut(key).expect("released key is present");
            slot.refs -= 1;
            if slot.refs == 0 {
                if !linger.is_zero() && slot.image.verified() {
                    slot.idle_since = Some(Instant::now());
                } else {
                    st.slots.remove(key);
                    st.reserved -= key.size;
                }
            }
        }
        self.publish();
        self.released.notify_waiters();
    }

    /// Frees the images nobody has held for `cache.linger`; returns how
    /// many.
    pub fn sweep(&self) -> usize {
        let linger = *self.linger.lock().expect("linger lock");
        let freed = {
            let mut st = self.state.lock().expect("cache lock");
            let expired: Vec<CacheKey> = st
                .slots
                .iter()
                .filter(|(_, s)| s.idle_since.is_some_and(|t| t.elapsed() >= linger))
                .map(|(k, _)| k.clone())
                .collect();
            for key in &expired {
                st.slots.remove(key);
                st.reserved -= key.size;
            }
            expired.len()
        };
        if freed > 0 {
            self.publish();
            self.released.notify_waiters();
        }
        freed
    }

    /// Frees lingering images as they expire, until `shutdown`.
    pub async fn expire(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => { self.sweep(); }
            }
        }
    }

    fn publish(&self) {
        let st = self.state.lock().expect("cache lock");
        self.metrics.cache_bytes.set(st.reserved as i64);
        self.metrics.cache_entries.set(st.slots.len() as i64);
        self.metrics
            .cache_refs
            .set(st.slots.values().map(|s| s.refs as i64).sum());
    }
}

/// A session's hold on a snapshot image; the memory lives while any exists.
pub struct CacheRef {
    image: Arc<Image>,
    cache: Arc<SnapshotCache>,
    key: CacheKey,
}

impl CacheRef {
    /// Snapshot length.
    pub fn len(&self) -> usize {
        self.image.len()
    }

    /// True for an empty snapshot.
    pub fn is_empty(&self) -> bool {
        self.image.len() == 0
    }

    /// Start address of the image (for memory registration).
    pub fn as_ptr(&self) -> *const u8 {
        self.image.buf.as_ptr()
    }

    /// Blocks until `[0, end)` is loaded and returns it (sessions send each
    /// range as soon as it is there).
    pub fn wait_loaded(&self, end: usize) -> Result<&[u8], CacheError> {
        self.image.wait_loaded(end)
    }

    /// Blocks until the whole image is loaded and verified.
    pub fn wait_complete(&self) -> Result<&[u8], CacheError> {
        self.image.wait_complete()
    }

    /// Async form of [`CacheRef::wait_complete`] (runs on a blocking thread).
    pub async fn complete(&self) -> Result<(), CacheError> {
        let image = self.image.clone();
        tokio::task::spawn_blocking(move || image.wait_complete().map(drop))
            .await
            .expect("wait does not panic")
    }
}

impl Drop for CacheRef {
    fn drop(&mut self) {
        self.cache.release(&self.key);
    }
}

/// Opens the entry's file and checks it is still the offered one.
fn open_checked(entry: &CatalogEntry) -> Result<std::fs::File, CacheError> {
    let path = &entry.path;
    let io = |source| CacheError::Io {
        path: path.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let mtime_ns = meta.modified().map(system_time_ns).unwrap_or_default();
    if meta.len() != entry.info.size || mtime_ns != entry.mtime_ns() {
        return Err(CacheError::Changed { path: path.clone() });
    }
    Ok(file)
}

/// Fills `image` from `file`, verifying as it goes, publishing progress.
fn load(image: &Image, file: std::fs::File, entry: &CatalogEntry) {
    let started = std::time::Instant::now();
    match fill(image, &file, entry) {
        Ok(()) => {
            image.publish(image.len(), Some(LoadState::Verified));
            info!(path = %entry.path.display(), bytes = image.len(), elapsed = ?started.elapsed(), "snapshot loaded into cache");
        }
        Err(e) => {
            warn!(error = %e, "snapshot load failed");
            let loaded = image.loaded.load(Ordering::Relaxed);
            image.publish(loaded, Some(LoadState::Failed(Arc::new(e))));
        }
    }
}

fn fill(image: &Image, file: &std::fs::File, entry: &CatalogEntry) -> Result<(), CacheError> {
    let path = &entry.path;
    let len = image.len();
    let mut verifier =
        Verifier::new(entry.format(), len as u64).map_err(|corruption| CacheError::Corrupt {
            path: path.clone(),
            corruption,
        })?;
    let ptr = image.buf.as_ptr() as *mut u8;
    let mut done = 0usize;
    while done < len {
        let want = (len - done).min(LOAD_CHUNK);
        // SAFETY: `ptr + done .. + want` lies inside the allocation, above
        // the published watermark, so no reader looks at it yet.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                ptr.add(done).cast(),
                want,
                done as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(CacheError::Io {
                path: path.clone(),
                source: e,
            });
        }
        if n == 0 {
            return Err(CacheError::Changed { path: path.clone() });
        }
        let n = n as usize;
        // SAFETY: just written by pread.
        let chunk = unsafe { std::slice::from_raw_parts(ptr.add(done), n) };
        verifier
            .update(chunk)
            .map_err(|corruption| CacheError::Corrupt {
                path: path.clone(),
                corruption,
            })?;
        done += n;
        image.publish(done, None);
    }
    let info = verifier
        .finish()
        .map_err(|corruption| CacheError::Corrupt {
            path: path.clone(),
            corruption,
        })?;
    // Same size and mtime but other bytes: rewritten in place.
    if info.checksum != entry.info.checksum {
        return Err(CacheError::Changed { path: path.clone() });
    }
    Ok(())
}
