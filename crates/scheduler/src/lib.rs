//! kvgate's endpoint scheduler: given a request's block keys and the pool's endpoints, choose
//! where it goes: a primary, ordered fallbacks and, for long uncached prompts in a P/D pool, a
//! prefill endpoint.
//!
//! Pure and synchronous: no async runtime, no I/O, no clock (time is passed in as
//! [`Millis`]). The EPP owns the shared state ([`KvIndex`](kv_index::KvIndex),
//! [`InflightTracker`], [`LoadBook`]) and calls [`Scheduler::schedule`] from any number of
//! threads.
//!
//! - [`filter`]: ready, decode role, model/LoRA, the data plane's subset hint.
//! - [`Policy`]: `kv` (the tier-credited cost with bounded load and temperature; the default),
//!   `prefix-only`, `least-load`, `round-robin`, `random`.
//! - Every decision speculates its blocks on the chosen endpoint(s) (or, in approximate mode,
//!   feeds [`ApproxTracker`](kv_index::ApproxTracker)) so the next request with the same prefix
//!   follows before the engine's event arrives.
//! - [`InflightTracker`]: the EPP's own per-endpoint accounting (routed → first token →
//!   finished); [`LoadBook`]: engine-reported samples with staleness.
//! - [`SchedulerConfig`]: the typed YAML configuration with validated defaults.
//! - [`Scheduler::route`]: schedule + in-flight accounting, the step the EPP's picker and the
//!   discrete-event replay share.
//!
//! Not here: parsing requests, tokenization, discovery, event ingestion, metrics export. The
//! crate README documents the cost, the bounded-load rule and every configuration field.
//!
//! ```
//! use kv_index::{EndpointId, IndexConfig, KvIndex};
//! use scheduler::{
//!     Endpoint, InflightTracker, LoadBook, Millis, ScheduleRequest, Scheduler, SchedulerConfig,
//! };
//!
//! let config = SchedulerConfig::from_yaml("policy: kv\nfallbacks: 2\n")?;
//! let scheduler = Scheduler::new(config, 7)?;
//! let index = KvIndex::new(IndexConfig::default())?;
//! let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
//! let endpoints: Vec<Endpoint> = (0..4u32)
//!     .map(|i| Endpoint::new(EndpointId::new(i).unwrap(), format!("10.0.0.{i}:8000").parse().unwrap()))
//!     .collect();
//! let keys = [kv_events::BlockKey(1), kv_events::BlockKey(2)];
//! let request = ScheduleRequest {
//!     keys: &keys,
//!     prompt_tokens: 40,
//!     prompt_blocks: None,
//!     model: "llama",
//!     subset: None,
//!     now: Millis(0),
//!     timed: false,
//! };
//! let decision = scheduler.schedule(&request, &endpoints, &index, &inflight, &loads)?;
//! assert_eq!(decision.fallbacks.len(), 2);
//! // The EPP accounts the request, then reports its first token and its end.
//! let token = inflight.on_routed(
//!     decision.primary.endpoint,
//!     decision.prompt_blocks,
//!     decision.uncached_blocks,
//!     8,
//! );
//! inflight.on_first_token(token);
//! inflight.on_finished(token);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod config;
mod cost;
mod decision;
mod endpoint;
pub mod filter;
mod inflight;
mod load;
mod policy;
mod rng;
mod route;
mod scheduler;

pub use config::{
    Admission, Approximate, BoundedLoad, ConfigError, Disaggregation, EngineLoadConfig,
    MAX_FALLBACKS, Policy, SchedulerConfig, Speculation, TierCredit, UnknownPolicy, Weights,
};
pub use cost::{EffectiveLoad, credit, kv_cost, prefill_cost, uncached_blocks};
pub use decision::{CandidateScore, Decision, Phases, Reason, ScheduleError};
pub use endpoint::{Endpoint, Pick, Role};
pub use filter::NoCandidateReason;
pub use inflight::{
    ChangeKind, InflightChange, InflightLoad, InflightToken, InflightTracker, JournalDrain,
};
pub use kv_index::Millis;
pub use load::{EngineLoad, LoadBook};
pub use route::{DEFAULT_DECODE_BLOCKS, Routed};
pub use scheduler::{ScheduleRequest, Scheduler};
