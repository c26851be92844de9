//! The snapshot store: what this agent offers and what it is receiving.
//!
//! Source side: [`watch`] follows `snapshot_dir` and fills the [`catalog`];
//! [`cache`] holds shared, budgeted in-memory images; [`served`] is what a
//! session sends from (an image, or the file through the page cache).
//! Replica side: [`install`] owns the staging file and its durable install;
//! [`journal`] records what a partial staging file holds, for resuming;
//! [`arrivals`] says which pieces of a snapshot being received are verified
//! (what a relay may pass on).

pub mod arrivals;
pub mod cache;
pub mod catalog;
pub mod install;
pub mod journal;
pub mod relay;
pub mod room;
pub mod served;
pub mod watch;
