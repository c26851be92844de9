//! Who an instance's stream log follows, and the task that follows it: a
//! primary, as one of its replicas ([`super::follow`]), or agents, nearest
//! first ([`super::pull`]). The source starts as the configuration says
//! (`[redis] primary_addr` or `[stream] upstream`); a fan-out sets a chain
//! of agents and a failover a new primary ([`crate::instance::failover`]), and what
//! was set is kept in the log's directory for as long as the configuration
//! names the same source. [`run`] runs the writer the source of the moment
//! needs and switches writers when the source changes kind; the log and
//! what its readers hold carry over.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::follow::Follow;
use super::mend::Upstream;
use super::pull::Pull;
use super::{Downstream, SharedLog};

/// The most upstreams in a chain.
pub const MAX_CHAIN: usize = 16;
/// The source's file in the log's directory.
pub const SOURCE_FILE: &str = "upstreams.json";

/// What a log follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A primary (`host:port`), as its replica.
    Primary(String),
    /// Agents (gRPC `host:port`), nearest first.
    Agents(Vec<String>),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Primary(addr) => write!(f, "primary {addr}"),
            Source::Agents(chain) => write!(f, "agent {}", chain.join(", then ")),
        }
    }
}

/// The source of a log, as it was set, and where it is kept.
pub struct Upstreams {
    configured: String,
    file: PathBuf,
    source: watch::Sender<Source>,
}

/// The source's file: the chain of agents, or the primary when one was
/// set, under the configured source it was set under.
#[derive(serde::Serialize, serde::Deserialize)]
struct SourceFile {
    configured: String,
    #[serde(default)]
    chain: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    primary: String,
}

/// Why a chain was refused.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("give 1 to {MAX_CHAIN} upstream agents, nearest first")]
    Length,
    #[error("{0:?} is not an agent's gRPC address host:port")]
    NotAnAgent(String),
    #[error("{0} is not in sync.allowed_sources of this agent; add it there to follow it")]
    NotAllowed(String),
    #[error("cannot keep the stream's source in {}: {source}", path.display())]
    Keep {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl Upstreams {
    /// The source kept in `dir` when it was set under `configured`, else
    /// `configured`.
    pub fn open(dir: &Path, configured: Source) -> Arc<Upstreams> {
        let file = dir.join(SOURCE_FILE);
        let key = key(&configured);
        let kept = crate::sys::fs::read_regular(&file, 64 << 10)
            .ok()
            .and_then(|b| serde_json::from_slice::<SourceFile>(&b).ok())
            .filter(|k| k.configured == key)
            .and_then(|k| match (k.primary.is_empty(), k.chain.is_empty()) {
                (false, _) => Some(Source::Primary(k.primary)),
                (true, false) => Some(Source::Agents(k.chain)),
                (true, true) => None,
            })
            .filter(well_formed);
        Arc::new(Upstreams {
            configured: key,
            file,
            source: watch::Sender::new(kept.unwrap_or(configured)),
        })
    }

    /// Follows `chain` (nearest first) from now on, each checked against
    /// `allowed` (`[sync] allowed_sources`); the session in progress ends
    /// and the next asks the nearest from the log's end.
    pub fn set(&self, chain: Vec<String>, allowed: &[String]) -> Result<(), ChainError> {
        if chain.is_empty() || chain.len() > MAX_CHAIN {
            return Err(ChainError::Length);
        }
        if let Some(bad) = chain.iter().find(|u| !crate::rpc::dial::is_agent_addr(u)) {
            return Err(ChainError::NotAnAgent(bad.clone()));
        }
        if let Some(bad) = chain
            .iter()
            .find(|u| !crate::rpc::dial::allowed(allowed, u))
        {
            return Err(ChainError::NotAllowed(bad.clone()));
        }
        self.keep(Source::Agents(chain))
    }

    /// Follows the primary at `addr` from now on, from the log's end.
    pub fn set_primary(&self, addr: &str) -> Result<(), ChainError> {
        self.keep(Source::Primary(addr.to_string()))
    }

    fn keep(&self, source: Source) -> Result<(), ChainError> {
        let (chain, primary) = match &source {
            Source::Primary(addr) => (Vec::new(), addr.clone()),
            Source::Agents(chain) => (chain.clone(), String::new()),
        };
        let kept = SourceFile {
            configured: self.configured.clone(),
            chain,
            primary,
        };
        let text = serde_json::to_vec(&kept).expect("a source serialises");
        crate::sys::fs::write_atomic(&self.file, &text, (".kvsync-chain-", ".tmp"), 0o644)
            .map_err(|source| ChainError::Keep {
                path: self.file.clone(),
                source,
            })?;
        self.source.send_replace(source);
        Ok(())
    }

    /// The source now.
    pub fn source(&self) -> Source {
        self.source.borrow().clone()
    }

    /// The chain of agents now, nearest first (empty: a primary).
    pub fn chain(&self) -> Vec<String> {
        match &*self.source.borrow() {
            Source::Agents(chain) => chain.clone(),
            Source::Primary(_) => Vec::new(),
        }
    }

    /// The source, to wait for its changes.
    pub fn watch(&self) -> watch::Receiver<Source> {
        self.source.subscribe()
    }
}

/// Whether a kept source has the shape [`Upstreams::set`] gives one (a
/// primary is kept only when non-empty): a file that does not (damaged,
/// or written by hand) is not followed.
fn well_formed(source: &Source) -> bool {
    match source {
        Source::Primary(_) => true,
        Source::Agents(chain) => {
            (1..=MAX_CHAIN).contains(&chain.len())
                && chain.iter().all(|u| crate::rpc::dial::is_agent_addr(u))
        }
    }
}

/// The configured source's key in the file: an agent's address as it was
/// written before a primary could be kept there, or `primary <addr>`.
fn key(configured: &Source) -> String {
    match configured {
        Source::Agents(chain) => chain.join(","),
        primary => primary.to_string(),
    }
}

/// What the two writers need: following a primary (its address set from
/// the source), and pulling from agents.
pub struct Writers {
    pub follow: Follow,
    pub pull: Arc<Pull>,
    /// The local server's address (`[redis] server_addr`): once it is the
    /// primary, it is no longer fed from the log.
    pub local_server: String,
}

/// Follows the source of `upstreams` into `stream` until `stop`: a
/// primary with [`super::follow::run`] (and its write safety watched), agents with
/// [`super::pull::run`], either with [`super::mend::run`] beside it; when the source changes kind, or names another
/// primary, the writer in progress is stopped and the other started from
/// the log's end.
pub async fn run(
    writers: Writers,
    upstreams: Arc<Upstreams>,
    stream: SharedLog,
    stop: CancellationToken,
) {
    let mut source = upstreams.watch();
    loop {
        let now = source.borrow_and_update().clone();
        stream.set_source(now.clone());
        let task = stop.child_token();
        let writer = async {
            match &now {
                Source::Primary(addr) => {
                    if *addr == writers.local_server {
                        // Promoted: what it acknowledged as a fed server
                        // no longer holds anything back.
                        stream.forget(&Downstream::Server);
                    }
                    let follow = Follow {
                        primary: addr.clone(),
                        ..writers.follow.clone()
                    };
                    tokio::join!(
                        super::safety::write_safety(
                            (follow.instance.clone(), addr.clone()),
                            follow.auth.clone(),
                            follow.metrics.clone(),
                            stream.clone(),
                            task.clone(),
                        ),
                        super::follow::snapshots_on_demand(
                            follow.clone(),
                            stream.clone(),
                            task.clone()
                        ),
                        super::mend::run(
                            Upstream::Primary(follow.clone()),
                            stream.clone(),
                            task.clone()
                        ),
                        super::follow::run(follow, stream.clone(), task.clone()),
                    );
                }
                Source::Agents(_) => {
                    let mend = Upstream::Agents(writers.pull.clone());
                    tokio::select! {
                        () = super::pull::run(writers.pull.clone(), stream.clone(), task.clone()) => {}
                        () = super::mend::run(mend, stream.clone(), task.clone()) => {}
                    }
                }
            }
        };
        let switched = async {
            loop {
                if source.changed().await.is_err() {
                    return false;
                }
                match (&now, &*source.borrow()) {
                    // A new chain is the puller's to follow.
                    (Source::Agents(_), next @ Source::Agents(_)) => {
                        stream.set_source(next.clone());
                        continue;
                    }
                    (was, next) if was == next => continue,
                    _ => return true,
                }
            }
        };
        tokio::pin!(writer);
        let switch = tokio::select! {
            () = &mut writer => return,
            s = switched => s,
        };
        // The writer ends its session and clears what it reported.
        task.cancel();
        writer.await;
        if !switch {
            return;
        }
        info!(instance = %writers.follow.instance, from = %now, to = %source.borrow().clone(), "the stream log follows a new source from its end");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_is_checked_kept_and_dropped_when_the_configured_one_changes() {
        let dir = tempfile::tempdir().unwrap();
        let origin = || Source::Agents(vec!["origin:1".into()]);
        let up = Upstreams::open(dir.path(), origin());
        assert_eq!(up.chain(), ["origin:1"]);
        let allowed = ["relay".to_string(), "origin".to_string()];
        assert!(matches!(up.set(vec![], &[]), Err(ChainError::Length)));
        assert!(matches!(
            up.set(vec!["no port".into()], &[]),
            Err(ChainError::NotAnAgent(_))
        ));
        assert!(matches!(
            up.set(vec!["elsewhere:1".into()], &allowed),
            Err(ChainError::NotAllowed(_))
        ));
        assert_eq!(up.chain(), ["origin:1"], "a refused chain changes nothing");
        up.set(vec!["relay:1".into(), "origin:1".into()], &allowed)
            .unwrap();
        assert_eq!(up.chain(), ["relay:1", "origin:1"]);
        assert_eq!(
            Upstreams::open(dir.path(), origin()).chain(),
            ["relay:1", "origin:1"],
            "kept across a restart"
        );
        assert_eq!(
            Upstreams::open(dir.path(), Source::Agents(vec!["other:1".into()])).chain(),
            ["other:1"],
            "the operator's new upstream wins"
        );
        // A failover's primary is kept the same way, and a chain kept by
        // an older agent (no primary) still reads.
        let up = Upstreams::open(dir.path(), origin());
        up.set_primary("10.0.0.2:6379").unwrap();
        let again = Upstreams::open(dir.path(), origin());
        assert_eq!(again.source(), Source::Primary("10.0.0.2:6379".into()));
        assert!(again.chain().is_empty());
        std::fs::write(
            dir.path().join(SOURCE_FILE),
            r#"{"configured":"origin:1","chain":["relay:1"]}"#,
        )
        .unwrap();
        assert_eq!(Upstreams::open(dir.path(), origin()).chain(), ["relay:1"]);
        let primary = Source::Primary("10.0.0.1:6379".into());
        assert_eq!(
            Upstreams::open(dir.path(), primary.clone()).source(),
            primary,
            "kept under another configured source: not this one's"
        );
        // A file in a shape no change of source gives (damaged, or
        // written by hand) is not followed: the configured source is.
        for bad in [
            r#"{"configured":"origin:1","chain":["not an address"]}"#,
            r#"{"configured":"origin:1","chain":["a:1","b:1","c:1","d:1","e:1","f:1","g:1","h:1","i:1","j:1","k:1","l:1","m:1","n:1","o:1","p:1","q:1"]}"#,
        ] {
            std::fs::write(dir.path().join(SOURCE_FILE), bad).unwrap();
            assert_eq!(
                Upstreams::open(dir.path(), origin()).source(),
                origin(),
                "{bad}"
            );
        }
    }
}
