//! Redis Sentinel's word on who an instance's primary is
//! (`[stream] sentinels`, `master_name`), taken only from a majority: the
//! way Sentinel itself fails a primary over only on a quorum and a leader
//! a majority elected, an agent that may demote a primary acts on no
//! single Sentinel's word. [`watch`] asks every configured Sentinel for
//! the master it knows (`SENTINEL MASTER`) at start, after every
//! reconnect, on every `+switch-master` of that name and every
//! [`RECHECK`] (every [`SETTLE`] for a while when they disagree: a
//! switch spreads among them), and passes on the address that a majority of the
//! configured Sentinels name ([`verdict`]); a Sentinel that names another
//! (cut off from the others, or lying, whatever epoch it claims) is
//! reported, never followed, and an agreed answer under an older epoch
//! than the one followed is never taken. [`super::named::apply`] takes
//! each address.

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::named::Known;
use crate::config::ServerAuth;
use crate::kv::redis::server_err;

/// How often the Sentinels are asked even without a message, in case a
/// subscription died silently.
pub const RECHECK: Duration = Duration::from_secs(10);
/// While the Sentinels disagree, they are asked again this soon, up to
/// [`SETTLE_ASKS`] times in a row (Sentinels spread a switch among
/// themselves through their hello messages, every 2 s).
const SETTLE: Duration = Duration::from_millis(250);
const SETTLE_ASKS: u32 = 40;
/// The least time between two askings a message causes (a Sentinel that
/// floods `+switch-master` makes the agent ask no more often).
const MESSAGE_GAP: Duration = Duration::from_millis(100);
/// The pause before a broken subscription is made again.
const RESUBSCRIBE: Duration = Duration::from_secs(1);
/// The longest one question to a Sentinel may take.
const ASK: Duration = Duration::from_secs(5);

/// The Sentinels of one instance's primary.
#[derive(Debug, Clone)]
pub struct Sentinels {
    pub addrs: Vec<String>,
    pub master_name: String,
    pub auth: ServerAuth,
}

/// Why a Sentinel gave no primary.
#[derive(Debug, thiserror::Error)]
pub enum SentinelError {
    #[error("sentinel {addr}: {message}")]
    Unreachable { addr: String, message: String },
    #[error("sentinel {addr} monitors no master named {name:?}")]
    NotMonitored { addr: String, name: String },
}

/// `host:port` of an address a Sentinel gives (IPv6 in brackets).
fn host_port(host: &str, port: &str) -> String {
    match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// The master `s.master_name` as the Sentinel at `addr` knows it.
pub async fn ask(addr: &str, s: &Sentinels) -> Result<Known, SentinelError> {
    let err = |e: &dyn std::fmt::Display| SentinelError::Unreachable {
        addr: addr.to_string(),
        message: e.to_string(),
    };
    let conversation = async {
        let client = crate::kv::redis::client(addr, &s.auth).map_err(|e| err(&e))?;
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| err(&crate::kv::redis::refused(addr, &s.auth, e)))?;
        redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(&s.master_name)
            .query_async::<Vec<String>>(&mut con)
            .await
            .map_err(|e| match e.to_string().contains("No such master") {
                true => SentinelError::NotMonitored {
                    addr: addr.to_string(),
                    name: s.master_name.clone(),
                },
                false => err(&e),
            })
    };
    let fields = tokio::time::timeout(ASK, conversation)
        .await
        .map_err(|_| err(&format!("no answer within {ASK:?}")))??;
    parse_master(&fields).ok_or_else(|| err(&"an answer to SENTINEL MASTER without ip and port"))
}

/// The address and epoch in `SENTINEL MASTER`'s field-value list.
fn parse_master(fields: &[String]) -> Option<Known> {
    let get = |key: &str| {
        fields
            .chunks_exact(2)
            .find(|kv| kv[0] == key)
            .map(|kv| kv[1].as_str())
    };
    // Data from a peer: an IP address or a plain host name, a port number.
    let ip = get("ip")
        .filter(|h| h.parse::<std::net::IpAddr>().is_ok() || crate::peer_text::is_plain_name(h))?;
    let port: u16 = get("port")?.parse().ok()?;
    Some(Known {
        epoch: get("config-epoch")?.parse().ok()?,
        addr: host_port(ip, &port.to_string()),
    })
}

/// The new primary a `+switch-master` message names (`<name> <old ip>
/// <old port> <new ip> <new port>`).
fn switched_to(message: &str) -> Option<String> {
    let words: Vec<&str> = message.split(' ').collect();
    match words.as_slice() {
        [_, _, _, ip, port] => Some(host_port(ip, port)),
        _ => None,
    }
}

/// Whether a `+switch-master` message (`<name> <old ip> <old port> <new
/// ip> <new port>`) is about `name`.
pub fn is_switch_of(message: &str, name: &str) -> bool {
    message.split(' ').next() == Some(name)
}

/// Whether `k` replaces what is followed `now`: a change under the same
/// or a newer epoch.
fn supersedes(k: &Known, now: Option<&Known>) -> bool {
    now.is_none_or(|n| k.epoch >= n.epoch && k != n)
}

/// What the configured Sentinels said at one asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The primary a majority of the configured Sentinels name, under the
    /// highest epoch a majority of them reached.
    pub agreed: Option<Known>,
    /// How many name the most named primary, of how many are configured.
    pub votes: usize,
    pub configured: usize,
    /// The Sentinels that name another primary than the most named one,
    /// with what they name.
    pub dissent: Vec<(String, Known)>,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (votes, of) = (self.votes, self.configured);
        match &self.agreed {
            Some(k) => write!(
                f,
                "{votes} of {of} Sentinels name {} (epoch {})",
                k.addr, k.epoch
            )?,
            None => write!(
                f,
                "no majority: at most {votes} of {of} Sentinels name the same primary; nothing is acted on"
            )?,
        }
        for (sentinel, k) in &self.dissent {
            write!(
                f,
                "; Sentinel {sentinel} names {} (epoch {}): not followed",
                k.addr, k.epoch
            )?;
        }
        Ok(())
    }
}

/// The verdict of `configured` Sentinels of which those in `answers`
/// answered (each Sentinel once): the address named by more than half of
/// the configured ones, under the highest epoch that many of them
/// reached, whatever epochs the others claim.
pub fn verdict(configured: usize, answers: &[(String, Known)]) -> Verdict {
    let votes = |addr: &str| answers.iter().filter(|(_, k)| k.addr == addr).count();
    let most = answers
        .iter()
        .map(|(_, k)| k.addr.as_str())
        .max_by_key(|a| votes(a));
    let (top, count) = match most {
        Some(addr) => (addr, votes(addr)),
        None => ("", 0),
    };
    // The highest epoch a majority reached: a minority's higher one (a
    // liar that agrees on the address) would outlast every later verdict.
    let majority = configured / 2 + 1;
    let mut epochs: Vec<u64> = answers
        .iter()
        .filter(|(_, k)| k.addr == top)
        .map(|(_, k)| k.epoch)
        .collect();
    epochs.sort_unstable_by(|a, b| b.cmp(a));
    let agreed = epochs.get(majority - 1).map(|&epoch| Known {
        addr: top.to_string(),
        epoch,
    });
    let dissent = answers
        .iter()
        .filter(|(_, k)| k.addr != top)
        .cloned()
        .collect();
    Verdict {
        agreed,
        votes: count,
        configured,
        dissent,
    }
}

/// Asks every Sentinel; those that cannot answer are logged.
async fn ask_all(s: &Sentinels) -> Verdict {
    let answers = futures::future::join_all(s.addrs.iter().map(|a| ask(a, s))).await;
    let mut named = Vec::new();
    for (addr, answer) in s.addrs.iter().zip(answers) {
        match answer {
            Ok(k) => named.push((addr.clone(), k)),
            Err(e) => warn!(error = %e, "a Sentinel gave no primary"),
        }
    }
    let v = verdict(s.addrs.len(), &named);
    if !v.dissent.is_empty() || v.agreed.is_none() {
        warn!(master = %s.master_name, verdict = %v, "the Sentinels disagree");
    }
    v
}

/// Keeps `primary` at the address a majority of the Sentinels name,
/// never going back to an older epoch, until `stop`; `report` hears every
/// verdict (status, the dissent counter).
pub async fn watch(
    s: Sentinels,
    primary: watch::Sender<Option<Known>>,
    report: impl Fn(&Verdict) + Send,
    stop: CancellationToken,
) {
    // Takes a verdict and says when to ask next: soon while the Sentinels
    // disagree (a switch spreads among them within seconds: the agent
    // acts once a majority has it, not at the next RECHECK), for at most
    // SETTLE_ASKS askings in a row (a lasting dissenter is only reported).
    let mut unsettled = 0;
    let mut take = |v: Verdict| {
        report(&v);
        let settled = v.agreed.is_some() && v.dissent.is_empty();
        primary.send_if_modified(|now| match v.agreed {
            Some(k) if supersedes(&k, now.as_ref()) => {
                *now = Some(k);
                true
            }
            _ => false,
        });
        unsettled = if settled { 0 } else { unsettled + 1 };
        let wait = match unsettled {
            1..=SETTLE_ASKS => SETTLE,
            _ => RECHECK,
        };
        Instant::now() + wait
    };
    let mut next = 0;
    while !stop.is_cancelled() {
        // Subscribed first, then asked: no switch falls in between.
        let addr = &s.addrs[next % s.addrs.len()];
        next += 1;
        let mut sub = match tokio::time::timeout(ASK, subscribe(addr, &s.auth)).await {
            Ok(Ok(sub)) => sub,
            Ok(Err(e)) => {
                warn!(sentinel = %addr, error = %e, "cannot subscribe to the Sentinel");
                take(ask_all(&s).await);
                pause(&stop, RESUBSCRIBE).await;
                continue;
            }
            Err(_) => {
                warn!(sentinel = %addr, "the Sentinel did not take the subscription within {ASK:?}");
                continue;
            }
        };
        info!(sentinel = %addr, master = %s.master_name, "following the Sentinels' +switch-master");
        let mut due = take(ask_all(&s).await);
        let mut asked = Instant::now();
        let mut messages = sub.on_message();
        // When due whatever the subscribed Sentinel sends (its messages
        // never put the asking off), and on a switch of the master's name,
        // at most once every MESSAGE_GAP.
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                m = messages.next() => match m {
                    Some(m) => {
                        // A message only makes the agent ask them all.
                        let text: String = m.get_payload().unwrap_or_default();
                        if is_news(&text, &s.master_name, primary.borrow().as_ref()) && asked.elapsed() >= MESSAGE_GAP {
                            info!(sentinel = %addr, switch = %text, "a Sentinel announced a switch of the primary: asking them all");
                            due = take(ask_all(&s).await);
                            asked = Instant::now();
                        }
                    }
                    None => {
                        warn!(sentinel = %addr, "the subscription to the Sentinel ended; subscribing again");
                        break;
                    }
                },
                _ = tokio::time::sleep_until(due) => {
                    due = take(ask_all(&s).await);
                    asked = Instant::now();
                }
            }
        }
        pause(&stop, RESUBSCRIBE).await;
    }
}

/// Subscribes to the Sentinel at `addr`'s `+switch-master` messages.
async fn subscribe(
    addr: &str,
    auth: &ServerAuth,
) -> Result<redis::aio::PubSub, crate::kv::redis::RedisError> {
    let client = crate::kv::redis::client(addr, auth)?;
    let mut sub = client
        .get_async_pubsub()
        .await
        .map_err(|e| crate::kv::redis::refused(addr, auth, e))?;
    sub.subscribe("+switch-master")
        .await
        .map_err(|e| server_err(addr, e))?;
    Ok(sub)
}

/// Whether a Sentinel's message `text` is news: a switch of `master`'s
/// primary to another than the one `followed` (a flood of the same one
/// asks nothing).
fn is_news(text: &str, master: &str, followed: Option<&Known>) -> bool {
    is_switch_of(text, master)
        && switched_to(text).is_some_and(|to| followed.is_none_or(|now| now.addr != to))
}

async fn pause(stop: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_master_is_read_from_sentinel_master_fields() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let fields = f(&[
            "name",
            "m",
            "ip",
            "10.0.0.2",
            "port",
            "6380",
            "config-epoch",
            "7",
        ]);
        assert_eq!(
            parse_master(&fields),
            Some(Known {
                epoch: 7,
                addr: "10.0.0.2:6380".into()
            })
        );
        let v6 = f(&["ip", "::1", "port", "6379", "config-epoch", "0"]);
        assert_eq!(parse_master(&v6).unwrap().addr, "[::1]:6379");
        assert_eq!(parse_master(&f(&["ip", "10.0.0.2", "port"])), None);
        // A lying Sentinel's text is data: no control characters reach
        // status, no port that is no number.
        let escape = f(&[
            "ip",
            "\u{1b}]0;PWNED\u{7}",
            "port",
            "6379",
            "config-epoch",
            "1",
        ]);
        assert_eq!(parse_master(&escape), None);
        let port = f(&["ip", "10.0.0.2", "port", "63 79", "config-epoch", "1"]);
        assert_eq!(parse_master(&port), None);
        assert_eq!(
            switched_to("m 10.0.0.1 6379 10.0.0.2 6380").as_deref(),
            Some("10.0.0.2:6380")
        );
        assert_eq!(switched_to("m 10.0.0.1"), None);
        assert!(is_switch_of("m 10.0.0.1 6379 10.0.0.2 6380", "m"));
        assert!(!is_switch_of("mm 10.0.0.1 6379 10.0.0.2 6380", "m"));
    }

    #[test]
    fn an_older_epoch_never_replaces_a_newer_one() {
        assert!(supersedes(&k(1, "a:1"), None));
        assert!(supersedes(&k(2, "b:1"), Some(&k(1, "a:1"))));
        assert!(
            !supersedes(&k(1, "a:1"), Some(&k(2, "b:1"))),
            "a cut-off Sentinel"
        );
        assert!(!supersedes(&k(2, "b:1"), Some(&k(2, "b:1"))), "nothing new");
    }

    fn k(epoch: u64, addr: &str) -> Known {
        Known {
            epoch,
            addr: addr.into(),
        }
    }

    fn said(answers: &[(&str, Known)]) -> Vec<(String, Known)> {
        answers
            .iter()
            .map(|(s, k)| (s.to_string(), k.clone()))
            .collect()
    }

    #[test]
    fn only_a_majority_of_the_configured_sentinels_is_followed() {
        let (p, a) = (k(1, "p:1"), k(2, "a:1"));
        // All agree.
        let v = verdict(
            3,
            &said(&[("s1", p.clone()), ("s2", p.clone()), ("s3", p.clone())]),
        );
        assert_eq!(v.agreed, Some(p.clone()));
        assert!(v.dissent.is_empty());
        // One lies with a huge epoch: reported, never followed.
        let liar = k(1 << 62, "fake:1");
        let v = verdict(
            3,
            &said(&[("s1", p.clone()), ("s2", p.clone()), ("s3", liar.clone())]),
        );
        assert_eq!(v.agreed, Some(p.clone()));
        assert_eq!(v.dissent, said(&[("s3", liar.clone())]));
        assert!(v.to_string().contains("Sentinel s3 names fake:1"), "{v}");
        // Two that answer of three configured agree: a majority of three.
        let v = verdict(3, &said(&[("s1", a.clone()), ("s2", a.clone())]));
        assert_eq!(v.agreed, Some(a.clone()));
        // One that answers of three, however high its epoch: no majority.
        for lone in [liar.clone(), a.clone()] {
            let v = verdict(3, &said(&[("s3", lone)]));
            assert_eq!(v.agreed, None);
            assert!(v.to_string().starts_with("no majority"), "{v}");
        }
        // Split two against two of four: none.
        let v = verdict(
            4,
            &said(&[
                ("s1", p.clone()),
                ("s2", p.clone()),
                ("s3", a.clone()),
                ("s4", a.clone()),
            ]),
        );
        assert_eq!(v.agreed, None);
        // A majority mid-switch: the highest epoch the majority reached.
        let v = verdict(
            3,
            &said(&[("s1", k(3, "a:1")), ("s2", k(4, "a:1")), ("s3", p.clone())]),
        );
        assert_eq!(v.agreed, Some(k(3, "a:1")));
        assert_eq!(verdict(3, &[]).agreed, None);
        // A liar that agrees on the address under a huge epoch: the
        // majority's epoch stands, so the next agreed switch supersedes it.
        let v = verdict(
            3,
            &said(&[
                ("s1", p.clone()),
                ("s2", p.clone()),
                ("s3", k(1 << 62, "p:1")),
            ]),
        );
        assert_eq!(v.agreed, Some(p.clone()));
        let next = verdict(
            3,
            &said(&[
                ("s1", a.clone()),
                ("s2", a.clone()),
                ("s3", k(1 << 62, "p:1")),
            ]),
        );
        assert!(supersedes(next.agreed.as_ref().unwrap(), v.agreed.as_ref()));
    }
}
