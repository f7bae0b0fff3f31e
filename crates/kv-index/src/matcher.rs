//! The prefix walk behind [`crate::KvIndex::find_matches`], kept apart from locking so the
//! algorithm is one readable loop over "who holds key i".
//!
//! Each candidate keeps a *level*: the fastest tier whose reach is still growing (4 = none).
//! At key `i` a candidate's best tier `b` is the fastest tier any of its holders (itself, its
//! node) has the block in; tiers faster than `b` stop at `i`, and with no tier it stops
//! altogether. The walk ends as soon as no candidate is still growing.

use kv_events::fasthash::U64Map;

use crate::block::{ALL_TIERS, Bits, Residency, effective, tier_bit};
use crate::id::{EndpointId, Holder};
use crate::overlap::Overlap;

const NONE: u32 = u32::MAX;
const DEAD: u8 = 4;

#[derive(Debug, Clone, Copy)]
struct Cand {
    endpoint: EndpointId,
    reach: [u32; 4],
    level: u8,
    mark_bits: Bits,
    /// The key index (+1) `mark_bits` belongs to.
    mark_key: u32,
    next_on_node: u32,
}

/// Reusable scratch for one thread's lookups.
#[derive(Debug, Default)]
pub(crate) struct Matcher {
    generation: u32,
    /// Indexed by endpoint id: (generation, candidate slot).
    ep_slot: Vec<(u32, u32)>,
    cands: Vec<Cand>,
    /// Result position → candidate slot (repeated candidates share a slot).
    order: Vec<u32>,
    alive: Vec<u32>,
    node_head: U64Map<u32, u32>,
}

const NODE_TIERS: Bits = ALL_TIERS & !tier_bit(kv_events::Tier::Gpu);

impl Matcher {
    /// Starts a lookup for `candidates`; `node_of` gives an endpoint's node, if known.
    pub(crate) fn begin(
        &mut self,
        candidates: &[EndpointId],
        node_of: impl Fn(EndpointId) -> Option<u32>,
    ) {
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.ep_slot.iter_mut().for_each(|e| *e = (0, 0));
            self.generation = 1;
        }
        let gen_ = self.generation;
        self.cands.clear();
        self.order.clear();
        self.alive.clear();
        self.node_head.clear();
        let max = candidates
            .iter()
            .map(|e| e.get() as usize + 1)
            .max()
            .unwrap_or(0);
        if self.ep_slot.len() < max {
            self.ep_slot.resize(max, (0, 0));
        }
        for &ep in candidates {
            let Some(entry) = self.ep_slot.get_mut(ep.get() as usize) else {
                continue;
            };
            if entry.0 == gen_ {
                self.order.push(entry.1);
                continue;
            }
            let slot = u32::try_from(self.cands.len()).unwrap_or(NONE);
            *entry = (gen_, slot);
            let next_on_node = match node_of(ep) {
                Some(node) => self.node_head.insert(node, slot).unwrap_or(NONE),
                None => NONE,
            };
            self.cands.push(Cand {
                endpoint: ep,
                reach: [0; 4],
                level: 0,
                mark_bits: 0,
                mark_key: 0,
                next_on_node,
            });
            self.order.push(slot);
            self.alive.push(slot);
        }
    }

    /// Whether any candidate can still extend its match.
    pub(crate) fn any_alive(&self) -> bool {
        !self.alive.is_empty()
    }

    /// Feeds the holders of key `i` (none when the key is unknown); returns [`Self::any_alive`].
    pub(crate) fn key(&mut self, i: u32, holders: impl Iterator<Item = Residency>) -> bool {
        let stamp = i + 1;
        for r in holders {
            match Holder::unpack(r.holder) {
                Holder::Endpoint(ep) => {
                    let Some(&(g, slot)) = self.ep_slot.get(ep.get() as usize) else {
                        continue;
                    };
                    if g == self.generation {
                        mark(&mut self.cands, slot, stamp, effective(r.bits));
                    }
                }
                Holder::Node(node) => {
                    let bits = r.bits & NODE_TIERS;
                    let mut slot = self.node_head.get(&node.get()).copied().unwrap_or(NONE);
                    while slot != NONE && bits != 0 {
                        mark(&mut self.cands, slot, stamp, bits);
                        slot = self
                            .cands
                            .get(slot as usize)
                            .map_or(NONE, |c| c.next_on_node);
                    }
                }
            }
        }
        let cands = &mut self.cands;
        self.alive.retain(|&slot| {
            let Some(c) = cands.get_mut(slot as usize) else {
                return false;
            };
            let bits = if c.mark_key == stamp { c.mark_bits } else { 0 };
            // The fastest tier holding this block; DEAD when none does.
            let best = if bits == 0 {
                DEAD
            } else {
                bits.trailing_zeros() as u8
            };
            if best > c.level {
                for t in c.level..best {
                    if let Some(r) = c.reach.get_mut(t as usize) {
                        *r = i;
                    }
                }
                c.level = best;
            }
            c.level < DEAD
        });
        self.any_alive()
    }

    /// Ends the walk after `n` keys and writes one overlap per requested candidate.
    pub(crate) fn finish(&mut self, n: u32, out: &mut Vec<Overlap>) {
        for &slot in &self.alive {
            if let Some(c) = self.cands.get_mut(slot as usize) {
                for t in c.level..DEAD {
                    if let Some(r) = c.reach.get_mut(t as usize) {
                        *r = n;
                    }
                }
            }
        }
        out.extend(
            self.order
                .iter()
                .filter_map(|&slot| self.cands.get(slot as usize))
                .map(|c| Overlap::new(c.endpoint, c.reach)),
        );
    }
}

fn mark(cands: &mut [Cand], slot: u32, stamp: u32, bits: Bits) {
    if let Some(c) = cands.get_mut(slot as usize) {
        if c.mark_key != stamp {
            c.mark_key = stamp;
            c.mark_bits = 0;
        }
        c.mark_bits |= bits;
    }
}
