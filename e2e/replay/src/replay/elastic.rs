//! A pool that changes while the replay runs: engines added (routable after a start-up delay),
//! engines removed (drained first), the decode leg of a disaggregated request, and what an
//! autoscaler reads each interval.
//!
//! An engine's life: `Starting` (listed, not ready: the router does not pick it) → `Serving` →
//! `Draining` (not ready; finishes the requests and prefill legs it holds) → `Gone` (removed
//! from the router: index entries, load samples, in-flight accounting). Removing a `Starting`
//! engine makes it `Gone` at once (a pod deleted before it was ready).

use engine_model::{KvTransfer, Nanos, RequestId};
use scheduler::Role;

use super::{EngineSlot, Event, Replay, ReplayError};

/// Where an engine is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Life {
    /// Added, not ready yet.
    Starting,
    /// Ready: the router may pick it.
    Serving,
    /// Removed from routing; finishing what it holds.
    Draining,
    /// Left the pool.
    Gone,
}

/// One engine's life, for accounting (GPU time runs from `added_at` to `gone_at`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLife {
    /// Its role.
    pub role: Role,
    /// When it was added (0 for the initial engines).
    pub added_at: Nanos,
    /// When it became ready, if it did.
    pub ready_at: Option<Nanos>,
    /// When it left the pool, if it did.
    pub gone_at: Option<Nanos>,
}

/// An engine as an autoscaler sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineView {
    /// Its index (the endpoint id).
    pub index: usize,
    /// Its role.
    pub role: Role,
    /// Its life.
    pub life: Life,
    /// When it was added.
    pub added_at: Nanos,
    /// Requests waiting in its queue (vLLM `num_requests_waiting`).
    pub waiting: u32,
    /// Requests running.
    pub running: u32,
    /// Requests and prefill legs routed to it and not finished.
    pub legs: u32,
}

/// What the gateway saw since the last [`Replay::take_interval`]: the figures the EPP's
/// metrics give an autoscaler.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IntervalStats {
    /// Requests routed.
    pub sent: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Requests completed.
    pub completed: u64,
    /// Their output tokens.
    pub output_tokens: u64,
    /// TTFT of each request whose first token came in the interval, ms.
    pub ttft_ms: Vec<f64>,
    /// Time per output token after the first of each request completed in the interval, ms.
    pub tpot_ms: Vec<f64>,
}

impl Replay<'_> {
    /// Virtual time now.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// Processes every event at or before `t`, then sets the clock to `t`. Returns whether
    /// events remain.
    pub fn run_until(&mut self, t: Nanos) -> bool {
        while self.queue.peek_time().is_some_and(|at| at <= t) {
            self.next_event();
        }
        self.now = self.now.max(t);
        !self.queue.is_empty()
    }

    /// Whether nothing is left to do: every session ended and no event is queued.
    pub fn is_done(&self) -> bool {
        self.queue.is_empty()
    }

    /// Adds an engine of `role` that becomes routable `start_up` from now. Returns its index.
    pub fn add_engine(&mut self, role: Role, start_up: Nanos) -> Result<usize, ReplayError> {
        let engine = super::new_engine(&self.config, self.node.as_ref())?;
        let index = self.router.add_endpoint(role)?;
        if self.node.is_some() {
            self.router.set_node(index, super::NODE);
        }
        self.engines.push(EngineSlot {
            engine,
            step: None,
            kicked: false,
            role,
            life: Life::Starting,
            legs: 0,
            added_at: self.now,
            ready_at: None,
            gone_at: None,
        });
        if start_up == 0 {
            self.ready(index);
        } else {
            self.queue.push(self.now + start_up, Event::Ready(index));
        }
        Ok(index)
    }

    /// Removes engine `index` from the pool: at once if it is still starting, else it stops
    /// taking requests and leaves when those it holds finish. Returns whether it was in the
    /// pool (starting or serving).
    pub fn remove_engine(&mut self, index: usize) -> bool {
        let Some(slot) = self.engines.get_mut(index) else {
            return false;
        };
        match slot.life {
            Life::Starting => {
                self.gone(index);
                true
            }
            Life::Serving => {
                slot.life = Life::Draining;
                self.router.set_ready(index, false);
                if slot.legs == 0 {
                    self.gone(index);
                }
                true
            }
            Life::Draining | Life::Gone => false,
        }
    }

    /// Every engine, gone ones included.
    pub fn engines(&self) -> impl Iterator<Item = EngineView> + '_ {
        self.engines
            .iter()
            .enumerate()
            .map(|(index, s)| EngineView {
                index,
                role: s.role,
                life: s.life,
                added_at: s.added_at,
                waiting: u32::try_from(s.engine.num_waiting()).unwrap_or(u32::MAX),
                running: s.engine.stats().running,
                legs: s.legs,
            })
    }

    /// What the gateway saw since the last call.
    pub fn take_interval(&mut self) -> IntervalStats {
        std::mem::take(&mut self.interval)
    }

    /// Every engine's life so far.
    pub fn lives(&self) -> Vec<EngineLife> {
        self.engines
            .iter()
            .map(|s| EngineLife {
                role: s.role,
                added_at: s.added_at,
                ready_at: s.ready_at,
                gone_at: s.gone_at,
            })
            .collect()
    }

    /// A starting engine finished starting.
    pub(super) fn ready(&mut self, index: usize) {
        let now = self.now;
        if let Some(slot) = self.engines.get_mut(index)
            && slot.life == Life::Starting
        {
            slot.life = Life::Serving;
            slot.ready_at = Some(now);
            self.router.set_ready(index, true);
        }
    }

    /// A request or prefill leg was routed to `index`.
    pub(super) fn assign(&mut self, index: usize) {
        if let Some(slot) = self.engines.get_mut(index) {
            slot.legs += 1;
        }
    }

    /// A request or prefill leg on `index` ended; a draining engine with nothing left goes.
    pub(super) fn release(&mut self, index: usize) {
        let Some(slot) = self.engines.get_mut(index) else {
            return;
        };
        slot.legs = slot.legs.saturating_sub(1);
        if slot.legs == 0 && slot.life == Life::Draining {
            self.gone(index);
        }
    }

    fn gone(&mut self, index: usize) {
        let now = self.now;
        if let Some(slot) = self.engines.get_mut(index) {
            slot.life = Life::Gone;
            slot.gone_at = Some(now);
            self.router.remove_endpoint(index);
        }
    }

    /// Request `id`'s prefill leg finished with `num_tokens` of KV to pull: its decode
    /// engine gets it as a remote prefill.
    pub(super) fn decode_leg(&mut self, id: RequestId, num_tokens: u32) {
        let Some(mut request) = self.pending_decode.remove(&id) else {
            return;
        };
        let Some(engine) = self.requests.get(&id).map(|o| o.engine) else {
            return;
        };
        request.arrival = self.now;
        request.kv_transfer = (num_tokens > 0).then_some(KvTransfer::RemotePrefill { num_tokens });
        self.arrive(engine, *request);
    }
}
