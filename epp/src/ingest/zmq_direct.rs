//! Direct-ZMQ ingestion: one thread per engine rank runs `engine_zmq`'s receive loop (PUB
//! subscription, gap repair through the engine's replay ROUTER when it has one) and applies the
//! normalised events to the index; a gap replay cannot cover, or an engine restart, drops the
//! source's entries first.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use engine_zmq::{Frame, FrameSink, StartFrom, StreamConfig};
use kv_events::KvEvent;
use kv_events::frame::FrameError;
use kv_index::{EndpointId, Holder, KvIndex};

use super::source::{Outcome, SourceState};

/// How long a receive waits before checking for stop.
const POLL: Duration = Duration::from_millis(200);
/// How long a replay may take before it is abandoned.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// One engine rank to subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectSource {
    /// The endpoint whose events these are.
    pub endpoint: EndpointId,
    /// Served model (the key seed).
    pub model: String,
    /// Engine block size.
    pub block_size: u32,
    /// PUB endpoint, e.g. `tcp://10.0.0.1:5557`.
    pub publisher: String,
    /// Replay ROUTER endpoint, if the engine has one.
    pub replay: Option<String>,
}

/// Counters across all sources, for metrics.
#[derive(Debug, Default)]
pub struct IngestStats {
    /// Batches applied.
    pub batches: AtomicU64,
    /// kvgate events applied to the index.
    pub events: AtomicU64,
    /// Gaps detected.
    pub gaps: AtomicU64,
    /// Gaps repaired by replay.
    pub replays: AtomicU64,
    /// Gaps that forced a resync (source entries dropped).
    pub resyncs: AtomicU64,
    /// Engine restarts seen.
    pub restarts: AtomicU64,
    /// Malformed frames or payloads.
    pub malformed: AtomicU64,
}

struct Running {
    source: DirectSource,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The set of subscriptions, kept in step with discovery by [`Ingester::sync`].
pub struct Ingester {
    ctx: zmq::Context,
    index: Arc<KvIndex>,
    running: HashMap<EndpointId, Running>,
    stats: Arc<IngestStats>,
}

impl std::fmt::Debug for Ingester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingester")
            .field("sources", &self.running.len())
            .finish_non_exhaustive()
    }
}

impl Ingester {
    /// An ingester applying to `index`.
    pub fn new(index: Arc<KvIndex>) -> Self {
        Self {
            ctx: zmq::Context::new(),
            index,
            running: HashMap::new(),
            stats: Arc::default(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> Arc<IngestStats> {
        Arc::clone(&self.stats)
    }

    /// Sources subscribed to.
    pub fn len(&self) -> usize {
        self.running.len()
    }

    /// Whether nothing is subscribed.
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// Subscribes to new sources and stops those no longer wanted (or changed).
    pub fn sync(&mut self, wanted: Vec<DirectSource>) {
        let wanted: HashMap<EndpointId, DirectSource> =
            wanted.into_iter().map(|s| (s.endpoint, s)).collect();
        let stale: Vec<EndpointId> = self
            .running
            .iter()
            .filter(|(id, r)| wanted.get(id) != Some(&r.source))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(mut r) = self.running.remove(&id) {
                r.stop.store(true, Ordering::Relaxed);
                if let Some(t) = r.thread.take() {
                    let _ = t.join();
                }
            }
        }
        for (id, source) in wanted {
            if self.running.contains_key(&id) {
                continue;
            }
            let stop = Arc::new(AtomicBool::new(false));
            let ctx = self.ctx.clone();
            let index = Arc::clone(&self.index);
            let stats = Arc::clone(&self.stats);
            let (src, flag) = (source.clone(), Arc::clone(&stop));
            let thread = std::thread::Builder::new()
                .name(format!("kv-zmq-{}", id.get()))
                .spawn(move || run_source(&ctx, &src, &index, &flag, &stats))
                .map_err(|e| tracing::error!(error = %e, "cannot start a KV-event subscriber"))
                .ok();
            self.running.insert(
                id,
                Running {
                    source,
                    stop,
                    thread,
                },
            );
        }
    }
}

impl Drop for Ingester {
    fn drop(&mut self) {
        self.sync(Vec::new());
    }
}

fn run_source(
    ctx: &zmq::Context,
    src: &DirectSource,
    index: &KvIndex,
    stop: &AtomicBool,
    stats: &IngestStats,
) {
    // With a replay socket, catch up on what the engine published before we joined.
    let start = if src.replay.is_some() {
        StartFrom::Zero
    } else {
        StartFrom::Live
    };
    let mut cfg = StreamConfig::new(src.publisher.clone(), src.replay.clone(), start);
    cfg.poll = POLL;
    cfg.replay_timeout = REPLAY_TIMEOUT;
    let mut sink = IndexSink {
        holder: Holder::Endpoint(src.endpoint),
        endpoint: src.endpoint,
        index,
        stats,
        state: SourceState::new(&src.model, src.block_size),
        out: Vec::new(),
    };
    if let Err(e) = engine_zmq::run(ctx, &cfg, stop, &mut sink) {
        tracing::error!(publisher = %src.publisher, error = %e, "KV-event subscription failed");
    }
}

/// Applies one engine stream's in-sequence frames to the index.
struct IndexSink<'a> {
    holder: Holder,
    endpoint: EndpointId,
    index: &'a KvIndex,
    stats: &'a IngestStats,
    state: SourceState,
    out: Vec<KvEvent>,
}

impl FrameSink for IndexSink<'_> {
    fn frame(&mut self, frame: Frame<'_>) {
        self.out.clear();
        match self.state.apply(frame.seq, frame.payload, &mut self.out) {
            Outcome::Applied => apply(self.index, self.holder, &self.out, self.stats),
            Outcome::Undecodable => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn gap(&mut self, _from: u64, _got: u64) {
        self.stats.gaps.fetch_add(1, Ordering::Relaxed);
    }

    fn repaired(&mut self, _from: u64, _got: u64) {
        self.stats.replays.fetch_add(1, Ordering::Relaxed);
    }

    fn lost(&mut self, from: u64, got: u64) {
        self.stats.resyncs.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            from,
            got,
            endpoint = self.endpoint.get(),
            "KV-event gap not repairable: dropping the source's entries"
        );
        self.index.remove_source(self.holder);
        self.state.reset();
    }

    fn restarted(&mut self) {
        self.stats.restarts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            endpoint = self.endpoint.get(),
            "engine restarted: dropping its entries"
        );
        self.index.remove_source(self.holder);
        self.state.reset();
    }

    fn malformed(&mut self, _error: &FrameError) {
        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
    }
}

fn apply(index: &KvIndex, holder: Holder, events: &[KvEvent], stats: &IngestStats) {
    if events.is_empty() {
        return;
    }
    index.apply(holder, events);
    stats.batches.fetch_add(1, Ordering::Relaxed);
    stats
        .events
        .fetch_add(events.len() as u64, Ordering::Relaxed);
}
