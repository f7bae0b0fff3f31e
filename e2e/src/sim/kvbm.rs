//! `--kvbm-socket`: the simulator as a connector of the node's KV block manager
//! (`kvgate-kvbm`).
//!
//! The engine model's offload tier ([`engine_model::OffloadTier`]) is answered here by the
//! daemon, over its connector socket and a shared-memory segment, through the daemon crate's
//! reference connector ([`kvgate_kvbm::client::Client`]):
//!
//! - every block the simulated GPU caches is **offloaded** (write-through, as vLLM's
//!   offloading connector and Dynamo's KVBM do): its kvgate key goes to the daemon with
//!   `block_bytes` bytes of the segment, so the daemon holds, evicts, demotes and publishes
//!   blocks of the real size of the preset's KV layout (layers × KV heads × head size × dtype
//!   × block size);
//! - a waiting request's blocks after its GPU prefix hit are **looked up and onboarded**: the
//!   daemon writes the blocks it holds into the segment (staging, as a connector's host
//!   buffer), and once the engine has GPU blocks for them it charges the load from each level
//!   (host memory, disk, the remote store) at the preset's bandwidth for that level, instead
//!   of computing those tokens. The answer is kept while the request waits for GPU blocks, so
//!   a request the engine cannot start yet does not onboard again on every step.
//!
//! The engine's step never waits on the socket. Calls go through bounded queues to one
//! worker task, lookups ahead of offloads; a lookup answers [`Lookup::Pending`] until the worker has the daemon's answer
//! (the request waits, others run: vLLM's scheduler does the same for a connector that is
//! still looking), and the worker wakes the engine loop when it arrives. A daemon that is
//! away, slow past [`CALL_TIMEOUT`], or answering errors costs only the cache: lookups answer
//! "nothing" (the tokens are computed) and offloads are dropped and counted; the worker
//! reconnects on the next call after [`RECONNECT_AFTER`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use engine_model::{CacheEvent, Lookup, LookupRequest, Offload, OffloadTier, RequestId, Sources};
use kv_events::key::{KeyChain, SaltStyle};
use kvgate_kvbm::client::{Client, ClientError};
use kvgate_kvbm::protocol::{MAX_BLOCKS, Slot};
use kvgate_kvbm::store::Layout;
use tokio::sync::{Notify, mpsc};

/// Deadline of one call to the daemon (connecting included).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// How long after a failure the worker waits before connecting again.
pub const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// Segment slots: blocks moved per offload or onboard call (the segment is `SLOTS` blocks).
const SLOTS: usize = 16;

/// Calls queued for the worker at most; more are not made (an offload is dropped, a lookup
/// answers "nothing").
const QUEUE: usize = 4096;

/// Connector settings.
#[derive(Debug, Clone)]
pub struct KvbmConfig {
    /// The daemon's connector socket.
    pub socket: PathBuf,
    /// The layout registered (its `model` seeds the block keys, as the EPP's do).
    pub layout: Layout,
}

/// The connector's counters, for `/metrics`.
#[derive(Debug, Default)]
pub struct KvbmStats {
    /// 1 while connected and registered.
    pub connected: AtomicU64,
    /// Blocks the daemon took (stored or already present).
    pub offloaded_blocks: AtomicU64,
    /// Blocks not offloaded: the queue was full, the daemon away or failing.
    pub offload_dropped_blocks: AtomicU64,
    /// Lookups answered by the daemon.
    pub lookups: AtomicU64,
    /// Lookups answered "nothing" without the daemon (queue full, away, failing).
    pub lookups_failed: AtomicU64,
    /// Blocks onboarded from the daemon's host memory.
    pub onboarded_host: AtomicU64,
    /// Blocks onboarded from the daemon's disk.
    pub onboarded_disk: AtomicU64,
    /// Blocks onboarded from the daemon's remote store.
    pub onboarded_remote: AtomicU64,
    /// Onboarded blocks whose bytes were not the block's (not used: computed instead).
    pub corrupt_blocks: AtomicU64,
    /// Failed calls (connect, register, offload, lookup, onboard, timeouts).
    pub errors: AtomicU64,
}

impl KvbmStats {
    /// Appends the `kvgate_sim_kvbm_*` metrics in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP kvgate_sim_kvbm_connected 1 while connected and registered to kvgate-kvbm.\n\
             # TYPE kvgate_sim_kvbm_connected gauge\nkvgate_sim_kvbm_connected {}",
            get(&self.connected)
        );
        let counters: [(&str, &str, u64); 6] = [
            (
                "kvgate_sim_kvbm_offloaded_blocks_total",
                "Blocks kvgate-kvbm took (stored or already held).",
                get(&self.offloaded_blocks),
            ),
            (
                "kvgate_sim_kvbm_offload_dropped_blocks_total",
                "Blocks not offloaded (queue full, daemon away or failing, or no room there).",
                get(&self.offload_dropped_blocks),
            ),
            (
                "kvgate_sim_kvbm_lookups_total",
                "Prefix lookups kvgate-kvbm answered.",
                get(&self.lookups),
            ),
            (
                "kvgate_sim_kvbm_lookups_failed_total",
                "Prefix lookups answered as misses without kvgate-kvbm (queue full, away, failing).",
                get(&self.lookups_failed),
            ),
            (
                "kvgate_sim_kvbm_corrupt_blocks_total",
                "Onboarded blocks whose bytes were not the block's (recomputed instead).",
                get(&self.corrupt_blocks),
            ),
            (
                "kvgate_sim_kvbm_errors_total",
                "Failed calls to kvgate-kvbm (connect, offload, lookup, onboard, timeouts).",
                get(&self.errors),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        let name = "kvgate_sim_kvbm_onboarded_blocks_total";
        let _ = writeln!(
            out,
            "# HELP {name} Blocks onboarded from kvgate-kvbm, by the level that held them.\n\
             # TYPE {name} counter"
        );
        for (tier, a) in [
            ("host", &self.onboarded_host),
            ("disk", &self.onboarded_disk),
            ("remote", &self.onboarded_remote),
        ] {
            let _ = writeln!(out, "{name}{{tier=\"{tier}\"}} {}", get(a));
        }
    }
}

/// The driver's side: request salts (keys fold them in) and the loop's wake-up.
#[derive(Debug, Clone)]
pub struct KvbmHandle {
    salts: Arc<Mutex<HashMap<RequestId, String>>>,
    /// Notified when a lookup's answer arrives.
    pub wake: Arc<Notify>,
    /// Counters.
    pub stats: Arc<KvbmStats>,
}

impl KvbmHandle {
    /// Records a request's `cache_salt` before the engine sees it.
    pub fn set_salt(&self, id: RequestId, salt: String) {
        lock(&self.salts).insert(id, salt);
    }
}

enum Job {
    Offload { parent: Option<u64>, keys: Vec<u64> },
    Lookup { id: RequestId, keys: Vec<u64> },
}

/// The engine model's offload tier, answered by the daemon.
#[derive(Debug)]
pub struct KvbmTier {
    /// Offloads, and lookups (served first: a request waits on each).
    offloads: mpsc::Sender<Job>,
    lookups: mpsc::Sender<Job>,
    answers: Arc<Mutex<HashMap<RequestId, Sources>>>,
    /// Requests whose lookup went to the worker: the first block asked for.
    asked: HashMap<RequestId, usize>,
    /// Their answers once in, kept while the request waits for GPU blocks to load them into
    /// (the blocks are already in the segment: the onboard ran with the lookup).
    known: HashMap<RequestId, Sources>,
    chains: HashMap<RequestId, KeyChain>,
    handle: KvbmHandle,
    model: String,
    block_size: usize,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Offload { keys, .. } => write!(f, "Offload({} blocks)", keys.len()),
            Self::Lookup { id, keys } => write!(f, "Lookup({id}, {} blocks)", keys.len()),
        }
    }
}

impl KvbmTier {
    /// Starts the worker on the current runtime (it connects on its first call).
    pub fn start(config: KvbmConfig) -> (Self, KvbmHandle) {
        let (offloads, offload_rx) = mpsc::channel(QUEUE);
        let (lookups, lookup_rx) = mpsc::channel(QUEUE);
        let handle = KvbmHandle {
            salts: Arc::default(),
            wake: Arc::new(Notify::new()),
            stats: Arc::default(),
        };
        let answers = Arc::default();
        let model = config.layout.model.clone();
        let block_size = config.layout.block_size as usize;
        tokio::spawn(
            Worker {
                config,
                client: None,
                retry_at: None,
                answers: Arc::clone(&answers),
                handle: handle.clone(),
            }
            .run(lookup_rx, offload_rx),
        );
        let tier = Self {
            offloads,
            lookups,
            answers,
            asked: HashMap::new(),
            known: HashMap::new(),
            chains: HashMap::new(),
            handle: handle.clone(),
            model,
            block_size,
        };
        (tier, handle)
    }

    /// The request's kvgate keys for every full block of `tokens`.
    fn keys(&mut self, id: RequestId, tokens: &[u32]) -> &[kv_events::BlockKey] {
        let (model, bs, salts) = (&self.model, self.block_size, &self.handle.salts);
        let chain = self.chains.entry(id).or_insert_with(|| {
            let salt = lock(salts).get(&id).cloned();
            KeyChain::new(model, salt.as_deref(), SaltStyle::VllmExtraKey, bs)
        });
        chain.advance(tokens);
        chain.keys()
    }
}

impl OffloadTier for KvbmTier {
    fn offload(&mut self, b: Offload<'_>, _events: &mut Vec<CacheEvent>) {
        // One call per contiguous run, chained on the block before it.
        let runs: Vec<(Option<u64>, Vec<u64>)> = {
            let all = self.keys(b.request, b.tokens);
            let key = |i: usize| all.get(i).map(|k| k.0);
            b.indices
                .chunk_by(|x, y| *y == *x + 1)
                .filter_map(|run| {
                    let first = *run.first()?;
                    let parent = first.checked_sub(1).and_then(key);
                    Some((parent, run.iter().filter_map(|&i| key(i)).collect()))
                })
                .collect()
        };
        for (parent, keys) in runs {
            let n = keys.len() as u64;
            if self
                .offloads
                .try_send(Job::Offload { parent, keys })
                .is_err()
            {
                self.handle
                    .stats
                    .offload_dropped_blocks
                    .fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// kvgate's vLLM connector loads in the step that schedules the request.
    fn loads_in_step(&self, _sources: &Sources) -> bool {
        true
    }

    fn lookup(&mut self, r: LookupRequest<'_>) -> Lookup {
        if let Some(first) = self.asked.get(&r.request).copied() {
            let sources = match self.known.get(&r.request) {
                Some(s) => *s,
                None => {
                    let Some(s) = lock(&self.answers).remove(&r.request) else {
                        return Lookup::Pending;
                    };
                    self.known.insert(r.request, s);
                    s
                }
            };
            // The answer covers blocks `first..first + n`; the request now starts at
            // `r.first_block` (its GPU hit may have grown or shrunk meanwhile).
            let end = first + sources.blocks();
            if r.first_block < first || end <= r.first_block {
                return Lookup::Found(Sources::default());
            }
            return Lookup::Found(sources.skip(r.first_block - first));
        }
        let keys: Vec<u64> = {
            let all = self.keys(r.request, r.tokens);
            all.get(r.first_block..r.first_block + r.hashes.len())
                .unwrap_or_default()
                .iter()
                .map(|k| k.0)
                .collect()
        };
        if keys.is_empty() {
            return Lookup::Found(Sources::default());
        }
        match self.lookups.try_send(Job::Lookup {
            id: r.request,
            keys,
        }) {
            Ok(()) => {
                self.asked.insert(r.request, r.first_block);
                Lookup::Pending
            }
            Err(_) => {
                self.handle
                    .stats
                    .lookups_failed
                    .fetch_add(1, Ordering::Relaxed);
                Lookup::Found(Sources::default())
            }
        }
    }

    /// The load began: a later admission (after a preemption) asks again.
    fn load_started(&mut self, r: LookupRequest<'_>, _sources: Sources) {
        self.asked.remove(&r.request);
        self.known.remove(&r.request);
    }

    fn finished(&mut self, request: RequestId) {
        self.chains.remove(&request);
        self.asked.remove(&request);
        self.known.remove(&request);
        lock(&self.answers).remove(&request);
        lock(&self.handle.salts).remove(&request);
    }

    /// The daemon's blocks are the node's, not this engine's: a prefix-cache reset keeps them.
    fn clear(&mut self) {}

    fn len(&self) -> usize {
        0
    }

    fn hashes(&self) -> Vec<u64> {
        Vec::new()
    }
}

struct Worker {
    config: KvbmConfig,
    client: Option<Client>,
    retry_at: Option<Instant>,
    answers: Arc<Mutex<HashMap<RequestId, Sources>>>,
    handle: KvbmHandle,
}

#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("no answer within {CALL_TIMEOUT:?}")]
    Timeout,
    #[error("not connected (retrying shortly)")]
    Away,
}

impl Worker {
    /// Serves calls until the tier is dropped: lookups first (a request waits on each), then
    /// offloads, in order within each.
    async fn run(mut self, mut lookups: mpsc::Receiver<Job>, mut offloads: mpsc::Receiver<Job>) {
        loop {
            let job = tokio::select! {
                biased;
                Some(job) = lookups.recv() => job,
                Some(job) = offloads.recv() => job,
                else => return,
            };
            match job {
                Job::Offload { parent, keys } => {
                    let n = keys.len() as u64;
                    match self.offload(parent, &keys).await {
                        Ok(taken) => {
                            let stats = &self.handle.stats;
                            stats.offloaded_blocks.fetch_add(taken, Ordering::Relaxed);
                            stats
                                .offload_dropped_blocks
                                .fetch_add(n - taken, Ordering::Relaxed);
                        }
                        Err(e) => {
                            self.failed("offload", &e);
                            self.handle
                                .stats
                                .offload_dropped_blocks
                                .fetch_add(n, Ordering::Relaxed);
                        }
                    }
                }
                Job::Lookup { id, keys } => {
                    let sources = match self.onboard(&keys).await {
                        Ok(s) => {
                            let stats = &self.handle.stats;
                            stats.lookups.fetch_add(1, Ordering::Relaxed);
                            stats
                                .onboarded_host
                                .fetch_add(s.host as u64, Ordering::Relaxed);
                            stats
                                .onboarded_disk
                                .fetch_add(s.disk as u64, Ordering::Relaxed);
                            stats
                                .onboarded_remote
                                .fetch_add(s.remote as u64, Ordering::Relaxed);
                            s
                        }
                        Err(e) => {
                            self.failed("lookup", &e);
                            self.handle
                                .stats
                                .lookups_failed
                                .fetch_add(1, Ordering::Relaxed);
                            Sources::default()
                        }
                    };
                    lock(&self.answers).insert(id, sources);
                    self.handle.wake.notify_one();
                }
            }
        }
    }

    fn failed(&mut self, op: &str, e: &CallError) {
        if !matches!(e, CallError::Away) {
            tracing::warn!(op, error = %e, "kvbm call failed; reconnecting");
            self.handle.stats.errors.fetch_add(1, Ordering::Relaxed);
            self.client = None;
            self.handle.stats.connected.store(0, Ordering::Relaxed);
            self.retry_at = Some(Instant::now() + RECONNECT_AFTER);
        }
    }

    /// The connected client, connecting first when due.
    async fn client(&mut self) -> Result<&mut Client, CallError> {
        if self.client.is_none() {
            if self.retry_at.is_some_and(|t| Instant::now() < t) {
                return Err(CallError::Away);
            }
            let segment = self.config.layout.block_bytes * SLOTS as u64;
            let connect = Client::connect(&self.config.socket, self.config.layout.clone(), segment);
            match tokio::time::timeout(CALL_TIMEOUT, connect).await {
                Ok(Ok(c)) => {
                    tracing::info!(socket = %self.config.socket.display(), layout_id = c.layout_id(), "connected to kvbm");
                    self.handle.stats.connected.store(1, Ordering::Relaxed);
                    self.retry_at = None;
                    self.client = Some(c);
                }
                Ok(Err(e)) => {
                    let e = CallError::from(e);
                    self.failed("connect", &e);
                    return Err(CallError::Away);
                }
                Err(_) => {
                    self.failed("connect", &CallError::Timeout);
                    return Err(CallError::Away);
                }
            }
        }
        self.client.as_mut().ok_or(CallError::Away)
    }

    /// Offloads a chain run in segment-sized calls: blocks the daemon took.
    async fn offload(&mut self, parent: Option<u64>, keys: &[u64]) -> Result<u64, CallError> {
        let block_bytes = self.config.layout.block_bytes;
        let mut parent = parent;
        let mut taken = 0;
        for chunk in keys.chunks(SLOTS) {
            let client = self.client().await?;
            let mut slots = Vec::with_capacity(chunk.len());
            for (i, &key) in chunk.iter().enumerate() {
                let offset = i as u64 * block_bytes;
                // The block's bytes are its key, then whatever the slot held: enough for
                // the onboard to check it got this block back.
                client
                    .segment()
                    .write(offset, &stamp(key, block_bytes))
                    .map_err(ClientError::from)?;
                slots.push(Slot { key, offset });
            }
            let call = client.offload(parent, slots);
            let (stored, present, _skipped) = tokio::time::timeout(CALL_TIMEOUT, call)
                .await
                .map_err(|_| CallError::Timeout)??;
            taken += u64::from(stored + present);
            parent = chunk.last().copied();
        }
        Ok(taken)
    }

    /// Looks `keys` up and onboards the leading blocks the daemon holds.
    async fn onboard(&mut self, keys: &[u64]) -> Result<Sources, CallError> {
        let block_bytes = self.config.layout.block_bytes;
        let stats = Arc::clone(&self.handle.stats);
        let client = self.client().await?;
        // The leading blocks held, in requests of at most the protocol's block limit.
        let mut any = 0;
        for chunk in keys.chunks(MAX_BLOCKS) {
            let (_, found) = tokio::time::timeout(CALL_TIMEOUT, client.lookup(chunk.to_vec()))
                .await
                .map_err(|_| CallError::Timeout)??;
            any += found as usize;
            if (found as usize) < chunk.len() {
                break;
            }
        }
        let mut sources = Sources::default();
        let held = keys.get(..any).unwrap_or_default();
        for chunk in held.chunks(SLOTS) {
            let slots: Vec<Slot> = chunk
                .iter()
                .enumerate()
                .map(|(i, &key)| Slot {
                    key,
                    offset: i as u64 * block_bytes,
                })
                .collect();
            let done = tokio::time::timeout(CALL_TIMEOUT, client.onboard(slots))
                .await
                .map_err(|_| CallError::Timeout)??;
            // Blocks come back host first, then disk, then remote (the daemon's search
            // order), so the levels of the intact leading ones follow from the counts.
            let mut intact = 0;
            for (i, &key) in chunk.iter().take(done.blocks as usize).enumerate() {
                let head = client
                    .segment()
                    .read(i as u64 * block_bytes, 8.min(block_bytes))
                    .map_err(ClientError::from)?;
                if head.as_ref() != &stamp(key, block_bytes)[..] {
                    stats.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                intact += 1;
            }
            sources += Sources {
                host: done.host as usize,
                disk: done.disk as usize,
                remote: done.remote as usize,
            }
            .take(intact);
            if intact < chunk.len() {
                break;
            }
        }
        Ok(sources)
    }
}

/// The bytes written at the head of a block's slot: its key, little-endian (cut to the block
/// for blocks under 8 bytes).
fn stamp(key: u64, block_bytes: u64) -> Vec<u8> {
    let b = key.to_le_bytes();
    b.get(..8.min(block_bytes as usize))
        .unwrap_or_default()
        .to_vec()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_is_the_key_cut_to_tiny_blocks() {
        assert_eq!(stamp(0x0102, 64), 0x0102u64.to_le_bytes());
        assert_eq!(stamp(0x0102, 2), [2, 1]);
    }
}
