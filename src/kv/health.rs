//! The local KV server's replication health as metrics.
//!
//! When the agent has a local Redis/Valkey (the primary it pre-flights, or
//! the replica a `redis` handoff seeds), it reads `INFO replication` and
//! `INFO stats` every `[redis] health_interval` and keeps the `kvsync_kv_*`
//! series true: whether the server answers and its replication link is up,
//! its replication offset, each replica's lag in bytes (on a primary), and
//! the primary's full and partial resync counters, so a resync loop or a
//! silently degraded link shows in Prometheus. Every series carries the
//! server's address (`server`); an agent without a local KV has none. What the fields mean is
//! read here; talking to the server is `redis`'s business.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounter;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::ServerAuth;
use crate::kv::redis::Info;
use crate::metrics::Metrics;

/// What one poll found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// The server is a replica (else a primary).
    pub replica: bool,
    /// In the role it should have, and linked: a replica's link to its
    /// primary is up (a server that should be a replica and is a master is
    /// down); a primary's always is.
    pub link_up: bool,
    /// `master_repl_offset` on a primary, `slave_repl_offset` on a replica.
    pub offset: u64,
    /// A primary's replicas (`ip:port`) and the bytes each has yet to
    /// acknowledge.
    pub lags: Vec<(String, u64)>,
    /// The primary's `sync_full` and `sync_partial_ok`.
    pub full_syncs: u64,
    pub partial_syncs: u64,
}

/// Reads `INFO replication` and `INFO stats` (merged) of a server that
/// should be a replica (`expect_replica`: the one a handoff seeds) or not
/// (a primary the agent follows).
pub fn read(info: &Info, expect_replica: bool) -> Health {
    let replica = matches!(info.get("role"), Some("slave" | "replica"));
    let offset = if replica {
        info.num("slave_repl_offset")
    } else {
        info.num("master_repl_offset")
    };
    let lags = (0..info.num("connected_slaves"))
        .filter_map(|i| info.get(&format!("slave{i}")))
        .filter_map(|line| {
            let field = |k: &str| {
                line.split(',')
                    .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
            };
            let acked: u64 = field("offset")?.parse().ok()?;
            let name = format!("{}:{}", field("ip")?, field("port")?);
            Some((name, offset.saturating_sub(acked)))
        })
        .collect();
    Health {
        replica,
        link_up: match replica {
            true => info.get("master_link_status") == Some("up"),
            false => !expect_replica,
        },
        offset,
        lags,
        full_syncs: info.num("sync_full"),
        partial_syncs: info.num("sync_partial_ok"),
    }
}

/// Mirrors a server counter into a Prometheus counter: it advances by what
/// the server's advanced, and by the whole new value after the server
/// restarted (its counter went back).
fn advance(counter: &IntCounter, last: &mut Option<u64>, now: u64) {
    let by = match *last {
        Some(before) if now >= before => now - before,
        _ => now,
    };
    counter.inc_by(by);
    *last = Some(now);
}

/// Polls instance `instance`'s server at `addr` (`expect_replica`: the one
/// a handoff seeds, see [`read`]) every `every` until `shutdown`, then
/// removes its gauges (a removed instance's last state must not stay on
/// dashboards).
pub async fn watch(
    (instance, addr, expect_replica): (String, String, bool),
    auth: ServerAuth,
    every: Duration,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let server = addr.as_str();
    let labels = [instance.as_str(), server];
    let (up, link_up, offset) = (
        metrics.kv_up.with_label_values(&labels),
        metrics.kv_link_up.with_label_values(&labels),
        metrics.kv_replication_offset.with_label_values(&labels),
    );
    let full_syncs = metrics.kv_full_syncs.with_label_values(&labels);
    let partial_syncs = metrics.kv_partial_syncs.with_label_values(&labels);
    let lag = &metrics.kv_replica_lag_bytes;
    let (mut full, mut partial) = (None, None);
    let mut replicas: HashSet<String> = HashSet::new();
    let mut down = false;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        let polled = crate::kv::redis::infos(&addr, &auth, &["replication", "stats"]).await;
        let health = match polled {
            Ok(info) => read(&info, expect_replica),
            Err(e) => {
                if !down {
                    warn!(error = %e, "the local KV server does not answer its health poll");
                }
                down = true;
                up.set(0);
                link_up.set(0);
                for r in replicas.drain() {
                    let _ = lag.remove_label_values(&[&instance, server, &r]);
                }
                continue;
            }
        };
        if down {
            info!(%addr, "the local KV server answers its health poll again");
            down = false;
        }
        up.set(1);
        link_up.set(health.link_up as i64);
        offset.set(health.offset as i64);
        let now: HashSet<String> = health.lags.iter().map(|(r, _)| r.clone()).collect();
        for gone in replicas.difference(&now) {
            let _ = lag.remove_label_values(&[&instance, server, gone]);
        }
        for (r, bytes) in &health.lags {
            lag.with_label_values(&[&instance, server, r])
                .set(*bytes as i64);
        }
        replicas = now;
        advance(&full_syncs, &mut full, health.full_syncs);
        advance(&partial_syncs, &mut partial, health.partial_syncs);
    }
    for r in &replicas {
        let _ = lag.remove_label_values(&[&instance, server, r]);
    }
    for gauge in [
        &metrics.kv_up,
        &metrics.kv_link_up,
        &metrics.kv_replication_offset,
    ] {
        let _ = gauge.remove_label_values(&labels);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_primary_and_a_replica_read_from_their_info() {
        let primary = Info::parse(
            "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
             slave0:ip=10.0.0.2,port=6379,state=online,offset=900,lag=0\r\n\
             slave1:ip=10.0.0.3,port=6380,state=online,offset=1000,lag=1\r\n\
             master_repl_offset:1000\r\n# Stats\r\nsync_full:3\r\nsync_partial_ok:7\r\n",
        );
        assert_eq!(
            read(&primary, false),
            Health {
                replica: false,
                link_up: true,
                offset: 1000,
                lags: vec![("10.0.0.2:6379".into(), 100), ("10.0.0.3:6380".into(), 0)],
                full_syncs: 3,
                partial_syncs: 7,
            }
        );
        let replica = Info::parse(
            "role:slave\r\nmaster_link_status:down\r\nslave_repl_offset:42\r\nmaster_repl_offset:50\r\n",
        );
        let h = read(&replica, true);
        assert!(h.replica && !h.link_up && h.lags.is_empty());
        assert_eq!(h.offset, 42);
        // A seeded or fed server that is a master: its link is down.
        let master = Info::parse("role:master\r\nmaster_repl_offset:50\r\n");
        assert!(!read(&master, true).link_up);
        assert!(read(&master, false).link_up);
    }

    #[test]
    fn mirrored_counters_survive_a_server_restart() {
        let c = IntCounter::new("c", "c").unwrap();
        let mut last = None;
        for now in [5, 7, 7, 2, 4] {
            advance(&c, &mut last, now);
        }
        // 5, +2, +0, restart: +2, +2.
        assert_eq!(c.get(), 11);
    }
}
