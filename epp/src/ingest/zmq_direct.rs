//! Direct-ZMQ ingestion: one thread per engine rank subscribes to its PUB socket, repairs gaps
//! through the engine's replay ROUTER when it has one (else drops the source's entries and
//! resynchronises), and applies the normalised events to the index.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_events::KvEvent;
use kv_events::frame::{KvFrame, ReplayReply, replay_request};
use kv_index::{EndpointId, Holder, KvIndex};

use super::source::{Outcome, SourceState};

/// How long a receive waits before checking for stop.
const POLL_MS: i32 = 200;
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
    let holder = Holder::Endpoint(src.endpoint);
    let sub = match subscribe(ctx, &src.publisher) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(publisher = %src.publisher, error = %e, "KV-event subscription failed");
            return;
        }
    };
    tracing::info!(publisher = %src.publisher, endpoint = src.endpoint.get(), "subscribed to KV events");
    let mut state = SourceState::new(&src.model, src.block_size);
    if src.replay.is_some() {
        // Catch up on what the engine published before we joined.
        state.resync_at(0);
    }
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let parts = match sub.recv_multipart(0) {
            Ok(p) => p,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "KV-event receive failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let Ok(frame) = KvFrame::from_parts(&parts) else {
            stats.malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        out.clear();
        let mut outcome = state.on_live(frame.seq, frame.payload, &mut out);
        if let Outcome::Gap { from, got } = outcome {
            stats.gaps.fetch_add(1, Ordering::Relaxed);
            let repaired = src
                .replay
                .as_deref()
                .is_some_and(|r| replay(ctx, r, got, &mut state, index, holder, stats));
            if repaired {
                stats.replays.fetch_add(1, Ordering::Relaxed);
                tracing::info!(from, got, "KV-event gap repaired by replay");
            } else {
                stats.resyncs.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    from,
                    got,
                    "KV-event gap not repairable: dropping the source's entries"
                );
                index.remove_source(holder);
                state.reset();
                state.resync_at(got);
            }
            out.clear();
            outcome = state.on_live(frame.seq, frame.payload, &mut out);
        }
        match outcome {
            Outcome::Applied => apply(index, holder, &out, stats),
            Outcome::Restarted => {
                stats.restarts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    endpoint = src.endpoint.get(),
                    "engine restarted: dropping its entries"
                );
                index.remove_source(holder);
                apply(index, holder, &out, stats);
            }
            Outcome::Undecodable => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Duplicate | Outcome::Gap { .. } => {}
        }
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

fn subscribe(ctx: &zmq::Context, endpoint: &str) -> zmq::Result<zmq::Socket> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_subscribe(b"")?;
    sub.set_rcvtimeo(POLL_MS)?;
    sub.set_linger(0)?;
    sub.connect(endpoint)?;
    Ok(sub)
}

/// Replays from the state's expected seq up to (not including) `until`; true when covered.
fn replay(
    ctx: &zmq::Context,
    endpoint: &str,
    until: u64,
    state: &mut SourceState,
    index: &KvIndex,
    holder: Holder,
    stats: &IngestStats,
) -> bool {
    let Some(from) = state.expected() else {
        return false;
    };
    let dealer = match ctx.socket(zmq::DEALER).and_then(|d| {
        d.set_rcvtimeo(POLL_MS)?;
        d.set_linger(0)?;
        d.connect(endpoint)?;
        d.send_multipart(replay_request(from), 0)?;
        Ok(d)
    }) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(%endpoint, error = %e, "KV-event replay request failed");
            return false;
        }
    };
    let deadline = Instant::now() + REPLAY_TIMEOUT;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        let parts = match dealer.recv_multipart(0) {
            Ok(p) => p,
            Err(_) => continue,
        };
        match ReplayReply::from_parts(&parts) {
            Ok(ReplayReply::End) => break,
            Ok(ReplayReply::Batch { frame, .. }) => {
                if frame.seq >= until {
                    continue;
                }
                out.clear();
                match state.on_replay(frame.seq, frame.payload, &mut out) {
                    Outcome::Applied => apply(index, holder, &out, stats),
                    Outcome::Gap { .. } => return false,
                    _ => {}
                }
            }
            Err(_) => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    state.expected() == Some(until)
}
