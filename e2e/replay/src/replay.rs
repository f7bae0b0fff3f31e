//! The discrete-event loop: sessions send turns, the router places them, engines step, outputs
//! and KV events flow back, all in virtual time.
//!
//! Events, in virtual nanoseconds, ties in scheduling order ([`EventQueue`]):
//! - `Send(session)`: the session's next turn is sent (its prompt is the whole history with
//!   the earlier answers from [`synth_answer`]); the router places it.
//! - `Arrive(engine, request)`: `request_latency` later, the engine queues it (at once when
//!   the latency is zero).
//! - `Kick(engine)`: an idle engine with work starts a step. Kicks are queued, not run inline,
//!   so requests sent at the same instant are batched as a live engine would batch them.
//! - `StepDone(engine)`: a step's outputs are delivered (first tokens, completions), its KV
//!   events leave for the router, and the engine starts its next step.
//! - `Deliver(engine, events)`: the events reach the router's index, `event_delay` after the step.
//! - `LoadTick`, `ExpireTick`: engine load samples, the EPP's expiry upkeep.
//! - `Ready(engine)`: an engine added while the replay runs finished starting and is routable.
//!
//! In a disaggregated pool (`prefill_engines > 0`) a decision with a prefill leg sends the
//! request first to the prefill engine as prefill-only (vLLM NIXL `do_remote_decode`: one
//! token, then the blocks to pull); when it finishes, the decode engine gets the request as a
//! remote prefill of those blocks (`do_remote_prefill`: it waits for the transfer, computes
//! the rest, and streams every output token) — the sidecar proxy's sequence. The client's
//! first token is the decode engine's. Engines can be added (routable after a start-up delay)
//! and removed (drained: no new requests, gone when their requests finish) while the replay
//! runs (`elastic`).
//!
//! Closed loop keeps `concurrency` sessions in flight (a session counts from its first send to
//! its last answer, think times included); open loop sends each session's first turn at its
//! start. A run ends when every session has ended and nothing is in flight.

use std::collections::HashMap;

use engine_model::{
    Engine, EngineStats, KvTransfer, Nanos, NewRequest, RequestId, StepOutput, XxhChain,
};
use scheduler::{InflightToken, Role};
use workload::{Pacing, RequestRecord, Status, Workload, synth_answer};

use crate::config::ReplayConfig;
use crate::node_tier::NodeStore;
use crate::queue::EventQueue;
use crate::router::{Router, RouterError, RouterStats};

mod elastic;

pub use elastic::{EngineLife, EngineView, IntervalStats, Life};

/// Why a replay could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// No engines.
    #[error("a replay needs at least one engine")]
    NoEngines,
    /// The engine configuration is invalid.
    #[error("engine configuration: {0}")]
    Engine(#[from] engine_model::ConfigError),
    /// The router could not be built.
    #[error(transparent)]
    Router(#[from] RouterError),
    /// Closed loop with zero concurrency.
    #[error("closed-loop concurrency must be at least 1")]
    ZeroConcurrency,
    /// Prefill engines without the scheduler's disaggregation (they would never be used), or
    /// no decode engine.
    #[error("a disaggregated pool needs scheduler.disaggregation.enabled and a decode engine")]
    Disaggregation,
}

/// What a replay produced.
#[derive(Debug, Clone)]
pub struct ReplayOutput {
    /// One record per request sent, in completion order.
    pub records: Vec<RequestRecord>,
    /// Each engine's counters at the end (prefix-cache queries and hits, preemptions, …).
    pub engines: Vec<EngineStats>,
    /// The router's counters.
    pub router: RouterStats,
    /// Virtual time of the last event.
    pub end: Nanos,
    /// Engine steps run, over all engines.
    pub steps: u64,
    /// Events processed.
    pub events: u64,
    /// The most sessions in flight at once.
    pub max_sessions_in_flight: usize,
    /// Every engine's life: role, when it was added, ready and gone.
    pub lives: Vec<EngineLife>,
    /// The node's KV block manager at the end, with one.
    pub node: Option<crate::NodeStats>,
}

#[derive(Debug)]
enum Event {
    Send(usize),
    Arrive(usize, Box<NewRequest>),
    Kick(usize),
    StepDone(usize),
    Deliver(usize, Vec<engine_model::CacheEvent>),
    DeliverNode(Vec<kv_events::KvEvent>),
    LoadTick,
    ExpireTick,
    Ready(usize),
}

#[derive(Debug)]
struct EngineSlot {
    engine: Engine,
    step: Option<StepOutput>,
    kicked: bool,
    role: Role,
    life: Life,
    /// Requests (or prefill legs) routed to it and not finished.
    legs: u32,
    added_at: Nanos,
    ready_at: Option<Nanos>,
    gone_at: Option<Nanos>,
}

#[derive(Debug, Default)]
struct SessionState {
    turn: u32,
    answers: Vec<Vec<u32>>,
    started: bool,
    done: bool,
}

#[derive(Debug)]
struct OpenRequest {
    session: usize,
    turn: u32,
    engine: usize,
    token: InflightToken,
    sent: Nanos,
    prompt_tokens: u32,
    first: Option<Nanos>,
    cached: Option<u32>,
    output_tokens: u32,
}

/// A replay in progress; [`Replay::next_event`] advances it one event at a time.
#[derive(Debug)]
pub struct Replay<'w> {
    workload: &'w Workload,
    config: ReplayConfig,
    router: Router,
    engines: Vec<EngineSlot>,
    queue: EventQueue<Event>,
    sessions: Vec<SessionState>,
    next_closed: usize,
    unfinished_sessions: usize,
    in_flight_sessions: usize,
    max_in_flight_sessions: usize,
    requests: HashMap<RequestId, OpenRequest>,
    /// Prefill legs in flight: leg id → (request id, prefill engine, its in-flight handle).
    prefill_legs: HashMap<RequestId, (RequestId, usize, Option<InflightToken>)>,
    /// Requests waiting for their prefill leg: the decode engine's request.
    pending_decode: HashMap<RequestId, Box<NewRequest>>,
    interval: IntervalStats,
    next_request: RequestId,
    records: Vec<RequestRecord>,
    now: Nanos,
    steps: u64,
    events: u64,
    /// The node's KV block manager, shared by every engine.
    node: Option<NodeStore>,
}

/// The one node of a replay with a block manager.
const NODE: kv_index::NodeId = match kv_index::NodeId::new(0) {
    Ok(n) => n,
    Err(_) => panic!("node 0 is in range"),
};

/// An engine of `config`, connected to `node`'s block manager when there is one.
fn new_engine(
    config: &ReplayConfig,
    node: Option<&NodeStore>,
) -> Result<Engine, engine_model::ConfigError> {
    match node {
        Some(n) => Engine::with_offload(
            config.engine.clone(),
            Box::new(n.connector(&config.model, config.engine.block_size)),
        ),
        None => Engine::new(config.engine.clone()),
    }
}

/// Runs `workload` to its end under `config`.
pub fn replay(workload: &Workload, config: ReplayConfig) -> Result<ReplayOutput, ReplayError> {
    let mut r = Replay::new(workload, config)?;
    while r.next_event().is_some() {}
    Ok(r.finish())
}

impl<'w> Replay<'w> {
    /// A replay at virtual time zero with its first events queued.
    pub fn new(workload: &'w Workload, config: ReplayConfig) -> Result<Self, ReplayError> {
        if config.engines == 0 {
            return Err(ReplayError::NoEngines);
        }
        let disaggregated = config.prefill_engines > 0;
        if disaggregated
            && (!config.scheduler.disaggregation.enabled
                || config.prefill_engines >= config.engines)
        {
            return Err(ReplayError::Disaggregation);
        }
        let role = |i: usize| match (disaggregated, i < config.prefill_engines) {
            (false, _) => Role::Both,
            (true, true) => Role::Prefill,
            (true, false) => Role::Decode,
        };
        let node = config.node_tier.map(NodeStore::new);
        let engines = (0..config.engines)
            .map(|i| {
                Ok(EngineSlot {
                    engine: new_engine(&config, node.as_ref())?,
                    step: None,
                    kicked: false,
                    role: role(i),
                    life: Life::Serving,
                    legs: 0,
                    added_at: 0,
                    ready_at: Some(0),
                    gone_at: None,
                })
            })
            .collect::<Result<Vec<_>, engine_model::ConfigError>>()?;
        let mut router = Router::new(
            config.engines,
            &config.model,
            config.engine.block_size,
            config.scheduler.clone(),
            config.seed,
        )?;
        if let Some(peer) = config.cache_aware {
            router = router.with_cache_aware(peer);
        }
        for (i, slot) in engines.iter().enumerate() {
            router.set_role(i, slot.role);
            if node.is_some() {
                router.set_node(i, NODE);
            }
        }
        router.account_prefill_legs(config.account_prefill_legs);
        let mut queue = EventQueue::new();
        let n = workload.sessions.len();
        let mut next_closed = 0;
        match workload.pacing {
            Pacing::Open => {
                for (i, s) in workload.sessions.iter().enumerate() {
                    queue.push(duration_ns(s.start), Event::Send(i));
                }
            }
            Pacing::Closed { concurrency } => {
                if concurrency == 0 {
                    return Err(ReplayError::ZeroConcurrency);
                }
                next_closed = n.min(concurrency as usize);
                for i in 0..next_closed {
                    queue.push(0, Event::Send(i));
                }
            }
        }
        if config.load_interval > 0 {
            queue.push(0, Event::LoadTick);
        }
        if config.expire_interval > 0 {
            queue.push(config.expire_interval, Event::ExpireTick);
        }
        Ok(Self {
            workload,
            router,
            engines,
            queue,
            sessions: (0..n).map(|_| SessionState::default()).collect(),
            next_closed,
            unfinished_sessions: n,
            in_flight_sessions: 0,
            max_in_flight_sessions: 0,
            requests: HashMap::new(),
            prefill_legs: HashMap::new(),
            pending_decode: HashMap::new(),
            interval: IntervalStats::default(),
            next_request: 0,
            records: Vec::new(),
            now: 0,
            steps: 0,
            events: 0,
            node,
            config,
        })
    }

    /// Processes the earliest pending event and returns its time; `None` when the run is over.
    pub fn next_event(&mut self) -> Option<Nanos> {
        let (at, event) = self.queue.pop()?;
        self.now = self.now.max(at);
        self.events += 1;
        match event {
            Event::Send(s) => self.send(s),
            Event::Arrive(e, request) => self.arrive(e, *request),
            Event::Kick(e) => {
                if let Some(slot) = self.engines.get_mut(e) {
                    slot.kicked = false;
                }
                self.run_engine(e);
            }
            Event::StepDone(e) => self.step_done(e),
            Event::Deliver(e, events) => self.router.deliver(e, events),
            Event::DeliverNode(events) => self.router.deliver_node(NODE, &events),
            Event::LoadTick => {
                for (i, slot) in self.engines.iter().enumerate() {
                    if matches!(slot.life, Life::Serving | Life::Draining) {
                        self.router.sample_load(i, &slot.engine.stats(), self.now);
                    }
                }
                if self.live() {
                    self.queue
                        .push(self.now + self.config.load_interval, Event::LoadTick);
                }
            }
            Event::ExpireTick => {
                self.router.expire(self.now);
                if self.live() {
                    self.queue
                        .push(self.now + self.config.expire_interval, Event::ExpireTick);
                }
            }
            Event::Ready(e) => self.ready(e),
        }
        Some(at)
    }

    /// Requests routed and not finished.
    pub fn requests_in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Sessions between their first send and their end.
    pub fn sessions_in_flight(&self) -> usize {
        self.in_flight_sessions
    }

    /// The router (for its counters and in-flight accounting).
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The records so far and the counters.
    pub fn finish(self) -> ReplayOutput {
        let lives = self.lives();
        ReplayOutput {
            records: self.records,
            engines: self.engines.iter().map(|s| s.engine.stats()).collect(),
            router: self.router.stats().clone(),
            end: self.now,
            steps: self.steps,
            events: self.events,
            max_sessions_in_flight: self.max_in_flight_sessions,
            lives,
            node: self.node.as_ref().map(NodeStore::stats),
        }
    }

    fn live(&self) -> bool {
        self.unfinished_sessions > 0 || !self.requests.is_empty()
    }

    fn send(&mut self, s: usize) {
        let workload = self.workload;
        let (Some(session), Some(state)) = (workload.sessions.get(s), self.sessions.get_mut(s))
        else {
            return;
        };
        if state.done {
            return;
        }
        if !state.started {
            state.started = true;
            self.in_flight_sessions += 1;
            self.max_in_flight_sessions = self.max_in_flight_sessions.max(self.in_flight_sessions);
        }
        if self.config.stop_at.is_some_and(|t| self.now >= t) {
            self.end_session(s);
            return;
        }
        let k = state.turn;
        let (Some(turn), Some(prompt)) = (
            session.turns.get(k as usize),
            session.prompt(&workload.vocab, k as usize, &state.answers),
        ) else {
            self.end_session(s);
            return;
        };
        let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        let placement = match self.router.route(&prompt, self.now) {
            Ok(p) => p,
            Err(e) => {
                self.fail(s, k, prompt_tokens, None, 503, e.to_string());
                self.end_session(s);
                return;
            }
        };
        let id = self.next_request;
        self.next_request += 1;
        self.interval.sent += 1;
        self.interval.prompt_tokens += u64::from(prompt_tokens);
        let output = synth_answer(&workload.vocab, session.id, k, turn.max_tokens);
        // A prefill leg: the prefill engine computes the prompt and makes one token; the
        // decode engine's request waits for it.
        let leg = placement
            .prefill
            .filter(|&p| p != placement.engine)
            .map(|p| {
                let leg_id = self.next_request;
                self.next_request += 1;
                let leg = NewRequest {
                    id: leg_id,
                    prompt: prompt.clone(),
                    output: output.first().map_or_else(Vec::new, |&t| vec![t]),
                    hasher: Box::new(XxhChain::new(self.config.engine_hash_seed)),
                    arrival: self.now,
                    kv_transfer: Some(KvTransfer::PrefillOnly),
                };
                (p, leg)
            });
        let request = NewRequest {
            id,
            prompt,
            output,
            hasher: Box::new(XxhChain::new(self.config.engine_hash_seed)),
            arrival: self.now,
            kv_transfer: None,
        };
        self.requests.insert(
            id,
            OpenRequest {
                session: s,
                turn: k,
                engine: placement.engine,
                token: placement.token,
                sent: self.now,
                prompt_tokens,
                first: None,
                cached: None,
                output_tokens: 0,
            },
        );
        self.assign(placement.engine);
        let (target, request) = match leg {
            Some((p, leg)) => {
                self.assign(p);
                self.prefill_legs
                    .insert(leg.id, (id, p, placement.prefill_token));
                self.pending_decode.insert(id, Box::new(request));
                (p, leg)
            }
            None => (placement.engine, request),
        };
        if self.config.request_latency == 0 {
            self.arrive(target, request);
        } else {
            self.queue.push(
                self.now + self.config.request_latency,
                Event::Arrive(target, Box::new(request)),
            );
        }
    }

    /// A routed request reaches its engine.
    fn arrive(&mut self, e: usize, mut request: NewRequest) {
        request.arrival = self.now;
        let id = request.id;
        let added = match self.engines.get_mut(e) {
            Some(slot) => slot.engine.add_request(request).map_err(|e| e.to_string()),
            None => Err("no such engine".to_owned()),
        };
        if let Err(error) = added {
            self.release(e);
            let id = match self.prefill_legs.remove(&id) {
                Some((main, _, token)) => {
                    if let Some(t) = token {
                        self.router.finished(t);
                    }
                    self.pending_decode.remove(&main);
                    if let Some(decode) = self.requests.get(&main).map(|o| o.engine) {
                        self.release(decode);
                    }
                    main
                }
                None => id,
            };
            let Some(open) = self.requests.remove(&id) else {
                return;
            };
            self.router.finished(open.token);
            self.fail(
                open.session,
                open.turn,
                open.prompt_tokens,
                Some(e),
                400,
                error,
            );
            self.end_session(open.session);
            return;
        }
        if let Some(slot) = self.engines.get_mut(e)
            && slot.step.is_none()
            && !slot.kicked
        {
            slot.kicked = true;
            self.queue.push(self.now, Event::Kick(e));
        }
    }

    fn run_engine(&mut self, e: usize) {
        let now = self.now;
        let Some(slot) = self.engines.get_mut(e) else {
            return;
        };
        if slot.step.is_some() {
            return;
        }
        match slot.engine.step(now) {
            Some(step) => {
                self.steps += 1;
                self.queue.push(now + step.duration, Event::StepDone(e));
                slot.step = Some(step);
            }
            None => {
                if let Some(t) = slot.engine.next_wakeup() {
                    self.queue.push(t, Event::Kick(e));
                }
            }
        }
    }

    fn step_done(&mut self, e: usize) {
        let Some(slot) = self.engines.get_mut(e) else {
            return;
        };
        let Some(step) = slot.step.take() else {
            return;
        };
        let mut events = step.events;
        events.extend(slot.engine.take_events());
        if !events.is_empty() {
            self.queue.push(
                self.now + self.config.event_delay,
                Event::Deliver(e, events),
            );
        }
        if let Some(node) = &self.node {
            let events = node.take_events();
            if !events.is_empty() {
                self.queue.push(
                    self.now + self.config.event_delay,
                    Event::DeliverNode(events),
                );
            }
        }
        for out in step.outputs {
            if out.preempted {
                continue;
            }
            if out.finished.is_some()
                && let Some((main, prefill, token)) = self.prefill_legs.remove(&out.id)
            {
                if let Some(t) = token {
                    self.router.first_token(t);
                    self.router.finished(t);
                }
                self.release(prefill);
                self.decode_leg(main, out.kv_transfer_params.map_or(0, |p| p.num_tokens));
                continue;
            }
            let Some(open) = self.requests.get_mut(&out.id) else {
                continue;
            };
            let n = u32::try_from(out.new_tokens.len()).unwrap_or(u32::MAX);
            if n > 0 && open.first.is_none() {
                open.first = Some(self.now);
                open.cached = out.num_cached_tokens;
                self.router.first_token(open.token);
                self.interval
                    .ttft_ms
                    .push(self.now.saturating_sub(open.sent) as f64 / 1e6);
            }
            open.output_tokens = open.output_tokens.saturating_add(n);
            if out.finished.is_some() {
                self.complete(out.id);
            }
        }
        self.run_engine(e);
    }

    fn complete(&mut self, id: RequestId) {
        let Some(open) = self.requests.remove(&id) else {
            return;
        };
        self.router.finished(open.token);
        self.release(open.engine);
        let ms = |ns: Nanos| ns as f64 / 1e6;
        let e2e = ms(self.now.saturating_sub(open.sent));
        let ttft = open.first.map(|f| ms(f.saturating_sub(open.sent)));
        let tpot = match (ttft, open.output_tokens) {
            (Some(t), n) if n >= 2 => Some((e2e - t) / f64::from(n - 1)),
            _ => None,
        };
        self.interval.completed += 1;
        self.interval.output_tokens += u64::from(open.output_tokens);
        if let Some(t) = tpot {
            self.interval.tpot_ms.push(t);
        }
        let workload = self.workload;
        let Some(session) = workload.sessions.get(open.session) else {
            return;
        };
        self.records.push(RequestRecord {
            run: self.config.run.clone(),
            load: self.config.load,
            session: session.id,
            turn: open.turn,
            group: session.group,
            start_ms: ms(open.sent),
            ttft_ms: ttft,
            tpot_ms: tpot,
            e2e_ms: e2e,
            prompt_tokens: open.prompt_tokens,
            output_tokens: open.output_tokens,
            cached_tokens: open.cached,
            status: Status::Ok,
            http_status: Some(200),
            endpoint: Some(open.engine.to_string()),
            error: None,
        });
        let Some(state) = self.sessions.get_mut(open.session) else {
            return;
        };
        let max_tokens = session
            .turns
            .get(open.turn as usize)
            .map_or(0, |t| t.max_tokens);
        state.answers.push(synth_answer(
            &workload.vocab,
            session.id,
            open.turn,
            max_tokens,
        ));
        state.turn = open.turn + 1;
        match session.turns.get(state.turn as usize) {
            Some(next) => {
                let at = self.now + duration_ns(next.think);
                self.queue.push(at, Event::Send(open.session));
            }
            None => self.end_session(open.session),
        }
    }

    fn fail(
        &mut self,
        s: usize,
        turn: u32,
        prompt_tokens: u32,
        engine: Option<usize>,
        http: u16,
        error: String,
    ) {
        let Some(session) = self.workload.sessions.get(s) else {
            return;
        };
        self.records.push(RequestRecord {
            run: self.config.run.clone(),
            load: self.config.load,
            session: session.id,
            turn,
            group: session.group,
            start_ms: self.now as f64 / 1e6,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: 0.0,
            prompt_tokens,
            output_tokens: 0,
            cached_tokens: None,
            status: Status::HttpError,
            http_status: Some(http),
            endpoint: engine.map(|e| e.to_string()),
            error: Some(error),
        });
    }

    fn end_session(&mut self, s: usize) {
        let Some(state) = self.sessions.get_mut(s) else {
            return;
        };
        if state.done {
            return;
        }
        state.done = true;
        state.answers = Vec::new();
        if state.started {
            self.in_flight_sessions = self.in_flight_sessions.saturating_sub(1);
        }
        self.unfinished_sessions = self.unfinished_sessions.saturating_sub(1);
        if let Pacing::Closed { .. } = self.workload.pacing {
            let n = self.workload.sessions.len();
            if self.config.stop_at.is_some_and(|t| self.now >= t) {
                // Nothing more will be sent: the sessions never started are over too.
                self.unfinished_sessions = self
                    .unfinished_sessions
                    .saturating_sub(n.saturating_sub(self.next_closed));
                self.next_closed = n;
            } else if self.next_closed < n {
                self.queue.push(self.now, Event::Send(self.next_closed));
                self.next_closed += 1;
            }
        }
    }
}

fn duration_ns(d: std::time::Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
