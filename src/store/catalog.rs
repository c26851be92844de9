//! The catalog: the verified snapshots this agent can offer as a source.
//!
//! Owns the in-memory list of valid snapshot files (path, format, size, mtime,
//! seq M, piece manifest), answers "latest snapshot of format F", publishes a change
//! generation that tests and sessions can await, and keeps the
//! `kvsync_snapshot_latest_*` gauges true. It does not look at the disk: the
//! watcher decides what goes in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::snapshot::manifest::{Manifest, PieceHasher};
use crate::snapshot::{self, Format, SnapshotError, SnapshotInfo};

/// One offered snapshot file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogEntry {
    pub path: PathBuf,
    pub mtime: SystemTime,
    pub info: SnapshotInfo,
    /// Its pieces' checksums, from the same read that validated it.
    pub manifest: Arc<Manifest>,
}

impl CatalogEntry {
    /// Validates the snapshot at `path` (modified at `mtime`) completely
    /// and computes its piece manifest in the same read.
    pub fn scan(
        path: &Path,
        format: Format,
        piece_size: u64,
        mtime: SystemTime,
    ) -> Result<CatalogEntry, SnapshotError> {
        let mut pieces = PieceHasher::new(piece_size);
        let info = snapshot::verify_file_observed(path, Some(format), |b| pieces.update(b))?;
        Ok(CatalogEntry {
            path: path.to_owned(),
            mtime,
            manifest: Arc::new(pieces.finish(info.clone())),
            info,
        })
    }

    pub fn format(&self) -> Format {
        self.info.format
    }

    /// Modification time in unix nanoseconds (part of the cache key).
    pub fn mtime_ns(&self) -> i128 {
        system_time_ns(self.mtime)
    }
}

/// Unix nanoseconds of a `SystemTime` (negative before 1970).
pub fn system_time_ns(t: SystemTime) -> i128 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// The most rejected files a catalog names (the rest are counted and
/// logged only).
const MAX_REJECTED: usize = 64;

/// Thread-safe set of offered snapshots, and of the files the watcher
/// rejected (with why).
pub struct Catalog {
    entries: RwLock<BTreeMap<PathBuf, Arc<CatalogEntry>>>,
    /// Files found not to be valid snapshots, each with the reason (at
    /// most [`MAX_REJECTED`]; a file offered or gone leaves the list).
    rejected: RwLock<BTreeMap<PathBuf, String>>,
    generation: watch::Sender<u64>,
    metrics: Arc<Metrics>,
    /// The instance whose snapshots these are (its `kv_instance` label).
    instance: String,
}

impl Catalog {
    pub fn new(metrics: Arc<Metrics>, instance: &str) -> Arc<Catalog> {
        Arc::new(Catalog {
            entries: RwLock::default(),
            rejected: RwLock::default(),
            generation: watch::channel(0).0,
            metrics,
            instance: instance.to_string(),
        })
    }

    /// The instance whose snapshots these are.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Adds or replaces the entry for `entry.path`.
    pub fn upsert(&self, entry: CatalogEntry) {
        self.unreject(&entry.path);
        let changed = {
            let mut map = self.entries.write().expect("catalog lock");
            let old = map.insert(entry.path.clone(), Arc::new(entry.clone()));
            old.as_deref() != Some(&entry)
        };
        if changed {
            self.changed();
        }
    }

    /// Withdraws `path`, found not to be a valid snapshot for `reason`,
    /// and keeps the reason for [`Catalog::rejected`].
    pub fn reject(&self, path: &Path, reason: String) {
        self.remove(path);
        let mut rejected = self.rejected.write().expect("catalog lock");
        if rejected.len() < MAX_REJECTED || rejected.contains_key(path) {
            rejected.insert(path.to_path_buf(), reason);
        }
    }

    /// The files found not to be valid snapshots, with why, by path.
    pub fn rejected(&self) -> Vec<(PathBuf, String)> {
        let rejected = self.rejected.read().expect("catalog lock");
        rejected
            .iter()
            .map(|(p, r)| (p.clone(), r.clone()))
            .collect()
    }

    fn unreject(&self, path: &Path) {
        self.rejected.write().expect("catalog lock").remove(path);
    }

    /// Removes the entry for `path` (offered or rejected); returns whether
    /// an offered one existed.
    pub fn remove(&self, path: &Path) -> bool {
        self.unreject(path);
        let removed = self
            .entries
            .write()
            .expect("catalog lock")
            .remove(path)
            .is_some();
        if removed {
            self.changed();
        }
        removed
    }

    /// Removes every entry under `dir` (the directory went away).
    pub fn remove_under(&self, dir: &Path) {
        self.rejected
            .write()
            .expect("catalog lock")
            .retain(|p, _| !p.starts_with(dir));
        let removed = {
            let mut map = self.entries.write().expect("catalog lock");
            let before = map.len();
            map.retain(|p, _| !p.starts_with(dir));
            before != map.len()
        };
        if removed {
            self.changed();
        }
    }

    /// The entry for `path`, if offered.
    pub fn get(&self, path: &Path) -> Option<Arc<CatalogEntry>> {
        self.entries
            .read()
            .expect("catalog lock")
            .get(path)
            .cloned()
    }

    /// The newest snapshot of `format`: highest seq, then newest mtime.
    pub fn latest(&self, format: Format) -> Option<Arc<CatalogEntry>> {
        self.entries
            .read()
            .expect("catalog lock")
            .values()
            .filter(|e| e.format() == format)
            .max_by_key(|e| (e.info.seq, e.mtime))
            .cloned()
    }

    /// Every offered snapshot, by path.
    pub fn list(&self) -> Vec<Arc<CatalogEntry>> {
        self.entries
            .read()
            .expect("catalog lock")
            .values()
            .cloned()
            .collect()
    }

    /// A receiver whose value changes whenever the catalog does.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn changed(&self) {
        for format in [Format::Kvr1, Format::RedisRdb] {
            let (seq, bytes) = self
                .latest(format)
                .map(|e| (e.info.seq as i64, e.info.size as i64))
                .unwrap_or((0, 0));
            let label = [self.instance.as_str(), format.as_str()];
            self.metrics
                .snapshot_latest_seq
                .with_label_values(&label)
                .set(seq);
            self.metrics
                .snapshot_latest_bytes
                .with_label_values(&label)
                .set(bytes);
        }
        self.generation.send_modify(|g| *g += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejected_file_is_named_until_it_is_offered_or_gone() {
        let c = Catalog::new(Metrics::new(), "default");
        let (a, b) = (Path::new("/s/a.rdb"), Path::new("/s/b.rdb"));
        c.reject(a, "no replication position".into());
        c.reject(b, "not a snapshot".into());
        assert_eq!(c.rejected().len(), 2);
        assert!(c.list().is_empty());
        c.remove(b);
        assert_eq!(
            c.rejected(),
            [(a.to_path_buf(), "no replication position".to_string())]
        );
        for n in 0..2 * MAX_REJECTED {
            c.reject(&PathBuf::from(format!("/t/{n}")), "bad".into());
        }
        assert_eq!(c.rejected().len(), MAX_REJECTED, "bounded");
        c.remove_under(Path::new("/t"));
        assert_eq!(c.rejected().len(), 1);
    }
}
