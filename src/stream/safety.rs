//! The primary's write safety as the agent that follows it sees it: its
//! `min-replicas-to-write` condition (enough replicas within
//! `min-replicas-max-lag`, or it refuses writes), read once a second and
//! shown in status and `kvsync_stream_write_safety_degraded`, with since when
//! it is degraded and why: the signal that a stream meant to be
//! acknowledged by replicas no longer is. The judgement ([`judge`]) is
//! plain code; [`write_safety`] reads the primary and reports it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::SharedLog;
use crate::config::ServerAuth;
use crate::kv::redis::{connect, info, Info, RedisError};
use crate::metrics::Metrics;

/// How often the primary's condition is read.
pub const EVERY: Duration = Duration::from_secs(1);

/// The primary's `min-replicas-to-write` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// `min-replicas-to-write` is 0: writes never wait for replicas.
    NotRequired,
    Holds {
        good: u64,
        min: u64,
        max_lag: u64,
    },
    Degraded {
        good: u64,
        min: u64,
        max_lag: u64,
    },
}

/// The condition from the primary's settings and its replication info:
/// its own count of good replicas when it keeps one, else the online
/// replicas whose last acknowledgement is at most `max_lag` seconds old.
pub fn judge(min: u64, max_lag: u64, repl: &Info) -> Condition {
    if min == 0 {
        return Condition::NotRequired;
    }
    let good = match repl.get("min_slaves_good_slaves") {
        Some(n) => n.parse().unwrap_or(0),
        None => (0..repl.num("connected_slaves"))
            .filter_map(|i| repl.get(&format!("slave{i}")))
            .filter(|line| {
                let field = |k: &str| {
                    line.split(',')
                        .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
                };
                field("state") == Some("online")
                    && field("lag").and_then(|l| l.parse::<u64>().ok()) <= Some(max_lag)
            })
            .count() as u64,
    };
    match good >= min {
        true => Condition::Holds { good, min, max_lag },
        false => Condition::Degraded { good, min, max_lag },
    }
}

/// What status says of `c`, degraded for `for_` so far.
fn describe(c: &Condition, for_: Duration) -> String {
    match c {
        Condition::NotRequired => "not required (min-replicas-to-write 0)".into(),
        Condition::Holds { good, min, max_lag } => {
            format!("holds: {good} replicas within {max_lag} s, {min} required")
        }
        Condition::Degraded { good, min, max_lag } => format!(
            "degraded for {} s: {good} replicas within {max_lag} s, min-replicas-to-write asks {min}: the primary refuses writes",
            for_.as_secs()
        ),
    }
}

/// Reads the primary's condition every [`EVERY`] until `stop` into the
/// stream's status and `kvsync_stream_write_safety_degraded`, and clears
/// both when stopped.
pub async fn write_safety(
    (instance, primary): (String, String),
    auth: ServerAuth,
    metrics: Arc<Metrics>,
    stream: SharedLog,
    stop: CancellationToken,
) {
    let degraded = metrics
        .stream_write_safety_degraded
        .with_label_values(&[&instance]);
    let mut since: Option<Instant> = None;
    loop {
        if stop.is_cancelled() {
            // No longer this primary's replica (a failover): nothing to say.
            degraded.set(0);
            stream.set_write_safety(String::new());
            return;
        }
        match read(&primary, &auth).await {
            Ok(c) => {
                let bad = matches!(c, Condition::Degraded { .. });
                let from = match (bad, since) {
                    (false, _) => None,
                    (true, Some(t)) => Some(t),
                    (true, None) => Some(Instant::now()),
                };
                since = from;
                degraded.set(bad as i64);
                stream.set_write_safety(describe(&c, from.map_or(Duration::ZERO, |t| t.elapsed())));
            }
            Err(e) => stream.set_write_safety(format!("unknown: {e}")),
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(EVERY) => {}
        }
    }
}

async fn read(primary: &str, auth: &ServerAuth) -> Result<Condition, RedisError> {
    let mut con = connect(primary, auth).await?;
    let min = crate::kv::seed::config_get(&mut con, primary, "min-replicas-to-write").await?;
    let lag = crate::kv::seed::config_get(&mut con, primary, "min-replicas-max-lag").await?;
    let repl = info(primary, auth, "replication").await?;
    Ok(judge(
        min.parse().unwrap_or(0),
        lag.parse().unwrap_or(0),
        &repl,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_condition_is_the_primarys_count_else_its_replicas_within_the_lag() {
        let repl = |text: &str| Info::parse(&format!("# Replication\r\n{text}\r\n"));
        assert_eq!(judge(0, 10, &repl("")), Condition::NotRequired);
        let counted = repl("connected_slaves:2\r\nmin_slaves_good_slaves:1");
        assert_eq!(
            judge(1, 10, &counted),
            Condition::Holds {
                good: 1,
                min: 1,
                max_lag: 10
            }
        );
        assert_eq!(
            judge(2, 10, &counted),
            Condition::Degraded {
                good: 1,
                min: 2,
                max_lag: 10
            }
        );
        let listed = repl(
            "connected_slaves:3\r\nslave0:ip=a,port=1,state=online,offset=5,lag=0\r\nslave1:ip=b,port=1,state=online,offset=5,lag=11\r\nslave2:ip=c,port=1,state=wait_bgsave,offset=0,lag=0",
        );
        assert_eq!(
            judge(2, 10, &listed),
            Condition::Degraded {
                good: 1,
                min: 2,
                max_lag: 10
            },
            "one too late, one not online"
        );
        assert!(describe(&judge(2, 10, &listed), Duration::from_secs(7))
            .starts_with("degraded for 7 s"));
    }
}
