//! Where an engine's KV offloading connector keeps blocks beyond the GPU.
//!
//! The engine model talks to its offload tier through [`OffloadTier`], the two calls a vLLM
//! v1 KV connector answers:
//!
//! - **store** ([`OffloadTier::offload`]): the blocks the GPU just cached, in chain order,
//!   copied out as they are cached (write-through, as vLLM's `OffloadingConnector` and
//!   Dynamo's KVBM do);
//! - **lookup** ([`OffloadTier::lookup`]): how many of the blocks right after a waiting
//!   request's GPU prefix hit the tier can load (vLLM's `get_num_new_matched_tokens`), then,
//!   once the engine has GPU blocks for them, [`OffloadTier::load_started`] (vLLM's
//!   `update_state_after_alloc`). An
//!   answer may not be known yet ([`Lookup::Pending`]: the request waits and asks again on a
//!   later step, as vLLM's scheduler does when a connector returns `None`); once known it says
//!   which of the tier's levels the blocks come from, so the engine charges each its own load
//!   bandwidth.
//!
//! Two tiers exist: the engine's own host memory (`HostCache`, vLLM's native CPU offloading:
//! answers at once, reports its copies as `CPU` KV events of the engine) and, in the live
//! simulator, the node's KV block manager (`kvgate-kvbm`, shared by every engine of the node,
//! which publishes its own events).

use crate::{CacheEvent, RequestId};

/// Blocks a request just cached on the GPU, handed to the tier to copy out.
#[derive(Debug, Clone, Copy)]
pub struct Offload<'a> {
    /// The request that computed them.
    pub request: RequestId,
    /// Their indices in the request's block chain, ascending (not always contiguous: blocks
    /// cached earlier under the same hash are not offloaded twice).
    pub indices: &'a [usize],
    /// Their hashes, one per index.
    pub hashes: &'a [u64],
    /// The request's tokens so far (block `i` is `tokens[i·block_size..(i+1)·block_size]`).
    pub tokens: &'a [u32],
}

/// A waiting request's question: how many of `hashes` (its blocks from `first_block` on, right
/// after its GPU prefix hit) can the tier load?
#[derive(Debug, Clone, Copy)]
pub struct LookupRequest<'a> {
    /// The request.
    pub request: RequestId,
    /// The index of `hashes[0]` in the request's block chain.
    pub first_block: usize,
    /// The candidate blocks' hashes, in chain order (already capped so that at least one
    /// prompt token is left to compute).
    pub hashes: &'a [u64],
    /// The request's tokens.
    pub tokens: &'a [u32],
}

/// Where loaded blocks come from, in blocks per level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sources {
    /// From host memory.
    pub host: usize,
    /// From local disk.
    pub disk: usize,
    /// From a remote store.
    pub remote: usize,
}

impl Sources {
    /// Blocks in all.
    pub fn blocks(&self) -> usize {
        self.host + self.disk + self.remote
    }
}

/// `sources` cut to their first `blocks` blocks (host ones first, then disk, then remote, the
/// order a tier serves them in).
pub(crate) fn cap(sources: Sources, blocks: usize) -> Sources {
    let host = sources.host.min(blocks);
    let disk = sources.disk.min(blocks - host);
    let remote = sources.remote.min(blocks - host - disk);
    Sources { host, disk, remote }
}

/// A tier's answer to a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Not known yet: ask again on a later step.
    Pending,
    /// The leading blocks the tier loads (their count is [`Sources::blocks`], at most the
    /// number asked for), by level; zero blocks: compute them all.
    Found(Sources),
}

/// An offloading connector's store, as the engine model sees it.
pub trait OffloadTier: Send + std::fmt::Debug {
    /// Copies out blocks the GPU just cached; copies the tier reports as the engine's own KV
    /// events go to `events`.
    fn offload(&mut self, blocks: Offload<'_>, events: &mut Vec<CacheEvent>);

    /// Which leading blocks of `request.hashes` the tier can load. Asked again on every step
    /// while the request cannot start (a pending answer, or GPU blocks not free for the load):
    /// it is a question, not a use.
    fn lookup(&mut self, request: LookupRequest<'_>) -> Lookup;

    /// The engine allocated GPU blocks for the first `sources.blocks()` blocks of
    /// `request.hashes` (what the last lookup found, capped) and waits for them: the load
    /// happens, and counts as a use of those blocks.
    fn load_started(&mut self, _request: LookupRequest<'_>, _sources: Sources) {}

    /// The request is gone (finished or aborted): forget anything kept for it.
    fn finished(&mut self, _request: RequestId) {}

    /// `reset_prefix_cache`: drop what the engine's own tier holds (no event; the engine
    /// reports one `Cleared`). A tier shared with other engines keeps its blocks.
    fn clear(&mut self);

    /// Blocks held for this engine, as far as the tier knows (0 for a shared tier).
    fn len(&self) -> usize;

    /// Whether [`len`](Self::len) is 0.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every hash held for this engine, sorted (empty for a shared tier).
    fn hashes(&self) -> Vec<u64>;
}
