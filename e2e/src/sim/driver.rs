//! The live engine loop: owns the engine model, steps it in scaled real time, hands each
//! request's tokens to its HTTP handler and each step's cache events to the publisher.
//!
//! One task runs the loop. A step is computed under a short lock at model time `t`; the loop
//! then sleeps until `t + duration` (wall time divided by the time scale) and delivers the
//! step's outputs, as vLLM returns a step's tokens when the forward pass ends. Requests that
//! arrive meanwhile join the next step (continuous batching).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use engine_model::{
    AdmitError, BlockHashChain, Engine, EngineStats, KvTransfer, Nanos, NewRequest, RequestId,
    TransferParams,
};
use tokio::sync::{Notify, mpsc};

use super::clock::Clock;
use super::events::BatchEncoder;
use super::kvbm::KvbmHandle;
use super::publisher::Publisher;

/// What a handler asks the engine to run.
#[derive(Debug)]
pub struct Submit {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// The tokens to generate, in order.
    pub output: Vec<u32>,
    /// The request's block-hash chain.
    pub hasher: Box<dyn BlockHashChain>,
    /// vLLM `cache_salt` (published in the first block's extra keys).
    pub salt: Option<String>,
    /// P/D role of this request.
    pub kv_transfer: Option<KvTransfer>,
}

/// One delivery to a request's handler.
#[derive(Debug, Clone)]
pub struct Update {
    /// Tokens produced by the step (0 or 1).
    pub tokens: Vec<u32>,
    /// Prompt tokens served from cache, on the first token.
    pub cached: Option<u32>,
    /// The request is done.
    pub finished: bool,
    /// P/D parameters, for a prefill-only request when it finishes.
    pub transfer: Option<TransferParams>,
    /// The request was preempted (its tokens so far stay valid; it will be recomputed).
    pub preempted: bool,
    /// Model time at which the step ended.
    pub at: Nanos,
    /// On the first token: model time spent waiting to be scheduled.
    pub queue_time: Option<Nanos>,
}

/// Why a request was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The waiting queue is at its bound.
    #[error("the engine's waiting queue is full ({0} requests)")]
    QueueFull(u32),
    /// The engine model refused it.
    #[error(transparent)]
    Admit(#[from] AdmitError),
    /// The engine loop is gone (shutting down).
    #[error("the engine is shutting down")]
    Stopped,
}

struct Sink {
    tx: mpsc::UnboundedSender<Update>,
    salt: Option<String>,
}

struct State {
    engine: Engine,
    sinks: HashMap<RequestId, Sink>,
    next_id: RequestId,
    stopped: bool,
}

/// How far behind its schedule the loop delivers steps (wall time), so an overloaded simulator
/// says so instead of silently running slower than its model.
#[derive(Debug, Default)]
pub struct LagStats {
    /// Sum of lags, in wall nanoseconds.
    pub sum_ns: std::sync::atomic::AtomicU64,
    /// Steps delivered.
    pub steps: std::sync::atomic::AtomicU64,
    /// Largest lag seen, in wall nanoseconds.
    pub max_ns: std::sync::atomic::AtomicU64,
}

/// Timer jitter the engine clock absorbs before it jumps to the wall clock: steps run back to
/// back in model time while the loop is late by less than this (wall time).
const MAX_DRIFT: std::time::Duration = std::time::Duration::from_millis(5);

struct Shared {
    /// End (model time) of the step in flight; 0 while idle.
    busy_until: std::sync::atomic::AtomicU64,
    lag: Arc<LagStats>,
    state: Mutex<State>,
    wake: Arc<Notify>,
    kvbm: Option<KvbmHandle>,
    clock: Clock,
    publisher: Option<Publisher>,
    encoder: BatchEncoder,
    max_waiting: u32,
}

/// A handle on the running engine loop; cheap to clone.
#[derive(Clone)]
pub struct Driver {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

/// A submitted request: its updates, and an abort when dropped before it finishes.
#[derive(Debug)]
pub struct Ticket {
    /// The engine's id for it.
    pub id: RequestId,
    /// Model time of arrival.
    pub arrival: Nanos,
    /// Updates, in order; closed after the finishing one.
    pub updates: mpsc::UnboundedReceiver<Update>,
    driver: Driver,
    done: bool,
}

impl Ticket {
    /// The next update; `None` once the request is done or the engine stopped.
    pub async fn next(&mut self) -> Option<Update> {
        if self.done {
            return None;
        }
        let u = self.updates.recv().await;
        match &u {
            Some(u) if u.finished => self.done = true,
            None => self.done = true,
            _ => {}
        }
        u
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            self.driver.abort(self.id);
        }
    }
}

impl Driver {
    /// Starts the loop on the current tokio runtime.
    pub fn spawn(
        engine: Engine,
        clock: Clock,
        publisher: Option<Publisher>,
        encoder: BatchEncoder,
        max_waiting: u32,
        kvbm: Option<KvbmHandle>,
    ) -> Self {
        let shared = Arc::new(Shared {
            busy_until: std::sync::atomic::AtomicU64::new(0),
            lag: Arc::default(),
            state: Mutex::new(State {
                engine,
                sinks: HashMap::new(),
                next_id: 1,
                stopped: false,
            }),
            wake: kvbm
                .as_ref()
                .map_or_else(|| Arc::new(Notify::new()), |k| Arc::clone(&k.wake)),
            kvbm,
            clock,
            publisher,
            encoder,
            max_waiting,
        });
        tokio::spawn(run(Arc::clone(&shared)));
        Self { shared }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Step-delivery lag counters.
    pub fn lag(&self) -> Arc<LagStats> {
        Arc::clone(&self.shared.lag)
    }

    /// The model clock.
    pub fn clock(&self) -> Clock {
        self.shared.clock
    }

    /// Admits a request.
    pub fn submit(&self, s: Submit) -> Result<Ticket, SubmitError> {
        // While the engine is busy its clock is the end of the running step; a request arriving
        // during that step is due for the next one even if timer jitter put the wall clock a
        // little past it.
        let wall_now = self.shared.clock.now();
        let busy_until = self
            .shared
            .busy_until
            .load(std::sync::atomic::Ordering::Relaxed);
        let arrival = if busy_until == 0 {
            wall_now
        } else {
            wall_now.min(busy_until)
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut st = self.lock();
            if st.stopped {
                return Err(SubmitError::Stopped);
            }
            let waiting = u32::try_from(st.engine.num_waiting()).unwrap_or(u32::MAX);
            if self.shared.max_waiting > 0 && waiting >= self.shared.max_waiting {
                return Err(SubmitError::QueueFull(waiting));
            }
            let id = st.next_id;
            st.next_id += 1;
            st.engine.add_request(NewRequest {
                id,
                prompt: s.prompt,
                output: s.output,
                hasher: s.hasher,
                arrival,
                kv_transfer: s.kv_transfer,
            })?;
            // Before the next step, the first that can look the request's blocks up.
            if let (Some(k), Some(salt)) = (&self.shared.kvbm, &s.salt) {
                k.set_salt(id, salt.clone());
            }
            st.sinks.insert(id, Sink { tx, salt: s.salt });
            id
        };
        self.shared.wake.notify_one();
        Ok(Ticket {
            id,
            arrival,
            updates: rx,
            driver: self.clone(),
            done: false,
        })
    }

    /// Drops a request (client disconnect).
    pub fn abort(&self, id: RequestId) {
        let mut st = self.lock();
        st.sinks.remove(&id);
        st.engine.abort(id);
    }

    /// The engine's current statistics.
    pub fn stats(&self) -> EngineStats {
        self.lock().engine.stats()
    }

    /// vLLM `/reset_prefix_cache`; false while blocks are in use.
    pub fn reset_prefix_cache(&self) -> bool {
        let ok = self.lock().engine.reset_prefix_cache();
        self.shared.wake.notify_one();
        ok
    }

    /// Stops the loop; pending requests see their update channel close.
    pub fn stop(&self) {
        let mut st = self.lock();
        st.stopped = true;
        st.sinks.clear();
        drop(st);
        self.shared.wake.notify_one();
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A panic while holding the lock would poison it; the state is still consistent for the
    // engine model (every method leaves it valid), so keep serving.
    shared
        .state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn wall_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn run(shared: Arc<Shared>) {
    use std::sync::atomic::Ordering::Relaxed;
    let max_drift = (MAX_DRIFT.as_nanos() as f64 * shared.clock.scale()) as Nanos;
    // Model time at which the previous step ended, while steps run back to back.
    let mut busy_until: Option<Nanos> = None;
    loop {
        let wall = shared.clock.now();
        let now = match busy_until {
            Some(t) => t.max(wall.saturating_sub(max_drift)),
            None => wall,
        };
        let (step, payload, wakeup) = {
            let mut st = lock(&shared);
            if st.stopped {
                return;
            }
            let step = st.engine.step(now);
            let mut events = st.engine.take_events();
            if let Some(s) = &step {
                // Reset events first: they were queued before this step ran.
                events.extend(s.events.iter().cloned());
            }
            let payload = if shared.publisher.is_some() {
                let sinks = &st.sinks;
                shared.encoder.encode(wall_ts(), &events, |id| {
                    sinks.get(&id).and_then(|s| s.salt.clone())
                })
            } else {
                None
            };
            (step, payload, st.engine.next_wakeup())
        };
        let Some(step) = step else {
            busy_until = None;
            shared.busy_until.store(0, Relaxed);
            if let (Some(p), Some(payload)) = (&shared.publisher, payload) {
                p.publish(payload);
            }
            match wakeup {
                Some(t) => {
                    let at = tokio::time::Instant::from_std(shared.clock.wall_at(t));
                    tokio::select! {
                        () = shared.wake.notified() => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => shared.wake.notified().await,
            }
            continue;
        };
        let end = now + step.duration;
        busy_until = Some(end);
        shared.busy_until.store(end.max(1), Relaxed);
        let due = shared.clock.wall_at(end);
        tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
        let lag = std::time::Instant::now()
            .saturating_duration_since(due)
            .as_nanos() as u64;
        {
            shared.lag.sum_ns.fetch_add(lag, Relaxed);
            shared.lag.steps.fetch_add(1, Relaxed);
            shared.lag.max_ns.fetch_max(lag, Relaxed);
        }
        if let (Some(p), Some(payload)) = (&shared.publisher, payload) {
            p.publish(payload);
        }
        let mut st = lock(&shared);
        for out in step.outputs {
            let finished = out.finished.is_some();
            let update = Update {
                tokens: out.new_tokens,
                cached: out.num_cached_tokens,
                finished,
                transfer: out.kv_transfer_params,
                preempted: out.preempted,
                at: end,
                queue_time: out.queue_time,
            };
            let gone = match st.sinks.get(&out.id) {
                Some(sink) => sink.tx.send(update).is_err(),
                None => false,
            };
            if finished || gone {
                st.sinks.remove(&out.id);
            }
        }
    }
}
