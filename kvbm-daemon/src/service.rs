//! The daemon's shared state and what every edge calls: the store and the outbox under one
//! short mutex (never held across an await), and the lower tiers (disk, remote) with their
//! write queues.
//!
//! - **Sealed envelopes** leave through one channel, filled under the state lock, so their
//!   order on it is their `seq` order; one publisher task drains it (snapshot requests seal
//!   into the same channel).
//! - **Lower-tier writes** (demotions, deletes) are queued, one queue and one writer per
//!   tier, and never delay a connector. A put stays readable from its queue until the tier
//!   has it, so an onboard right after a demotion finds the block. Each queue's puts are
//!   bounded in operations and in bytes; a put that does not fit is dropped and counted, and
//!   the store forgets the block there at once (no phantom residency). Deletes are never
//!   dropped (a dropped one would leave a file or key outside the index). A put that fails is
//!   forgotten the same way, and a delete of it queued behind any later put of the same block.
//!   A block the tier turns out not to have at onboard (or, on disk, cannot read) is
//!   forgotten and deleted the same way, unless a put of it is queued by then.
//! - **Lower-tier reads** (onboards) run in the connector's request, in chain order (disk
//!   reads on the blocking pool), and stop at the first block the tier no longer has.
//! - **Closing**: after [`Service::close`] every request is refused as unavailable and no
//!   snapshot is answered, so nothing follows the final `Cleared` on the wire.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use bytes::Bytes;
use kv_events::snapshot::Snapshot;
use kv_events::{BlockKey, Envelope, Tier};
use tokio::sync::{Notify, mpsc};

use std::collections::VecDeque;

use crate::disk::{DiskDir, DiskError, block_name};
use crate::metrics::Metrics;
use crate::outbox::{Group, Outbox};
use crate::peers::Peers;
use crate::pending::Pending;
use crate::remote::Remote;
use crate::store::{BlockId, BlockStore, Effect, Found, Layout, LayoutId, Offloaded, StoreError};

/// Disk blocks an onboard keeps being read ahead of the block it is at, at most…
const READ_AHEAD: usize = 64;
/// …and at most this many bytes of them (at least one block).
const READ_AHEAD_BYTES: u64 = 64 << 20;
/// Consecutive disk blocks of a chain read by one task on the blocking pool (one `preadv`
/// for those that lie together), at most; the read-ahead runs several such tasks at once.
const READ_GROUP: usize = 16;

/// Puts the disk writer writes together (one `pwritev` per run of free slots), at most…
const WRITE_BATCH: usize = 64;
/// …and at most this many bytes of them (at least one put).
const WRITE_BATCH_BYTES: u64 = 64 << 20;

/// Disk reads of consecutive blocks of a chain running on the blocking pool.
type DiskReads = tokio::task::JoinHandle<Vec<Result<Option<Bytes>, DiskError>>>;

/// The largest block the remote tier takes (Redis's default `proto-max-bulk-len`; S3 takes
/// up to 5 GiB in one `PUT`).
pub const MAX_REMOTE_BLOCK_BYTES: u64 = 512 << 20;

/// A queued lower-tier write.
#[derive(Debug)]
pub enum WriteOp {
    /// Write a block.
    Put {
        /// The block (forgotten by the store if the write fails).
        id: BlockId,
        /// Its name in the tier (file name, Redis key or S3 object key).
        name: String,
        /// The block.
        data: Bytes,
    },
    /// Delete a block.
    Delete {
        /// Its name in the tier.
        name: String,
    },
}

impl WriteOp {
    /// The block's name in the tier.
    pub fn name(&self) -> &str {
        match self {
            WriteOp::Put { name, .. } | WriteOp::Delete { name } => name,
        }
    }
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

/// One lower tier's write queue. Puts are bounded (in operations and bytes); deletes are not
/// dropped, or their files and keys would outlive the index: there are at most as many as
/// blocks the tier ever held beyond what it holds now, each a short name.
struct WriteQueue {
    tier: Tier,
    tx: mpsc::UnboundedSender<WriteOp>,
    pending: Mutex<Pending>,
    bounds: QueueBounds,
}

impl WriteQueue {
    fn new(tier: Tier, bounds: QueueBounds) -> (Self, mpsc::UnboundedReceiver<WriteOp>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = Self {
            tier,
            tx,
            pending: Mutex::new(Pending::default()),
            bounds,
        };
        (queue, rx)
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn queued(&self, name: &str) -> Option<Bytes> {
        self.pending().readable(name)
    }
}

/// Why a lower-tier read failed.
#[derive(Debug)]
struct ReadError {
    /// The metric label of its class.
    kind: &'static str,
    /// For the log.
    message: String,
    /// Whether a later read may succeed (the block then stays indexed).
    transient: bool,
}

impl ReadError {
    /// An error that will not pass.
    fn lasting(kind: &'static str, message: String) -> Self {
        Self {
            kind,
            message,
            transient: false,
        }
    }
}

/// The lower tiers' back ends (each absent when its tier is disabled).
#[derive(Debug, Default, Clone)]
pub struct Backends {
    /// The disk tier's directory.
    pub disk: Option<Arc<DiskDir>>,
    /// The remote store.
    pub remote: Option<Arc<Remote>>,
}

impl Backends {
    /// A block's name in a lower tier.
    fn name(&self, tier: Tier, fingerprint: u64, key: BlockKey) -> String {
        match (tier, &self.remote) {
            (Tier::Disk, _) | (_, None) => block_name(fingerprint, key),
            (_, Some(remote)) => remote.block_name(fingerprint, key),
        }
    }
}

/// The shared state.
pub struct Service {
    state: Mutex<State>,
    /// The clock pins are kept in (milliseconds since start).
    started: std::time::Instant,
    /// The longest pin.
    max_pin: std::time::Duration,
    backends: Backends,
    /// One per lower tier with a back end.
    queues: Vec<WriteQueue>,
    sealed_tx: mpsc::UnboundedSender<Envelope>,
    wake: Notify,
    metrics: Arc<Metrics>,
    /// Other nodes' block managers, once attached.
    peers: OnceLock<Arc<Peers>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("disk", &self.backends.disk.as_ref().map(|d| d.path()))
            .field(
                "remote",
                &self.backends.remote.as_ref().map(|r| r.address()),
            )
            .finish_non_exhaustive()
    }
}

/// What [`Service::start`] hands the edges: the service, the sealed envelopes to publish, and
/// each lower tier's write queue (for [`disk_writer`] and [`remote_writer`]).
#[derive(Debug)]
pub struct Parts {
    /// The service.
    pub service: Arc<Service>,
    /// Sealed envelopes, in `seq` order.
    pub sealed: mpsc::UnboundedReceiver<Envelope>,
    /// Disk writes, when there is a disk tier.
    pub disk: Option<mpsc::UnboundedReceiver<WriteOp>>,
    /// Remote writes, when there is a remote tier.
    pub remote: Option<mpsc::UnboundedReceiver<WriteOp>>,
}

/// What a lookup found held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Leading blocks in this node's host memory.
    pub host: u32,
    /// Leading blocks this node or, after them, one peer holds.
    pub any: u32,
    /// Of this node's, how many are now pinned.
    pub pinned: u32,
    /// Of `any`, how many a peer holds (not pinned).
    pub peer: u32,
}

/// Where an onboarded block came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// This node's host memory.
    Host,
    /// This node's disk.
    Disk,
    /// The remote store.
    Remote,
    /// Another node's block manager.
    Peer,
}

impl From<Tier> for Origin {
    fn from(tier: Tier) -> Self {
        match tier {
            Tier::Host | Tier::Gpu => Origin::Host,
            Tier::Disk => Origin::Disk,
            Tier::Remote => Origin::Remote,
        }
    }
}

/// Bounds of a write queue's puts.

#[derive(Debug, Clone, Copy)]
pub struct QueueBounds {
    /// Puts queued at most.
    pub ops: usize,
    /// Block bytes queued at most.
    pub bytes: u64,
}

impl Service {
    /// A service over `store`, and the channels its edges drain; each present back end's
    /// writes go through a queue bounded by its `bounds` (disk, remote).
    pub fn start(
        store: BlockStore,
        outbox: Outbox,
        max_pin: std::time::Duration,
        backends: Backends,
        bounds: [QueueBounds; 2],
        metrics: Arc<Metrics>,
    ) -> Parts {
        let [disk_bounds, remote_bounds] = bounds;
        let mut queues = Vec::new();
        let mut queue = |present: bool, tier, bounds| {
            present.then(|| {
                let (q, rx) = WriteQueue::new(tier, bounds);
                queues.push(q);
                rx
            })
        };
        let disk = queue(backends.disk.is_some(), Tier::Disk, disk_bounds);
        let remote = queue(backends.remote.is_some(), Tier::Remote, remote_bounds);
        let (sealed_tx, sealed) = mpsc::unbounded_channel();
        let service = Arc::new(Self {
            state: Mutex::new(State {
                store,
                outbox,
                closed: false,
            }),
            started: std::time::Instant::now(),
            max_pin,
            backends,
            queues,
            sealed_tx,
            wake: Notify::new(),
            metrics,
            peers: OnceLock::new(),
        });
        Parts {
            service,
            sealed,
            disk,
            remote,
        }
    }

    fn queue(&self, tier: Tier) -> Option<&WriteQueue> {
        self.queues.iter().find(|q| q.tier == tier)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Milliseconds since start: the pins' clock.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The state, unless the service is closed, with expired pins dropped.
    fn open(&self) -> Result<MutexGuard<'_, State>, ServiceError> {
        let mut state = self.lock();
        if state.closed {
            Err(ServiceError::Closing)
        } else {
            state.store.expire_pins(self.now_ms());
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
        if self.backends.remote.is_some() && layout.block_bytes > MAX_REMOTE_BLOCK_BYTES {
            return Err(StoreError::Layout(crate::store::LayoutError::Invalid(
                "blocks above 512 MiB do not fit the remote tier",
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

    /// How much of a chain is held; with `pin` > 0, the leading held blocks are also pinned
    /// that long (at most the service's longest pin). Past the blocks this node holds, the
    /// run a peer holds counts too (not pinned: a peer's blocks may be gone by the onboard).
    pub fn lookup(
        &self,
        layout: LayoutId,
        keys: &[BlockKey],
        pin: std::time::Duration,
    ) -> Result<Held, ServiceError> {
        let (local, pinned, fingerprint) = {
            let mut state = self.open()?;
            let found = state.store.lookup(layout, keys)?;
            // Only a miss with peers attached asks them (the fingerprint hashes the layout).
            let ask_peers = self.peers.get().is_some() && (found.any as usize) < keys.len();
            let fingerprint = state
                .store
                .layout(layout)
                .filter(|_| ask_peers)
                .map(Layout::fingerprint);
            let pinned = if pin.is_zero() {
                0
            } else {
                let ms = u64::try_from(pin.min(self.max_pin).as_millis()).unwrap_or(u64::MAX);
                let until = self.now_ms().saturating_add(ms);
                state.store.pin(layout, keys, until)?
            };
            (found, pinned, fingerprint)
        };
        let rest = keys.get(local.any as usize..).unwrap_or_default();
        let peer = match (self.peers.get(), fingerprint) {
            (Some(peers), Some(fp)) => peers.best(rest, fp).map_or(0, |h| h.blocks),
            _ => 0,
        };
        Ok(Held {
            host: local.host,
            any: local.any + peer,
            pinned,
            peer,
        })
    }

    /// The fingerprints of the layouts connectors registered (what peers may pull).
    pub fn layout_fingerprints(&self) -> Vec<u64> {
        self.lock()
            .store
            .layouts()
            .map(|(_, l)| l.fingerprint())
            .collect()
    }

    /// Lets lookups and onboards reach other nodes' block managers (once; later calls are
    /// ignored).
    pub fn attach_peers(&self, peers: Arc<Peers>) {
        let _ = self.peers.set(peers);
    }

    /// The longest pin.
    pub fn max_pin(&self) -> std::time::Duration {
        self.max_pin
    }

    /// Releases the pins of `keys`; returns how many there were.
    pub fn unpin(&self, layout: LayoutId, keys: &[BlockKey]) -> Result<u32, ServiceError> {
        Ok(self.open()?.store.unpin(layout, keys)?)
    }

    /// The leading blocks of `keys` this node holds, then those a peer holds after them,
    /// each with where it came from. Blocks pulled from a peer are stored in this node's host
    /// memory (and published) like an offload; a pull that fails ends the chain there (the
    /// engine computes the rest).
    pub async fn onboard(
        &self,
        layout: LayoutId,
        keys: &[BlockKey],
    ) -> Result<Vec<(Bytes, Origin)>, ServiceError> {
        let local = self.onboard_local(layout, keys).await?;
        let mut out: Vec<(Bytes, Origin)> = local
            .into_iter()
            .map(|(d, t)| (d, Origin::from(t)))
            .collect();
        let (Some(peers), Some(rest)) = (
            self.peers.get(),
            keys.get(out.len()..).filter(|r| !r.is_empty()),
        ) else {
            return Ok(out);
        };
        let described = self.open()?.store.layout(layout).cloned();
        let Some(described) = described else {
            return Ok(out);
        };
        let Some(holding) = peers.best(rest, described.fingerprint()) else {
            return Ok(out);
        };
        let want = rest.get(..holding.blocks as usize).unwrap_or(rest);
        let started = std::time::Instant::now();
        let (answer_parent, pulled) = match peers.pull(&holding, &described, want).await {
            Ok(answer) => answer,
            Err(e) => {
                self.metrics.peer.pull_failed(e.metric_label());
                peers.failed(&holding);
                tracing::warn!(
                    peer = %holding.node, addr = %holding.addr, error = %e,
                    "pull from a peer failed; the engine computes those blocks"
                );
                return Ok(out);
            }
        };
        let bytes: u64 = pulled.iter().map(|b| b.len() as u64).sum();
        self.metrics
            .peer
            .pulled(pulled.len(), want.len(), bytes, started.elapsed());
        if !pulled.is_empty() {
            // The key before the run: the last block served here, else the holder's record.
            let parent = match out.len().checked_sub(1) {
                Some(i) => keys.get(i).copied(),
                None => answer_parent,
            };
            let blocks: Vec<(BlockKey, Bytes)> =
                want.iter().copied().zip(pulled.iter().cloned()).collect();
            // The connector gets the blocks either way; keeping them here is a bonus.
            let mut state = self.open()?;
            let mut effects = Vec::new();
            if let Err(e) = state.store.offload(layout, parent, &blocks, &mut effects) {
                tracing::warn!(error = %e, "blocks pulled from a peer not kept");
            }
            self.dispatch(&mut state, effects);
        }
        out.extend(pulled.into_iter().map(|d| (d, Origin::Peer)));
        Ok(out)
    }

    /// A peer's pull: the leading blocks of `keys` this node holds under a layout equal to
    /// `layout` (none when no connector here registered it), at most one answer's worth,
    /// from this node's own tiers only; and the key before the first in its chain (so the
    /// puller stores the run where it belongs).
    pub async fn serve_pull(
        &self,
        layout: &Layout,
        keys: &[BlockKey],
    ) -> Result<(Option<BlockKey>, Vec<Bytes>), ServiceError> {
        let (id, parent) = {
            let state = self.open()?;
            let id = state
                .store
                .layouts()
                .find_map(|(id, l)| (l == layout).then_some(id));
            let parent = match (id, keys.first()) {
                (Some(layout), Some(key)) => state.store.parent(&BlockId { layout, key: *key }),
                _ => None,
            };
            (id, parent)
        };
        let Some(id) = id else {
            return Ok((None, Vec::new()));
        };
        let keys = keys
            .get(..crate::peers::wire::answer_blocks(layout.block_bytes))
            .unwrap_or(keys);
        let blocks = self
            .onboard_local(id, keys)
            .await?
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        Ok((parent, blocks))
    }

    /// The leading blocks of `keys` the node holds, each with the tier it came from;
    /// lower-tier blocks are read (from the write queue if not yet written) and promoted to
    /// host memory.
    pub async fn onboard_local(
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
        let found: Vec<(Tier, Option<Bytes>)> = found
            .into_iter()
            .map(|f| match f {
                Found::Host(data) => (Tier::Host, Some(data)),
                Found::Disk => (Tier::Disk, None),
                Found::Remote => (Tier::Remote, None),
            })
            .collect();
        // Disk reads run ahead of the chain, up to READ_AHEAD blocks (and READ_AHEAD_BYTES)
        // at once in groups of READ_GROUP consecutive disk blocks (an NVMe serves many reads
        // in parallel, and blocks that lie together are read in one call); results are taken
        // in chain order.
        let window = usize::try_from(READ_AHEAD_BYTES / block_bytes.max(1))
            .unwrap_or(READ_AHEAD)
            .clamp(1, READ_AHEAD);
        let group = READ_GROUP.min(window);
        let mut groups: VecDeque<(std::ops::Range<usize>, DiskReads)> = VecDeque::new();
        let mut ready: HashMap<usize, Result<Option<Bytes>, ReadError>> = HashMap::new();
        let mut spawned = 0;
        let mut out = Vec::with_capacity(found.len());
        for (i, ((tier, data), key)) in found.iter().zip(keys).enumerate() {
            if let Some(data) = data {
                out.push((data.clone(), Tier::Host));
                continue;
            }
            let tier = *tier;
            while spawned < found.len() && spawned < i + window {
                match found.get(spawned) {
                    // Not past a remote block: a remote timeout there ends the chain.
                    Some((Tier::Remote, _)) => break,
                    Some((Tier::Disk, None)) => {
                        let start = spawned;
                        let mut names = Vec::new();
                        while spawned < i + window
                            && names.len() < group
                            && let (Some((Tier::Disk, None)), Some(k)) =
                                (found.get(spawned), keys.get(spawned))
                        {
                            names.push(self.backends.name(Tier::Disk, fingerprint, *k));
                            spawned += 1;
                        }
                        if names.is_empty() {
                            break;
                        }
                        if let Some(read) = self.spawn_disk_reads(names, block_bytes) {
                            groups.push_back((start..spawned, read));
                        }
                    }
                    _ => spawned += 1,
                }
            }
            if !ready.contains_key(&i)
                && groups.front().is_some_and(|(range, _)| range.contains(&i))
                && let Some((range, read)) = groups.pop_front()
            {
                let n = range.len();
                ready.extend(range.zip(Self::disk_results(read, n).await));
            }
            let name = self.backends.name(tier, fingerprint, *key);
            let id = BlockId { layout, key: *key };
            let result = match ready.remove(&i) {
                // A read started early may have missed a block whose put landed since (and
                // is no longer queued): a miss is read again, queue first, before it counts.
                Some(Ok(None)) | None => self.read(tier, name.clone(), block_bytes).await,
                Some(other) => other,
            };
            let read = match result {
                Ok(data) => data.filter(|d| d.len() as u64 == block_bytes),
                Err(e) => {
                    let label = tier_label(tier);
                    self.metrics.tier_error(label, "read", e.kind);
                    tracing::warn!(tier = label, error = %e.message, "lower-tier read failed");
                    // A remote timeout may pass: the block stays indexed. A file that cannot
                    // be read, or an object the store refuses or returns damaged, is treated
                    // as gone, or a hot unreadable block would stay claimed for ever.
                    if e.transient {
                        break;
                    }
                    None
                }
            };
            let data = match read {
                Some(data) => Some(data),
                None => self.missed(tier, id, &name, block_bytes)?,
            };
            // The chain stops at the first block its tier no longer has.
            let Some(data) = data else { break };
            // Closed while reading: the final Cleared is out, change nothing more.
            let mut state = self.open()?;
            let mut effects = Vec::new();
            state.store.promote(id, tier, data.clone(), &mut effects)?;
            self.dispatch(&mut state, effects);
            out.push((data, tier));
        }
        Ok(out)
    }

    /// A lower tier did not have a block it indexes (gone, torn, or unreadable). Under the
    /// state lock, so no put of it is queued meanwhile: if a put of it is queued or being
    /// written now (the block was evicted and demoted again while the read ran), those bytes
    /// are the answer; otherwise the store forgets the block there, and a delete clears
    /// whatever the tier has under its name.
    fn missed(
        &self,
        tier: Tier,
        id: BlockId,
        name: &str,
        len: u64,
    ) -> Result<Option<Bytes>, ServiceError> {
        let mut state = self.open()?;
        let queued = self.queue(tier).and_then(|q| q.queued(name));
        if let Some(data) = queued.filter(|d| d.len() as u64 == len) {
            return Ok(Some(data));
        }
        if self.forget(&mut state, id, tier) {
            self.queue_delete(tier, name.to_owned());
            drop(state);
            self.wake.notify_one();
        }
        Ok(None)
    }

    /// Starts reading blocks of a chain on the blocking pool (none without a disk tier).
    fn spawn_disk_reads(&self, names: Vec<String>, len: u64) -> Option<DiskReads> {
        let disk = self.backends.disk.clone()?;
        Some(tokio::task::spawn_blocking(move || {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            disk.read_many(&names, len)
        }))
    }

    /// Started disk reads' outcomes: `n`, in order.
    async fn disk_results(read: DiskReads, n: usize) -> Vec<Result<Option<Bytes>, ReadError>> {
        match read.await {
            Ok(results) => results
                .into_iter()
                .map(|r| r.map_err(|e| ReadError::lasting(e.metric_label(), e.to_string())))
                .collect(),
            Err(e) => (0..n)
                .map(|_| Err(ReadError::lasting("io", e.to_string())))
                .collect(),
        }
    }

    /// A block's bytes from a lower tier: its write queue first, then the back end.
    async fn read(&self, tier: Tier, name: String, len: u64) -> Result<Option<Bytes>, ReadError> {
        let queued = self.queue(tier).and_then(|q| q.queued(&name));
        if queued.is_some() {
            return Ok(queued);
        }
        match tier {
            Tier::Disk => match self.spawn_disk_reads(vec![name], len) {
                Some(read) => Self::disk_results(read, 1).await.pop().unwrap_or(Ok(None)),
                None => Ok(None),
            },
            _ => match &self.backends.remote {
                Some(remote) => remote.get(&name, len).await.map_err(|e| ReadError {
                    kind: e.metric_label(),
                    message: e.to_string(),
                    transient: e.is_transient(),
                }),
                None => Ok(None),
            },
        }
    }

    /// Routes a store operation's effects: events to the outbox, lower-tier writes to their
    /// queues.
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
                Effect::Write { tier, id, data } => {
                    if let Some(name) = name_of(&self.backends, &state.store, tier, id)
                        && !self.queue_put(tier, id, name, data)
                    {
                        dropped.push((id, tier));
                    }
                }
                Effect::Delete { tier, id } => {
                    if let Some(name) = name_of(&self.backends, &state.store, tier, id) {
                        self.queue_delete(tier, name);
                    }
                }
            }
        }
        // A put that could not be queued never reaches its tier: forget the block there
        // (after the loop, so its Removed follows its Stored).
        for (id, tier) in dropped {
            published |= self.forget(state, id, tier);
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

    /// Forgets `id` in `tier` and queues its events; true when something was published.
    fn forget(&self, state: &mut State, id: BlockId, tier: Tier) -> bool {
        let mut effects = Vec::new();
        state.store.lost(id, tier, &mut effects);
        let group = state.store.layout(id.layout).map(Group::of);
        let mut published = false;
        for effect in effects {
            if let (Effect::Publish { event, .. }, Some(group)) = (effect, group) {
                state.outbox.push(group, event);
                published = true;
            }
        }
        published
    }

    /// A queued put failed: the tier may not have the block, so the store forgets it there,
    /// and a delete follows any later put of it in the queue (which the forgotten entry no
    /// longer accounts for).
    fn write_failed(&self, tier: Tier, id: BlockId, name: String) {
        let mut state = self.lock();
        if state.closed {
            return;
        }
        if self.forget(&mut state, id, tier) {
            self.queue_delete(tier, name);
            drop(state);
            self.wake.notify_one();
        }
    }

    /// Queues a put; false when it was dropped (the tier has no queue, or it is full in
    /// operations or bytes).
    fn queue_put(&self, tier: Tier, id: BlockId, name: String, data: Bytes) -> bool {
        let (Some(q), Some(counters)) = (self.queue(tier), self.metrics.writes(tier)) else {
            return false;
        };
        if !q.pending().push(&name, &data, q.bounds.ops, q.bounds.bytes) {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // Fails only once the writer is gone.
        if q.tx
            .send(WriteOp::Put {
                id,
                name: name.clone(),
                data,
            })
            .is_err()
        {
            q.pending().unsent(&name);
            counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Queues a delete of `name`; the puts of it still queued are superseded (the writer skips
    /// them: the delete would remove what they wrote).
    fn queue_delete(&self, tier: Tier, name: String) {
        let Some(q) = self.queue(tier) else { return };
        let superseded = q.pending().supersede(&name);
        if superseded > 0
            && let Some(counters) = self.metrics.writes(tier)
        {
            counters
                .superseded
                .fetch_add(u64::from(superseded), Ordering::Relaxed);
        }
        // Fails only once the writer is gone.
        if q.tx.send(WriteOp::Delete { name }).is_err()
            && let Some(counters) = self.metrics.writes(tier)
        {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The writer of `tier` took `op` from its queue: whether to perform it (false for a put
    /// a later delete superseded).
    fn take(&self, tier: Tier, op: &WriteOp) -> bool {
        match (op, self.queue(tier)) {
            (WriteOp::Put { name, .. }, Some(q)) => q.pending().take(name),
            _ => true,
        }
    }

    /// A put the writer took is done (written or failed): it is no longer readable from the
    /// queue.
    fn put_done(&self, tier: Tier, name: &str) {
        if let Some(q) = self.queue(tier) {
            q.pending().done(name);
        }
    }

    /// Block bytes queued per lower tier (disk, remote).
    pub fn queued_bytes(&self) -> [u64; 2] {
        [Tier::Disk, Tier::Remote].map(|t| self.queue(t).map_or(0, |q| q.pending().bytes()))
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

    /// The daemon's metrics in the Prometheus text format; gauges kept elsewhere (the
    /// fabric's leaked buffers) are read now.
    pub fn metrics_text(&self) -> String {
        if let Some(peers) = self.peers.get() {
            let leaked = peers.fabric_leaked_buffers();
            self.metrics
                .peer
                .fabric_leaked
                .store(leaked, Ordering::Relaxed);
        }
        if let Some(disk) = &self.backends.disk {
            let bytes = disk.file_bytes();
            self.metrics.disk_file_bytes.store(bytes, Ordering::Relaxed);
        }
        let queued = self.queued_bytes();
        self.with_store(|store| self.metrics.render(store, queued))
    }

    /// Reads the store for a metrics scrape (expired pins dropped first).
    pub fn with_store<T>(&self, f: impl FnOnce(&BlockStore) -> T) -> T {
        let mut state = self.lock();
        state.store.expire_pins(self.now_ms());
        f(&state.store)
    }
}

/// The metrics label of a tier.
fn tier_label(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "gpu",
        Tier::Host => "host",
        Tier::Disk => "disk",
        Tier::Remote => "remote",
    }
}

fn name_of(backends: &Backends, store: &BlockStore, tier: Tier, id: BlockId) -> Option<String> {
    store
        .layout(id.layout)
        .map(|l| backends.name(tier, l.fingerprint(), id.key))
}

/// Counts a finished write, and reports a failed put to the service.
fn write_finished(
    service: &Service,
    tier: Tier,
    op: &'static str,
    failed_put: Option<(BlockId, String)>,
    error: Option<(&'static str, String)>,
) {
    match error {
        None => {
            if let Some(counters) = service.metrics.writes(tier) {
                counters.done.fetch_add(1, Ordering::Relaxed);
            }
        }
        Some((kind, message)) => {
            let label = tier_label(tier);
            service.metrics.tier_error(label, op, kind);
            tracing::warn!(tier = label, op, error = %message, "lower-tier write failed");
            if let Some((id, name)) = failed_put {
                service.write_failed(tier, id, name);
            }
        }
    }
}

/// Remote writes in flight at once. One at a time, the writer fell behind the demotions of a
/// busy node: each `SET` of a block waits a round trip, and the `redis` crate's multiplexed
/// connection (or the S3 client's pool) carries several at once.
const REMOTE_IN_FLIGHT: usize = 16;

/// Drains the remote write queue into the remote store for the life of the service: up to
/// `REMOTE_IN_FLIGHT` (16) operations at once, never two on the same name (a put and a later
/// delete of one block stay in order: a batch ends before the second).
pub async fn remote_writer(
    service: Arc<Service>,
    remote: Arc<Remote>,
    mut rx: mpsc::UnboundedReceiver<WriteOp>,
) {
    let mut carry: Option<WriteOp> = None;
    loop {
        let first = match carry.take() {
            Some(op) => op,
            None => match rx.recv().await {
                Some(op) => op,
                None => return,
            },
        };
        if !service.take(Tier::Remote, &first) {
            continue;
        }
        let mut names = std::collections::HashSet::new();
        names.insert(first.name().to_owned());
        let mut batch = vec![first];
        while batch.len() < REMOTE_IN_FLIGHT {
            let Ok(op) = rx.try_recv() else { break };
            if names.contains(op.name()) {
                carry = Some(op);
                break;
            }
            if service.take(Tier::Remote, &op) {
                names.insert(op.name().to_owned());
                batch.push(op);
            }
        }
        let mut running = tokio::task::JoinSet::new();
        for op in batch {
            let (service, remote) = (Arc::clone(&service), Arc::clone(&remote));
            running.spawn(async move { remote_write(&service, &remote, op).await });
        }
        while running.join_next().await.is_some() {}
    }
}

/// One remote write, its outcome recorded.
async fn remote_write(service: &Service, remote: &Remote, op: WriteOp) {
    match op {
        WriteOp::Put { id, name, data } => {
            let r = remote.put(&name, data).await;
            service.put_done(Tier::Remote, &name);
            let error = r.err().map(|e| (e.metric_label(), e.to_string()));
            write_finished(service, Tier::Remote, "write", Some((id, name)), error);
        }
        WriteOp::Delete { name } => {
            let error = remote
                .delete(&name)
                .await
                .err()
                .map(|e| (e.metric_label(), e.to_string()));
            write_finished(service, Tier::Remote, "delete", None, error);
        }
    }
}

/// Drains the disk write queue into the directory for the life of the service (the process:
/// the service holds the queue's sender). Puts are written in batches of what is queued (at
/// most `WRITE_BATCH` blocks and `WRITE_BATCH_BYTES`), so blocks demoted together lie
/// together; deletes only free slots and are applied as they come. A batch never holds two
/// operations on one name (a put and a later delete of a block stay in order: the batch is
/// written before the second). Blocking: run it on a thread of its own.
pub fn disk_writer(service: &Service, disk: &DiskDir, mut rx: mpsc::UnboundedReceiver<WriteOp>) {
    let mut carry: Option<WriteOp> = None;
    loop {
        let mut next = match carry.take() {
            Some(op) => Some(op),
            None => match rx.blocking_recv() {
                Some(op) => Some(op),
                None => return,
            },
        };
        let mut puts: Vec<(BlockId, String, Bytes)> = Vec::new();
        let mut names = std::collections::HashSet::new();
        let mut bytes = 0u64;
        while let Some(op) = next.take() {
            if names.contains(op.name()) {
                carry = Some(op);
                break;
            }
            if service.take(Tier::Disk, &op) {
                match op {
                    WriteOp::Put { id, name, data } => {
                        bytes += data.len() as u64;
                        names.insert(name.clone());
                        puts.push((id, name, data));
                    }
                    WriteOp::Delete { name } => {
                        let error = disk
                            .delete(&name)
                            .err()
                            .map(|e| (e.metric_label(), e.to_string()));
                        write_finished(service, Tier::Disk, "delete", None, error);
                    }
                }
            }
            if puts.len() >= WRITE_BATCH || bytes >= WRITE_BATCH_BYTES {
                break;
            }
            next = rx.try_recv().ok();
        }
        if puts.is_empty() {
            continue;
        }
        let batch: Vec<(&str, &[u8])> = puts
            .iter()
            .map(|(_, name, data)| (name.as_str(), data.as_ref()))
            .collect();
        let results = disk.write_many(&batch);
        for ((id, name, _), r) in puts.into_iter().zip(results) {
            service.put_done(Tier::Disk, &name);
            let error = r.err().map(|e| (e.metric_label(), e.to_string()));
            write_finished(service, Tier::Disk, "write", Some((id, name)), error);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kv_events::KvEvent;

    use super::*;
    use crate::outbox::Identity;
    use crate::remote::redis::{Redis, RedisConfig};
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

    /// A service of 2 host blocks and `disk_blocks` disk blocks over `backends` (with a
    /// remote budget of 64 blocks when there is Redis), its layout registered.
    fn start(disk_blocks: u64, backends: Backends, queue_bytes: u64) -> (Parts, LayoutId) {
        let remote_bytes = if backends.remote.is_some() { 64 * B } else { 0 };
        let parts = Service::start(
            BlockStore::new(StoreConfig {
                host_bytes: 2 * B,
                disk_bytes: disk_blocks * B,
                remote_bytes,
                max_pins: 1024,
                disk_min_uses: 0,
                disk_write_through: false,
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
            Duration::from_secs(30),
            backends,
            [QueueBounds {
                ops: 16,
                bytes: queue_bytes,
            }; 2],
            Arc::new(Metrics::default()),
        );
        let l = parts.service.register(layout()).unwrap();
        (parts, l)
    }

    /// A service of 2 host blocks whose Redis is never written (no writer task runs), so
    /// remote puts stay queued; `queue_bytes` bounds them.
    fn service(queue_bytes: u64) -> (Parts, LayoutId) {
        let redis = Redis::new(
            RedisConfig::from_url("redis://127.0.0.1:1", Duration::from_millis(50), 1024).unwrap(),
        );
        let backends = Backends {
            disk: None,
            remote: Some(Arc::new(Remote::Redis(redis))),
        };
        start(0, backends, queue_bytes)
    }

    fn blocks(keys: &[u64]) -> Vec<(BlockKey, Bytes)> {
        keys.iter()
            .map(|k| (BlockKey(*k), Bytes::from(vec![*k as u8; B as usize])))
            .collect()
    }

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(std::path::PathBuf);

    impl TempDir {
        fn new(what: &str) -> Self {
            let path = std::env::temp_dir()
                .join(format!("kvgate-kvbm-service-{what}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            Self(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A service of 2 host and 4 disk blocks over `dir`, no remote tier, and its disk
    /// writer on a thread of its own (started by the caller through `run_writer`).
    fn disk_service(dir: &std::path::Path) -> (Parts, LayoutId, Arc<DiskDir>) {
        let disk = Arc::new(DiskDir::open(dir, crate::disk::DirectIo::Off).unwrap());
        let backends = Backends {
            disk: Some(Arc::clone(&disk)),
            remote: None,
        };
        let (parts, l) = start(4, backends, 1 << 20);
        (parts, l, disk)
    }

    fn run_writer(parts: &mut Parts, disk: &Arc<DiskDir>) {
        let (service, disk) = (Arc::clone(&parts.service), Arc::clone(disk));
        let rx = parts.disk.take().unwrap();
        std::thread::spawn(move || disk_writer(&service, &disk, rx));
    }

    async fn drained(s: &Service) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while s.queued_bytes() != [0, 0] {
            assert!(std::time::Instant::now() < deadline, "disk queue drained");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn sealed_events(parts: &mut Parts) -> Vec<KvEvent> {
        parts.service.seal();
        let mut out = Vec::new();
        while let Ok(e) = parts.sealed.try_recv() {
            out.extend(e.events);
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn disk_blocks_are_read_from_the_queue_then_from_the_directory() {
        let dir = TempDir::new("read");
        let (mut parts, l, disk) = disk_service(&dir.0);
        let s = Arc::clone(&parts.service);
        // Four blocks into two host slots: 1 and 2 are demoted to disk, still queued.
        s.offload(l, None, &blocks(&[1, 2, 3, 4])).unwrap();
        assert_eq!(s.queued_bytes(), [2 * B, 0]);
        let one = s.onboard(l, &[BlockKey(1)]).await.unwrap();
        assert_eq!(
            one,
            vec![(Bytes::from(vec![1u8; B as usize]), Origin::Disk)]
        );
        run_writer(&mut parts, &disk);
        drained(&s).await;
        // Block 2 now comes from its file.
        let two = s.onboard(l, &[BlockKey(2)]).await.unwrap();
        assert_eq!(
            two,
            vec![(Bytes::from(vec![2u8; B as usize]), Origin::Disk)]
        );
        assert_eq!(s.with_store(|st| st.counters().disk.onboarded), 2);
        // Promoting 1 and 2 demoted 3 and 4: every disk block is in the directory.
        drained(&s).await;
        let on_disk = s.with_store(|st| st.resident(l, Tier::Disk));
        assert_eq!(on_disk.len(), 4);
        for key in &on_disk {
            let name = block_name(layout().fingerprint(), *key);
            assert!(disk.read(&name, B).unwrap().is_some(), "{key:?} is on disk");
        }
        // A block the directory lost behind the store's back: the onboard stops there and
        // the block is forgotten on disk, with a Removed event.
        let in_host = s.with_store(|st| st.resident(l, Tier::Host));
        let gone = *on_disk.iter().find(|k| !in_host.contains(k)).unwrap();
        disk.delete(&block_name(layout().fingerprint(), gone))
            .unwrap();
        let _ = sealed_events(&mut parts);
        assert!(s.onboard(l, &[gone]).await.unwrap().is_empty());
        assert_eq!(s.lookup(l, &[gone], Duration::ZERO).unwrap().any, 0);
        assert!(sealed_events(&mut parts).contains(&KvEvent::Removed {
            keys: vec![gone],
            tier: Tier::Disk
        }));
        assert_eq!(s.with_store(|st| st.counters().disk.lost), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_chain_comes_back_from_disk_whole_and_in_order() {
        let dir = TempDir::new("chain");
        let disk = Arc::new(DiskDir::open(&dir.0, crate::disk::DirectIo::Off).unwrap());
        let backends = Backends {
            disk: Some(Arc::clone(&disk)),
            remote: None,
        };
        let (mut parts, l) = start(100, backends, 1 << 20);
        run_writer(&mut parts, &disk);
        let s = Arc::clone(&parts.service);
        // 90 blocks through two host slots, 10 at a time (the queue holds 16 puts): 88
        // are demoted, in batches the writer puts together.
        let keys: Vec<u64> = (1..=90).collect();
        let mut parent = None;
        for chunk in keys.chunks(10) {
            s.offload(l, parent, &blocks(chunk)).unwrap();
            parent = chunk.last().map(|k| BlockKey(*k));
            drained(&s).await;
        }
        assert_eq!(disk.blocks(), 88);
        // The whole chain, across several read groups and the host blocks at its end.
        let chain: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
        let got = s.onboard(l, &chain).await.unwrap();
        assert_eq!(got.len(), 90);
        for (k, (data, origin)) in keys.iter().zip(&got) {
            assert_eq!(data, &Bytes::from(vec![*k as u8; B as usize]), "block {k}");
            let expected = if *k <= 88 { Origin::Disk } else { Origin::Host };
            assert_eq!(*origin, expected, "block {k}");
        }
        // A hole in the middle: the chain stops there.
        drained(&s).await;
        disk.delete(&block_name(layout().fingerprint(), BlockKey(40)))
            .unwrap();
        let again = s.onboard(l, &chain).await.unwrap();
        assert_eq!(again.len(), 39);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_miss_with_a_put_queued_is_served_from_the_queue_and_not_forgotten() {
        let dir = TempDir::new("miss");
        let (mut parts, l, _disk) = disk_service(&dir.0);
        let s = Arc::clone(&parts.service);
        // Block 1 is demoted to disk; its put is queued (no writer runs), as when a block
        // is evicted and demoted again while an onboard's read of its old file runs.
        s.offload(l, None, &blocks(&[1, 2, 3])).unwrap();
        let id = BlockId {
            layout: l,
            key: BlockKey(1),
        };
        let name = block_name(layout().fingerprint(), BlockKey(1));
        let got = s.missed(Tier::Disk, id, &name, B).unwrap();
        assert_eq!(got, Some(Bytes::from(vec![1u8; B as usize])));
        assert_eq!(s.lookup(l, &[BlockKey(1)], Duration::ZERO).unwrap().any, 1);
        // Once the put is done (and the tier still misses), the miss forgets the block and
        // queues a delete of its name.
        let mut rx = parts.disk.take().unwrap();
        while let Ok(op) = rx.try_recv() {
            assert!(s.take(Tier::Disk, &op), "nothing superseded");
        }
        s.put_done(Tier::Disk, &name);
        assert_eq!(s.missed(Tier::Disk, id, &name, B).unwrap(), None);
        assert_eq!(s.lookup(l, &[BlockKey(1)], Duration::ZERO).unwrap().any, 0);
        assert!(matches!(rx.try_recv(), Ok(WriteOp::Delete { name: n }) if n == name));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_disk_write_forgets_the_block() {
        let dir = TempDir::new("fail");
        let (mut parts, l, disk) = disk_service(&dir.0);
        let s = Arc::clone(&parts.service);
        // The directory vanishes: every write fails.
        std::fs::remove_dir_all(&dir.0).unwrap();
        run_writer(&mut parts, &disk);
        s.offload(l, None, &blocks(&[1, 2, 3])).unwrap();
        drained(&s).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while s.lookup(l, &[BlockKey(1)], Duration::ZERO).unwrap().any != 0 {
            assert!(std::time::Instant::now() < deadline, "block 1 forgotten");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let events = sealed_events(&mut parts);
        let stored = events.iter().position(|e| {
            matches!(e, KvEvent::Stored { keys, tier: Tier::Disk, .. } if keys == &[BlockKey(1)])
        });
        let removed = events.iter().position(|e| {
            e == &KvEvent::Removed {
                keys: vec![BlockKey(1)],
                tier: Tier::Disk,
            }
        });
        assert!(stored.is_some() && removed > stored, "{events:?}");
        let text = s.metrics_text();
        assert!(
            text.contains("kvgate_kvbm_lost_blocks_total{tier=\"disk\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvgate_kvbm_tier_errors_total{tier=\"disk\",op=\"write\""),
            "{text}"
        );
    }

    #[tokio::test]
    async fn puts_a_later_delete_supersedes_are_skipped_and_free_their_room() {
        let dir = TempDir::new("supersede");
        let disk = Arc::new(DiskDir::open(&dir.0, crate::disk::DirectIo::Off).unwrap());
        let backends = Backends {
            disk: Some(disk),
            remote: None,
        };
        let (mut parts, l) = start(2, backends, 1 << 20);
        let s = Arc::clone(&parts.service);
        // Six blocks through two host and two disk slots while the writer is stalled: four
        // are demoted, and the first two leave the disk again before their puts ran.
        s.offload(l, None, &blocks(&[1, 2, 3, 4, 5, 6])).unwrap();
        assert_eq!(s.queued_bytes(), [2 * B, 0], "superseded puts hold no room");
        let mut rx = parts.disk.take().unwrap();
        let (mut written, mut deleted) = (Vec::new(), Vec::new());
        while let Ok(op) = rx.try_recv() {
            let take = s.take(Tier::Disk, &op);
            match op {
                WriteOp::Put { name, .. } if take => written.push(name),
                WriteOp::Put { .. } => {}
                WriteOp::Delete { name } => deleted.push(name),
            }
        }
        let names = |keys: &[u64]| -> Vec<String> {
            keys.iter()
                .map(|k| block_name(layout().fingerprint(), BlockKey(*k)))
                .collect()
        };
        assert_eq!(written, names(&[3, 4]), "only the blocks the disk holds");
        assert_eq!(deleted, names(&[1, 2]), "the deletes still run");
        let text = s.metrics_text();
        assert!(
            text.contains("kvgate_kvbm_write_superseded_total{tier=\"disk\"} 2"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_demoted_block_is_onboarded_from_the_queue_before_redis_has_it() {
        let (parts, l) = service(1 << 20);
        let s = &parts.service;
        // Three blocks into two host slots: block 1 is demoted, its put still queued.
        s.offload(l, None, &blocks(&[1, 2, 3])).unwrap();
        assert_eq!(s.queued_bytes(), [0, B]);
        let got = s.onboard(l, &[BlockKey(1)]).await.unwrap();
        assert_eq!(
            got,
            vec![(Bytes::from(vec![1u8; B as usize]), Origin::Remote)]
        );
        assert_eq!(
            s.lookup(l, &[BlockKey(1)], Duration::ZERO).unwrap(),
            Held {
                host: 1,
                any: 1,
                ..Held::default()
            }
        );
    }

    /// An S3-speaking responder on loopback: `PUT`s succeed; a `GET` answers 503 while
    /// `busy` is set, else the block's bytes with a wrong stored SHA-256 (a damaged object).
    async fn damaging_s3(busy: Arc<std::sync::atomic::AtomicBool>) -> u16 {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let busy = Arc::clone(&busy);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let head_end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            let mut chunk = vec![0; 1 << 16];
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        while buf.len() < head_end + len {
                            let mut chunk = vec![0; 1 << 16];
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..head_end + len);
                        let response = if head.starts_with("put ") {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_vec()
                        } else if busy.load(Ordering::SeqCst) {
                            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
                                .to_vec()
                        } else {
                            let mut r = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {B}\r\n\
                                 x-amz-meta-kvgate-sha256: {}\r\n\r\n",
                                "0".repeat(64)
                            )
                            .into_bytes();
                            r.extend(std::iter::repeat_n(1u8, B as usize));
                            r
                        };
                        if conn.write_all(&response).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn a_remote_block_read_back_busy_stays_and_one_read_back_damaged_is_forgotten() {
        use crate::remote::s3::{Addressing, S3, S3Config, S3Options};
        let busy = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let port = damaging_s3(Arc::clone(&busy)).await;
        let options = S3Options {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            region: "us-east-1".into(),
            addressing: Addressing::Path,
        };
        let credentials = crate::remote::s3::Credentials {
            access_key_id: "AK".into(),
            secret_access_key: "SK".into(),
            session_token: None,
        };
        let config = S3Config::from_url(
            "s3://kvgate",
            &options,
            credentials,
            Duration::from_secs(2),
            1 << 20,
        )
        .unwrap();
        let remote = Arc::new(Remote::S3(S3::new(config)));
        let backends = Backends {
            disk: None,
            remote: Some(Arc::clone(&remote)),
        };
        let (mut parts, l) = start(0, backends, 1 << 20);
        let s = Arc::clone(&parts.service);
        tokio::spawn(remote_writer(
            Arc::clone(&s),
            remote,
            parts.remote.take().unwrap(),
        ));
        // Block 1 is demoted and written to the bucket.
        s.offload(l, None, &blocks(&[1, 2, 3])).unwrap();
        drained(&s).await;
        let indexed = |s: &Service| s.lookup(l, &[BlockKey(1)], Duration::ZERO).unwrap().any;
        // The store is busy (503): the read fails, the block stays indexed for a later try.
        assert!(s.onboard(l, &[BlockKey(1)]).await.unwrap().is_empty());
        assert_eq!(indexed(&s), 1);
        assert_eq!(s.with_store(|st| st.counters().remote.lost), 0);
        // The object comes back damaged: the block is forgotten (a Removed, and a delete).
        busy.store(false, Ordering::SeqCst);
        assert!(s.onboard(l, &[BlockKey(1)]).await.unwrap().is_empty());
        assert_eq!(indexed(&s), 0);
        assert_eq!(s.with_store(|st| st.counters().remote.lost), 1);
        let text = s.metrics_text();
        assert!(
            text.contains(
                r#"kvgate_kvbm_tier_errors_total{tier="remote",op="read",kind="status"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kvgate_kvbm_tier_errors_total{tier="remote",op="read",kind="integrity"} 1"#
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn queued_bytes_are_bounded_and_overflow_is_counted() {
        let (parts, l) = service(B);
        let s = &parts.service;
        s.offload(l, None, &blocks(&[1, 2, 3, 4])).unwrap();
        // Blocks 1 and 2 were demoted; only one fits the queue.
        assert_eq!(s.queued_bytes(), [0, B]);
        assert_eq!(s.metrics().remote_writes.dropped.load(Ordering::Relaxed), 1);
        // Block 2's put was dropped, so the store forgot it at once (Removed, not a phantom
        // remote entry); block 1 comes from the queue.
        assert_eq!(s.lookup(l, &[BlockKey(2)], Duration::ZERO).unwrap().any, 0);
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
