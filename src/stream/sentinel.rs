//! Redis Sentinel's word on who an instance's primary is
//! (`[stream] sentinels`, `master_name`): [`watch`] asks every Sentinel
//! for the master it knows (`SENTINEL MASTER`) at start, after every
//! reconnect, on every `+switch-master` of that name and every
//! [`RECHECK`], and passes on the address held under the newest
//! configuration epoch; an answer under an older epoch than the one
//! followed (a Sentinel cut off from the others) is never taken. [`apply`]
//! takes each address the way `kvsync stream follow --primary` does
//! ([`super::failover::follow_primary`]), again and again until it is
//! taken: the promoted server's agent may not have moved yet.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::kv::redis::server_err;

/// How often the Sentinels are asked even without a message, in case a
/// subscription died silently.
pub const RECHECK: Duration = Duration::from_secs(10);
/// The pause before a failed take of a primary is tried again (the
/// promoted server's agent usually moves within milliseconds).
pub const RETRY: Duration = Duration::from_millis(200);
/// The pause before a broken subscription is made again.
const RESUBSCRIBE: Duration = Duration::from_secs(1);
/// The longest one question to a Sentinel may take.
const ASK: Duration = Duration::from_secs(5);

/// The Sentinels of one instance's primary.
#[derive(Debug, Clone)]
pub struct Sentinels {
    pub addrs: Vec<String>,
    pub master_name: String,
    pub password: String,
}

/// The primary a Sentinel knows, under its configuration epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    pub epoch: u64,
    pub addr: String,
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
        let client = crate::kv::redis::client(addr, &s.password).map_err(|e| err(&e))?;
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| err(&e))?;
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
    Some(Known {
        epoch: get("config-epoch")?.parse().ok()?,
        addr: host_port(get("ip")?, get("port")?),
    })
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

/// The newest of what the Sentinels answer, if any answers; those that
/// cannot are logged.
async fn newest(s: &Sentinels) -> Option<Known> {
    let answers = futures::future::join_all(s.addrs.iter().map(|a| ask(a, s))).await;
    let mut best: Option<Known> = None;
    for answer in answers {
        match answer {
            Ok(k) if best.as_ref().is_none_or(|b| k.epoch > b.epoch) => best = Some(k),
            Ok(_) => {}
            Err(e) => warn!(error = %e, "a Sentinel gave no primary"),
        }
    }
    best
}

/// Keeps `primary` at the address the Sentinels hold under the newest
/// epoch, never going back to an older epoch, until `stop`.
pub async fn watch(s: Sentinels, primary: watch::Sender<Option<Known>>, stop: CancellationToken) {
    let take = |k: Option<Known>| {
        primary.send_if_modified(|now| match k {
            Some(k) if supersedes(&k, now.as_ref()) => {
                *now = Some(k);
                true
            }
            _ => false,
        });
    };
    let mut next = 0;
    while !stop.is_cancelled() {
        // Subscribed first, then asked: no switch falls in between.
        let addr = &s.addrs[next % s.addrs.len()];
        next += 1;
        let subscribed = async {
            let client = crate::kv::redis::client(addr, &s.password)?;
            let mut sub = client
                .get_async_pubsub()
                .await
                .map_err(|e| server_err(addr, e))?;
            sub.subscribe("+switch-master")
                .await
                .map_err(|e| server_err(addr, e))?;
            Ok::<_, crate::kv::redis::RedisError>(sub)
        };
        let mut sub = match tokio::time::timeout(ASK, subscribed).await {
            Ok(Ok(sub)) => sub,
            Ok(Err(e)) => {
                warn!(sentinel = %addr, error = %e, "cannot subscribe to the Sentinel");
                take(newest(&s).await);
                pause(&stop, RESUBSCRIBE).await;
                continue;
            }
            Err(_) => {
                warn!(sentinel = %addr, "the Sentinel did not take the subscription within {ASK:?}");
                continue;
            }
        };
        info!(sentinel = %addr, master = %s.master_name, "following the Sentinels' +switch-master");
        take(newest(&s).await);
        let mut messages = sub.on_message();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                m = messages.next() => match m {
                    Some(m) => {
                        let text: String = m.get_payload().unwrap_or_default();
                        if is_switch_of(&text, &s.master_name) {
                            info!(sentinel = %addr, switch = %text, "the Sentinels switched the primary");
                            take(newest(&s).await);
                        }
                    }
                    None => {
                        warn!(sentinel = %addr, "the subscription to the Sentinel ended; subscribing again");
                        break;
                    }
                },
                _ = tokio::time::sleep(RECHECK) => take(newest(&s).await),
            }
        }
        pause(&stop, RESUBSCRIBE).await;
    }
}

async fn pause(stop: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}

/// Takes every primary `primary` names with `follow(addr, first)`, tried
/// again every [`RETRY`] until it is taken or a newer one is named, until
/// `stop`; `first` says whether this is the first try of that primary.
pub async fn apply<F, Fut, E>(
    mut primary: watch::Receiver<Option<Known>>,
    follow: F,
    stop: CancellationToken,
) where
    F: Fn(String, bool) -> Fut,
    Fut: Future<Output = Result<String, E>>,
    E: std::fmt::Display,
{
    'next: loop {
        let wanted = primary.borrow_and_update().clone();
        if let Some(k) = wanted {
            let (mut said, mut first) = (String::new(), true);
            loop {
                let tried = follow(k.addr.clone(), first);
                first = false;
                match tried.await {
                    Ok(done) => {
                        info!(primary = %k.addr, epoch = k.epoch, %done, "the stream follows the Sentinels' primary");
                        break;
                    }
                    Err(e) => {
                        // Said once per reason, not at every try.
                        let e = e.to_string();
                        if e != said {
                            warn!(primary = %k.addr, error = %e, "the Sentinels' primary is not followed yet; trying again");
                            said = e;
                        }
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    changed = primary.changed() => match changed {
                        Ok(()) => continue 'next,
                        Err(_) => return,
                    },
                    _ = tokio::time::sleep(RETRY) => {}
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = primary.changed() => if changed.is_err() { return },
        }
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
        assert!(is_switch_of("m 10.0.0.1 6379 10.0.0.2 6380", "m"));
        assert!(!is_switch_of("mm 10.0.0.1 6379 10.0.0.2 6380", "m"));
    }

    #[test]
    fn an_older_epoch_never_replaces_a_newer_one() {
        let k = |epoch, addr: &str| Known {
            epoch,
            addr: addr.into(),
        };
        assert!(supersedes(&k(1, "a:1"), None));
        assert!(supersedes(&k(2, "b:1"), Some(&k(1, "a:1"))));
        assert!(
            !supersedes(&k(1, "a:1"), Some(&k(2, "b:1"))),
            "a cut-off Sentinel"
        );
        assert!(!supersedes(&k(2, "b:1"), Some(&k(2, "b:1"))), "nothing new");
    }

    #[tokio::test]
    async fn a_primary_not_taken_is_tried_again_until_taken_and_a_newer_one_wins() {
        let (tx, rx) = watch::channel(None);
        let stop = CancellationToken::new();
        let (seen, mut tries) = tokio::sync::mpsc::unbounded_channel();
        let follow = move |addr: String, first: bool| {
            let _ = seen.send((addr.clone(), first));
            async move {
                match addr.as_str() {
                    "a:1" => Err("the promoted server's agent has not moved yet"),
                    _ => Ok(addr),
                }
            }
        };
        let task = tokio::spawn(apply(rx, follow, stop.clone()));
        type Tries = tokio::sync::mpsc::UnboundedReceiver<(String, bool)>;
        async fn next(tries: &mut Tries) -> (String, bool) {
            let t = tokio::time::timeout(Duration::from_secs(10), tries.recv());
            t.await.expect("a try within the deadline").unwrap()
        }
        let a = |first| ("a:1".to_string(), first);
        tx.send_replace(Some(Known {
            epoch: 1,
            addr: "a:1".into(),
        }));
        assert_eq!(next(&mut tries).await, a(true));
        assert_eq!(next(&mut tries).await, a(false), "tried again, not first");
        tx.send_replace(Some(Known {
            epoch: 2,
            addr: "b:1".into(),
        }));
        // A try of a:1 may have started before the change was seen.
        let mut t = next(&mut tries).await;
        while t == a(false) {
            t = next(&mut tries).await;
        }
        assert_eq!(t, ("b:1".to_string(), true));
        stop.cancel();
        task.await.unwrap();
        assert!(
            tries.try_recv().is_err(),
            "b:1 was taken once, then nothing more"
        );
    }
}
