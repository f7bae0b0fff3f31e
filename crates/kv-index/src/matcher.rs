//! The prefix walk behind [`crate::KvIndex::find_matches`], kept apart from locking so the
//! algorithm is one readable loop over "who holds key i".
//!
//! Each live candidate keeps a *level*: the fastest tier whose reach is still growing (4 =
//! none). At key `i` a candidate's best tier `b` is the fastest tier any of its holders
//! (itself, its node) has the block in; tiers faster than `b` stop at `i`, and with no tier it
//! stops altogether. The walk ends as soon as no candidate is still growing.
//!
//! Costs: only candidates holding key 0 (directly or through their node) get state, so a
//! lookup against `c` candidates is O(c) for the id map and the output plus O(holders) per key.
//! A key whose holder list equals the previous key's changes nothing and is skipped after one
//! comparison (a shared prefix's blocks have the same holders); with one live candidate each
//! key is a direct check of the block's (sorted) holders.

use crate::id::{EndpointId, Holder};
use crate::overlap::Overlap;
use crate::table::{ALL_TIERS, Bits, ENTRY_MASK, Holders, effective, entry_holder, tier_bit};

const DEAD: u8 = 4;
/// A candidate's node not looked up yet.
const UNRESOLVED: u32 = u32::MAX - 1;
/// A candidate on no known node.
const NO_NODE: u32 = u32::MAX;
const NODE_BIT: u32 = 1 << 31;
const NODE_TIERS: Bits = ALL_TIERS & !tier_bit(kv_events::Tier::Gpu);

#[derive(Debug, Clone, Copy)]
struct Cand {
    endpoint: u32,
    /// The candidate's (first) position in the caller's list.
    pos: u32,
    /// The node's packed holder id, or `UNRESOLVED` / `NO_NODE`.
    node: u32,
    reach: [u32; 4],
    level: u8,
    mark_bits: Bits,
    /// The key index (+1) `mark_bits` belongs to.
    mark_key: u32,
}

impl Cand {
    /// Folds key `i`'s best-tier mask into the level; returns whether still growing.
    fn advance(&mut self, i: u32, bits: Bits) -> bool {
        let best = if bits == 0 {
            DEAD
        } else {
            bits.trailing_zeros() as u8
        };
        if best > self.level {
            for t in self.level..best {
                if let Some(r) = self.reach.get_mut(t as usize) {
                    *r = i;
                }
            }
            self.level = best;
        }
        self.level < DEAD
    }

    fn mark(&mut self, stamp: u32, bits: Bits) {
        if self.mark_key != stamp {
            self.mark_key = stamp;
            self.mark_bits = 0;
        }
        self.mark_bits |= bits;
    }
}

/// A candidate with state: the id map's value is then its state index, else its position.
const CREATED: u32 = 1 << 31;

/// Endpoint id → candidate position, or state index once created (with [`CREATED`]);
/// generation-stamped so a lookup never clears it.
/// Dense (indexed by id) while ids are small relative to the candidate count, else a small
/// open-addressing table sized by the candidate count.
#[derive(Debug, Default)]
struct IdMap {
    generation: u32,
    dense: bool,
    /// Dense: `generation << 32 | value` by id. Sparse: the same, paired with the id.
    by_id: Vec<u64>,
    table: Vec<(u64, u32)>,
    shift: u32,
}

impl IdMap {
    fn reset(&mut self, candidates: &[EndpointId]) {
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.by_id.iter_mut().for_each(|e| *e = 0);
            self.table.iter_mut().for_each(|e| *e = (0, 0));
            self.generation = 1;
        }
        let max = candidates.iter().map(|e| e.get()).max().unwrap_or(0) as usize;
        self.dense = max < 16 * candidates.len() + 4096;
        if self.dense {
            if self.by_id.len() <= max {
                self.by_id.resize(max + 1, 0);
            }
        } else {
            let want = (2 * candidates.len()).next_power_of_two().max(16);
            if self.table.len() < want {
                self.table = vec![(0, 0); want];
                self.shift = 64 - want.trailing_zeros();
            }
        }
    }

    fn tag(&self, value: u32) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(value)
    }

    fn live(&self, e: u64) -> Option<u32> {
        (e >> 32 == u64::from(self.generation)).then_some(e as u32)
    }

    /// The sparse table's slot for `id`: its entry or the vacant slot where it would go.
    fn slot(&self, id: u32) -> usize {
        let mask = self.table.len() - 1;
        let mut i = (u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize;
        while let Some(&(e, k)) = self.table.get(i) {
            if self.live(e).is_none() || k == id {
                return i;
            }
            i = (i + 1) & mask;
        }
        i
    }

    fn get(&self, id: u32) -> Option<u32> {
        if self.dense {
            self.by_id.get(id as usize).and_then(|&e| self.live(e))
        } else {
            let (e, k) = self.table.get(self.slot(id)).copied()?;
            self.live(e).filter(|_| k == id)
        }
    }

    fn set(&mut self, id: u32, value: u32) {
        let tagged = self.tag(value);
        if self.dense {
            if let Some(e) = self.by_id.get_mut(id as usize) {
                *e = tagged;
            }
        } else {
            let i = self.slot(id);
            if let Some(e) = self.table.get_mut(i) {
                *e = (tagged, id);
            }
        }
    }
}

/// Where an endpoint runs, for node tiers (looked up lazily: most walks never need it).
pub(crate) trait NodeOf {
    /// The node's raw id, if known.
    fn node_of(&self, endpoint: u32) -> Option<u32>;
}

/// Reusable scratch for one thread's lookups.
#[derive(Debug, Default)]
pub(crate) struct Matcher {
    ids: IdMap,
    /// Some candidate is listed twice.
    repeats: bool,
    /// The candidates `ids` was built for: a lookup with the same list (the EPP passes its
    /// pool's endpoints each time) keeps the map and only undoes the states the last one
    /// created, instead of mapping every candidate again.
    mapped: Vec<EndpointId>,
    cands: Vec<Cand>,
    alive: Vec<u32>,
    started: bool,
    /// The previous key's holders: a one-holder entry, or (with `prev_many`) a list.
    prev_one: Option<u64>,
    prev_many: Vec<u64>,
    prev_is_many: bool,
}

impl Matcher {
    /// Starts a lookup for `candidates`.
    pub(crate) fn begin(&mut self, candidates: &[EndpointId]) {
        if self.mapped.as_slice() == candidates {
            for c in &self.cands {
                self.ids.set(c.endpoint, c.pos);
            }
        } else {
            self.ids.reset(candidates);
            self.repeats = false;
            for (p, ep) in candidates.iter().enumerate() {
                match u32::try_from(p) {
                    Ok(p) if p < CREATED && self.ids.get(ep.get()).is_none() => {
                        self.ids.set(ep.get(), p);
                    }
                    // A repeat (or a position too large to record): finish looks each one up.
                    _ => self.repeats = true,
                }
            }
            self.mapped.clear();
            self.mapped.extend_from_slice(candidates);
        }
        self.cands.clear();
        self.alive.clear();
        self.started = false;
        self.prev_one = None;
        self.prev_is_many = false;
    }

    /// The state index of candidate `ep`, if it has state.
    fn cand_of(&self, ep: u32) -> Option<u32> {
        self.ids
            .get(ep)
            .filter(|v| v & CREATED != 0)
            .map(|v| v & !CREATED)
    }

    /// Whether the walk must go on (no key seen yet, or some candidate still growing).
    pub(crate) fn wants_more(&self) -> bool {
        !self.started || !self.alive.is_empty()
    }

    /// Whether `h` equals the previous key's holders (then key `i` changes nothing).
    fn same_as_prev(&mut self, h: Holders<'_>) -> bool {
        match h {
            Holders::None => false,
            Holders::One(e) => {
                let same = !self.prev_is_many && self.prev_one == Some(e);
                self.prev_one = Some(e);
                self.prev_is_many = false;
                same
            }
            Holders::Many(list) => {
                // Without an early exit, so the comparison vectorises: a shared prefix's
                // blocks (tens of holders each) all take this path, and most are equal.
                if self.prev_is_many
                    && self.prev_many.len() == list.len()
                    && self
                        .prev_many
                        .iter()
                        .zip(list)
                        .fold(0, |diff, (&a, &b)| diff | (a ^ (b & ENTRY_MASK)))
                        == 0
                {
                    return true;
                }
                self.prev_many.clear();
                self.prev_many.extend(list.iter().map(|&e| e & ENTRY_MASK));
                self.prev_is_many = true;
                self.prev_one = None;
                false
            }
        }
    }

    /// Feeds the holders of key `i` (keys come in order from 0); returns
    /// [`Matcher::wants_more`].
    pub(crate) fn key(
        &mut self,
        i: u32,
        holders: Holders<'_>,
        candidates: &[EndpointId],
        nodes: &impl NodeOf,
    ) -> bool {
        if !self.started {
            self.started = true;
            self.same_as_prev(holders);
            self.first(holders, candidates, nodes);
        } else if self.same_as_prev(holders) {
            // Same holders as key i-1: every level stays as it is.
        } else if let [only] = self.alive[..] {
            self.one(i, only, holders, nodes);
        } else {
            self.many(i, holders, nodes);
        }
        self.wants_more()
    }

    /// Key 0: creates state for the candidates holding it.
    fn first(&mut self, holders: Holders<'_>, candidates: &[EndpointId], nodes: &impl NodeOf) {
        let mut node_holders = false;
        holders.for_each(|h, bits| match Holder::unpack(h) {
            Holder::Endpoint(ep) => {
                if let Some(c) = self.state(ep.get(), UNRESOLVED)
                    && let Some(cand) = self.cands.get_mut(c as usize)
                {
                    cand.mark(1, effective(bits));
                }
            }
            Holder::Node(_) => node_holders |= bits & NODE_TIERS != 0,
        });
        if node_holders {
            // Candidates on a node holding key 0 start too, even without blocks of their own.
            for ep in candidates {
                let ep = ep.get();
                let node = nodes.node_of(ep).map_or(NO_NODE, |n| n | NODE_BIT);
                let bits = match node {
                    NO_NODE => 0,
                    n => holders.bits_of(n) & NODE_TIERS,
                };
                let c = match self.cand_of(ep) {
                    Some(c) => c,
                    None if bits != 0 => match self.state(ep, node) {
                        Some(c) => c,
                        None => continue,
                    },
                    None => continue,
                };
                if let Some(cand) = self.cands.get_mut(c as usize) {
                    cand.node = node;
                    cand.mark(1, bits);
                }
            }
        }
        for c in 0..self.cands.len() {
            if let Some(cand) = self.cands.get_mut(c) {
                let bits = if cand.mark_key == 1 {
                    cand.mark_bits
                } else {
                    0
                };
                if cand.advance(0, bits) {
                    self.alive.push(c as u32);
                }
            }
        }
    }

    /// Candidate `endpoint`'s state index, creating the state if it has none; `None` when it
    /// is not a candidate.
    fn state(&mut self, endpoint: u32, node: u32) -> Option<u32> {
        let v = self.ids.get(endpoint)?;
        if v & CREATED != 0 {
            return Some(v & !CREATED);
        }
        let c = u32::try_from(self.cands.len())
            .ok()
            .filter(|&c| c < CREATED)?;
        self.cands.push(Cand {
            endpoint,
            pos: v,
            node,
            reach: [0; 4],
            level: 0,
            mark_bits: 0,
            mark_key: 0,
        });
        self.ids.set(endpoint, c | CREATED);
        Some(c)
    }

    fn resolve(cand: &mut Cand, nodes: &impl NodeOf) -> u32 {
        if cand.node == UNRESOLVED {
            cand.node = nodes
                .node_of(cand.endpoint)
                .map_or(NO_NODE, |n| n | NODE_BIT);
        }
        cand.node
    }

    /// One live candidate: look its endpoint (and node) up in the block's sorted holders.
    fn one(&mut self, i: u32, c: u32, holders: Holders<'_>, nodes: &impl NodeOf) {
        let Some(cand) = self.cands.get_mut(c as usize) else {
            return;
        };
        let mut bits = effective(holders.bits_of(cand.endpoint));
        let node_held = match holders {
            Holders::None => false,
            Holders::One(e) => entry_holder(e) & NODE_BIT != 0,
            Holders::Many(list) => list
                .last()
                .is_some_and(|&e| entry_holder(e) & NODE_BIT != 0),
        };
        if node_held {
            let node = Self::resolve(cand, nodes);
            if node != NO_NODE {
                bits |= holders.bits_of(node) & NODE_TIERS;
            }
        }
        if !cand.advance(i, bits) {
            self.alive.clear();
        }
    }

    /// Several live candidates: mark each from the holders, then advance them all.
    fn many(&mut self, i: u32, holders: Holders<'_>, nodes: &impl NodeOf) {
        let stamp = i + 1;
        let (ids, cands, alive) = (&self.ids, &mut self.cands, &self.alive);
        holders.for_each(|h, bits| {
            if h & NODE_BIT == 0 {
                let c = ids
                    .get(h)
                    .filter(|v| v & CREATED != 0)
                    .map(|v| v & !CREATED);
                if let Some(cand) = c.and_then(|c| cands.get_mut(c as usize)) {
                    cand.mark(stamp, effective(bits));
                }
            } else if bits & NODE_TIERS != 0 {
                for &c in alive {
                    if let Some(cand) = cands.get_mut(c as usize)
                        && Self::resolve(cand, nodes) == h
                    {
                        cand.mark(stamp, bits & NODE_TIERS);
                    }
                }
            }
        });
        let cands = &mut self.cands;
        self.alive.retain(|&c| {
            cands.get_mut(c as usize).is_some_and(|cand| {
                let bits = if cand.mark_key == stamp {
                    cand.mark_bits
                } else {
                    0
                };
                cand.advance(i, bits)
            })
        });
    }

    /// Ends the walk after `n` keys and writes one overlap per requested candidate.
    pub(crate) fn finish(&mut self, n: u32, candidates: &[EndpointId], out: &mut Vec<Overlap>) {
        for &c in &self.alive {
            if let Some(cand) = self.cands.get_mut(c as usize) {
                for t in cand.level..DEAD {
                    if let Some(r) = cand.reach.get_mut(t as usize) {
                        *r = n;
                    }
                }
            }
        }
        let base = out.len();
        out.extend(candidates.iter().map(|&ep| Overlap::new(ep, [0; 4])));
        let Some(out) = out.get_mut(base..) else {
            return;
        };
        if self.repeats {
            for o in out.iter_mut() {
                if let Some(c) = self
                    .cand_of(o.endpoint.get())
                    .and_then(|c| self.cands.get(c as usize))
                {
                    o.reach = c.reach;
                }
            }
        } else {
            // Only candidates holding key 0 have state: patch their rows.
            for c in &self.cands {
                if let Some(o) = out.get_mut(c.pos as usize) {
                    o.reach = c.reach;
                }
            }
        }
    }
}
