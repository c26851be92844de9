//! `kvsync fanout --cluster`: which replica agents each shard's source
//! seeds. Every agent is asked which primary its instance is about: a
//! source the primary beside it (`[redis] primary_addr`), a replica the
//! primary its server is to replicate (`[redis] primary`). [`pair`] (plain
//! code) gives each replica to the source of its primary, and refuses the
//! whole set before anything starts when one cannot be placed.

use std::collections::BTreeMap;
use std::net::SocketAddr;

/// An agent and the primary its instance names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub agent: String,
    pub primary: String,
}

/// Why a cluster fan-out was not started; nothing was.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PairError {
    #[error("the sources {0} and {1} sit beside the same primary {2}: give one per shard")]
    TwoSources(String, String, String),
    #[error("the replica agent {replica} is to replicate {primary}, which no --source sits beside (the sources sit beside: {known})")]
    NoSource {
        replica: String,
        primary: String,
        known: String,
    },
}

/// Each source with the replicas whose primary is the one it sits beside,
/// in the order the sources were given (one without replicas is left out).
/// Two addresses name one primary when their text is the same or they
/// resolve (`resolved`) to a common socket address.
pub fn pair(
    sources: &[Named],
    replicas: &[Named],
    resolved: &BTreeMap<String, Vec<SocketAddr>>,
) -> Result<Vec<(String, Vec<String>)>, PairError> {
    let same = |a: &str, b: &str| {
        a == b
            || match (resolved.get(a), resolved.get(b)) {
                (Some(x), Some(y)) => x.iter().any(|s| y.contains(s)),
                _ => false,
            }
    };
    for (i, a) in sources.iter().enumerate() {
        if let Some(b) = sources[i + 1..]
            .iter()
            .find(|b| same(&a.primary, &b.primary))
        {
            return Err(PairError::TwoSources(
                a.agent.clone(),
                b.agent.clone(),
                a.primary.clone(),
            ));
        }
    }
    let mut shards: Vec<(String, Vec<String>)> = sources
        .iter()
        .map(|s| (s.agent.clone(), Vec::new()))
        .collect();
    for r in replicas {
        let Some(at) = sources.iter().position(|s| same(&s.primary, &r.primary)) else {
            let known = sources
                .iter()
                .map(|s| format!("{} beside {}", s.agent, s.primary))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(PairError::NoSource {
                replica: r.agent.clone(),
                primary: r.primary.clone(),
                known,
            });
        };
        shards[at].1.push(r.agent.clone());
    }
    shards.retain(|(_, replicas)| !replicas.is_empty());
    Ok(shards)
}

/// The socket addresses each of `addrs` resolves to (none for one that
/// does not resolve: it then matches only by its text).
pub async fn resolve(addrs: impl Iterator<Item = &str>) -> BTreeMap<String, Vec<SocketAddr>> {
    let mut resolved = BTreeMap::new();
    for a in addrs {
        let found = match tokio::net::lookup_host(a).await {
            Ok(found) => found.collect(),
            Err(_) => Vec::new(),
        };
        resolved.insert(a.to_string(), found);
    }
    resolved
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(agent: &str, primary: &str) -> Named {
        Named {
            agent: agent.into(),
            primary: primary.into(),
        }
    }

    #[test]
    fn each_replica_goes_to_the_source_of_its_primary() {
        let sources = [
            n("s1", "10.0.0.1:6379"),
            n("s2", "p2:6379"),
            n("s3", "10.0.0.3:6379"),
        ];
        let replicas = [
            n("r1", "10.0.0.1:6379"),
            n("r2", "10.0.0.2:6379"),
            n("r1b", "10.0.0.1:6379"),
        ];
        let mut resolved = BTreeMap::new();
        resolved.insert("p2:6379".into(), vec!["10.0.0.2:6379".parse().unwrap()]);
        resolved.insert(
            "10.0.0.2:6379".into(),
            vec!["10.0.0.2:6379".parse().unwrap()],
        );
        let shards = pair(&sources, &replicas, &resolved).unwrap();
        assert_eq!(
            shards,
            vec![
                ("s1".to_string(), vec!["r1".to_string(), "r1b".to_string()]),
                ("s2".to_string(), vec!["r2".to_string()]),
            ],
            "by text or by a common address; s3 has no replica"
        );
    }

    #[test]
    fn a_replica_without_a_source_or_two_sources_of_one_primary_refuse_the_whole_set() {
        let none = BTreeMap::new();
        let err = pair(&[n("s1", "a:1")], &[n("r1", "a:1"), n("r2", "b:1")], &none).unwrap_err();
        assert!(matches!(&err, PairError::NoSource { replica, .. } if replica == "r2"));
        assert!(err.to_string().contains("s1 beside a:1"), "{err}");
        let err = pair(&[n("s1", "a:1"), n("s2", "a:1")], &[n("r1", "a:1")], &none).unwrap_err();
        assert_eq!(
            err,
            PairError::TwoSources("s1".into(), "s2".into(), "a:1".into())
        );
    }
}
