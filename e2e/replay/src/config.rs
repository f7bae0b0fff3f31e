//! What a replay runs on: the engines, the router's configuration, and the delays between them.

use engine_model::{EngineConfig, Nanos};
use scheduler::SchedulerConfig;

use crate::peer::CacheAwareConfig;

/// Nanoseconds in a millisecond.
pub const MS: Nanos = 1_000_000;

/// A replay's setup. Every delay is virtual time.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Label written into every record's `run` (the policy or variant under test).
    pub run: String,
    /// Label written into every record's `load` (the concurrency or speed-up of this run).
    pub load: Option<f64>,
    /// Number of engines, at least one.
    pub engines: usize,
    /// The first this many engines are prefill-only and the rest decode (a disaggregated pool,
    /// which needs `scheduler.disaggregation.enabled`); 0: every engine does both.
    pub prefill_engines: usize,
    /// Account prefill legs in flight on their prefill engines, as the EPP does (default;
    /// [`Router::account_prefill_legs`](crate::Router::account_prefill_legs)).
    pub account_prefill_legs: bool,
    /// Every engine's configuration (a preset's, usually).
    pub engine: EngineConfig,
    /// The router's scheduler configuration (the EPP's YAML).
    pub scheduler: SchedulerConfig,
    /// Place requests with the peer routers' cache-aware model instead of `scheduler`.
    pub cache_aware: Option<CacheAwareConfig>,
    /// The served model name: the key seed of the router and the normalisers.
    pub model: String,
    /// Seeds the scheduler's random choices (ties, `random`, temperature).
    pub seed: u64,
    /// The engines' block-hash seed (vLLM's `PYTHONHASHSEED`-like constant; one for all).
    pub engine_hash_seed: u64,
    /// From the client's send to the request reaching its engine: the gateway path (Envoy,
    /// the EPP, the network) and whatever the serving frontend does first (chat template,
    /// tokenization). It adds to TTFT and end-to-end latency, not to engine work.
    pub request_latency: Nanos,
    /// From the end of an engine step to its KV events reaching the index (sidecar + NATS).
    pub event_delay: Nanos,
    /// How often engine load samples reach the router; zero sends none (EPP accounting only).
    pub load_interval: Nanos,
    /// How often the EPP's upkeep expires speculative entries (its 500 ms tick).
    pub expire_interval: Nanos,
    /// No request is sent at or after this time; sessions still running are abandoned at
    /// their next turn, in-flight requests finish.
    pub stop_at: Option<Nanos>,
    /// The node's KV block manager (`kvgate-kvbm`, one node for every engine): every engine
    /// offloads to it and onboards from it, and its tiers are credited to every engine, as
    /// `kvgate-bench up --kvbm` runs it live. `None`: no block manager.
    pub node_tier: Option<crate::NodeTierConfig>,
}

impl ReplayConfig {
    /// Defaults for `engines` engines of `engine`: the EPP's default scheduler (`kv`), 5 ms
    /// event delay, 200 ms load samples (the EPP scraper's interval), 500 ms expiry tick.
    pub fn new(engines: usize, engine: EngineConfig) -> Self {
        Self {
            run: "kv".into(),
            load: None,
            engines,
            prefill_engines: 0,
            account_prefill_legs: true,
            engine,
            scheduler: SchedulerConfig::default(),
            cache_aware: None,
            model: "model".into(),
            seed: 0,
            engine_hash_seed: 0x6b76_6761_7465,
            request_latency: 0,
            event_delay: 5 * MS,
            load_interval: 200 * MS,
            expire_interval: 500 * MS,
            stop_at: None,
            node_tier: None,
        }
    }
}
