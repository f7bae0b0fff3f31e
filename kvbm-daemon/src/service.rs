//! The daemon's shared state and what every edge calls: the store and the outbox under one
//! short mutex (never held across an await), the remote tier's client and its write queue.
//!
//! - **Sealed envelopes** leave through one channel, filled under the state lock, so their
//!   order on it is their `seq` order; one publisher task drains it (snapshot requests seal
//!   into the same channel).
//! - **Remote writes** (demotions, deletes) are queued to one writer task and never delay a
//!   connector. A put stays readable from the queue until Redis has it, so an onboard right
//!   after a demotion finds the block. The queue is bounded in operations and in bytes; a
//!   write that does not fit is dropped and counted (a dropped put is harmless: the onboard
//!   that misses the block in Redis forgets it).
//! - **Remote reads** (onboards) run in the connector's request, in chain order, and stop at
//!   the first block Redis no longer has.
//! - **Closing**: after [`Service::close`] every request is refused as unavailable and no
//!   snapshot is answered, so nothing follows the final `Cleared` on the wire.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use kv_events::snapshot::Snapshot;
use kv_events::{BlockKey, Envelope, Tier};
use tokio::sync::{Notify, mpsc};

use crate::metrics::Metrics;
use crate::outbox::{Group, Outbox};
use crate::remote::block_name;
use crate::remote::redis::Redis;
use crate::store::{
    BlockId, BlockStore, Effect, Found, Layout, LayoutId, Lookup, Offloaded, StoreError,
};

/// The largest block the remote tier takes (Redis's default `proto-max-bulk-len`).
pub const MAX_REMOTE_BLOCK_BYTES: u64 = 512 << 20;

/// A queued remote write.
#[derive(Debug)]
pub enum RemoteOp {
    /// `SET name data`.
    Put {
        /// The Redis key.
        name: String,
        /// The block.
        data: Bytes,
    },
    /// `DEL name`.
    Delete {
        /// The Redis key.
        name: String,
    },
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// The store refused it.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The daemon is shutting down.
    #[error("the block manager is shutting down")]
    Closing,
}

/// Why a snapshot could not be answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// The request names a model this node does not serve.
    #[error("this node serves no layout of model {0:?}")]
    UnknownModel(String),
    /// The daemon is shutting down.
    #[error("the block manager is shutting down")]
    Closing,
}

struct State {
    store: BlockStore,
    outbox: Outbox,
    /// Set by [`Service::close`], under this lock: nothing changes or is published after.
    closed: bool,
}

/// Events pending publication beyond which the outbox starts a new epoch instead (NATS has
/// been away; receivers resynchronise from a snapshot either way).
const MAX_PENDING_KEYS: usize = 1 << 20;

/// Remote writes not yet done: readable by onboards meanwhile. Per name, the latest bytes
/// and how many puts of it are queued (a block can be demoted again before its first put ran).
#[derive(Default)]
struct Pending {
    puts: HashMap<String, (Bytes, u32)>,
    bytes: u64,
}

/// The shared state.
pub struct Service {
    state: Mutex<State>,
    redis: Option<Arc<Redis>>,
    remote_tx: Option<mpsc::Sender<RemoteOp>>,
    pending: Mutex<Pending>,
    pending_limit: u64,
    sealed_tx: mpsc::UnboundedSender<Envelope>,
    wake: Notify,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("remote", &self.redis.as_ref().map(|r| r.address()))
            .finish_non_exhaustive()
    }
}

/// What [`Service::start`] hands the edges: the service, the sealed envelopes to publish, and
/// (with Redis) the remote write queue for [`remote_writer`].
#[derive(Debug)]
pub struct Parts {
    /// The service.
    pub service: Arc<Service>,
    /// Sealed envelopes, in `seq` order.
    pub sealed: mpsc::UnboundedReceiver<Envelope>,
    /// Remote writes, when there is a remote tier.
    pub remote: Option<mpsc::Receiver<RemoteOp>>,
}

/// Bounds of the remote write queue.
#[derive(Debug, Clone, Copy)]
pub struct RemoteQueue {
    /// Operations queued at most.
    pub ops: usize,
    /// Block bytes queued at most.
    pub bytes: u64,
}

impl Service {
    /// A service over `store`, and the channels its edges drain; with `redis`, remote writes
    /// go through a queue bounded by `queue`.
    pub fn start(
        store: BlockStore,
        outbox: Outbox,
        redis: Option<Arc<Redis>>,
        queue: RemoteQueue,
        metrics: Arc<Metrics>,
    ) -> Parts {
        let (tx, rx) = match redis {
            Some(_) => {
                let (tx, rx) = mpsc::channel(queue.ops.max(1));
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let (sealed_tx, sealed) = mpsc::unbounded_channel();
        let service = Arc::new(Self {
            state: Mutex::new(State {
                store,
                outbox,
                closed: false,
            }),
            redis,
            remote_tx: tx,
            pending: Mutex::new(Pending::default()),
            pending_limit: queue.bytes,
            sealed_tx,
            wake: Notify::new(),
            metrics,
        });
        Parts {
            service,
            sealed,
            remote: rx,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The state, unless the service is closed.
    fn open(&self) -> Result<MutexGuard<'_, State>, ServiceError> {
        let state = self.lock();
        if state.closed {
            Err(ServiceError::Closing)
        } else {
            Ok(state)
        }
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Completes when events are waiting to be sealed, or envelopes to be published.
    pub async fn changed(&self) {
        self.wake.notified().await;
    }

    /// Registers a connector's layout; with a remote tier, blocks above
    /// [`MAX_REMOTE_BLOCK_BYTES`] are refused.
    pub fn register(&self, layout: Layout) -> Result<LayoutId, ServiceError> {
        let mut state = self.open()?;
        let id = state.outbox.identity();
        if layout.model != id.model || layout.block_size != id.block_size {
            return Err(StoreError::Layout(crate::store::LayoutError::OtherModel {
                model: id.model.clone(),
                block_size: id.block_size,
            })
            .into());
        }
        if self.redis.is_some() && layout.block_bytes > MAX_REMOTE_BLOCK_BYTES {
            return Err(StoreError::Layout(crate::store::LayoutError::Invalid(
                "blocks above 512 MiB do not fit the remote tier (Redis's bulk limit)",
            ))
            .into());
        }
        Ok(state.store.register(layout)?)
    }

    /// Stores a chain of blocks.
    pub fn offload(
        &self,
        layout: LayoutId,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, Bytes)],
    ) -> Result<Offloaded, ServiceError> {
        let mut state = self.open()?;
        let mut effects = Vec::new();
        let done = state.store.offload(layout, parent, blocks, &mut effects)?;
        self.dispatch(&mut state, effects);
        Ok(done)
    }

    /// How much of a chain is held.
    pub fn lookup(&self, layout: LayoutId, keys: &[BlockKey]) -> Result<Lookup, ServiceError> {
        Ok(self.open()?.store.lookup(layout, keys)?)
    }

    /// The leading blocks of `keys` the node holds, each with the tier it came from; remote
    /// blocks are fetched (from the write queue if not yet written) and promoted to host
    /// memory.
    pub async fn onboard(
        &self,
        layout: LayoutId,
        keys: &[BlockKey],
    ) -> Result<Vec<(Bytes, Tier)>, ServiceError> {
        let (found, fingerprint, block_bytes) = {
            let mut state = self.open()?;
            let found = state.store.onboard(layout, keys)?;
            let l = state
                .store
                .layout(layout)
                .ok_or(StoreError::UnknownLayout(layout.0))?;
            (found, l.fingerprint(), l.block_bytes)
        };
        let mut out = Vec::with_capacity(found.len());
        for (found, key) in found.into_iter().zip(keys) {
            let data = match found {
                Found::Host(data) => {
                    out.push((data, Tier::Host));
                    continue;
                }
                Found::Remote => {
                    let name = block_name(fingerprint, *key);
                    let queued = self.pending().puts.get(&name).map(|(d, _)| d.clone());
                    match queued {
                        Some(data) => Ok(Some(data)),
                        None => match &self.redis {
                            Some(redis) => redis.get(name.as_bytes()).await,
                            None => Ok(None),
                        },
                    }
                }
            };
            let id = BlockId { layout, key: *key };
            let mut effects = Vec::new();
            match data {
                Ok(Some(data)) if data.len() as u64 == block_bytes => {
                    // Closed while fetching: the final Cleared is out, change nothing more.
                    let mut state = self.open()?;
                    state.store.promote(id, data.clone(), &mut effects)?;
                    self.dispatch(&mut state, effects);
                    out.push((data, Tier::Remote));
                }
                Ok(_) => {
                    // Gone (Redis evicted it, or its put was dropped), or corrupted.
                    let mut state = self.open()?;
                    state.store.remote_lost(id, &mut effects);
                    self.dispatch(&mut state, effects);
                    break;
                }
                Err(e) => {
                    self.metrics.remote_error("get", e.metric_label());
                    tracing::warn!(error = %e, "remote fetch failed; onboard stops there");
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Routes a store operation's effects: events to the outbox, remote writes to the queue.
    fn dispatch(&self, state: &mut State, effects: Vec<Effect>) {
        let mut published = false;
        let mut dropped = Vec::new();
        for effect in effects {
            match effect {
                Effect::Publish { layout, event } => {
                    if let Some(group) = state.store.layout(layout).map(Group::of) {
                        state.outbox.push(group, event);
                        published = true;
                    }
                }
                Effect::RemotePut { id, data } => {
                    if let Some(name) = name_of(&state.store, id)
                        && !self.queue_put(name, data)
                    {
                        dropped.push(id);
                    }
                }
                Effect::RemoteDelete { id } => {
                    if let Some(name) = name_of(&state.store, id) {
                        self.queue_delete(name);
                    }
                }
            }
        }
        // A put that could not be queued never reaches Redis: forget the block there (after
        // the loop, so its Removed follows its Stored).
        for id in dropped {
            let mut effects = Vec::new();
            state.store.remote_lost(id, &mut effects);
            let group = state.store.layout(id.layout).map(Group::of);
            for effect in effects {
                if let (Effect::Publish { event, .. }, Some(group)) = (effect, group) {
                    state.outbox.push(group, event);
                    published = true;
                }
            }
        }
        if state.outbox.pending_keys() > MAX_PENDING_KEYS {
            state.outbox.new_epoch(kv_bridge::epoch::random_epoch());
            self.metrics
                .outbox_overflows
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                limit = MAX_PENDING_KEYS,
                "events piled up unpublished (NATS away?): starting a new epoch instead"
            );
        }
        if published {
            self.wake.notify_one();
        }
    }

    /// Queues a put; false when it was dropped (the queue is full in operations or bytes).
    fn queue_put(&self, name: String, data: Bytes) -> bool {
        let Some(tx) = &self.remote_tx else {
            return false;
        };
        let len = data.len() as u64;
        {
            let mut p = self.pending();
            if p.bytes + len > self.pending_limit {
                drop(p);
                self.metrics.remote_dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            p.bytes += len;
            let entry = p.puts.entry(name.clone()).or_insert((data.clone(), 0));
            entry.0 = data.clone();
            entry.1 += 1;
        }
        if tx
            .try_send(RemoteOp::Put {
                name: name.clone(),
                data,
            })
            .is_err()
        {
            self.put_done(&name);
            self.metrics.remote_dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn queue_delete(&self, name: String) {
        let Some(tx) = &self.remote_tx else { return };
        if tx.try_send(RemoteOp::Delete { name }).is_err() {
            self.metrics.remote_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A queued put is done (written, failed or dropped): it is no longer readable from the
    /// queue.
    fn put_done(&self, name: &str) {
        let mut p = self.pending();
        let Some((data, count)) = p.puts.get_mut(name) else {
            return;
        };
        let len = data.len() as u64;
        *count -= 1;
        if *count == 0 {
            p.puts.remove(name);
        }
        p.bytes = p.bytes.saturating_sub(len);
    }

    /// Block bytes queued for Redis.
    pub fn queued_bytes(&self) -> u64 {
        self.pending().bytes
    }

    /// Seals pending events into the sealed channel.
    pub fn seal(&self) {
        let mut state = self.lock();
        let mut out = Vec::new();
        state.outbox.seal(&mut out);
        for e in out {
            // The receiver lives as long as the publisher; after it stops nothing is sent.
            let _ = self.sealed_tx.send(e);
        }
    }

    /// A snapshot for a request naming `model` (or none); envelopes sealed on the way go to
    /// the sealed channel first.
    pub fn snapshot(&self, model: Option<&str>) -> Result<Snapshot, SnapshotError> {
        let mut state = self.open().map_err(|_| SnapshotError::Closing)?;
        if let Some(m) = model
            && m != state.outbox.identity().model
        {
            return Err(SnapshotError::UnknownModel(m.into()));
        }
        let mut out = Vec::new();
        let snapshot = state.outbox.snapshot(&mut out);
        for e in out {
            let _ = self.sealed_tx.send(e);
        }
        self.wake.notify_one();
        Ok(snapshot)
    }

    /// Announces a fresh start: a `Cleared` as the epoch's first envelope, so receivers drop
    /// what a previous run of this node (one that crashed without its final `Cleared`) left
    /// in their index, and fetch a snapshot.
    pub fn announce_start(&self) {
        self.lock().outbox.clear(None);
        self.wake.notify_one();
    }

    /// Starts a new epoch (after NATS reconnects: receivers then fetch snapshots).
    pub fn new_epoch(&self, epoch: u64) {
        self.lock().outbox.new_epoch(epoch);
    }

    /// Refuses every later request and snapshot, then queues `Cleared` (the node's tiers go
    /// away with the daemon) and seals it: it is the last envelope.
    pub fn close(&self) {
        let mut state = self.lock();
        if state.closed {
            return;
        }
        state.closed = true;
        state.outbox.clear(None);
        let mut out = Vec::new();
        state.outbox.seal(&mut out);
        for e in out {
            let _ = self.sealed_tx.send(e);
        }
        drop(state);
        self.wake.notify_one();
    }

    /// Reads the store for a metrics scrape.
    pub fn with_store<T>(&self, f: impl FnOnce(&BlockStore) -> T) -> T {
        f(&self.lock().store)
    }
}

fn name_of(store: &BlockStore, id: BlockId) -> Option<String> {
    store
        .layout(id.layout)
        .map(|l| block_name(l.fingerprint(), id.key))
}

/// Drains the remote write queue into Redis until every sender is gone.
pub async fn remote_writer(
    service: Arc<Service>,
    redis: Arc<Redis>,
    mut rx: mpsc::Receiver<RemoteOp>,
) {
    let metrics = Arc::clone(service.metrics());
    while let Some(op) = rx.recv().await {
        let (what, result) = match &op {
            RemoteOp::Put { name, data } => {
                let r = redis.put(name.as_bytes(), data).await;
                service.put_done(name);
                ("put", r)
            }
            RemoteOp::Delete { name } => ("delete", redis.delete(name.as_bytes()).await),
        };
        match result {
            Ok(()) => {
                metrics.remote_ops.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                metrics.remote_error(what, e.metric_label());
                tracing::warn!(op = what, error = %e, "remote write failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kv_events::KvEvent;

    use super::*;
    use crate::outbox::Identity;
    use crate::remote::redis::RedisConfig;
    use crate::store::StoreConfig;

    const B: u64 = 8;

    fn layout() -> Layout {
        Layout {
            model: "m".into(),
            dtype: "fp8".into(),
            layers: 2,
            block_size: 4,
            block_bytes: B,
            shard: 0,
            shards: 1,
        }
    }

    /// A service of 2 host blocks whose Redis is never written (no writer task runs), so
    /// remote puts stay queued; `queue_bytes` bounds them.
    fn service(queue_bytes: u64) -> (Parts, LayoutId) {
        let redis = Redis::new(
            RedisConfig::from_url("redis://127.0.0.1:1", Duration::from_millis(50), 1024).unwrap(),
        );
        let parts = Service::start(
            BlockStore::new(StoreConfig {
                host_bytes: 2 * B,
                remote_bytes: 64 * B,
            }),
            Outbox::new(
                Identity {
                    namespace: "ns".into(),
                    node: "n".into(),
                    model: "m".into(),
                    block_size: 4,
                },
                1,
                1024,
            ),
            Some(Arc::new(redis)),
            RemoteQueue {
                ops: 16,
                bytes: queue_bytes,
            },
            Arc::new(Metrics::default()),
        );
        let l = parts.service.register(layout()).unwrap();
        (parts, l)
    }

    fn blocks(keys: &[u64]) -> Vec<(BlockKey, Bytes)> {
        keys.iter()
            .map(|k| (BlockKey(*k), Bytes::from(vec![*k as u8; B as usize])))
            .collect()
    }

    #[tokio::test]
    async fn a_demoted_block_is_onboarded_from_the_queue_before_redis_has_it() {
        let (parts, l) = service(1 << 20);
        let s = &parts.service;
        // Three blocks into two host slots: block 1 is demoted, its put still queued.
        s.offload(l, None, &blocks(&[1, 2, 3])).unwrap();
        assert_eq!(s.queued_bytes(), B);
        let got = s.onboard(l, &[BlockKey(1)]).await.unwrap();
        assert_eq!(
            got,
            vec![(Bytes::from(vec![1u8; B as usize]), Tier::Remote)]
        );
        assert_eq!(
            s.lookup(l, &[BlockKey(1)]).unwrap(),
            Lookup { host: 1, any: 1 }
        );
    }

    #[tokio::test]
    async fn queued_bytes_are_bounded_and_overflow_is_counted() {
        let (parts, l) = service(B);
        let s = &parts.service;
        s.offload(l, None, &blocks(&[1, 2, 3, 4])).unwrap();
        // Blocks 1 and 2 were demoted; only one fits the queue.
        assert_eq!(s.queued_bytes(), B);
        assert_eq!(s.metrics().remote_dropped.load(Ordering::Relaxed), 1);
        // Block 2's put was dropped, so the store forgot it at once (Removed, not a phantom
        // remote entry); block 1 comes from the queue.
        assert_eq!(s.lookup(l, &[BlockKey(2)]).unwrap().any, 0);
        let got = s.onboard(l, &[BlockKey(1), BlockKey(2)]).await.unwrap();
        assert_eq!(got.len(), 1);
    }

    #[tokio::test]
    async fn after_close_nothing_follows_the_cleared_envelope() {
        let (mut parts, l) = service(1 << 20);
        let s = &parts.service;
        s.offload(l, None, &blocks(&[1])).unwrap();
        s.close();
        assert_eq!(
            s.offload(l, None, &blocks(&[2])),
            Err(ServiceError::Closing)
        );
        assert!(matches!(
            s.onboard(l, &[BlockKey(1)]).await,
            Err(ServiceError::Closing)
        ));
        assert_eq!(s.snapshot(None).unwrap_err(), SnapshotError::Closing);
        s.seal();
        let mut last = None;
        while let Ok(e) = parts.sealed.try_recv() {
            last = Some(e);
        }
        let last = last.unwrap();
        assert_eq!(last.events.last(), Some(&KvEvent::Cleared { tier: None }));
    }

    #[tokio::test]
    async fn snapshots_name_the_served_model_only() {
        let (parts, _) = service(1 << 20);
        let s = &parts.service;
        assert!(s.snapshot(Some("m")).is_ok());
        assert!(s.snapshot(None).is_ok());
        assert_eq!(
            s.snapshot(Some("other")).unwrap_err(),
            SnapshotError::UnknownModel("other".into())
        );
        let mut other = layout();
        other.model = "other".into();
        assert!(s.register(other).is_err());
        let mut big = layout();
        big.block_bytes = MAX_REMOTE_BLOCK_BYTES + 1;
        assert!(s.register(big).is_err());
    }
}
