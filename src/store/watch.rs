//! The snapshot directory watcher: turns files appearing in `snapshot_dir`
//! into catalog entries.
//!
//! Owns following the directory (`notify` events plus a periodic rescan as a
//! safety net), debouncing (a file is validated only after it has been quiet
//! for `watch.debounce`), skipping temp files, validating complete files with
//! the streaming verifier, and surviving the directory being removed and
//! recreated. Rejected files are logged once per (path, size, mtime) and
//! counted in `kvsync_snapshots_rejected_total{reason}`. What "valid" means is
//! left to `snapshot`; what is offered is kept by `catalog`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::WatchConfig;
use crate::metrics::Metrics;
use crate::snapshot::Format;
use crate::store::catalog::{Catalog, CatalogEntry};

/// True for names that are never snapshots: hidden files, temp files of
/// kvsync and of the KV (`temp-*.rdb`, `*.tmp`), handoff records.
pub fn is_ignored_name(name: &str) -> bool {
    name.starts_with('.')
        || name.starts_with("temp-")
        || name.ends_with(".tmp")
        || name.ends_with(".partial")
        || name.ends_with(".replmeta")
}

/// What the watcher last decided about one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    size: u64,
    mtime: SystemTime,
}

/// Watches one directory and keeps the catalog in step with it.
pub struct DirWatcher {
    dir: PathBuf,
    format: Format,
    /// Piece size of the manifests computed while validating.
    piece_size: u64,
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    config: WatchConfig,
    /// Files already decided (offered or rejected) at this size and mtime.
    decided: HashMap<PathBuf, Seen>,
    /// Files with recent activity: when they were last touched.
    pending: HashMap<PathBuf, Instant>,
    dir_present: bool,
}

impl DirWatcher {
    pub fn new(
        dir: PathBuf,
        (format, piece_size): (Format, u64),
        catalog: Arc<Catalog>,
        metrics: Arc<Metrics>,
        config: WatchConfig,
    ) -> DirWatcher {
        // Every rejection reason is a series from the start (zero, not
        // missing).
        for reason in crate::snapshot::REJECTION_REASONS {
            metrics
                .snapshots_rejected
                .with_label_values(&[catalog.instance(), reason]);
        }
        DirWatcher {
            dir,
            format,
            piece_size,
            catalog,
            metrics,
            config,
            decided: HashMap::new(),
            pending: HashMap::new(),
            dir_present: true,
        }
    }

    /// Runs until `shutdown` is cancelled.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let (tx, mut rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
        let mut watcher: Option<RecommendedWatcher> = None;
        // While the directory is missing, look for it every second.
        let retry = Duration::from_secs(1).min(self.config.rescan_interval);
        let mut next_rescan = Instant::now();
        loop {
            if Instant::now() >= next_rescan {
                if watcher.is_none() {
                    watcher = self.arm(tx.clone());
                }
                self.rescan().await;
                if !self.dir_present {
                    watcher = None;
                }
                let every = if watcher.is_some() {
                    self.config.rescan_interval
                } else {
                    retry
                };
                next_rescan = Instant::now() + every;
            }
            self.process_due().await;
            let wake = self
                .pending
                .values()
                .map(|t| *t + self.config.debounce)
                .min()
                .map_or(next_rescan, |t| t.min(next_rescan));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(wake) => {}
                event = rx.recv() => match event {
                    Some(Ok(event)) => {
                        if self.on_event(event) {
                            // The directory went away or moved, or the
                            // kernel dropped events.
                            watcher = None;
                            next_rescan = Instant::now();
                        }
                    }
                    Some(Err(e)) => {
                        warn!(dir = %self.dir.display(), error = %e, "watch error; rescanning");
                        watcher = None;
                        next_rescan = Instant::now();
                    }
                    None => return,
                },
            }
        }
    }

    /// Starts a `notify` watch on the directory, if it exists.
    fn arm(
        &mut self,
        tx: mpsc::UnboundedSender<notify::Result<notify::Event>>,
    ) -> Option<RecommendedWatcher> {
        let mut w = match notify::recommended_watcher(move |ev| {
            let _ = tx.send(ev);
        }) {
            Ok(w) => w,
            Err(e) => {
                warn!(error = %e, "cannot create a file watcher; relying on periodic rescans");
                return None;
            }
        };
        match w.watch(&self.dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                debug!(dir = %self.dir.display(), "watching snapshot directory");
                Some(w)
            }
            Err(e) => {
                if self.dir_present {
                    warn!(dir = %self.dir.display(), error = %e, "cannot watch snapshot directory; will retry");
                }
                None
            }
        }
    }

    /// Records activity; returns true when the directory must be watched
    /// and listed afresh (it was removed or renamed, or events were lost).
    fn on_event(&mut self, event: notify::Event) -> bool {
        use notify::event::{AccessKind, AccessMode};
        use notify::EventKind;
        // Reads (the watcher's own validation, cache loads) change nothing;
        // a writer closing the file does.
        if matches!(event.kind, EventKind::Access(a) if a != AccessKind::Close(AccessMode::Write)) {
            return false;
        }
        let now = Instant::now();
        let mut dir_gone = event.need_rescan();
        for path in event.paths {
            if path == self.dir {
                dir_gone |= event.kind.is_remove()
                    || matches!(
                        event.kind,
                        notify::EventKind::Modify(notify::event::ModifyKind::Name(_))
                    );
                continue;
            }
            if path.parent() == Some(self.dir.as_path()) {
                self.pending.insert(path, now);
            }
        }
        dir_gone
    }

    /// Lists the directory: new or changed files become pending, vanished
    /// files leave the catalog.
    async fn rescan(&mut self) {
        let dir = self.dir.clone();
        let listing = tokio::task::spawn_blocking(move || list_files(&dir))
            .await
            .expect("listing task does not panic");
        let files = match listing {
            Ok(files) => {
                if !self.dir_present {
                    info!(dir = %self.dir.display(), "snapshot directory is back");
                }
                self.dir_present = true;
                files
            }
            Err(e) => {
                if self.dir_present {
                    warn!(dir = %self.dir.display(), error = %e, "snapshot directory unreadable; its snapshots are no longer offered");
                }
                self.dir_present = false;
                self.decided.clear();
                self.pending.clear();
                self.catalog.remove_under(&self.dir);
                return;
            }
        };
        let gone: Vec<PathBuf> = self
            .decided
            .keys()
            .filter(|p| !files.contains_key(*p))
            .cloned()
            .collect();
        for path in gone {
            self.forget(&path);
        }
        // Files found by a rescan are due at once; their quiet time is
        // checked against their mtime when they are processed.
        let due = instant_ago(self.config.debounce);
        for (path, seen) in files {
            if self.decided.get(&path) != Some(&seen) {
                self.pending.entry(path).or_insert(due);
            }
        }
    }

    /// Validates the pending files that have been quiet long enough.
    async fn process_due(&mut self) {
        let now = Instant::now();
        let due: Vec<PathBuf> = self
            .pending
            .iter()
            .filter(|(_, t)| **t + self.config.debounce <= now)
            .map(|(p, _)| p.clone())
            .collect();
        for path in due {
            self.pending.remove(&path);
            self.consider(path).await;
        }
    }

    async fn consider(&mut self, path: PathBuf) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if is_ignored_name(name) {
            return;
        }
        // The entry itself: a link is never followed, whatever it names.
        let seen = match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => Seen {
                size: m.len(),
                mtime: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            },
            Ok(m) => {
                let what = if m.is_symlink() {
                    "a symbolic link"
                } else {
                    "not a regular file"
                };
                warn!(path = %path.display(), "{what}, so not offered: kvsync offers only regular files in snapshot_dir");
                return self.forget(&path);
            }
            Err(_) => return self.forget(&path),
        };
        if self.decided.get(&path) == Some(&seen) {
            return;
        }
        // Written to within the debounce window: look again later.
        let age = SystemTime::now()
            .duration_since(seen.mtime)
            .unwrap_or_default();
        if age < self.config.debounce {
            self.pending.insert(path, instant_ago(age));
            return;
        }
        let (format, piece_size) = (self.format, self.piece_size);
        let p = path.clone();
        let verdict = tokio::task::spawn_blocking(move || {
            CatalogEntry::scan(&p, format, piece_size, seen.mtime)
        })
        .await
        .expect("verify task does not panic");
        // The file may have changed while it was being read.
        let after = std::fs::symlink_metadata(&path).ok().map(|m| Seen {
            size: m.len(),
            mtime: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        });
        if after != Some(seen) {
            self.pending.insert(path, Instant::now());
            return;
        }
        self.decided.insert(path.clone(), seen);
        match verdict {
            Ok(entry) => {
                let info = &entry.info;
                info!(path = %path.display(), seq = info.seq, size = info.size, format = %info.format, pieces = entry.manifest.pieces(), "snapshot offered");
                self.catalog.upsert(entry);
            }
            Err(e) => {
                warn!(error = %e, "snapshot rejected; not offered");
                self.metrics
                    .snapshots_rejected
                    .with_label_values(&[self.catalog.instance(), e.reason()])
                    .inc();
                self.catalog.reject(&path, e.what());
            }
        }
    }

    fn forget(&mut self, path: &Path) {
        self.decided.remove(path);
        self.pending.remove(path);
        if self.catalog.remove(path) {
            info!(path = %path.display(), "snapshot withdrawn (file gone)");
        }
    }
}

/// `Instant::now()` minus `d`, clamped at now on clocks younger than `d`.
fn instant_ago(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_sub(d).unwrap_or(now)
}

/// Regular, non-ignored files of `dir` with their size and mtime.
fn list_files(dir: &Path) -> std::io::Result<HashMap<PathBuf, Seen>> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if is_ignored_name(&name.to_string_lossy()) {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_file() {
            out.insert(
                entry.path(),
                Seen {
                    size: meta.len(),
                    mtime: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                },
            );
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::is_ignored_name;

    #[test]
    fn temp_and_hidden_names_are_ignored() {
        for name in [
            ".x",
            "temp-123.rdb",
            "snap.tmp",
            "a.partial",
            "dump.rdb.replmeta",
            ".kvsync-gen-1.tmp",
        ] {
            assert!(is_ignored_name(name), "{name}");
        }
        for name in ["snap-1.kvr1", "dump.rdb"] {
            assert!(!is_ignored_name(name), "{name}");
        }
    }
}
