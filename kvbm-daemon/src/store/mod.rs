//! The block store: the daemon's pure core. No I/O, no clock, no async.
//!
//! Three tiers, each byte-budgeted and least-recently-used:
//!
//! - **host** (G2): the block bytes, in memory;
//! - **disk** (G3): an index of the blocks this daemon wrote to its disk directory;
//! - **remote** (G4): an index of what this node wrote to the remote store (Redis).
//!
//! The bytes of the two lower tiers live outside the store; it asks the edge to write,
//! read and delete them through [`Effect`]s.
//!
//! Tiers are inclusive: a block promoted from a lower tier to host memory stays where it
//! was. A block the host evicts is *demoted*: written to every lower tier that does not have
//! it yet (and touched in those that do), so the disk keeps a fast local copy and the remote
//! store a large one; a lower tier's own evictions are dropped. Every change of residency
//! is reported, in order, as a kvgate [`KvEvent`] for the block's layout, so a receiver that
//! applies the events in order holds exactly the store's residency (a property test checks
//! this).
//!
//! **Disk admission.** With [`StoreConfig::disk_min_uses`] above 0, a block goes to disk
//! only once it was used (offloaded or onboarded) that many times, as a frequency sketch
//! estimates, so blocks used once do not wear the disk; Redis takes them either way. With
//! [`StoreConfig::disk_write_through`], a block stored in host memory is written to disk at
//! once (if admitted), instead of when host memory evicts it.
//!
//! **Pins.** A connector can pin the leading blocks of a chain it found (between a lookup and
//! the onboard that loads them) until a deadline: a pinned block is not evicted from any tier.
//! The store has no clock: deadlines are plain numbers, and the edge expires pins
//! ([`BlockStore::expire_pins`]) with its own clock before each operation. Pins are bounded
//! in number ([`StoreConfig::max_pins`]). When pinned blocks leave a tier too little room, a
//! new block is not stored there and nothing is evicted for it: an offload into host memory
//! full of pinned blocks stores the block straight into the lower tiers, and counts it
//! `skipped` only when none takes it.
//!
//! Every operation validates its whole input before it changes anything.

mod layout;
mod sketch;
mod tier;

use std::collections::HashMap;

use bytes::Bytes;
use kv_events::{BlockKey, KvEvent, Tier};

use layout::Layouts;
pub use layout::{Layout, LayoutError, LayoutId, MAX_LAYOUTS, MAX_NAME_BYTES, MAX_SHARDS};
use sketch::Sketch;
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
    /// Disk tier bytes; 0 disables the tier.
    pub disk_bytes: u64,
    /// Remote tier bytes this node may occupy; 0 disables the tier.
    pub remote_bytes: u64,
    /// Blocks pinned at once at most.
    pub max_pins: usize,
    /// Uses (offloads and onboards, as estimated) a block needs before it is written to
    /// disk; 0 admits every block.
    pub disk_min_uses: u8,
    /// Write blocks to disk when host memory stores them, not when it evicts them.
    pub disk_write_through: bool,
}

/// The tiers below host memory, in the order an onboard searches them.
pub const LOWER_TIERS: [Tier; 2] = [Tier::Disk, Tier::Remote];

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
    /// Write the block to a lower tier ([`Tier::Disk`] or [`Tier::Remote`]).
    Write {
        /// The tier.
        tier: Tier,
        /// The block.
        id: BlockId,
        /// Its bytes.
        data: Bytes,
    },
    /// Delete the block from a lower tier.
    Delete {
        /// The tier.
        tier: Tier,
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
    /// On disk (and not in host memory): the edge reads it, then calls
    /// [`BlockStore::promote`] (or [`BlockStore::lost`] when the file is gone).
    Disk,
    /// In the remote store only: the edge fetches it, then calls [`BlockStore::promote`] (or
    /// [`BlockStore::lost`] when the remote store no longer has it).
    Remote,
}

/// How much of a chain the store holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Leading blocks present in host memory.
    pub host: u32,
    /// Leading blocks present in any tier.
    pub any: u32,
}

/// What an offload did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offloaded {
    /// Blocks newly stored.
    pub stored: u32,
    /// Blocks the store already had (touched).
    pub present: u32,
    /// Blocks not stored: pinned blocks left their tier too little room.
    pub skipped: u32,
}

/// A lower tier's counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LowerCounters {
    /// Blocks stored into the tier (demotions and direct offloads).
    pub stored: u64,
    /// Blocks evicted from the tier's budget.
    pub evicted: u64,
    /// Blocks the edge found gone (a missing file, a key Redis evicted, a failed write).
    pub lost: u64,
    /// Blocks read back from the tier for an onboard ([`BlockStore::promote`] calls).
    pub onboarded: u64,
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Blocks stored into host memory (offloads and promotions).
    pub host_stored: u64,
    /// Blocks evicted from host memory.
    pub host_evicted: u64,
    /// Host evictions written to at least one lower tier.
    pub demoted: u64,
    /// Onboard requests answered.
    pub onboards: u64,
    /// Blocks an offload could not store because pinned blocks filled their tier.
    pub skipped: u64,
    /// Pins that expired before being released.
    pub pins_expired: u64,
    /// Blocks the disk's admission filter kept off the disk (used too few times).
    pub disk_rejected: u64,
    /// Blocks onboarded from host memory.
    pub onboarded_host: u64,
    /// The disk tier's.
    pub disk: LowerCounters,
    /// The remote tier's.
    pub remote: LowerCounters,
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
    /// Disk, then remote (as [`LOWER_TIERS`]).
    lower: [Lower; 2],
    /// Pinned blocks and their deadlines (in the edge's clock).
    pins: Pins,
    /// Block uses, for the disk's admission filter (when it is on).
    uses: Option<Sketch>,
    disk_min_uses: u8,
    disk_write_through: bool,
    counters: StoreCounters,
    /// Blocks held in at least one tier: counted when a block enters a tier while no other
    /// holds it, and uncounted when one leaves the last tier holding it ([`settle`]).
    distinct: u64,
}

/// Whether any tier holds `id`.
fn held(host: &TierSet<HostBlock>, lower: &[Lower; 2], id: &BlockId) -> bool {
    host.contains(id) || lower.iter().any(|l| l.set.contains(id))
}

/// Uncounts, from `distinct`, the blocks of `left` (each just removed from one tier) that no
/// tier holds any more. Run right after each removal, so that a block leaving two tiers in one
/// operation is uncounted once, when it leaves the second.
fn settle(
    distinct: &mut u64,
    host: &TierSet<HostBlock>,
    lower: &[Lower; 2],
    left: impl IntoIterator<Item = BlockId>,
) {
    for id in left {
        if !held(host, lower, &id) {
            *distinct = distinct.saturating_sub(1);
        }
    }
}

/// Pinned blocks: not evicted from any tier until their deadline.
#[derive(Debug)]
struct Pins {
    /// Per pinned block: how many pins hold it, and the latest deadline among them.
    held: HashMap<BlockId, Pin>,
    max: usize,
    /// No pin expires before this (a lower bound, so most operations skip the expiry scan).
    next_expiry: u64,
}

/// The pins on one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pin {
    count: u32,
    until: u64,
}

impl Pins {
    fn contains(&self, id: &BlockId) -> bool {
        self.held.contains_key(id)
    }
}

/// A lower tier: an index of blocks whose bytes live at the edge (each block's value is its
/// parent key), and its counters.
#[derive(Debug)]
struct Lower {
    tier: Tier,
    set: TierSet<Option<BlockKey>>,
    counters: LowerCounters,
}

impl Lower {
    fn new(tier: Tier, capacity: u64) -> Self {
        Self {
            tier,
            set: TierSet::new(capacity),
            counters: LowerCounters::default(),
        }
    }

    /// Evicts least recently used unpinned blocks until `bytes` fit, deleting their copies
    /// and adding them to `evicted`; false (and nothing evicted) when pinned blocks leave too
    /// little room.
    fn make_room(
        &mut self,
        bytes: u64,
        pins: &Pins,
        evicted: &mut Vec<BlockId>,
        effects: &mut Vec<Effect>,
    ) -> bool {
        let Some(victims) = self.set.victims(bytes, |id| pins.contains(id)) else {
            return false;
        };
        for victim in victims {
            self.set.remove(&victim);
            evicted.push(victim);
            self.counters.evicted += 1;
            effects.push(Effect::Delete {
                tier: self.tier,
                id: victim,
            });
            effects.push(removed(victim, self.tier));
        }
        true
    }

    /// Inserts a block the tier lacks, with its write, once [`Lower::make_room`] made room
    /// (the caller publishes its `Stored`).
    fn insert(
        &mut self,
        id: BlockId,
        bytes: u64,
        parent: Option<BlockKey>,
        data: &Bytes,
        effects: &mut Vec<Effect>,
    ) {
        self.set.insert(id, bytes, parent);
        self.counters.stored += 1;
        effects.push(Effect::Write {
            tier: self.tier,
            id,
            data: data.clone(),
        });
    }
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
    fn new(layout: LayoutId, tier: Tier, parent: Option<BlockKey>, token_count: u32) -> Self {
        Self {
            layout,
            tier,
            parent,
            keys: Vec::new(),
            token_count,
        }
    }

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

    /// `key` was already there: the run breaks, and the next stored block follows `key`.
    fn skip(&mut self, key: BlockKey, effects: &mut Vec<Effect>) {
        self.flush(effects);
        self.parent = Some(key);
    }
}

/// What storing a block straight into the lower tiers did.
enum Lowered {
    /// A tier took it.
    Stored,
    /// None took it, and one had it.
    Present,
    /// None has it: `no_room` when pinned blocks left a tier too little room.
    Skipped { no_room: bool },
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
            lower: [
                Lower::new(Tier::Disk, config.disk_bytes),
                Lower::new(Tier::Remote, config.remote_bytes),
            ],
            pins: Pins {
                held: HashMap::new(),
                max: config.max_pins,
                next_expiry: u64::MAX,
            },
            uses: (config.disk_min_uses > 0).then(|| Sketch::new(1 << 16)),
            disk_min_uses: config.disk_min_uses,
            disk_write_through: config.disk_write_through,
            counters: StoreCounters::default(),
            distinct: 0,
        }
    }

    /// Registers a layout (idempotent), refusing one whose blocks fit no tier.
    pub fn register(&mut self, layout: Layout) -> Result<LayoutId, StoreError> {
        let largest = self
            .lower
            .iter()
            .map(|l| l.set.capacity())
            .fold(self.host.capacity(), u64::max);
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

    /// Counts a use of `id` for the disk's admission filter.
    fn record_use(&mut self, id: &BlockId) {
        if let Some(uses) = &mut self.uses {
            uses.record(id);
        }
    }

    /// Whether `tier` takes `id` now: the disk only once the block was used often enough.
    fn admits(
        uses: Option<&Sketch>,
        min: u8,
        tier: Tier,
        id: &BlockId,
        rejected: &mut u64,
    ) -> bool {
        let ok = tier != Tier::Disk || uses.is_none_or(|u| u.estimate(id) >= min);
        if !ok {
            *rejected += 1;
        }
        ok
    }

    fn lower(&self, tier: Tier) -> Option<&Lower> {
        self.lower.iter().find(|l| l.tier == tier)
    }

    fn lower_mut(&mut self, tier: Tier) -> Option<&mut Lower> {
        self.lower.iter_mut().find(|l| l.tier == tier)
    }

    /// Stores a chain of blocks (`parent` is the key before the first): into host memory, or,
    /// when host memory is disabled or a block cannot fit it, straight into every lower tier
    /// it fits.
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
        for (key, _) in blocks {
            self.record_use(&BlockId { layout, key: *key });
        }
        Ok(if self.host.fits(want) {
            self.offload_host(layout, parent, blocks, (want, tokens), effects)
        } else {
            self.offload_lower(layout, parent, blocks, (want, tokens), effects)
        })
    }

    fn offload_host(
        &mut self,
        layout: LayoutId,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, Bytes)],
        (want, tokens): (u64, u32),
        effects: &mut Vec<Effect>,
    ) -> Offloaded {
        let mut run = Run::new(layout, Tier::Host, parent, tokens);
        let mut lower_runs = LOWER_TIERS.map(|tier| Run::new(layout, tier, parent, tokens));
        let mut done = Offloaded::default();
        let mut before = parent;
        for (key, data) in blocks {
            let id = BlockId { layout, key: *key };
            if self.host.touch(&id) {
                done.present += 1;
                run.skip(*key, effects);
            } else {
                // Evictions (and their events) come before this block's Stored, so flush the
                // run first if room must be made.
                if self.host.free() < want {
                    // Evictions demote into the lower tiers: their pending Stored events go
                    // first.
                    run.flush(effects);
                    for r in &mut lower_runs {
                        r.flush(effects);
                    }
                    if !self.make_host_room(want, effects) {
                        // Pinned blocks fill host memory: the block goes where it fits below.
                        // The lower runs are empty (flushed above); they follow the chain.
                        run.skip(*key, effects);
                        for r in &mut lower_runs {
                            r.parent = before;
                        }
                        match self.store_lower(id, before, data, want, &mut lower_runs, effects) {
                            Lowered::Stored => done.stored += 1,
                            Lowered::Present => done.present += 1,
                            Lowered::Skipped { .. } => {
                                done.skipped += 1;
                                self.counters.skipped += 1;
                            }
                        }
                        before = Some(*key);
                        continue;
                    }
                }
                if !self.lower.iter().any(|l| l.set.contains(&id)) {
                    self.distinct += 1;
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
                run.keys.push(*key);
                done.stored += 1;
            }
            // Stored (or already) in host memory: with write-through, on disk too.
            if self.disk_write_through {
                let [disk_run, _] = &mut lower_runs;
                self.write_through(id, before, data, disk_run, effects);
            }
            before = Some(*key);
        }
        run.flush(effects);
        for r in &mut lower_runs {
            r.flush(effects);
        }
        done
    }

    /// Writes a block that host memory just stored (or had) to disk as well (touches it
    /// there if present), when the disk admits it and has room.
    fn write_through(
        &mut self,
        id: BlockId,
        parent: Option<BlockKey>,
        data: &Bytes,
        run: &mut Run,
        effects: &mut Vec<Effect>,
    ) {
        let bytes = data.len() as u64;
        let (uses, min) = (self.uses.as_ref(), self.disk_min_uses);
        let [disk, _] = &mut self.lower;
        if !disk.set.fits(bytes) || disk.set.touch(&id) {
            run.skip(id.key, effects);
            return;
        }
        if !Self::admits(uses, min, Tier::Disk, &id, &mut self.counters.disk_rejected) {
            run.skip(id.key, effects);
            return;
        }
        if disk.set.free() < bytes {
            run.flush(effects);
        }
        let mut evicted = Vec::new();
        let room = disk.make_room(bytes, &self.pins, &mut evicted, effects);
        settle(
            &mut self.distinct,
            &self.host,
            &self.lower,
            evicted.drain(..),
        );
        if !room {
            run.skip(id.key, effects);
            return;
        }
        // Host memory holds the block: the count does not change.
        let [disk, _] = &mut self.lower;
        disk.insert(id, bytes, parent, data, effects);
        run.keys.push(id.key);
    }

    /// Stores straight into the lower tiers a block fits: a block counts as stored when one
    /// of them took it, present when one had it, skipped otherwise.
    fn offload_lower(
        &mut self,
        layout: LayoutId,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, Bytes)],
        (want, tokens): (u64, u32),
        effects: &mut Vec<Effect>,
    ) -> Offloaded {
        let mut runs = LOWER_TIERS.map(|tier| Run::new(layout, tier, parent, tokens));
        let mut done = Offloaded::default();
        let mut before = parent;
        for (key, data) in blocks {
            let id = BlockId { layout, key: *key };
            match self.store_lower(id, before, data, want, &mut runs, effects) {
                Lowered::Stored => done.stored += 1,
                Lowered::Present => done.present += 1,
                Lowered::Skipped { no_room } => {
                    // Pinned blocks left no room, or the disk (the only tier with room) did
                    // not admit it yet: only the first is counted here, the filter counts
                    // its own.
                    done.skipped += 1;
                    self.counters.skipped += u64::from(no_room);
                }
            }
            before = Some(*key);
        }
        for run in &mut runs {
            run.flush(effects);
        }
        done
    }

    /// Stores one block straight into every lower tier that fits and admits it (touching it
    /// where present).
    fn store_lower(
        &mut self,
        id: BlockId,
        before: Option<BlockKey>,
        data: &Bytes,
        want: u64,
        runs: &mut [Run; 2],
        effects: &mut Vec<Effect>,
    ) -> Lowered {
        let key = id.key;
        let (mut stored, mut present, mut no_room) = (false, false, false);
        let was_held = held(&self.host, &self.lower, &id);
        let mut evicted = Vec::new();
        let (uses, min) = (self.uses.as_ref(), self.disk_min_uses);
        for (i, run) in runs.iter_mut().enumerate() {
            let Some(lower) = self.lower.get_mut(i) else {
                continue;
            };
            if !lower.set.fits(want) {
                continue;
            }
            if lower.set.touch(&id) {
                present = true;
                run.skip(key, effects);
                continue;
            }
            if !Self::admits(uses, min, lower.tier, &id, &mut self.counters.disk_rejected) {
                run.skip(key, effects);
                continue;
            }
            if lower.set.free() < want {
                run.flush(effects);
            }
            let room = lower.make_room(want, &self.pins, &mut evicted, effects);
            settle(
                &mut self.distinct,
                &self.host,
                &self.lower,
                evicted.drain(..),
            );
            if !room {
                no_room = true;
                run.skip(key, effects);
                continue;
            }
            let Some(lower) = self.lower.get_mut(i) else {
                continue;
            };
            lower.insert(id, want, before, data, effects);
            run.keys.push(key);
            stored = true;
        }
        if stored && !was_held {
            self.distinct += 1;
        }
        if stored {
            Lowered::Stored
        } else if present {
            Lowered::Present
        } else {
            Lowered::Skipped { no_room }
        }
    }

    /// Evicts unpinned host blocks, least recently used first, until `bytes` fit; each is
    /// demoted. False (and nothing evicted) when pinned blocks leave too little room.
    fn make_host_room(&mut self, bytes: u64, effects: &mut Vec<Effect>) -> bool {
        let pins = &self.pins;
        let Some(victims) = self.host.victims(bytes, |id| pins.contains(id)) else {
            return false;
        };
        for victim in victims {
            let Some(gone) = self.host.remove(&victim) else {
                continue;
            };
            self.counters.host_evicted += 1;
            effects.push(removed(victim, Tier::Host));
            self.demote(victim, gone.bytes, &gone.value, effects);
            // Demoted, it is still held; dropped, it leaves the count.
            settle(&mut self.distinct, &self.host, &self.lower, [victim]);
        }
        true
    }

    /// Writes a block leaving host memory to every lower tier that fits it and lacks it.
    fn demote(&mut self, id: BlockId, bytes: u64, block: &HostBlock, effects: &mut Vec<Effect>) {
        let token_count = self.layouts.get(id.layout).map_or(0, |l| l.block_size);
        let mut written = false;
        let mut evicted = Vec::new();
        let (uses, min) = (self.uses.as_ref(), self.disk_min_uses);
        for i in 0..self.lower.len() {
            let Some(lower) = self.lower.get_mut(i) else {
                continue;
            };
            if lower.set.touch(&id)
                || !lower.set.fits(bytes)
                || !Self::admits(uses, min, lower.tier, &id, &mut self.counters.disk_rejected)
            {
                continue;
            }
            let room = lower.make_room(bytes, &self.pins, &mut evicted, effects);
            settle(
                &mut self.distinct,
                &self.host,
                &self.lower,
                evicted.drain(..),
            );
            let Some(lower) = self.lower.get_mut(i).filter(|_| room) else {
                continue;
            };
            lower.insert(id, bytes, block.parent, &block.data, effects);
            written = true;
            effects.push(Effect::Publish {
                layout: id.layout,
                event: KvEvent::Stored {
                    keys: vec![id.key],
                    parent: block.parent,
                    tier: lower.tier,
                    lora: None,
                    token_count,
                },
            });
        }
        if written {
            self.counters.demoted += 1;
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
            if !in_host && !self.lower.iter().any(|l| l.set.contains(&id)) {
                break;
            }
            host_run &= in_host;
            found.host += u32::from(host_run);
            found.any += 1;
        }
        Ok(found)
    }

    /// The leading blocks of `keys` the store holds, each with where it is (host memory
    /// first, then disk, then remote); the tier that has it is touched. Lower-tier blocks
    /// are read by the edge, which then calls [`BlockStore::promote`] or
    /// [`BlockStore::lost`].
    pub fn onboard(
        &mut self,
        layout: LayoutId,
        keys: &[BlockKey],
    ) -> Result<Vec<Found>, StoreError> {
        self.check_layout(layout)?;
        let mut out = Vec::new();
        for key in keys {
            let id = BlockId { layout, key: *key };
            if self.host.contains(&id) || self.lower.iter().any(|l| l.set.contains(&id)) {
                self.record_use(&id);
            }
            if self.host.touch(&id) {
                let data = self
                    .host
                    .get(&id)
                    .map(|b| b.value.data.clone())
                    .unwrap_or_default();
                out.push(Found::Host(data));
                self.counters.onboarded_host += 1;
            } else {
                // Disk before remote: the first lower tier that has it serves it.
                match self
                    .lower
                    .iter_mut()
                    .find_map(|l| l.set.touch(&id).then_some(l.tier))
                {
                    Some(Tier::Disk) => out.push(Found::Disk),
                    Some(_) => out.push(Found::Remote),
                    None => break,
                }
            }
        }
        self.counters.onboards += 1;
        Ok(out)
    }

    /// Copies a block read back from a lower tier (`from`) into host memory (it stays where
    /// it was). Does nothing when host memory is disabled, the block is already there, or
    /// `from`'s index no longer has it (it was evicted while the read ran: the bytes are
    /// still good, but the store keeps to what it accounts).
    pub fn promote(
        &mut self,
        id: BlockId,
        from: Tier,
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
        let Some(lower) = self.lower_mut(from) else {
            return Ok(());
        };
        // The read succeeded: it counts even if the block is not kept in host memory below.
        lower.counters.onboarded += 1;
        let Some(parent) = lower.set.get(&id).map(|r| r.value) else {
            return Ok(());
        };
        if !self.host.fits(want) || self.host.contains(&id) || !self.make_host_room(want, effects) {
            return Ok(());
        }
        // Making room may have demoted into `from` and evicted the block from it.
        if !held(&self.host, &self.lower, &id) {
            self.distinct += 1;
        }
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

    /// A lower tier no longer has `id` (a file gone or a write that failed; a key the remote
    /// store evicted by its own memory policy or someone deleted): forget it there. Nothing
    /// happens for host memory, which the store holds itself.
    pub fn lost(&mut self, id: BlockId, tier: Tier, effects: &mut Vec<Effect>) {
        let Some(lower) = self.lower_mut(tier) else {
            return;
        };
        let was_here = lower.set.remove(&id).is_some();
        if was_here {
            lower.counters.lost += 1;
            effects.push(removed(id, tier));
        }
        if !held(&self.host, &self.lower, &id) {
            // A pin on a block no tier holds any more would only take a slot.
            self.pins.held.remove(&id);
            if was_here {
                self.distinct = self.distinct.saturating_sub(1);
            }
        }
    }

    /// Pins the leading blocks of `keys` the store holds (in any tier) until `until`, in the
    /// edge's clock, and touches them (they are about to be used). Pins are counted per
    /// block: each `pin` needs its own `unpin`, and the block keeps the latest deadline of
    /// its pins. Returns how many blocks are pinned, fewer when the pin limit is reached.
    pub fn pin(
        &mut self,
        layout: LayoutId,
        keys: &[BlockKey],
        until: u64,
    ) -> Result<u32, StoreError> {
        let held = self.lookup(layout, keys)?.any as usize;
        let mut pinned = 0;
        for key in keys.iter().take(held) {
            let id = BlockId { layout, key: *key };
            if let Some(p) = self.pins.held.get_mut(&id) {
                p.count = p.count.saturating_add(1);
                p.until = p.until.max(until);
            } else if self.pins.held.len() < self.pins.max {
                self.pins.held.insert(id, Pin { count: 1, until });
                self.pins.next_expiry = self.pins.next_expiry.min(until);
            } else {
                break;
            }
            self.host.touch(&id);
            for lower in &mut self.lower {
                lower.set.touch(&id);
            }
            pinned += 1;
        }
        Ok(pinned)
    }

    /// Releases one pin of each of `keys`; returns how many blocks had one.
    pub fn unpin(&mut self, layout: LayoutId, keys: &[BlockKey]) -> Result<u32, StoreError> {
        self.check_layout(layout)?;
        let mut released = 0;
        for key in keys {
            let id = BlockId { layout, key: *key };
            let Some(p) = self.pins.held.get_mut(&id) else {
                continue;
            };
            released += 1;
            p.count -= 1;
            if p.count == 0 {
                self.pins.held.remove(&id);
            }
        }
        Ok(released)
    }

    /// Drops the pins whose deadline is at or before `now` (cheap while none is due).
    pub fn expire_pins(&mut self, now: u64) {
        if now < self.pins.next_expiry {
            return;
        }
        let before = self.pins.held.len();
        self.pins.held.retain(|_, p| p.until > now);
        self.counters.pins_expired += (before - self.pins.held.len()) as u64;
        self.pins.next_expiry = self
            .pins
            .held
            .values()
            .map(|p| p.until)
            .min()
            .unwrap_or(u64::MAX);
    }

    /// Blocks pinned now.
    pub fn pinned(&self) -> usize {
        self.pins.held.len()
    }

    /// Drops every block of every tier (the lower tiers' copies are deleted too), and every
    /// pin.
    pub fn clear(&mut self, effects: &mut Vec<Effect>) {
        self.pins.held.clear();
        self.pins.next_expiry = u64::MAX;
        self.distinct = 0;
        self.host.clear();
        for lower in &mut self.lower {
            for id in lower.set.clear() {
                effects.push(Effect::Delete {
                    tier: lower.tier,
                    id,
                });
            }
        }
        for (layout, _) in self.layouts.iter() {
            effects.push(Effect::Publish {
                layout,
                event: KvEvent::Cleared { tier: None },
            });
        }
    }

    /// The key before `id` in its chain, as the block was stored (`None` for a chain's first
    /// block, or a block the store does not hold).
    pub fn parent(&self, id: &BlockId) -> Option<BlockKey> {
        if let Some(b) = self.host.get(id) {
            return b.value.parent;
        }
        self.lower
            .iter()
            .find_map(|l| l.set.get(id))
            .and_then(|r| r.value)
    }

    /// The keys of `layout` resident in `tier`, least recently used first (for snapshots).
    pub fn resident(&self, layout: LayoutId, tier: Tier) -> Vec<BlockKey> {
        let of = |id: BlockId| (id.layout == layout).then_some(id.key);
        match tier {
            Tier::Host => self.host.ids().filter_map(of).collect(),
            Tier::Gpu => Vec::new(),
            lower => self
                .lower(lower)
                .map_or_else(Vec::new, |l| l.set.ids().filter_map(of).collect()),
        }
    }

    /// A tier's occupancy (this node's share of the remote store; nothing for GPU memory).
    pub fn usage(&self, tier: Tier) -> TierUsage {
        let of = |blocks: usize, bytes, capacity| TierUsage {
            blocks: blocks as u64,
            bytes,
            capacity,
        };
        match tier {
            Tier::Host => of(self.host.len(), self.host.used(), self.host.capacity()),
            Tier::Gpu => TierUsage::default(),
            lower => self.lower(lower).map_or_else(TierUsage::default, |l| {
                of(l.set.len(), l.set.used(), l.set.capacity())
            }),
        }
    }

    /// Blocks held in at least one tier, each counted once (a block can be in host memory and
    /// in a lower tier at once). Kept as tiers change: O(1).
    pub fn distinct_blocks(&self) -> u64 {
        self.distinct
    }

    /// [`BlockStore::distinct_blocks`] counted from the tiers (the property tests check the
    /// kept count against it).
    #[cfg(test)]
    fn distinct_blocks_scanned(&self) -> u64 {
        let [disk, remote] = &self.lower;
        let disk_only = disk.set.ids().filter(|id| !self.host.contains(id)).count();
        let remote_only = remote
            .set
            .ids()
            .filter(|id| !self.host.contains(id) && !disk.set.contains(id))
            .count();
        (self.host.len() + disk_only + remote_only) as u64
    }

    /// Counters since start.
    pub fn counters(&self) -> StoreCounters {
        let of = |tier| self.lower(tier).map(|l| l.counters).unwrap_or_default();
        StoreCounters {
            disk: of(Tier::Disk),
            remote: of(Tier::Remote),
            ..self.counters
        }
    }
}

#[cfg(test)]
mod tests;
