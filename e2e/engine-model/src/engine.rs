//! The engine: requests in, steps out, in virtual time.

use std::collections::{HashMap, VecDeque};

use crate::block_pool::BlockPool;
use crate::config::{ConfigError, EngineConfig};
use crate::cost::BatchShape;
use crate::output::{EngineStats, FinishReason, RequestOutput, StepOutput, TransferParams};
use crate::request::{AdmitError, NewRequest, Phase, Request};
use crate::{BlockId, CacheEvent, Nanos, RequestId};

/// A model of one vLLM engine: scheduler, paged KV cache with prefix caching, KV events and
/// step timing. Single-threaded and pure: the caller owns the clock.
#[derive(Debug)]
pub struct Engine {
    pub(crate) config: EngineConfig,
    pub(crate) requests: HashMap<RequestId, Request>,
    /// Running requests, in scheduling order.
    pub(crate) running: Vec<RequestId>,
    /// Waiting requests (new, preempted, or waiting for remote KV), front first.
    pub(crate) waiting: VecDeque<RequestId>,
    pub(crate) pool: BlockPool,
    pub(crate) counters: Counters,
    /// The latest `now` passed to [`Engine::step`].
    clock: Nanos,
}

/// Monotonic counters behind [`EngineStats`].
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counters {
    pub(crate) queries: u64,
    pub(crate) hits: u64,
    pub(crate) preempted_queries: u64,
    pub(crate) preempted_hits: u64,
    pub(crate) num_preemptions: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) generation_tokens: u64,
    /// Tokens loaded from the host tier instead of computed.
    pub(crate) host_hits: u64,
}

impl Counters {
    /// Records one prefix-cache lookup the way vLLM's `PrefixCacheStats.record` does:
    /// lookups of previously preempted requests are kept apart.
    pub(crate) fn record_lookup(&mut self, queried: u64, hit: u64, preempted: bool) {
        if preempted {
            self.preempted_queries += queried;
            self.preempted_hits += hit;
        } else {
            self.queries += queried;
            self.hits += hit;
        }
    }
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(config: EngineConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            pool: BlockPool::new(
                config.num_gpu_blocks,
                config.enable_prefix_caching,
                config.num_host_blocks,
            ),
            config,
            requests: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            counters: Counters::default(),
            clock: 0,
        })
    }

    /// An idle engine whose offloading connector keeps its blocks in `tier` (instead of the
    /// host memory `num_host_blocks` sizes). Without prefix caching nothing is offloaded and
    /// `tier` is dropped.
    pub fn with_offload(
        config: EngineConfig,
        tier: Box<dyn crate::OffloadTier>,
    ) -> Result<Self, ConfigError> {
        let mut engine = Self::new(config)?;
        engine.pool.set_offload(tier);
        Ok(engine)
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request. Rejects, changing nothing, a request with an empty prompt or output,
    /// one whose prompt + output exceed `max_model_len`, or one whose id is taken.
    pub fn add_request(&mut self, req: NewRequest) -> Result<(), AdmitError> {
        if self.requests.contains_key(&req.id) {
            return Err(AdmitError::Duplicate(req.id));
        }
        let req = Request::admit(req, &self.config)?;
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
        Ok(())
    }

    /// Drops a request wherever it is (waiting, running, transferring) and frees its blocks;
    /// full, hashed blocks stay cached. Returns whether it existed.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.release(id)
    }

    /// Runs one step at virtual time `now`: schedules a batch, prices it with the cost model
    /// and returns what it produced, delivered at `now + duration`. `None` when nothing can
    /// run now (idle, waiting on KV transfers or future arrivals: see
    /// [`next_wakeup`](Self::next_wakeup)).
    pub fn step(&mut self, now: Nanos) -> Option<StepOutput> {
        self.clock = self.clock.max(now);
        let schedule = self.schedule(now);
        let mut outputs: Vec<RequestOutput> = schedule
            .preempted
            .iter()
            .map(|&id| RequestOutput::preempted(id))
            .collect();
        let mut shape = BatchShape::default();
        let mut finished = Vec::new();
        for &(id, num_new) in &schedule.batch {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            let before = req.num_computed;
            req.num_computed += num_new;
            let first_scheduled = *req.first_scheduled.get_or_insert(now);
            let completes = req.num_computed >= req.num_tokens();
            let decode = completes && num_new == 1 && req.num_generated() > 0;
            if decode || !self.config.free_prefill {
                shape.add_seq(before as u64, num_new as u64, decode, completes);
            } else {
                shape.add_seq(0, 0, false, completes);
            }
            if !completes {
                continue;
            }
            let Some(token) = req.append_next_token() else {
                continue;
            };
            let first = req.num_generated() == 1;
            self.counters.generation_tokens += 1;
            if first {
                self.counters.prompt_tokens += req.prompt_len as u64;
            }
            let done = req.is_done();
            let kv_transfer_params = (done && req.prefill_only)
                .then(|| transfer_params(req, self.config.block_size as usize));
            outputs.push(RequestOutput {
                id,
                new_tokens: vec![token],
                num_cached_tokens: if first {
                    Some(req.num_cached_tokens.unwrap_or(0))
                } else {
                    None
                },
                finished: done.then_some(FinishReason::Length),
                kv_transfer_params,
                preempted: false,
                queue_time: first.then(|| first_scheduled.saturating_sub(req.arrival)),
            });
            if done {
                finished.push(id);
            }
        }
        for id in finished {
            self.release(id);
        }
        if schedule.batch.is_empty() && outputs.is_empty() {
            return None;
        }
        Some(StepOutput {
            duration: self
                .config
                .cost
                .duration(&shape, self.config.kv_bytes_per_token)
                .saturating_add(schedule.load),
            outputs,
            events: self.pool.take_events(),
            shape,
        })
    }

    /// The earliest virtual time, after the latest `step`, at which something waiting becomes
    /// schedulable without any step running: a KV transfer completing or a request arriving.
    pub fn next_wakeup(&self) -> Option<Nanos> {
        self.waiting
            .iter()
            .filter_map(|id| self.requests.get(id))
            .map(|r| match r.phase {
                Phase::Transferring { ready_at, .. } => ready_at,
                _ => r.arrival,
            })
            .filter(|&t| t > self.clock)
            .min()
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// vLLM `/reset_prefix_cache`: only when no block is in use (returns `false` otherwise);
    /// on success drops every cached hash and queues a [`CacheEvent::Cleared`] for
    /// [`take_events`](Self::take_events).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    /// Cache events produced outside a returned step (a reset, or a KV transfer that completed
    /// in a step that ran no batch), in order. Call it before the next `step` to keep the
    /// overall order; events left here are otherwise returned by the next step.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.pool.take_events()
    }

    /// Requests waiting to be scheduled (the admission check's one figure, cheaper than
    /// [`Engine::stats`]).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Current gauges and counters.
    pub fn stats(&self) -> EngineStats {
        let to_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let total = self.pool.usable();
        let used = self.pool.num_used();
        let transferring = self
            .requests
            .values()
            .filter(|r| matches!(r.phase, Phase::Transferring { .. }))
            .count();
        EngineStats {
            running: to_u32(self.running.len()),
            waiting: to_u32(self.waiting.len()),
            transferring: to_u32(transferring),
            kv_usage: if total == 0 {
                0.0
            } else {
                used as f64 / total as f64
            },
            prefix_cache_queries: self.counters.queries,
            prefix_cache_hits: self.counters.hits,
            preempted_prefix_cache_queries: self.counters.preempted_queries,
            preempted_prefix_cache_hits: self.counters.preempted_hits,
            num_preemptions: self.counters.num_preemptions,
            cached_blocks: to_u32(self.pool.num_cached()),
            distinct_cached_blocks: to_u32(self.pool.num_cached_distinct()),
            free_blocks: to_u32(self.pool.num_free()),
            used_blocks: to_u32(used),
            total_blocks: to_u32(total),
            prompt_tokens: self.counters.prompt_tokens,
            generation_tokens: self.counters.generation_tokens,
            host_blocks: to_u32(self.pool.num_host()),
            host_hit_tokens: self.counters.host_hits,
        }
    }

    /// Every cached block hash, sorted, once per block holding it (for tests that rebuild the
    /// cache from the event stream).
    #[doc(hidden)]
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.pool.cached_hashes()
    }

    /// Every hash in the offloading connector's host tier, sorted (for tests that rebuild it
    /// from the event stream).
    #[doc(hidden)]
    pub fn host_hashes(&self) -> Vec<u64> {
        self.pool.host_hashes()
    }

    /// Checks internal consistency: every block's reference count equals the number of live
    /// requests holding it, the free queue holds exactly the unreferenced blocks, the hash map
    /// matches the blocks, and every request is in exactly one queue in a matching phase.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for req in self.requests.values() {
            for &b in &req.blocks {
                *refs.entry(b).or_default() += 1;
            }
            if req.num_cached_blocks > req.blocks.len() {
                return Err(format!(
                    "request {}: more cached blocks than blocks",
                    req.id
                ));
            }
            let bs = self.config.block_size as usize;
            if req.blocks.len() < req.num_computed.div_ceil(bs) {
                return Err(format!(
                    "request {}: computed tokens without blocks",
                    req.id
                ));
            }
        }
        self.pool.check(&refs)?;
        if self.running.len() > self.config.max_num_seqs as usize {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        let mut seen = HashMap::new();
        for id in self.running.iter().chain(self.waiting.iter()) {
            if seen.insert(*id, ()).is_some() {
                return Err(format!("request {id} queued twice"));
            }
        }
        if seen.len() != self.requests.len() {
            return Err("a request is in no queue, or a queue holds an unknown id".into());
        }
        for id in &self.running {
            match self.requests.get(id) {
                Some(r) if r.phase == Phase::Running => {}
                _ => return Err(format!("running request {id} not in the running phase")),
            }
        }
        for id in &self.waiting {
            match self.requests.get(id) {
                Some(r) if r.phase != Phase::Running => {
                    if r.phase == Phase::Waiting && r.num_computed == 0 && !r.blocks.is_empty() {
                        return Err(format!("waiting request {id} holds blocks"));
                    }
                }
                _ => return Err(format!("waiting request {id} in the running phase")),
            }
        }
        Ok(())
    }

    /// Removes a request and frees its blocks.
    fn release(&mut self, id: RequestId) -> bool {
        let Some(req) = self.requests.remove(&id) else {
            return false;
        };
        self.pool.free_blocks(&req.blocks);
        self.pool.offload_finished(id);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        true
    }
}

/// The prompt's full blocks, for a decode engine to pull.
fn transfer_params(req: &Request, block_size: usize) -> TransferParams {
    let full = (req.prompt_len / block_size).min(req.blocks.len());
    let block_ids = req
        .blocks
        .get(..full)
        .map(<[_]>::to_vec)
        .unwrap_or_default();
    let block_hashes = req
        .hashes
        .get(..full)
        .map(<[_]>::to_vec)
        .unwrap_or_default();
    TransferParams {
        block_ids,
        block_hashes,
        num_tokens: u32::try_from(full * block_size).unwrap_or(u32::MAX),
        prompt_tokens: u32::try_from(req.prompt_len).unwrap_or(u32::MAX),
    }
}
