//! The KV side: everything that talks to the local key-value server.
//!
//! [`redis`] is the Redis/Valkey client the rest talk through; [`resp`]
//! the bits of RESP spoken on raw replication connections.
//! Replica side: [`handoff`] tells the KV about an installed snapshot's M,
//! by [`restart`] (place the RDB, restart the server; into a cluster node
//! with [`cluster`]'s `nodes.conf` and `CLUSTER MEET`) or [`seed`] (the
//! agent as a one-shot master of a running server, sending the RDB as a
//! [`payload`], from the installed file or as its pieces arrive). Source side:
//! [`preflight`] checks the primary's backlog still holds M+1 and sizes
//! what a seeding needs; [`backlog`] holds it there while seedings run.
//! Either side: [`health`] keeps the local server's replication health as
//! metrics; [`check`] compares a replica's keys with its primary's;
//! [`rights`] tells whether kvsync's logins hold the rights their roles
//! need.

pub mod backlog;
pub mod check;
pub mod cluster;
pub mod handoff;
pub mod health;
pub mod payload;
pub mod preflight;
pub mod redis;
pub mod resp;
pub mod restart;
pub mod rights;
pub mod seed;
