//! Keeping a `redis-stream` server on its feed, and saying how it is.
//! Every `[redis] health_interval` the agent reads the server's `INFO`
//! (the address is the instance's configured `server_addr`, the password
//! its configured one) and [`decide`]s, as plain code, what that means:
//! fed (its `run_id` is remembered in the log's directory, so an agent
//! restart still knows it), released or pointed elsewhere, the stream's
//! primary now, or a master. A master is pointed back at its feed only
//! when all of these prove it is the same data restarted, not a promotion:
//! its `run_id` differs from the one last seen fed (a new process; a
//! `REPLICAOF NO ONE` keeps the `run_id`) and the process is younger than
//! the time since this run last saw it fed (and not since off its feed:
//! a process once seen promoted or pointed elsewhere proves nothing by a
//! later restart), the log does not follow a
//! primary (the server may be it, under another name), it has taken
//! no write since (a server restarted as a master shifts its id, as a
//! promotion does: its offset is still where its old id ended), and the
//! log continues that old id at that offset. The move itself is
//! [`super::hand::onto_feed`]'s, which checks again before it acts, has
//! the feed continue the server's new id at exactly that offset (and
//! refuse it anywhere else, never a full resync), and puts the server
//! back if the feed would not continue it. Everything
//! else is reported, never acted on: the verdict is the instance's
//! server health in status, `kvsync_instance_health` and `/readyz`. A
//! master that left the feed is also never seeded over ([`may_seed`]).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::feed::FeedHandle;
use super::source::Source;
use super::SharedLog;
use crate::config::RedisConfig;
use crate::kv::redis::Info;
use crate::metrics::Metrics;

/// Where the `run_id` of the server last seen following the feed is kept,
/// in the stream log's directory.
pub const RUN_ID_FILE: &str = ".kvsync-feed-server-run-id";

/// How an instance is, worst last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Ok,
    /// Working, not synced: starting, reconnecting, re-seeding, released.
    Degraded,
    /// Will not get better on its own: an operator must act.
    Stuck,
}

impl Verdict {
    pub const ALL: [Verdict; 3] = [Verdict::Ok, Verdict::Degraded, Verdict::Stuck];

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Degraded => "degraded",
            Verdict::Stuck => "stuck",
        }
    }
}

/// A verdict and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub verdict: Verdict,
    pub reason: String,
}

impl Health {
    pub fn ok(reason: impl Into<String>) -> Health {
        Health {
            verdict: Verdict::Ok,
            reason: reason.into(),
        }
    }
    pub fn degraded(reason: impl Into<String>) -> Health {
        Health {
            verdict: Verdict::Degraded,
            reason: reason.into(),
        }
    }
    pub fn stuck(reason: impl Into<String>) -> Health {
        Health {
            verdict: Verdict::Stuck,
            reason: reason.into(),
        }
    }
}

/// What one read of the server's `INFO replication` and `server` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub replica: bool,
    /// Its master's address, as the server reports it.
    pub master: Option<(String, u16)>,
    pub link_up: bool,
    pub run_id: String,
    pub replid: String,
    pub offset: u64,
    /// Its previous replication id, and the offset it ended at (+1): a
    /// server restarted as a master keeps the history it held here.
    pub replid2: String,
    pub second_offset: u64,
}

impl Seen {
    pub fn read(info: &Info) -> Seen {
        let master = match (info.get("master_host"), info.get("master_port")) {
            (Some(h), Some(p)) => p.parse().ok().map(|p| (h.to_string(), p)),
            _ => None,
        };
        Seen {
            replica: matches!(info.get("role"), Some("slave" | "replica")),
            master,
            link_up: info.get("master_link_status") == Some("up"),
            run_id: info.get("run_id").unwrap_or_default().to_string(),
            replid: info.get("master_replid").unwrap_or_default().to_string(),
            offset: info.num("master_repl_offset"),
            replid2: info.get("master_replid2").unwrap_or_default().to_string(),
            second_offset: info.num("second_repl_offset"),
        }
    }

    /// The history a master holds that a feed could continue: its
    /// previous id at its offset, while it has taken no write under the
    /// new one (a restart, or a promotion, shifts the id).
    pub fn held_before(&self) -> Option<(&str, u64)> {
        (!self.replica && self.second_offset == self.offset + 1)
            .then_some((self.replid2.as_str(), self.offset))
    }

    /// It follows `feed`.
    fn follows(&self, feed: SocketAddr) -> bool {
        self.replica
            && self.master.as_ref().is_some_and(|(h, p)| {
                *p == feed.port() && h.parse::<IpAddr>().ok() == Some(feed.ip())
            })
    }
}

/// What the agent knows beside the server's word.
#[derive(Debug, Clone, Copy)]
pub struct Known<'a> {
    pub feed: SocketAddr,
    /// The `run_id` last seen following the feed (none: never).
    pub fed_run_id: Option<&'a str>,
    /// The log follows a primary (this server may be it, under whatever
    /// name the others know it by): no master is ever moved then.
    pub is_source: bool,
    /// This run of the agent saw the server on its feed, and the server
    /// has run for less time than has passed since (a new process: a
    /// promotion while the agent was away proves nothing).
    pub restarted_since_fed: bool,
    /// The log continues the history the server holds
    /// ([`Seen::held_before`]).
    pub continued: bool,
    /// How far a fed server is behind the log ([`Lag`]).
    pub behind: Behind,
}

/// How far a fed server is behind its log, and how far it may be while its
/// instance counts as synced (`[stream] ready_behind`, `ready_lag`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Behind {
    pub bytes: u64,
    /// How long ago the log stood where the server stands now, at most
    /// (zero: it holds all the log held at the last look).
    pub age: Duration,
    pub max_bytes: u64,
    pub max_age: Duration,
}

/// The log's ends over time, to tell how long a fed server has been short
/// of them: each look marks where the log ends; marks the server has
/// reached are dropped, and the oldest left is its lag.
#[derive(Debug, Default)]
pub struct Lag(std::collections::VecDeque<(std::time::Instant, u64)>);

impl Lag {
    /// Marks the log's `end` at `now`, drops what the server at `at` has
    /// reached, and returns how long ago the log stood beyond the server.
    pub fn look(&mut self, now: std::time::Instant, end: u64, at: u64) -> Duration {
        if self.0.back().is_some_and(|&(_, e)| e > end) {
            // The log started over (at a snapshot): its old ends mean nothing.
            self.0.clear();
        }
        if self.0.back().is_none_or(|&(_, e)| e < end) {
            self.0.push_back((now, end));
        }
        while self.0.front().is_some_and(|&(_, e)| e <= at) {
            self.0.pop_front();
        }
        // A bounded record: the oldest marks are what the lag reads.
        if self.0.len() > 4096 {
            self.0.remove(1);
        }
        self.0
            .front()
            .map_or(Duration::ZERO, |&(t, _)| now.saturating_duration_since(t))
    }
}

/// What to do about the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// It follows the feed: remember its `run_id`.
    Fed(Health),
    /// A restart of a fed server came back a master whose data the log
    /// continues: point it back at the feed.
    Repoint,
    /// Leave it and say so.
    Report(Health),
    /// A master that left the feed (promoted, or restarted with writes or
    /// data the log does not continue): left alone, and no seeding or
    /// re-seeding may replace what it holds.
    Left(Health),
}

/// Decides on the server `seen`, given what the agent `known`s.
pub fn decide(seen: &Seen, known: Known) -> Decision {
    if seen.follows(known.feed) {
        let b = known.behind;
        return Decision::Fed(if !seen.link_up {
            Health::degraded("follows its feed, its link is down")
        } else if b.bytes > b.max_bytes {
            Health::degraded(format!(
                "follows its feed, {} bytes behind the log (ready within {})",
                b.bytes, b.max_bytes
            ))
        } else if b.age > b.max_age {
            Health::degraded(format!(
                "follows its feed, short of where the log stood {:.0?} ago (ready within {:?})",
                b.age, b.max_age
            ))
        } else {
            Health::ok("follows its feed")
        });
    }
    if seen.replica {
        let (h, p) = seen.master.clone().unwrap_or_default();
        return Decision::Report(Health::degraded(format!(
            "follows {h}:{p}, not this agent's feed (released, or pointed elsewhere): kvsync stream attach takes it back"
        )));
    }
    if known.is_source {
        return Decision::Report(Health::ok(
            "a master while the log follows a primary (the stream's primary after a failover): never moved",
        ));
    }
    const LEFT: &str = "left alone (a seeding into it is refused too): fail over to it, or make it a replica yourself, which discards what it holds";
    let restarted = known.fed_run_id.is_some_and(|r| r != seen.run_id);
    match (known.fed_run_id, restarted, known.continued) {
        (Some(_), true, true) if known.restarted_since_fed => Decision::Repoint,
        (Some(_), true, true) => Decision::Left(Health::stuck(format!(
            "a writable master under a new process, which this run of the agent did not see restart from its feed (it may have been promoted meanwhile): {LEFT}"
        ))),
        (Some(_), false, _) => Decision::Left(Health::stuck(format!(
            "a writable master since it was promoted while running (REPLICAOF NO ONE by someone else): {LEFT}"
        ))),
        (Some(_), true, false) => Decision::Left(Health::stuck(match seen.held_before() {
            None => format!(
                "restarted as a writable master and took {} bytes of writes since: {LEFT}",
                seen.offset.saturating_sub(seen.second_offset.saturating_sub(1))
            ),
            Some(_) => format!(
                "restarted as a writable master with data the stream log does not continue: {LEFT}"
            ),
        })),
        // Never seen fed (a server not seeded yet): nothing proves a
        // restart, so nothing is moved.
        (None, ..) => Decision::Report(Health::degraded(
            "a master this agent never saw on its feed: seed it with kvsync sync",
        )),
    }
}

/// Whether a seeding may replace the data of the server `cfg` names, fed
/// from the log in `dir`: not when it is a master this agent once had on
/// its feed (it left it: promoted, or restarted with writes or data the
/// log does not continue, and holds what no one else may have), or whose
/// record of that is damaged. A server never fed (a new one: no record)
/// may be seeded. Returns why not.
pub async fn may_seed(cfg: &RedisConfig, dir: &Path) -> Result<(), String> {
    let info = crate::kv::redis::info(&cfg.server_addr, &cfg.auth(), "replication")
        .await
        .map_err(|e| format!("cannot read the local server's role before seeding it: {e}"))?;
    let master = !Seen::read(&info).replica;
    let path = dir.join(RUN_ID_FILE);
    // A record that is there but unreadable (a bad disk) may be one of a
    // server that was fed: never read as "never fed".
    let fed = fed_run_id(&path).is_some() || path.symlink_metadata().is_ok();
    match (master, fed) {
        (true, true) => Err(format!(
            "the local server {} is a writable master since it left this agent's feed (promoted, or restarted with writes): a seeding would replace what it holds; fail over to it, or make it a replica yourself first, which discards that",
            cfg.server_addr
        )),
        _ => Ok(()),
    }
}

/// The remembered `run_id` (none: never fed, or unreadable).
fn fed_run_id(path: &Path) -> Option<String> {
    let b = crate::sys::fs::read_regular(path, 128).ok()?;
    let s = String::from_utf8(b).ok()?;
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())).then_some(s)
}

/// Keeps instance `instance`'s server on `feed` (see the module's doc)
/// until `stop`, reporting its health on `stream`: `ready` bounds the
/// bytes and the time it may be behind the log while it counts as synced.
pub async fn run(
    instance: String,
    cfg: RedisConfig,
    (feed, stream, dir): (FeedHandle, SharedLog, PathBuf),
    timeout: Duration,
    ready: (u64, Duration),
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let path = dir.join(RUN_ID_FILE);
    let mut fed = fed_run_id(&path);
    // When this run last saw the server on its feed.
    let mut fed_at: Option<std::time::Instant> = None;
    let server = cfg.server_addr.clone();
    let repointed = metrics
        .stream_server_repointed
        .with_label_values(&[&instance]);
    let mut lag = Lag::default();
    let mut tick = tokio::time::interval(cfg.health_interval.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let auth = cfg.auth();
        let polled = crate::kv::redis::infos(&server, &auth, &["replication", "server"]);
        let (seen, uptime) = match polled.await {
            Ok(info) => (
                Seen::read(&info),
                Duration::from_secs(info.num("uptime_in_seconds")),
            ),
            Err(e) => {
                stream.set_server_health(Health::degraded(format!("does not answer: {e}")));
                continue;
            }
        };
        let known = Known {
            feed: feed.addr,
            fed_run_id: fed.as_deref(),
            is_source: matches!(stream.source(), Source::Primary(_)),
            restarted_since_fed: fed_at.is_some_and(|at| started_within(uptime, at.elapsed())),
            continued: seen
                .held_before()
                .is_some_and(|(id, at)| stream.view(|l| l.continues(id, at).is_ok())),
            behind: {
                let end = stream.position().map_or(0, |(_, end)| end);
                Behind {
                    bytes: end.saturating_sub(seen.offset),
                    age: lag.look(std::time::Instant::now(), end, seen.offset),
                    max_bytes: ready.0,
                    max_age: ready.1,
                }
            },
        };
        let decision = decide(&seen, known);
        let same_process = fed.as_deref() == Some(seen.run_id.as_str());
        fed_at = seen_fed(fed_at, &decision, same_process, std::time::Instant::now());
        stream.set_server_left(matches!(decision, Decision::Left(_)));
        let health = match decision {
            Decision::Fed(health) => {
                if fed.as_deref() != Some(seen.run_id.as_str()) {
                    remember(&path, &seen.run_id).await;
                    fed = Some(seen.run_id.clone());
                }
                health
            }
            Decision::Report(health) | Decision::Left(health) => health,
            Decision::Repoint => {
                stream.set_server_health(Health::degraded(
                    "came back a master from a restart: being pointed back at its feed",
                ));
                warn!(%instance, server, replid = %seen.replid, offset = seen.offset, "the fed server came back a master (restarted) with data the log continues: pointing it back at its feed");
                match super::hand::onto_feed(&cfg, timeout, &feed, &stream, Some(&seen.run_id))
                    .await
                {
                    Ok(done) => {
                        // On its feed now: a promotion of this process
                        // from here on is one to leave alone.
                        remember(&path, &seen.run_id).await;
                        fed = Some(seen.run_id.clone());
                        fed_at = Some(std::time::Instant::now());
                        repointed.inc();
                        info!(%instance, "{done}");
                        Health::ok(done)
                    }
                    Err(e @ super::hand::HandError::Changed { .. }) => {
                        Health::degraded(e.to_string())
                    }
                    Err(e) => Health::stuck(format!(
                        "came back a master and could not be pointed back at its feed: {e}"
                    )),
                }
            }
        };
        stream.set_server_health(health);
    }
}

/// When this run last saw the server on its feed, after a look that
/// `decided`: now, for a fed one; forgotten once the process last seen fed
/// (`same_process`) is seen off its feed, promoted or pointed elsewhere
/// while running, so that a later restart of it (a crash that loads an
/// RDB of its fed days) is never read as a restart from the feed.
fn seen_fed(
    prev: Option<std::time::Instant>,
    decided: &Decision,
    same_process: bool,
    now: std::time::Instant,
) -> Option<std::time::Instant> {
    match decided {
        Decision::Fed(_) => Some(now),
        _ if same_process => None,
        _ => prev,
    }
}

/// Whether a server reporting `uptime` (its `uptime_in_seconds`) started
/// within the last `ago`. The report is whole seconds of the server's
/// clock (its start's second subtracted from now's), up to a second more
/// than the time it has run: a server started 0.1 s after it was last seen
/// fed (another process then), asked 4.9 s later, reports 5.
fn started_within(uptime: Duration, ago: Duration) -> bool {
    uptime < ago + Duration::from_secs(1)
}

/// Remembers `run_id` as the fed server's.
async fn remember(path: &Path, run_id: &str) {
    let (path, id) = (path.to_path_buf(), run_id.to_string());
    let written = tokio::task::spawn_blocking(move || {
        crate::sys::fs::write_atomic(&path, id.as_bytes(), (".kvsync-run-id-", ".tmp"), 0o600)
    })
    .await
    .expect("run id task");
    if let Err(e) = written {
        warn!(error = %e, "cannot remember the fed server's run_id: a restart of it may not be pointed back");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FEED: &str = "127.0.0.1:7000";

    fn seen(replica: bool, master: Option<(&str, u16)>, run_id: &str) -> Seen {
        Seen {
            replica,
            master: master.map(|(h, p)| (h.to_string(), p)),
            link_up: true,
            run_id: run_id.into(),
            replid: "r".repeat(40),
            offset: 100,
            replid2: "q".repeat(40),
            second_offset: 101,
        }
    }

    #[test]
    fn a_master_holds_its_old_history_only_while_it_took_no_write() {
        let mut s = seen(false, None, "a");
        assert_eq!(s.held_before(), Some(("q".repeat(40).as_str(), 100)));
        s.offset = 150;
        assert_eq!(s.held_before(), None, "it took writes");
        s.replica = true;
        s.offset = 100;
        assert_eq!(s.held_before(), None, "a replica");
    }

    fn known(fed: Option<&str>, is_source: bool, continued: bool) -> Known<'_> {
        Known {
            feed: FEED.parse().unwrap(),
            fed_run_id: fed,
            is_source,
            restarted_since_fed: true,
            continued,
            behind: Behind::default(),
        }
    }

    #[test]
    fn a_fed_server_is_ok_only_within_the_bounds_of_bytes_and_time_behind() {
        let s = seen(true, Some(("127.0.0.1", 7000)), "a");
        let bounds = Behind {
            max_bytes: 1000,
            max_age: Duration::from_secs(30),
            ..Behind::default()
        };
        let verdict = |behind| match decide(
            &s,
            Known {
                behind,
                ..known(None, false, true)
            },
        ) {
            Decision::Fed(h) => h,
            d => panic!("{d:?}"),
        };
        assert_eq!(
            verdict(Behind {
                bytes: 1000,
                ..bounds
            })
            .verdict,
            Verdict::Ok
        );
        let h = verdict(Behind {
            bytes: 1001,
            ..bounds
        });
        assert_eq!(h.verdict, Verdict::Degraded);
        assert!(h.reason.contains("1001 bytes behind"), "{}", h.reason);
        let h = verdict(Behind {
            age: Duration::from_secs(31),
            ..bounds
        });
        assert_eq!(h.verdict, Verdict::Degraded);
        assert!(
            h.reason.contains("short of where the log stood"),
            "{}",
            h.reason
        );
    }

    #[test]
    fn the_lag_is_the_age_of_the_oldest_log_end_the_server_has_not_reached() {
        let t0 = std::time::Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut lag = Lag::default();
        assert_eq!(lag.look(at(0), 100, 100), Duration::ZERO, "it holds all");
        assert_eq!(lag.look(at(5), 200, 150), Duration::ZERO, "just marked");
        assert_eq!(lag.look(at(10), 300, 150), Duration::from_secs(5));
        assert_eq!(
            lag.look(at(15), 300, 250),
            Duration::from_secs(5),
            "past 200, short of 300"
        );
        assert_eq!(lag.look(at(20), 300, 300), Duration::ZERO);
    }

    #[test]
    fn a_process_seen_off_its_feed_is_no_longer_one_seen_fed() {
        let (then, now) = (
            std::time::Instant::now(),
            std::time::Instant::now() + Duration::from_secs(1),
        );
        let fed = Decision::Fed(Health::ok("follows its feed"));
        let left = Decision::Left(Health::stuck("promoted"));
        assert_eq!(seen_fed(None, &fed, true, now), Some(now));
        // Promoted (or pointed elsewhere) while running: forgotten.
        assert_eq!(seen_fed(Some(then), &left, true, now), None);
        // A new process (a restart being looked at): kept, to prove it.
        assert_eq!(
            seen_fed(Some(then), &Decision::Repoint, false, now),
            Some(then)
        );
    }

    #[test]
    fn a_restart_is_read_through_the_rounding_of_its_uptime() {
        // Seen fed at 25.45 s, restarted at 25.55 s, asked at 30.45 s.
        assert!(started_within(
            Duration::from_secs(5),
            Duration::from_millis(5000)
        ));
        assert!(started_within(
            Duration::from_secs(4),
            Duration::from_millis(5000)
        ));
        // Running since well before it was last seen fed.
        assert!(!started_within(
            Duration::from_secs(7),
            Duration::from_millis(5000)
        ));
    }

    #[test]
    fn the_verdicts_are_the_metrics_labels() {
        assert_eq!(
            Verdict::ALL.map(Verdict::as_str),
            crate::metrics::HEALTH_VERDICTS
        );
    }

    #[test]
    fn a_server_on_its_feed_is_fed_and_its_link_decides_ok() {
        let mut s = seen(true, Some(("127.0.0.1", 7000)), "a");
        assert!(
            matches!(decide(&s, known(None, false, true)), Decision::Fed(h) if h.verdict == Verdict::Ok)
        );
        s.link_up = false;
        assert!(
            matches!(decide(&s, known(None, false, true)), Decision::Fed(h) if h.verdict == Verdict::Degraded)
        );
    }

    #[test]
    fn only_a_restarted_master_the_log_continues_is_pointed_back() {
        let master = seen(false, None, "new");
        assert_eq!(
            decide(&master, known(Some("old"), false, true)),
            Decision::Repoint
        );
        // Never seen fed: nothing proves a restart.
        let never = decide(&master, known(None, false, true));
        assert!(matches!(never, Decision::Report(h) if h.verdict == Verdict::Degraded));
        // A new process this run did not see start after it was fed (the
        // agent was away: it may have been promoted meanwhile).
        let away = Known {
            restarted_since_fed: false,
            ..known(Some("old"), false, true)
        };
        assert!(matches!(decide(&master, away), Decision::Left(h) if h.verdict == Verdict::Stuck));
        // The same process: promoted on purpose, left alone, said stuck.
        let same = decide(&master, known(Some("new"), false, true));
        assert!(matches!(same, Decision::Left(h) if h.verdict == Verdict::Stuck));
        // Data the log does not continue: a re-seeding, never a move.
        let other = decide(&master, known(Some("old"), false, false));
        assert!(
            matches!(other, Decision::Left(h) if h.verdict == Verdict::Stuck && h.reason.contains("left alone"))
        );
        // The stream's primary now (a failover): never touched.
        let primary = decide(&master, known(Some("old"), true, true));
        assert!(matches!(primary, Decision::Report(h) if h.verdict == Verdict::Ok));
    }

    #[test]
    fn a_replica_of_another_master_is_reported_never_moved() {
        let s = seen(true, Some(("10.0.0.9", 6379)), "a");
        let d = decide(&s, known(Some("a"), false, true));
        assert!(
            matches!(d, Decision::Report(h) if h.verdict == Verdict::Degraded && h.reason.contains("10.0.0.9:6379"))
        );
    }
}
