//! kvsync — a replication sidecar that moves full KV snapshots between hosts.
//!
//! An agent runs next to every KV server. On a source it watches the snapshot
//! directory and serves verified snapshots; on a replica it pulls one over
//! TCP or RDMA (BLK3), checks every piece, installs it durably and hands its
//! sequence number M to the local KV. docs/ARCHITECTURE.md walks through the
//! flow; its layer table is the map of these modules and says which may use
//! which (`tests/layering.rs` holds the code to it).

pub mod agent;
pub mod blk3;
pub mod cli;
pub mod config;
pub mod control;
pub mod fanout;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod instance;
pub mod kv;
pub mod metrics;
pub mod peer_text;
pub mod rpc;
pub mod snapshot;
pub mod store;
pub mod stream;
pub mod sync;
pub mod sys;
pub mod transport;
