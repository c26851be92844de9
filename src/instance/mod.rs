//! The KV instances one agent serves, each with its own parts: its
//! configuration (the agent's shared sections with the instance's own),
//! the catalog of its snapshots, what it relays to other replicas, its
//! primary's backlog guard, its replication stream's log, and the token and tasks of its watchers. What
//! stays agent-wide (the listeners, the session table and its limits, the
//! cache's budget) is not here.
//!
//! A request names an instance, or none; [`Instances::resolve`] is the one
//! rule for which instance that means.

pub mod failover;
pub mod start;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, InstanceConfig};
use crate::kv::backlog::BacklogGuard;
use crate::store::catalog::Catalog;
use crate::store::relay::RelayTable;
use crate::stream::keep::{Health, Verdict};
use crate::stream::SharedLog;

/// One KV instance and its parts.
pub struct Instance {
    pub name: String,
    /// The configuration its parts run with ([`Config::for_instance`]).
    pub config: Config,
    pub catalog: Arc<Catalog>,
    /// What this agent passes on of the instance's snapshots it receives.
    pub relays: Arc<RelayTable>,
    /// Its local primary's backlog, when `[redis] primary_addr` is set.
    pub backlog: Option<Arc<BacklogGuard>>,
    /// Its replication stream's log, when `[stream] dir` is set.
    pub stream: Option<SharedLog>,
    /// Its server's feed from that log (`redis-stream`; with `redis`, a
    /// cluster node's gap its primary's backlog no longer holds).
    pub feed: Option<crate::stream::feed::FeedHandle>,
    /// Whom that log follows, a primary or agents, when it has one.
    pub upstreams: Option<Arc<crate::stream::source::Upstreams>>,
    /// Cancelled when the instance is removed or the agent stops: its
    /// tasks end and its running syncs are cancelled.
    pub stop: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Instance {
    pub fn new(
        config: Config,
        catalog: Arc<Catalog>,
        backlog: Option<Arc<BacklogGuard>>,
        stop: CancellationToken,
    ) -> Instance {
        Instance {
            name: catalog.instance().to_string(),
            config,
            catalog,
            relays: Arc::default(),
            backlog,
            stream: None,
            feed: None,
            upstreams: None,
            stop,
            tasks: Mutex::default(),
        }
    }

    /// Whether the instance runs with `ic`'s own settings.
    pub fn has_settings(&self, ic: &InstanceConfig) -> bool {
        let c = &self.config;
        c.snapshot_dir == ic.snapshot_dir
            && c.snapshot_format == ic.snapshot_format
            && c.handoff == ic.handoff
            && c.redis == ic.redis
            && c.stream == ic.stream
    }

    /// Runs `task` as one of the instance's own, until [`Instance::end`].
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(task);
        self.tasks.lock().expect("tasks lock").push(handle);
    }

    /// The instance's health ([`health_of`] its stream).
    pub fn health(&self) -> Health {
        health_of(self.stream.as_ref())
    }

    /// Stops the instance's tasks and waits for them to end.
    pub async fn end(&self) {
        self.stop.cancel();
        let tasks = std::mem::take(&mut *self.tasks.lock().expect("tasks lock"));
        for task in tasks {
            let _ = task.await;
        }
    }
}

/// The health of an instance with `stream`: the worst of its writer's and
/// its fed server's, with their reasons (ok without a stream: a snapshot
/// instance has nothing it keeps in sync).
pub fn health_of(stream: Option<&SharedLog>) -> Health {
    let Some(s) = stream else {
        return Health::ok("no stream to keep in sync");
    };
    let parts = [
        Some(("stream", s.writer_health())),
        s.server_health().map(|h| ("server", h)),
    ];
    let parts: Vec<_> = parts.into_iter().flatten().collect();
    let verdict = parts
        .iter()
        .map(|(_, h)| h.verdict)
        .max()
        .unwrap_or(Verdict::Ok);
    let reason = parts
        .iter()
        .filter(|(_, h)| h.verdict == verdict)
        .map(|(what, h)| format!("{what}: {}", h.reason))
        .collect::<Vec<_>>()
        .join("; ");
    Health { verdict, reason }
}

/// Keeps `kvsync_instance_health` of instance `name` current (every
/// second) until `stop`.
pub async fn export_health(
    name: String,
    stream: Option<SharedLog>,
    metrics: Arc<crate::metrics::Metrics>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = health_of(stream.as_ref()).verdict;
        for v in Verdict::ALL {
            metrics
                .instance_health
                .with_label_values(&[&name, v.as_str()])
                .set((v == now) as i64);
        }
    }
}

/// Why a request's instance is not one this agent serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstanceError {
    #[error("this agent serves no instance {name:?}; it serves {}", .names.join(", "))]
    Unknown { name: String, names: Vec<String> },
    #[error("this agent serves {} instances ({}); name the one meant (the request's instance field, or --instance)", .names.len(), .names.join(", "))]
    Unnamed { names: Vec<String> },
}

/// The instances of one agent, by name.
#[derive(Default)]
pub struct Instances(RwLock<BTreeMap<String, Arc<Instance>>>);

impl Instances {
    /// The instance `name` means: that one, or, for an empty name, the
    /// only one (so that callers that do not know instances keep working
    /// against a single-instance agent).
    pub fn resolve(&self, name: &str) -> Result<Arc<Instance>, InstanceError> {
        let map = self.0.read().expect("instances lock");
        let names = || map.keys().cloned().collect();
        match name {
            "" if map.len() == 1 => Ok(map.values().next().expect("one instance").clone()),
            "" => Err(InstanceError::Unnamed { names: names() }),
            name => map
                .get(name)
                .cloned()
                .ok_or_else(|| InstanceError::Unknown {
                    name: name.to_string(),
                    names: names(),
                }),
        }
    }

    /// Every instance, by name.
    pub fn all(&self) -> Vec<Arc<Instance>> {
        self.0
            .read()
            .expect("instances lock")
            .values()
            .cloned()
            .collect()
    }

    /// Adds `instance`, returning the one it replaces.
    pub fn insert(&self, instance: Arc<Instance>) -> Option<Arc<Instance>> {
        self.0
            .write()
            .expect("instances lock")
            .insert(instance.name.clone(), instance)
    }

    /// Removes instance `name`.
    pub fn remove(&self, name: &str) -> Option<Arc<Instance>> {
        self.0.write().expect("instances lock").remove(name)
    }

    /// How many instances there are.
    pub fn len(&self) -> usize {
        self.0.read().expect("instances lock").len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(name: &str) -> Arc<Instance> {
        let metrics = crate::metrics::Metrics::new();
        Arc::new(Instance::new(
            Config::default(),
            Catalog::new(metrics, name),
            None,
            CancellationToken::new(),
        ))
    }

    #[test]
    fn an_unnamed_request_means_the_only_instance_and_is_refused_among_several() {
        let all = Instances::default();
        all.insert(instance("shard-1"));
        assert_eq!(all.resolve("").unwrap().name, "shard-1");
        assert_eq!(all.resolve("shard-1").unwrap().name, "shard-1");
        all.insert(instance("shard-2"));
        let err = all.resolve("").err().unwrap();
        assert_eq!(
            err,
            InstanceError::Unnamed {
                names: vec!["shard-1".into(), "shard-2".into()]
            }
        );
        assert!(err.to_string().contains("shard-1, shard-2"), "{err}");
        let err = all.resolve("shard-3").err().unwrap();
        assert!(
            err.to_string()
                .contains("no instance \"shard-3\"; it serves shard-1, shard-2"),
            "{err}"
        );
        assert_eq!(all.resolve("shard-2").unwrap().name, "shard-2");
    }
}
