//! What this agent relays: the snapshot of each format it is receiving (or
//! has installed) from another agent, which it offers to further replicas
//! with the origin's manifest while it still receives it.
//!
//! A receiving job registers its snapshot here once its manifest checked
//! ([`RelayTable::receiving`]); the registration holds the staging file and
//! the [`Arrivals`] the receiver reports to, so an offer can start a relay
//! image in the cache (`SnapshotCache::acquire_relay`) that fills block by
//! block as the bytes land. Installing turns it into an installed entry, served from
//! the installed file like any snapshot; a job that fails withdraws it. A
//! newer snapshot of the same format supersedes the entry: offers for the
//! old one are refused from then on (sessions already serving it finish).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::rpc::pb;
use crate::snapshot::manifest::Manifest;
use crate::snapshot::{Format, SnapshotId, SnapshotInfo};
use crate::store::arrivals::Arrivals;
use crate::store::cache::RelayFeed;
use crate::store::catalog::CatalogEntry;

/// Where a relayed snapshot's bytes are.
#[derive(Clone)]
enum Held {
    /// Still arriving in a staging file.
    Receiving {
        path: PathBuf,
        file: Arc<std::fs::File>,
        arrivals: Arc<Arrivals>,
    },
    /// Installed: served from the file like any snapshot.
    Installed(CatalogEntry),
}

#[derive(Clone)]
struct Entry {
    manifest: Arc<Manifest>,
    origin: String,
    /// Its file name at the origin.
    name: String,
    held: Held,
    /// Tells a registration's guard whether the entry is still its own.
    generation: u64,
}

/// How to serve a relayed snapshot.
pub enum RelaySource {
    /// A relay image, filled as the receive's bytes land.
    Feed(RelayFeed),
    /// The installed file.
    File(CatalogEntry),
}

/// A relayed snapshot chosen for an offer.
pub struct Relayed {
    pub manifest: Arc<Manifest>,
    /// The node id of the agent whose snapshot it is.
    pub origin: String,
    /// Its file name there (a plain name, or empty).
    pub name: String,
    pub source: RelaySource,
}

/// The relayed snapshot of each format.
#[derive(Default)]
pub struct RelayTable {
    entries: Mutex<(HashMap<Format, Entry>, u64)>,
}

impl RelayTable {
    /// Registers the snapshot `manifest` describes, from agent `origin`
    /// (where it is called `name`), arriving in the staging file `path`. It
    /// stays offered while the returned guard lives, or after
    /// [`Registration::installed`]. A name that is not plain is not passed on.
    pub fn receiving(
        self: &Arc<Self>,
        (origin, name): (&str, &str),
        manifest: Arc<Manifest>,
        (path, file): (PathBuf, std::fs::File),
        arrivals: Arc<Arrivals>,
    ) -> Registration {
        let format = manifest.info.format;
        let mut entries = self.entries.lock().expect("relay lock");
        entries.1 += 1;
        let generation = entries.1;
        entries.0.insert(
            format,
            Entry {
                manifest,
                origin: origin.to_string(),
                name: if crate::peer_text::is_plain_name(name) {
                    name.to_string()
                } else {
                    String::new()
                },
                held: Held::Receiving {
                    path,
                    file: Arc::new(file),
                    arrivals,
                },
                generation,
            },
        );
        Registration {
            table: self.clone(),
            format,
            generation,
        }
    }

    /// The relayed snapshot of `format` that is `want` (any, when `None`).
    pub fn find(&self, format: Format, want: Option<&SnapshotId>) -> Option<Relayed> {
        let entries = self.entries.lock().expect("relay lock");
        let entry = entries.0.get(&format)?;
        if want.is_some_and(|id| !id.is(&entry.manifest)) {
            return None;
        }
        let source = match &entry.held {
            Held::Receiving {
                path,
                file,
                arrivals,
            } => RelaySource::Feed(RelayFeed {
                path: path.clone(),
                file: file.try_clone().ok()?,
                manifest: entry.manifest.clone(),
                arrivals: arrivals.clone(),
            }),
            Held::Installed(e) => RelaySource::File(e.clone()),
        };
        Some(Relayed {
            manifest: entry.manifest.clone(),
            origin: entry.origin.clone(),
            name: entry.name.clone(),
            source,
        })
    }

    /// Withdraws the entry for `info`'s snapshot (its file changed).
    pub fn withdraw(&self, info: &SnapshotInfo) {
        let mut entries = self.entries.lock().expect("relay lock");
        if entries
            .0
            .get(&info.format)
            .is_some_and(|e| e.manifest.info == *info)
        {
            entries.0.remove(&info.format);
        }
    }

    /// What status shows: each relayed snapshot of `instance` and its state.
    pub fn list(&self, instance: &str) -> Vec<pb::RelayEntry> {
        let entries = self.entries.lock().expect("relay lock");
        entries
            .0
            .values()
            .map(|e| pb::RelayEntry {
                snapshot: Some(e.manifest.id().into()),
                origin_node_id: e.origin.clone(),
                state: match e.held {
                    Held::Receiving { .. } => "receiving",
                    Held::Installed(_) => "installed",
                }
                .into(),
                instance: instance.to_string(),
            })
            .collect()
    }
}

/// A receiving job's hold on its relay entry: dropping it withdraws the
/// entry unless it was installed (or superseded) meanwhile.
pub struct Registration {
    table: Arc<RelayTable>,
    format: Format,
    generation: u64,
}

impl Registration {
    /// The snapshot is installed as `entry`: offered from that file from now
    /// on, until a newer one supersedes it.
    pub fn installed(self, entry: CatalogEntry) {
        let mut entries = self.table.entries.lock().expect("relay lock");
        if let Some(e) = entries.0.get_mut(&self.format) {
            if e.generation == self.generation {
                e.held = Held::Installed(entry);
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut entries = self.table.entries.lock().expect("relay lock");
        let mine = entries.0.get(&self.format).is_some_and(|e| {
            e.generation == self.generation && matches!(e.held, Held::Receiving { .. })
        });
        if mine {
            entries.0.remove(&self.format);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(seq: u64) -> Arc<Manifest> {
        let info = SnapshotInfo {
            format: Format::Kvr1,
            size: 10,
            seq,
            checksum: seq * 3,
            records: 0,
            created_ms: 0,
            repl_id: None,
        };
        let mut hasher = crate::snapshot::manifest::PieceHasher::new(1 << 20);
        hasher.update(&[0; 10]);
        Arc::new(hasher.finish(info))
    }

    fn register(table: &Arc<RelayTable>, seq: u64) -> Registration {
        let file = tempfile::tempfile().unwrap();
        let arrivals = Arc::new(Arrivals::new(vec![false]));
        table.receiving(
            ("origin", "s.kvr1"),
            manifest(seq),
            ("/x".into(), file),
            arrivals,
        )
    }

    #[test]
    fn a_failed_receive_withdraws_its_snapshot_and_a_newer_one_supersedes_it() {
        let table = Arc::new(RelayTable::default());
        let want = |seq: u64| manifest(seq).id();
        let first = register(&table, 5);
        assert!(table.find(Format::Kvr1, Some(&want(5))).is_some());
        assert!(table.find(Format::Kvr1, Some(&want(6))).is_none());
        assert!(table.find(Format::RedisRdb, None).is_none());
        drop(first);
        assert!(table.find(Format::Kvr1, None).is_none(), "withdrawn");

        let old = register(&table, 5);
        let entry = CatalogEntry {
            path: "/installed".into(),
            mtime: std::time::SystemTime::UNIX_EPOCH,
            info: manifest(5).info.clone(),
            manifest: manifest(5),
        };
        old.installed(entry);
        let found = table.find(Format::Kvr1, Some(&want(5))).unwrap();
        assert!(
            matches!(found.source, RelaySource::File(_)),
            "still offered, installed"
        );
        assert_eq!(table.list("default")[0].state, "installed");

        let newer = register(&table, 6);
        assert!(
            table.find(Format::Kvr1, Some(&want(5))).is_none(),
            "superseded"
        );
        let stale = register(&table, 7);
        drop(newer); // not its entry any more: leaves seq 7 alone
        assert!(table.find(Format::Kvr1, Some(&want(7))).is_some());
        drop(stale);
        assert!(table.list("default").is_empty());
    }
}
