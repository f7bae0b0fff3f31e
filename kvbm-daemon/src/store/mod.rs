//! The block store: the daemon's pure core. No I/O, no clock, no async.
//!
//! Two tiers in this build, both byte-budgeted and least-recently-used:
//!
//! - **host** (G2): the block bytes, in memory;
//! - **remote** (G4): an index of what this node wrote to the remote store (Redis); the bytes
//!   live there, and the store asks the edge to put, fetch and delete them through
//!   [`Effect`]s.
//!
//! Tiers are inclusive: a block promoted from remote to host stays in remote. A block the
//! host evicts is *demoted*: written to remote unless remote already has it (then it is only
//! touched there). Every change of residency is reported, in order, as a kvgate
//! [`KvEvent`] for the block's layout, so a receiver that applies the events in order holds
//! exactly the store's residency (a property test checks this).
//!
//! Every operation validates its whole input before it changes anything.

mod layout;
mod tier;

use bytes::Bytes;
use kv_events::{BlockKey, KvEvent, Tier};

use layout::Layouts;
pub use layout::{Layout, LayoutError, LayoutId, MAX_LAYOUTS, MAX_NAME_BYTES, MAX_SHARDS};
use tier::TierSet;

/// A block's address: its layout and its kvgate key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    /// The layout.
    pub layout: LayoutId,
    /// The kvgate key.
    pub key: BlockKey,
}

/// The store's budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// Host tier bytes; 0 disables the tier.
    pub host_bytes: u64,
    /// Remote tier bytes this node may occupy; 0 disables the tier.
    pub remote_bytes: u64,
}

/// What the edge must do after an operation, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Publish `event` on the layout's subject.
    Publish {
        /// The layout whose envelope carries it.
        layout: LayoutId,
        /// The event.
        event: KvEvent,
    },
    /// Write the block to the remote store.
    RemotePut {
        /// The block.
        id: BlockId,
        /// Its bytes.
        data: Bytes,
    },
    /// Delete the block from the remote store.
    RemoteDelete {
        /// The block.
        id: BlockId,
    },
}

/// Why an operation was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The layout id was never registered.
    #[error("unknown layout {0}")]
    UnknownLayout(u32),
    /// A block's size differs from its layout's.
    #[error("block {index} has {got} bytes; its layout's blocks have {want}")]
    BlockSize {
        /// The block's position in the request.
        index: usize,
        /// Its size.
        got: u64,
        /// The layout's block size.
        want: u64,
    },
    /// The layout could not be registered.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Where a block of an onboard request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// In host memory: here are its bytes.
    Host(Bytes),
    /// In the remote store only: the edge fetches it, then calls [`BlockStore::promote`] (or
    /// [`BlockStore::remote_lost`] when the remote store no longer has it).
    Remote,
}

/// How much of a chain the store holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Leading blocks present in host memory.
    pub host: u32,
    /// Leading blocks present in host memory or the remote store.
    pub any: u32,
}

/// What an offload did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offloaded {
    /// Blocks newly stored.
    pub stored: u32,
    /// Blocks the store already had (touched).
    pub present: u32,
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Blocks stored into host memory (offloads and promotions).
    pub host_stored: u64,
    /// Blocks evicted from host memory.
    pub host_evicted: u64,
    /// Host evictions written to the remote store.
    pub demoted: u64,
    /// Blocks stored into the remote store (demotions and direct offloads).
    pub remote_stored: u64,
    /// Blocks evicted from this node's remote budget.
    pub remote_evicted: u64,
    /// Remote blocks the remote store no longer had.
    pub remote_lost: u64,
    /// Onboard requests answered, and the blocks they found per tier.
    pub onboards: u64,
    /// Blocks onboarded from host memory.
    pub onboarded_host: u64,
    /// Blocks fetched from the remote store for an onboard ([`BlockStore::promote`] calls).
    pub onboarded_remote: u64,
}

/// A tier's occupancy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierUsage {
    /// Blocks held.
    pub blocks: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Byte budget.
    pub capacity: u64,
}

#[derive(Debug)]
struct HostBlock {
    data: Bytes,
    parent: Option<BlockKey>,
}

/// The store. See the module documentation.
#[derive(Debug)]
pub struct BlockStore {
    layouts: Layouts,
    host: TierSet<HostBlock>,
    remote: TierSet<Option<BlockKey>>,
    counters: StoreCounters,
}

/// Collects consecutive newly stored keys of one chain into as few `Stored` events as the
/// interleaved evictions allow.
struct Run {
    layout: LayoutId,
    tier: Tier,
    parent: Option<BlockKey>,
    keys: Vec<BlockKey>,
    token_count: u32,
}

impl Run {
    fn flush(&mut self, effects: &mut Vec<Effect>) {
        if self.keys.is_empty() {
            return;
        }
        let keys = std::mem::take(&mut self.keys);
        let token_count = self.token_count.saturating_mul(keys.len() as u32);
        let parent = self.parent;
        self.parent = keys.last().copied();
        effects.push(Effect::Publish {
            layout: self.layout,
            event: KvEvent::Stored {
                keys,
                parent,
                tier: self.tier,
                lora: None,
                token_count,
            },
        });
    }
}

/// The event of one block leaving `tier`.
fn removed(id: BlockId, tier: Tier) -> Effect {
    Effect::Publish {
        layout: id.layout,
        event: KvEvent::Removed {
            keys: vec![id.key],
            tier,
        },
    }
}

impl BlockStore {
    /// An empty store.
    pub fn new(config: StoreConfig) -> Self {
        Self {
            layouts: Layouts::default(),
            host: TierSet::new(config.host_bytes),
            remote: TierSet::new(config.remote_bytes),
            counters: StoreCounters::default(),
        }
    }

    /// Registers a layout (idempotent), refusing one whose blocks fit no tier.
    pub fn register(&mut self, layout: Layout) -> Result<LayoutId, StoreError> {
        let largest = self.host.capacity().max(self.remote.capacity());
        if layout.block_bytes > largest {
            return Err(LayoutError::TooLarge {
                block_bytes: layout.block_bytes,
                largest,
            }
            .into());
        }
        Ok(self.layouts.register(layout)?)
    }

    /// A registered layout.
    pub fn layout(&self, id: LayoutId) -> Option<&Layout> {
        self.layouts.get(id)
    }

    /// Every registered layout.
    pub fn layouts(&self) -> impl Iterator<Item = (LayoutId, &Layout)> {
        self.layouts.iter()
    }

    fn check_layout(&self, layout: LayoutId) -> Result<&Layout, StoreError> {
        self.layouts
            .get(layout)
            .ok_or(StoreError::UnknownLayout(layout.0))
    }

    /// Stores a chain of blocks (`parent` is the key before the first): into host memory, or
    /// straight into the remote store when host memory is disabled or the block cannot fit it.
    pub fn offload(
        &mut self,
        layout: LayoutId,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, Bytes)],
        effects: &mut Vec<Effect>,
    ) -> Result<Offloaded, StoreError> {
        let l = self.check_layout(layout)?;
        let (want, tokens) = (l.block_bytes, l.block_size);
        for (index, (_, data)) in blocks.iter().enumerate() {
            if data.len() as u64 != want {
                return Err(StoreError::BlockSize {
                    index,
                    got: data.len() as u64,
                    want,
                });
            }
        }
        let to_host = self.host.fits(want);
        let tier = if to_host { Tier::Host } else { Tier::Remote };
        let mut run = Run {
            layout,
            tier,
            parent,
            keys: Vec::new(),
            token_count: tokens,
        };
        let mut done = Offloaded::default();
        let mut before = parent;
        for (key, data) in blocks {
            let id = BlockId { layout, key: *key };
            let present = if to_host {
                self.host.touch(&id)
            } else {
                self.remote.touch(&id)
            };
            if present {
                done.present += 1;
                run.flush(effects);
                run.parent = Some(*key);
            } else {
                // Evictions (and their events) come before this block's Stored, so flush the
                // run first if room must be made.
                if to_host {
                    if self.host.free() < want {
                        run.flush(effects);
                        self.make_host_room(want, effects);
                    }
                    self.host.insert(
                        id,
                        want,
                        HostBlock {
                            data: data.clone(),
                            parent: before,
                        },
                    );
                    self.counters.host_stored += 1;
                } else {
                    if self.remote.free() < want {
                        run.flush(effects);
                        self.make_remote_room(want, effects);
                    }
                    self.remote.insert(id, want, before);
                    self.counters.remote_stored += 1;
                    effects.push(Effect::RemotePut {
                        id,
                        data: data.clone(),
                    });
                }
                run.keys.push(*key);
                done.stored += 1;
            }
            before = Some(*key);
        }
        run.flush(effects);
        Ok(done)
    }

    /// Evicts host blocks, least recently used first, until `bytes` fit; each is demoted.
    fn make_host_room(&mut self, bytes: u64, effects: &mut Vec<Effect>) {
        while self.host.free() < bytes {
            let Some(victim) = self.host.oldest() else {
                return;
            };
            let Some(gone) = self.host.remove(&victim) else {
                return;
            };
            self.counters.host_evicted += 1;
            effects.push(removed(victim, Tier::Host));
            self.demote(victim, gone.bytes, gone.value, effects);
        }
    }

    fn demote(&mut self, id: BlockId, bytes: u64, block: HostBlock, effects: &mut Vec<Effect>) {
        if self.remote.touch(&id) || !self.remote.fits(bytes) {
            return;
        }
        self.make_remote_room(bytes, effects);
        self.remote.insert(id, bytes, block.parent);
        self.counters.demoted += 1;
        self.counters.remote_stored += 1;
        effects.push(Effect::RemotePut {
            id,
            data: block.data,
        });
        effects.push(Effect::Publish {
            layout: id.layout,
            event: KvEvent::Stored {
                keys: vec![id.key],
                parent: block.parent,
                tier: Tier::Remote,
                lora: None,
                token_count: self.layouts.get(id.layout).map_or(0, |l| l.block_size),
            },
        });
    }

    fn make_remote_room(&mut self, bytes: u64, effects: &mut Vec<Effect>) {
        while self.remote.free() < bytes {
            let Some(victim) = self.remote.oldest() else {
                return;
            };
            self.remote.remove(&victim);
            self.counters.remote_evicted += 1;
            effects.push(Effect::RemoteDelete { id: victim });
            effects.push(removed(victim, Tier::Remote));
        }
    }

    /// How many leading blocks of `keys` the store holds (read only: recency is unchanged).
    pub fn lookup(&self, layout: LayoutId, keys: &[BlockKey]) -> Result<Lookup, StoreError> {
        self.check_layout(layout)?;
        let mut found = Lookup::default();
        let mut host_run = true;
        for key in keys {
            let id = BlockId { layout, key: *key };
            let in_host = self.host.contains(&id);
            if !in_host && !self.remote.contains(&id) {
                break;
            }
            host_run &= in_host;
            found.host += u32::from(host_run);
            found.any += 1;
        }
        Ok(found)
    }

    /// The leading blocks of `keys` the store holds, each with where it is; host blocks are
    /// touched. Remote blocks are fetched by the edge, which then calls
    /// [`BlockStore::promote`] or [`BlockStore::remote_lost`].
    pub fn onboard(
        &mut self,
        layout: LayoutId,
        keys: &[BlockKey],
    ) -> Result<Vec<Found>, StoreError> {
        self.check_layout(layout)?;
        let mut out = Vec::new();
        for key in keys {
            let id = BlockId { layout, key: *key };
            if self.host.touch(&id) {
                let data = self
                    .host
                    .get(&id)
                    .map(|b| b.value.data.clone())
                    .unwrap_or_default();
                out.push(Found::Host(data));
                self.counters.onboarded_host += 1;
            } else if self.remote.touch(&id) {
                out.push(Found::Remote);
            } else {
                break;
            }
        }
        self.counters.onboards += 1;
        Ok(out)
    }

    /// Copies a block fetched from the remote store into host memory (it stays in remote).
    /// Does nothing when host memory is disabled, the block is already there, or the remote
    /// index no longer has it (it was evicted while the fetch ran: the bytes are still good,
    /// but the store keeps to what it accounts).
    pub fn promote(
        &mut self,
        id: BlockId,
        data: Bytes,
        effects: &mut Vec<Effect>,
    ) -> Result<(), StoreError> {
        let want = self.check_layout(id.layout)?.block_bytes;
        if data.len() as u64 != want {
            return Err(StoreError::BlockSize {
                index: 0,
                got: data.len() as u64,
                want,
            });
        }
        // The fetch succeeded: it counts even if the block is not kept in host memory below.
        self.counters.onboarded_remote += 1;
        let Some(parent) = self.remote.get(&id).map(|r| r.value) else {
            return Ok(());
        };
        if !self.host.fits(want) || self.host.contains(&id) {
            return Ok(());
        }
        self.make_host_room(want, effects);
        self.host.insert(id, want, HostBlock { data, parent });
        self.counters.host_stored += 1;
        effects.push(Effect::Publish {
            layout: id.layout,
            event: KvEvent::Stored {
                keys: vec![id.key],
                parent,
                tier: Tier::Host,
                lora: None,
                token_count: self.layouts.get(id.layout).map_or(0, |l| l.block_size),
            },
        });
        Ok(())
    }

    /// The remote store no longer has `id` (evicted by its own memory policy, or deleted by
    /// someone else): forget it.
    pub fn remote_lost(&mut self, id: BlockId, effects: &mut Vec<Effect>) {
        if self.remote.remove(&id).is_some() {
            self.counters.remote_lost += 1;
            effects.push(removed(id, Tier::Remote));
        }
    }

    /// Drops every block of both tiers (the remote copies are deleted too).
    pub fn clear(&mut self, effects: &mut Vec<Effect>) {
        self.host.clear();
        for id in self.remote.clear() {
            effects.push(Effect::RemoteDelete { id });
        }
        for (layout, _) in self.layouts.iter() {
            effects.push(Effect::Publish {
                layout,
                event: KvEvent::Cleared { tier: None },
            });
        }
    }

    /// The keys of `layout` resident in `tier`, least recently used first (for snapshots).
    pub fn resident(&self, layout: LayoutId, tier: Tier) -> Vec<BlockKey> {
        let of = |id: BlockId| (id.layout == layout).then_some(id.key);
        match tier {
            Tier::Host => self.host.ids().filter_map(of).collect(),
            Tier::Remote => self.remote.ids().filter_map(of).collect(),
            Tier::Gpu | Tier::Disk => Vec::new(),
        }
    }

    /// Host memory occupancy.
    pub fn host_usage(&self) -> TierUsage {
        TierUsage {
            blocks: self.host.len() as u64,
            bytes: self.host.used(),
            capacity: self.host.capacity(),
        }
    }

    /// Remote occupancy (this node's share).
    pub fn remote_usage(&self) -> TierUsage {
        TierUsage {
            blocks: self.remote.len() as u64,
            bytes: self.remote.used(),
            capacity: self.remote.capacity(),
        }
    }

    /// Counters since start.
    pub fn counters(&self) -> StoreCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests;
