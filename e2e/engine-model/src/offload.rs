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

    /// The first `n` blocks, counting host ones first, then disk, then remote (the order a
    /// tier serves them in).
    #[must_use]
    pub fn take(self, n: usize) -> Self {
        let host = self.host.min(n);
        let disk = self.disk.min(n - host);
        let remote = self.remote.min(n - host - disk);
        Self { host, disk, remote }
    }

    /// Without the first `n` blocks (host ones first).
    #[must_use]
    pub fn skip(self, n: usize) -> Self {
        let host = self.host.saturating_sub(n);
        let n = n - (self.host - host);
        let disk = self.disk.saturating_sub(n);
        let n = n - (self.disk - disk);
        Self {
            host,
            disk,
            remote: self.remote.saturating_sub(n),
        }
    }
}

impl std::ops::AddAssign for Sources {
    fn add_assign(&mut self, other: Self) {
        self.host += other.host;
        self.disk += other.disk;
        self.remote += other.remote;
    }
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

    /// Whether a hit's blocks, found at `sources`' levels, load in the step that schedules
    /// the request (vLLM `load_kv_async = False`, as kvgate's vLLM connector does: the worker
    /// copies them in `start_load_kv` before the forward pass, so the step takes the load's
    /// time and the request computes its other tokens in the same step) rather than while
    /// the request waits and other steps run (`false`, the default: vLLM's
    /// `OffloadingConnector`). Asked per hit, so a connector may load fast levels in the
    /// step and wait for slow ones.
    fn loads_in_step(&self, _sources: &Sources) -> bool {
        false
    }

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

#[cfg(test)]
mod tests {
    use super::Sources;

    #[test]
    fn take_and_skip_count_host_blocks_first() {
        let s = Sources {
            host: 2,
            disk: 1,
            remote: 3,
        };
        let t = |host, disk, remote| Sources { host, disk, remote };
        assert_eq!(s.take(3), t(2, 1, 0));
        assert_eq!(s.take(2), t(2, 0, 0));
        assert_eq!(s.take(10), s);
        assert_eq!(s.skip(3), t(0, 0, 3));
        assert_eq!(s.skip(1), t(1, 1, 3));
        assert_eq!(s.skip(10).blocks(), 0);
        assert_eq!(s.skip(0), s);
        let mut sum = s;
        sum += s.take(1);
        assert_eq!(sum, t(3, 1, 3));
    }
}
