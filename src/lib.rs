//! kvsync — a replication sidecar that moves full KV snapshots between hosts.
//!
//! An agent runs next to every KV server. On a source it watches the snapshot
//! directory and serves snapshots from the page cache (TCP) or a shared
//! in-memory image (RDMA, relays still receiving); on a replica
//! it pulls a snapshot, verifies its checksum, installs it durably and hands
//! its sequence number M to the local KV. `docs/ARCHITECTURE.md`
//! walks through the whole flow.
//!
//! The modules follow that flow:
//! - [`config`] — the TOML configuration and its validation.
//! - [`snapshot`] — snapshot formats and their streaming verifiers.
//! - [`manifest`] — a snapshot's identity and per-piece checksums.
//! - [`catalog`] / [`watch`] — which snapshots this agent offers, and the
//!   directory watcher that fills the catalog.
//! - [`buf`] — page-aligned buffers for the data path.
//! - [`cache`] — the shared, budgeted snapshot buffers on the source.
//! - [`served`] — what a source session sends from: a cache image, or the
//!   snapshot file itself through the kernel's page cache (TCP).
//! - [`arrivals`] — which pieces of a snapshot being received are verified
//!   (what a relay may pass on).
//! - [`peer_text`] — which strings from peers are acceptable, and escaping.
//! - [`pem`] — reading and checking PEM files.
//! - [`conn_limit`] — connections counted in total and per address.
//! - [`rpc`] — gRPC plumbing shared by both ends: generated types, bearer
//!   tokens, TLS settings, dialing an agent.
//! - [`control`] — the gRPC services (orchestrator and peer).
//! - [`blk3`] — the BLK3 data-plane protocol as sans-IO state machines.
//! - [`transport`] — drivers that run BLK3 over TCP and RDMA (verbs, or the
//!   emulated fabric), the RDMA probe and transport selection.
//! - [`sync`] — replica sync jobs and the source role's sessions.
//! - [`fanout`] — seeding many replicas through a tree of relays.
//! - [`install`] — staging and durably installing received snapshots.
//! - [`journal`] — what a partly received snapshot holds, for resuming.
//! - [`handoff`] — handing the snapshot's sequence number to the local KV.
//! - [`redis`] — Redis/Valkey: the source's backlog pre-flight and the
//!   replica's seeding handoff.
//! - [`redis_seed`] — the `redis-replicate` handoff: the agent as a one-shot
//!   master that streams the RDB to the running replica server.
//! - [`backlog`] — the source's hold on its primary's replication backlog
//!   while seedings run (refuse, or grow and restore; watch).
//! - [`kv_health`] — the local KV server's replication health as metrics.
//! - [`kv_check`] — comparing a replica's keys with its primary's.
//! - [`metrics`] — every Prometheus handle and the `/metrics` endpoint.
//! - [`agent`] — wires the parts into a running agent.
//! - [`cli`] — the `kvsync` command line.

pub mod agent;
pub mod arrivals;
pub mod backlog;
pub mod blk3;
pub mod buf;
pub mod cache;
pub mod catalog;
pub mod cli;
pub mod config;
pub mod conn_limit;
pub mod control;
pub mod fanout;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod handoff;
pub mod install;
pub mod journal;
pub mod kv_check;
pub mod kv_health;
pub mod manifest;
pub mod metrics;
pub mod peer_text;
pub mod pem;
pub mod redis;
pub mod redis_seed;
pub mod rpc;
pub mod served;
pub mod snapshot;
pub mod sync;
pub mod transport;
pub mod watch;
