//! A primary named by a voice the agent follows (the majority of the
//! configured Sentinels, [`super::sentinel`]; the local node of a cluster,
//! [`super::shard`]) and its take: [`apply`] takes each named address the
//! way `kvsync stream follow --primary` does
//! ([`crate::instance::failover::follow_primary`]), again and again until
//! it is taken (the promoted server's agent may not have moved yet), and
//! until the old primary is re-attached too (it may be down); a newer name
//! replaces it. Which names are newer is the voice's to say.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The pause before a failed take of a primary is tried again (the
/// promoted server's agent usually moves within milliseconds).
pub const RETRY: Duration = Duration::from_millis(200);
/// In the first [`EAGER`] of a primary's tries, the pause is this short
/// instead: the old primary's agent re-attaches its server only once the
/// promoted server's agent has moved, and every moment it waits the old
/// primary may take writes that the failover loses.
const RETRY_EAGER: Duration = Duration::from_millis(10);
const EAGER: Duration = Duration::from_secs(1);
/// At most one name in this long gets the [`EAGER`] tries (a voice whose
/// name flaps makes no flood of them), and the pause between tries
/// doubles up to [`RETRY_MAX`] (a name never proved is asked about ever
/// more rarely).
const EAGER_GAP: Duration = Duration::from_secs(10);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// The pause before a take whose only part left is the old primary's
/// re-attach (it did not answer) is tried again.
pub const PENDING: Duration = Duration::from_secs(10);

/// A primary as a voice names it, under the epoch of that voice's
/// configuration (a Sentinel's, or the shard primary's in a cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    pub epoch: u64,
    pub addr: String,
}

/// How a try of a primary ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// Everything is done.
    Done(String),
    /// The log follows it, but the old primary is still to be re-attached
    /// (it did not answer): tried again every [`PENDING`].
    Pending(String),
}

/// Takes every primary `primary` names with `follow(addr)`, tried again
/// after [`RETRY`] (at first sooner, then ever later) until it is taken (every [`PENDING`]
/// while only the old primary's re-attach is pending) or a newer one is
/// named, until `stop`; `voice` names who named it in the log
/// ("the Sentinels'", "the cluster's").
pub async fn apply<F, Fut, E>(
    voice: &'static str,
    mut primary: watch::Receiver<Option<Known>>,
    follow: F,
    stop: CancellationToken,
) where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<Taken, E>>,
    E: std::fmt::Display,
{
    let mut eager_at: Option<Instant> = None;
    'next: loop {
        let wanted = primary.borrow_and_update().clone();
        if let Some(k) = wanted {
            let mut said = String::new();
            let first = Instant::now();
            let eager = eager_at.is_none_or(|t| t.elapsed() >= EAGER_GAP);
            if eager {
                eager_at = Some(first);
            }
            let mut retry = RETRY;
            loop {
                // Said once per reason, not at every try.
                let (again, now) = match follow(k.addr.clone()).await {
                    Ok(Taken::Done(done)) => {
                        info!(primary = %k.addr, epoch = k.epoch, %done, "the stream follows {voice} primary");
                        break;
                    }
                    Ok(Taken::Pending(e)) => (PENDING, e),
                    Err(e) if eager && first.elapsed() < EAGER => (RETRY_EAGER, e.to_string()),
                    Err(e) => {
                        let pause = retry;
                        retry = (retry * 2).min(RETRY_MAX);
                        (pause, e.to_string())
                    }
                };
                if now != said {
                    warn!(primary = %k.addr, error = %now, "{voice} primary is not wholly taken yet; trying again");
                    said = now;
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    changed = primary.changed() => match changed {
                        Ok(()) => continue 'next,
                        Err(_) => return,
                    },
                    _ = tokio::time::sleep(again) => {}
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

    fn k(epoch: u64, addr: &str) -> Known {
        Known {
            epoch,
            addr: addr.into(),
        }
    }

    #[tokio::test]
    async fn a_primary_not_taken_is_tried_again_until_taken_and_a_newer_one_wins() {
        let (tx, rx) = watch::channel(None);
        let stop = CancellationToken::new();
        let (seen, mut tries) = tokio::sync::mpsc::unbounded_channel();
        let follow = move |addr: String| {
            let _ = seen.send(addr.clone());
            async move {
                match addr.as_str() {
                    "a:1" => Err("the promoted server's agent has not moved yet"),
                    _ => Ok(Taken::Done(addr)),
                }
            }
        };
        let task = tokio::spawn(apply("the test's", rx, follow, stop.clone()));
        type Tries = tokio::sync::mpsc::UnboundedReceiver<String>;
        async fn next(tries: &mut Tries) -> String {
            let t = tokio::time::timeout(Duration::from_secs(10), tries.recv());
            t.await.expect("a try within the deadline").unwrap()
        }
        tx.send_replace(Some(k(1, "a:1")));
        assert_eq!(next(&mut tries).await, "a:1");
        assert_eq!(next(&mut tries).await, "a:1", "tried again");
        tx.send_replace(Some(k(2, "b:1")));
        // A try of a:1 may have started before the change was seen.
        let mut t = next(&mut tries).await;
        while t == "a:1" {
            t = next(&mut tries).await;
        }
        assert_eq!(t, "b:1");
        stop.cancel();
        task.await.unwrap();
        assert!(
            tries.try_recv().is_err(),
            "b:1 was taken once, then nothing more"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pending_re_attach_is_tried_again_until_done() {
        let (tx, rx) = watch::channel(None);
        let stop = CancellationToken::new();
        let tries = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = tries.clone();
        let follow = move |_addr: String| {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                match n {
                    // The old primary is down for two tries, then back.
                    0 | 1 => Ok::<_, String>(Taken::Pending("the old primary is down".into())),
                    _ => Ok(Taken::Done("re-attached".into())),
                }
            }
        };
        let task = tokio::spawn(apply("the test's", rx, follow, stop.clone()));
        tx.send_replace(Some(k(1, "a:1")));
        // Virtual time: three tries take two PENDINGs.
        tokio::time::sleep(PENDING * 2 + RETRY).await;
        assert_eq!(tries.load(std::sync::atomic::Ordering::SeqCst), 3);
        tokio::time::sleep(PENDING * 3).await;
        assert_eq!(
            tries.load(std::sync::atomic::Ordering::SeqCst),
            3,
            "done: no more tries"
        );
        stop.cancel();
        task.await.unwrap();
    }
}
