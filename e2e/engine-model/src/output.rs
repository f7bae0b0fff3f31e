//! What a step produces and what the engine reports about itself.

use crate::cost::BatchShape;
use crate::{BlockId, CacheEvent, Nanos, RequestId};

/// The result of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// How long the step's forward pass takes; its outputs are delivered at `now + duration`.
    /// Zero when the scheduler only preempted requests or finished a KV transfer and ran no
    /// batch.
    pub duration: Nanos,
    /// One per request that emitted a token, finished or was preempted in this step: the
    /// preempted ones first, then the batch in scheduling order.
    pub outputs: Vec<RequestOutput>,
    /// Cache events, in the order vLLM emits them within the step.
    pub events: Vec<CacheEvent>,
    /// What the batch computed.
    pub shape: BatchShape,
}

/// What one request got from a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// The token generated this step, if any (at most one).
    pub new_tokens: Vec<u32>,
    /// On the request's first token: the prompt tokens served without computing them, vLLM's
    /// `num_cached_tokens`: local prefix-cache hits plus, for a remote prefill, the tokens
    /// pulled from the remote engine (vLLM counts connector tokens as computed).
    pub num_cached_tokens: Option<u32>,
    /// Set when the request finished in this step.
    pub finished: Option<FinishReason>,
    /// For a prefill-only request, on finishing: what a decode engine pulls.
    pub kv_transfer_params: Option<TransferParams>,
    /// The request was preempted in this step: its blocks were freed, it went back to the front
    /// of the waiting queue and will recompute its tokens (already emitted tokens stand).
    pub preempted: bool,
    /// On the request's first token: how long it waited between arrival and the step that first
    /// scheduled it (vLLM's queue time).
    pub queue_time: Option<Nanos>,
}

impl RequestOutput {
    pub(crate) fn preempted(id: RequestId) -> Self {
        Self {
            id,
            new_tokens: Vec::new(),
            num_cached_tokens: None,
            finished: None,
            kv_transfer_params: None,
            preempted: true,
            queue_time: None,
        }
    }
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It generated all its output tokens (vLLM `length`; a caller that cut the output at a
    /// stop string reports `stop` itself).
    Length,
}

/// The blocks a prefill-only request leaves for a decode engine (vLLM NIXL's
/// `kv_transfer_params`: `remote_block_ids` and the tokens they hold).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferParams {
    /// Block ids of the prompt's full blocks, in order.
    pub block_ids: Vec<BlockId>,
    /// Their hashes.
    pub block_hashes: Vec<u64>,
    /// Tokens in those blocks (`block_ids.len() × block_size`): pass it as
    /// [`KvTransfer::RemotePrefill`](crate::KvTransfer::RemotePrefill)'s `num_tokens`.
    pub num_tokens: u32,
    /// Prompt tokens of the request.
    pub prompt_tokens: u32,
}

/// Engine gauges and counters, as vLLM's `/metrics` exposes them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Requests running (`vllm:num_requests_running`).
    pub running: u32,
    /// Requests waiting, KV transfers included (`vllm:num_requests_waiting`).
    pub waiting: u32,
    /// Of `waiting`, those whose KV is arriving from a remote engine.
    pub transferring: u32,
    /// Fraction of usable blocks held by requests (`vllm:kv_cache_usage_perc`); free blocks
    /// that still hold cached hashes do not count.
    pub kv_usage: f64,
    /// Prefix-cache lookups, in tokens (`vllm:prefix_cache_queries`): a waiting request's full
    /// length each time the scheduler looks it up; lookups of preempted requests excluded.
    pub prefix_cache_queries: u64,
    /// Prefix-cache hits, in tokens (`vllm:prefix_cache_hits`), same lookups.
    pub prefix_cache_hits: u64,
    /// Lookups of previously preempted requests, in tokens (vLLM keeps them apart).
    pub preempted_prefix_cache_queries: u64,
    /// Hits of those lookups, in tokens.
    pub preempted_prefix_cache_hits: u64,
    /// Preemptions so far (`vllm:num_preemptions`).
    pub num_preemptions: u64,
    /// Blocks holding a cached hash, in use or free (duplicates counted).
    pub cached_blocks: u32,
    /// Distinct hashes among them: the blocks the engine's KV events say it holds.
    pub distinct_cached_blocks: u32,
    /// Free blocks, cached or not.
    pub free_blocks: u32,
    /// Blocks held by requests.
    pub used_blocks: u32,
    /// Usable blocks (`num_gpu_blocks − 1`): `used + free == total`.
    pub total_blocks: u32,
    /// Prompt tokens of requests that produced their first token (`vllm:prompt_tokens`).
    pub prompt_tokens: u64,
    /// Generated tokens (`vllm:generation_tokens`).
    pub generation_tokens: u64,
    /// Blocks in the offloading connector's host tier (0 when offloading is off).
    pub host_blocks: u32,
    /// Prompt tokens loaded from the host tier instead of computed (in each request's
    /// `num_cached_tokens` too, as vLLM counts connector hits).
    pub host_hit_tokens: u64,
}
