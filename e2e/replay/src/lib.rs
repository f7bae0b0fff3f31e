//! kvgate's discrete-event replay: a [`Workload`](workload::Workload) against N
//! [`engine_model::Engine`]s in virtual time, routed with the EPP's own code.
//!
//! The router ([`Router`]) holds what the EPP holds for a pool — the prefix index, the
//! scheduler, the in-flight accounting, the engine load samples — and each engine's event
//! normaliser as its sidecar would. Requests are keyed with the EPP's key derivation and placed
//! with [`scheduler::Scheduler::route`], the call the EPP's picker makes; the engines' KV events
//! reach the index through the sidecar's normaliser after a configurable delay. So a policy or a
//! weight that wins here wins because of the code that runs in production, not a model of it.
//!
//! Pure and single-threaded: no async runtime, no I/O, no clock. The same workload, config and
//! seed give the same records. A one-hour trace on dozens of engines replays in seconds; the
//! crate README gives the design, what is modelled and what is not.
//!
//! ```
//! use std::time::Duration;
//! use engine_model::Preset;
//! use replay::{ReplayConfig, replay};
//! use workload::{Pacing, Session, Span, Turn, Vocab, Workload};
//!
//! let turn = |seed| Turn { user: vec![Span { seed, len: 64 }], max_tokens: 8, think: Duration::ZERO };
//! let workload = Workload {
//!     name: "tiny".into(),
//!     pacing: Pacing::Closed { concurrency: 2 },
//!     vocab: Vocab::default(),
//!     sessions: (0..4).map(|i| Session { id: i, start: Duration::ZERO, group: 0,
//!                                          turns: vec![turn(i), turn(100 + i)] }).collect(),
//! };
//! let out = replay(&workload, ReplayConfig::new(2, Preset::Small.config()))?;
//! assert_eq!(out.records.len(), 8);
//! assert!(out.max_sessions_in_flight <= 2);
//! # Ok::<(), replay::ReplayError>(())
//! ```

pub mod autoscale;
mod config;
mod node_tier;
mod peer;
pub mod profiler;
mod queue;
mod replay;
mod router;
mod translate;

pub use config::{MS, ReplayConfig};
pub use node_tier::{NodeStats, NodeStore, NodeTier, NodeTierConfig};
pub use peer::{CacheAware, CacheAwareBranch, CacheAwareConfig, CacheAwarePick, ReplayPolicy};
pub use queue::EventQueue;
pub use replay::{
    EngineLife, EngineView, IntervalStats, Life, Replay, ReplayError, ReplayOutput, replay,
};
pub use router::{Placement, Router, RouterError, RouterStats, millis};
pub use translate::engine_event;
