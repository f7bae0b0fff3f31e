//! kvgate's global prefix index: which endpoints (and nodes) hold which KV blocks, per tier,
//! and how long a prefix of a prompt's block-key chain each candidate endpoint can serve.
//!
//! Pure and synchronous: no async runtime, no I/O, no clock (time is passed in as
//! [`Millis`]). The EPP feeds it the [`kv_events::KvEvent`]s of every source (an endpoint's
//! sidecar or a node's KV block manager) and asks [`KvIndex::find_matches`] on each request.
//!
//! - [`KvIndex`]: the sharded, lock-protected index (one writer per source, many readers).
//! - Speculation ([`KvIndex::speculate`]/[`KvIndex::expire`]): blocks a routed request will
//!   create, visible until confirmed by the endpoint's events or expired.
//! - [`ApproxTracker`]: approximate mode for engines that publish no events; it models each
//!   endpoint's cache from routing decisions (TTL + capacity) and emits the events the engine
//!   would have sent.
//!
//! Not here: scoring, load accounting, transport (NATS), snapshots' wire format. See the
//! crate's README for the design, complexity and measured figures.

mod approx;
mod config;
mod id;
mod index;
mod matcher;
mod overlap;
mod runs;
mod shard;
mod table;
mod time;

pub use approx::ApproxTracker;
pub use config::{ConfigError, IndexConfig};
pub use id::{EndpointId, Holder, IdOutOfRange, MAX_ID, NodeId};
pub use index::{IndexStats, KvIndex};
pub use overlap::Overlap;
pub use time::Millis;
