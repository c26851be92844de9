//! Snapshot side, end to end: the `gen-snapshot`/`verify` CLI, the directory
//! watcher and catalog, the shared cache, and the agent's `/metrics`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvsync::config::WatchConfig;
use kvsync::metrics::Metrics;
use kvsync::snapshot::{self, Format};
use kvsync::store::cache::{CacheError, SnapshotCache};
use kvsync::store::catalog::{Catalog, CatalogEntry};
use kvsync::store::watch::DirWatcher;
use tokio_util::sync::CancellationToken;

fn tmpdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(kvsync_bin())
        .args(args)
        .output()
        .expect("run kvsync")
}

// ---------------------------------------------------------------- CLI

#[test]
fn gen_snapshot_sizes_are_exact() {
    let dir = tmpdir();
    for (arg, bytes) in [
        ("36", 36u64),
        ("1000", 1000),
        ("1KiB", 1024),
        ("3MiB", 3 << 20),
        ("65539", 65539),
    ] {
        let out = dir.path().join(format!("s-{bytes}.kvr1"));
        let o = run(&[
            "gen-snapshot",
            "--format",
            "kvr1",
            "--size",
            arg,
            "--seq",
            "5",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(std::fs::metadata(&out).unwrap().len(), bytes, "size {arg}");
        let info = snapshot::verify_file(&out, None).unwrap();
        assert_eq!((info.seq, info.size), (5, bytes));
    }
    // No temp files left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn gen_snapshot_refuses_inexpressible_sizes() {
    let dir = tmpdir();
    let out = dir.path().join("bad.kvr1");
    for size in ["20", "40"] {
        let o = run(&[
            "gen-snapshot",
            "--size",
            size,
            "--seq",
            "1",
            out.to_str().unwrap(),
        ]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("cannot be expressed"), "{err}");
        assert!(!out.exists());
    }
}

#[test]
fn verify_exit_codes_and_json() {
    let dir = tmpdir();
    let good = dir.path().join("good.kvr1");
    gen_snapshot(&good, 100_000, 77);

    let o = run(&["verify", good.to_str().unwrap()]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("seq 77"));

    let o = run(&["verify", "--json", good.to_str().unwrap()]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "kvr1");
    assert_eq!(v["size"], 100_000);
    assert_eq!(v["seq"], 77);
    assert_eq!(v["checksum_ok"], true);

    let mut bytes = std::fs::read(&good).unwrap();
    bytes[5000] ^= 0x10;
    let bad = dir.path().join("bad.kvr1");
    std::fs::write(&bad, &bytes).unwrap();
    let o = run(&["verify", "--json", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["checksum_ok"], false);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bad.kvr1") && err.contains("offset"), "{err}");

    let truncated = dir.path().join("cut.kvr1");
    std::fs::write(&truncated, &bytes[..30]).unwrap();
    let o = run(&["verify", truncated.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated header"));

    let o = run(&["verify", dir.path().join("missing").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("missing"));
}

// ---------------------------------------------------------------- watcher

struct Watched {
    catalog: Arc<Catalog>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn start_watcher(dir: &Path) -> Watched {
    start_watcher_rescanning(dir, Duration::from_secs(30))
}

fn start_watcher_rescanning(dir: &Path, rescan_interval: Duration) -> Watched {
    let metrics = Metrics::new();
    let catalog = Catalog::new(metrics.clone(), "default");
    let config = WatchConfig {
        debounce: Duration::from_millis(50),
        rescan_interval,
    };
    let w = DirWatcher::new(
        dir.to_owned(),
        (Format::Kvr1, 1 << 20),
        catalog.clone(),
        metrics.clone(),
        config,
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn(w.run(stop.clone()));
    Watched {
        catalog,
        metrics,
        stop,
        task,
    }
}

impl Watched {
    /// Waits until `cond` holds for the catalog, re-checking on every change.
    async fn until(&self, what: &str, cond: impl Fn(&Catalog) -> bool) {
        let mut rx = self.catalog.subscribe();
        let check = async {
            loop {
                if cond(&self.catalog) {
                    return;
                }
                rx.changed().await.expect("catalog alive");
            }
        };
        tokio::time::timeout(DEADLINE, check)
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
    }

    fn rejected(&self, reason: &str) -> u64 {
        self.metrics
            .snapshots_rejected
            .with_label_values(&["default", reason])
            .get()
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap();
    }
}

fn gen_bytes(size: u64, seq: u64) -> Vec<u8> {
    let spec = snapshot::kvr1::GenSpec {
        size,
        seq,
        created_ms: 0,
        seed: seq,
    };
    let mut v = Vec::new();
    spec.write_to(&mut v).unwrap();
    v
}

#[tokio::test]
async fn watcher_offers_snapshot_renamed_into_place() {
    let dir = tmpdir();
    // One snapshot already there at start (initial scan).
    std::fs::write(dir.path().join("old.kvr1"), gen_bytes(5000, 3)).unwrap();
    let w = start_watcher(dir.path());
    w.until("initial scan", |c| {
        c.latest(Format::Kvr1).map(|e| e.info.seq) == Some(3)
    })
    .await;

    let tmp = dir.path().join(".incoming.tmp");
    std::fs::write(&tmp, gen_bytes(70_000, 9)).unwrap();
    let path = dir.path().join("snap-9.kvr1");
    std::fs::rename(&tmp, &path).unwrap();
    w.until("renamed snapshot", |c| {
        c.latest(Format::Kvr1).map(|e| e.info.seq) == Some(9)
    })
    .await;
    let e = w.catalog.get(&path).unwrap();
    assert_eq!(e.info.size, 70_000);
    assert_eq!(w.catalog.list().len(), 2);
    assert!(w.catalog.get(&tmp).is_none());
    assert_eq!(
        w.metrics
            .snapshot_latest_seq
            .with_label_values(&["default", "kvr1"])
            .get(),
        9
    );

    std::fs::remove_file(&path).unwrap();
    w.until("removal", |c| {
        c.latest(Format::Kvr1).map(|e| e.info.seq) == Some(3)
    })
    .await;
    w.stop().await;
}

#[tokio::test]
async fn periodic_rescan_finds_a_change_the_kernel_does_not_report() {
    // inotify reports no writes made through a shared mapping (inotify(7)),
    // and a mapping made before the watch starts raises no open or close
    // event: only the rescan can see this change (by the mtime the write
    // fault sets; the directory is on the build disk, not a tmpfs).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("snap-4.kvr1");
    std::fs::write(&path, gen_bytes(100_000, 4)).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    // SAFETY: this test is the only user of the file while it is mapped.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
    drop(file); // the mapping keeps the file open: no close event yet
    let w = start_watcher_rescanning(dir.path(), Duration::from_millis(200));
    w.until("initial scan", |c| c.get(&path).is_some()).await;

    map[50_000] ^= 0x01;
    w.until("the rescan drops the changed file", |c| {
        c.get(&path).is_none()
    })
    .await;
    assert_eq!(w.rejected("checksum_mismatch"), 1);
    drop(map);
    w.stop().await;
}

#[tokio::test]
async fn watcher_never_offers_partial_and_counts_corrupt() {
    let dir = tmpdir();
    let w = start_watcher(dir.path());
    let full = gen_bytes(200_000, 11);

    // A partially written file sits there: rejected once, never offered.
    let path = dir.path().join("snap-11.kvr1");
    std::fs::write(&path, &full[..120_000]).unwrap();
    wait_for_async("partial file rejected", DEADLINE, || async {
        (w.rejected("truncated") == 1).then_some(())
    })
    .await;
    assert!(w.catalog.get(&path).is_none());

    // The writer finishes: now it is offered.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(&full[120_000..]).unwrap();
    }
    w.until("completed file", |c| c.get(&path).is_some()).await;
    assert_eq!(
        w.rejected("truncated"),
        1,
        "rejection logged and counted once"
    );

    // A corrupt file is rejected and counted, never offered.
    let mut bad = gen_bytes(50_000, 12);
    bad[40_000] ^= 1;
    let bad_path = dir.path().join("snap-12.kvr1");
    std::fs::write(&bad_path, &bad).unwrap();
    wait_for_async("corrupt file rejected", DEADLINE, || async {
        (w.rejected("checksum_mismatch") == 1).then_some(())
    })
    .await;
    assert!(w.catalog.get(&bad_path).is_none());
    assert_eq!(w.catalog.latest(Format::Kvr1).unwrap().info.seq, 11);
    w.stop().await;
}

#[tokio::test]
async fn watcher_survives_directory_removed_and_recreated() {
    let parent = tmpdir();
    let dir = parent.path().join("snapshots");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("a.kvr1"), gen_bytes(1000, 1)).unwrap();
    let w = start_watcher(&dir);
    w.until("first snapshot", |c| c.list().len() == 1).await;

    std::fs::remove_dir_all(&dir).unwrap();
    w.until("directory gone", |c| c.list().is_empty()).await;

    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join(".b.tmp"), gen_bytes(2000, 2)).unwrap();
    std::fs::rename(dir.join(".b.tmp"), dir.join("b.kvr1")).unwrap();
    w.until("snapshot in recreated directory", |c| {
        c.latest(Format::Kvr1).map(|e| e.info.seq) == Some(2)
    })
    .await;
    w.stop().await;
}

// ---------------------------------------------------------------- cache

fn entry_for(path: &Path) -> CatalogEntry {
    let mtime = std::fs::metadata(path).unwrap().modified().unwrap();
    CatalogEntry::scan(path, Format::Kvr1, 1 << 20, mtime).unwrap()
}

fn write_snapshot(path: &Path, size: u64, seq: u64) -> Vec<u8> {
    let bytes = gen_bytes(size, seq);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, &bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cache_eight_concurrent_acquirers_share_one_load() {
    let dir = tmpdir();
    let path = dir.path().join("s.kvr1");
    let bytes = write_snapshot(&path, 3 << 20, 4);
    let metrics = Metrics::new();
    let cache = SnapshotCache::new(1 << 30, Duration::from_secs(5), metrics.clone());
    let entry = entry_for(&path);
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (cache, entry, barrier) = (cache.clone(), entry.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            cache.acquire("default", &entry).await.unwrap()
        }));
    }
    let mut refs = Vec::new();
    for t in tasks {
        refs.push(t.await.unwrap());
    }
    refs[0].complete().await.unwrap();
    assert_eq!(metrics.cache_loads.get(), 1, "exactly one load");
    assert_eq!(metrics.cache_hits.get(), 7);
    assert_eq!(metrics.cache_refs.get(), 8);
    assert_eq!(metrics.cache_entries.get(), 1);
    assert_eq!(metrics.cache_bytes.get(), 3 << 20);
    let ptr = refs[0].as_ptr();
    for r in &refs {
        assert_eq!(r.as_ptr(), ptr, "one shared buffer");
        assert_eq!(r.as_ptr() as usize % 4096, 0, "page aligned");
    }
    assert_eq!(refs[3].wait_complete().unwrap(), &bytes[..]);
    assert_eq!(refs[5].wait_loaded(1000).unwrap(), &bytes[..1000]);
    drop(refs);
    assert_eq!(cache.entries(), 0);
    assert_eq!(
        metrics.cache_bytes.get(),
        0,
        "last release frees the buffer"
    );
    assert_eq!(metrics.cache_refs.get(), 0);
}

#[tokio::test]
async fn cache_replaced_file_gets_new_entry_old_holder_keeps_old_bytes() {
    let dir = tmpdir();
    let path = dir.path().join("s.kvr1");
    let old = write_snapshot(&path, 100_000, 1);
    let metrics = Metrics::new();
    let cache = SnapshotCache::new(1 << 30, Duration::from_secs(5), metrics.clone());
    let old_entry = entry_for(&path);
    let holder = cache.acquire("default", &old_entry).await.unwrap();
    // The file is replaced right after the acquisition: the holder opened
    // it already and still gets the old bytes.

    let new = write_snapshot(&path, 120_000, 2);
    let new_entry = entry_for(&path);
    let fresh = cache.acquire("default", &new_entry).await.unwrap();
    fresh.complete().await.unwrap();
    holder.complete().await.unwrap();
    assert_eq!(
        holder.wait_complete().unwrap(),
        &old[..],
        "holder reads the old snapshot"
    );
    assert_eq!(
        fresh.wait_complete().unwrap(),
        &new[..],
        "new acquirer reads the new one"
    );
    assert_eq!(cache.entries(), 2);
    assert_eq!(metrics.cache_loads.get(), 2);

    // The old entry can no longer be loaded from disk: clear error.
    drop(holder);
    assert_eq!(cache.entries(), 1);
    match cache.acquire("default", &old_entry).await {
        Err(CacheError::Changed { path: p }) => assert_eq!(p, path),
        other => panic!("expected Changed, got {:?}", other.map(|_| ())),
    }
    drop(fresh);
    assert_eq!(cache.entries(), 0);
    assert_eq!(metrics.cache_bytes.get(), 0);
}

#[tokio::test]
async fn cache_budget_waits_then_fails_or_proceeds() {
    let dir = tmpdir();
    let (a, b): (PathBuf, PathBuf) = (dir.path().join("a.kvr1"), dir.path().join("b.kvr1"));
    write_snapshot(&a, 600_000, 1);
    write_snapshot(&b, 600_000, 2);
    let metrics = Metrics::new();

    // Larger than the whole budget: refused at once.
    let tiny = SnapshotCache::new(1000, Duration::from_secs(5), metrics.clone());
    assert!(matches!(
        tiny.acquire("default", &entry_for(&a)).await,
        Err(CacheError::TooLarge { .. })
    ));

    // Room for one: the second waits, and fails when nothing is released.
    let cache = SnapshotCache::new(1_000_000, Duration::from_millis(200), metrics.clone());
    let held = cache.acquire("default", &entry_for(&a)).await.unwrap();
    let err = cache
        .acquire("default", &entry_for(&b))
        .await
        .err()
        .expect("over budget");
    assert!(matches!(err, CacheError::OverBudget { .. }), "{err}");
    assert!(err.to_string().contains("retry later"));
    // The same snapshot is still shared within budget.
    let shared = cache.acquire("default", &entry_for(&a)).await.unwrap();
    drop(shared);

    // Waiting acquirer proceeds as soon as the holder releases.
    let cache = SnapshotCache::new(1_000_000, DEADLINE, metrics.clone());
    let held2 = cache.acquire("default", &entry_for(&a)).await.unwrap();
    let (c2, eb) = (cache.clone(), entry_for(&b));
    let mut waiter = tokio::spawn(async move { c2.acquire("default", &eb).await.map(|r| r.len()) });
    // The waiter runs (this await yields to it) and blocks: it cannot
    // finish while `held2` exists.
    let blocked = tokio::time::timeout(Duration::from_millis(300), &mut waiter).await;
    assert!(
        blocked.is_err(),
        "the waiter got past a full budget: {blocked:?}"
    );
    assert_eq!(cache.refs(), 1);
    drop(held2);
    assert_eq!(waiter.await.unwrap().unwrap(), 600_000);
    drop(held);
}

#[tokio::test]
async fn an_instance_borrows_idle_room_but_one_within_its_share_is_served_first() {
    let dir = tmpdir();
    let files: Vec<PathBuf> = (0..4)
        .map(|i| {
            let p = dir.path().join(format!("{i}.kvr1"));
            write_snapshot(&p, 600_000, i + 1);
            p
        })
        .collect();
    let metrics = Metrics::new();
    // Two instances: each is guaranteed one image's room of the two.
    let cache = SnapshotCache::new(1_200_000, DEADLINE, metrics.clone());
    cache.set_instances(2);
    let a1 = cache.acquire("a", &entry_for(&files[0])).await.unwrap();
    // b is idle: a borrows its room.
    let a2 = cache.acquire("a", &entry_for(&files[1])).await.unwrap();
    // b, within its share, waits for room; so does a's third load.
    let (c, e) = (cache.clone(), entry_for(&files[2]));
    let mut b = tokio::spawn(async move { c.acquire("b", &e).await });
    let (c, e) = (cache.clone(), entry_for(&files[3]));
    let mut a3 = tokio::spawn(async move { c.acquire("a", &e).await });
    for waiter in [&mut b, &mut a3] {
        let blocked = tokio::time::timeout(Duration::from_millis(200), waiter).await;
        assert!(blocked.is_err(), "got past a full budget");
    }
    // The room a gives back goes to b, not to a's third load.
    drop(a1);
    let b = b.await.unwrap().unwrap();
    assert_eq!(b.len(), 600_000);
    let blocked = tokio::time::timeout(Duration::from_millis(200), &mut a3).await;
    assert!(blocked.is_err(), "a borrowed room b was waiting for");
    drop(a2);
    assert_eq!(a3.await.unwrap().unwrap().len(), 600_000);
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_image_lingers_for_stragglers_and_yields_to_new_loads() {
    let dir = tmpdir();
    let (a, b): (PathBuf, PathBuf) = (dir.path().join("a.kvr1"), dir.path().join("b.kvr1"));
    write_snapshot(&a, 600_000, 1);
    write_snapshot(&b, 600_000, 2);
    let metrics = Metrics::new();
    // Room for one image; released images linger.
    let cache = SnapshotCache::new(1_000_000, Duration::from_millis(200), metrics.clone());
    cache.set_linger(Duration::from_secs(3600));
    // Only a verified image lingers: each holder here waits for its load.
    let loaded = |r: kvsync::store::cache::CacheRef| async move {
        tokio::task::spawn_blocking(move || {
            r.wait_complete().unwrap();
            r
        })
        .await
        .unwrap()
    };
    drop(loaded(cache.acquire("default", &entry_for(&a)).await.unwrap()).await);
    assert_eq!((cache.refs(), cache.entries()), (0, 1), "lingering");
    // A straggler reuses it: no second load.
    drop(cache.acquire("default", &entry_for(&a)).await.unwrap());
    assert_eq!(metrics.cache_loads.get(), 1);
    assert_eq!(metrics.cache_hits.get(), 1);
    // Another snapshot needs the room: the lingering image gives it up at
    // once instead of making the load wait.
    let other = loaded(cache.acquire("default", &entry_for(&b)).await.unwrap()).await;
    assert_eq!((cache.refs(), cache.entries()), (1, 1));
    assert_eq!(metrics.cache_loads.get(), 2);
    drop(other);
    // Expired lingering images are freed by the sweep.
    cache.set_linger(Duration::ZERO);
    assert_eq!(cache.sweep(), 1);
    assert_eq!((cache.entries(), metrics.cache_bytes.get()), (0, 0));
}

#[tokio::test]
async fn cache_load_failure_reaches_every_holder() {
    let dir = tmpdir();
    let path = dir.path().join("s.kvr1");
    write_snapshot(&path, 200_000, 1);
    let metrics = Metrics::new();
    let cache = SnapshotCache::new(1 << 30, Duration::from_secs(5), metrics.clone());
    // The catalog believed in other bytes (rewritten in place, same size and mtime).
    let mut entry = entry_for(&path);
    entry.info.checksum ^= 1;
    let a = cache.acquire("default", &entry).await.unwrap();
    let b = cache.acquire("default", &entry).await.unwrap();
    for r in [&a, &b] {
        let err = r.complete().await.unwrap_err();
        assert!(
            err.to_string().contains("changed since it was offered"),
            "{err}"
        );
    }
    drop((a, b));
    assert_eq!(cache.entries(), 0);
}

// ---------------------------------------------------------------- agent

#[test]
fn agent_serves_metrics_with_catalog_gauges() {
    let dir = tmpdir();
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    gen_snapshot(&snaps.join("s1.kvr1"), 10_000, 41);
    std::fs::write(
        snaps.join("junk.kvr1"),
        b"not a snapshot at all, definitely not",
    )
    .unwrap();
    let agent = AgentProcess::start(
        &[
            "--node-id",
            "t1",
            "--snapshot-dir",
            snaps.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--data-listen",
            "127.0.0.1:0",
        ],
        dir.path(),
    );
    let scrape = wait_for("latest seq gauge", DEADLINE, || {
        let s = agent.metrics();
        (metric_value(&s, "kvsync_snapshot_latest_seq{format=\"kvr1\"}") == Some(41.0)).then_some(s)
    });
    assert_eq!(
        metric_value(&scrape, "kvsync_snapshot_latest_bytes{format=\"kvr1\"}"),
        Some(10_000.0)
    );
    let scrape = wait_for("rejection counted", DEADLINE, || {
        let s = agent.metrics();
        metric_value(
            &s,
            "kvsync_snapshots_rejected_total{reason=\"not_a_snapshot\"}",
        )
        .map(|_| s)
    });
    for name in [
        "kvsync_snapshot_cache_bytes",
        "kvsync_snapshot_cache_entries",
        "kvsync_snapshot_cache_refs",
        "kvsync_snapshot_cache_loads_total",
        "kvsync_snapshot_cache_hits_total",
        "kvsync_build_info{faults=\"true\"",
        "kvsync_rdma_available",
    ] {
        assert!(
            scrape.lines().any(|l| l.starts_with(name)),
            "{name} missing from scrape:\n{scrape}"
        );
    }
}

#[test]
fn agent_reports_every_config_problem() {
    let dir = tmpdir();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "snapshot_dir = \"rel\"\n[transport]\nchunk_mb = 0\n[grpc]\nlisten = \"x\"\n",
    )
    .unwrap();
    let o = run(&["agent", "--config", cfg.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    for key in ["snapshot_dir", "transport.chunk_mb", "grpc.listen"] {
        assert!(err.contains(key), "{key} not reported:\n{err}");
    }
    let o = run(&["check-config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("3 problems") && err.contains("transport.chunk_mb"),
        "{err}"
    );
    let o = run(&[
        "check-config",
        concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kvsync.toml"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).ends_with(": ok\n"));
    std::fs::write(&cfg, "[metrics]\nlisten = \"0.0.0.0:9464\"\n").unwrap();
    let o = run(&["check-config", cfg.to_str().unwrap()]);
    assert!(o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("warning: metrics.listen 0.0.0.0:9464"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::write(&cfg, "[grpc]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
    let o = run(&["agent", "--config", cfg.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("bogus"));
}

#[test]
fn check_config_names_both_instances_that_share_a_directory_and_each_instances_problem() {
    let dir = tmpdir();
    let cfg = dir.path().join("instances.toml");
    let table = |name: &str, dir: &str, extra: &str| {
        format!("[[instance]]\nname = \"{name}\"\nsnapshot_dir = \"{dir}\"\n{extra}")
    };
    std::fs::write(
        &cfg,
        [
            table("shard-1", "/var/lib/kv/one", ""),
            table("shard-2", "/var/lib/kv/one/", ""),
            table(
                "shard-3",
                "/var/lib/kv/three",
                "[instance.handoff]\nmode = \"exec\"\n",
            ),
        ]
        .concat(),
    )
    .unwrap();
    let o = run(&["check-config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "instances \"shard-1\" and \"shard-2\" share the snapshot_dir /var/lib/kv/one"
        ),
        "{err}"
    );
    assert!(
        err.contains("instance.shard-3.handoff.exec: mode \"exec\" needs a program"),
        "{err}"
    );
    assert!(err.contains("2 problems"), "{err}");
    // With instances, the per-instance keys are not at the top level.
    std::fs::write(
        &cfg,
        format!("snapshot_dir = \"/x\"\n{}", table("a", "/y", "")),
    )
    .unwrap();
    let o = run(&["check-config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("belong in each [[instance]]"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
