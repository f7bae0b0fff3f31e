//! The publishing side's pure core: the store's events sealed into kvgate envelopes, and
//! snapshots consistent with them.
//!
//! The daemon is one KV-event source (the EPP keeps one stream per node): `source.node` set,
//! no pool or pod, the `model` and `block_size` it was started for (every layout must match),
//! one random epoch per start, `seq` contiguous from 0.
//!
//! Several layouts can hold the same key: the tensor-parallel shards of one layout *group*
//! (a block is usable only with every shard), and groups of other dtypes. The receiver keeps a
//! set of (key, tier), so the outbox counts shards per (key, tier, group) and complete groups
//! per (key, tier): it publishes `Stored` when the first group becomes complete and `Removed`
//! when the last stops being so. [`Outbox::snapshot`] seals what is pending first and reports
//! the counted set, so it is exactly the effect of the envelopes below its `next_seq`.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use kv_events::envelope::{ENVELOPE_VERSION, EngineKind};
use kv_events::snapshot::{Snapshot, TierKeys};
use kv_events::{BlockKey, Envelope, KvEvent, Source, Tier};

/// Who the daemon is on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Kubernetes namespace.
    pub namespace: String,
    /// The node.
    pub node: String,
    /// The served model (the key seed): every layout's model.
    pub model: String,
    /// Tokens per block: every layout's block size.
    pub block_size: u32,
}

/// Pending events, the sequence numbers used, and how many layouts hold each (key, tier).
#[derive(Debug)]
pub struct Outbox {
    identity: Identity,
    epoch: u64,
    max_keys: usize,
    next_seq: u64,
    pending: Vec<KvEvent>,
    pending_keys: usize,
    /// Per (key, tier, layout group): how many of the group's shards hold the key.
    shard_counts: HashMap<(BlockKey, Tier, u64), u32>,
    /// Per (key, tier): how many layout groups hold every shard of the key (published if > 0).
    holders: HashMap<(BlockKey, Tier), u32>,
}

/// The layout group an event comes from: all tensor-parallel shards of one layout
/// ([`Layout::group`](crate::store::Layout::group)), and how many there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// The group's fingerprint.
    pub id: u64,
    /// Its shard count.
    pub shards: u32,
}

impl Group {
    /// The group of `layout`.
    pub fn of(layout: &crate::store::Layout) -> Self {
        Self {
            id: layout.group(),
            shards: layout.shards.max(1),
        }
    }
}

impl Outbox {
    /// An outbox for one daemon run. `max_keys_per_envelope` bounds what one envelope carries
    /// (the receivers' limit); a single event above it still travels alone.
    pub fn new(identity: Identity, epoch: u64, max_keys_per_envelope: usize) -> Self {
        Self {
            identity,
            epoch,
            max_keys: max_keys_per_envelope.max(1),
            next_seq: 0,
            pending: Vec::new(),
            pending_keys: 0,
            shard_counts: HashMap::new(),
            holders: HashMap::new(),
        }
    }

    /// The envelope source.
    pub fn source(&self) -> Source {
        Source {
            namespace: self.identity.namespace.clone(),
            pool: None,
            pod: None,
            ip: None,
            port: None,
            dp_rank: 0,
            node: Some(self.identity.node.clone()),
            model: self.identity.model.clone(),
            engine: EngineKind::Kvbm,
            block_size: self.identity.block_size,
        }
    }

    /// Who the daemon is.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Starts over under `epoch`: `seq` restarts at 0 and pending events are dropped
    /// (receivers see the new epoch and fetch snapshots, which hold the current state).
    pub fn new_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.next_seq = 0;
        self.pending.clear();
        self.pending_keys = 0;
    }

    /// Queues the part of a layout's event that changes the published (key, tier) set: a key
    /// is published in a tier once every shard of it is held there under some layout group,
    /// and removed when no group holds all its shards any more.
    pub fn push(&mut self, group: Group, event: KvEvent) {
        match event {
            KvEvent::Stored {
                keys,
                parent,
                tier,
                lora,
                token_count,
            } => {
                let n = keys.len();
                let new: Vec<BlockKey> = keys
                    .into_iter()
                    .filter(|k| {
                        let c = self.shard_counts.entry((*k, tier, group.id)).or_insert(0);
                        *c += 1;
                        if *c != group.shards {
                            return false;
                        }
                        let h = self.holders.entry((*k, tier)).or_insert(0);
                        *h += 1;
                        *h == 1
                    })
                    .collect();
                if new.is_empty() {
                    return;
                }
                // A run part of which was already published (or is not whole yet) loses its
                // chain: no parent then.
                let whole = new.len() == n;
                let per_block = token_count / u32::try_from(n.max(1)).unwrap_or(u32::MAX);
                self.pending_keys += new.len();
                self.pending.push(KvEvent::Stored {
                    token_count: per_block.saturating_mul(new.len() as u32),
                    keys: new,
                    parent: if whole { parent } else { None },
                    tier,
                    lora,
                });
            }
            KvEvent::Removed { keys, tier } => {
                let gone: Vec<BlockKey> = keys
                    .into_iter()
                    .filter(|k| {
                        let Entry::Occupied(mut c) = self.shard_counts.entry((*k, tier, group.id))
                        else {
                            return false;
                        };
                        let was_complete = *c.get() == group.shards;
                        *c.get_mut() -= 1;
                        if *c.get() == 0 {
                            c.remove();
                        }
                        if !was_complete {
                            return false;
                        }
                        match self.holders.entry((*k, tier)) {
                            Entry::Occupied(mut h) if *h.get() > 1 => {
                                *h.get_mut() -= 1;
                                false
                            }
                            Entry::Occupied(h) => {
                                h.remove();
                                true
                            }
                            Entry::Vacant(_) => false,
                        }
                    })
                    .collect();
                if !gone.is_empty() {
                    self.pending_keys += gone.len();
                    self.pending.push(KvEvent::Removed { keys: gone, tier });
                }
            }
            KvEvent::Cleared { tier } => self.clear(tier),
            KvEvent::Unknown => {}
        }
    }

    /// Queues a `Cleared` of `tier` (all tiers when `None`) and forgets what it covered.
    pub fn clear(&mut self, tier: Option<Tier>) {
        match tier {
            None => {
                self.holders.clear();
                self.shard_counts.clear();
            }
            Some(t) => {
                self.holders.retain(|(_, held), _| *held != t);
                self.shard_counts.retain(|(_, held, _), _| *held != t);
            }
        }
        self.pending.push(KvEvent::Cleared { tier });
    }

    /// Events waiting to be sealed.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Block keys in the events waiting to be sealed.
    pub const fn pending_keys(&self) -> usize {
        self.pending_keys
    }

    /// Seals every pending event into envelopes of at most the configured keys each.
    pub fn seal(&mut self, out: &mut Vec<Envelope>) {
        if self.pending.is_empty() {
            return;
        }
        let source = self.source();
        let mut batch: Vec<KvEvent> = Vec::new();
        let mut keys = 0usize;
        self.pending_keys = 0;
        let events = std::mem::take(&mut self.pending);
        for event in events {
            let n = event.key_count();
            if !batch.is_empty() && keys + n > self.max_keys {
                out.push(self.envelope(&source, std::mem::take(&mut batch)));
                keys = 0;
            }
            keys += n;
            batch.push(event);
        }
        if !batch.is_empty() {
            out.push(self.envelope(&source, batch));
        }
    }

    fn envelope(&mut self, source: &Source, events: Vec<KvEvent>) -> Envelope {
        let seq = self.next_seq;
        self.next_seq += 1;
        Envelope {
            v: ENVELOPE_VERSION,
            source: source.clone(),
            epoch: self.epoch,
            seq,
            events,
        }
    }

    /// Seals what is pending into `out`, then snapshots the published (key, tier) set as of the
    /// end of the sealed stream.
    pub fn snapshot(&mut self, out: &mut Vec<Envelope>) -> Snapshot {
        self.seal(out);
        let source = self.source();
        let mut by_tier = Tier::ALL.map(|tier| (tier, Vec::new()));
        for (key, tier) in self.holders.keys() {
            if let Some((_, keys)) = by_tier.iter_mut().find(|(t, _)| t == tier) {
                keys.push(*key);
            }
        }
        let tiers = by_tier
            .into_iter()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(tier, keys)| TierKeys { tier, keys })
            .collect();
        Snapshot {
            source,
            epoch: self.epoch,
            next_seq: self.next_seq,
            tiers,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use bytes::Bytes;
    use proptest::prelude::*;

    use super::*;
    use crate::store::{BlockStore, Effect, Layout, LayoutId, StoreConfig};

    fn identity() -> Identity {
        Identity {
            namespace: "ns".into(),
            node: "node-a".into(),
            model: "m".into(),
            block_size: 4,
        }
    }

    /// A store of 4 host and 8 remote blocks with three layouts of one model: the two
    /// tensor-parallel shards of an fp8 layout, and a whole bf16 one.
    fn store() -> (BlockStore, [LayoutId; 3]) {
        let mut s = BlockStore::new(StoreConfig {
            host_bytes: 4 * 8,
            disk_bytes: 0,
            remote_bytes: 8 * 8,
            max_pins: 0,
            disk_min_uses: 0,
            disk_write_through: false,
        });
        let layout = |dtype: &str, shard, shards| Layout {
            model: "m".into(),
            dtype: dtype.into(),
            layers: 2,
            block_size: 4,
            block_bytes: 8,
            shard,
            shards,
        };
        let a0 = s.register(layout("fp8", 0, 2)).unwrap();
        let a1 = s.register(layout("fp8", 1, 2)).unwrap();
        let b = s.register(layout("bf16", 0, 1)).unwrap();
        (s, [a0, a1, b])
    }

    fn publish(store: &BlockStore, outbox: &mut Outbox, fx: Vec<Effect>) {
        for e in fx {
            if let Effect::Publish { layout, event } = e {
                outbox.push(Group::of(store.layout(layout).unwrap()), event);
            }
        }
    }

    fn apply(resident: &mut HashSet<(BlockKey, Tier)>, e: &Envelope) {
        for ev in &e.events {
            match ev {
                KvEvent::Stored { keys, tier, .. } => {
                    for k in keys {
                        assert!(resident.insert((*k, *tier)), "stored twice");
                    }
                }
                KvEvent::Removed { keys, tier } => {
                    for k in keys {
                        assert!(resident.remove(&(*k, *tier)), "removed but absent");
                    }
                }
                KvEvent::Cleared { tier: None } => resident.clear(),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// What the node can serve: keys whose every fp8 shard is held in a tier, or whose bf16
    /// block is.
    fn usable(s: &BlockStore, [a0, a1, b]: [LayoutId; 3]) -> HashSet<(BlockKey, Tier)> {
        let mut out = HashSet::new();
        for tier in Tier::ALL {
            let h1: HashSet<BlockKey> = s.resident(a1, tier).into_iter().collect();
            out.extend(
                s.resident(a0, tier)
                    .into_iter()
                    .filter(|k| h1.contains(k))
                    .map(|k| (k, tier)),
            );
            out.extend(s.resident(b, tier).into_iter().map(|k| (k, tier)));
        }
        out
    }

    fn offload(s: &mut BlockStore, outbox: &mut Outbox, l: LayoutId, k: u64) {
        let mut fx = Vec::new();
        let block = [(BlockKey(k), Bytes::from(vec![0u8; 8]))];
        s.offload(l, None, &block, &mut fx).unwrap();
        publish(s, outbox, fx);
    }

    #[test]
    fn envelopes_are_bounded_contiguous_and_name_the_node() {
        let (mut s, [_, _, b]) = store();
        let mut outbox = Outbox::new(identity(), 7, 3);
        for k in 0..6u64 {
            offload(&mut s, &mut outbox, b, k);
        }
        let mut out = Vec::new();
        outbox.seal(&mut out);
        assert!(out.len() >= 2);
        for (i, e) in out.iter().enumerate() {
            assert_eq!((e.epoch, e.seq), (7, i as u64));
            assert!(e.events.iter().map(KvEvent::key_count).sum::<usize>() <= 3);
            assert_eq!(e.source.node.as_deref(), Some("node-a"));
            assert_eq!(e.source.engine, EngineKind::Kvbm);
            assert_eq!((e.source.pod.as_deref(), e.source.block_size), (None, 4));
        }
        assert_eq!(outbox.pending(), 0);
    }

    #[test]
    fn a_block_is_published_once_every_shard_holds_it() {
        let (mut s, [a0, a1, _]) = store();
        let mut outbox = Outbox::new(identity(), 1, 100);
        let keys = |outbox: &mut Outbox| {
            let mut out = Vec::new();
            outbox.seal(&mut out);
            out.iter()
                .flat_map(|e| &e.events)
                .map(KvEvent::key_count)
                .sum::<usize>()
        };
        offload(&mut s, &mut outbox, a0, 1);
        assert_eq!(
            keys(&mut outbox),
            0,
            "one shard of two is not a usable block"
        );
        offload(&mut s, &mut outbox, a1, 1);
        assert_eq!(keys(&mut outbox), 1);
    }

    proptest! {
        /// Applying the envelopes below a snapshot's `next_seq` gives exactly the snapshot, and
        /// applying them all gives what the store can serve: every shard of a block, or a
        /// whole block of another layout.
        #[test]
        fn snapshots_and_streams_match_the_store(
            ops in proptest::collection::vec((0usize..3, 0u64..12), 1..80),
            at in 0usize..80,
        ) {
            let (mut s, layouts) = store();
            let mut outbox = Outbox::new(identity(), 1, 4);
            let mut sealed = Vec::new();
            let mut snap = None;
            for (i, (l, k)) in ops.iter().enumerate() {
                offload(&mut s, &mut outbox, layouts[*l], *k);
                if i == at {
                    snap = Some(outbox.snapshot(&mut sealed));
                }
                if i % 5 == 0 {
                    outbox.seal(&mut sealed);
                }
            }
            outbox.seal(&mut sealed);
            let mut all: HashSet<(BlockKey, Tier)> = HashSet::new();
            for e in &sealed {
                apply(&mut all, e);
            }
            prop_assert_eq!(&all, &usable(&s, layouts));
            let Some(snap) = snap else { return Ok(()); };
            let mut upto: HashSet<(BlockKey, Tier)> = HashSet::new();
            for e in sealed.iter().filter(|e| e.seq < snap.next_seq) {
                apply(&mut upto, e);
            }
            prop_assert_eq!(upto, snap.entries().collect::<HashSet<_>>());
        }
    }
}
