//! The stream's decisions as plain code: no I/O, no clock (the caller
//! passes the time), no gRPC types. Two runtimes ask them: `stream::follow`
//! (an agent that follows its primary: what the primary's answer to
//! `PSYNC` makes of the log, where a read splits at a promotion point,
//! what to acknowledge, how long to wait before reconnecting) and
//! `stream::pull` (a replica agent that follows upstream agents).
//!
//! The puller asks [`UpstreamPolicy::pick`] whom to follow next
//! and tells [`UpstreamPolicy::ended`] how a session ended; it answers with
//! what to do: fall back to TCP for a while after a ring failed, start the
//! log over at a snapshot that continues into the upstream's log, try the
//! next upstream of the chain at once, or pause and begin again with the
//! nearest.
//!
//! The rules: a failed session passes its upstream over for [`PASS_OVER`]
//! (not when this agent's own log failed: another upstream would not help);
//! while sessions fail without the log moving, the pause doubles from
//! 100 ms to 5 s; an upstream that no longer holds a log's offset but
//! names a snapshot that continues into its log is asked again every 30 s
//! (it will not find the offset again soon); after a ring failed, the
//! stream runs over TCP for `[stream] rdma_retry` before the ring is tried
//! again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::config::StreamAck;
use crate::kv::redis::Info;

/// How long a failed upstream is passed over for the next of the chain,
/// and how long a session on any but the nearest lasts before the nearest
/// is asked again.
pub const PASS_OVER: Duration = Duration::from_secs(30);
/// The first pause after a session failed before any stream.
const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause while sessions fail.
const MAX_PAUSE: Duration = Duration::from_secs(5);
/// The pause while an upstream no longer holds the log's offset.
const TOO_OLD_PAUSE: Duration = Duration::from_secs(30);

/// The pause before the next session while sessions fail: 100 ms,
/// doubling to 5 s, back to 100 ms once a session moved the log.
#[derive(Debug)]
pub struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff(FIRST_PAUSE)
    }
}

impl Backoff {
    /// A session ended; `progressed`: the log moved during it. The pause
    /// before the next.
    pub fn failed(&mut self, progressed: bool) -> Duration {
        if progressed {
            self.0 = FIRST_PAUSE;
        }
        self.0
    }

    /// The pause was taken: the next is twice as long.
    pub fn paused(&mut self) {
        self.0 = (self.0 * 2).min(MAX_PAUSE);
    }
}

/// A primary's promotion, from its `INFO replication`: the id it had
/// before (`master_replid2`) held up to offset `at`, its own from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promotion {
    pub previous: String,
    pub replid: String,
    pub at: u64,
}

impl Promotion {
    /// The promotion a primary's `INFO replication` describes, if any:
    /// a previous id (`master_replid2`) that held up to
    /// `second_repl_offset` - 1.
    pub fn from_info(info: &Info) -> Option<Promotion> {
        let second = info
            .get("second_repl_offset")
            .and_then(|o| o.parse::<u64>().ok())
            .filter(|&o| o > 0)?;
        Some(Promotion {
            previous: info.get("master_replid2")?.to_string(),
            replid: info.get("master_replid")?.to_string(),
            at: second - 1,
        })
    }
}

/// What the primary's answer to `PSYNC` makes of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Psync {
    /// `+FULLRESYNC`: its RDB comes, and the log starts over at this id
    /// and offset.
    FullResync { replid: String, offset: u64 },
    /// `+CONTINUE`: the log goes on from the offset asked, after `now`;
    /// `later`, the change of id at a promotion point past that offset,
    /// where the stream read from the primary switches id.
    Continue {
        now: LogStep,
        later: Option<(String, u64)>,
    },
    /// An answer to a question not asked, or not PSYNC's.
    Refused,
}

/// What the log does before the stream goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogStep {
    /// A log still empty starts at the snapshot's point (id, offset).
    Restart(String, u64),
    /// The stream goes on under this new id from the log's end.
    Switch(String),
    Keep,
}

/// What `answer` to `PSYNC <id> <offset+1>` (`asked`: `None` for
/// `PSYNC ? -1`) makes of a log (`empty` or not), the primary having been
/// `promoted` as its `INFO` says. A promoted primary's own history starts
/// where it took over: the old id's bytes up to there go under the old id.
pub fn psync(
    answer: &str,
    asked: Option<(String, u64)>,
    promoted: Option<&Promotion>,
    empty: bool,
) -> Psync {
    let words: Vec<&str> = answer.split_whitespace().collect();
    match (words.as_slice(), asked) {
        (["+FULLRESYNC", id, offset], _) => match offset.parse() {
            Ok(offset) => Psync::FullResync {
                replid: id.to_string(),
                offset,
            },
            Err(_) => Psync::Refused,
        },
        (["+CONTINUE", rest @ ..], Some((id, start))) if rest.len() <= 1 => {
            let new = rest.first().map_or(id.clone(), |new| new.to_string());
            let at = promoted
                .filter(|p| p.replid == new && p.previous == id && start < p.at)
                .map_or(start, |p| p.at);
            let switch = Some((new, at)).filter(|(new, _)| *new != id);
            let now = match (empty, switch.clone().filter(|(_, at)| *at == start)) {
                (true, _) => LogStep::Restart(id, start),
                (false, Some((new, _))) => LogStep::Switch(new),
                (false, None) => LogStep::Keep,
            };
            Psync::Continue {
                now,
                later: switch.filter(|(_, at)| *at > start),
            }
        }
        _ => Psync::Refused,
    }
}

/// How many more bytes the primary must be able to take before the start
/// of a range falls out of its backlog for a fetch to ask for it again
/// ([`backlog_holds`], at most a quarter of the backlog): the stream
/// moves on while the question is on its way.
pub const BACKLOG_MARGIN: u64 = 4 << 20;

/// Whether the primary, by its `INFO replication`, answers `PSYNC <replid>
/// <offset+1>` with a continuation that carries the `len` bytes after
/// `offset`, with room to spare: the check that keeps fetching a damaged
/// record again from the primary from ever costing it a full resync (a
/// fork). `Err` says why not. As Redis and Valkey decide: the id is the
/// primary's, or its previous one up to where it took over
/// (`second_repl_offset`); the backlog holds the offset asked, far enough
/// from being dropped; the primary has gone past the range.
pub fn backlog_holds(info: &Info, replid: &str, offset: u64, len: u64) -> Result<(), String> {
    let (Some(asked), Some(last)) = (offset.checked_add(1), offset.checked_add(len)) else {
        return Err(format!("{offset}+{len} is no range of offsets"));
    };
    let current = info.get("master_replid") == Some(replid);
    let previous =
        info.get("master_replid2") == Some(replid) && asked <= info.num("second_repl_offset");
    if !current && !previous {
        return Err(format!("its history is no longer {replid}'s"));
    }
    if info.get("repl_backlog_active") != Some("1") {
        return Err("it has no backlog".into());
    }
    let (first, histlen, size) = (
        info.num("repl_backlog_first_byte_offset"),
        info.num("repl_backlog_histlen"),
        info.num("repl_backlog_size"),
    );
    // Bytes the primary can still take before `asked` is dropped: those
    // before it in the backlog, and the room the backlog has left.
    let margin = BACKLOG_MARGIN.min(size / 4);
    let room = asked
        .saturating_sub(first)
        .saturating_add(size.saturating_sub(histlen));
    let end = first.saturating_add(histlen);
    if asked < first || room < margin || last > end {
        return Err(format!(
            "its backlog holds offsets {first}..{end} ({room} bytes from dropping the first asked, fewer than {margin}), not {offset}..{last}"
        ));
    }
    Ok(())
}

/// Of a read of `len` bytes from the stream at `end`, how many go before
/// the change of id at `switch`'s offset (`None`: the change is not
/// within it).
pub fn before_switch(end: u64, len: usize, switch: Option<&(String, u64)>) -> Option<usize> {
    let (_, at) = switch?;
    let before = usize::try_from(at.checked_sub(end)?).ok()?;
    (before <= len).then_some(before)
}

/// The offset to acknowledge to the primary under `ack`: the log's `end`,
/// or what the servers below `applied` (at most the end); never below
/// what was `acked` before (a downstream that lags may join). `None`:
/// nothing to acknowledge yet.
pub fn ack_offset(ack: StreamAck, end: u64, applied: Option<u64>, acked: u64) -> Option<u64> {
    let offset = match ack {
        StreamAck::Log => Some(end),
        StreamAck::Replicas => applied.map(|a| a.min(end)),
    };
    offset.map(|o| o.max(acked))
}

/// What an upstream's answer that it no longer holds the log's offset
/// means, from where its own log stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotHeld {
    /// It still follows a history this log left at `left_at` (a failover
    /// it has not followed) and went past that point: its bytes and its
    /// snapshot hold writes lost to the failover. Nothing is taken from it.
    Stale { left_at: u64 },
    /// Its log stands on this log's own history, behind this log's end
    /// (it is catching up, or started over at an older snapshot): it is
    /// asked again, and its snapshot would only take the server back.
    Behind,
    /// It holds neither the offset nor any point of this log's history:
    /// a snapshot of it may start this log over.
    TooOld,
}

/// Reads an upstream's "too old" answer: its log stands at `theirs` (its
/// current id and end); this log `left_at` that id for a later one (a
/// promotion or restart), and asked to continue from `ours` (its end, or
/// the snapshot an empty log continues).
pub fn not_held(theirs: (&str, u64), left_at: Option<u64>, ours: Option<(&str, u64)>) -> NotHeld {
    let (id, end) = theirs;
    match (left_at, ours) {
        (Some(left_at), _) if end > left_at => NotHeld::Stale { left_at },
        (Some(_), _) => NotHeld::Behind,
        (None, Some((our_id, our_end))) if our_id == id && end <= our_end => NotHeld::Behind,
        _ => NotHeld::TooOld,
    }
}

/// How a session with an upstream ended, as the decisions need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// The RDMA ring failed (to connect, or during the session).
    RingFailed,
    /// This agent's log could not be written or read.
    LogFailed,
    /// The upstream no longer holds the offset asked for.
    TooOld {
        /// The log asked with a stream of its own (not from nothing).
        held: bool,
        /// The snapshot that continues into the upstream's log: its
        /// replication id and M.
        continues: Option<(String, u64)>,
    },
    /// Anything else: unreachable, refused, a broken rule, silence.
    Failed,
}

/// What to do after a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Then {
    /// Again at once, over TCP until the ring is tried again.
    OverTcp,
    /// Start the log over at this replication id and M and sync the
    /// snapshot `upstream` named (`[stream] reseed`).
    Reseed {
        upstream: String,
        replid: String,
        m: u64,
    },
    /// The next upstream of the chain at once.
    Next,
    /// Pause this long, then begin again with the nearest
    /// ([`UpstreamPolicy::paused`]).
    Pause(Duration),
}

/// Whom to follow now.
#[derive(Debug, PartialEq, Eq)]
pub struct Pick<'a> {
    pub upstream: &'a str,
    /// The first of the chain: a session on another ends after
    /// [`PASS_OVER`].
    pub nearest: bool,
    /// Over TCP until then (a ring failed); `None`: the ring may be tried.
    pub tcp_until: Option<Instant>,
}

/// A replica agent's choice of upstream over time.
#[derive(Debug)]
pub struct UpstreamPolicy {
    pause: Backoff,
    passed: HashMap<String, Instant>,
    tcp_until: Option<Instant>,
    ring_retry: Duration,
    /// The upstream of this round that said "too old" and named a
    /// snapshot (its replication id and M): re-seeded from once no other
    /// upstream is left to ask.
    too_old: Option<(String, String, u64)>,
}

impl UpstreamPolicy {
    /// `ring_retry`: how long the stream runs over TCP after a ring failed.
    pub fn new(ring_retry: Duration) -> UpstreamPolicy {
        UpstreamPolicy {
            pause: Backoff::default(),
            passed: HashMap::new(),
            tcp_until: None,
            ring_retry,
            too_old: None,
        }
    }

    /// The nearest upstream of `chain` not passed over at `now` (`None`:
    /// there is none, or every one is passed over).
    pub fn pick<'a>(&self, chain: &'a [String], now: Instant) -> Option<Pick<'a>> {
        let upstream = chain
            .iter()
            .find(|u| self.passed.get(*u).is_none_or(|until| *until <= now))?;
        Some(Pick {
            upstream,
            nearest: chain.first() == Some(upstream),
            tcp_until: self.tcp_until.filter(|t| *t > now),
        })
    }

    /// The chain changed: every upstream is asked afresh.
    pub fn chain_changed(&mut self) {
        self.passed.clear();
    }

    /// A session with `upstream` of `chain` ended `why` at `now`;
    /// `progressed`: the log moved during it; `can_reseed`: `[stream]
    /// reseed` is on (and starting the log over has not just failed).
    pub fn ended(
        &mut self,
        upstream: &str,
        chain: &[String],
        why: &Ended,
        progressed: bool,
        can_reseed: bool,
        now: Instant,
    ) -> Then {
        if *why == Ended::RingFailed {
            self.tcp_until = Some(now + self.ring_retry);
            return Then::OverTcp;
        }
        if progressed || !can_reseed {
            self.too_old = None;
        }
        if let (
            true,
            Ended::TooOld {
                continues: Some((replid, m)),
                ..
            },
        ) = (can_reseed, why)
        {
            self.too_old = Some((upstream.to_string(), replid.clone(), *m));
        }
        let pause = self.pause.failed(progressed);
        if *why != Ended::LogFailed {
            self.passed.insert(upstream.to_string(), now + PASS_OVER);
            if self.pick(chain, now).is_some() {
                return Then::Next;
            }
        }
        // Re-seeding is the last resort: only once no other upstream of
        // the chain is left to ask (one of them may still hold the offset).
        if let Some((upstream, replid, m)) = self.too_old.take() {
            self.passed.clear();
            return Then::Reseed {
                upstream,
                replid,
                m,
            };
        }
        match why {
            Ended::TooOld {
                held: true,
                continues: Some(_),
            } => Then::Pause(TOO_OLD_PAUSE),
            _ => Then::Pause(pause),
        }
    }

    /// The pause is over: the nearest is asked again, and the next pause
    /// is twice as long (at most 5 s).
    pub fn paused(&mut self) {
        self.passed.clear();
        self.pause.paused();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_asked_of_the_primary_only_well_inside_its_backlog_and_history() {
        let (a, b) = ("a".repeat(40), "b".repeat(40));
        let info = |first: u64, histlen: u64, size: u64| {
            Info::parse(&format!(
                "master_replid:{b}\r\nmaster_replid2:{a}\r\nsecond_repl_offset:50000001\r\nrepl_backlog_active:1\r\nrepl_backlog_size:{size}\r\nrepl_backlog_first_byte_offset:{first}\r\nrepl_backlog_histlen:{histlen}\r\n"
            ))
        };
        let big = info(10_000_001, 64 << 20, 64 << 20);
        assert_eq!(backlog_holds(&big, &b, 60_000_000, 1000), Ok(()));
        assert_eq!(
            backlog_holds(&big, &a, 30_000_000, 1000),
            Ok(()),
            "the previous id, before the promotion"
        );
        assert!(backlog_holds(&big, &a, 50_000_001, 10).is_err(), "after it");
        assert!(backlog_holds(&big, &"c".repeat(40), 30_000_000, 10).is_err());
        assert!(
            backlog_holds(&big, &b, 10_000_000 + (1 << 20), 10).is_err(),
            "too near the backlog's start: it may move past it"
        );
        let end = 10_000_001 + (64 << 20);
        assert!(backlog_holds(&big, &b, end - 100, 100).is_ok());
        assert!(
            backlog_holds(&big, &b, end - 100, 101).is_err(),
            "not there yet"
        );
        let small = info(1, 1 << 20, 1 << 20);
        assert_eq!(backlog_holds(&small, &b, 300_000, 100), Ok(()));
        assert!(backlog_holds(&small, &b, 100, 100).is_err());
        let filling = info(1, 4 << 20, 64 << 20);
        assert_eq!(
            backlog_holds(&filling, &b, 0, 100),
            Ok(()),
            "a backlog not yet full drops nothing for a while"
        );
        let none = Info::parse(&format!("master_replid:{b}\r\nrepl_backlog_active:0\r\n"));
        assert!(backlog_holds(&none, &b, 1, 1).is_err());
    }

    fn chain(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    const RETRY: Duration = Duration::from_secs(60);

    #[test]
    fn an_upstream_that_does_not_hold_the_offset_is_stale_behind_or_too_old() {
        let ours = Some(("new", 900));
        // On the history this log left at 500 for "new".
        let stale = not_held(("old", 600), Some(500), ours);
        assert_eq!(stale, NotHeld::Stale { left_at: 500 }, "past the point");
        assert_eq!(not_held(("old", 500), Some(500), ours), NotHeld::Behind);
        assert_eq!(not_held(("old", 0), Some(500), ours), NotHeld::Behind);
        // On this log's current id.
        assert_eq!(not_held(("new", 700), None, ours), NotHeld::Behind);
        assert_eq!(not_held(("new", 1000), None, ours), NotHeld::TooOld);
        // Elsewhere: another id, an empty log, or an empty upstream.
        assert_eq!(not_held(("other", 10), None, ours), NotHeld::TooOld);
        assert_eq!(not_held(("new", 10), None, None), NotHeld::TooOld);
        assert_eq!(not_held(("", 0), None, ours), NotHeld::TooOld);
    }

    #[test]
    fn a_failed_upstream_is_passed_over_for_a_while_then_the_nearest_again() {
        let chain = chain(&["relay:1", "parent:1", "origin:1"]);
        let now = Instant::now();
        let mut u = UpstreamPolicy::new(RETRY);
        let pick = u.pick(&chain, now).unwrap();
        assert_eq!((pick.upstream, pick.nearest), ("relay:1", true));
        for (failed, next) in [("relay:1", "parent:1"), ("parent:1", "origin:1")] {
            let then = u.ended(failed, &chain, &Ended::Failed, false, true, now);
            assert_eq!(then, Then::Next);
            let pick = u.pick(&chain, now).unwrap();
            assert_eq!((pick.upstream, pick.nearest), (next, false));
        }
        let then = u.ended("origin:1", &chain, &Ended::Failed, false, true, now);
        assert_eq!(then, Then::Pause(FIRST_PAUSE), "all passed over");
        assert_eq!(u.pick(&chain, now), None);
        assert_eq!(
            u.pick(&chain, now + PASS_OVER).unwrap().upstream,
            "relay:1",
            "the nearest once its pass-over ends"
        );
        u.paused();
        assert_eq!(
            u.pick(&chain, now).unwrap().upstream,
            "relay:1",
            "or after the pause"
        );
    }

    #[test]
    fn the_pause_doubles_to_five_seconds_while_nothing_moves_and_starts_over_after_progress() {
        let chain = chain(&["up:1"]);
        let now = Instant::now();
        let mut u = UpstreamPolicy::new(RETRY);
        let mut pauses = Vec::new();
        for _ in 0..8 {
            match u.ended("up:1", &chain, &Ended::Failed, false, true, now) {
                Then::Pause(p) => pauses.push(p.as_millis()),
                other => panic!("{other:?}"),
            }
            u.paused();
        }
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        let then = u.ended("up:1", &chain, &Ended::Failed, true, true, now);
        assert_eq!(then, Then::Pause(FIRST_PAUSE), "the log moved");
    }

    #[test]
    fn a_log_that_failed_is_not_an_upstreams_fault() {
        let chain = chain(&["a:1", "b:1"]);
        let now = Instant::now();
        let mut u = UpstreamPolicy::new(RETRY);
        let then = u.ended("a:1", &chain, &Ended::LogFailed, false, true, now);
        assert_eq!(then, Then::Pause(FIRST_PAUSE));
        assert_eq!(
            u.pick(&chain, now).unwrap().upstream,
            "a:1",
            "not passed over"
        );
    }

    #[test]
    fn a_failed_ring_runs_the_stream_over_tcp_until_its_retry() {
        let chain = chain(&["a:1", "b:1"]);
        let now = Instant::now();
        let mut u = UpstreamPolicy::new(RETRY);
        assert_eq!(u.pick(&chain, now).unwrap().tcp_until, None);
        let then = u.ended("a:1", &chain, &Ended::RingFailed, false, true, now);
        assert_eq!(then, Then::OverTcp);
        let pick = u.pick(&chain, now).unwrap();
        assert_eq!(pick.upstream, "a:1", "the same upstream, not passed over");
        assert_eq!(pick.tcp_until, Some(now + RETRY));
        assert_eq!(u.pick(&chain, now + RETRY).unwrap().tcp_until, None);
    }

    #[test]
    fn too_old_reseeds_where_allowed_else_asks_again_every_30_seconds() {
        let chain = chain(&["a:1"]);
        let now = Instant::now();
        let named = Ended::TooOld {
            held: true,
            continues: Some(("r".repeat(40), 900)),
        };
        let mut u = UpstreamPolicy::new(RETRY);
        assert_eq!(
            u.ended("a:1", &chain, &named, false, true, now),
            Then::Reseed {
                upstream: "a:1".into(),
                replid: "r".repeat(40),
                m: 900
            }
        );
        assert_eq!(
            u.pick(&chain, now).unwrap().upstream,
            "a:1",
            "a re-seeding passes nothing over"
        );
        // Another upstream of the chain may still hold the offset: it is
        // asked first, and the re-seeding waits until none is left, from
        // the one that named the snapshot (whatever the last one said).
        let two = super::tests::chain(&["a:1", "b:1"]);
        let mut v = UpstreamPolicy::new(RETRY);
        assert_eq!(v.ended("a:1", &two, &named, false, true, now), Then::Next);
        assert_eq!(v.pick(&two, now).unwrap().upstream, "b:1");
        assert_eq!(
            v.ended("b:1", &two, &Ended::Failed, false, true, now),
            Then::Reseed {
                upstream: "a:1".into(),
                replid: "r".repeat(40),
                m: 900
            }
        );
        assert_eq!(v.pick(&two, now).unwrap().upstream, "a:1");
        // One that serves (the log moved) forgets it.
        assert_eq!(v.ended("a:1", &two, &named, false, true, now), Then::Next);
        assert!(matches!(
            v.ended("b:1", &two, &Ended::Failed, true, true, now),
            Then::Pause(_)
        ));
        // Without [stream] reseed, or once starting over failed.
        assert_eq!(
            u.ended("a:1", &chain, &named, false, false, now),
            Then::Pause(TOO_OLD_PAUSE)
        );
        u.paused();
        // A log that asked from nothing, or an upstream that named no
        // snapshot (it takes one soon): the usual pause.
        for why in [
            Ended::TooOld {
                held: false,
                continues: Some(("r".repeat(40), 900)),
            },
            Ended::TooOld {
                held: true,
                continues: None,
            },
        ] {
            assert_eq!(
                u.ended("a:1", &chain, &why, false, false, now),
                Then::Pause(Duration::from_millis(200)),
                "{why:?}"
            );
        }
    }

    const OLD: &str = "1111111111111111111111111111111111111111";
    const NEW: &str = "2222222222222222222222222222222222222222";

    #[test]
    fn a_full_resync_starts_the_log_over_at_the_rdbs_offset() {
        for asked in [None, Some((OLD.to_string(), 500))] {
            assert_eq!(
                psync(&format!("+FULLRESYNC {NEW} 900"), asked, None, false),
                Psync::FullResync {
                    replid: NEW.into(),
                    offset: 900
                }
            );
        }
        assert_eq!(psync("+FULLRESYNC x y", None, None, false), Psync::Refused);
    }

    #[test]
    fn a_continue_goes_on_from_the_log_and_an_empty_log_starts_where_it_asked() {
        let asked = || Some((OLD.to_string(), 500));
        assert_eq!(
            psync("+CONTINUE", asked(), None, false),
            Psync::Continue {
                now: LogStep::Keep,
                later: None
            }
        );
        assert_eq!(
            psync("+CONTINUE", asked(), None, true),
            Psync::Continue {
                now: LogStep::Restart(OLD.into(), 500),
                later: None
            },
            "an empty log continues the snapshot's point"
        );
        assert_eq!(
            psync(&format!("+CONTINUE {NEW}"), asked(), None, false),
            Psync::Continue {
                now: LogStep::Switch(NEW.into()),
                later: None
            },
            "a new id from where the log stands"
        );
        for refused in ["+CONTINUE a b", "-ERR no", ""] {
            assert_eq!(
                psync(refused, asked(), None, false),
                Psync::Refused,
                "{refused}"
            );
        }
        assert_eq!(
            psync("+CONTINUE", None, None, false),
            Psync::Refused,
            "a continue to a full resync's question"
        );
    }

    #[test]
    fn a_promotion_past_the_log_switches_id_at_the_promotion_point_in_the_stream() {
        let promoted = Promotion {
            previous: OLD.into(),
            replid: NEW.into(),
            at: 800,
        };
        let answer = format!("+CONTINUE {NEW}");
        assert_eq!(
            psync(&answer, Some((OLD.into(), 500)), Some(&promoted), false),
            Psync::Continue {
                now: LogStep::Keep,
                later: Some((NEW.into(), 800))
            },
            "the bytes up to 800 are the old id's"
        );
        assert_eq!(
            psync(&answer, Some((OLD.into(), 800)), Some(&promoted), false),
            Psync::Continue {
                now: LogStep::Switch(NEW.into()),
                later: None
            },
            "at the point itself: the new id at once"
        );
        let other = Promotion {
            previous: "3".repeat(40),
            ..promoted
        };
        assert_eq!(
            psync(&answer, Some((OLD.into(), 500)), Some(&other), false),
            Psync::Continue {
                now: LogStep::Switch(NEW.into()),
                later: None
            },
            "a promotion from another history is not this log's"
        );
    }

    #[test]
    fn a_read_splits_where_the_id_changes_inside_it() {
        let switch = (NEW.to_string(), 800);
        assert_eq!(before_switch(700, 50, Some(&switch)), None, "not yet");
        assert_eq!(before_switch(700, 100, Some(&switch)), Some(100));
        assert_eq!(before_switch(700, 300, Some(&switch)), Some(100));
        assert_eq!(before_switch(800, 300, Some(&switch)), Some(0));
        assert_eq!(before_switch(700, 300, None), None);
    }

    #[test]
    fn the_acknowledgement_follows_the_ack_mode_and_never_goes_back() {
        assert_eq!(ack_offset(StreamAck::Log, 900, None, 0), Some(900));
        assert_eq!(
            ack_offset(StreamAck::Replicas, 900, None, 0),
            None,
            "no downstream"
        );
        assert_eq!(
            ack_offset(StreamAck::Replicas, 900, Some(700), 0),
            Some(700)
        );
        assert_eq!(
            ack_offset(StreamAck::Replicas, 900, Some(950), 0),
            Some(900)
        );
        assert_eq!(
            ack_offset(StreamAck::Replicas, 900, Some(600), 700),
            Some(700),
            "a lagging downstream joined"
        );
    }

    #[test]
    fn a_changed_chain_is_asked_afresh() {
        let chain = chain(&["a:1"]);
        let now = Instant::now();
        let mut u = UpstreamPolicy::new(RETRY);
        u.ended("a:1", &chain, &Ended::Failed, false, true, now);
        assert_eq!(u.pick(&chain, now), None);
        u.chain_changed();
        assert_eq!(u.pick(&chain, now).unwrap().upstream, "a:1");
        assert_eq!(u.pick(&[], now), None, "no agents: nothing to follow");
    }
}
