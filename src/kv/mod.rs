//! The KV side: everything that talks to the local key-value server.
//!
//! [`handoff`] tells the KV about an installed snapshot's M; [`redis`] holds
//! the Redis/Valkey conversations (the source's backlog pre-flight, the
//! replica's restart handoff); [`seed`] is the `redis-replicate` handoff
//! (the agent as a one-shot master); [`backlog`] is the source's hold on its
//! primary's replication backlog while seedings run; [`health`] keeps the
//! local server's replication health as metrics; [`check`] compares a
//! replica's keys with its primary's.

pub mod backlog;
pub mod check;
pub mod handoff;
pub mod health;
pub mod redis;
pub mod seed;
