//! The per-pod normaliser: engine events in, kvgate events out.
//!
//! It computes kvgate keys from the token ids of `BlockStored` (continuing the chain from the
//! parent's key) and remembers, per engine hash, the key and the tiers holding it, so that
//! `BlockRemoved` and token-less stores into lower tiers resolve to keys. An entry is dropped
//! when its last tier removes it, and `AllBlocksCleared` drops the whole map, so memory follows
//! the engine's resident set. A configurable bound refuses growth beyond it (a stream that
//! lost its removals); the caller then resynchronises.

use crate::engine::{BlockRemoved, BlockStored, EngineEvent, EngineHash};
use crate::event::KvEvent;
use crate::fasthash::U64Map;
use crate::key::{BlockKey, KeyHasher, KeySeed};
use crate::tier::{Tier, TierSet, tier_of};

/// Static facts about the engine whose events are normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormalizerConfig {
    /// The served model name (the key seed when a block has no LoRA adapter).
    pub model: String,
    /// The engine's block size in tokens.
    pub block_size: u32,
    /// Most engine hashes remembered at once.
    pub max_resident: usize,
}

impl NormalizerConfig {
    /// A config with the default bound (4 Mi blocks, ~100 MiB).
    pub fn new(model: impl Into<String>, block_size: u32) -> Self {
        Self {
            model: model.into(),
            block_size,
            max_resident: 4 << 20,
        }
    }
}

/// Why an event could not be normalised. The event is not applied; earlier ones stay applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NormalizeError {
    /// The event's block size is not the engine's configured one.
    #[error("event block size {got} differs from the configured {expected}")]
    BlockSizeMismatch {
        /// Configured.
        expected: u32,
        /// In the event.
        got: u32,
    },
    /// `token_ids` does not cover exactly the published blocks.
    #[error("{tokens} token ids for {blocks} blocks of {block_size}")]
    TokenCountMismatch {
        /// Blocks in the event.
        blocks: usize,
        /// Tokens in the event.
        tokens: usize,
        /// Tokens per block.
        block_size: u32,
    },
    /// `extra_keys` does not have one entry per block.
    #[error("{extra} extra-key entries for {blocks} blocks")]
    ExtraKeysMismatch {
        /// Blocks in the event.
        blocks: usize,
        /// Entries in `extra_keys`.
        extra: usize,
    },
    /// The parent block was never seen, so the chain cannot be continued.
    #[error("parent block {0:?} is unknown; the stream must be resynchronised")]
    UnknownParent(EngineHash),
    /// The configured bound on remembered blocks was reached.
    #[error("more than {0} resident blocks; the stream must be resynchronised")]
    CapacityExceeded(usize),
}

impl NormalizeError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            NormalizeError::BlockSizeMismatch { .. } => "block_size_mismatch",
            NormalizeError::TokenCountMismatch { .. } => "token_count_mismatch",
            NormalizeError::ExtraKeysMismatch { .. } => "extra_keys_mismatch",
            NormalizeError::UnknownParent(_) => "unknown_parent",
            NormalizeError::CapacityExceeded(_) => "capacity_exceeded",
        }
    }
}

/// Counters of what the normaliser has done, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NormalizeStats {
    /// Blocks stored (one per block per tier).
    pub stored_blocks: u64,
    /// Blocks removed.
    pub removed_blocks: u64,
    /// Removals of blocks never seen stored (e.g. stored before the subscription started).
    pub unknown_removed: u64,
    /// Token-less stores of blocks never seen with tokens (cannot be keyed; skipped).
    pub unresolved_stored: u64,
    /// `AllBlocksCleared` events.
    pub clears: u64,
    /// Event types this version does not know (skipped).
    pub unknown_events: u64,
}

/// What the normaliser knows of one engine hash: its key, its tiers, and how many GPU copies
/// of it the engine holds. vLLM does not de-duplicate its GPU cache: two blocks computed with
/// the same content are both cached under one hash, each with its own `BlockStored` and, when
/// evicted, its own `BlockRemoved`; the block stays on the GPU until its last copy goes.
/// Lower tiers hold one copy per hash (offloading connectors store a block once), so a repeated
/// store there changes nothing and one removal ends the residency.
#[derive(Debug, Clone, Copy)]
struct Resident {
    key: BlockKey,
    tiers: TierSet,
    /// Copies per tier (`Tier::index`), saturating.
    copies: [u16; 4],
}

impl Resident {
    fn new(key: BlockKey) -> Self {
        Self {
            key,
            tiers: TierSet::EMPTY,
            copies: [0; 4],
        }
    }

    fn add(&mut self, tier: Tier) {
        self.tiers.insert(tier);
        if let Some(c) = self.copies.get_mut(tier.index()) {
            *c = if tier == Tier::Gpu {
                c.saturating_add(1)
            } else {
                1
            };
        }
    }

    /// Drops one copy in `tier`: `None` if the tier held none, else whether it was the last.
    fn drop_copy(&mut self, tier: Tier) -> Option<bool> {
        if !self.tiers.contains(tier) {
            return None;
        }
        let c = self.copies.get_mut(tier.index())?;
        *c = c.saturating_sub(1);
        if *c == 0 {
            self.tiers.remove(tier);
            Some(true)
        } else {
            Some(false)
        }
    }
}

/// Normalises one engine's (one pod × one DP rank's) event stream.
#[derive(Debug)]
pub struct Normalizer {
    config: NormalizerConfig,
    model_seed: KeySeed,
    hasher: KeyHasher,
    resident: U64Map<EngineHash, Resident>,
    stats: NormalizeStats,
}

impl Normalizer {
    /// A normaliser with an empty map.
    pub fn new(config: NormalizerConfig) -> Self {
        let model_seed = KeySeed::new(&config.model, None);
        Self {
            config,
            model_seed,
            hasher: KeyHasher::new(),
            resident: U64Map::default(),
            stats: NormalizeStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> NormalizeStats {
        self.stats
    }

    /// Engine hashes currently remembered.
    pub fn resident_len(&self) -> usize {
        self.resident.len()
    }

    /// The kvgate key the engine hash maps to, if it is resident in some tier.
    pub fn key_of(&self, hash: EngineHash) -> Option<BlockKey> {
        self.resident.get(&hash).map(|r| r.key)
    }

    /// Every resident (key, tier) pair, in no particular order (for snapshots).
    pub fn resident(&self) -> impl Iterator<Item = (BlockKey, Tier)> + '_ {
        self.resident.values().flat_map(|r| {
            Tier::ALL
                .into_iter()
                .filter(|t| r.tiers.contains(*t))
                .map(|t| (r.key, t))
        })
    }

    /// Forgets everything (after a resynchronisation, or a restart of the engine).
    pub fn reset(&mut self) {
        self.resident = U64Map::default();
    }

    /// Normalises one event, appending the resulting kvgate events to `out`.
    pub fn apply(
        &mut self,
        event: &EngineEvent,
        out: &mut Vec<KvEvent>,
    ) -> Result<(), NormalizeError> {
        match event {
            EngineEvent::BlockStored(s) if s.token_ids.is_empty() => {
                self.store_tokenless(s, out);
                Ok(())
            }
            EngineEvent::BlockStored(s) => self.store(s, out),
            EngineEvent::BlockRemoved(r) => {
                self.remove(r, out);
                Ok(())
            }
            EngineEvent::AllBlocksCleared => {
                self.stats.clears += 1;
                self.reset();
                out.push(KvEvent::Cleared { tier: None });
                Ok(())
            }
            EngineEvent::Unknown { .. } => {
                self.stats.unknown_events += 1;
                Ok(())
            }
        }
    }

    fn store(&mut self, s: &BlockStored, out: &mut Vec<KvEvent>) -> Result<(), NormalizeError> {
        let bs = self.config.block_size;
        if s.block_size != bs {
            return Err(NormalizeError::BlockSizeMismatch {
                expected: bs,
                got: s.block_size,
            });
        }
        let blocks = s.block_hashes.len();
        if s.token_ids.len() != blocks * bs as usize {
            return Err(NormalizeError::TokenCountMismatch {
                blocks,
                tokens: s.token_ids.len(),
                block_size: bs,
            });
        }
        if let Some(extra) = &s.extra_keys
            && extra.len() != blocks
        {
            return Err(NormalizeError::ExtraKeysMismatch {
                blocks,
                extra: extra.len(),
            });
        }
        let parent = match s.parent_block_hash {
            None => None,
            Some(h) => Some(self.key_of(h).ok_or(NormalizeError::UnknownParent(h))?),
        };
        let new_entries = s
            .block_hashes
            .iter()
            .filter(|h| !self.resident.contains_key(h))
            .count();
        if self.resident.len() + new_entries > self.config.max_resident {
            return Err(NormalizeError::CapacityExceeded(self.config.max_resident));
        }
        let seed = match &s.lora_name {
            Some(lora) => KeySeed::new(lora, s.cache_salt.as_deref()),
            None if s.cache_salt.is_some() => {
                KeySeed::new(&self.config.model, s.cache_salt.as_deref())
            }
            None => self.model_seed,
        };
        let tier = tier_of(s.medium);
        let mut prev = parent.map_or(seed.0, |k| k.0);
        let mut keys = Vec::with_capacity(blocks);
        for (i, (hash, tokens)) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs as usize))
            .enumerate()
        {
            let extra = s
                .extra_keys
                .as_ref()
                .and_then(|e| e.get(i))
                .and_then(Option::as_ref);
            let key = self
                .hasher
                .next(prev, tokens, extra.map(|r| r.0.as_slice()));
            prev = key.0;
            keys.push(key);
            self.remember(*hash, key, tier, out);
        }
        self.stats.stored_blocks += blocks as u64;
        out.push(KvEvent::Stored {
            keys,
            parent,
            tier,
            lora: s.lora_name.clone(),
            token_count: u32::try_from(s.token_ids.len()).unwrap_or(u32::MAX),
        });
        Ok(())
    }

    /// Records `hash → key` in `tier`. If the hash was known under another key (the engine
    /// reused a hash for other content, e.g. after a restart with a new seed), the old key's
    /// residency is withdrawn first so no holder is left behind in the index.
    fn remember(&mut self, hash: EngineHash, key: BlockKey, tier: Tier, out: &mut Vec<KvEvent>) {
        let entry = self.resident.entry(hash).or_insert(Resident::new(key));
        if entry.key != key {
            for t in Tier::ALL {
                if entry.tiers.contains(t) {
                    out.push(KvEvent::Removed {
                        keys: vec![entry.key],
                        tier: t,
                    });
                }
            }
            *entry = Resident::new(key);
        }
        entry.add(tier);
    }

    fn store_tokenless(&mut self, s: &BlockStored, out: &mut Vec<KvEvent>) {
        let tier = tier_of(s.medium);
        let mut keys = Vec::with_capacity(s.block_hashes.len());
        for hash in &s.block_hashes {
            match self.resident.get_mut(hash) {
                Some(r) => {
                    r.add(tier);
                    keys.push(r.key);
                }
                None => self.stats.unresolved_stored += 1,
            }
        }
        if keys.is_empty() {
            return;
        }
        self.stats.stored_blocks += keys.len() as u64;
        let parent = s.parent_block_hash.and_then(|h| self.key_of(h));
        out.push(KvEvent::Stored {
            keys,
            parent,
            tier,
            lora: s.lora_name.clone(),
            token_count: 0,
        });
    }

    fn remove(&mut self, r: &BlockRemoved, out: &mut Vec<KvEvent>) {
        let tier = tier_of(r.medium);
        let mut keys = Vec::with_capacity(r.block_hashes.len());
        for hash in &r.block_hashes {
            let Some(entry) = self.resident.get_mut(hash) else {
                self.stats.unknown_removed += 1;
                continue;
            };
            match entry.drop_copy(tier) {
                None => {
                    self.stats.unknown_removed += 1;
                    continue;
                }
                // Another copy is still cached: the block stays.
                Some(false) => continue,
                Some(true) => {}
            }
            keys.push(entry.key);
            if entry.tiers.is_empty() {
                self.resident.remove(hash);
            }
        }
        self.shrink_if_sparse();
        if !keys.is_empty() {
            self.stats.removed_blocks += keys.len() as u64;
            out.push(KvEvent::Removed { keys, tier });
        }
    }

    /// Gives memory back once the map is less than a quarter full.
    fn shrink_if_sparse(&mut self) {
        let cap = self.resident.capacity();
        if cap > 1024 && self.resident.len() * 4 < cap {
            self.resident.shrink_to(self.resident.len() * 2);
        }
    }
}
