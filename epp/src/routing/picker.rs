//! The routing brain: parse → rewrite → key → schedule → record, behind the ext_proc layer's
//! [`Router`] seam. Everything here is synchronous and bounded; it runs on the stream's task.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kv_events::{BlockKey, Tier};
use kv_index::{EndpointId, KvIndex, Millis, Overlap};
use otel::StageLog;
use scheduler::{
    Endpoint, InflightToken, InflightTracker, LoadBook, Routed, ScheduleRequest, Scheduler,
};

use super::keys::{Keyed, Keyer};
use super::request::{self, Api};
use super::rewrite::{REWRITE_HEADERS, RewriteRules, rewrite_request_body};
use super::stats::{Completed, ErrorCode, RequestMetrics, Series};
use super::trace::{self, ResponseTrace};
use crate::discovery::Datastore;
use crate::extproc::{Decision, Rejection, ResponseEvent, ResponseModel, Router, RoutingInput};
use crate::load::health::HealthBook;

/// Request header carrying the pick's fallback endpoints (`ip:port`, comma-separated) to the
/// model server's sidecar, which migrates a failing stream to them.
pub const FALLBACK_HEADER: &str = "x-kvgate-fallback-endpoints";

/// Headers naming the request's InferenceObjective, in the order they are read: llm-d's current
/// spelling first, then GIE's.
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
];

/// The priorities of the pool's InferenceObjectives (from Kubernetes discovery).
pub trait Objectives: Send + Sync + std::fmt::Debug {
    /// The priority of the objective `name` (unset priority is 0), `None` if unknown.
    fn priority(&self, name: &str) -> Option<i32>;
}

/// Counters the metrics endpoint reads.
#[derive(Debug, Default)]
pub struct PickerStats {
    /// Requests routed.
    pub routed: AtomicU64,
    /// Requests keyed with an exact tokenizer.
    pub exact_keys: AtomicU64,
    /// Requests keyed approximately (byte fallback).
    pub approximate_keys: AtomicU64,
    /// Prompt blocks looked up.
    pub prompt_blocks: AtomicU64,
    /// Of those, blocks the primary held in a credited tier (not computed).
    pub gpu_hit_blocks: AtomicU64,
    /// Of those, per tier (GPU, host, disk, remote): blocks whose fastest copy for the primary
    /// was in that tier, credited or not.
    pub tier_hit_blocks: [AtomicU64; 4],
    /// Requests whose keying stopped before the end of the prompt (no endpoint held the newest
    /// key); their token counts are estimates.
    pub early_stops: AtomicU64,
    /// Prompt tokens estimated rather than tokenized (the part of early-stopped prompts past
    /// the last chunk tokenized).
    pub estimated_tokens: AtomicU64,
    /// Decisions, total nanoseconds (parse → pick).
    pub decision_nanos: AtomicU64,
    /// Requests whose model was rewritten.
    pub model_rewrites: AtomicU64,
    /// Sheddable requests refused while the pool was saturated.
    pub shed: AtomicU64,
}

/// What the picker remembers of a routed request until its response ends.
#[derive(Debug)]
struct OpenRequest {
    token: InflightToken,
    /// A disaggregated request's prefill leg on its prefill endpoint (the prompt's uncached
    /// blocks as prefill work), until the decode endpoint's first byte says the prompt was
    /// computed and its KV pulled.
    prefill: Option<InflightToken>,
    series: Arc<Series>,
    routed: Instant,
    first_byte: Option<Instant>,
    status: u16,
    usage: Option<(u32, u32, Option<u32>)>,
    trace: ResponseTrace,
}

/// A request after parsing, rewriting and keying.
struct Prepared {
    keyed: Option<Keyed>,
    /// The model the client asked for, and the one it is served as.
    model: String,
    served: String,
    body: Option<Vec<u8>>,
}

/// Whether any endpoint of the pool holds a key, in any tier (speculation included): the
/// early-stop probe of keying. The endpoint that held the previous key is asked first (one
/// candidate instead of the pool), since a prompt's blocks usually sit together.
struct PoolProbe<'a> {
    index: &'a KvIndex,
    pool: Vec<EndpointId>,
    last: Option<EndpointId>,
    found: Vec<Overlap>,
}

impl<'a> PoolProbe<'a> {
    fn new(index: &'a KvIndex, endpoints: &[Endpoint]) -> Self {
        Self {
            index,
            pool: endpoints.iter().map(|e| e.id).collect(),
            last: None,
            found: Vec::with_capacity(endpoints.len()),
        }
    }

    fn held(&mut self, key: BlockKey) -> bool {
        if let Some(last) = self.last {
            self.found.clear();
            self.index
                .find_matches_into(&[key], &[last], &mut self.found);
            if self.found.iter().any(|o| o.reach(Tier::Remote) > 0) {
                return true;
            }
        }
        self.found.clear();
        self.index
            .find_matches_into(&[key], &self.pool, &mut self.found);
        self.last = self
            .found
            .iter()
            .find(|o| o.reach(Tier::Remote) > 0)
            .map(|o| o.endpoint);
        self.last.is_some()
    }
}

/// Implements [`Router`] for one InferencePool.
#[derive(Debug)]
pub struct Picker {
    keyer: Keyer,
    scheduler: Scheduler,
    rewrites: RewriteRules,
    /// Whether clients may set the P/D transfer fields (`request::TRANSFER_FIELDS`).
    client_transfer_fields: bool,
    objectives: Option<Arc<dyn Objectives>>,
    index: Arc<KvIndex>,
    inflight: Arc<InflightTracker>,
    loads: Arc<LoadBook>,
    datastore: Arc<Datastore>,
    health: Arc<HealthBook>,
    tickets: Mutex<HashMap<u64, OpenRequest>>,
    next_ticket: AtomicU64,
    epoch: Instant,
    stats: Arc<PickerStats>,
    requests: Arc<RequestMetrics>,
}

impl Picker {
    /// A picker over shared state.
    pub fn new(
        keyer: Keyer,
        scheduler: Scheduler,
        index: Arc<KvIndex>,
        inflight: Arc<InflightTracker>,
        loads: Arc<LoadBook>,
        datastore: Arc<Datastore>,
    ) -> Self {
        Self {
            keyer,
            scheduler,
            rewrites: RewriteRules::default(),
            client_transfer_fields: false,
            objectives: None,
            index,
            inflight,
            loads,
            datastore,
            health: Arc::default(),
            tickets: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(1),
            epoch: Instant::now(),
            stats: Arc::default(),
            requests: Arc::default(),
        }
    }

    /// Serves models under other names by `rules`.
    #[must_use]
    pub fn with_rewrites(mut self, rules: RewriteRules) -> Self {
        self.rewrites = rules;
        self
    }

    /// Lets clients set the P/D transfer fields (`kv_transfer_params`, `bootstrap_*`), which
    /// are refused with 400 by default: for deployments whose trusted clients run their own
    /// prefill/decode flow through the gateway.
    #[must_use]
    pub fn with_client_transfer_fields(mut self, allowed: bool) -> Self {
        self.client_transfer_fields = allowed;
        self
    }

    /// Leaves out of rotation the endpoints `health` has found unreachable.
    #[must_use]
    pub fn with_health(mut self, health: Arc<HealthBook>) -> Self {
        self.health = health;
        self
    }

    /// The endpoints' health the picker routes by.
    pub fn health(&self) -> &HealthBook {
        &self.health
    }

    /// Reads request priorities from `objectives` (header `x-gateway-inference-objective`).
    #[must_use]
    pub fn with_objectives(mut self, objectives: Arc<dyn Objectives>) -> Self {
        self.objectives = Some(objectives);
        self
    }

    /// The request's priority: its objective's, 0 without one (or an unknown one).
    fn priority(&self, input: &RoutingInput<'_>) -> (i32, Option<String>) {
        let Some(name) = OBJECTIVE_HEADERS.iter().find_map(|wanted| {
            input
                .headers
                .iter()
                .find(|(k, _)| k == wanted)
                .map(|(_, v)| v.trim())
                .filter(|v| !v.is_empty())
        }) else {
            return (0, None);
        };
        let p = self
            .objectives
            .as_ref()
            .and_then(|o| o.priority(name))
            .unwrap_or(0);
        (p, Some(name.to_owned()))
    }

    /// How requests are keyed.
    pub fn keyer(&self) -> &Keyer {
        &self.keyer
    }

    /// The counters.
    pub fn stats(&self) -> Arc<PickerStats> {
        Arc::clone(&self.stats)
    }

    /// The per-request (GIE) metrics.
    pub fn request_metrics(&self) -> Arc<RequestMetrics> {
        Arc::clone(&self.requests)
    }

    /// The load book the scheduler reads.
    pub fn loads(&self) -> &LoadBook {
        &self.loads
    }

    /// Resident (block, holder) pairs in the index.
    pub fn index_residencies(&self) -> usize {
        self.index.stats().residencies
    }

    /// The monotonic clock shared with the index and scheduler.
    pub fn now(&self) -> Millis {
        Millis(u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    /// A prefill leg ended (the decode endpoint's first byte, or the request's end).
    fn leg_finished(&self, leg: InflightToken) {
        if self.inflight.on_finished(leg) {
            self.loads.note_finished(leg.endpoint());
        }
    }

    /// Requests in flight with a ticket.
    pub fn open_tickets(&self) -> usize {
        self.tickets.lock().map_or(0, |t| t.len())
    }

    fn prepare(
        &self,
        input: &RoutingInput<'_>,
        ticket: u64,
        endpoints: &[Endpoint],
        stages: &mut StageLog,
    ) -> Result<Prepared, (Rejection, String)> {
        let api = Api::of_path(input.path);
        let (Some(body), Api::Completions | Api::Chat) = (input.body, api) else {
            return Ok(Prepared {
                keyed: None,
                model: String::new(),
                served: String::new(),
                body: None,
            });
        };
        let parse = trace::parse(stages, body.len());
        let parsed = request::parse(api, body)
            .map_err(|e| (Rejection::BadRequest(e.to_string()), String::new()))?;
        if let Some(field) = parsed.transfer_field
            && !self.client_transfer_fields
        {
            tracing::debug!(field, "refused a client-set KV transfer field");
            return Err((
                Rejection::BadRequest(format!(
                    "`{field}` directs the engine's KV transfer and is set by kvgate on the \
                     prefill/decode path; clients may not send it (the EPP's \
                     --allow-client-transfer-params lets trusted clients)"
                )),
                String::new(),
            ));
        }
        let model = parsed
            .model
            .as_deref()
            .unwrap_or(self.keyer.default_model())
            .to_owned();
        let header = input
            .headers
            .iter()
            .find(|(k, _)| REWRITE_HEADERS.contains(&k.as_str()))
            .map(|(_, v)| v.as_str());
        let draw = xxhash_rust::xxh3::xxh3_64(&ticket.to_le_bytes());
        let target = self
            .rewrites
            .target(&model, header, draw)
            .map(str::to_owned);
        let new_body = match &target {
            Some(t) => Some(
                rewrite_request_body(body, t)
                    .map_err(|e| (Rejection::BadRequest(e.to_string()), model.clone()))?,
            ),
            None => None,
        };
        stages.close(parse, []);
        // Keying stops once no endpoint of the pool (a superset of the candidates) holds the
        // newest key: a point query per tokenized chunk.
        let tokenize = stages.open("tokenize", None);
        let mut probe = PoolProbe::new(&self.index, endpoints);
        let keyed = self
            .keyer
            .key_served(&parsed, target.as_deref(), &mut |key| probe.held(key))
            .map_err(|e| {
                let r = if matches!(e, tokenize::TokenizeError::InputTooLarge { .. }) {
                    Rejection::PayloadTooLarge(e.to_string())
                } else if e.is_client_error() {
                    Rejection::BadRequest(e.to_string())
                } else {
                    Rejection::Unavailable(format!("tokenization failed: {e}"))
                };
                (r, model.clone())
            })?;
        trace::tokenized(stages, tokenize, &keyed);
        let served = target.unwrap_or_else(|| model.clone());
        Ok(Prepared {
            keyed: Some(keyed),
            model,
            served,
            body: new_body,
        })
    }

    fn reject(&self, rejection: Rejection, model: &str) -> Rejection {
        let code = match rejection {
            Rejection::BadRequest(_) => ErrorCode::BadRequest,
            Rejection::PayloadTooLarge(_) => ErrorCode::PayloadTooLarge,
            Rejection::TooManyRequests(_) => ErrorCode::ResourceExhausted,
            Rejection::Unavailable(_) => ErrorCode::ServiceUnavailable,
        };
        self.requests.on_rejected(model, code);
        rejection
    }
}

impl Router for Picker {
    fn route(&self, input: RoutingInput<'_>) -> Result<Decision, Rejection> {
        let started = Instant::now();
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let endpoints = self.health.mask(self.datastore.snapshot());
        // Stages only under a traced request's span; a refused request's are exported when
        // `stages` drops.
        let mut stages = StageLog::start(input.trace);
        let prepared = match self.prepare(&input, ticket, &endpoints, &mut stages) {
            Ok(p) => p,
            Err((rejection, model)) => return Err(self.reject(rejection, &model)),
        };
        let keyed = &prepared.keyed;
        let (priority, objective) = self.priority(&input);
        if priority < 0
            && self
                .scheduler
                .pool_saturated(&prepared.served, &endpoints, &self.loads, self.now())
        {
            self.stats.shed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                request_id = input.request_id.unwrap_or("-"),
                objective = objective.as_deref().unwrap_or("-"),
                priority,
                "shed: pool saturated"
            );
            return Err(self.reject(
                Rejection::TooManyRequests(format!(
                    "the pool is saturated and this request is sheddable (objective {:?}, \
                     priority {priority})",
                    objective.unwrap_or_default()
                )),
                &prepared.model,
            ));
        }
        let (keys, prompt_tokens, prompt_blocks, model) = match keyed {
            Some(k) => (
                &k.keys[..],
                k.prompt_tokens,
                Some(k.prompt_blocks),
                k.model.as_str(),
            ),
            None => (&[][..], 0, None, ""),
        };
        let req = ScheduleRequest {
            keys,
            prompt_tokens,
            prompt_blocks,
            model,
            subset: input.subset.as_deref(),
            now: self.now(),
            timed: stages.is_active(),
        };
        let scheduling = Instant::now();
        let pick = stages.open_at("pick", None, scheduling);
        let scheduled =
            self.scheduler
                .route(&req, &endpoints, &self.index, &self.inflight, &self.loads);
        self.requests
            .on_scheduled(scheduled.is_ok(), scheduling.elapsed());
        trace::picked(
            &mut stages,
            pick,
            endpoints.len(),
            scheduled.as_ref().ok().map(|r| &r.decision),
        );
        let Routed { decision, token } = match scheduled {
            Ok(r) => r,
            Err(e) => {
                return Err(self.reject(Rejection::Unavailable(e.to_string()), &prepared.model));
            }
        };
        let series = self.requests.series(&prepared.model, &prepared.served);
        series.on_routed(input.body.map_or(0, <[u8]>::len));
        // The prefill endpoint computes the prompt, so it carries the prefill work while the
        // leg runs; without it, every pick between two engine load samples sees the same
        // prefill endpoints idle and piles prompts onto one of them.
        let prefill = decision.prefill.map(|p| {
            self.inflight.on_routed(
                p.endpoint,
                decision.prompt_blocks,
                decision.uncached_blocks,
                0,
            )
        });
        let open = OpenRequest {
            token,
            prefill,
            series,
            routed: started,
            first_byte: None,
            status: 0,
            usage: None,
            trace: ResponseTrace::start(input.trace.clone(), stages, &prepared.model),
        };
        self.tickets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ticket, open);
        let s = &self.stats;
        s.routed.fetch_add(1, Ordering::Relaxed);
        if let Some(k) = keyed {
            let counter = if k.exact {
                &s.exact_keys
            } else {
                &s.approximate_keys
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if k.stopped_early {
                s.early_stops.fetch_add(1, Ordering::Relaxed);
                s.estimated_tokens.fetch_add(
                    u64::from(k.prompt_tokens.saturating_sub(k.tokenized)),
                    Ordering::Relaxed,
                );
            }
        }
        s.prompt_blocks
            .fetch_add(u64::from(decision.prompt_blocks), Ordering::Relaxed);
        s.gpu_hit_blocks.fetch_add(
            u64::from(
                decision
                    .prompt_blocks
                    .saturating_sub(decision.uncached_blocks),
            ),
            Ordering::Relaxed,
        );
        for (counter, tier) in s.tier_hit_blocks.iter().zip(Tier::ALL) {
            counter.fetch_add(u64::from(decision.overlap.hits(tier)), Ordering::Relaxed);
        }
        let mut add_headers = Vec::new();
        if let Some(prefill) = decision.prefill {
            add_headers.push((
                "x-prefiller-host-port".to_owned(),
                prefill.address.to_string(),
            ));
        }
        let endpoints: Vec<String> = decision
            .endpoints()
            .map(|p| p.address.to_string())
            .collect();
        // The fallbacks, for the sidecar: where to migrate a streamed answer whose engine fails
        // mid-way (clients cannot set it: `x-kvgate-*` headers are stripped).
        if let Some(fallbacks) = endpoints.get(1..).filter(|f| !f.is_empty()) {
            add_headers.push((FALLBACK_HEADER.to_owned(), fallbacks.join(",")));
        }
        let took = started.elapsed();
        s.decision_nanos.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.requests.decision.observe_duration(took);
        let response_model = prepared.body.is_some().then(|| {
            s.model_rewrites.fetch_add(1, Ordering::Relaxed);
            ResponseModel {
                served: prepared.served.clone(),
                client: prepared.model.clone(),
            }
        });
        tracing::debug!(
            request_id = input.request_id.unwrap_or("-"),
            endpoint = %decision.primary.address,
            reason = decision.reason.as_str(),
            model = prepared.model.as_str(),
            served_as = prepared.served.as_str(),
            prompt_blocks = decision.prompt_blocks,
            uncached_blocks = decision.uncached_blocks,
            "routed"
        );
        Ok(Decision {
            endpoints,
            body: prepared.body,
            add_headers,
            ticket,
            response_model,
        })
    }

    fn on_response(&self, ticket: u64, event: ResponseEvent) {
        let mut tickets = self.tickets.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            ResponseEvent::Headers { status, .. } => {
                if let Some(open) = tickets.get_mut(&ticket) {
                    open.status = status;
                }
            }
            ResponseEvent::FirstByte => {
                if let Some(open) = tickets.get_mut(&ticket) {
                    if open.first_byte.is_none() {
                        let now = Instant::now();
                        open.first_byte = Some(now);
                        open.trace.first_byte(now.duration_since(open.routed));
                    }
                    self.inflight.on_first_token(open.token);
                    if let Some(leg) = open.prefill.take() {
                        self.leg_finished(leg);
                    }
                }
            }
            ResponseEvent::Usage {
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                if let Some(open) = tickets.get_mut(&ticket) {
                    open.usage = Some((prompt_tokens, completion_tokens, cached_tokens));
                }
            }
            ResponseEvent::End | ResponseEvent::Aborted => {
                let Some(open) = tickets.remove(&ticket) else {
                    return;
                };
                drop(tickets);
                if let Some(leg) = open.prefill {
                    self.leg_finished(leg);
                }
                if self.inflight.on_finished(open.token) {
                    self.loads.note_finished(open.token.endpoint());
                }
                if event == ResponseEvent::End {
                    let completed = Completed {
                        duration: open.routed.elapsed(),
                        ttft: open.first_byte.map(|t| t.duration_since(open.routed)),
                        usage: open.usage,
                        status: open.status,
                    };
                    open.series.on_completed(&completed);
                    open.trace.completed(&completed);
                } else {
                    open.series.on_aborted();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::EndpointKey;
    use kv_events::key::SaltStyle;
    use scheduler::{Endpoint, SchedulerConfig};

    fn picker(n: u16) -> (Picker, Arc<Datastore>) {
        let ds = Arc::new(Datastore::new());
        let eps: Vec<(EndpointKey, Endpoint)> = (0..n)
            .map(|i| {
                let key = (format!("pod-{i}"), 8000);
                let id = ds.id_for(&key);
                (
                    key,
                    Endpoint::new(id, format!("10.0.0.{i}:8000").parse().unwrap()),
                )
            })
            .collect();
        ds.replace(eps);
        let index = Arc::new(KvIndex::new(kv_index::IndexConfig::default()).unwrap());
        let p = Picker::new(
            Keyer::new(4, SaltStyle::VllmExtraKey, "m"),
            Scheduler::new(SchedulerConfig::default(), 7).unwrap(),
            index,
            Arc::new(InflightTracker::new()),
            Arc::new(LoadBook::new()),
            Arc::clone(&ds),
        );
        (p, ds)
    }

    fn input<'a>(
        path: &'a str,
        body: Option<&'a [u8]>,
        subset: Option<Vec<String>>,
    ) -> RoutingInput<'a> {
        RoutingInput {
            method: "POST",
            path,
            headers: &[],
            body,
            subset,
            request_id: Some("r1"),
            trace: &NO_TRACE,
        }
    }

    /// An untraced request's span.
    static NO_TRACE: otel::RequestSpan = otel::RequestSpan::none();

    #[test]
    fn routes_parses_and_frees_in_flight_state() {
        let (p, _) = picker(3);
        let body =
            br#"{"model":"m","prompt":"the same long shared prefix, the same long shared prefix"}"#;
        let d = p.route(input("/v1/completions", Some(body), None)).unwrap();
        assert_eq!(d.endpoints.len(), 3, "primary + fallbacks");
        let fallbacks = d.add_headers.iter().find(|(k, _)| k == FALLBACK_HEADER);
        assert_eq!(
            fallbacks.map(|(_, v)| v.clone()),
            Some(d.endpoints[1..].join(",")),
            "the sidecar learns where to migrate"
        );
        assert_eq!(p.open_tickets(), 1);
        p.on_response(d.ticket, ResponseEvent::FirstByte);
        p.on_response(d.ticket, ResponseEvent::End);
        p.on_response(d.ticket, ResponseEvent::Aborted);
        assert_eq!(p.open_tickets(), 0);
        // Speculation makes the same prompt stick to the same endpoint before any KV event.
        let d2 = p.route(input("/v1/completions", Some(body), None)).unwrap();
        assert_eq!(d.endpoints[0], d2.endpoints[0]);
        p.on_response(d2.ticket, ResponseEvent::Aborted);
        assert_eq!(p.open_tickets(), 0);
        assert!(p.inflight.is_empty());
    }

    #[test]
    fn prefill_legs_count_on_their_prefill_endpoint_until_the_first_byte() {
        let (p, ds) = picker(4);
        // Two prefill endpoints, two decode endpoints.
        let eps: Vec<(EndpointKey, Endpoint)> = (0..4u16)
            .map(|i| {
                let key = (format!("pod-{i}"), 8000);
                let id = ds.id_for(&key);
                let mut e = Endpoint::new(id, format!("10.0.0.{i}:8000").parse().unwrap());
                e.role = if i < 2 {
                    scheduler::Role::Prefill
                } else {
                    scheduler::Role::Decode
                };
                (key, e)
            })
            .collect();
        ds.replace(eps);
        let mut config = SchedulerConfig::default();
        config.disaggregation.enabled = true;
        config.disaggregation.min_uncached_blocks = 1;
        let p = Picker {
            scheduler: Scheduler::new(config, 7).unwrap(),
            ..p
        };
        let prompt = |i: usize| {
            format!(
                r#"{{"model":"m","prompt":"distinct prompt number {i}: {}"}}"#,
                "x".repeat(64)
            )
        };
        let header = |d: &Decision| {
            d.add_headers
                .iter()
                .find(|(k, _)| k == "x-prefiller-host-port")
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        let a = p
            .route(input("/v1/completions", Some(prompt(1).as_bytes()), None))
            .unwrap();
        let b = p
            .route(input("/v1/completions", Some(prompt(2).as_bytes()), None))
            .unwrap();
        // The first prompt's prefill is still running: the second goes to the other prefiller.
        assert_ne!(header(&a), header(&b));
        // Its first byte ends the leg (and only the leg): the prefiller is free again.
        p.on_response(a.ticket, ResponseEvent::FirstByte);
        let free = |e: &str| {
            let id = ds.id_for(&(format!("pod-{}", &e[7..8]), 8000));
            p.inflight.load(id).requests
        };
        assert_eq!(free(&header(&a)), 0);
        assert_eq!(free(&header(&b)), 1);
        // A request that ends before its first byte frees its leg too.
        p.on_response(b.ticket, ResponseEvent::Aborted);
        p.on_response(a.ticket, ResponseEvent::End);
        assert!(p.inflight.is_empty());
    }

    #[test]
    fn rejections_map_to_statuses() {
        let (p, _) = picker(2);
        let bad = p
            .route(input("/v1/chat/completions", Some(b"{"), None))
            .unwrap_err();
        assert_eq!(bad.status(), 400);
        let none = p
            .route(input(
                "/v1/completions",
                Some(br#"{"prompt":"x"}"#),
                Some(vec![]),
            ))
            .unwrap_err();
        assert_eq!(none.status(), 503);
        let subset = p
            .route(input(
                "/v1/completions",
                Some(br#"{"prompt":"x"}"#),
                Some(vec!["10.0.0.1".into()]),
            ))
            .unwrap();
        assert_eq!(subset.endpoints, vec!["10.0.0.1:8000".to_owned()]);
        let get = p.route(input("/v1/models", None, None)).unwrap();
        assert!(!get.endpoints.is_empty());
        let (empty, _) = picker(0);
        assert_eq!(
            empty
                .route(input("/v1/models", None, None))
                .unwrap_err()
                .status(),
            503
        );
    }

    #[test]
    fn client_transfer_fields_are_refused_unless_allowed() {
        let (p, _) = picker(2);
        let body = br#"{"prompt":"abcdefghijklmnop","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"203.0.113.9","remote_port":5600}}"#;
        let err = p
            .route(input("/v1/completions", Some(body), None))
            .unwrap_err();
        assert_eq!(err.status(), 400);
        assert_eq!(err.reason(), "bad-request");
        assert!(err.message().contains("`kv_transfer_params`"), "{err:?}");
        let chat = br#"{"messages":[{"role":"user","content":"hi"}],"bootstrap_host":"203.0.113.9","bootstrap_room":1}"#;
        assert_eq!(
            p.route(input("/v1/chat/completions", Some(chat), None))
                .unwrap_err()
                .status(),
            400
        );
        // Neither counts as routed.
        assert_eq!(p.stats().routed.load(Ordering::Relaxed), 0);
        let p = p.with_client_transfer_fields(true);
        assert!(
            !p.route(input("/v1/completions", Some(body), None))
                .unwrap()
                .endpoints
                .is_empty()
        );
    }

    #[test]
    fn model_rewrites_change_the_body_the_keys_and_the_metrics() {
        let (p, _) = picker(2);
        let rules = crate::routing::rewrite::RewriteRules::from_yaml(
            "rules: [{model: m, targets: [{modelRewrite: m-lora}]}]",
        )
        .unwrap();
        let p = p.with_rewrites(rules);
        let body = br#"{"model":"m","prompt":"abcdefghijklmnop"}"#;
        let d = p.route(input("/v1/completions", Some(body), None)).unwrap();
        assert_eq!(
            d.body.as_deref(),
            Some(&br#"{"model":"m-lora","prompt":"abcdefghijklmnop"}"#[..])
        );
        assert_eq!(
            d.response_model,
            Some(ResponseModel {
                served: "m-lora".into(),
                client: "m".into()
            })
        );
        p.on_response(
            d.ticket,
            ResponseEvent::Headers {
                status: 200,
                served: None,
            },
        );
        p.on_response(d.ticket, ResponseEvent::FirstByte);
        p.on_response(
            d.ticket,
            ResponseEvent::Usage {
                prompt_tokens: 4,
                completion_tokens: 3,
                cached_tokens: Some(0),
            },
        );
        p.on_response(d.ticket, ResponseEvent::End);
        // The header beats the rules; naming the requested model itself means no rewrite.
        let headers = [("x-gateway-model-name-rewrite".to_owned(), "m".to_owned())];
        let mut inp = input("/v1/completions", Some(body), None);
        inp.headers = &headers;
        let plain = p.route(inp).unwrap();
        assert_eq!(plain.body, None);
        assert_eq!(plain.response_model, None);
        p.on_response(plain.ticket, ResponseEvent::Aborted);

        let mut e = telemetry::Exposition::new();
        p.request_metrics().render(&mut e, "pool");
        let text = e.finish();
        for want in [
            "inference_objective_request_total{model_name=\"m\",target_model_name=\"m-lora\"} 1",
            "inference_objective_request_total{model_name=\"m\",target_model_name=\"m\"} 1",
            "inference_objective_output_tokens_sum{model_name=\"m\",target_model_name=\"m-lora\"} 3",
            "error_code=\"Aborted\"} 1",
        ] {
            assert!(text.contains(want), "missing {want}\n{text}");
        }
        assert_eq!(p.stats().model_rewrites.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_probe_finds_holders_in_any_tier_and_asks_the_last_holder_first() {
        let (p, ds) = picker(3);
        let eps = ds.snapshot();
        let k = |i: u64| BlockKey(1000 + i);
        let store = |e: usize, keys: Vec<BlockKey>, tier: Tier| {
            p.index.apply(
                kv_index::Holder::Endpoint(eps[e].id),
                &[kv_events::KvEvent::Stored {
                    keys,
                    parent: None,
                    tier,
                    lora: None,
                    token_count: 0,
                }],
            );
        };
        store(0, vec![k(0), k(1)], Tier::Gpu);
        store(2, vec![k(2)], Tier::Disk);
        let mut probe = PoolProbe::new(&p.index, &eps);
        assert!(probe.held(k(0)));
        assert_eq!(probe.last, Some(eps[0].id));
        assert!(probe.held(k(1)));
        assert!(probe.held(k(2)), "held on disk by another endpoint");
        assert_eq!(probe.last, Some(eps[2].id));
        assert!(!probe.held(k(3)));
        assert_eq!(probe.last, None);
        assert!(!PoolProbe::new(&p.index, &[]).held(k(0)));
    }

    #[derive(Debug)]
    struct Fixed;

    impl Objectives for Fixed {
        fn priority(&self, name: &str) -> Option<i32> {
            match name {
                "batch" => Some(-1),
                "chat" => Some(10),
                _ => None,
            }
        }
    }

    #[test]
    fn sheddable_requests_get_429_only_while_the_pool_is_saturated() {
        let (p, ds) = picker(2);
        let p = p.with_objectives(Arc::new(Fixed));
        let body = br#"{"model":"m","prompt":"hello there"}"#;
        let with = |name: &str| [("x-gateway-inference-objective".to_owned(), name.to_owned())];
        let route = |h: &[(String, String)]| {
            let mut i = input("/v1/completions", Some(body), None);
            i.headers = h;
            p.route(i)
        };
        let h = with("batch");
        let d = route(&h).unwrap();
        p.on_response(d.ticket, ResponseEvent::Aborted);
        for e in ds.snapshot().iter() {
            p.loads.record(
                e.id,
                scheduler::EngineLoad {
                    waiting: 50,
                    running: 8,
                    kv_usage: 0.95,
                    at: p.now(),
                },
            );
        }
        let shed = route(&h).unwrap_err();
        assert_eq!(shed.status(), 429);
        assert!(shed.message().contains("batch"));
        for ok in [with("chat"), with("unknown")] {
            let d = route(&ok).unwrap();
            p.on_response(d.ticket, ResponseEvent::Aborted);
        }
        let d = route(&[]).unwrap();
        p.on_response(d.ticket, ResponseEvent::Aborted);
        assert_eq!(p.stats().shed.load(Ordering::Relaxed), 1);
        // Both spellings present: llm-d's header is read first.
        let both = [
            (
                "x-gateway-inference-objective".to_owned(),
                "batch".to_owned(),
            ),
            (
                "x-llm-d-inference-objective".to_owned(),
                " chat ".to_owned(),
            ),
        ];
        let d = route(&both).unwrap();
        p.on_response(d.ticket, ResponseEvent::Aborted);
        let flipped = [
            (
                "x-gateway-inference-objective".to_owned(),
                "chat".to_owned(),
            ),
            ("x-llm-d-inference-objective".to_owned(), "batch".to_owned()),
        ];
        assert_eq!(route(&flipped).unwrap_err().status(), 429);
    }
}
