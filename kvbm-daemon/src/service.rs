//! The daemon's shared state and what every edge calls: the store and the outbox under one
//! short mutex (never held across an await), the remote tier's client and its write queue.
//!
//! Remote writes (demotions, deletes) are queued to one writer task and never delay a
//! connector; a full queue drops the write and counts it. A dropped put is harmless: the
//! onboard that later misses the block in Redis tells the store it is lost. Remote reads
//! (onboards) run in the connector's request, in chain order, and stop at the first block
//! Redis no longer has.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use kv_events::snapshot::Snapshot;
use kv_events::{BlockKey, KvEvent, Tier};
use tokio::sync::{Notify, mpsc};

use crate::metrics::Metrics;
use crate::outbox::{Outbox, Sealed};
use crate::remote::block_name;
use crate::remote::redis::Redis;
use crate::store::{
    BlockId, BlockStore, Effect, Found, Layout, LayoutId, Lookup, Offloaded, StoreError,
};

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

struct State {
    store: BlockStore,
    outbox: Outbox,
}

/// Why a snapshot could not be answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// No layout serves the model asked for.
    #[error("no layout of model {0:?} on this node")]
    UnknownModel(String),
    /// The request named no model and the node serves several.
    #[error("the request names no model and this node serves {0} layouts")]
    Ambiguous(usize),
}

/// The shared state.
pub struct Service {
    state: Mutex<State>,
    redis: Option<Arc<Redis>>,
    remote_tx: Option<mpsc::Sender<RemoteOp>>,
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

impl Service {
    /// A service over `store`; with `redis`, remote writes go through a queue of
    /// `remote_queue` operations drained by [`remote_writer`] (returned to be spawned).
    pub fn new(
        store: BlockStore,
        outbox: Outbox,
        redis: Option<Arc<Redis>>,
        remote_queue: usize,
        metrics: Arc<Metrics>,
    ) -> (Arc<Self>, Option<mpsc::Receiver<RemoteOp>>) {
        let (tx, rx) = match redis {
            Some(_) => {
                let (tx, rx) = mpsc::channel(remote_queue.max(1));
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let service = Arc::new(Self {
            state: Mutex::new(State { store, outbox }),
            redis,
            remote_tx: tx,
            wake: Notify::new(),
            metrics,
        });
        (service, rx)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Completes when events are waiting to be sealed.
    pub async fn changed(&self) {
        self.wake.notified().await;
    }

    /// Registers a connector's layout.
    pub fn register(&self, layout: Layout) -> Result<LayoutId, StoreError> {
        self.lock().store.register(layout)
    }

    /// A registered layout.
    pub fn layout(&self, id: LayoutId) -> Option<Layout> {
        self.lock().store.layout(id).cloned()
    }

    /// Stores a chain of blocks.
    pub fn offload(
        &self,
        layout: LayoutId,
        parent: Option<BlockKey>,
        blocks: &[(BlockKey, Bytes)],
    ) -> Result<Offloaded, StoreError> {
        let mut state = self.lock();
        let mut effects = Vec::new();
        let done = state.store.offload(layout, parent, blocks, &mut effects)?;
        self.dispatch(&mut state, effects);
        Ok(done)
    }

    /// How much of a chain is held.
    pub fn lookup(&self, layout: LayoutId, keys: &[BlockKey]) -> Result<Lookup, StoreError> {
        self.lock().store.lookup(layout, keys)
    }

    /// The leading blocks of `keys` the node holds, each with the tier it came from; remote
    /// blocks are fetched and promoted to host memory.
    pub async fn onboard(
        &self,
        layout: LayoutId,
        keys: &[BlockKey],
    ) -> Result<Vec<(Bytes, Tier)>, StoreError> {
        let (found, fingerprint, block_bytes) = {
            let mut state = self.lock();
            let found = state.store.onboard(layout, keys)?;
            let l = state
                .store
                .layout(layout)
                .ok_or(StoreError::UnknownLayout(layout.0))?;
            (found, l.fingerprint(), l.block_bytes)
        };
        let mut out = Vec::with_capacity(found.len());
        for (found, key) in found.into_iter().zip(keys) {
            match found {
                Found::Host(data) => out.push((data, Tier::Host)),
                Found::Remote => {
                    let id = BlockId { layout, key: *key };
                    let Some(redis) = &self.redis else { break };
                    let name = block_name(fingerprint, *key);
                    match redis.get(name.as_bytes()).await {
                        Ok(Some(data)) if data.len() as u64 == block_bytes => {
                            let mut state = self.lock();
                            let mut effects = Vec::new();
                            state.store.promote(id, data.clone(), &mut effects)?;
                            self.dispatch(&mut state, effects);
                            out.push((data, Tier::Remote));
                        }
                        Ok(_) => {
                            // Gone (Redis evicted it, or a put was dropped), or corrupted.
                            let mut state = self.lock();
                            let mut effects = Vec::new();
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
            }
        }
        Ok(out)
    }

    /// Routes a store operation's effects: events to the outbox, remote writes to the queue.
    fn dispatch(&self, state: &mut State, effects: Vec<Effect>) {
        let mut published = false;
        for effect in effects {
            match effect {
                Effect::Publish { layout, event } => {
                    state.outbox.push(layout, event);
                    published = true;
                }
                Effect::RemotePut { id, data } => {
                    if let Some(name) = name_of(&state.store, id) {
                        self.queue(RemoteOp::Put { name, data });
                    }
                }
                Effect::RemoteDelete { id } => {
                    if let Some(name) = name_of(&state.store, id) {
                        self.queue(RemoteOp::Delete { name });
                    }
                }
            }
        }
        if published {
            self.wake.notify_one();
        }
    }

    fn queue(&self, op: RemoteOp) {
        let Some(tx) = &self.remote_tx else { return };
        if tx.try_send(op).is_err() {
            self.metrics.remote_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Seals pending events into envelopes.
    pub fn seal(&self, out: &mut Vec<Sealed>) {
        let mut state = self.lock();
        let State { store, outbox } = &mut *state;
        outbox.seal(store, out);
    }

    /// A snapshot for a request naming `model` (or none, when the node serves one layout);
    /// envelopes sealed on the way go to `out` and must be published.
    pub fn snapshot(
        &self,
        model: Option<&str>,
        out: &mut Vec<Sealed>,
    ) -> Result<Snapshot, SnapshotError> {
        let mut state = self.lock();
        let State { store, outbox } = &mut *state;
        let layouts: Vec<(LayoutId, &Layout)> = store.layouts().collect();
        let layout = match model {
            Some(m) => layouts
                .iter()
                .find(|(_, l)| l.model == m)
                .map(|(id, _)| *id)
                .ok_or_else(|| SnapshotError::UnknownModel(m.to_owned()))?,
            None => match layouts.as_slice() {
                [(only, _)] => *only,
                _ => return Err(SnapshotError::Ambiguous(layouts.len())),
            },
        };
        outbox
            .snapshot(store, layout, out)
            .ok_or(SnapshotError::Ambiguous(0))
    }

    /// Starts a new epoch (after NATS reconnects: receivers then fetch snapshots).
    pub fn new_epoch(&self, epoch: u64) {
        self.lock().outbox.new_epoch(epoch);
    }

    /// Queues `Cleared` for every layout: the node's tiers go away with the daemon.
    pub fn clear_on_shutdown(&self) {
        let mut state = self.lock();
        let layouts: Vec<LayoutId> = state.store.layouts().map(|(id, _)| id).collect();
        for layout in layouts {
            state.outbox.push(layout, KvEvent::Cleared { tier: None });
        }
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
    redis: Arc<Redis>,
    mut rx: mpsc::Receiver<RemoteOp>,
    metrics: Arc<Metrics>,
) {
    while let Some(op) = rx.recv().await {
        let (what, result) = match &op {
            RemoteOp::Put { name, data } => ("put", redis.put(name.as_bytes(), data).await),
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
