//! The scheduler: filter, look up, rank, pick a prefill leg when it pays, and speculate.

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use kv_events::{BlockKey, Tier};
use kv_index::{ApproxTracker, EndpointId, Holder, KvIndex, Millis, Overlap};

use crate::config::{ConfigError, Policy, SchedulerConfig};
use crate::cost::{EffectiveLoad, credit, prefill_cost, uncached_blocks};
use crate::decision::{CandidateScore, Decision, Phases, ScheduleError};
use crate::endpoint::{Endpoint, Pick};
use crate::filter::{NoCandidateReason, decode_candidates, prefill_candidates};
use crate::inflight::InflightTracker;
use crate::load::LoadBook;
use crate::policy::{Candidate, rank};
use crate::rng::{SeededRng, tie_key};

/// One request, as the scheduler needs it.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleRequest<'a> {
    /// The prompt's block keys (full blocks only), from the first block.
    pub keys: &'a [BlockKey],
    /// The prompt's length in tokens.
    pub prompt_tokens: u32,
    /// The prompt's full blocks when `keys` holds only a prefix of them (the caller stopped
    /// keying once no endpoint could extend its match, and estimated the rest); `None` means
    /// `keys.len()`. Costs and in-flight accounting use it; the lookup and speculation use
    /// `keys`.
    pub prompt_blocks: Option<u32>,
    /// The requested model or LoRA adapter (empty: any endpoint).
    pub model: &'a str,
    /// The data plane's subset hint, when it sent one (`Some(&[])`: nothing is allowed).
    pub subset: Option<&'a [String]>,
    /// The EPP's monotonic clock now.
    pub now: Millis,
    /// Time the lookup and the ranking ([`Decision::phases`]): a traced request's stages.
    pub timed: bool,
}

/// Places requests on endpoints. Shared by every request stream: `schedule` takes `&self`
/// (the round-robin turn and the random source are atomics; approximate mode's tracker is
/// behind a mutex held only to record a decision).
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    rng: SeededRng,
    turn: AtomicU64,
    approx: Option<Mutex<ApproxTracker>>,
}

impl ScheduleRequest<'_> {
    /// The prompt's full blocks: [`ScheduleRequest::prompt_blocks`], never below `keys.len()`.
    pub fn blocks(&self) -> u32 {
        let keyed = u32::try_from(self.keys.len()).unwrap_or(u32::MAX);
        self.prompt_blocks.map_or(keyed, |b| b.max(keyed))
    }
}

impl Scheduler {
    /// A scheduler with a validated `config`; `seed` fixes every random choice (the same calls
    /// in the same order give the same decisions).
    pub fn new(config: SchedulerConfig, seed: u64) -> Result<Self, ConfigError> {
        config.validate()?;
        let approx = config.approximate.enabled.then(|| {
            Mutex::new(ApproxTracker::new(
                Millis(config.approximate.ttl_ms),
                config.approximate.capacity_blocks,
            ))
        });
        Ok(Self {
            config,
            rng: SeededRng::new(seed),
            turn: AtomicU64::new(0),
            approx,
        })
    }

    /// The configuration in force.
    pub const fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Whether every ready endpoint that could decode a request for `model` is saturated by
    /// [`crate::Admission`]'s rule (false when there is none: that is a 503, not a 429). An
    /// endpoint without a fresh engine sample is not saturated.
    pub fn pool_saturated(
        &self,
        model: &str,
        endpoints: &[Endpoint],
        loads: &LoadBook,
        now: Millis,
    ) -> bool {
        let a = &self.config.admission;
        let max_age = self.config.engine_load_max_age();
        let mut any = false;
        for e in endpoints
            .iter()
            .filter(|e| e.ready && e.role.serves_decode() && e.serves_model(model))
        {
            any = true;
            let saturated = loads.fresh(e.id, now, max_age).is_some_and(|l| {
                l.waiting >= a.queue_depth_threshold || l.kv_usage >= a.kv_usage_threshold
            });
            if !saturated {
                return false;
            }
        }
        any
    }

    /// Chooses the primary, its fallbacks and (for a long uncached prompt in a P/D pool) a
    /// prefill endpoint, then records the choice in the index (speculation, or the approximate
    /// tracker's events) so the next request with this prefix sees it.
    ///
    /// `endpoints` is the pool (distinct ids), in a stable order (round-robin follows it).
    /// The caller then accounts the request with
    /// [`InflightTracker::on_routed`]`(primary, prompt_blocks, uncached_blocks, expected)`.
    pub fn schedule(
        &self,
        req: &ScheduleRequest<'_>,
        endpoints: &[Endpoint],
        index: &KvIndex,
        inflight: &InflightTracker,
        loads: &LoadBook,
    ) -> Result<Decision, ScheduleError> {
        let mut eligible = Vec::with_capacity(endpoints.len());
        decode_candidates(endpoints, req.model, req.subset, &mut eligible)?;
        let lookup = matches!(self.config.policy, Policy::Kv | Policy::PrefixOnly);
        let salt = self.rng.next_u64();
        let looked_up = req.timed.then(Instant::now);
        let cands = self.gather(&eligible, req, lookup, index, inflight, loads, salt);
        let prompt_blocks = req.blocks();
        let scored = req.timed.then(Instant::now);
        let ranking = rank(&cands, prompt_blocks, &self.config, &self.rng, &self.turn);
        let phases = looked_up.zip(scored).map(|(start, scored)| Phases {
            lookup: (start, scored),
            score: (scored, Instant::now()),
        });

        // The filters returned at least one candidate, so the ranking has a primary row.
        let chosen = ranking
            .rows
            .get(ranking.primary)
            .and_then(|row| Some((*eligible.get(row.index)?, cands.get(row.index)?)));
        let Some((primary, cand)) = chosen else {
            return Err(NoCandidateReason::NoReadyEndpoints.into());
        };
        let overlap = match cand.overlap {
            Some(o) => o,
            None => Self::overlap_of(index, req.keys, primary.id),
        };
        let uncached = uncached_blocks(prompt_blocks, &overlap, &self.config.credit);
        let fallbacks = ranking
            .rows
            .iter()
            .enumerate()
            .filter(|&(pos, _)| pos != ranking.primary)
            .filter_map(|(_, r)| eligible.get(r.index).map(|e| e.pick()))
            .take(self.config.fallbacks)
            .collect();
        let prefill_leg = self
            .wants_prefill(req.prompt_tokens, uncached)
            .then(|| self.pick_prefill(req, endpoints, index, inflight, loads, salt))
            .flatten();
        let scores = ranking
            .rows
            .iter()
            .filter_map(|r| {
                cands.get(r.index).map(|c| CandidateScore {
                    endpoint: c.id,
                    cost: r.cost,
                    overlap: c.overlap,
                    credit: c.overlap.map(|_| c.credit),
                    load: c.load,
                    over_cap: r.over_cap,
                })
            })
            .collect();

        self.record(index, &overlap, req.keys, req.now);
        if let Some((_, leg)) = &prefill_leg {
            self.record(index, leg, req.keys, req.now);
        }
        Ok(Decision {
            primary: primary.pick(),
            fallbacks,
            prefill: prefill_leg.map(|(pick, _)| pick),
            reason: ranking.reason,
            overlap,
            prompt_blocks,
            uncached_blocks: uncached,
            scores,
            phases,
        })
    }

    /// Drops expired speculative entries and, in approximate mode, the blocks the tracker
    /// assumes evicted by now. Call periodically (e.g. every 100 ms). Returns how many entries
    /// were dropped (speculative entries plus approximate blocks).
    pub fn expire(&self, index: &KvIndex, now: Millis) -> usize {
        let mut n = index.expire(now);
        if let Some(approx) = &self.approx {
            let removed = approx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .expire(now);
            for (endpoint, event) in removed {
                if let kv_events::KvEvent::Removed { keys, .. } = &event {
                    n += keys.len();
                }
                index.apply(Holder::Endpoint(endpoint), std::slice::from_ref(&event));
            }
        }
        n
    }

    /// Forgets what approximate mode assumed `endpoint` holds (it left the pool). The caller
    /// also removes it from the index (`KvIndex::remove_source`) and the load books.
    pub fn remove_endpoint(&self, endpoint: EndpointId) {
        if let Some(approx) = &self.approx {
            approx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove_endpoint(endpoint);
        }
    }

    /// The policies' view of `eligible`: loads, overlaps when `lookup`, tie keys.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        eligible: &[&Endpoint],
        req: &ScheduleRequest<'_>,
        lookup: bool,
        index: &KvIndex,
        inflight: &InflightTracker,
        loads: &LoadBook,
        salt: u64,
    ) -> Vec<Candidate> {
        let ids: Vec<EndpointId> = eligible.iter().map(|e| e.id).collect();
        let mut own = Vec::with_capacity(ids.len());
        inflight.loads_into(&ids, &mut own);
        let mut engine = Vec::with_capacity(ids.len());
        loads.fresh_into(
            &ids,
            req.now,
            self.config.engine_load_max_age(),
            &mut engine,
        );
        let mut overlaps = Vec::new();
        if lookup {
            overlaps.reserve(ids.len());
            if req.keys.is_empty() {
                overlaps.extend(ids.iter().map(|&id| Overlap::new(id, [0; 4])));
            } else {
                index.find_matches_into(req.keys, &ids, &mut overlaps);
            }
        }
        let mut overlaps = overlaps.into_iter();
        ids.iter()
            .zip(own)
            .zip(engine)
            .map(|((&id, own), engine)| {
                let overlap = overlaps.next().filter(|o| o.endpoint == id);
                Candidate {
                    id,
                    load: EffectiveLoad::new(own, engine, &self.config.engine_load),
                    overlap,
                    credit: overlap.map_or(0.0, |o| credit(&o, &self.config.credit)),
                    tie: tie_key(salt, id.get()),
                }
            })
            .collect()
    }

    fn overlap_of(index: &KvIndex, keys: &[BlockKey], endpoint: EndpointId) -> Overlap {
        if keys.is_empty() {
            return Overlap::new(endpoint, [0; 4]);
        }
        index
            .find_matches(keys, &[endpoint])
            .first()
            .copied()
            .unwrap_or(Overlap::new(endpoint, [0; 4]))
    }

    /// Whether the decode endpoint's uncached suffix is long enough to prefill elsewhere.
    fn wants_prefill(&self, prompt_tokens: u32, uncached: u32) -> bool {
        let d = &self.config.disaggregation;
        d.enabled && prompt_tokens >= d.min_prompt_tokens && uncached >= d.min_uncached_blocks
    }

    /// The prefill endpoint with the lowest prefill cost (random tie-break) and its overlap,
    /// if any prefill endpoint exists.
    fn pick_prefill(
        &self,
        req: &ScheduleRequest<'_>,
        endpoints: &[Endpoint],
        index: &KvIndex,
        inflight: &InflightTracker,
        loads: &LoadBook,
        salt: u64,
    ) -> Option<(Pick, Overlap)> {
        let mut eligible = Vec::new();
        prefill_candidates(endpoints, req.model, &mut eligible);
        if eligible.is_empty() {
            return None;
        }
        let prompt_blocks = req.blocks();
        let cands = self.gather(&eligible, req, true, index, inflight, loads, salt);
        let cost =
            |c: &Candidate| prefill_cost(prompt_blocks, c.credit, &c.load, &self.config.weights);
        let best = cands
            .iter()
            .zip(&eligible)
            .min_by(|(a, _), (b, _)| cost(a).total_cmp(&cost(b)).then(a.tie.cmp(&b.tie)))?;
        let overlap = best.0.overlap.unwrap_or(Overlap::new(best.0.id, [0; 4]));
        Some((best.1.pick(), overlap))
    }

    /// Makes the choice of `overlap.endpoint` visible to the next lookups. Approximate mode:
    /// every key is a use (it renews the tracker's LRU and TTL), and the tracker's events go to
    /// the index. Otherwise (when enabled) the keys past the endpoint's GPU reach are
    /// speculated; those within it are already resident there (or speculated by an earlier
    /// decision whose engine event is on its way).
    fn record(&self, index: &KvIndex, overlap: &Overlap, keys: &[BlockKey], now: Millis) {
        let endpoint = overlap.endpoint;
        if keys.is_empty() {
            return;
        }
        if let Some(approx) = &self.approx {
            let events = approx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .record_route(endpoint, keys, now);
            index.apply(Holder::Endpoint(endpoint), &events);
        } else if self.config.speculation.enabled {
            let reach = usize::try_from(overlap.reach(Tier::Gpu)).unwrap_or(usize::MAX);
            if let Some(suffix) = keys.get(reach..).filter(|s| !s.is_empty()) {
                index.speculate(endpoint, suffix, now, self.config.speculation_ttl());
            }
        }
    }
}
