//! The concurrent index: shards by key hash, each behind a `std::sync::RwLock`, with an
//! advisory per-shard count of waiting writers so neither side holds a lock long while the
//! other waits.
//!
//! - Writers (one per source stream) bucket an event batch by shard, touch every line the ops
//!   will write in all shards at once under shared locks (`try_read`: their cache misses
//!   overlap, and no lookup is held up), then apply each shard's ops in chunks of at most
//!   [`WRITE_BATCH`] per exclusive hold. Shards that are free are written at once; the others
//!   are announced together and taken as they come free.
//! - A lookup takes a shard's shared lock the first time one of its keys needs it and keeps
//!   it for the next keys, but after every probe batch it lets go of each shard a writer is
//!   waiting for, and defers to announced writers before taking a shard. So a writer waits
//!   about one probe batch per `apply`, and a lookup that collides with an `apply` waits until
//!   the writer has passed the shards it needs (one chunk each).
//! - Nobody blocks while holding a lock: a writer holds one shard at a time and waits for none
//!   while holding it; a reader that must wait for a shard first releases every shard a writer
//!   waits for, and spins (then yields) rather than sleeping on the lock. Hence no deadlock,
//!   and a writer is never starved by back-to-back lookups (`tests/concurrency.rs`).
//! - Run logs ([`crate::runs`]): an `apply` holds its source's log exclusively throughout and
//!   zeroes other holders' entries only once it holds no shard (queueing them for a log held
//!   by its writer); `speculate` only *tries* its endpoint's log (busy: no positions); a
//!   lookup only *tries* a log's lock, reads it and lets go before anything else, so logs add
//!   no wait cycle and the request path never waits behind an ingest. A lookup
//!   follows a log from the last key it fed (a *cursor*) and lets it plan the next probe batch.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::{Duration, Instant};

use kv_events::fasthash::U64Map;
use kv_events::{BlockKey, KvEvent, Tier};

use crate::config::{ConfigError, IndexConfig};
use crate::id::{EndpointId, Holder, NodeId};
use crate::matcher::{Matcher, NodeOf};
use crate::overlap::Overlap;
use crate::runs::{LogCell, RunCtx, RunLog, Runs, Zero};
use crate::shard::{Op, Shard};
use crate::table::{
    ALL_TIERS, Bits, Grown, Holders, NO_POS, SPEC, Table, entry, one_word, tier_bit,
};
use crate::time::Millis;

/// Ops applied per exclusive hold of a shard (bounds how long a lookup can wait on a writer).
const WRITE_BATCH: usize = 64;
/// Source-list keys cleared per exclusive hold.
const CLEAR_BATCH: usize = 256;
/// Keys in a lookup's first probe batch: a typical shared system prompt (blocks held by many
/// endpoints, so no run log can name them before they are probed) in one round of overlapping
/// misses. When a prompt's first block is not resident the rest of the batch is wasted, but
/// such a prompt's decision is dominated by tokenizing it. Measured against 8 (the
/// `-- lookup` bench, four alternated pairs): p50 lower in three, equal in one.
const FIRST_BATCH: usize = 64;
/// Keys in a probe batch that no run log planned, after the first: where a log diverges one
/// holder usually goes on, and its run is followed after one probe. Each such batch doubles
/// the next, up to [`MAX_BATCH`]. Each batch's probes are issued together so their cache
/// misses overlap.
const NEXT_BATCH: usize = 8;
const MAX_BATCH: usize = 128;
/// How long a waiting thread spins before it starts yielding its core (on an oversubscribed
/// machine the thread it waits for may need this core to run).
const SPIN_FOR: Duration = Duration::from_micros(20);
/// How long a lookup defers to writers that announced they want a shard (a safety valve
/// against writers taking turns forever; a writer takes an announced shard within one probe
/// batch of every lookup holding it).
const DEFER_FOR: Duration = Duration::from_millis(2);
const NOT_FOUND: usize = usize::MAX;
const NOT_LOGGED: u32 = NO_POS;
/// What a batch loads for a key whose shard is not held (cannot happen; keeps types simple).
static ZERO: u64 = 0;

/// Counters describing the index's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Distinct blocks held by anyone.
    pub blocks: usize,
    /// (block, holder) residencies.
    pub residencies: usize,
    /// Blocks evicted to stay within capacity, since creation.
    pub evicted_blocks: u64,
    /// Bytes in the index's tables (capacity-based; excludes allocator overhead).
    pub heap_bytes: usize,
    /// Shard tables doubled in place, under the exclusive lock: every lookup of that shard
    /// waited for the copy (milliseconds at millions of blocks). Ingest grows tables before
    /// that point, so this counts only growth that speculation or a contended writer forced.
    pub table_growths_blocking: u64,
    /// Shard tables grown by a copy built under the shared lock (lookups went on) and
    /// installed in O(1).
    pub table_growths_shared: u64,
    /// Speculative residencies dropped because their shard's table was being copied to grow
    /// (speculation is a hint; the request path does not wait for the copy).
    pub speculation_skipped: u64,
}

/// How a flush treats shard tables that must grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Growth {
    /// Build a grown copy of a shard's table under the shared lock, before writing the shard,
    /// when the writes may take it past [`Table::wants_room`] (ingest).
    Early,
    /// Never build one (speculation, on the request path), and drop the writes to a shard
    /// whose table another writer is copying rather than wait for the copy.
    Skip,
}

/// The global prefix index: block keys → the endpoints and nodes holding them, per tier.
#[derive(Debug)]
pub struct KvIndex {
    shards: Box<[RwLock<Shard>]>,
    /// Per shard: writers waiting for its exclusive lock (advisory; lookups yield to them).
    waiting: Box<[AtomicU32]>,
    /// Sum of `waiting`, so lookups check one word when nobody waits.
    any_waiting: AtomicU32,
    /// Per shard: grown copies of its table being built (speculation skips such shards).
    growing: Box<[AtomicU32]>,
    /// Speculative residencies dropped for a growing shard.
    spec_skipped: AtomicU64,
    shift: u32,
    /// Endpoint → node raw id.
    nodes: RwLock<U64Map<u32, u32>>,
    /// Every holder's run log.
    runs: Runs,
}

thread_local! {
    static MATCHER: RefCell<Matcher> = RefCell::new(Matcher::default());
    static OPS: RefCell<Vec<Vec<Op>>> = const { RefCell::new(Vec::new()) };
    static ZEROS: RefCell<Vec<Zero>> = const { RefCell::new(Vec::new()) };
}

/// Waiting for a lock: spin (the holder is running and its hold is short) and only after
/// [`SPIN_FOR`] yield the core (the holder may have been descheduled).
struct Backoff {
    round: u32,
    start: Option<Instant>,
}

impl Backoff {
    fn new() -> Self {
        Self {
            round: 0,
            start: None,
        }
    }

    /// Time since the first wait.
    fn waited(&mut self) -> Duration {
        self.start.get_or_insert_with(Instant::now).elapsed()
    }

    fn wait(&mut self) {
        self.round = self.round.wrapping_add(1);
        // Check the clock every 64 rounds only.
        if self.round % 64 == 1 && self.waited() > SPIN_FOR {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The shared locks one lookup holds.
struct Reader<'a> {
    index: &'a KvIndex,
    guards: Vec<Option<RwLockReadGuard<'a, Shard>>>,
    /// How many of `guards` are taken.
    held: usize,
}

impl<'a> Reader<'a> {
    fn new(index: &'a KvIndex) -> Self {
        let mut guards = Vec::with_capacity(index.shards.len());
        guards.resize_with(index.shards.len(), || None);
        Self {
            index,
            guards,
            held: 0,
        }
    }

    /// Takes the shared locks of every shard `keys` live in (waiting for one may release
    /// others to a waiting writer: then go round again).
    fn hold(&mut self, keys: &[BlockKey]) {
        loop {
            let mut waited = false;
            for &k in keys {
                let i = self.index.shard_of(k);
                if matches!(self.guards.get(i), Some(None)) {
                    waited |= self.take(i);
                }
            }
            if !waited {
                return;
            }
        }
    }

    /// Takes shard `i`'s shared lock; returns whether it had to wait (and so may have released
    /// others).
    fn take(&mut self, i: usize) -> bool {
        let (g, waited) = self.acquire(i);
        if let Some(slot) = self.guards.get_mut(i) {
            match (slot.is_some(), g.is_some()) {
                (false, true) => self.held += 1,
                (true, false) => self.held -= 1,
                _ => {}
            }
            *slot = g;
        }
        waited
    }

    /// Whether every shard's lock is held.
    fn all_held(&self) -> bool {
        self.held == self.guards.len()
    }

    /// Shard `i`, if its lock is held.
    fn held(&self, i: usize) -> Option<&Shard> {
        self.guards.get(i)?.as_deref()
    }

    /// Shard `i`'s shared lock, and whether the wait may have released other shards.
    fn acquire(&mut self, i: usize) -> (Option<RwLockReadGuard<'a, Shard>>, bool) {
        let (Some(lock), Some(waiting)) = (self.index.shards.get(i), self.index.waiting.get(i))
        else {
            return (None, false);
        };
        let mut backoff = Backoff::new();
        loop {
            // Defer to waiting writers (but not forever: several could take turns).
            if waiting.load(Relaxed) == 0 || backoff.waited() > DEFER_FOR {
                match lock.try_read() {
                    Ok(g) => return (Some(g), backoff.start.is_some()),
                    Err(TryLockError::Poisoned(p)) => {
                        return (Some(p.into_inner()), backoff.start.is_some());
                    }
                    Err(TryLockError::WouldBlock) => {}
                }
            }
            // Never wait while holding what a writer waits for.
            self.yield_to_writers();
            backoff.wait();
        }
    }

    /// Releases every held shard a writer is waiting for.
    fn yield_to_writers(&mut self) {
        if self.index.any_waiting.load(Relaxed) == 0 {
            return;
        }
        for (g, w) in self.guards.iter_mut().zip(self.index.waiting.iter()) {
            if g.is_some() && w.load(Relaxed) != 0 {
                *g = None;
                self.held -= 1;
            }
        }
    }
}

/// The run log a lookup used last (most walks follow one holder's runs).
#[derive(Default)]
struct LastLog(Option<(u32, Arc<LogCell>)>);

impl LastLog {
    fn get(&mut self, runs: &Runs, holder: u32) -> Option<&LogCell> {
        if self.0.as_ref().is_none_or(|(h, _)| *h != holder) {
            self.0 = runs.get(holder).map(|l| (holder, l));
        }
        self.0.as_ref().map(|(_, l)| &**l)
    }
}

struct Nodes<'a>(&'a RwLock<U64Map<u32, u32>>);

impl NodeOf for Nodes<'_> {
    fn node_of(&self, endpoint: u32) -> Option<u32> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&endpoint)
            .copied()
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let per_shard = config.capacity / config.shards;
        Ok(Self {
            shards: (0..config.shards)
                .map(|_| RwLock::new(Shard::new(per_shard)))
                .collect(),
            waiting: (0..config.shards).map(|_| AtomicU32::new(0)).collect(),
            any_waiting: AtomicU32::new(0),
            growing: (0..config.shards).map(|_| AtomicU32::new(0)).collect(),
            spec_skipped: AtomicU64::new(0),
            shift: 64 - config.shards.trailing_zeros(),
            nodes: RwLock::new(U64Map::default()),
            runs: Runs::default(),
        })
    }

    fn shard_of(&self, key: BlockKey) -> usize {
        // The top bits: the shard's own table indexes by a mix of all bits.
        key.0.checked_shr(self.shift).unwrap_or(0) as usize
    }

    /// Shard `i`'s exclusive lock, announcing the wait so lookups let go of it.
    fn write_lock(&self, i: usize) -> Option<RwLockWriteGuard<'_, Shard>> {
        let lock = self.shards.get(i)?;
        match lock.try_write() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        let waiting = self.waiting.get(i)?;
        waiting.fetch_add(1, Relaxed);
        self.any_waiting.fetch_add(1, Relaxed);
        let mut backoff = Backoff::new();
        let g = loop {
            match lock.try_write() {
                Ok(g) => break g,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) => backoff.wait(),
            }
        };
        waiting.fetch_sub(1, Relaxed);
        self.any_waiting.fetch_sub(1, Relaxed);
        Some(g)
    }

    /// Runs `f` on shard `i` under its exclusive lock.
    fn with_shard<R>(&self, i: usize, f: impl FnOnce(&mut Shard) -> R) -> Option<R> {
        let mut g = self.write_lock(i)?;
        Some(f(&mut g))
    }

    /// Says which node an endpoint runs on (`None`: unknown), so lookups credit the node's
    /// host/disk/remote tiers to it.
    pub fn set_endpoint_node(&self, endpoint: EndpointId, node: Option<NodeId>) {
        let mut nodes = self.nodes.write().unwrap_or_else(PoisonError::into_inner);
        match node {
            Some(n) => nodes.insert(endpoint.get(), n.get()),
            None => nodes.remove(&endpoint.get()),
        };
    }

    /// Applies one source's events in order. `Stored`'s parent, LoRA and token count are not
    /// needed (keys already chain); `Unknown` is skipped.
    pub fn apply(&self, source: Holder, events: &[KvEvent]) {
        let holder = source.pack();
        self.with_log(holder, |log, zeros| {
            OPS.with_borrow_mut(|ops| {
                ops.resize_with(self.shards.len(), Vec::new);
                for ev in events {
                    match ev {
                        KvEvent::Stored { keys, tier, .. } => {
                            let bits = tier_bit(*tier);
                            self.bucket(ops, keys, log, |_, k, pos| Op::Set(k, bits, pos));
                        }
                        KvEvent::Removed { keys, tier } => {
                            let bits = tier_bit(*tier);
                            for &k in keys {
                                if let Some(v) = ops.get_mut(self.shard_of(k)) {
                                    v.push(Op::Unset(k, bits));
                                }
                            }
                        }
                        KvEvent::Cleared { tier } => {
                            self.flush(holder, ops, Millis(0), Growth::Early, log, zeros);
                            let bits = tier.map_or(ALL_TIERS, tier_bit);
                            // A GPU (or full) clear drops the source's speculation too.
                            let bits = if bits & 1 != 0 { bits | SPEC } else { bits };
                            self.clear_source(holder, bits, log, zeros);
                        }
                        KvEvent::Unknown => {}
                    }
                }
                self.flush(holder, ops, Millis(0), Growth::Early, log, zeros);
            });
        });
    }

    /// Runs `f` holding `holder`'s run log exclusively (its new residencies append to it),
    /// then zeroes the other holders' entries the writes invalidated, holding no lock.
    fn with_log<R>(&self, holder: u32, f: impl FnOnce(&mut RunLog, &mut Vec<Zero>) -> R) -> R {
        let log = self.runs.get_or_create(holder);
        let r = ZEROS.with_borrow_mut(|zeros| {
            log.write(|g| {
                let r = f(g, zeros);
                g.zero_own(holder, zeros);
                r
            })
        });
        ZEROS.with_borrow_mut(|zeros| self.runs.apply_zeros(zeros));
        r
    }

    /// Buckets `keys` by shard as `op(key, run-log position)`: the keys get consecutive
    /// positions in `log`, in order, so the chain they form is one run.
    fn bucket(
        &self,
        ops: &mut [Vec<Op>],
        keys: &[BlockKey],
        log: &mut RunLog,
        mut op: impl FnMut(usize, BlockKey, u32) -> Op,
    ) {
        let base = log.reserve_run(keys.len());
        for ((j, &k), off) in keys.iter().enumerate().zip(0u32..) {
            let pos = if base == NO_POS { NO_POS } else { base + off };
            if let Some(v) = ops.get_mut(self.shard_of(k)) {
                v.push(op(j, k, pos));
            }
        }
    }

    /// Applies each shard's pending ops, [`WRITE_BATCH`] per exclusive hold, then empties them.
    /// Shards that are free are done at once; the others are announced together and taken
    /// as they come free, so a lookup releases all of them at its next batch boundary (one
    /// wait per call, not one per shard).
    fn flush(
        &self,
        holder: u32,
        ops: &mut [Vec<Op>],
        deadline: Millis,
        growth: Growth,
        log: &mut RunLog,
        zeros: &mut Vec<Zero>,
    ) {
        let mut ctx = RunCtx {
            holder,
            own: Some(log),
            runs: Some(&self.runs),
            zeros,
        };
        self.flush_with(holder, ops, deadline, growth, &mut ctx);
    }

    fn flush_with(
        &self,
        holder: u32,
        ops: &mut [Vec<Op>],
        deadline: Millis,
        growth: Growth,
        ctx: &mut RunCtx<'_>,
    ) {
        // First touch every line the ops will write, in all shards at once, under *shared*
        // locks (so lookups are not held up, and nothing waits: `try_read` only): an `apply`
        // of a few chains spreads over every shard, and touching shard by shard under its
        // exclusive lock stalled once per shard (the unlock's fence waits for the writes'
        // misses); this way the misses of all shards overlap, and each exclusive hold is short.
        //
        // Under the same shared lock, a shard whose table these writes may take past
        // `wants_room` gets a grown copy of it (`Growth::Early`): lookups go on during the copy,
        // and the exclusive hold that writes the shard installs it in O(1), where growing in
        // place would hold every lookup of the shard for the whole copy.
        let mut grown: Vec<(usize, Grown)> = Vec::new();
        // Slots replaced by installed copies, freed at the end, with no lock held.
        let mut retired = Vec::new();
        let sink = ops.iter().enumerate().fold(0, |a, (i, v)| {
            if v.is_empty() {
                return a;
            }
            match self.shards.get(i).map(RwLock::try_read) {
                Some(Ok(g)) => {
                    if growth == Growth::Early
                        && let Some(adding) = g.wants_room(v)
                    {
                        // Marked before the copy starts, so speculation skips the shard
                        // rather than wait for the copy's shared lock.
                        if let Some(n) = self.growing.get(i) {
                            n.fetch_add(1, Relaxed);
                        }
                        grown.push((i, g.grown(adding)));
                    }
                    a ^ g.touch(holder, v)
                }
                _ => a,
            }
        });
        std::hint::black_box(sink);
        // Shards whose copy is this flush's. Another writer's pending copy of a shard makes
        // this flush leave it alone until that copy is installed (any edit in between would
        // waste the copy, and a race repeated on every flush would copy the table again and
        // again): speculation drops its writes there, other writers wait as for the lock.
        let own: Vec<usize> = grown.iter().map(|&(i, _)| i).collect();
        let others_copy = |i: usize| !own.contains(&i) && self.copying(i);
        // Installs shard `i`'s grown copy, if one was built, before its first write.
        let mut install = |i: usize, shard: &mut Shard| {
            if let Some(p) = grown.iter().position(|&(j, _)| j == i) {
                let (_, copy) = grown.swap_remove(p);
                retired.extend(shard.install(copy));
                if let Some(n) = self.growing.get(i) {
                    n.fetch_sub(1, Relaxed);
                }
            }
        };
        let mut blocked = Vec::new();
        for (i, v) in ops.iter_mut().enumerate() {
            if v.is_empty() {
                continue;
            }
            if others_copy(i) {
                match growth {
                    Growth::Skip => self.skip_speculation(v),
                    Growth::Early => blocked.push(i),
                }
                continue;
            }
            if v.len() <= WRITE_BATCH {
                let Some(lock) = self.shards.get(i) else {
                    v.clear();
                    continue;
                };
                match lock.try_write() {
                    Ok(mut g) => {
                        install(i, &mut g);
                        g.apply_touched(holder, v, deadline, ctx);
                    }
                    Err(TryLockError::Poisoned(p)) => {
                        let mut g = p.into_inner();
                        install(i, &mut g);
                        g.apply_touched(holder, v, deadline, ctx);
                    }
                    Err(TryLockError::WouldBlock) => {
                        blocked.push(i);
                        continue;
                    }
                }
                v.clear();
                continue;
            }
            match self.shards.get(i).map(RwLock::try_write) {
                Some(Ok(mut g)) => {
                    install(i, &mut g);
                    self.write_all(i, g, holder, v, deadline, ctx);
                }
                Some(Err(TryLockError::Poisoned(p))) => {
                    let mut g = p.into_inner();
                    install(i, &mut g);
                    self.write_all(i, g, holder, v, deadline, ctx);
                }
                Some(Err(TryLockError::WouldBlock)) => blocked.push(i),
                None => v.clear(),
            }
        }
        if !blocked.is_empty() {
            for &i in &blocked {
                if let Some(w) = self.waiting.get(i) {
                    w.fetch_add(1, Relaxed);
                }
            }
            self.any_waiting.fetch_add(blocked.len() as u32, Relaxed);
            let mut backoff = Backoff::new();
            while !blocked.is_empty() {
                let before = blocked.len();
                blocked.retain(|&i| {
                    let g = if others_copy(i) {
                        if growth == Growth::Early {
                            return true;
                        }
                        None
                    } else {
                        match self.shards.get(i).map(RwLock::try_write) {
                            Some(Ok(g)) => Some(g),
                            Some(Err(TryLockError::Poisoned(p))) => Some(p.into_inner()),
                            Some(Err(TryLockError::WouldBlock)) => return true,
                            None => None,
                        }
                    };
                    let Some(mut g) = g else {
                        if let Some(v) = ops.get_mut(i) {
                            self.skip_speculation(v);
                        }
                        if let Some(w) = self.waiting.get(i) {
                            w.fetch_sub(1, Relaxed);
                        }
                        self.any_waiting.fetch_sub(1, Relaxed);
                        return false;
                    };
                    if let Some(w) = self.waiting.get(i) {
                        w.fetch_sub(1, Relaxed);
                    }
                    self.any_waiting.fetch_sub(1, Relaxed);
                    install(i, &mut g);
                    if let Some(v) = ops.get_mut(i) {
                        self.write_all(i, g, holder, v, deadline, ctx);
                    }
                    false
                });
                if blocked.len() == before {
                    backoff.wait();
                }
            }
        }
        // Copies whose shard was not written (its ops vanished): nobody installs them.
        for (i, _) in grown {
            if let Some(n) = self.growing.get(i) {
                n.fetch_sub(1, Relaxed);
            }
        }
        drop(retired);
    }

    /// Whether a grown copy of shard `i`'s table is being built or waits to be installed:
    /// speculation and expiry leave the shard alone meanwhile, since any edit would make the
    /// copy stale (and the table then grow in place, holding lookups).
    fn copying(&self, i: usize) -> bool {
        self.growing.get(i).is_some_and(|n| n.load(Relaxed) > 0)
    }

    /// Drops speculative writes to a shard being grown (speculation is a hint; the request
    /// path does not wait for the copy), counting them.
    fn skip_speculation(&self, ops: &mut Vec<Op>) {
        self.spec_skipped.fetch_add(ops.len() as u64, Relaxed);
        ops.clear();
    }

    /// Applies `ops` to shard `i`: the first chunk under `g`, the rest re-locking per chunk.
    fn write_all(
        &self,
        i: usize,
        mut g: RwLockWriteGuard<'_, Shard>,
        holder: u32,
        ops: &mut Vec<Op>,
        deadline: Millis,
        ctx: &mut RunCtx<'_>,
    ) {
        let mut chunks = ops.chunks(WRITE_BATCH);
        if let Some(first) = chunks.next() {
            g.apply(holder, first, deadline, ctx);
        }
        drop(g);
        for chunk in chunks {
            self.with_shard(i, |s| s.apply(holder, chunk, deadline, ctx));
        }
        ops.clear();
    }

    /// Clears `bits` of `holder` on every block it holds, visiting only its own key lists,
    /// [`CLEAR_BATCH`] keys per exclusive hold.
    /// Its run-log entries are zeroed at once (the caller holds its log).
    fn clear_source(&self, holder: u32, bits: Bits, log: &mut RunLog, zeros: &mut Vec<Zero>) {
        let mut ctx = RunCtx {
            holder,
            own: Some(log),
            runs: Some(&self.runs),
            zeros,
        };
        for i in 0..self.shards.len() {
            let mut cursor = usize::MAX;
            while cursor > 0 {
                let step = self.with_shard(i, |s| {
                    s.clear_some(holder, bits, cursor, CLEAR_BATCH, &mut ctx)
                });
                match step {
                    Some(c) => cursor = c,
                    None => break,
                }
            }
        }
    }

    /// Replaces everything `source` holds (its confirmed tiers; speculation is kept) with a
    /// snapshot of (key, tier) residencies. For resynchronising after a gap or a new epoch.
    /// O(source's keys + snapshot). A concurrent lookup may see the source partly cleared.
    pub fn replace_source(
        &self,
        source: Holder,
        snapshot: impl IntoIterator<Item = (BlockKey, Tier)>,
    ) {
        let holder = source.pack();
        let snapshot: Vec<(BlockKey, Tier)> = snapshot.into_iter().collect();
        let keys: Vec<BlockKey> = snapshot.iter().map(|&(k, _)| k).collect();
        let mut ops: Vec<Vec<Op>> = vec![Vec::new(); self.shards.len()];
        self.with_log(holder, |log, zeros| {
            self.clear_source(holder, ALL_TIERS, log, zeros);
            self.bucket(&mut ops, &keys, log, |j, k, pos| {
                let bits = snapshot.get(j).map_or(0, |&(_, t)| tier_bit(t));
                Op::Set(k, bits, pos)
            });
            self.flush(holder, &mut ops, Millis(0), Growth::Early, log, zeros);
        });
    }

    /// Forgets `source` entirely (its residencies and speculation). O(source's keys).
    pub fn remove_source(&self, source: Holder) {
        let holder = source.pack();
        self.with_log(holder, |log, zeros| {
            self.clear_source(holder, ALL_TIERS | SPEC, log, zeros);
        });
        self.runs.remove(holder);
    }

    /// Records that a request routed to `endpoint` will put `keys` in its GPU cache: they count
    /// as GPU residency until a store or removal from the endpoint confirms them, or until
    /// [`KvIndex::expire`] runs at or after `now + ttl`.
    ///
    /// Never waits for the endpoint's run log (an `apply` of the endpoint's events holds it
    /// for its whole call): when it is busy, the speculative residencies get no log position
    /// (lookups probe them) and the entries they invalidate are zeroed by the `apply` before
    /// it lets go of the log.
    pub fn speculate(&self, endpoint: EndpointId, keys: &[BlockKey], now: Millis, ttl: Millis) {
        let holder = Holder::Endpoint(endpoint).pack();
        let deadline = now.after(ttl);
        let log = self.runs.get_or_create(holder);
        let logged = ZEROS.with_borrow_mut(|zeros| {
            log.try_write(|log| {
                OPS.with_borrow_mut(|ops| {
                    ops.resize_with(self.shards.len(), Vec::new);
                    self.bucket(ops, keys, log, |_, k, pos| Op::Spec(k, pos));
                    self.flush(holder, ops, deadline, Growth::Skip, log, zeros);
                });
                log.zero_own(holder, zeros);
            })
        });
        if logged.is_none() {
            OPS.with_borrow_mut(|ops| {
                ops.resize_with(self.shards.len(), Vec::new);
                for &k in keys {
                    if let Some(v) = ops.get_mut(self.shard_of(k)) {
                        v.push(Op::Spec(k, NO_POS));
                    }
                }
                ZEROS.with_borrow_mut(|zeros| {
                    let mut ctx = RunCtx::deferred(&self.runs, zeros);
                    self.flush_with(holder, ops, deadline, Growth::Skip, &mut ctx);
                });
            });
        }
        ZEROS.with_borrow_mut(|zeros| self.runs.apply_zeros(zeros));
    }

    /// Drops speculative entries whose deadline is at or before `now`; returns how many. A
    /// shard whose table is being grown from a copy is left for the next call.
    pub fn expire(&self, now: Millis) -> usize {
        let mut n = 0;
        ZEROS.with_borrow_mut(|zeros| {
            for i in 0..self.shards.len() {
                if self.copying(i) {
                    // Its entries expire at the next call; an edit now would waste the copy.
                    continue;
                }
                while let Some((k, more)) = self.with_shard(i, |s| {
                    let mut ctx = RunCtx::deferred(&self.runs, zeros);
                    s.expire(now, WRITE_BATCH, &mut ctx)
                }) {
                    self.runs.apply_zeros(zeros);
                    n += k;
                    if !more {
                        break;
                    }
                }
            }
        });
        n
    }

    /// For each candidate (in order), the prefix of `keys` it can serve per tier. Stops reading
    /// as soon as no candidate can extend its match.
    pub fn find_matches(&self, keys: &[BlockKey], candidates: &[EndpointId]) -> Vec<Overlap> {
        let mut out = Vec::with_capacity(candidates.len());
        self.find_matches_into(keys, candidates, &mut out);
        out
    }

    /// [`KvIndex::find_matches`], appending to `out`.
    pub fn find_matches_into(
        &self,
        keys: &[BlockKey],
        candidates: &[EndpointId],
        out: &mut Vec<Overlap>,
    ) {
        if candidates.is_empty() {
            return;
        }
        MATCHER.with_borrow_mut(|m| {
            m.begin(candidates);
            let nodes = Nodes(&self.nodes);
            let mut reader = Reader::new(self);
            let mut done = 0;
            let mut batch = FIRST_BATCH;
            let mut first = true;
            let mut slots = [NOT_FOUND; MAX_BATCH];
            let mut loaded = [0u64; 2 * MAX_BATCH];
            // The one-holder word last fed to the matcher: a key with the same sole holder
            // (and bits) changes nothing, so the common case costs one comparison.
            let mut prev_one = 0u64;
            let mut logs = LastLog::default();
            // Where the last key fed sits in some holder's run log: the next keys are read
            // from there while they match.
            let mut cursor: Option<(u32, u32)> = None;
            // Whether the cursor was taken from a block with several holders.
            let mut shared = false;
            'walk: while done < keys.len() && m.wants_more() {
                // Follow the cursor: feed the keys its log knows, then let it name the keys
                // to probe next (blocks it shares), so the batch stops where its next run
                // starts or it diverges, and no probe is wasted beyond.
                let mut planned = 0;
                // The holder whose log planned this batch: the cursor stays in its log.
                let mut planner = u32::MAX;
                if let Some((holder, pos)) = cursor.take()
                    && let Some(log) = logs.get(&self.runs, holder)
                    && let Some(log) = log.try_read()
                {
                    let rest = keys.get(done..).unwrap_or_default();
                    if shared {
                        // The log's next entry is a miss of its own, and after a shared block
                        // the log is one of its holders', which mostly goes elsewhere: load
                        // the next probe batch's home slots now, so their misses overlap it.
                        // (After the lock above: a locked instruction waits for every earlier
                        // load.)
                        let next = rest.get(..NEXT_BATCH.min(rest.len()));
                        self.touch_homes(&reader, next, &mut loaded);
                    }
                    let mut ended = false;
                    let base = done;
                    let n = log.walk_changes(pos, rest, |j, bits| {
                        let w = one_word(holder, bits);
                        if w == prev_one {
                            return true;
                        }
                        prev_one = w;
                        let i = u32::try_from(base + j).unwrap_or(u32::MAX);
                        ended = !m.key(i, Holders::One(entry(holder, bits)), candidates, &nodes);
                        !ended
                    });
                    done += n;
                    if ended {
                        break 'walk;
                    }
                    let rest = keys.get(done..).unwrap_or_default();
                    let next = pos.saturating_add(1).saturating_add(n as u32);
                    planned = log.plan(next, rest, MAX_BATCH);
                    planner = holder;
                    if n > 0 {
                        // Probing resumes after a run: batches grow afresh.
                        batch = NEXT_BATCH;
                    }
                    if done >= keys.len() {
                        break 'walk;
                    }
                }
                let len = planned.max(batch);
                let chunk = keys
                    .get(done..keys.len().min(done + len))
                    .unwrap_or_default();
                // Shared locks of every shard the batch needs (once all are held, nothing to do).
                if !reader.all_held() {
                    let mut waited = false;
                    for &key in chunk {
                        let s = self.shard_of(key);
                        if reader.held(s).is_none() {
                            waited |= reader.take(s);
                        }
                    }
                    if waited {
                        // Waiting may have released others to a writer: hold them all.
                        reader.hold(chunk);
                    }
                }
                // Two rounds of overlapping cache misses: every key's home bucket, then the
                // holder lists of the blocks found. Addresses are computed first and loaded
                // in a tight loop, each into its own cell (a dependency or a long loop body
                // between loads would serialise the misses).
                let mut tables: [Option<&Table>; MAX_BATCH] = [None; MAX_BATCH];
                let mut homes = [(0usize, &ZERO); MAX_BATCH];
                for ((&key, t), h) in chunk.iter().zip(&mut tables).zip(&mut homes) {
                    *t = reader.held(self.shard_of(key)).map(Shard::table);
                    if let Some(t) = t {
                        let (i, r) = t.home_ref(key.0);
                        *h = (i, r.unwrap_or(&ZERO));
                    }
                }
                for (l, (_, r)) in loaded.iter_mut().zip(&homes).take(chunk.len()) {
                    *l = **r;
                }
                std::hint::black_box(&loaded);
                let mut lines = [&ZERO; 2 * MAX_BATCH];
                let mut n_lines = 0;
                for (((&key, t), &(h, _)), slot) in
                    chunk.iter().zip(&tables).zip(&homes).zip(&mut slots)
                {
                    *slot = NOT_FOUND;
                    if let Some(t) = t
                        && let Some(i) = t.find_from(key.0, h)
                    {
                        *slot = i;
                        t.holder_lines(i, |r| {
                            if let Some(l) = lines.get_mut(n_lines) {
                                *l = r;
                                n_lines += 1;
                            }
                        });
                    }
                }
                for (l, r) in loaded.iter_mut().zip(&lines).take(n_lines) {
                    *l = **r;
                }
                std::hint::black_box(&loaded);
                let last = chunk.len().saturating_sub(1);
                // The last key fed: the cursor is taken from it once the batch is done.
                let mut fed: Option<(&Table, usize)> = None;
                for (n, (t, &slot)) in tables.iter().zip(&slots).take(chunk.len()).enumerate() {
                    let i = u32::try_from(done).unwrap_or(u32::MAX);
                    done += 1;
                    let Some(t) = t.filter(|_| slot != NOT_FOUND) else {
                        fed = None;
                        if !m.key(i, Holders::None, candidates, &nodes) {
                            break 'walk;
                        }
                        continue;
                    };
                    let w = t.touch(slot);
                    if w != prev_one {
                        let h = t.holders(slot);
                        prev_one = if matches!(h, Holders::One(_)) { w } else { 0 };
                        if !m.key(i, h, candidates, &nodes) {
                            break 'walk;
                        }
                    }
                    fed = Some((t, slot));
                    // A block held by one holder mid-batch may start a run: follow it now
                    // if its log goes on with the next key (the rest of the batch is dropped).
                    if n < last
                        && let Some((holder, _, pos)) = t.sole(slot)
                        && pos != NOT_LOGGED
                        && let Some(log) = logs.get(&self.runs, holder)
                        && let Some(log) = log.try_read()
                        && log.walk(pos, keys.get(done..done + 1).unwrap_or_default(), |_, _| {
                            true
                        }) > 0
                    {
                        break;
                    }
                }
                cursor = fed.and_then(|(t, slot)| t.cursor(slot, planner));
                shared = fed.is_some_and(|(t, slot)| t.sole(slot).is_none());
                batch = if std::mem::take(&mut first) {
                    NEXT_BATCH
                } else {
                    (batch * 2).min(MAX_BATCH)
                };
                reader.yield_to_writers();
            }
            drop(reader);
            m.finish(u32::try_from(done).unwrap_or(u32::MAX), candidates, out);
        });
    }

    /// Loads the home slot of each key whose shard `reader` holds (into `sink`, so the loads
    /// happen and their misses overlap whatever follows).
    fn touch_homes(&self, reader: &Reader<'_>, keys: Option<&[BlockKey]>, sink: &mut [u64]) {
        for (&key, l) in keys.unwrap_or_default().iter().zip(sink.iter_mut()) {
            if let Some(r) = reader
                .held(self.shard_of(key))
                .and_then(|s| s.table().home_ref(key.0).1)
            {
                *l = *r;
            }
        }
        std::hint::black_box(&*sink);
    }

    /// The blocks `source` holds in any tier, speculative ones included: what an operator
    /// compares with the engine's own count to see whether the index went stale. One read
    /// lock per shard, O(shards).
    pub fn residencies_of(&self, source: Holder) -> usize {
        let holder = source.pack();
        self.shards
            .iter()
            .map(|lock| {
                lock.read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .residencies_of(holder)
            })
            .sum()
    }

    /// Counts of blocks, residencies and evictions, and the tables' size.
    pub fn stats(&self) -> IndexStats {
        let mut st = IndexStats::default();
        for lock in self.shards.iter() {
            let s = lock.read().unwrap_or_else(PoisonError::into_inner);
            st.blocks += s.blocks();
            st.residencies += s.residencies();
            st.evicted_blocks += s.evicted();
            st.heap_bytes += s.heap_bytes();
            let (blocking, shared) = s.growths();
            st.table_growths_blocking += blocking;
            st.table_growths_shared += shared;
        }
        st.heap_bytes += self.runs.heap_bytes();
        st.speculation_skipped = self.spec_skipped.load(Relaxed);
        st
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use std::sync::mpsc;

    use super::*;

    fn key(i: u64) -> BlockKey {
        BlockKey((i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// Every run-log entry of `holder` claiming a state is its key's only residency, with
    /// exactly those bits.
    fn entries_exact(idx: &KvIndex, holder: u32) {
        let log = idx.runs.get(holder).unwrap();
        assert_eq!(log.queued(), 0);
        for (k, state) in log.try_read().unwrap().known() {
            let shard = idx.shards[idx.shard_of(BlockKey(k))].read().unwrap();
            assert_eq!(
                shard.table().get(k),
                Holders::One(crate::table::entry(holder, state)),
                "entry of key {k}"
            );
        }
    }

    fn stored(keys: &[BlockKey]) -> KvEvent {
        KvEvent::Stored {
            keys: keys.to_vec(),
            parent: None,
            tier: Tier::Gpu,
            lora: None,
            token_count: 16 * keys.len() as u32,
        }
    }

    /// Ingest grows shard tables from a copy built under the shared lock, never in place under
    /// the exclusive one (which would hold every lookup of the shard for the whole copy);
    /// speculation, which never builds copies, still grows in place when it fills a table.
    #[test]
    fn ingest_grows_tables_off_the_exclusive_lock() {
        let config = IndexConfig {
            shards: 4,
            capacity: 1 << 20,
        };
        let idx = KvIndex::new(config).unwrap();
        let e = EndpointId::new(1).unwrap();
        let keys: Vec<BlockKey> = (0..20_000).map(key).collect();
        for chunk in keys.chunks(32) {
            idx.apply(Holder::Endpoint(e), &[stored(chunk)]);
        }
        let st = idx.stats();
        assert_eq!(st.blocks, 20_000);
        assert_eq!(st.table_growths_blocking, 0);
        // From empty to ≥ 20,000 / 4 blocks per shard at ≤ 11/16 load: about 12 doublings each.
        assert!(st.table_growths_shared >= 4 * 10, "{st:?}");
        assert_eq!(idx.find_matches(&keys, &[e])[0].reaches()[0], 20_000);

        let idx = KvIndex::new(config).unwrap();
        for chunk in keys.chunks(32) {
            idx.speculate(e, chunk, Millis(0), Millis(1_000_000));
        }
        let st = idx.stats();
        assert_eq!(st.blocks, 20_000);
        assert_eq!(st.table_growths_shared, 0);
        assert!(st.table_growths_blocking >= 4 * 10, "{st:?}");
    }

    /// While a shard's table is being copied to grow (a reader holds its shared lock and the
    /// shard is marked growing), speculation drops its writes to that shard instead of waiting
    /// for the copy, and counts them; the other shards get theirs.
    #[test]
    fn speculation_skips_a_shard_whose_table_is_being_copied() {
        let idx = KvIndex::new(IndexConfig {
            shards: 4,
            capacity: 1 << 20,
        })
        .unwrap();
        let e = EndpointId::new(2).unwrap();
        let keys: Vec<BlockKey> = (0..400).map(key).collect();
        let in_0 = keys.iter().filter(|&&k| idx.shard_of(k) == 0).count();
        assert!(in_0 > 0 && in_0 < keys.len());
        let (done, finished) = mpsc::channel();
        std::thread::scope(|s| {
            let copying = idx.shards[0].read().unwrap();
            idx.growing[0].fetch_add(1, Relaxed);
            s.spawn(|| {
                idx.speculate(e, &keys, Millis(0), Millis(1_000));
                done.send(()).unwrap();
            });
            // A generous bound only so a regression fails instead of hanging.
            finished
                .recv_timeout(Duration::from_secs(60))
                .expect("speculate waited for the copy");
            idx.growing[0].fetch_sub(1, Relaxed);
            drop(copying);
        });
        let st = idx.stats();
        assert_eq!(st.speculation_skipped, in_0 as u64);
        assert_eq!(st.blocks, keys.len() - in_0);
        assert_eq!(idx.any_waiting.load(Relaxed), 0);
        assert!(idx.waiting.iter().all(|w| w.load(Relaxed) == 0));
    }

    /// A writer leaves a shard alone while another writer's grown copy of its table is pending
    /// (an edit would waste the copy): it waits, then writes once the copy is installed.
    #[test]
    fn a_writer_waits_for_another_writers_pending_copy() {
        let idx = KvIndex::new(IndexConfig {
            shards: 4,
            capacity: 1 << 20,
        })
        .unwrap();
        let (a, b) = (EndpointId::new(1).unwrap(), EndpointId::new(2).unwrap());
        let keys: Vec<BlockKey> = (0..200).map(key).collect();
        idx.apply(Holder::Endpoint(a), &[stored(&keys)]);
        let more: Vec<BlockKey> = (200..208).map(key).collect();
        assert!(more.iter().any(|&k| idx.shard_of(k) == 0));
        let (done, finished) = mpsc::channel();
        std::thread::scope(|s| {
            // Another writer's copy of shard 0 is pending.
            idx.growing[0].fetch_add(1, Relaxed);
            s.spawn(|| {
                idx.apply(Holder::Endpoint(b), &[stored(&more)]);
                done.send(()).unwrap();
            });
            assert!(
                finished.recv_timeout(Duration::from_millis(200)).is_err(),
                "the writer edited a shard whose copy was pending"
            );
            idx.growing[0].fetch_sub(1, Relaxed);
            finished
                .recv_timeout(Duration::from_secs(60))
                .expect("the writer went on once the copy was gone");
        });
        assert_eq!(idx.find_matches(&more, &[b])[0].reaches()[0], 8);
        assert_eq!(idx.stats().table_growths_blocking, 0);
    }

    /// The EPP's request path must not wait behind a large ingest: while the endpoint's run
    /// log is held exclusively (as an `apply` holds it), `speculate` completes, lookups see
    /// the speculation, and the log entries it invalidated are zeroed before the log is let go.
    #[test]
    fn speculation_does_not_wait_for_a_busy_run_log() {
        let idx = KvIndex::new(IndexConfig {
            shards: 4,
            capacity: 1 << 20,
        })
        .unwrap();
        let e = EndpointId::new(3).unwrap();
        let holder = Holder::Endpoint(e).pack();
        let keys: Vec<BlockKey> = (0..40).map(key).collect();
        // The endpoint holds the first 20 blocks in host memory only (exact log entries).
        idx.apply(
            Holder::Endpoint(e),
            &[KvEvent::Stored {
                keys: keys[..20].to_vec(),
                parent: None,
                tier: Tier::Host,
                lora: None,
                token_count: 256,
            }],
        );
        entries_exact(&idx, holder);
        let reach = |idx: &KvIndex| idx.find_matches(&keys, &[e])[0].reaches();
        assert_eq!(reach(&idx), [0, 20, 20, 20]);

        let cell = idx.runs.get(holder).unwrap();
        let (done, finished) = mpsc::channel();
        std::thread::scope(|s| {
            cell.write(|_log| {
                s.spawn(|| {
                    idx.speculate(e, &keys[..30], Millis(0), Millis(100));
                    done.send(()).unwrap();
                });
                // A generous bound only so a regression fails instead of hanging: with the log
                // held here, a speculation waiting for it would never finish.
                finished
                    .recv_timeout(Duration::from_secs(60))
                    .expect("speculate waited for the busy run log");
                // Lookups cannot read the log now: they probe, and see the speculation.
                assert_eq!(reach(&idx), [30, 30, 30, 30]);
                // The host-only entries the speculation made stale wait for this writer.
                assert_eq!(cell.queued(), 20);
            });
        });
        // Released: the queued entries were zeroed first, so every entry is exact.
        entries_exact(&idx, holder);
        assert_eq!(reach(&idx), [30, 30, 30, 30]);
        // Confirmed by a GPU store, speculation goes; expiry of the rest leaves the host tier.
        idx.apply(
            Holder::Endpoint(e),
            &[KvEvent::Stored {
                keys: keys[..10].to_vec(),
                parent: None,
                tier: Tier::Gpu,
                lora: None,
                token_count: 256,
            }],
        );
        assert_eq!(idx.expire(Millis(100)), 20);
        entries_exact(&idx, holder);
        assert_eq!(reach(&idx), [10, 20, 20, 20]);
    }
}
