//! The routing brain: parse → key → schedule → record, behind the ext_proc layer's [`Router`]
//! seam. Everything here is synchronous and bounded; it runs on the stream's task.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kv_index::{KvIndex, Millis};
use scheduler::{InflightToken, InflightTracker, LoadBook, ScheduleRequest, Scheduler};

use super::keys::{Keyed, Keyer};
use super::request::{self, Api};
use crate::discovery::Datastore;
use crate::extproc::{Decision, Rejection, ResponseEvent, Router, RoutingInput};

/// Expected output blocks for in-flight accounting when a request does not bound its output.
const DEFAULT_DECODE_BLOCKS: u32 = 16;

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
    /// Of those, blocks the primary held on GPU.
    pub gpu_hit_blocks: AtomicU64,
    /// Decisions, total nanoseconds (parse → pick).
    pub decision_nanos: AtomicU64,
}

/// Implements [`Router`] for one InferencePool.
#[derive(Debug)]
pub struct Picker {
    keyer: Keyer,
    scheduler: Scheduler,
    index: Arc<KvIndex>,
    inflight: Arc<InflightTracker>,
    loads: Arc<LoadBook>,
    datastore: Arc<Datastore>,
    tickets: Mutex<HashMap<u64, InflightToken>>,
    next_ticket: AtomicU64,
    epoch: Instant,
    stats: Arc<PickerStats>,
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
            index,
            inflight,
            loads,
            datastore,
            tickets: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(1),
            epoch: Instant::now(),
            stats: Arc::default(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> Arc<PickerStats> {
        Arc::clone(&self.stats)
    }

    /// The monotonic clock shared with the index and scheduler.
    pub fn now(&self) -> Millis {
        Millis(u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    /// Requests in flight with a ticket.
    pub fn open_tickets(&self) -> usize {
        self.tickets.lock().map_or(0, |t| t.len())
    }

    fn key(&self, input: &RoutingInput<'_>) -> Result<Option<Keyed>, Rejection> {
        let api = Api::of_path(input.path);
        let (Some(body), Api::Completions | Api::Chat) = (input.body, api) else {
            return Ok(None);
        };
        let parsed = request::parse(api, body).map_err(|e| Rejection::BadRequest(e.to_string()))?;
        let keyed = self.keyer.key(&parsed).map_err(|e| {
            if e.is_client_error() {
                Rejection::BadRequest(e.to_string())
            } else {
                Rejection::Unavailable(format!("tokenization failed: {e}"))
            }
        })?;
        Ok(Some(keyed))
    }
}

impl Router for Picker {
    fn route(&self, input: RoutingInput<'_>) -> Result<Decision, Rejection> {
        let started = Instant::now();
        let keyed = self.key(&input)?;
        let endpoints = self.datastore.snapshot();
        let (keys, prompt_tokens, model) = match &keyed {
            Some(k) => (&k.keys[..], k.prompt_tokens, k.model.as_str()),
            None => (&[][..], 0, ""),
        };
        let req = ScheduleRequest {
            keys,
            prompt_tokens,
            model,
            subset: input.subset.as_deref(),
            now: self.now(),
        };
        let decision = self
            .scheduler
            .schedule(&req, &endpoints, &self.index, &self.inflight, &self.loads)
            .map_err(|e| Rejection::Unavailable(e.to_string()))?;
        let token = self.inflight.on_routed(
            decision.primary.endpoint,
            decision.prompt_blocks,
            decision.uncached_blocks,
            DEFAULT_DECODE_BLOCKS,
        );
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut t) = self.tickets.lock() {
            t.insert(ticket, token);
        }
        let s = &self.stats;
        s.routed.fetch_add(1, Ordering::Relaxed);
        if let Some(k) = &keyed {
            let counter = if k.exact {
                &s.exact_keys
            } else {
                &s.approximate_keys
            };
            counter.fetch_add(1, Ordering::Relaxed);
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
        s.decision_nanos.fetch_add(
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        tracing::debug!(
            request_id = input.request_id.unwrap_or("-"),
            endpoint = %decision.primary.address,
            reason = decision.reason.as_str(),
            prompt_blocks = decision.prompt_blocks,
            uncached_blocks = decision.uncached_blocks,
            "routed"
        );
        Ok(Decision {
            endpoints,
            body: None,
            add_headers,
            ticket,
        })
    }

    fn on_response(&self, ticket: u64, event: ResponseEvent) {
        match event {
            ResponseEvent::FirstByte => {
                let token = self
                    .tickets
                    .lock()
                    .ok()
                    .and_then(|t| t.get(&ticket).copied());
                if let Some(token) = token {
                    self.inflight.on_first_token(token);
                }
            }
            ResponseEvent::End | ResponseEvent::Aborted => {
                let token = self.tickets.lock().ok().and_then(|mut t| t.remove(&ticket));
                if let Some(token) = token {
                    self.inflight.on_finished(token);
                }
            }
            ResponseEvent::Headers { .. } | ResponseEvent::Usage { .. } => {}
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
        }
    }

    #[test]
    fn routes_parses_and_frees_in_flight_state() {
        let (p, _) = picker(3);
        let body =
            br#"{"model":"m","prompt":"the same long shared prefix, the same long shared prefix"}"#;
        let d = p.route(input("/v1/completions", Some(body), None)).unwrap();
        assert_eq!(d.endpoints.len(), 3, "primary + fallbacks");
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
}
