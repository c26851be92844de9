//! An independent consistency check of a Redis/Valkey replica against its
//! primary, which does not trust the replication link it checks.
//!
//! [`check`] samples keys on the primary (all of them when there are no
//! more than the sample, else `RANDOMKEY`), reads each one's
//! serialized value (`DUMP`) on both servers and compares them. A write in
//! flight is not a mismatch: a round reads the primary's offset, its
//! values, waits until the replica has processed that offset, reads the
//! replica's values, then the primary's again; a key counts as differing
//! only when the primary's value stayed the same across the round and the
//! replica's is another. A key the primary changed meanwhile is checked
//! again in the next round (at most [`ROUNDS`]), and reported as unsettled
//! if it never held still. Two `DUMP`s can differ for the same value (a set
//! or hash serialized in another iteration order), so differing dumps are
//! compared once more by content before they count.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::config::ServerAuth;
use crate::kv::redis::{connect, server_err, Info, RedisError};

/// Rounds a key that keeps changing is checked in.
pub const ROUNDS: usize = 3;
/// How long the replica may take to reach the primary's offset.
const CATCH_UP: Duration = Duration::from_secs(30);
/// Keys per pipelined batch.
const BATCH: usize = 500;

/// What a check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Keys sampled (the unsettled ones included).
    pub checked: usize,
    /// Keys whose value differs on the replica (sorted).
    pub mismatches: Vec<String>,
    /// Keys the primary changed in every round, so never compared.
    pub unsettled: Vec<String>,
}

/// Compares up to `sample` keys of `primary` with `replica`.
pub async fn check(
    primary: &str,
    replica: &str,
    auth: &ServerAuth,
    sample: usize,
) -> Result<Report, RedisError> {
    let mut p = connect(primary, auth).await?;
    let mut r = connect(replica, auth).await?;
    let keys = sample_keys(&mut p, primary, sample).await?;
    let mut report = Report {
        checked: keys.len(),
        ..Report::default()
    };
    for batch in keys.chunks(BATCH) {
        let mut pending: Vec<String> = batch.to_vec();
        for _ in 0..ROUNDS {
            if pending.is_empty() {
                break;
            }
            pending = round(&mut p, &mut r, (primary, replica), pending, &mut report).await?;
        }
        report.unsettled.extend(pending);
    }
    report.mismatches.sort();
    report.unsettled.sort();
    Ok(report)
}

/// One round over `keys`: records the mismatches, returns the keys the
/// primary changed meanwhile.
async fn round(
    p: &mut MultiplexedConnection,
    r: &mut MultiplexedConnection,
    (primary, replica): (&str, &str),
    keys: Vec<String>,
    report: &mut Report,
) -> Result<Vec<String>, RedisError> {
    let before = dumps(p, primary, &keys).await?;
    let offset = repl_offset(p, primary, "master_repl_offset").await?;
    caught_up(r, replica, offset).await?;
    let theirs = dumps(r, replica, &keys).await?;
    let after = dumps(p, primary, &keys).await?;
    let mut changed = Vec::new();
    for (i, key) in keys.into_iter().enumerate() {
        if before[i] != after[i] {
            changed.push(key);
        } else if theirs[i] != before[i] && !same_content(p, r, (primary, replica), &key).await? {
            report.mismatches.push(key);
        }
    }
    Ok(changed)
}

/// Up to `sample` keys of the server: all of them (`SCAN`) when it holds
/// no more, else a random sample (`RANDOMKEY`, repeats dropped), so that
/// periodic checks look at different keys each time.
async fn sample_keys(
    con: &mut MultiplexedConnection,
    addr: &str,
    sample: usize,
) -> Result<Vec<String>, RedisError> {
    let err = |e| server_err(addr, e);
    let size: usize = redis::cmd("DBSIZE").query_async(con).await.map_err(err)?;
    if size > sample {
        let mut pipe = redis::pipe();
        for _ in 0..sample {
            pipe.cmd("RANDOMKEY");
        }
        let keys: Vec<Option<String>> = pipe.query_async(con).await.map_err(err)?;
        let unique: std::collections::BTreeSet<String> = keys.into_iter().flatten().collect();
        return Ok(unique.into_iter().collect());
    }
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(con)
            .await
            .map_err(err)?;
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            // A key written meanwhile may make SCAN return more, or twice.
            keys.sort();
            keys.dedup();
            keys.truncate(sample);
            return Ok(keys);
        }
    }
}

/// `DUMP` of each key (`None`: no such key).
async fn dumps(
    con: &mut MultiplexedConnection,
    addr: &str,
    keys: &[String],
) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("DUMP").arg(k);
    }
    pipe.query_async(con).await.map_err(|e| server_err(addr, e))
}

async fn repl_offset(
    con: &mut MultiplexedConnection,
    addr: &str,
    field: &str,
) -> Result<u64, RedisError> {
    let text: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(con)
        .await
        .map_err(|e| server_err(addr, e))?;
    Ok(Info::parse(&text).num(field))
}

/// Waits until the replica has processed the primary's stream up to
/// `offset`.
async fn caught_up(
    con: &mut MultiplexedConnection,
    addr: &str,
    offset: u64,
) -> Result<(), RedisError> {
    let started = Instant::now();
    while repl_offset(con, addr, "slave_repl_offset").await? < offset {
        if started.elapsed() > CATCH_UP {
            return Err(RedisError::Timeout {
                what: format!("replica {addr} to reach the primary's offset {offset}"),
                after: CATCH_UP,
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Whether `key` holds the same content on both servers, whatever order
/// its members were serialized in.
async fn same_content(
    p: &mut MultiplexedConnection,
    r: &mut MultiplexedConnection,
    (primary, replica): (&str, &str),
    key: &str,
) -> Result<bool, RedisError> {
    let (ours, theirs) = (
        content(p, primary, key).await?,
        content(r, replica, key).await?,
    );
    Ok(matches!((ours, theirs), (Some(a), Some(b)) if a == b))
}

/// A key's type and members in a canonical order; `None` for a type whose
/// content is only comparable as a dump.
async fn content(
    con: &mut MultiplexedConnection,
    addr: &str,
    key: &str,
) -> Result<Option<(String, BTreeMap<Vec<u8>, Vec<u8>>)>, RedisError> {
    let err = |e| server_err(addr, e);
    let kind: String = redis::cmd("TYPE")
        .arg(key)
        .query_async(con)
        .await
        .map_err(err)?;
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = match kind.as_str() {
        "hash" => redis::cmd("HGETALL")
            .arg(key)
            .query_async(con)
            .await
            .map_err(err)?,
        "zset" => redis::cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(con)
            .await
            .map_err(err)?,
        "set" => {
            let members: Vec<Vec<u8>> = redis::cmd("SMEMBERS")
                .arg(key)
                .query_async(con)
                .await
                .map_err(err)?;
            members.into_iter().map(|m| (m, Vec::new())).collect()
        }
        _ => return Ok(None),
    };
    Ok(Some((kind, pairs.into_iter().collect())))
}

/// On a replica's agent: checks the local server against its primary every
/// `every`, counting mismatches in `kvsync_kv_consistency_mismatches_total`,
/// until `shutdown`.
pub async fn every(
    instance: String,
    (primary, replica): (String, String),
    auth: ServerAuth,
    (every, sample): (Duration, usize),
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let counter = metrics
        .kv_consistency_mismatches
        .with_label_values(&[instance.as_str(), replica.as_str()]);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match check(&primary, &replica, &auth, sample).await {
            Ok(report) if report.mismatches.is_empty() => {
                tracing::debug!(
                    checked = report.checked,
                    "replica consistent with its primary"
                )
            }
            Ok(report) => {
                counter.inc_by(report.mismatches.len() as u64);
                let keys: Vec<String> = report
                    .mismatches
                    .iter()
                    .take(20)
                    .map(|k| crate::peer_text::escape_controls(k).into_owned())
                    .collect();
                tracing::warn!(
                    checked = report.checked,
                    mismatches = report.mismatches.len(),
                    ?keys,
                    "replica differs from its primary"
                );
            }
            Err(e) => tracing::warn!(error = %e, "consistency check could not run"),
        }
    }
}
