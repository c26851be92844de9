//! kvsync — a replication sidecar that moves full KV snapshots between hosts.
//!
//! An agent runs next to every KV server. On a source it watches the snapshot
//! directory and serves snapshots from the page cache (TCP) or a shared
//! in-memory image (RDMA, relays still receiving); on a replica
//! it pulls a snapshot, verifies its checksum, installs it durably and hands
//! its sequence number M to the local KV. `docs/ARCHITECTURE.md`
//! walks through the whole flow.
//!
//! The modules follow that flow (docs/ARCHITECTURE.md's layer table says
//! which may use which; `tests/layering.rs` holds the code to it):
//! - [`config`] — the TOML configuration and its validation.
//! - [`snapshot`] — snapshot formats, their streaming verifiers and the
//!   piece manifest.
//! - [`store`] — the snapshot store: the watcher and catalog of what this
//!   agent offers, the shared cache, what a session sends from, and the
//!   replica's staging, journal and verified-piece tracking.
//! - [`kv`] — the local KV server: handoff, Redis/Valkey, the backlog
//!   guard, seeding, health and the replica check.
//! - [`sys`] — OS helpers: aligned buffers, PEM, splice, zero-copy, fs.
//! - [`peer_text`] — which strings from peers are acceptable, and escaping.
//! - [`rpc`] — gRPC plumbing shared by both ends: generated types, bearer
//!   tokens, TLS settings, dialing an agent, connection counting.
//! - [`control`] — the gRPC services (orchestrator and peer).
//! - [`blk3`] — the BLK3 data-plane protocol as sans-IO state machines.
//! - [`transport`] — drivers that run BLK3 over TCP and RDMA (verbs, or the
//!   emulated fabric), the RDMA probe and transport selection.
//! - [`sync`] — replica sync jobs and the source role's sessions.
//! - [`fanout`] — seeding many replicas through a tree of relays.
//! - [`metrics`] — every Prometheus handle and the `/metrics` endpoint.
//! - [`agent`] — wires the parts into a running agent.
//! - [`cli`] — the `kvsync` command line.

pub mod agent;
pub mod blk3;
pub mod cli;
pub mod config;
pub mod control;
pub mod fanout;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod kv;
pub mod metrics;
pub mod peer_text;
pub mod rpc;
pub mod snapshot;
pub mod store;
pub mod sync;
pub mod sys;
pub mod transport;
