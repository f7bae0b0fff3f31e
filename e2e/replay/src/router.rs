//! The replay's router: the EPP's routing state and code, fed in virtual time.
//!
//! It owns what the EPP owns for one pool — the prefix index ([`KvIndex`]), the scheduler
//! ([`Scheduler`]), the in-flight accounting ([`InflightTracker`]) and the engine load samples
//! ([`LoadBook`]) — plus, per engine, the sidecar's event [`Normalizer`]. Requests are keyed
//! with the EPP's key derivation ([`request_block_keys`], vLLM salt style, no salt) and placed
//! with [`Scheduler::route`], the call the EPP's picker makes; nothing here ranks endpoints.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use engine_model::{CacheEvent, EngineStats, Nanos};
use kv_events::key::{SaltStyle, request_block_keys};
use kv_events::{KvEvent, Normalizer, NormalizerConfig};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex};
use scheduler::{
    DEFAULT_DECODE_BLOCKS, Endpoint, EngineLoad, InflightToken, InflightTracker, LoadBook, Millis,
    Role, ScheduleRequest, Scheduler, SchedulerConfig,
};

use crate::peer::{CacheAware, CacheAwareConfig};
use crate::translate::engine_event;

/// Why the router could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The scheduler configuration is invalid.
    #[error("scheduler configuration: {0}")]
    Scheduler(#[from] scheduler::ConfigError),
    /// The index configuration is invalid.
    #[error("index configuration: {0}")]
    Index(#[from] kv_index::ConfigError),
    /// More engines than endpoint ids.
    #[error("{0} engines exceed the endpoint id range")]
    TooManyEngines(usize),
    /// Engines added or removed while the peer routers' model (a fixed pool) places requests.
    #[error("the cache-aware model needs a fixed pool")]
    FixedPool,
}

/// Where one request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The engine's index.
    pub engine: usize,
    /// The in-flight handle to report the first token and the end with.
    pub token: InflightToken,
    /// Prompt blocks the router expected the engine to hold (GPU credit at decision time).
    pub expected_hit_blocks: u32,
    /// The prefill engine of a disaggregated request (the decision's prefill leg): it computes
    /// the prompt and `engine` pulls the KV and decodes.
    pub prefill: Option<usize>,
    /// The prefill leg's in-flight handle, when the router accounts prefill legs
    /// ([`Router::account_prefill_legs`]).
    pub prefill_token: Option<InflightToken>,
}

/// Counters of the router's work.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Decisions made.
    pub decisions: u64,
    /// Decisions per [`scheduler::Reason`] label.
    pub reasons: BTreeMap<&'static str, u64>,
    /// Engine events the normaliser refused (the live sidecar would resynchronise).
    pub normalize_errors: u64,
    /// Engine events delivered to the index.
    pub events_applied: u64,
}

/// The EPP's routing state over `n` engines (endpoint id = engine index).
#[derive(Debug)]
pub struct Router {
    scheduler: Scheduler,
    index: KvIndex,
    inflight: InflightTracker,
    loads: LoadBook,
    endpoints: Vec<Endpoint>,
    normalizers: Vec<Normalizer>,
    model: String,
    block_size: usize,
    scratch: Vec<KvEvent>,
    stats: RouterStats,
    /// When set, requests are placed by the peer routers' cache-aware model instead of the
    /// scheduler (the index is still fed, so the engines' events cost the same).
    peer: Option<CacheAware>,
    loads_scratch: Vec<u64>,
    account_prefill: bool,
}

/// Engine `i`'s endpoint: id `i`, address `10.0.hi.lo:8000`, ready.
fn endpoint(i: usize, role: Role) -> Result<Endpoint, RouterError> {
    let raw = u32::try_from(i).map_err(|_| RouterError::TooManyEngines(i + 1))?;
    let id = EndpointId::new(raw).map_err(|_| RouterError::TooManyEngines(i + 1))?;
    let [_, _, hi, lo] = raw.to_be_bytes();
    let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, hi, lo), 8000));
    let mut e = Endpoint::new(id, addr);
    e.role = role;
    Ok(e)
}

/// Virtual nanoseconds on the EPP's millisecond clock.
pub fn millis(now: Nanos) -> Millis {
    Millis(now / 1_000_000)
}

impl Router {
    /// A router for `engines` engines of `block_size`-token blocks serving `model`.
    pub fn new(
        engines: usize,
        model: &str,
        block_size: u32,
        config: SchedulerConfig,
        seed: u64,
    ) -> Result<Self, RouterError> {
        let endpoints = (0..engines)
            .map(|i| endpoint(i, Role::Both))
            .collect::<Result<Vec<_>, RouterError>>()?;
        let normalizers = (0..engines)
            .map(|_| Normalizer::new(NormalizerConfig::new(model, block_size)))
            .collect();
        Ok(Self {
            scheduler: Scheduler::new(config, seed)?,
            index: KvIndex::new(IndexConfig::default())?,
            inflight: InflightTracker::new(),
            loads: LoadBook::new(),
            endpoints,
            normalizers,
            model: model.to_owned(),
            block_size: block_size as usize,
            scratch: Vec::new(),
            stats: RouterStats::default(),
            peer: None,
            loads_scratch: Vec::new(),
            account_prefill: false,
        })
    }

    /// Places requests with the peer routers' cache-aware policy ([`CacheAware`]) instead of
    /// the EPP's scheduler.
    #[must_use]
    pub fn with_cache_aware(mut self, config: CacheAwareConfig) -> Self {
        self.peer = Some(CacheAware::new(self.endpoints.len(), config));
        self
    }

    /// Keys `prompt` and places it, as the EPP does for a request naming the pool's model.
    pub fn route(
        &mut self,
        prompt: &[u32],
        now: Nanos,
    ) -> Result<Placement, scheduler::ScheduleError> {
        let keys = request_block_keys(
            &self.model,
            None,
            SaltStyle::VllmExtraKey,
            prompt,
            self.block_size,
        );
        let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        if let Some(placement) = self.route_cache_aware(&keys, prompt_tokens) {
            return Ok(placement);
        }
        let req = ScheduleRequest {
            keys: &keys,
            prompt_tokens,
            prompt_blocks: None,
            model: &self.model,
            subset: None,
            now: millis(now),
            timed: false,
        };
        let routed = self.scheduler.route(
            &req,
            &self.endpoints,
            &self.index,
            &self.inflight,
            &self.loads,
        )?;
        self.stats.decisions += 1;
        *self
            .stats
            .reasons
            .entry(routed.decision.reason.as_str())
            .or_default() += 1;
        let engine = routed.decision.primary.endpoint.get() as usize;
        let blocks = routed.decision.prompt_blocks;
        let prefill_token = match (self.account_prefill, routed.decision.prefill) {
            (true, Some(p)) => Some(self.inflight.on_routed(p.endpoint, blocks, blocks, 0)),
            _ => None,
        };
        Ok(Placement {
            engine,
            token: routed.token,
            expected_hit_blocks: routed
                .decision
                .prompt_blocks
                .saturating_sub(routed.decision.uncached_blocks),
            prefill: routed.decision.prefill.map(|p| p.endpoint.get() as usize),
            prefill_token,
        })
    }

    /// Places a request with the cache-aware model; `None` when the model is off.
    fn route_cache_aware(
        &mut self,
        keys: &[kv_events::key::BlockKey],
        prompt_tokens: u32,
    ) -> Option<Placement> {
        let peer = self.peer.as_mut()?;
        self.loads_scratch.clear();
        self.loads_scratch.extend(
            self.endpoints
                .iter()
                .map(|e| self.inflight.load(e.id).requests),
        );
        let pick = peer.pick(keys, prompt_tokens, &self.loads_scratch);
        let endpoint = self.endpoints.get(pick.worker)?.id;
        self.stats.decisions += 1;
        *self.stats.reasons.entry(pick.branch.as_str()).or_default() += 1;
        let blocks = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        let token = self.inflight.on_routed(
            endpoint,
            blocks,
            blocks.saturating_sub(pick.matched_blocks),
            DEFAULT_DECODE_BLOCKS,
        );
        Some(Placement {
            engine: pick.worker,
            token,
            expected_hit_blocks: pick.matched_blocks,
            prefill: None,
            prefill_token: None,
        })
    }

    /// The request produced its first token (its first response byte reached the gateway).
    pub fn first_token(&self, token: InflightToken) {
        self.inflight.on_first_token(token);
    }

    /// The request's stream ended.
    pub fn finished(&self, token: InflightToken) {
        if self.inflight.on_finished(token) {
            self.loads.note_finished(token.endpoint());
        }
    }

    /// Delivers one engine step's cache events to the index through the engine's normaliser,
    /// as the sidecar and the EPP's ingestion do.
    pub fn deliver(&mut self, engine: usize, events: Vec<CacheEvent>) {
        let (Some(norm), Some(endpoint)) =
            (self.normalizers.get_mut(engine), self.endpoints.get(engine))
        else {
            return;
        };
        self.scratch.clear();
        let block_size = u32::try_from(self.block_size).unwrap_or(u32::MAX);
        for event in events {
            if norm
                .apply(&engine_event(&event, block_size, None), &mut self.scratch)
                .is_err()
            {
                self.stats.normalize_errors += 1;
            }
        }
        self.stats.events_applied += self.scratch.len() as u64;
        self.index
            .apply(Holder::Endpoint(endpoint.id), &self.scratch);
    }

    /// Puts engine `engine` on node `node`: the node's tiers are credited to it.
    pub fn set_node(&mut self, engine: usize, node: kv_index::NodeId) {
        if let Some(e) = self.endpoints.get_mut(engine) {
            e.node = Some(node);
        }
    }

    /// Delivers a node's KV block manager events to the index, as the EPP's node subscription
    /// does.
    pub fn deliver_node(&mut self, node: kv_index::NodeId, events: &[KvEvent]) {
        self.stats.events_applied += events.len() as u64;
        self.index.apply(Holder::Node(node), events);
    }

    /// Records an engine's load sample, as the EPP's scraper (or the sidecar's relay) does.
    pub fn sample_load(&self, engine: usize, stats: &EngineStats, now: Nanos) {
        if let Some(e) = self.endpoints.get(engine) {
            self.loads.record(
                e.id,
                EngineLoad {
                    waiting: stats.waiting,
                    running: stats.running,
                    kv_usage: stats.kv_usage,
                    at: millis(now),
                },
            );
        }
    }

    /// The EPP's periodic upkeep: expire speculative entries.
    pub fn expire(&self, now: Nanos) {
        self.scheduler.expire(&self.index, millis(now));
    }

    /// Also accounts each prefill leg in flight on its prefill endpoint (its prompt blocks as
    /// prefill work, until the leg finishes), as the EPP does until the decode engine's first
    /// byte; off, the prefill pick balances on engine samples of queued requests alone
    /// (`docs/autoscaling.md` measures what that does).
    pub fn account_prefill_legs(&mut self, on: bool) {
        self.account_prefill = on;
    }

    /// Sets engine `engine`'s role in a disaggregated pool.
    pub fn set_role(&mut self, engine: usize, role: Role) {
        if let Some(e) = self.endpoints.get_mut(engine) {
            e.role = role;
        }
    }

    /// Adds an engine (not ready: discovery lists a pod before it is ready) with its sidecar's
    /// normaliser; returns its index.
    pub fn add_endpoint(&mut self, role: Role) -> Result<usize, RouterError> {
        if self.peer.is_some() {
            return Err(RouterError::FixedPool);
        }
        let i = self.endpoints.len();
        let mut e = endpoint(i, role)?;
        e.ready = false;
        self.endpoints.push(e);
        self.normalizers.push(Normalizer::new(NormalizerConfig::new(
            &self.model,
            u32::try_from(self.block_size).unwrap_or(u32::MAX),
        )));
        Ok(i)
    }

    /// Marks an engine ready (routable) or not (starting, draining), as discovery does with
    /// pod readiness.
    pub fn set_ready(&mut self, engine: usize, ready: bool) {
        if let Some(e) = self.endpoints.get_mut(engine) {
            e.ready = ready;
        }
    }

    /// Forgets an engine that left the pool, as the EPP's discovery does for a deleted pod:
    /// its index entries, load samples and in-flight accounting. It is never routed to again.
    pub fn remove_endpoint(&mut self, engine: usize) {
        let Some(e) = self.endpoints.get_mut(engine) else {
            return;
        };
        e.ready = false;
        let id = e.id;
        self.index.remove_source(Holder::Endpoint(id));
        self.scheduler.remove_endpoint(id);
        self.inflight.remove_endpoint(id);
        self.loads.remove(id);
    }

    /// Requests in flight in the EPP's accounting.
    pub fn inflight_len(&self) -> usize {
        self.inflight.len()
    }

    /// The counters.
    pub fn stats(&self) -> &RouterStats {
        &self.stats
    }
}
