//! One scheduling pass of vLLM v1's scheduler (FCFS policy, chunked prefill on).
//!
//! 1. The token budget is `max_num_batched_tokens`.
//! 2. Running requests, in order: each takes what it has left to compute (1 token when
//!    decoding), capped by `long_prefill_token_threshold` and the budget. When its blocks cannot
//!    be allocated, the *last* running request is preempted (blocks freed, computed tokens reset
//!    to 0, pushed to the front of the waiting queue, behind requests holding remote KV) and
//!    the allocation retried; a request that preempts itself is not scheduled.
//! 3. Only if nobody was preempted: waiting requests, first come first served, while the budget
//!    and `max_num_seqs` allow. A request with nothing computed is looked up in the prefix
//!    cache (at most `num_tokens − 1` tokens can hit, in whole blocks); a remote prefill starts
//!    its transfer and is skipped; a request whose blocks cannot be allocated stops the loop.
//!    Skipped requests go back to the front of the queue, in order.
//!
//! Blocks become cached (and `Stored` is emitted) when the scheduling decision covers them, as
//! vLLM caches at allocation time.
//!
//! Two departures keep the model live where vLLM can hang with remote-prefill requests holding
//! blocks while waiting: preempted requests queue behind them (see `preempt`), and a queue
//! stuck with nothing running releases them (see `break_stall`).

use crate::block_pool::{BlockPool, CacheRequest};
use crate::engine::Engine;
use crate::offload::{Lookup, LookupRequest, Sources};
use crate::request::{Phase, Request};
use crate::{Nanos, RequestId};

/// The decisions of one scheduling pass.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    /// Scheduled requests and their new tokens, in order.
    pub(crate) batch: Vec<(RequestId, usize)>,
    /// Requests preempted in this pass, in order.
    pub(crate) preempted: Vec<RequestId>,
    /// Time the step spends loading blocks from an offload tier that loads in the step
    /// ([`crate::OffloadTier::loads_in_step`]) before its forward pass.
    pub(crate) load: Nanos,
}

/// What happened to the request at the front of the waiting queue.
enum Admission {
    /// Moved to running with this many new tokens, after loading blocks from an offload tier
    /// that loads in the step for this long (0: nothing loaded).
    Scheduled(usize, Nanos),
    /// Stays waiting but does not block the queue (a KV transfer in flight).
    Skipped,
    /// Cannot be scheduled now; nobody behind it is either.
    Blocked,
    /// No such request (dropped from the queue).
    Gone,
}

impl Engine {
    /// Decides the next batch at virtual time `now`.
    pub(crate) fn schedule(&mut self, now: Nanos) -> Schedule {
        let mut budget = self.config.max_num_batched_tokens as usize;
        let mut out = Schedule::default();

        let mut idx = 0;
        while budget > 0 {
            let Some(&id) = self.running.get(idx) else {
                break;
            };
            let Some(remaining) = self
                .requests
                .get(&id)
                .map(|r| r.num_tokens().saturating_sub(r.num_computed))
            else {
                self.running.remove(idx);
                continue;
            };
            let num_new = self.chunk(remaining, budget);
            if num_new == 0 {
                idx += 1;
                continue;
            }
            let mut scheduled = false;
            loop {
                if self.grow_running(id, num_new) {
                    scheduled = true;
                    break;
                }
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
            if scheduled {
                out.batch.push((id, num_new));
                budget -= num_new;
                idx += 1;
            }
        }

        if out.preempted.is_empty() {
            self.schedule_waiting(now, &mut budget, &mut out);
            if self.break_stall(now, &mut out) {
                self.schedule_waiting(now, &mut budget, &mut out);
            }
        }
        out
    }

    /// The waiting loop: admits requests first come first served.
    fn schedule_waiting(&mut self, now: Nanos, budget: &mut usize, out: &mut Schedule) {
        let mut skipped = Vec::new();
        while *budget > 0 && self.running.len() < self.config.max_num_seqs as usize {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            match self.admit_waiting(id, now, *budget) {
                Admission::Scheduled(num_new, load) => {
                    self.waiting.pop_front();
                    self.running.push(id);
                    out.batch.push((id, num_new));
                    out.load = out.load.saturating_add(load);
                    *budget -= num_new;
                }
                Admission::Skipped => {
                    self.waiting.pop_front();
                    skipped.push(id);
                }
                Admission::Gone => {
                    self.waiting.pop_front();
                }
                Admission::Blocked => break,
            }
        }
        for id in skipped.into_iter().rev() {
            self.waiting.push_front(id);
        }
    }

    /// Liveness guard (not in vLLM). Waiting requests whose KV arrived from a remote engine
    /// hold blocks; a request ahead of them (typically one just preempted) may need those
    /// blocks, and vLLM's FCFS loop never reaches past it: vLLM hangs. When nothing runs, no
    /// transfer is still in flight and the queue is stuck that way, the block holders are
    /// preempted by recomputation (their received blocks stay cached, so they will hit them
    /// again) and the queue is retried. Returns whether it preempted anything.
    fn break_stall(&mut self, now: Nanos, out: &mut Schedule) -> bool {
        if !out.batch.is_empty() || !self.running.is_empty() {
            return false;
        }
        let Some(head) = self.waiting.front().and_then(|id| self.requests.get(id)) else {
            return false;
        };
        if head.arrival > now {
            return false;
        }
        let mut holders = Vec::new();
        for id in &self.waiting {
            let Some(req) = self.requests.get(id) else {
                continue;
            };
            if matches!(req.phase, Phase::Transferring { ready_at, .. } if ready_at > now) {
                return false;
            }
            if !req.blocks.is_empty() {
                holders.push(*id);
            }
        }
        let block_size = self.config.block_size as usize;
        for &id in &holders {
            if let Some(req) = self.requests.get_mut(&id) {
                if let Phase::Transferring { target, .. } = req.phase {
                    cache_up_to(&mut self.pool, req, block_size, target);
                }
                self.pool.free_blocks(&req.blocks);
                req.blocks.clear();
                req.num_cached_blocks = 0;
                req.num_computed = 0;
                req.num_preemptions += 1;
                req.phase = Phase::Waiting;
            }
            self.counters.num_preemptions += 1;
            out.preempted.push(id);
        }
        !holders.is_empty()
    }

    /// Tokens a request with `remaining` tokens to compute gets from a budget of `budget`.
    fn chunk(&self, remaining: usize, budget: usize) -> usize {
        let threshold = self.config.long_prefill_token_threshold as usize;
        let capped = if threshold > 0 {
            remaining.min(threshold)
        } else {
            remaining
        };
        capped.min(budget)
    }

    /// Allocates the blocks a running request needs for `num_new` more tokens.
    fn grow_running(&mut self, id: RequestId, num_new: usize) -> bool {
        let block_size = self.config.block_size as usize;
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let upto = req.num_computed + num_new;
        let need = upto.div_ceil(block_size).saturating_sub(req.blocks.len());
        let Some(new) = self.pool.allocate(need) else {
            return false;
        };
        req.blocks.extend(new);
        cache_up_to(&mut self.pool, req, block_size, upto);
        true
    }

    /// Preemption by recomputation: frees the request's blocks and queues it at the front of
    /// the waiting queue, but behind the waiting requests that hold blocks (remote KV arriving
    /// or arrived), which vLLM keeps at the front too. vLLM puts the preempted request ahead of
    /// them; when it needs their blocks, vLLM deadlocks.
    pub(crate) fn preempt(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            self.pool.free_blocks(&req.blocks);
            req.blocks.clear();
            req.num_cached_blocks = 0;
            req.num_computed = 0;
            req.num_preemptions += 1;
            req.phase = Phase::Waiting;
        }
        let holders = self
            .waiting
            .iter()
            .take_while(|w| self.requests.get(w).is_some_and(|r| !r.blocks.is_empty()))
            .count();
        self.waiting.insert(holders, id);
        self.counters.num_preemptions += 1;
    }

    /// Tries to move the request at the front of the waiting queue to running.
    fn admit_waiting(&mut self, id: RequestId, now: Nanos, budget: usize) -> Admission {
        let block_size = self.config.block_size as usize;
        let threshold = self.config.long_prefill_token_threshold as usize;
        let Some(req) = self.requests.get_mut(&id) else {
            return Admission::Gone;
        };
        if req.arrival > now {
            return Admission::Blocked;
        }
        if let Phase::Transferring { ready_at, target } = req.phase {
            if now < ready_at {
                return Admission::Skipped;
            }
            // The remote KV arrived: those blocks are computed; cache them as such.
            req.num_computed = target;
            req.phase = Phase::Waiting;
            cache_up_to(&mut self.pool, req, block_size, target);
        }

        let mut hits = Vec::new();
        // Blocks the offload tier loads in this step: (first block, sources).
        let mut in_step: Option<(usize, Sources)> = None;
        if req.num_computed == 0 {
            if self.pool.caching() {
                let max_blocks = (req.num_tokens() - 1) / block_size;
                hits = self.pool.longest_hit(&req.hashes, max_blocks);
                let queried = req.num_tokens() as u64;
                let hit = (hits.len() * block_size) as u64;
                self.counters
                    .record_lookup(queried, hit, req.num_preemptions > 0);
            }
            if let Some(remote) = req.remote_prefill {
                let target = (remote as usize).min(req.prompt_len - 1) / block_size * block_size;
                if target > hits.len() * block_size {
                    let bytes = (target - hits.len() * block_size) as u128
                        * u128::from(self.config.kv_bytes_per_token);
                    let load = Load {
                        hits,
                        target,
                        wait: transfer_time(bytes, self.config.kv_transfer_bandwidth),
                    };
                    // Blocked: the pull is tried again next step.
                    let admission = start_load(&mut self.pool, req, load, &self.config, now);
                    if matches!(admission, Admission::Skipped) {
                        req.remote_prefill = None;
                    }
                    return admission;
                }
                req.remote_prefill = None;
            } else if self.pool.offloading() {
                // The offloading connector: the blocks right after the GPU hit that its tier
                // holds load before the request is scheduled (vLLM's
                // `WAITING_FOR_REMOTE_KVS`), and count as computed. A tier that does not know
                // yet keeps the request waiting without blocking the queue.
                let max_blocks = (req.num_tokens() - 1) / block_size;
                let after = req.hashes.get(hits.len()..).unwrap_or_default();
                let after = after
                    .get(..max_blocks.saturating_sub(hits.len()).min(after.len()))
                    .unwrap_or_default();
                let lookup = self.pool.offload_lookup(LookupRequest {
                    request: id,
                    first_block: hits.len(),
                    hashes: after,
                    tokens: &req.tokens,
                });
                let sources = match lookup {
                    Lookup::Pending => return Admission::Skipped,
                    Lookup::Found(s) => s,
                };
                let sources = sources.take(after.len());
                let first_block = hits.len();
                if sources.blocks() > 0 && self.pool.offload_loads_in_step(&sources) {
                    // The connector loads them in the step that schedules the request (vLLM
                    // `load_kv_async = False`): they count as computed now, their GPU blocks
                    // are allocated with the step's, and the step takes the load's time.
                    in_step = Some((first_block, sources));
                } else if sources.blocks() > 0 {
                    let load = Load {
                        target: (first_block + sources.blocks()) * block_size,
                        hits,
                        wait: offload_wait(&sources, &self.config),
                    };
                    let admission = start_load(&mut self.pool, req, load, &self.config, now);
                    if matches!(admission, Admission::Skipped) {
                        load_started(
                            &mut self.pool,
                            &mut self.counters,
                            req,
                            block_size,
                            first_block,
                            sources,
                        );
                    }
                    return admission;
                }
            }
        }

        let loaded = in_step.map_or(0, |(_, sources)| sources.blocks() * block_size);
        let computed = req.num_computed.max(hits.len() * block_size + loaded);
        let remaining = req.num_tokens().saturating_sub(computed);
        let capped = if threshold > 0 {
            remaining.min(threshold)
        } else {
            remaining
        };
        let num_new = capped.min(budget);
        if num_new == 0 {
            return Admission::Blocked;
        }
        let upto = computed + num_new;
        let held = req.blocks.len() + hits.len();
        let need = upto.div_ceil(block_size).saturating_sub(held);
        if !self.pool.can_allocate(&hits, need) {
            return Admission::Blocked;
        }
        self.pool.touch(&hits);
        let Some(new) = self.pool.allocate(need) else {
            self.pool.free_blocks(&hits);
            return Admission::Blocked;
        };
        if !hits.is_empty() {
            req.num_cached_blocks = hits.len();
            req.blocks = hits;
        }
        req.blocks.extend(new);
        req.num_computed = computed;
        // A load in the step starts before the step's blocks are cached (and offloaded): the
        // tier serves the blocks from where they are, then the engine saves what it computed.
        if let Some((first_block, sources)) = in_step {
            load_started(
                &mut self.pool,
                &mut self.counters,
                req,
                block_size,
                first_block,
                sources,
            );
        }
        cache_up_to(&mut self.pool, req, block_size, upto);
        if req.num_cached_tokens.is_none() {
            req.num_cached_tokens = Some(u32::try_from(computed).unwrap_or(u32::MAX));
        }
        req.phase = Phase::Running;
        let wait = in_step.map_or(0, |(_, sources)| offload_wait(&sources, &self.config));
        Admission::Scheduled(num_new, wait)
    }
}

/// A load from the offload tier of `sources.blocks()` blocks from `first_block` on began: the
/// tier hears it (it counts as a use of those blocks) and the tokens count as host hits.
fn load_started(
    pool: &mut BlockPool,
    counters: &mut crate::engine::Counters,
    req: &Request,
    block_size: usize,
    first_block: usize,
    sources: Sources,
) {
    let found = sources.blocks();
    counters.host_hits += (found * block_size) as u64;
    let hashes = req
        .hashes
        .get(first_block..first_block + found)
        .unwrap_or_default();
    pool.offload_load_started(
        LookupRequest {
            request: req.id,
            first_block,
            hashes,
            tokens: &req.tokens,
        },
        sources,
    );
}

/// KV that arrives from outside the GPU before a request runs: a remote prefill's blocks, or
/// blocks the host tier holds.
struct Load {
    /// The request's GPU prefix hit.
    hits: Vec<crate::BlockId>,
    /// Tokens computed once the load is done (whole blocks, beyond the hit).
    target: usize,
    /// How long the bytes take to arrive.
    wait: Nanos,
}

/// How long `bytes` take at `bandwidth` bytes/s.
fn transfer_time(bytes: u128, bandwidth: u64) -> Nanos {
    let wait = (bytes * 1_000_000_000).div_ceil(u128::from(bandwidth.max(1)));
    Nanos::try_from(wait).unwrap_or(Nanos::MAX)
}

/// How long loading blocks from the offload tier's levels takes: one after the other, each
/// at its own bandwidth (host memory over PCIe, disk, the remote store).
fn offload_wait(sources: &Sources, config: &crate::EngineConfig) -> Nanos {
    let block = u128::from(config.kv_bytes_per_token) * u128::from(config.block_size);
    [
        (sources.host, config.host_load_bandwidth),
        (sources.disk, config.disk_load_bandwidth),
        (sources.remote, config.remote_load_bandwidth),
    ]
    .into_iter()
    .map(|(blocks, bw)| transfer_time(blocks as u128 * block, bw))
    .fold(0, Nanos::saturating_add)
}

/// Allocates the blocks `load` fills and puts the request in [`Phase::Transferring`] until its
/// bytes have arrived; blocked (nothing changed) when the blocks cannot be had.
fn start_load(
    pool: &mut BlockPool,
    req: &mut Request,
    load: Load,
    config: &crate::EngineConfig,
    now: Nanos,
) -> Admission {
    let block_size = config.block_size as usize;
    let local = load.hits.len() * block_size;
    let need = load.target / block_size - load.hits.len();
    if !pool.can_allocate(&load.hits, need) {
        return Admission::Blocked;
    }
    pool.touch(&load.hits);
    let Some(new) = pool.allocate(need) else {
        pool.free_blocks(&load.hits);
        return Admission::Blocked;
    };
    req.num_cached_blocks = load.hits.len();
    req.blocks = load.hits;
    req.blocks.extend(new);
    req.num_computed = local;
    req.phase = Phase::Transferring {
        ready_at: now.saturating_add(load.wait),
        target: load.target,
    };
    Admission::Skipped
}

/// Caches the request's full blocks up to `num_tokens` tokens that are not cached yet.
fn cache_up_to(pool: &mut BlockPool, req: &mut Request, block_size: usize, num_tokens: usize) {
    let full = (num_tokens / block_size)
        .min(req.blocks.len())
        .min(req.hashes.len());
    if full <= req.num_cached_blocks {
        return;
    }
    pool.cache_full_blocks(
        CacheRequest {
            id: req.id,
            blocks: &req.blocks,
            hashes: &req.hashes,
            tokens: &req.tokens,
            block_size,
        },
        req.num_cached_blocks,
        full,
    );
    req.num_cached_blocks = full;
}
