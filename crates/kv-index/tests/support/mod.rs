//! A deliberately naive reference model of the index: a map from key to a set of
//! (holder, bit) pairs and a linear scan per candidate. Shared by the property tests.

#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, HashSet};

use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, Millis, NodeId};

/// Bit 4 stands for "speculative GPU".
const SPEC: u8 = 4;

#[derive(Debug, Default)]
pub struct Model {
    held: HashMap<BlockKey, HashSet<(Holder, u8)>>,
    spec: HashMap<(BlockKey, EndpointId), u64>,
    pub node_of: HashMap<EndpointId, NodeId>,
    /// Record every speculation, even on a block the endpoint has in GPU (where the index's
    /// is a no-op). A bounded index that evicted that block records it, so this is the bound
    /// an evicting index must stay within.
    pub spec_always: bool,
}

impl Model {
    fn set(&mut self, k: BlockKey, h: Holder, bit: u8, on: bool) {
        let e = self.held.entry(k).or_default();
        if on {
            e.insert((h, bit));
        } else {
            e.remove(&(h, bit));
        }
    }

    fn drop_spec(&mut self, k: BlockKey, h: Holder) {
        if let Holder::Endpoint(ep) = h {
            self.spec.remove(&(k, ep));
            self.set(k, h, SPEC, false);
        }
    }

    pub fn apply(&mut self, h: Holder, events: &[KvEvent]) {
        for ev in events {
            match ev {
                KvEvent::Stored { keys, tier, .. } => {
                    for &k in keys {
                        if *tier == Tier::Gpu {
                            self.drop_spec(k, h);
                        }
                        self.set(k, h, tier.index() as u8, true);
                    }
                }
                KvEvent::Removed { keys, tier } => {
                    for &k in keys {
                        if *tier == Tier::Gpu {
                            self.drop_spec(k, h);
                        }
                        self.set(k, h, tier.index() as u8, false);
                    }
                }
                KvEvent::Cleared { tier } => {
                    let spec_too = matches!(tier, None | Some(Tier::Gpu));
                    for set in self.held.values_mut() {
                        set.retain(|&(hh, bit)| {
                            hh != h
                                || !(tier.is_none_or(|t| t.index() as u8 == bit)
                                    || (spec_too && bit == SPEC))
                        });
                    }
                    if spec_too {
                        self.spec.retain(|&(_, ep), _| Holder::Endpoint(ep) != h);
                    }
                }
                KvEvent::Unknown => {}
            }
        }
    }

    pub fn replace_source(&mut self, h: Holder, snapshot: &[(BlockKey, Tier)]) {
        for set in self.held.values_mut() {
            set.retain(|&(hh, bit)| hh != h || bit == SPEC);
        }
        for &(k, t) in snapshot {
            self.apply(
                h,
                &[KvEvent::Stored {
                    keys: vec![k],
                    parent: None,
                    tier: t,
                    lora: None,
                    token_count: 0,
                }],
            );
        }
    }

    pub fn remove_source(&mut self, h: Holder) {
        for set in self.held.values_mut() {
            set.retain(|&(hh, _)| hh != h);
        }
        self.spec.retain(|&(_, ep), _| Holder::Endpoint(ep) != h);
    }

    pub fn speculate(&mut self, ep: EndpointId, keys: &[BlockKey], now: Millis, ttl: Millis) {
        let h = Holder::Endpoint(ep);
        for &k in keys {
            if !self.spec_always && self.held.get(&k).is_some_and(|s| s.contains(&(h, 0))) {
                continue;
            }
            self.spec.insert((k, ep), now.0.saturating_add(ttl.0));
            self.set(k, h, SPEC, true);
        }
    }

    pub fn expire(&mut self, now: Millis) -> usize {
        let gone: Vec<_> = self
            .spec
            .iter()
            .filter(|(_, d)| **d <= now.0)
            .map(|(k, _)| *k)
            .collect();
        for &(k, ep) in &gone {
            self.drop_spec(k, Holder::Endpoint(ep));
        }
        gone.len()
    }

    /// The fastest-tier mask `ep` can serve `k` from.
    fn tiers(&self, k: BlockKey, ep: EndpointId) -> u8 {
        let node = self.node_of.get(&ep).copied();
        let mut mask = 0u8;
        for &(h, bit) in self.held.get(&k).into_iter().flatten() {
            match h {
                Holder::Endpoint(e) if e == ep => mask |= 1 << if bit == SPEC { 0 } else { bit },
                Holder::Node(n) if Some(n) == node && bit != 0 && bit != SPEC => mask |= 1 << bit,
                _ => {}
            }
        }
        mask
    }

    /// Per-tier reach: for each tier t, the first key not held in any tier ≤ t.
    pub fn find(&self, keys: &[BlockKey], ep: EndpointId) -> [u32; 4] {
        let mut out = [0u32; 4];
        for (t, r) in out.iter_mut().enumerate() {
            let allowed = (1u8 << (t + 1)) - 1;
            *r = keys
                .iter()
                .take_while(|&&k| self.tiers(k, ep) & allowed != 0)
                .count() as u32;
        }
        out
    }

    /// `h`'s residencies (blocks it holds in any tier, speculative ones included).
    pub fn residencies_of(&self, h: Holder) -> usize {
        self.held
            .values()
            .filter(|s| s.iter().any(|&(x, _)| x == h))
            .count()
    }

    pub fn residencies(&self) -> usize {
        self.held
            .values()
            .map(|s| s.iter().map(|&(h, _)| h).collect::<HashSet<_>>().len())
            .sum()
    }
}
