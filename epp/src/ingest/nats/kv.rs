//! The KV side of NATS ingestion without the network: decoded envelopes, snapshot results and
//! ticks in; index writes, load samples and snapshot orders out. One [`SourceSync`] per holder.
//!
//! The async adapter ([`super::adapter`]) owns one of these, feeds it what arrives and performs
//! the [`FetchOrder`]s it returns.

use std::collections::HashMap;
use std::sync::Arc;

use kv_events::load::LoadSample;
use kv_events::snapshot::{Snapshot, SnapshotRequest};
use kv_events::{Envelope, Source, subject};
use kv_index::{Holder, KvIndex, Millis};
use kv_sync::{Effect, SourceSync, SyncConfig};
use scheduler::{EngineLoad, LoadBook};

use super::resolve::Resolver;
use super::stats::{NatsStats, add, set};

/// Unknown sources remembered (to ask for their snapshot once discovery knows them).
const MAX_PENDING_UNKNOWN: usize = 1024;

/// A snapshot request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchOrder {
    /// The source's holder.
    pub holder: Holder,
    /// The request id to pass back.
    pub id: u64,
    /// Where to send it.
    pub subject: String,
    /// What to send.
    pub request: SnapshotRequest,
}

/// What became of a fetch.
#[derive(Debug)]
pub enum FetchResult {
    /// A complete, well-formed snapshot.
    Done(Snapshot),
    /// No usable reply (send failed, malformed or mismatched chunks, timeout).
    Failed,
}

/// The subject a source's snapshots are requested on: the pod subject of DESIGN.md for pod
/// sources, `kvgate.snapshot.<namespace>.<node>` (one token fewer, so it cannot collide) for
/// node sources.
pub fn snapshot_subject(source: &Source) -> Option<String> {
    match (&source.pool, &source.pod, &source.node) {
        (Some(pool), Some(pod), _) => Some(subject::snapshot(&source.namespace, pool, pod)),
        (_, None, Some(node)) => Some(subject::node_snapshot(&source.namespace, node)),
        _ => None,
    }
}

#[derive(Debug)]
struct Entry {
    source: Source,
    sync: SourceSync,
}

/// Every source's synchronisation, applied to the shared index.
#[derive(Debug)]
pub struct KvIngest {
    config: SyncConfig,
    index: Arc<KvIndex>,
    loads: Arc<LoadBook>,
    stats: Arc<NatsStats>,
    sources: HashMap<Holder, Entry>,
    unknown: HashMap<Source, ()>,
}

impl KvIngest {
    /// An ingester writing to `index` and `loads`.
    pub fn new(
        config: SyncConfig,
        index: Arc<KvIndex>,
        loads: Arc<LoadBook>,
        stats: Arc<NatsStats>,
    ) -> Self {
        Self {
            config,
            index,
            loads,
            stats,
            sources: HashMap::new(),
            unknown: HashMap::new(),
        }
    }

    /// Sources tracked.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    /// Whether none is tracked.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// Whether `holder` is tracked and stale.
    pub fn is_stale(&self, holder: Holder) -> Option<bool> {
        self.sources.get(&holder).map(|e| e.sync.is_stale())
    }

    /// An envelope arrived at `now`.
    pub fn on_envelope(&mut self, env: Envelope, r: &Resolver<'_>, now: Millis) -> Vec<FetchOrder> {
        let Some(holder) = r.holder(&env.source) else {
            add(&self.stats.unknown_sources, 1);
            self.remember_unknown(env.source);
            return Vec::new();
        };
        let mut out = Vec::new();
        let entry = self.entry(holder, env.source, now, &mut out);
        entry
            .sync
            .on_envelope(env.epoch, env.seq, env.events, now, &mut out);
        self.act(holder, out)
    }

    /// A fetch for `holder`'s request `id` ended.
    pub fn on_fetch(
        &mut self,
        holder: Holder,
        id: u64,
        result: FetchResult,
        r: &Resolver<'_>,
        now: Millis,
    ) -> Vec<FetchOrder> {
        let Some(entry) = self.sources.get_mut(&holder) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        match result {
            FetchResult::Done(snap) if r.holder(&snap.source) == Some(holder) => {
                entry.sync.on_snapshot(id, snap, now, &mut out);
            }
            FetchResult::Done(_) | FetchResult::Failed => {
                entry.sync.on_snapshot_failed(id, now, &mut out);
            }
        }
        self.act(holder, out)
    }

    /// A load sample arrived at `now` (stamped with `now`, not the sender's clock). The first
    /// sample of an endpoint with no KV-event source yet starts that source's sync (a snapshot
    /// request), as its first envelope would.
    pub fn on_load(
        &mut self,
        sample: &LoadSample,
        r: &Resolver<'_>,
        now: Millis,
    ) -> Vec<FetchOrder> {
        let Some(holder @ Holder::Endpoint(id)) = r.holder(&sample.source) else {
            add(&self.stats.unknown_sources, 1);
            return Vec::new();
        };
        self.loads.record(
            id,
            EngineLoad {
                waiting: sample.waiting,
                running: sample.running,
                kv_usage: sample.kv_usage,
                at: now,
            },
        );
        add(&self.stats.load_samples, 1);
        if self.sources.contains_key(&holder) {
            return Vec::new();
        }
        // A sidecar this EPP has no KV events from yet (it published them before this EPP
        // subscribed, and its engine has been idle since): take the source up now, so its
        // snapshot brings the cache it holds, instead of waiting for its next event.
        let mut out = Vec::new();
        self.entry(holder, sample.source.clone(), now, &mut out);
        let orders = self.act(holder, out);
        self.gauges();
        orders
    }

    /// Time passed: overdue requests fail, backoffs end, departed sources are forgotten,
    /// unknown ones discovery now knows are taken up (first sight: a snapshot request).
    pub fn tick(&mut self, r: &Resolver<'_>, now: Millis) -> Vec<FetchOrder> {
        let gone: Vec<Holder> = self
            .sources
            .iter()
            .filter(|(h, e)| r.holder(&e.source) != Some(**h))
            .map(|(h, _)| *h)
            .collect();
        for h in gone {
            self.sources.remove(&h);
        }
        let mut orders = Vec::new();
        let known: Vec<(Source, Holder)> = self
            .unknown
            .keys()
            .filter_map(|s| Some((s.clone(), r.holder(s)?)))
            .collect();
        for (source, holder) in known {
            self.unknown.remove(&source);
            let mut out = Vec::new();
            self.entry(holder, source, now, &mut out);
            orders.extend(self.act(holder, out));
        }
        let holders: Vec<Holder> = self.sources.keys().copied().collect();
        for h in holders {
            let mut out = Vec::new();
            if let Some(e) = self.sources.get_mut(&h) {
                e.sync.tick(now, &mut out);
            }
            orders.extend(self.act(h, out));
        }
        self.gauges();
        orders
    }

    /// The connection came back: every source may have missed envelopes.
    pub fn resync_all(&mut self, now: Millis) -> Vec<FetchOrder> {
        let holders: Vec<Holder> = self.sources.keys().copied().collect();
        let mut orders = Vec::new();
        for h in holders {
            let mut out = Vec::new();
            if let Some(e) = self.sources.get_mut(&h) {
                e.sync.resync(now, &mut out);
            }
            orders.extend(self.act(h, out));
        }
        self.gauges();
        orders
    }

    fn remember_unknown(&mut self, source: Source) {
        if self.unknown.len() < MAX_PENDING_UNKNOWN || self.unknown.contains_key(&source) {
            self.unknown.insert(source, ());
        }
    }

    fn entry(
        &mut self,
        holder: Holder,
        source: Source,
        now: Millis,
        out: &mut Vec<Effect>,
    ) -> &mut Entry {
        let config = self.config;
        let entry = self.sources.entry(holder).or_insert_with(|| {
            tracing::info!(?holder, pod = ?source.pod, node = ?source.node, "new KV-event source");
            Entry {
                sync: SourceSync::new(config, now, out),
                source: source.clone(),
            }
        });
        if entry.source != source {
            entry.source = source;
        }
        entry
    }

    fn act(&mut self, holder: Holder, effects: Vec<Effect>) -> Vec<FetchOrder> {
        let s = &self.stats;
        let mut orders = Vec::new();
        for e in effects {
            match e {
                Effect::Apply(events) => {
                    self.index.apply(holder, &events);
                    add(&s.envelopes_applied, 1);
                    add(&s.events_applied, events.len() as u64);
                }
                Effect::Replace(snap) => {
                    let n = snap.len();
                    self.index.replace_source(holder, snap.entries());
                    add(&s.snapshots_ok, 1);
                    tracing::info!(
                        ?holder,
                        keys = n,
                        epoch = snap.epoch,
                        next_seq = snap.next_seq,
                        "snapshot applied"
                    );
                }
                Effect::Request { id } => {
                    let Some(entry) = self.sources.get(&holder) else {
                        continue;
                    };
                    let Some(subject) = snapshot_subject(&entry.source) else {
                        continue;
                    };
                    add(&s.snapshots_requested, 1);
                    orders.push(FetchOrder {
                        holder,
                        id,
                        subject,
                        request: SnapshotRequest::for_source(&entry.source),
                    });
                }
                Effect::Gap => add(&s.gaps, 1),
                Effect::NewEpoch => add(&s.new_epochs, 1),
                Effect::Failed(f) => {
                    tracing::debug!(
                        ?holder,
                        reason = f.metric_label(),
                        "snapshot attempt failed"
                    );
                    s.failed(f);
                }
                Effect::LateReply => add(&s.snapshot_late, 1),
            }
        }
        orders
    }

    fn gauges(&self) {
        let stale = self.sources.values().filter(|e| e.sync.is_stale()).count();
        set(&self.stats.stale_sources, stale as u64);
        set(&self.stats.sources, self.sources.len() as u64);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use kv_events::envelope::{ENVELOPE_VERSION, EngineKind};
    use kv_events::snapshot::TierKeys;
    use kv_events::{BlockKey, KvEvent, Tier};
    use kv_index::{EndpointId, IndexConfig};
    use scheduler::Endpoint;

    use super::*;
    use crate::discovery::Datastore;
    use crate::discovery::apply::NodeIds;

    fn source(pod: &str) -> Source {
        Source {
            namespace: "ns".into(),
            pool: Some("p".into()),
            pod: Some(pod.into()),
            ip: None,
            port: Some(8000),
            dp_rank: 1,
            node: None,
            model: "m".into(),
            engine: EngineKind::Vllm,
            block_size: 16,
        }
    }

    fn envelope(pod: &str, seq: u64, key: u64) -> Envelope {
        Envelope {
            v: ENVELOPE_VERSION,
            source: source(pod),
            epoch: 5,
            seq,
            events: vec![KvEvent::Stored {
                keys: vec![BlockKey(key)],
                parent: None,
                tier: Tier::Gpu,
                lora: None,
                token_count: 16,
            }],
        }
    }

    fn snapshot(pod: &str, next_seq: u64, keys: &[u64]) -> Snapshot {
        Snapshot {
            source: source(pod),
            epoch: 5,
            next_seq,
            tiers: vec![TierKeys {
                tier: Tier::Gpu,
                keys: keys.iter().copied().map(BlockKey).collect(),
            }],
        }
    }

    /// An ingest over a fresh index, with the index and the counters it writes.
    fn ingest() -> (Arc<KvIndex>, Arc<NatsStats>, KvIngest) {
        let index = Arc::new(KvIndex::new(IndexConfig::default()).unwrap());
        let stats = Arc::new(NatsStats::default());
        let kv = KvIngest::new(
            SyncConfig::default(),
            Arc::clone(&index),
            Arc::new(LoadBook::new()),
            Arc::clone(&stats),
        );
        (index, stats, kv)
    }

    /// Discovery now lists exactly `pod` (port 8000, the sources' port); its endpoint id.
    fn discover(ds: &Datastore, pod: &str) -> EndpointId {
        let key = (pod.to_owned(), 8000);
        let id = ds.id_for(&key);
        ds.replace(vec![(
            key,
            Endpoint::new(id, "10.0.0.1:8000".parse().unwrap()),
        )]);
        id
    }

    #[test]
    fn unknown_sources_wait_for_discovery_and_departed_ones_are_forgotten() {
        let ds = Datastore::new();
        let nodes = NodeIds::default();
        let r = Resolver {
            datastore: &ds,
            nodes: &nodes,
            model: "m",
        };
        let (index, stats, mut kv) = ingest();
        // Unknown: counted, no request.
        assert!(
            kv.on_envelope(envelope("a", 0, 1), &r, Millis(0))
                .is_empty()
        );
        assert_eq!(
            stats
                .unknown_sources
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        assert!(kv.is_empty());
        // Discovery learns of it: the next tick asks for its snapshot.
        let id = discover(&ds, "a");
        let orders = kv.tick(&r, Millis(1));
        assert_eq!(orders.len(), 1);
        let o = &orders[0];
        assert_eq!(o.holder, Holder::Endpoint(id));
        assert_eq!(o.subject, "kvgate.snapshot.ns.p.a");
        assert_eq!(o.request.dp_rank, 1);
        assert_eq!(kv.is_stale(o.holder), Some(true));
        // A reply naming another source is refused; the right one makes it live.
        let (holder, req) = (o.holder, o.id);
        kv.on_fetch(
            holder,
            req,
            FetchResult::Done(snapshot("b", 3, &[9])),
            &r,
            Millis(2),
        );
        assert_eq!(
            stats
                .snapshot_error
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        let orders = kv.tick(&r, Millis(200));
        let req = orders[0].id;
        kv.on_envelope(envelope("a", 3, 2), &r, Millis(201));
        kv.on_fetch(
            holder,
            req,
            FetchResult::Done(snapshot("a", 3, &[1])),
            &r,
            Millis(202),
        );
        assert_eq!(kv.is_stale(holder), Some(false));
        let hits = index.find_matches(&[BlockKey(1), BlockKey(2)], &[id]);
        assert_eq!(hits[0].reach(Tier::Gpu), 2);
        // Discovery drops it: forgotten at the next tick.
        ds.replace(Vec::new());
        kv.tick(&r, Millis(300));
        assert!(kv.is_empty());
    }

    /// An EPP that subscribed after a sidecar's last envelope hears of it first by its load
    /// samples: the first one starts the source's sync, so its snapshot brings the cache.
    #[test]
    fn a_load_sample_from_a_silent_kv_source_fetches_its_snapshot() {
        let ds = Datastore::new();
        let nodes = NodeIds::default();
        let r = Resolver {
            datastore: &ds,
            nodes: &nodes,
            model: "m",
        };
        let (index, stats, mut kv) = ingest();
        let sample = |pod: &str| LoadSample {
            v: ENVELOPE_VERSION,
            source: source(pod),
            unix_ms: 0,
            waiting: 0,
            running: 1,
            kv_usage: 0.5,
        };
        // Not discovered: counted, nothing asked.
        assert!(kv.on_load(&sample("a"), &r, Millis(0)).is_empty());
        assert!(kv.is_empty());
        let id = discover(&ds, "a");
        let orders = kv.on_load(&sample("a"), &r, Millis(1));
        assert_eq!(orders.len(), 1, "{orders:?}");
        assert_eq!(orders[0].holder, Holder::Endpoint(id));
        assert_eq!(orders[0].subject, "kvgate.snapshot.ns.p.a");
        // Later samples ask nothing more; the snapshot makes the source live.
        assert!(kv.on_load(&sample("a"), &r, Millis(2)).is_empty());
        kv.on_fetch(
            orders[0].holder,
            orders[0].id,
            FetchResult::Done(snapshot("a", 4, &[1, 2])),
            &r,
            Millis(3),
        );
        assert_eq!(kv.is_stale(Holder::Endpoint(id)), Some(false));
        let hits = index.find_matches(&[BlockKey(1), BlockKey(2)], &[id]);
        assert_eq!(hits[0].reach(Tier::Gpu), 2);
        // The envelope after the snapshot's position applies in order.
        assert!(
            kv.on_envelope(envelope("a", 4, 3), &r, Millis(4))
                .is_empty()
        );
        let hits = index.find_matches(&[BlockKey(1), BlockKey(2), BlockKey(3)], &[id]);
        assert_eq!(hits[0].reach(Tier::Gpu), 3);
        assert_eq!(
            stats
                .load_samples
                .load(std::sync::atomic::Ordering::Relaxed),
            2
        );
    }

    #[test]
    fn node_sources_ask_on_a_subject_of_their_own() {
        let mut s = source("x");
        s.pool = None;
        s.pod = None;
        s.node = Some("node.1".into());
        assert_eq!(snapshot_subject(&s).unwrap(), "kvgate.snapshot.ns.node_1");
        s.node = None;
        assert_eq!(snapshot_subject(&s), None);
    }
}
