//! The publishing side's pure core: the store's events, per layout, sealed into kvgate
//! envelopes, and snapshots consistent with them.
//!
//! The daemon publishes one source per layout (`source.node` set, no pool or pod; `model` and
//! `block_size` from the layout), all under one random epoch per start. Each source's `seq`
//! is contiguous from 0. [`Outbox::snapshot`] seals what is pending first, so the resident
//! set it reports is exactly the effect of the envelopes below its `next_seq`.

use std::collections::BTreeMap;

use kv_events::envelope::{ENVELOPE_VERSION, EngineKind};
use kv_events::snapshot::{Snapshot, TierKeys};
use kv_events::{Envelope, KvEvent, Source, Tier};

use crate::store::{BlockStore, Layout, LayoutId};

/// Who the daemon is on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Kubernetes namespace.
    pub namespace: String,
    /// The node.
    pub node: String,
}

#[derive(Debug, Default)]
struct Stream {
    next_seq: u64,
    pending: Vec<KvEvent>,
}

/// The envelope source of one layout on one node.
fn node_source(identity: &Identity, layout: &Layout) -> Source {
    Source {
        namespace: identity.namespace.clone(),
        pool: None,
        pod: None,
        ip: None,
        port: None,
        dp_rank: 0,
        node: Some(identity.node.clone()),
        model: layout.model.clone(),
        engine: EngineKind::Kvbm,
        block_size: layout.block_size,
    }
}

/// Pending events per layout, and the sequence numbers already used.
#[derive(Debug)]
pub struct Outbox {
    identity: Identity,
    epoch: u64,
    max_keys: usize,
    streams: BTreeMap<LayoutId, Stream>,
}

/// A sealed envelope and the layout whose subject it goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// The layout.
    pub layout: LayoutId,
    /// The envelope.
    pub envelope: Envelope,
}

impl Outbox {
    /// An outbox for one daemon run. `max_keys_per_envelope` bounds what one envelope carries
    /// (the receivers' limit); a single event above it still travels alone.
    pub fn new(identity: Identity, epoch: u64, max_keys_per_envelope: usize) -> Self {
        Self {
            identity,
            epoch,
            max_keys: max_keys_per_envelope.max(1),
            streams: BTreeMap::new(),
        }
    }

    /// The epoch.
    pub const fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The envelope source of `layout`, `None` when the store does not know it.
    pub fn source(&self, store: &BlockStore, layout: LayoutId) -> Option<Source> {
        store.layout(layout).map(|l| node_source(&self.identity, l))
    }

    /// Starts over under `epoch`: every stream's `seq` restarts at 0 and pending events are
    /// dropped (receivers see the new epoch and fetch snapshots, which hold the current state).
    pub fn new_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        for stream in self.streams.values_mut() {
            *stream = Stream::default();
        }
    }

    /// Queues an event of `layout`.
    pub fn push(&mut self, layout: LayoutId, event: KvEvent) {
        let stream = self.streams.entry(layout).or_default();
        stream.pending.push(event);
    }

    /// Events waiting to be sealed.
    pub fn pending(&self) -> usize {
        self.streams.values().map(|s| s.pending.len()).sum()
    }

    /// Seals every pending event into envelopes of at most the configured keys each.
    pub fn seal(&mut self, store: &BlockStore, out: &mut Vec<Sealed>) {
        for (layout, stream) in &mut self.streams {
            if stream.pending.is_empty() {
                continue;
            }
            let Some(l) = store.layout(*layout) else {
                stream.pending.clear();
                continue;
            };
            let source = node_source(&self.identity, l);
            let mut batch: Vec<KvEvent> = Vec::new();
            let mut keys = 0usize;
            let mut emit = |batch: &mut Vec<KvEvent>, stream_seq: &mut u64| {
                out.push(Sealed {
                    layout: *layout,
                    envelope: Envelope {
                        v: ENVELOPE_VERSION,
                        source: source.clone(),
                        epoch: self.epoch,
                        seq: *stream_seq,
                        events: std::mem::take(batch),
                    },
                });
                *stream_seq += 1;
            };
            for event in stream.pending.drain(..) {
                let n = event.key_count();
                if !batch.is_empty() && keys + n > self.max_keys {
                    emit(&mut batch, &mut stream.next_seq);
                    keys = 0;
                }
                keys += n;
                batch.push(event);
            }
            if !batch.is_empty() {
                emit(&mut batch, &mut stream.next_seq);
            }
        }
    }

    /// Seals what is pending into `out`, then snapshots `layout`'s residency as of the end of
    /// its sealed stream.
    pub fn snapshot(
        &mut self,
        store: &BlockStore,
        layout: LayoutId,
        out: &mut Vec<Sealed>,
    ) -> Option<Snapshot> {
        self.seal(store, out);
        let source = self.source(store, layout)?;
        let next_seq = self.streams.get(&layout).map_or(0, |s| s.next_seq);
        let tiers = [Tier::Host, Tier::Remote]
            .into_iter()
            .map(|tier| TierKeys {
                tier,
                keys: store.resident(layout, tier),
            })
            .filter(|t| !t.keys.is_empty())
            .collect();
        Some(Snapshot {
            source,
            epoch: self.epoch,
            next_seq,
            tiers,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use bytes::Bytes;
    use kv_events::BlockKey;
    use proptest::prelude::*;

    use super::*;
    use crate::store::{Effect, StoreConfig};

    fn identity() -> Identity {
        Identity {
            namespace: "ns".into(),
            node: "node-a".into(),
        }
    }

    fn store() -> (BlockStore, LayoutId) {
        let mut s = BlockStore::new(StoreConfig {
            host_bytes: 4 * 8,
            remote_bytes: 8 * 8,
        });
        let l = s
            .register(Layout {
                model: "m".into(),
                dtype: "fp8".into(),
                layers: 2,
                block_size: 4,
                block_bytes: 8,
            })
            .unwrap();
        (s, l)
    }

    fn publish(outbox: &mut Outbox, fx: Vec<Effect>) {
        for e in fx {
            if let Effect::Publish { layout, event } = e {
                outbox.push(layout, event);
            }
        }
    }

    #[test]
    fn envelopes_are_bounded_contiguous_and_name_the_node() {
        let (mut s, l) = store();
        let mut outbox = Outbox::new(identity(), 7, 3);
        let mut fx = Vec::new();
        for k in 0..6u64 {
            let block = [(BlockKey(k), Bytes::from(vec![0u8; 8]))];
            s.offload(l, None, &block, &mut fx).unwrap();
        }
        publish(&mut outbox, fx);
        let mut out = Vec::new();
        outbox.seal(&s, &mut out);
        assert!(out.len() >= 2);
        for (i, sealed) in out.iter().enumerate() {
            let e = &sealed.envelope;
            assert_eq!((e.epoch, e.seq), (7, i as u64));
            assert!(e.events.iter().map(KvEvent::key_count).sum::<usize>() <= 3);
            assert_eq!(e.source.node.as_deref(), Some("node-a"));
            assert_eq!(e.source.engine, EngineKind::Kvbm);
            assert_eq!((e.source.pod.as_deref(), e.source.block_size), (None, 4));
        }
        assert_eq!(outbox.pending(), 0);
    }

    proptest! {
        /// Applying the envelopes below a snapshot's `next_seq` gives exactly the snapshot.
        #[test]
        fn snapshots_match_the_envelopes_before_them(
            keys in proptest::collection::vec(0u64..24, 1..80),
            at in 0usize..80,
        ) {
            let (mut s, l) = store();
            let mut outbox = Outbox::new(identity(), 1, 4);
            let mut sealed = Vec::new();
            let mut snap = None;
            for (i, k) in keys.iter().enumerate() {
                let mut fx = Vec::new();
                let block = [(BlockKey(*k), Bytes::from(vec![0u8; 8]))];
                s.offload(l, None, &block, &mut fx).unwrap();
                publish(&mut outbox, fx);
                if i == at {
                    snap = outbox.snapshot(&s, l, &mut sealed);
                }
                if i % 5 == 0 {
                    outbox.seal(&s, &mut sealed);
                }
            }
            let Some(snap) = snap else { return Ok(()); };
            let mut resident: HashSet<(BlockKey, Tier)> = HashSet::new();
            for e in sealed.iter().map(|s| &s.envelope).filter(|e| e.seq < snap.next_seq) {
                for ev in &e.events {
                    match ev {
                        KvEvent::Stored { keys, tier, .. } => {
                            resident.extend(keys.iter().map(|k| (*k, *tier)));
                        }
                        KvEvent::Removed { keys, tier } => {
                            for k in keys {
                                resident.remove(&(*k, *tier));
                            }
                        }
                        other => prop_assert!(false, "unexpected {:?}", other),
                    }
                }
            }
            prop_assert_eq!(resident, snap.entries().collect::<HashSet<_>>());
        }
    }
}
