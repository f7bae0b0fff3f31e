//! The paged KV cache: blocks with reference counts, the free queue in eviction order, and the
//! prefix-cache map from block hash to blocks (vLLM's `BlockPool`).
//!
//! Reproduced from vLLM v1:
//! - Block 0 is the *null block*: reserved, never allocated, so `num_gpu_blocks − 1` blocks are
//!   usable and block ids start at 1.
//! - The cache is not de-duplicated: when two requests fill blocks with the same content (one
//!   computed them while the other was still in flight), both blocks are cached under the same
//!   hash, each emits its own `Stored`, and evicting one emits a `Removed` while the other stays
//!   cached. A lookup takes the first block cached under a hash.
//! - Allocating takes the front of the free queue; a block that still holds a hash is evicted
//!   then (one `Removed` per block). A cache hit on a free block removes it from the queue.
//! - Freeing returns a request's blocks tail first, so its last blocks are evicted first.

use std::collections::HashMap;

use crate::free_queue::FreeQueue;
use crate::host_cache::HostCache;
use crate::offload::{Lookup, LookupRequest, Offload, OffloadTier, Sources};
use crate::{BlockId, CacheEvent, RequestId};

#[derive(Debug, Clone, Copy, Default)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
}

/// The GPU's KV blocks, their reference counts, free queue and prefix-cache map.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    free: FreeQueue,
    /// Hash → the blocks cached under it, first cached first.
    cached: HashMap<u64, Vec<BlockId>>,
    /// Blocks listed in `cached`, duplicates counted (kept so that stats are O(1): the simulator
    /// reads them on every submission and metrics scrape, with pools of 10⁵–10⁶ blocks).
    num_cached: usize,
    caching: bool,
    /// The offloading connector's tier (write-through; none when off).
    offload: Option<Box<dyn OffloadTier>>,
    events: Vec<CacheEvent>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (the null block included), all free, and a host tier
    /// of `num_host_blocks` (0: no offloading; only with caching on).
    pub(crate) fn new(num_gpu_blocks: u32, caching: bool, num_host_blocks: u32) -> Self {
        let n = num_gpu_blocks as usize;
        let mut free = FreeQueue::new(n);
        for id in 1..num_gpu_blocks {
            free.push_back(id);
        }
        Self {
            blocks: vec![Block::default(); n],
            free,
            cached: HashMap::new(),
            num_cached: 0,
            caching,
            offload: (caching && num_host_blocks > 0)
                .then(|| Box::new(HostCache::new(num_host_blocks)) as Box<dyn OffloadTier>),
            events: Vec::new(),
        }
    }

    /// Replaces the offloading connector's tier (only with prefix caching on: without it
    /// nothing is cached, so nothing is offloaded; `tier` is then dropped).
    pub(crate) fn set_offload(&mut self, tier: Box<dyn OffloadTier>) {
        if self.caching {
            self.offload = Some(tier);
        }
    }

    /// Whether an offloading tier is set.
    pub(crate) fn offloading(&self) -> bool {
        self.offload.is_some()
    }

    /// Whether the offloading tier loads a hit's blocks in the step that schedules the request.
    pub(crate) fn offload_loads_in_step(&self, sources: &Sources) -> bool {
        self.offload
            .as_ref()
            .is_some_and(|t| t.loads_in_step(sources))
    }

    /// Asks the offloading tier which leading blocks of `request.hashes` it loads (none
    /// without a tier).
    pub(crate) fn offload_lookup(&mut self, request: LookupRequest<'_>) -> Lookup {
        match &mut self.offload {
            Some(tier) if !request.hashes.is_empty() => tier.lookup(request),
            _ => Lookup::Found(Sources::default()),
        }
    }

    /// Tells the offloading tier a load of what its lookup found started.
    pub(crate) fn offload_load_started(&mut self, request: LookupRequest<'_>, sources: Sources) {
        if let Some(tier) = &mut self.offload {
            tier.load_started(request, sources);
        }
    }

    /// Tells the offloading tier a request is gone.
    pub(crate) fn offload_finished(&mut self, request: RequestId) {
        if let Some(tier) = &mut self.offload {
            tier.finished(request);
        }
    }

    /// Blocks in the offloading tier (for this engine).
    pub(crate) fn num_host(&self) -> usize {
        self.offload.as_ref().map_or(0, |t| t.len())
    }

    /// Every hash in the offloading tier (for this engine), sorted.
    pub(crate) fn host_hashes(&self) -> Vec<u64> {
        self.offload
            .as_ref()
            .map(|t| t.hashes())
            .unwrap_or_default()
    }

    /// Blocks that requests can use (all but the null block).
    pub(crate) fn usable(&self) -> usize {
        self.blocks.len().saturating_sub(1)
    }

    /// Free blocks, cached or not.
    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by at least one request.
    pub(crate) fn num_used(&self) -> usize {
        self.usable().saturating_sub(self.free.len())
    }

    /// Blocks currently holding a cached hash (in use or free), duplicates counted.
    pub(crate) fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Distinct hashes held by cached blocks (what the engine's KV events leave in an index).
    pub(crate) fn num_cached_distinct(&self) -> usize {
        self.cached.len()
    }

    /// Whether prefix caching is on.
    pub(crate) fn caching(&self) -> bool {
        self.caching
    }

    /// The blocks of the longest run of leading `hashes` that are cached, at most `max_blocks`.
    pub(crate) fn longest_hit(&self, hashes: &[u64], max_blocks: usize) -> Vec<BlockId> {
        if !self.caching {
            return Vec::new();
        }
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.cached.get(h).and_then(|ids| ids.first().copied()))
            .collect()
    }

    /// Whether `num_new` fresh blocks can be allocated after touching `hits` (hits on free
    /// blocks take those blocks out of the free queue, so they count against it).
    pub(crate) fn can_allocate(&self, hits: &[BlockId], num_new: usize) -> bool {
        let evictable_hits = hits
            .iter()
            .filter(|&&b| self.ref_count(b) == Some(0))
            .count();
        num_new + evictable_hits <= self.free.len()
    }

    /// Takes a reference on each hit block, removing free ones from the free queue.
    pub(crate) fn touch(&mut self, hits: &[BlockId]) {
        for &id in hits {
            if let Some(block) = self.blocks.get_mut(id as usize) {
                if block.ref_cnt == 0 {
                    self.free.remove(id);
                }
                block.ref_cnt += 1;
            }
        }
    }

    /// Takes `n` blocks from the front of the free queue, evicting the cached ones. Returns
    /// `None` (and changes nothing) when fewer than `n` are free.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free.pop_front()?;
            self.evict(id);
            if let Some(block) = self.blocks.get_mut(id as usize) {
                block.ref_cnt = 1;
            }
            out.push(id);
        }
        Some(out)
    }

    /// Drops the hash of a block being reused, emitting `Removed`.
    fn evict(&mut self, id: BlockId) {
        let Some(hash) = self.blocks.get_mut(id as usize).and_then(|b| b.hash.take()) else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&hash) {
            let before = ids.len();
            ids.retain(|&b| b != id);
            self.num_cached -= before - ids.len();
            if ids.is_empty() {
                self.cached.remove(&hash);
            }
        }
        self.events.push(CacheEvent::Removed { hashes: vec![hash] });
    }

    /// Releases one reference on each of a request's blocks, the last block first, so that a
    /// request's tail is evicted before its head.
    pub(crate) fn free_blocks(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            if let Some(block) = self.blocks.get_mut(id as usize) {
                block.ref_cnt = block.ref_cnt.saturating_sub(1);
                if block.ref_cnt == 0 {
                    self.free.push_back(id);
                }
            }
        }
    }

    /// Caches the request's full blocks `from..to` under their hashes and emits one `Stored`
    /// for them (vLLM `cache_full_blocks`). `tokens` are the request's tokens, `hashes` its
    /// block hashes (at least `to` of them).
    pub(crate) fn cache_full_blocks(&mut self, req: CacheRequest<'_>, from: usize, to: usize) {
        if !self.caching || from >= to {
            return;
        }
        let (Some(ids), Some(new_hashes)) = (req.blocks.get(from..to), req.hashes.get(from..to))
        else {
            return;
        };
        let mut stored = Vec::with_capacity(new_hashes.len());
        let mut indices = Vec::with_capacity(new_hashes.len());
        for (i, (&id, &hash)) in ids.iter().zip(new_hashes).enumerate() {
            let Some(block) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if block.hash.is_some() {
                continue;
            }
            block.hash = Some(hash);
            self.cached.entry(hash).or_default().push(id);
            self.num_cached += 1;
            stored.push(hash);
            indices.push(from + i);
        }
        if stored.is_empty() {
            return;
        }
        let parent = from.checked_sub(1).and_then(|i| req.hashes.get(i).copied());
        let token_ids = req
            .tokens
            .get(from * req.block_size..to * req.block_size)
            .map(<[u32]>::to_vec)
            .unwrap_or_default();
        // Write-through: the offloading connector copies what the GPU just cached (after the
        // GPU's `Stored`, which gives consumers the blocks' tokens).
        let copies = self.offload.is_some().then(|| stored.clone());
        self.events.push(CacheEvent::Stored {
            hashes: stored,
            parent,
            token_ids,
            request: req.id,
            first_block_index: u32::try_from(from).unwrap_or(u32::MAX),
        });
        if let (Some(copies), Some(tier)) = (copies, &mut self.offload) {
            tier.offload(
                Offload {
                    request: req.id,
                    indices: &indices,
                    hashes: &copies,
                    tokens: req.tokens,
                },
                &mut self.events,
            );
        }
    }

    /// Drops every cached hash when no block is in use (vLLM `reset_prefix_cache`); returns
    /// whether it did.
    pub(crate) fn reset(&mut self) -> bool {
        if self.num_used() != 0 {
            return false;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        self.num_cached = 0;
        if let Some(tier) = &mut self.offload {
            tier.clear();
        }
        self.events.push(CacheEvent::Cleared);
        true
    }

    /// The events produced since the last call, in order.
    pub(crate) fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached hash, sorted, once per block holding it.
    pub(crate) fn cached_hashes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .cached
            .iter()
            .flat_map(|(&h, ids)| std::iter::repeat_n(h, ids.len()))
            .collect();
        out.sort_unstable();
        out
    }

    /// The reference count of a block, `None` for an unknown id.
    pub(crate) fn ref_count(&self, id: BlockId) -> Option<u32> {
        self.blocks.get(id as usize).map(|b| b.ref_cnt)
    }

    /// Checks the pool's internal consistency against the reference counts the live requests
    /// imply (`expected[id]` = number of requests holding block `id`).
    pub(crate) fn check(&self, expected: &HashMap<BlockId, u32>) -> Result<(), String> {
        if self.free.contains(0) {
            return Err("the null block is in the free queue".into());
        }
        if let Some(id) = expected
            .keys()
            .find(|&&id| id == 0 || id as usize >= self.blocks.len())
        {
            return Err(format!(
                "a request holds block {id}, which is not allocatable"
            ));
        }
        let mut hashed = 0usize;
        for (id, block) in self.blocks.iter().enumerate().skip(1) {
            let id = BlockId::try_from(id).map_err(|e| e.to_string())?;
            let want = expected.get(&id).copied().unwrap_or(0);
            if block.ref_cnt != want {
                return Err(format!(
                    "block {id}: ref count {} but {want} requests hold it",
                    block.ref_cnt
                ));
            }
            if (block.ref_cnt == 0) != self.free.contains(id) {
                return Err(format!(
                    "block {id}: ref count {} but free-queue membership {}",
                    block.ref_cnt,
                    self.free.contains(id)
                ));
            }
            if let Some(h) = block.hash {
                hashed += 1;
                let holders = self
                    .cached
                    .get(&h)
                    .map_or(0, |ids| ids.iter().filter(|&&b| b == id).count());
                if holders != 1 {
                    return Err(format!("block {id}: listed {holders} times under its hash"));
                }
            }
        }
        let listed: usize = self.cached.values().map(Vec::len).sum();
        if hashed != listed || listed != self.num_cached {
            return Err(format!(
                "{listed} cache entries (counted {}) but {hashed} hashed blocks",
                self.num_cached
            ));
        }
        Ok(())
    }
}

/// The parts of a request that caching its blocks needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheRequest<'a> {
    pub(crate) id: RequestId,
    pub(crate) blocks: &'a [BlockId],
    pub(crate) hashes: &'a [u64],
    pub(crate) tokens: &'a [u32],
    pub(crate) block_size: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(blocks: &'a [BlockId], hashes: &'a [u64], tokens: &'a [u32]) -> CacheRequest<'a> {
        CacheRequest {
            id: 1,
            blocks,
            hashes,
            tokens,
            block_size: 2,
        }
    }

    #[test]
    fn block_zero_is_reserved() {
        let mut pool = BlockPool::new(4, true, 0);
        assert_eq!(pool.usable(), 3);
        let got = pool.allocate(3).unwrap();
        assert_eq!(got, vec![1, 2, 3]);
        assert!(pool.allocate(1).is_none());
        assert_eq!(pool.num_used(), 3);
    }

    #[test]
    fn freeing_puts_the_tail_first_in_eviction_order() {
        let mut pool = BlockPool::new(5, true, 0);
        let blocks = pool.allocate(3).unwrap();
        pool.cache_full_blocks(req(&blocks, &[10, 11, 12], &[0; 6]), 0, 3);
        pool.take_events();
        pool.free_blocks(&blocks);
        // Block 4 was never used; then the request's blocks tail first.
        assert_eq!(pool.free.iter().collect::<Vec<_>>(), vec![4, 3, 2, 1]);
        let _ = pool.allocate(2).unwrap();
        assert_eq!(
            pool.take_events(),
            vec![CacheEvent::Removed { hashes: vec![12] }]
        );
        assert_eq!(pool.cached_hashes(), vec![10, 11]);
    }

    #[test]
    fn duplicates_are_cached_twice_and_evicted_separately() {
        let mut pool = BlockPool::new(3, true, 0);
        let a = pool.allocate(1).unwrap();
        let b = pool.allocate(1).unwrap();
        pool.cache_full_blocks(req(&a, &[7], &[1, 2]), 0, 1);
        pool.cache_full_blocks(req(&b, &[7], &[1, 2]), 0, 1);
        assert_eq!(pool.take_events().len(), 2);
        assert_eq!(pool.cached_hashes(), vec![7, 7]);
        assert_eq!(
            pool.longest_hit(&[7], 1),
            a,
            "lookup takes the first cached block"
        );
        pool.free_blocks(&a);
        pool.free_blocks(&b);
        pool.allocate(1).unwrap();
        assert_eq!(
            pool.take_events(),
            vec![CacheEvent::Removed { hashes: vec![7] }]
        );
        assert_eq!(pool.cached_hashes(), vec![7]);
        assert_eq!(pool.longest_hit(&[7], 1), b);
    }

    #[test]
    fn touching_a_free_hit_takes_it_out_of_the_queue() {
        let mut pool = BlockPool::new(3, true, 0);
        let a = pool.allocate(1).unwrap();
        pool.cache_full_blocks(req(&a, &[5], &[1, 2]), 0, 1);
        pool.free_blocks(&a);
        assert!(pool.can_allocate(&a, 1));
        assert!(
            !pool.can_allocate(&a, 2),
            "the free hit counts against the free blocks"
        );
        pool.touch(&a);
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.ref_count(a[0]), Some(1));
        let mut expected = HashMap::new();
        expected.insert(a[0], 1);
        pool.check(&expected).unwrap();
    }

    #[test]
    fn reset_only_when_idle() {
        let mut pool = BlockPool::new(3, true, 0);
        let a = pool.allocate(1).unwrap();
        pool.cache_full_blocks(req(&a, &[5], &[1, 2]), 0, 1);
        pool.take_events();
        assert!(!pool.reset());
        pool.free_blocks(&a);
        assert!(pool.reset());
        assert_eq!(pool.take_events(), vec![CacheEvent::Cleared]);
        assert!(pool.cached_hashes().is_empty());
        assert!(pool.longest_hit(&[5], 1).is_empty());
    }

    #[test]
    fn caching_off_stores_nothing() {
        let mut pool = BlockPool::new(3, false, 0);
        let a = pool.allocate(1).unwrap();
        pool.cache_full_blocks(req(&a, &[5], &[1, 2]), 0, 1);
        assert!(pool.take_events().is_empty());
        assert!(pool.longest_hit(&[5], 1).is_empty());
    }

    #[test]
    fn check_detects_a_wrong_ref_count() {
        let mut pool = BlockPool::new(3, true, 0);
        let a = pool.allocate(1).unwrap();
        assert!(pool.check(&HashMap::new()).is_err());
        let mut expected = HashMap::new();
        expected.insert(a[0], 1);
        assert!(pool.check(&expected).is_ok());
    }
}
