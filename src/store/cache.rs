//! The shared snapshot cache (source side; docs/ARCHITECTURE.md, "The
//! shared snapshot cache").
//!
//! Owns loading a snapshot file into one page-aligned buffer shared by every
//! session that serves it, keyed by (path, size, mtime): one background load
//! that verifies as it goes while sessions send what is loaded; a refcount and
//! a `cache.linger` after the last holder; a memory budget that makes loads
//! wait or fail clearly, shared fairly by the agent's instances; and relay
//! images filled block by block as a snapshot being received lands, each
//! piece checked again.
//!
//! The sharing rule: with `n` instances, each is guaranteed a share of
//! `budget / n` and may borrow free room beyond it, except while another
//! instance that is still within its share waits for room: then room that
//! frees up goes to that instance first. Images in use cannot be taken
//! back, so a borrower's are not; lingering ones are freed for any load.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::snapshot::manifest::Manifest;
use crate::snapshot::{Corruption, Verifier};
use crate::store::arrivals::{Arrivals, ArrivalsError, RELAY_BLOCK};
use crate::store::catalog::{system_time_ns, CatalogEntry};
use crate::sys::buf::AlignedBuf;

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
    #[error("cache memory budget exhausted: {size} bytes needed, {in_use} of {budget} in use after waiting {waited:?} (each of its {instances} instances is guaranteed {}); retry later", budget / (*instances).max(1) as u64)]
    OverBudget {
        size: u64,
        in_use: u64,
        budget: u64,
        instances: usize,
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
    /// A relayed snapshot's receive ended before this piece came.
    #[error("this agent's own sync of the relayed snapshot ended: {0}")]
    RelayEnded(#[from] ArrivalsError),
    /// The bytes of a relayed snapshot's piece that this agent passed on
    /// do not match the manifest (the staging file changed after the
    /// receiver verified them).
    #[error("{path}: piece {index} changed after it was verified")]
    PieceChanged { path: PathBuf, index: u32 },
    /// A piece of a relayed snapshot failed this agent's own check after
    /// it began passing its bytes on: they are not the piece.
    #[error("piece {index} failed this relay's own check after it began passing it on: drop that piece's bytes")]
    PieceDropped { index: u32 },
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

    /// Blocks until `[0, need)` is loaded; returns the loaded prefix, up
    /// to `end` at most.
    fn wait_loaded(&self, need: usize, end: usize) -> Result<&[u8], CacheError> {
        let end = end.min(self.len());
        let need = need.min(end);
        let mut state = self.state.lock().expect("image lock");
        loop {
            let loaded = self.loaded.load(Ordering::Acquire);
            if loaded >= need {
                // SAFETY: the loader wrote every byte below `loaded` before
                // publishing it with Release, and never writes them again.
                return Ok(unsafe {
                    std::slice::from_raw_parts(self.buf.as_ptr(), loaded.min(end))
                });
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
    /// The instance that loaded it (whose share it counts in).
    instance: String,
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

impl Slots {
    fn reserved_by(&self, instance: &str) -> u64 {
        self.by_instance.get(instance).copied().unwrap_or(0)
    }

    /// Whether `instance` may take `size` more bytes of `budget` shared by
    /// `instances`, room permitting (the rule in this module's head).
    fn may_take(&self, instance: &str, size: u64, budget: u64, instances: usize) -> bool {
        let share = budget / instances.max(1) as u64;
        self.reserved_by(instance) + size <= share
            || !self
                .waiting
                .iter()
                .any(|(i, _)| i != instance && self.reserved_by(i) < share)
    }

    /// Frees lingering images, oldest first, until `size` more bytes fit;
    /// false when they cannot.
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
            self.free(&key);
        }
        true
    }

    fn add(&mut self, key: CacheKey, slot: Slot) {
        self.reserved += key.size;
        *self.by_instance.entry(slot.instance.clone()).or_default() += key.size;
        self.slots.insert(key, slot);
    }

    fn free(&mut self, key: &CacheKey) {
        let Some(slot) = self.slots.remove(key) else {
            return;
        };
        self.reserved -= key.size;
        if let Some(r) = self.by_instance.get_mut(&slot.instance) {
            *r -= key.size;
            if *r == 0 {
                self.by_instance.remove(&slot.instance);
            }
        }
    }
}

#[derive(Default)]
struct Slots {
    slots: HashMap<CacheKey, Slot>,
    /// Bytes reserved by all slots (loaded or loading).
    reserved: u64,
    /// The same, by instance (only instances with slots).
    by_instance: HashMap<String, u64>,
    /// Instances with loads waiting for room, and how many.
    waiting: HashMap<String, usize>,
}

/// One load waiting for room, counted in [`Slots::waiting`] until it is
/// admitted, gives up or is dropped.
struct Queued<'a> {
    cache: &'a SnapshotCache,
    instance: &'a str,
    on: bool,
}

impl Queued<'_> {
    /// Counts it (`true`) or not, under the cache lock `st`.
    fn set(&mut self, st: &mut Slots, on: bool) {
        if on == self.on {
            return;
        }
        self.on = on;
        if on {
            *st.waiting.entry(self.instance.to_string()).or_default() += 1;
        } else if let Some(n) = st.waiting.get_mut(self.instance) {
            *n -= 1;
            if *n == 0 {
                st.waiting.remove(self.instance);
            }
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.on {
            let mut st = self.cache.state.lock().expect("cache lock");
            self.set(&mut st, false);
        }
    }
}

/// The cache. Cheap to share as `Arc<SnapshotCache>`.
pub struct SnapshotCache {
    state: Mutex<Slots>,
    released: Notify,
    budget: AtomicU64,
    /// Instances the budget is shared by.
    instances: AtomicUsize,
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
            instances: AtomicUsize::new(1),
            acquire_timeout,
            linger: Mutex::new(Duration::ZERO),
            metrics,
        })
    }

    /// How long an image nobody holds stays loaded (zero: freed at once).
    pub fn set_linger(&self, linger: Duration) {
        *self.linger.lock().expect("linger lock") = linger;
    }

    /// Sets how many instances share the budget (at start and on reload).
    pub fn set_instances(&self, n: usize) {
        self.instances.store(n.max(1), Ordering::Relaxed);
        self.released.notify_waiters();
    }

    /// Returns a reference to `instance`'s snapshot, starting its load if it
    /// is not loaded or loading yet. Does not wait for the load.
    pub async fn acquire(
        self: &Arc<Self>,
        instance: &str,
        entry: &CatalogEntry,
    ) -> Result<CacheRef, CacheError> {
        let e = entry.clone();
        self.acquire_with(instance, CacheKey::of(entry), move || {
            // Open now: from here the inode is ours even if the file is
            // deleted or replaced before the load reads it.
            let file = open_checked(&e)?;
            Ok(Box::new(move |image: &Arc<Image>| fill(image, &file, &e)))
        })
        .await
    }

    /// Returns a reference to the image of a snapshot this agent is still
    /// receiving (it relays it): each piece is read from the staging file
    /// once the receiver verified it, and checked against the manifest
    /// again on its way in. Sessions send each piece as soon as it is there.
    pub async fn acquire_relay(
        self: &Arc<Self>,
        instance: &str,
        feed: RelayFeed,
    ) -> Result<CacheRef, CacheError> {
        let key = CacheKey {
            path: feed.path.clone(),
            size: feed.manifest.info.size,
            mtime_ns: 0,
        };
        self.acquire_with(instance, key, move || {
            let file = feed.file.try_clone().map_err(|source| CacheError::Io {
                path: feed.path.clone(),
                source,
            })?;
            Ok(Box::new(move |image: &Arc<Image>| {
                fill_relay(image, &file, &feed)
            }))
        })
        .await
    }

    /// The shared part of acquiring: a reference to the image under `key`,
    /// or a new one, within the budget, filled by what `open` returns on a
    /// blocking thread.
    async fn acquire_with(
        self: &Arc<Self>,
        instance: &str,
        key: CacheKey,
        open: impl FnOnce() -> Result<Loader, CacheError>,
    ) -> Result<CacheRef, CacheError> {
        let size = key.size;
        let started = tokio::time::Instant::now();
        let deadline = started + self.acquire_timeout;
        let mut open = Some(open);
        let mut queued = Queued {
            cache: self,
            instance,
            on: false,
        };
        loop {
            let released = self.released.notified();
            {
                let mut st = self.state.lock().expect("cache lock");
                queued.set(&mut st, false);
                if let Some(slot) = st.slots.get_mut(&key) {
                    slot.refs += 1;
                    slot.idle_since = None;
                    let (image, refs) = (slot.image.clone(), slot.refs);
                    drop(st);
                    self.publish();
                    self.metrics.cache_hits.inc();
                    info!(path = %key.path.display(), "reusing snapshot buffer ref={refs}");
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
                let instances = self.instances.load(Ordering::Relaxed);
                if st.may_take(instance, size, budget, instances) && st.make_room(size, budget) {
                    let open = open.take().expect("a load is opened once");
                    let loader = open()?;
                    let buf = AlignedBuf::new(size as usize).map_err(|source| CacheError::Io {
                        path: key.path.clone(),
                        source,
                    })?;
                    let image = Arc::new(Image {
                        buf,
                        loaded: AtomicUsize::new(0),
                        state: Mutex::new(LoadState::Loading),
                        progress: Condvar::new(),
                    });
                    st.add(
                        key.clone(),
                        Slot {
                            instance: instance.to_string(),
                            refs: 1,
                            image: image.clone(),
                            idle_since: None,
                        },
                    );
                    drop(st);
                    self.publish();
                    self.metrics.cache_loads.inc();
                    let (img, path) = (image.clone(), key.path.clone());
                    tokio::task::spawn_blocking(move || load(&img, &path, loader));
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
                        instances,
                        budget,
                        waited: started.elapsed(),
                    });
                }
                queued.set(&mut st, true);
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
                    st.free(key);
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
                st.free(key);
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
        self.image.wait_loaded(end, end)
    }

    /// Blocks until more than `at` bytes are loaded and returns the loaded
    /// prefix, up to `end` at most (a session sends what a relay image has
    /// passed on so far, not waiting for a whole range).
    pub fn wait_past(&self, at: usize, end: usize) -> Result<&[u8], CacheError> {
        self.image.wait_loaded(at + 1, end)
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
pub(crate) fn open_checked(entry: &CatalogEntry) -> Result<std::fs::File, CacheError> {
    let path = &entry.path;
    let io = |source| CacheError::Io {
        path: path.clone(),
        source,
    };
    let file = crate::sys::fs::open_read(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let mtime_ns = meta.modified().map(system_time_ns).unwrap_or_default();
    if meta.len() != entry.info.size || mtime_ns != entry.mtime_ns() {
        return Err(CacheError::Changed { path: path.clone() });
    }
    Ok(file)
}

/// Fills an image on a blocking thread; `Err` fails it for every holder.
type Loader = Box<dyn FnOnce(&Arc<Image>) -> Result<(), CacheError> + Send>;

/// Runs `loader` and publishes its verdict.
fn load(image: &Arc<Image>, path: &std::path::Path, loader: Loader) {
    let started = std::time::Instant::now();
    match loader(image) {
        Ok(()) => {
            image.publish(image.len(), Some(LoadState::Verified));
            info!(path = %path.display(), bytes = image.len(), elapsed = ?started.elapsed(), "snapshot loaded into cache");
        }
        Err(e) => {
            warn!(error = %e, "snapshot load failed");
            let loaded = image.loaded.load(Ordering::Relaxed);
            image.publish(loaded, Some(LoadState::Failed(Arc::new(e))));
        }
    }
}

/// Reads `[offset, offset + len)` of `file` into the same range of the
/// image, handing each chunk read to `chunk` (which may publish it).
fn read_into(
    image: &Image,
    file: &std::fs::File,
    path: &std::path::Path,
    (offset, len): (usize, usize),
    mut chunk: impl FnMut(&[u8], usize) -> Result<(), CacheError>,
) -> Result<(), CacheError> {
    assert!(offset + len <= image.len(), "read inside the image");
    let ptr = image.buf.as_ptr() as *mut u8;
    let mut done = offset;
    let end = offset + len;
    while done < end {
        let want = (end - done).min(LOAD_CHUNK);
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
                path: path.to_owned(),
                source: e,
            });
        }
        if n == 0 {
            return Err(CacheError::Changed {
                path: path.to_owned(),
            });
        }
        let n = n as usize;
        // SAFETY: just written by pread.
        let bytes = unsafe { std::slice::from_raw_parts(ptr.add(done), n) };
        done += n;
        chunk(bytes, done)?;
    }
    Ok(())
}

/// Fills `image` from a snapshot file, verifying it with its own checksum
/// as it goes and publishing each chunk.
fn fill(image: &Arc<Image>, file: &std::fs::File, entry: &CatalogEntry) -> Result<(), CacheError> {
    let path = &entry.path;
    let corrupt = |corruption| CacheError::Corrupt {
        path: path.clone(),
        corruption,
    };
    let mut verifier = Verifier::new(entry.format(), image.len() as u64).map_err(corrupt)?;
    read_into(image, file, path, (0, image.len()), |bytes, done| {
        verifier.update(bytes).map_err(corrupt)?;
        image.publish(done, None);
        Ok(())
    })?;
    let info = verifier.finish().map_err(corrupt)?;
    // Same size and mtime but other bytes: rewritten in place.
    if info.checksum != entry.info.checksum {
        return Err(CacheError::Changed { path: path.clone() });
    }
    Ok(())
}

/// A snapshot this agent is receiving, as a relay image's source.
pub struct RelayFeed {
    /// The staging file's path (the image's key) and an open handle to it.
    pub path: PathBuf,
    pub file: std::fs::File,
    pub manifest: Arc<Manifest>,
    pub arrivals: Arc<Arrivals>,
}

/// Fills a relay image in order, cutting through: the bytes of the next
/// piece are read from the staging file and published block by block as
/// they land there ([`RELAY_BLOCK`]), before the receiver checked the
/// piece, so a session passes them on at once and a relay delays its
/// children by a block, not a piece. Every replica checks every piece
/// against the origin's manifest itself; the relay checks the bytes it
/// copied too, once the receiver verified the piece (what it reads after
/// that verdict it publishes only after this check). Bytes it published
/// can never be taken back (sessions are sending them), so a piece that
/// failed the receiver's check after some were published, or whose bytes
/// here do not match the manifest, fails the image: every session serving
/// it ends and its replica pulls from further up, keeping what it verified.
/// A piece that failed before any of it was published just comes again.
/// Stops when nobody holds the image.
fn fill_relay(
    image: &Arc<Image>,
    file: &std::fs::File,
    feed: &RelayFeed,
) -> Result<(), CacheError> {
    let (path, manifest) = (&feed.path, &feed.manifest);
    for index in 0..manifest.pieces() {
        let (offset, len) = manifest.range(index);
        let mut hash = blake3::Hasher::new();
        let mut copied = 0;
        let mut drops = None;
        loop {
            // The next block (or the piece's end), the verdict, or a drop.
            let want = (copied + RELAY_BLOCK).min(len);
            let piece = feed.arrivals.wait_until(index, |p| {
                Some(p.drops) != drops || (copied < len && p.landed >= want)
            })?;
            // Only the loader's own reference is left: the image was dropped.
            if Arc::strong_count(image) == 1 {
                return Err(ArrivalsError::Ended("nobody holds the image".into()).into());
            }
            if drops.is_some_and(|d| d != piece.drops) && copied > 0 {
                return Err(CacheError::PieceDropped { index });
            }
            drops = Some(piece.drops);
            let upto = match piece {
                p if p.verified => len,
                p if p.landed >= want => p.landed,
                _ => copied,
            };
            if upto > copied {
                read_into(
                    image,
                    file,
                    path,
                    ((offset + copied) as usize, (upto - copied) as usize),
                    |b, _| {
                        hash.update(b);
                        Ok(())
                    },
                )?;
                copied = upto;
                if !piece.verified {
                    image.publish((offset + copied) as usize, None);
                }
            }
            if piece.verified && copied == len {
                break;
            }
        }
        if !manifest.piece_is(index, &hash.finalize()) {
            return Err(CacheError::PieceChanged {
                path: path.clone(),
                index,
            });
        }
        image.publish((offset + len) as usize, None);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::manifest::PieceHasher;
    use crate::snapshot::{Format, SnapshotInfo};
    use std::os::unix::fs::FileExt;

    const PIECE: u64 = 2 * RELAY_BLOCK;

    /// A 4-piece staging file and its manifest, and a relay image of it
    /// nobody verified a piece of yet.
    async fn relay_image() -> (tempfile::NamedTempFile, Arc<Arrivals>, CacheRef, Vec<u8>) {
        let bytes: Vec<u8> = (0..4 * PIECE).map(|i| (i * 7 % 251) as u8).collect();
        let mut hasher = PieceHasher::new(PIECE);
        hasher.update(&bytes);
        let info = SnapshotInfo {
            format: Format::Kvr1,
            size: bytes.len() as u64,
            seq: 3,
            checksum: 9,
            records: 0,
            created_ms: 0,
            repl_id: None,
        };
        let manifest = Arc::new(hasher.finish(info));
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().write_all_at(&bytes, 0).unwrap();
        let arrivals = Arc::new(Arrivals::new(vec![false; 4]));
        let cache = SnapshotCache::new(1 << 30, Duration::from_secs(5), Metrics::new());
        let image = cache
            .acquire_relay(
                "default",
                RelayFeed {
                    path: file.path().to_owned(),
                    file: file.as_file().try_clone().unwrap(),
                    manifest,
                    arrivals: arrivals.clone(),
                },
            )
            .await
            .unwrap();
        (file, arrivals, image, bytes)
    }

    #[tokio::test]
    async fn a_relay_image_passes_on_each_block_as_it_lands_and_checks_each_piece_again() {
        let (file, arrivals, image, bytes) = relay_image().await;
        let image = Arc::new(image);
        let loaded = |end: u64| {
            let image = image.clone();
            std::thread::spawn(move || image.wait_loaded(end as usize).map(<[u8]>::to_vec))
        };
        // Half a block landed: nothing to pass on yet. A block landed: it
        // is passed on before the piece is checked.
        arrivals.landed(0, RELAY_BLOCK / 2, PIECE);
        let first_block = loaded(RELAY_BLOCK);
        arrivals.landed(0, RELAY_BLOCK, PIECE);
        assert_eq!(
            first_block.join().unwrap().unwrap(),
            bytes[..RELAY_BLOCK as usize]
        );
        arrivals.landed(0, PIECE, PIECE);
        arrivals.mark(0);
        arrivals.mark(1);
        assert_eq!(
            loaded(2 * PIECE).join().unwrap().unwrap(),
            bytes[..2 * PIECE as usize]
        );
        // Piece 2 changed on disk after the receiver verified it: its
        // bytes are published, but the image fails at its check.
        file.as_file().write_all_at(b"X", 2 * PIECE + 5).unwrap();
        arrivals.mark(2);
        let err = image.wait_complete().unwrap_err();
        assert!(err.to_string().contains("piece 2 changed"), "{err}");
        assert!(image.wait_loaded(3 * PIECE as usize).is_err());
    }

    #[tokio::test]
    async fn a_piece_that_fails_the_relays_check_after_it_was_passed_on_fails_the_image() {
        let (_file, arrivals, image, _) = relay_image().await;
        // Dropped before any of it was passed on: it just comes again.
        arrivals.landed(0, RELAY_BLOCK / 2, PIECE);
        arrivals.dropped(0);
        arrivals.landed(0, PIECE, PIECE);
        arrivals.mark(0);
        // Dropped after a block of it was passed on: those bytes cannot be
        // taken back, so every session serving the image ends.
        arrivals.landed(1, RELAY_BLOCK, PIECE);
        image.wait_loaded((PIECE + RELAY_BLOCK) as usize).unwrap();
        arrivals.dropped(1);
        let err = image.wait_complete().unwrap_err();
        assert!(
            err.to_string()
                .contains("piece 1 failed this relay's own check"),
            "{err}"
        );
        assert_eq!(
            image.wait_loaded(PIECE as usize).unwrap().len(),
            PIECE as usize,
            "what it passed on stays"
        );
    }

    #[tokio::test]
    async fn a_relay_image_fails_when_its_receive_ends_and_completes_when_it_finishes() {
        let (_file, arrivals, image, _) = relay_image().await;
        arrivals.mark(0);
        arrivals.end("the relay's own sync failed: cut");
        let err = image.wait_complete().unwrap_err();
        assert!(err.to_string().contains("cut"), "{err}");
        assert!(
            image.wait_loaded(PIECE as usize).is_ok(),
            "what it had stays"
        );

        let (_file, arrivals, image, bytes) = relay_image().await;
        for i in [3, 1, 0, 2] {
            arrivals.mark(i);
        }
        assert_eq!(image.wait_complete().unwrap(), bytes);
    }
}
