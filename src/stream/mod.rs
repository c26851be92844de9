//! The replication stream: the incremental half of replication, after a
//! snapshot's M. An agent follows its primary into a checksummed log on
//! disk ([`log`], [`follow`]) and serves that log on.

pub mod follow;
pub mod log;
