//! The node's KV block manager in virtual time: what `kvgate-kvbm` is to the live simulators
//! (`kvgate-sim --kvbm-socket`), for the replay's engines.
//!
//! One [`NodeStore`] per node holds blocks by their kvgate key, shared by every engine of the
//! node, in two inclusive levels as the daemon keeps them:
//!
//! - **host memory**: least recently used first out; a block evicted from it is demoted to
//!   disk (written there if absent, touched if present);
//! - **disk** (optional): least recently used first out, its evictions are dropped.
//!
//! Each engine's [`NodeTier`] is its connector: it offloads every block the engine caches
//! (write-through, under the kvgate key of the request's tokens, as the live connector does)
//! and answers lookups at once with the leading blocks the node holds, host memory first, a
//! disk block being promoted to host memory as the daemon promotes it at onboard; the engine
//! loads what it finds in the step that schedules the request, as kvgate's vLLM connector
//! does ([`OffloadTier::loads_in_step`]). Every
//! residency change becomes a [`KvEvent`] in the store's outbox, which the replay delivers to
//! the router's index as the node's events (the daemon publishes them on NATS), so the
//! scheduler credits the node's tiers to every engine on it, as the EPP does.
//!
//! Not modelled: the remote tier, pins (onboards follow lookups at once here), write queues
//! and their drops, the daemon's transfer costs on the CPU (the engine model charges loads at
//! the configured bandwidths).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use engine_model::{CacheEvent, Lookup, LookupRequest, Offload, OffloadTier, RequestId, Sources};
use kv_events::KvEvent;
use kv_events::key::{BlockKey, KeyChain, SaltStyle};
use kv_events::tier::Tier;

/// A node store's sizes, in blocks of the engines' layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeTierConfig {
    /// Host-memory blocks.
    pub host_blocks: usize,
    /// Disk blocks (0: no disk level).
    pub disk_blocks: usize,
    /// A what-if for the connector: hits with disk blocks load while the request waits and
    /// other steps run, host-memory hits in the step. kvgate's vLLM connector (false) loads
    /// every hit in the step.
    pub async_disk_loads: bool,
}

/// A least-recently-used set of keys.
#[derive(Debug, Default)]
struct Lru {
    capacity: usize,
    stamp: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    next: u64,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    fn contains(&self, key: u64) -> bool {
        self.stamp.contains_key(&key)
    }

    fn touch(&mut self, key: u64) {
        if let Some(s) = self.stamp.get_mut(&key) {
            self.order.remove(s);
            *s = self.next;
            self.order.insert(self.next, key);
            self.next += 1;
        }
    }

    /// Inserts `key` as the most recent (touches it if held); returns the keys evicted (never
    /// `key` itself), or `None` when the level has no room at all (nothing stored).
    fn insert(&mut self, key: u64) -> Option<Vec<u64>> {
        if self.capacity == 0 {
            return None;
        }
        if self.contains(key) {
            self.touch(key);
            return Some(Vec::new());
        }
        self.stamp.insert(key, self.next);
        self.order.insert(self.next, key);
        self.next += 1;
        let mut evicted = Vec::new();
        while self.stamp.len() > self.capacity {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            self.stamp.remove(&victim);
            evicted.push(victim);
        }
        Some(evicted)
    }

    fn len(&self) -> usize {
        self.stamp.len()
    }
}

/// Counters of a node store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Blocks offloaded (new to the node, or already held).
    pub offloaded: u64,
    /// Blocks onboarded from host memory.
    pub onboarded_host: u64,
    /// Blocks onboarded from disk.
    pub onboarded_disk: u64,
    /// Blocks in host memory now.
    pub host_blocks: usize,
    /// Blocks on disk now.
    pub disk_blocks: usize,
}

#[derive(Debug)]
struct Inner {
    host: Lru,
    disk: Lru,
    outbox: Vec<KvEvent>,
    stats: NodeStats,
}

impl Inner {
    /// Stores `key` in host memory (demoting what that evicts), or straight on disk when host
    /// memory is off.
    fn store(&mut self, key: u64, parent: Option<u64>) {
        let had = self.host.contains(key);
        let Some(evicted) = self.host.insert(key) else {
            self.demote(key);
            return;
        };
        if !had {
            self.stored(Tier::Host, key, parent);
        }
        for victim in evicted {
            self.removed(Tier::Host, victim);
            self.demote(victim);
        }
    }

    /// Writes `key` to disk (or touches it there).
    fn demote(&mut self, key: u64) {
        let had = self.disk.contains(key);
        let Some(evicted) = self.disk.insert(key) else {
            return;
        };
        if !had {
            self.stored(Tier::Disk, key, None);
        }
        for victim in evicted {
            self.removed(Tier::Disk, victim);
        }
    }

    fn stored(&mut self, tier: Tier, key: u64, parent: Option<u64>) {
        self.outbox.push(KvEvent::Stored {
            keys: vec![BlockKey(key)],
            parent: parent.map(BlockKey),
            tier,
            lora: None,
            token_count: 0,
        });
    }

    fn removed(&mut self, tier: Tier, key: u64) {
        self.outbox.push(KvEvent::Removed {
            keys: vec![BlockKey(key)],
            tier,
        });
    }
}

/// One node's shared block store; cheap to clone (a handle).
#[derive(Debug, Clone)]
pub struct NodeStore {
    inner: Arc<Mutex<Inner>>,
    async_disk_loads: bool,
}

impl NodeStore {
    /// An empty store.
    pub fn new(config: NodeTierConfig) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                host: Lru::new(config.host_blocks),
                disk: Lru::new(config.disk_blocks),
                outbox: Vec::new(),
                stats: NodeStats::default(),
            })),
            async_disk_loads: config.async_disk_loads,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The residency changes since the last call, in order: the node's KV events.
    pub fn take_events(&self) -> Vec<KvEvent> {
        std::mem::take(&mut self.lock().outbox)
    }

    /// The counters and sizes.
    pub fn stats(&self) -> NodeStats {
        let g = self.lock();
        NodeStats {
            host_blocks: g.host.len(),
            disk_blocks: g.disk.len(),
            ..g.stats
        }
    }

    /// Engine `model`'s connector to this store (blocks of `block_size` tokens).
    pub fn connector(&self, model: &str, block_size: u32) -> NodeTier {
        NodeTier {
            store: self.clone(),
            model: model.to_owned(),
            block_size: block_size as usize,
            chains: HashMap::new(),
            async_disk_loads: self.async_disk_loads,
        }
    }
}

/// One engine's connector to its node's [`NodeStore`].
#[derive(Debug)]
pub struct NodeTier {
    store: NodeStore,
    model: String,
    block_size: usize,
    chains: HashMap<RequestId, KeyChain>,
    async_disk_loads: bool,
}

/// Request `id`'s kvgate keys for every full block of `tokens` (its chain kept in `chains`).
fn chain_keys<'c>(
    chains: &'c mut HashMap<RequestId, KeyChain>,
    model: &str,
    block_size: usize,
    id: RequestId,
    tokens: &[u32],
) -> &'c [BlockKey] {
    let chain = chains
        .entry(id)
        .or_insert_with(|| KeyChain::new(model, None, SaltStyle::VllmExtraKey, block_size));
    chain.advance(tokens);
    chain.keys()
}

impl OffloadTier for NodeTier {
    fn offload(&mut self, b: Offload<'_>, _events: &mut Vec<CacheEvent>) {
        let keys = chain_keys(
            &mut self.chains,
            &self.model,
            self.block_size,
            b.request,
            b.tokens,
        );
        let mut g = self.store.lock();
        for &i in b.indices {
            let Some(key) = keys.get(i).map(|k| k.0) else {
                continue;
            };
            let parent = i.checked_sub(1).and_then(|p| keys.get(p)).map(|k| k.0);
            g.store(key, parent);
            g.stats.offloaded += 1;
        }
    }

    /// kvgate's vLLM connector loads in the step that schedules the request; with
    /// [`NodeTierConfig::async_disk_loads`], only hits served from host memory alone.
    fn loads_in_step(&self, sources: &Sources) -> bool {
        !self.async_disk_loads || (sources.disk == 0 && sources.remote == 0)
    }

    /// The leading blocks the node holds, by level (a question: nothing moves).
    fn lookup(&mut self, r: LookupRequest<'_>) -> Lookup {
        let keys = chain_keys(
            &mut self.chains,
            &self.model,
            self.block_size,
            r.request,
            r.tokens,
        );
        let wanted = keys
            .get(r.first_block..r.first_block + r.hashes.len())
            .unwrap_or_default();
        let g = self.store.lock();
        let mut found = Sources::default();
        for key in wanted.iter().map(|k| k.0) {
            if g.host.contains(key) {
                found.host += 1;
            } else if g.disk.contains(key) {
                found.disk += 1;
            } else {
                break;
            }
        }
        Lookup::Found(found)
    }

    /// The onboard: host-memory blocks are touched, disk ones touched and promoted to host
    /// memory (the daemon serves the host ones at once, then reads the others).
    fn load_started(&mut self, r: LookupRequest<'_>, sources: Sources) {
        let keys = chain_keys(
            &mut self.chains,
            &self.model,
            self.block_size,
            r.request,
            r.tokens,
        );
        let wanted = keys
            .get(r.first_block..r.first_block + sources.blocks())
            .unwrap_or_default();
        let mut g = self.store.lock();
        let levels: Vec<bool> = wanted.iter().map(|k| g.host.contains(k.0)).collect();
        for (i, (key, &in_host)) in wanted.iter().map(|k| k.0).zip(&levels).enumerate() {
            if in_host {
                g.host.touch(key);
                g.stats.onboarded_host += 1;
            } else if g.disk.contains(key) {
                g.disk.touch(key);
                g.stats.onboarded_disk += 1;
                let parent = (r.first_block + i)
                    .checked_sub(1)
                    .and_then(|p| keys.get(p))
                    .map(|k| k.0);
                g.store(key, parent);
            }
        }
    }

    fn finished(&mut self, request: RequestId) {
        self.chains.remove(&request);
    }

    /// The node's blocks are not this engine's: a prefix-cache reset keeps them.
    fn clear(&mut self) {}

    fn len(&self) -> usize {
        0
    }

    fn hashes(&self) -> Vec<u64> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn keys(events: &[KvEvent], want: Tier, stored: bool) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Stored { keys, tier, .. } if stored && *tier == want => Some(keys[0].0),
                KvEvent::Removed { keys, tier } if !stored && *tier == want => Some(keys[0].0),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn hits_load_in_the_step_unless_disk_loads_wait() {
        let hit = |host, disk| Sources {
            host,
            disk,
            remote: 0,
        };
        for async_disk_loads in [false, true] {
            let store = NodeStore::new(NodeTierConfig {
                host_blocks: 2,
                disk_blocks: 2,
                async_disk_loads,
            });
            let tier = store.connector("m", 16);
            assert!(tier.loads_in_step(&hit(3, 0)));
            assert_eq!(tier.loads_in_step(&hit(3, 1)), !async_disk_loads);
            assert_eq!(tier.loads_in_step(&hit(0, 2)), !async_disk_loads);
        }
    }

    #[test]
    fn host_evictions_are_demoted_to_disk_and_disk_hits_promoted_back() {
        let store = NodeStore::new(NodeTierConfig {
            host_blocks: 2,
            disk_blocks: 3,
            async_disk_loads: false,
        });
        let mut g = store.lock();
        for k in [1, 2, 3, 4] {
            g.store(k, None);
        }
        drop(g);
        let ev = store.take_events();
        assert_eq!(keys(&ev, Tier::Host, true), [1, 2, 3, 4]);
        assert_eq!(keys(&ev, Tier::Host, false), [1, 2]);
        assert_eq!(keys(&ev, Tier::Disk, true), [1, 2]);
        let s = store.stats();
        assert_eq!((s.host_blocks, s.disk_blocks), (2, 2));
        // 1 is on disk only: storing it again promotes it, demoting 3.
        store.lock().store(1, None);
        let ev = store.take_events();
        assert_eq!(keys(&ev, Tier::Host, true), [1]);
        assert_eq!(keys(&ev, Tier::Host, false), [3]);
        assert_eq!(keys(&ev, Tier::Disk, true), [3]);
        // Disk full (1, 2, 3): the next demotion drops its least recent, 1 (an offload
        // stores into host memory without refreshing the disk copy; an onboard touches it).
        store.lock().store(5, None);
        let ev = store.take_events();
        assert_eq!(keys(&ev, Tier::Host, false), [4]);
        assert_eq!(keys(&ev, Tier::Disk, false), [1]);
    }

    #[test]
    fn without_host_memory_blocks_go_straight_to_disk() {
        let store = NodeStore::new(NodeTierConfig {
            host_blocks: 0,
            disk_blocks: 4,
            async_disk_loads: false,
        });
        store.lock().store(7, None);
        let ev = store.take_events();
        assert!(keys(&ev, Tier::Host, true).is_empty());
        assert_eq!(keys(&ev, Tier::Disk, true), [7]);
    }

    #[test]
    fn one_engines_offloads_are_another_engines_hits_by_level() {
        let store = NodeStore::new(NodeTierConfig {
            host_blocks: 2,
            disk_blocks: 8,
            async_disk_loads: false,
        });
        let mut a = store.connector("m", 2);
        let mut b = store.connector("m", 2);
        let tokens: Vec<u32> = (0..9).collect();
        let hashes = [10, 11, 12, 13];
        a.offload(
            Offload {
                request: 1,
                indices: &[0, 1, 2, 3],
                hashes: &hashes,
                tokens: &tokens,
            },
            &mut Vec::new(),
        );
        // Host memory keeps the last two blocks; the first two are on disk.
        let ask = LookupRequest {
            request: 7,
            first_block: 0,
            hashes: &hashes,
            tokens: &tokens,
        };
        let found = b.lookup(ask);
        assert_eq!(b.lookup(ask), found, "a lookup moves nothing");
        assert_eq!(store.stats().onboarded_disk, 0);
        assert_eq!(
            found,
            Lookup::Found(Sources {
                host: 2,
                disk: 2,
                remote: 0
            })
        );
        let Lookup::Found(sources) = found else {
            unreachable!()
        };
        b.load_started(ask, sources);
        let s = store.stats();
        assert_eq!((s.onboarded_host, s.onboarded_disk), (2, 2));
        // The two disk blocks were promoted: host memory (2 blocks) now holds them.
        assert_eq!(
            b.lookup(ask),
            Lookup::Found(Sources {
                host: 2,
                disk: 2,
                remote: 0
            })
        );
        // A chain that differs from block 1 on finds block 0 only.
        let mut other = tokens.clone();
        other[3] = 99;
        let found = b.lookup(LookupRequest {
            request: 8,
            first_block: 0,
            hashes: &hashes,
            tokens: &other,
        });
        assert!(matches!(found, Lookup::Found(s) if s.blocks() == 1));
        // Keys are the EPP's: the model seeds them.
        let mut c = store.connector("another-model", 2);
        let found = c.lookup(LookupRequest {
            request: 9,
            first_block: 0,
            hashes: &hashes,
            tokens: &tokens,
        });
        assert_eq!(found, Lookup::Found(Sources::default()));
        assert_eq!(store.stats().offloaded, 4);
    }
}
