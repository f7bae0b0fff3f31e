//! The planner: one [`Planner::plan`] call per interval turns an observation into replicas per
//! role. The steps, in order (the crate README has the formulas):
//!
//! 1. **Hold on bad input**: a clock that went back, a role whose replicas are unknown, missing
//!    or invalid metrics: the current replicas, clamped into bounds and the budget.
//! 2. **Learn**: the predictors take the interval's request rate and lengths; the correction
//!    factors take observed / expected latency (throughput model); the regressions take
//!    (load per ready replica, latency) points (load model).
//! 3. **Need per role**: the throughput model's replicas for the predicted load, or the load
//!    model's target (one replica per interval toward it), or the larger of the two; a dead
//!    band keeps a need near a boundary from flapping; then the role's bounds.
//! 4. **Stabilise**: HPA's scale-down window and the minimum replica lifetime ([`Governor`]).
//! 5. **Move capacity**: when the budget binds, roles held above their recommendation only by
//!    stabilisation give those replicas up, in this decision, to roles that need more.
//! 6. **Budget**: the GPUs are shared ([`budget::allocate`]).

use std::collections::BTreeMap;

use crate::budget::{self, Ask};
use crate::config::{ConfigError, Mode, PlannerConfig, Role, Slo};
use crate::decision::{Decision, HoldCause, Limit, Reason, RoleDecision, Source};
use crate::governor::{Governor, Held};
use crate::observation::{Load, Metrics, Observation};
use crate::predictor::Predictor;
use crate::profile::Profile;
use crate::regression::Regression;

/// Observations further apart than this many intervals restart the predictors and the
/// regressions.
pub const STALE_INTERVALS: f64 = 4.0;

/// Latencies above this multiple of the SLO are kept out of the load model's regressions.
const OVERLOAD: f64 = 2.0;

/// In a disaggregated pool, an interval's ITL is taken as late news when the requests on the
/// decode engines fit in this share of the ready decode replicas at the objective.
const STALE_ITL_SHARE: f64 = 0.5;

/// The throughput model's correction factors: observed / expected latency, smoothed and
/// bounded (1 = the profile is right).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Corrections {
    /// TTFT: the profiled prefill capacity is divided by it.
    pub prefill: f64,
    /// ITL: the ITL target the decode capacity is read at is divided by it.
    pub decode: f64,
}

/// The SLA planner of one pool. Pure and synchronous; the operator (or a replay) calls
/// [`Planner::plan`] once per interval.
#[derive(Debug, Clone)]
pub struct Planner {
    config: PlannerConfig,
    rps: Predictor,
    isl: Predictor,
    osl: Predictor,
    corrections: Corrections,
    /// TTFT against prompt tokens/s per ready replica.
    ttft: Regression,
    /// ITL against decoding sequences per ready replica.
    itl: Regression,
    /// The least prompt tokens/s per ready replica at which TTFT missed the SLO, lately.
    ttft_missed: Miss,
    /// The least output tokens/s per ready replica at which ITL missed the SLO, lately.
    itl_missed: Miss,
    governors: BTreeMap<Role, Governor>,
    last_at: Option<f64>,
}

/// The least load per replica at which a latency missed its SLO, and when it was last seen
/// at or below that load: a miss is remembered for [`Tuning::miss_memory_s`] (the pool and
/// its traffic change; a miss from long ago should not hold replicas for ever).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Miss(Option<(f64, f64)>);

impl Miss {
    /// The remembered load at `now`, if the miss is recent enough.
    fn load(self, now: f64, memory_s: f64) -> Option<f64> {
        self.0
            .filter(|&(_, at)| now - at <= memory_s)
            .map(|(x, _)| x)
    }

    /// A miss at load `x` at time `at`.
    fn record(&mut self, x: f64, at: f64, memory_s: f64) {
        self.0 = match self.load(at, memory_s) {
            Some(v) if v < x => self.0,
            _ => Some((x, at)),
        };
    }
}

/// One latency signal of the load model.
struct Signal {
    /// Replicas the regression says the predicted load needs.
    need: Option<f64>,
    /// The interval's latency.
    observed: Option<f64>,
    /// The SLO.
    target: f64,
    /// The load per replica with one replica fewer.
    fewer_load: f64,
    /// The least load per replica at which the SLO was missed.
    missed_at: Option<f64>,
}

/// A need in replicas to a whole count (a hair under an integer is that integer).
fn count(need: f64) -> u32 {
    if need.is_nan() || need <= 0.0 {
        0
    } else if need >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        (need - 1e-9).ceil().max(0.0) as u32
    }
}

/// Up as soon as `need` exceeds `current`; down only to a count leaving `tolerance` headroom.
fn dead_band(need: f64, current: u32, tolerance: f64) -> u32 {
    let up = count(need);
    if up > current {
        up
    } else {
        count(need / (1.0 - tolerance)).min(current)
    }
}

fn per(demand: f64, capacity: f64) -> f64 {
    if demand <= 0.0 {
        0.0
    } else if capacity > 0.0 {
        demand / capacity
    } else {
        f64::INFINITY
    }
}

/// The throughput model: the replicas (fractional) `role` needs for `load` with `profile`,
/// planning for `utilisation` of each replica's capacity at the SLO:
/// `prefill = rps·isl ÷ (prefill_capacity(ttft / c_prefill) · u)`,
/// `decode = rps·osl ÷ (decode_capacity(itl / c_decode, isl + osl/2) · u)`, and
/// `both = prefill + decode` (an aggregated replica time-shares the two). Infinite when the
/// profile gives no capacity at all for a positive load.
pub fn throughput_need(
    profile: &Profile,
    slo: &Slo,
    load: &Load,
    utilisation: f64,
    corrections: Corrections,
    role: Role,
) -> f64 {
    // Both corrections scale the latency the profile is read at (a replica whose latency is
    // `c` times the profile's meets the objective where the profile meets objective / c),
    // which stays right where the curve bends, unlike scaling the capacity.
    let prefill_capacity =
        profile.prefill_capacity(slo.ttft_ms / corrections.prefill) * utilisation;
    let decode_capacity = profile
        .decode_capacity(slo.itl_ms / corrections.decode, load.decode_context())
        * utilisation;
    let prefill = per(load.prefill_tokens_per_s(), prefill_capacity);
    let decode = per(load.decode_tokens_per_s(), decode_capacity);
    match role {
        Role::Prefill => prefill,
        Role::Decode => decode,
        Role::Both => prefill + decode,
    }
}

/// The decode replicas (fractional) that hold `requests` on decode engines at once within the
/// ITL objective: `decode = requests ÷ (decode_sequences(itl / c_decode, isl + osl/2) · u)`,
/// the sequences a replica carries there by Little's law
/// ([`Profile::decode_sequences`]). Infinite when the profile gives no capacity at all for a
/// positive count.
pub fn concurrency_need(
    profile: &Profile,
    slo: &Slo,
    load: &Load,
    utilisation: f64,
    corrections: Corrections,
    requests: f64,
) -> f64 {
    let sequences =
        profile.decode_sequences(slo.itl_ms / corrections.decode, load.decode_context());
    per(requests, sequences * utilisation)
}

impl Corrections {
    /// No correction: the profile is taken as it is.
    pub const NONE: Corrections = Corrections {
        prefill: 1.0,
        decode: 1.0,
    };
}

impl Planner {
    /// A planner for a validated `config`.
    pub fn new(config: PlannerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let governors = config
            .roles
            .keys()
            .map(|&r| {
                (
                    r,
                    Governor::new(
                        config.scale_down_stabilization_s,
                        config.min_replica_lifetime_s,
                    ),
                )
            })
            .collect();
        Ok(Self {
            rps: Predictor::new(config.predictor),
            isl: Predictor::new(config.predictor),
            osl: Predictor::new(config.predictor),
            corrections: Corrections::NONE,
            ttft: Regression::new(config.tuning.regression_forgetting),
            itl: Regression::new(config.tuning.regression_forgetting),
            ttft_missed: Miss::default(),
            itl_missed: Miss::default(),
            governors,
            last_at: None,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// The current correction factors.
    pub fn corrections(&self) -> Corrections {
        self.corrections
    }

    /// The role that prefills (`Both` in an aggregated pool).
    fn prefill_role(&self) -> Role {
        if self.config.roles.contains_key(&Role::Both) {
            Role::Both
        } else {
            Role::Prefill
        }
    }

    /// Whether, in a disaggregated pool, the interval's ITL misses its objective: first tokens
    /// then also wait for decode slots, so TTFT says nothing about prefill.
    fn decode_saturated(&self, m: &Metrics) -> bool {
        self.prefill_role() != self.decode_role()
            && m.itl_ms.is_some_and(|itl| itl > self.config.slo.itl_ms)
    }

    /// Whether, in a disaggregated pool, the interval's ITL is late news: an interval's ITL is
    /// that of the requests that completed in it, which with long answers started minutes ago.
    /// When the requests decoding now fit in [`STALE_ITL_SHARE`] of the ready replicas at the
    /// objective (the profile's sequences by Little's law, corrected), a missed ITL is an
    /// earlier overload's: it neither adds replicas, nor holds them, nor is remembered as a
    /// miss at today's load per replica.
    fn decode_itl_stale(&self, m: &Metrics, ready_decode: u32) -> bool {
        let (Some(p), Some(n)) = (&self.config.profile, m.decode_requests) else {
            return false;
        };
        let sequences = p.decode_sequences(
            self.config.slo.itl_ms / self.corrections.decode,
            m.load().decode_context(),
        );
        self.prefill_role() != self.decode_role()
            && ready_decode > 0
            && n <= STALE_ITL_SHARE * f64::from(ready_decode) * sequences
    }

    /// The time of the latest observation (0 before any).
    fn now(&self) -> f64 {
        self.last_at.unwrap_or(0.0)
    }

    /// The role that decodes.
    fn decode_role(&self) -> Role {
        if self.config.roles.contains_key(&Role::Both) {
            Role::Both
        } else {
            Role::Decode
        }
    }

    /// One interval: the replicas each role should have.
    pub fn plan(&mut self, obs: &Observation) -> Decision {
        let current: BTreeMap<Role, u32> = self
            .config
            .roles
            .keys()
            .filter_map(|r| obs.replicas.get(r).map(|&n| (*r, n)))
            .collect();
        if current.len() < self.config.roles.len() {
            return self.hold(obs.at_s, &current, HoldCause::ReplicasUnknown);
        }
        if !obs.at_s.is_finite() || self.last_at.is_some_and(|t| obs.at_s < t) {
            return self.hold(obs.at_s, &current, HoldCause::ClockWentBack);
        }
        let Some(m) = obs.metrics else {
            return self.hold(obs.at_s, &current, HoldCause::MetricsUnavailable);
        };
        if !m.is_valid() {
            return self.hold(obs.at_s, &current, HoldCause::MetricsInvalid);
        }
        if self
            .last_at
            .is_some_and(|t| obs.at_s - t > STALE_INTERVALS * self.config.interval_s)
        {
            for p in [&mut self.rps, &mut self.isl, &mut self.osl] {
                p.reset();
            }
            self.ttft.reset();
            self.itl.reset();
            self.ttft_missed = Miss::default();
            self.itl_missed = Miss::default();
        }
        self.last_at = Some(obs.at_s);
        self.rps.observe(m.rps);
        if m.rps > 0.0 {
            self.isl.observe(m.isl_tokens);
            self.osl.observe(m.osl_tokens);
        }
        let predicted = Load {
            rps: self.rps.predict().unwrap_or(0.0),
            isl_tokens: self.isl.predict().unwrap_or(m.isl_tokens),
            osl_tokens: self.osl.predict().unwrap_or(m.osl_tokens),
        };
        let ready = |role: Role| {
            obs.ready
                .get(&role)
                .or_else(|| current.get(&role))
                .copied()
                .unwrap_or(0)
        };
        self.learn(&m, ready(self.prefill_role()), ready(self.decode_role()));
        let mut roles = BTreeMap::new();
        for (&role, limits) in &self.config.roles {
            let now = current.get(&role).copied().unwrap_or(0);
            let (need, raw, source) = self.recommend(role, &predicted, &m, now, ready(role));
            let recommended = raw.clamp(limits.min_replicas, limits.max_replicas);
            let (governed, held) = match self.governors.get_mut(&role) {
                Some(g) => g.govern(obs.at_s, now, recommended),
                None => (recommended, Held::No),
            };
            // A role held at replicas outside its bounds is still brought into them.
            let governed = governed.clamp(limits.min_replicas, limits.max_replicas);
            let limit = match held {
                Held::Stabilization => Some(Limit::Stabilization),
                Held::Lifetime => Some(Limit::Lifetime),
                Held::No => (recommended != raw).then_some(Limit::Bounds),
            };
            roles.insert(
                role,
                RoleDecision {
                    current: now,
                    ready: ready(role),
                    need,
                    recommended,
                    desired: governed,
                    source,
                    limit,
                },
            );
        }
        let moved = self.move_capacity(&mut roles);
        let budget_limited = self.share_budget(&mut roles);
        for (role, d) in &roles {
            if let Some(g) = self.governors.get_mut(role) {
                g.applied(obs.at_s, d.current, d.desired);
            }
        }
        let reason = self.reason(&roles, moved, budget_limited);
        Decision {
            desired: roles.iter().map(|(&r, d)| (r, d.desired)).collect(),
            predicted: Some(predicted),
            reason,
            budget_limited,
            roles,
        }
    }

    /// The current replicas, clamped into bounds and the budget.
    fn hold(&mut self, at: f64, current: &BTreeMap<Role, u32>, cause: HoldCause) -> Decision {
        let asks: Vec<(Role, Ask)> = current
            .iter()
            .filter_map(|(&role, &n)| {
                let l = self.config.roles.get(&role)?;
                Some((
                    role,
                    Ask {
                        current: n,
                        want: n.clamp(l.min_replicas, l.max_replicas),
                        min: l.min_replicas,
                        gpus: l.gpus_per_replica,
                    },
                ))
            })
            .collect();
        let plain: Vec<Ask> = asks.iter().map(|(_, a)| *a).collect();
        let (got, budget_limited) = budget::allocate(&plain, self.config.gpu_budget);
        let desired: BTreeMap<Role, u32> = asks.iter().map(|(r, _)| *r).zip(got).collect();
        if at.is_finite() && !matches!(cause, HoldCause::ClockWentBack) {
            for (role, &to) in &desired {
                if let (Some(g), Some(&from)) = (self.governors.get_mut(role), current.get(role)) {
                    g.applied(at, from, to);
                }
            }
        }
        Decision {
            desired,
            predicted: None,
            reason: Reason::Hold(cause),
            budget_limited,
            roles: BTreeMap::new(),
        }
    }

    /// Updates the correction factors and the regressions from the interval's metrics.
    fn learn(&mut self, m: &Metrics, ready_prefill: u32, ready_decode: u32) {
        if m.rps <= 0.0 {
            return;
        }
        let slo = self.config.slo;
        let t = self.config.tuning;
        let observed = m.load();
        let smooth = |c: f64, ratio: f64| {
            if ratio.is_finite() && ratio > 0.0 {
                (c + t.correction_smoothing * (ratio - c))
                    .clamp(1.0 / t.max_correction, t.max_correction)
            } else {
                c
            }
        };
        let now = self.now();
        // In a disaggregated pool a request's first token also waits for a decode slot: while
        // decode misses its ITL objective (saturated), TTFT says nothing about prefill.
        let decode_saturated = self.decode_saturated(m);
        if let (true, false, Some(ttft)) = (ready_prefill > 0, decode_saturated, m.ttft_ms) {
            let x = observed.prefill_tokens_per_s() / f64::from(ready_prefill);
            // Points deep in overload (queues growing) say nothing about where the SLO is
            // crossed and would tilt a straight line: they are only remembered as misses.
            if ttft <= OVERLOAD * slo.ttft_ms {
                self.ttft.observe(x, ttft);
            }
            if ttft > slo.ttft_ms {
                self.ttft_missed.record(x, now, t.miss_memory_s);
            }
            if let Some(p) = &self.config.profile
                && x >= t.correction_min_utilisation * p.prefill_capacity(slo.ttft_ms)
            {
                let expected = p.expected_ttft(x);
                self.corrections.prefill = smooth(self.corrections.prefill, ttft / expected);
            }
        }
        let itl_stale = self.decode_itl_stale(m, ready_decode);
        if let (true, false, Some(itl)) = (ready_decode > 0, itl_stale, m.itl_ms) {
            let y = observed.decode_tokens_per_s() / f64::from(ready_decode);
            if itl > slo.itl_ms {
                self.itl_missed.record(y, now, t.miss_memory_s);
            }
            // Little's law: sequences decoding per replica = tokens/s × seconds per token.
            if itl <= OVERLOAD * slo.itl_ms {
                self.itl.observe(y * itl / 1000.0, itl);
            }
            let context = observed.decode_context();
            // More requests on the decode engines than they can batch at the objective, or
            // first tokens deep in overload (a backlog): the ITL of the requests completing
            // now is an overload's, not a sign that the profile is off.
            let over_capacity = |p: &Profile| {
                m.ttft_ms.is_some_and(|t| t > OVERLOAD * slo.ttft_ms)
                    || m.decode_requests.is_some_and(|n| {
                        n > f64::from(ready_decode) * p.decode_sequences(slo.itl_ms, context)
                    })
            };
            if let Some(p) = &self.config.profile
                && y >= t.correction_min_utilisation * p.decode_capacity(slo.itl_ms, context)
                && !over_capacity(p)
            {
                let expected = p.expected_itl(y, context);
                self.corrections.decode = smooth(self.corrections.decode, itl / expected);
            }
        }
    }

    /// The throughput model's replicas for `load` (fractional), if there is a profile.
    /// For the decode role of a disaggregated pool, the larger of that and the requests on
    /// its engines by Little's law ([`concurrency_need`]): output lengths show only as
    /// requests complete, the requests in flight as soon as longer answers start.
    fn throughput_need(&self, role: Role, load: &Load, m: &Metrics) -> Option<f64> {
        let p = self.config.profile.as_ref()?;
        let (slo, u) = (&self.config.slo, self.config.tuning.target_utilisation);
        let by_rate = throughput_need(p, slo, load, u, self.corrections, role);
        Some(match (role, m.decode_requests) {
            (Role::Decode, Some(n)) => {
                by_rate.max(concurrency_need(p, slo, load, u, self.corrections, n))
            }
            _ => by_rate,
        })
    }

    /// The load model's step for a role: one replica up when the regression says `current`
    /// replicas cannot hold the predicted load within the SLO, or when every replica is
    /// serving and the observed latency misses it; one down when the regression says one
    /// fewer leaves the tolerance's headroom, the observed latency has that headroom, and one
    /// fewer would not load each replica to within the tolerance of the least load per replica
    /// at which the SLO was ever missed (since the last restart); else none. That last rule
    /// keeps a regression fitted to a curved latency from trying the same failing count again
    /// and again. Returns the need (the regression's replicas, the largest over the role's
    /// signals; `current` without a fit), the step, whether every signal had a usable
    /// regression (without one the model knows when to add, never when to remove), and the
    /// fewest replicas the remembered misses allow (at most `current`).
    fn load_step(
        &self,
        role: Role,
        load: &Load,
        m: &Metrics,
        current: u32,
        ready: u32,
    ) -> (f64, u32, bool, u32) {
        let slo = self.config.slo;
        let tol = self.config.tuning.tolerance;
        let fewer = f64::from(current.saturating_sub(1).max(1));
        // A first token late behind a saturated decode role is not prefill's miss, where the
        // profile says prefill has the capacity (without a profile it cannot be told apart).
        let not_prefills = self.decode_saturated(m)
            && self
                .throughput_need(role, load, m)
                .is_some_and(|n| n <= f64::from(current));
        let prefill = || Signal {
            need: self
                .ttft
                .fit()
                .and_then(|l| l.load_at(slo.ttft_ms))
                .map(|x| load.prefill_tokens_per_s() / x),
            observed: m.ttft_ms.filter(|_| !not_prefills),
            target: slo.ttft_ms,
            fewer_load: load.prefill_tokens_per_s() / fewer,
            missed_at: self
                .ttft_missed
                .load(self.now(), self.config.tuning.miss_memory_s),
        };
        // At the target, a replica decoding `c` sequences makes c / ITL tokens/s.
        let decode = || Signal {
            need: self
                .itl
                .fit()
                .and_then(|l| l.load_at(slo.itl_ms))
                .map(|c| load.decode_tokens_per_s() * slo.itl_ms / 1000.0 / c),
            observed: m.itl_ms.filter(|_| !self.decode_itl_stale(m, ready)),
            target: slo.itl_ms,
            fewer_load: load.decode_tokens_per_s() / fewer,
            missed_at: self
                .itl_missed
                .load(self.now(), self.config.tuning.miss_memory_s),
        };
        let signals = match role {
            Role::Prefill => vec![prefill()],
            Role::Decode => vec![decode()],
            Role::Both => vec![prefill(), decode()],
        };
        let need = signals
            .iter()
            .filter_map(|s| s.need)
            .fold(None, |acc: Option<f64>, n| {
                Some(acc.map_or(n, |a| a.max(n)))
            })
            .unwrap_or(f64::from(current));
        let demand = load.rps > 0.0;
        // Up when the regression says so, or when the latency misses the SLO with every
        // replica serving (a regression can be wrong; a replica still starting is not yet
        // capacity, so its absence is not a reason for another).
        let up = (current == 0 && demand)
            || signals.iter().any(|s| {
                s.need.is_some_and(|n| count(n) > current)
                    || (ready >= current && s.observed.is_some_and(|y| y > s.target))
            });
        let down = current > 0
            && signals.iter().all(|s| {
                s.need.is_some_and(|n| dead_band(n, current, tol) < current)
                    && s.observed.is_none_or(|y| y <= s.target * (1.0 - tol))
                    && s.missed_at.is_none_or(|v| s.fewer_load <= v * (1.0 - tol))
            });
        let step = if up {
            current.saturating_add(1)
        } else if down {
            current - 1
        } else {
            current
        };
        // The fewest replicas that keep every signal's load per replica within the tolerance
        // of the least load at which it missed the SLO (at most `current`).
        let lowest_safe = signals
            .iter()
            .filter_map(|s| {
                let v = s.missed_at? * (1.0 - tol);
                Some(count(
                    s.fewer_load * f64::from(current.saturating_sub(1).max(1)) / v,
                ))
            })
            .max()
            .unwrap_or(0)
            .min(current);
        (
            need,
            step,
            signals.iter().all(|s| s.need.is_some()),
            lowest_safe,
        )
    }

    /// The role's need, its unbounded recommendation, and which model made it.
    fn recommend(
        &self,
        role: Role,
        load: &Load,
        m: &Metrics,
        current: u32,
        ready: u32,
    ) -> (f64, u32, Source) {
        let tol = self.config.tuning.tolerance;
        let throughput = self.throughput_need(role, load, m).unwrap_or(0.0);
        match self.config.mode {
            Mode::Throughput => (
                throughput,
                dead_band(throughput, current, tol),
                Source::Throughput,
            ),
            Mode::Load => {
                let (need, step, _, _) = self.load_step(role, load, m, current, ready);
                (need, step, Source::Load)
            }
            Mode::Both => {
                let (need, step, informed, safe) = self.load_step(role, load, m, current, ready);
                let floor = dead_band(throughput, current, tol);
                if floor > step {
                    (throughput, floor, Source::Throughput)
                } else if !informed && step <= current {
                    // A load model without a regression (a latency flat under load) only knows
                    // when to add a replica; the throughput model decides the rest, but not
                    // below a count whose load per replica has missed the SLO.
                    (throughput, floor.max(safe), Source::Throughput)
                } else {
                    (need, step, Source::Load)
                }
            }
        }
    }

    /// When the budget cannot hold every role's governed replicas and one of them grows,
    /// takes the replicas that only stabilisation holds above a role's recommendation, as
    /// many as the shortfall needs. Returns whether any moved.
    fn move_capacity(&self, roles: &mut BTreeMap<Role, RoleDecision>) -> bool {
        let (true, Some(budget)) = (self.config.move_between_roles, self.config.gpu_budget) else {
            return false;
        };
        let gpus = |role: &Role| {
            self.config
                .roles
                .get(role)
                .map_or(0, |l| l.gpus_per_replica)
        };
        let wanted: u64 = roles
            .iter()
            .map(|(r, d)| u64::from(d.desired) * u64::from(gpus(r)))
            .sum();
        let growing = roles.values().any(|d| d.desired > d.current);
        let mut short = wanted.saturating_sub(u64::from(budget));
        if short == 0 || !growing {
            return false;
        }
        let mut donors: Vec<(Role, u32)> = roles
            .iter()
            .filter(|(r, d)| {
                d.limit == Some(Limit::Stabilization) && d.desired > d.recommended && gpus(r) > 0
            })
            .map(|(&r, d)| (r, d.desired - d.recommended))
            .collect();
        donors.sort_by_key(|&(r, spare)| (std::cmp::Reverse(spare), r));
        let mut moved = false;
        for (role, spare) in donors {
            let g = u64::from(gpus(&role));
            let take = u32::try_from(short.div_ceil(g))
                .unwrap_or(u32::MAX)
                .min(spare);
            if let Some(d) = roles.get_mut(&role)
                && take > 0
            {
                d.desired -= take;
                d.limit = Some(Limit::Moved);
                short = short.saturating_sub(u64::from(take) * g);
                moved = true;
            }
            if short == 0 {
                break;
            }
        }
        moved
    }

    /// Fits the roles into the budget; returns whether any got less than it asked.
    fn share_budget(&self, roles: &mut BTreeMap<Role, RoleDecision>) -> bool {
        let asks: Vec<Ask> = roles
            .iter()
            .map(|(r, d)| {
                let l = self.config.roles.get(r);
                Ask {
                    current: d.current,
                    want: d.desired,
                    min: l.map_or(0, |l| l.min_replicas),
                    gpus: l.map_or(0, |l| l.gpus_per_replica),
                }
            })
            .collect();
        let (got, limited) = budget::allocate(&asks, self.config.gpu_budget);
        for (d, n) in roles.values_mut().zip(got) {
            if n < d.desired {
                d.limit = Some(Limit::Budget);
            }
            d.desired = n;
        }
        limited
    }

    fn reason(
        &self,
        roles: &BTreeMap<Role, RoleDecision>,
        moved: bool,
        budget_limited: bool,
    ) -> Reason {
        let grew = roles
            .iter()
            .filter(|(_, d)| d.desired > d.current)
            .max_by_key(|&(&r, d)| (d.desired - d.current, std::cmp::Reverse(r)));
        let gave = roles
            .iter()
            .filter(|(_, d)| d.limit == Some(Limit::Moved) && d.desired < d.current)
            .max_by_key(|&(&r, d)| (d.current - d.desired, std::cmp::Reverse(r)));
        if let (true, Some((&to, _)), Some((&from, d))) = (moved, grew, gave) {
            return Reason::MovedCapacity {
                from,
                to,
                replicas: d.current - d.desired,
            };
        }
        let changed = roles
            .iter()
            .filter(|(_, d)| d.desired != d.current)
            .max_by_key(|&(&r, d)| (d.desired.abs_diff(d.current), std::cmp::Reverse(r)));
        if let Some((&role, d)) = changed {
            let (from, to) = (d.current, d.desired);
            let out_of_bounds = self
                .config
                .roles
                .get(&role)
                .is_some_and(|l| from < l.min_replicas || from > l.max_replicas);
            return if out_of_bounds {
                Reason::Bounds { role, from, to }
            } else if d.limit == Some(Limit::Budget) && to < from {
                Reason::Budget { role, from, to }
            } else if d.source == Source::Load {
                Reason::Load { role, from, to }
            } else {
                Reason::Throughput { role, from, to }
            };
        }
        let any = |l: Limit| roles.values().any(|d| d.limit == Some(l));
        if any(Limit::Stabilization) {
            Reason::Hold(HoldCause::Stabilizing)
        } else if any(Limit::Lifetime) {
            Reason::Hold(HoldCause::MinLifetime)
        } else if budget_limited {
            Reason::Hold(HoldCause::Budget)
        } else {
            Reason::Steady
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PredictorKind, RoleLimits, Slo, Tuning};
    use crate::profile::tests::profile;

    fn config(mode: Mode) -> PlannerConfig {
        let limits = RoleLimits {
            min_replicas: 1,
            max_replicas: 10,
            gpus_per_replica: 1,
        };
        PlannerConfig {
            mode,
            interval_s: 30.0,
            predictor: PredictorKind::Constant,
            scale_down_stabilization_s: 90.0,
            min_replica_lifetime_s: 0.0,
            gpu_budget: None,
            roles: [(Role::Prefill, limits), (Role::Decode, limits)].into(),
            slo: Slo {
                ttft_ms: 2000.0,
                itl_ms: 50.0,
                percentile: 90.0,
            },
            profile: Some(profile()),
            move_between_roles: true,
            tuning: Tuning {
                target_utilisation: 1.0,
                tolerance: 0.0,
                ..Tuning::default()
            },
        }
    }

    fn metrics(rps: f64, isl: f64, osl: f64) -> Metrics {
        Metrics {
            rps,
            isl_tokens: isl,
            osl_tokens: osl,
            ttft_ms: None,
            itl_ms: None,
            queue_depth: None,
            decode_requests: None,
        }
    }

    fn obs(at_s: f64, m: Option<Metrics>, p: u32, d: u32) -> Observation {
        Observation {
            at_s,
            metrics: m,
            replicas: [(Role::Prefill, p), (Role::Decode, d)].into(),
            ready: BTreeMap::new(),
        }
    }

    #[test]
    fn throughput_mode_divides_the_load_by_the_profiled_capacity() {
        let mut planner = Planner::new(config(Mode::Throughput)).unwrap();
        // Prefill capacity at 2 s: 8,000 tokens/s; decode at 50 ms and a context of
        // 1000 + 100/2 = 1,050: 100 + 50·(20 − 1.05) = 1,047.5 tokens/s.
        let d = planner.plan(&obs(0.0, Some(metrics(20.0, 1000.0, 100.0)), 1, 1));
        assert_eq!(d.desired[&Role::Prefill], 3, "20,000 / 8,000");
        assert_eq!(d.desired[&Role::Decode], 2, "2,000 / 1,047.5");
        assert_eq!(
            d.reason,
            Reason::Throughput {
                role: Role::Prefill,
                from: 1,
                to: 3
            }
        );
        assert!((d.roles[&Role::Prefill].need - 2.5).abs() < 1e-9);
        assert_eq!(d.predicted.unwrap().rps, 20.0);
    }

    #[test]
    fn requests_on_decode_engines_raise_the_decode_need_by_littles_law() {
        // At 50 ms and a context of 1,050 a decode replica makes 1,047.5 tokens/s, so it
        // carries 1,047.5 × 0.05 = 52.4 sequences.
        let mut m = metrics(20.0, 1000.0, 100.0);
        m.decode_requests = Some(200.0);
        let d = Planner::new(config(Mode::Throughput))
            .unwrap()
            .plan(&obs(0.0, Some(m), 1, 1));
        assert!((d.roles[&Role::Decode].need - 200.0 / 52.375).abs() < 1e-9);
        assert_eq!(d.desired[&Role::Decode], 4);
        // Fewer requests than the rate implies: the rate decides.
        m.decode_requests = Some(10.0);
        let d = Planner::new(config(Mode::Throughput))
            .unwrap()
            .plan(&obs(0.0, Some(m), 1, 1));
        assert_eq!(d.desired[&Role::Decode], 2, "2,000 / 1,047.5");
        // A negative count is bad metrics: hold.
        m.decode_requests = Some(-1.0);
        let d = Planner::new(config(Mode::Throughput))
            .unwrap()
            .plan(&obs(0.0, Some(m), 1, 1));
        assert_eq!(d.reason, Reason::Hold(HoldCause::MetricsInvalid));
    }

    #[test]
    fn an_overloaded_decode_role_teaches_no_correction() {
        let mut planner = Planner::new(config(Mode::Throughput)).unwrap();
        // Two decode replicas carry 2 × 52.4 sequences at the objective; 200 are there.
        let mut m = metrics(20.0, 1000.0, 100.0);
        m.itl_ms = Some(80.0);
        m.decode_requests = Some(200.0);
        planner.plan(&obs(0.0, Some(m), 3, 2));
        assert!((planner.corrections().decode - 1.0).abs() < 1e-9);
        // Within what they can batch, the same ITL is the profile's error.
        m.decode_requests = Some(60.0);
        planner.plan(&obs(30.0, Some(m), 3, 2));
        assert!(planner.corrections().decode > 1.0);
    }

    #[test]
    fn a_late_itl_miss_neither_adds_nor_holds_decode_replicas() {
        // Five decode replicas carry 5 × 52.4 sequences at the objective. The requests that
        // completed in the interval missed the ITL objective (80 ms: they decoded through an
        // earlier overload), but only 40 requests are on the decode engines now.
        let mut m = metrics(2.0, 1000.0, 100.0);
        m.itl_ms = Some(80.0);
        m.decode_requests = Some(40.0);
        let mut planner = Planner::new(config(Mode::Both)).unwrap();
        let d = planner.plan(&obs(0.0, Some(m), 1, 5));
        assert!(d.desired[&Role::Decode] <= 5, "{d:?}");
        assert!((planner.corrections().decode - 1.0).abs() < 1e-9);
        assert!(
            planner.itl_missed.load(0.0, 600.0).is_none(),
            "no miss remembered"
        );
        // The same ITL with more than half of what the engines batch on them is today's: one
        // more replica (the load model; by the profile two would do).
        m.decode_requests = Some(140.0);
        let mut planner = Planner::new(config(Mode::Both)).unwrap();
        let d = planner.plan(&obs(0.0, Some(m), 1, 5));
        assert!(d.desired[&Role::Decode] == 6, "{d:?}");
        assert!(planner.itl_missed.load(0.0, 600.0).is_some());
    }

    #[test]
    fn a_slow_first_token_while_decode_misses_is_not_blamed_on_prefill() {
        let mut planner = Planner::new(config(Mode::Throughput)).unwrap();
        planner.plan(&obs(0.0, Some(metrics(20.0, 1000.0, 100.0)), 3, 2));
        // TTFT twice the profile's, but ITL misses too: decode slots were the wait.
        let mut m = metrics(20.0, 1000.0, 100.0);
        m.ttft_ms = Some(3000.0);
        m.itl_ms = Some(80.0);
        planner.plan(&obs(30.0, Some(m), 3, 2));
        assert!((planner.corrections().prefill - 1.0).abs() < 1e-9);
        assert!(planner.corrections().decode > 1.0);
        // The same TTFT with decode within its objective is prefill's.
        m.itl_ms = Some(20.0);
        planner.plan(&obs(60.0, Some(m), 3, 2));
        assert!((planner.corrections().prefill - 1.5).abs() < 1e-9);
    }

    #[test]
    fn a_remembered_miss_expires() {
        let mut miss = Miss::default();
        miss.record(100.0, 0.0, 600.0);
        miss.record(150.0, 10.0, 600.0);
        assert_eq!(
            miss.load(600.0, 600.0),
            Some(100.0),
            "the least load is kept"
        );
        assert_eq!(miss.load(601.0, 600.0), None, "forgotten after the memory");
        miss.record(150.0, 700.0, 600.0);
        assert_eq!(
            miss.load(700.0, 600.0),
            Some(150.0),
            "an expired miss does not win"
        );
        miss.record(120.0, 710.0, 600.0);
        assert_eq!(miss.load(1310.0, 600.0), Some(120.0));
    }

    #[test]
    fn a_slow_prefill_raises_the_correction_and_the_replicas() {
        let mut planner = Planner::new(config(Mode::Throughput)).unwrap();
        // 3 ready prefill replicas at 6,667 tokens/s each: the profile expects 1,500 ms.
        let mut m = metrics(20.0, 1000.0, 100.0);
        m.ttft_ms = Some(3000.0);
        let before = planner.plan(&obs(0.0, Some(metrics(20.0, 1000.0, 100.0)), 3, 2));
        assert_eq!(before.desired[&Role::Prefill], 3, "20,000 / 8,000");
        let after = planner.plan(&obs(30.0, Some(m), 3, 2));
        // Ratio 2 → correction 1 + 0.5·(2 − 1) = 1.5 → the profile read at 2,000 / 1.5 ms:
        // 4,000 + 4,000·(833 / 1,500) = 6,222 tokens/s.
        assert!((planner.corrections().prefill - 1.5).abs() < 1e-9);
        assert!((after.roles[&Role::Prefill].need - 20_000.0 / 6_222.222).abs() < 1e-3);
        assert_eq!(after.desired[&Role::Prefill], 4);
        // Bounded: a wild ratio moves it to the cap, not beyond.
        m.ttft_ms = Some(1e9);
        planner.plan(&obs(60.0, Some(m), 4, 2));
        assert_eq!(planner.corrections().prefill, 2.0);
    }

    #[test]
    fn missing_or_bad_metrics_hold_the_current_replicas() {
        let mut planner = Planner::new(config(Mode::Throughput)).unwrap();
        let d = planner.plan(&obs(0.0, None, 4, 7));
        assert_eq!(d.reason, Reason::Hold(HoldCause::MetricsUnavailable));
        assert_eq!(d.desired, [(Role::Prefill, 4), (Role::Decode, 7)].into());
        let d = planner.plan(&obs(30.0, Some(metrics(f64::NAN, 1.0, 1.0)), 4, 7));
        assert_eq!(d.reason, Reason::Hold(HoldCause::MetricsInvalid));
        assert_eq!(d.desired, [(Role::Prefill, 4), (Role::Decode, 7)].into());
        // Out-of-bounds replicas are clamped even on a hold.
        let d = planner.plan(&obs(60.0, None, 0, 12));
        assert_eq!(d.desired, [(Role::Prefill, 1), (Role::Decode, 10)].into());
        let mut unknown = obs(90.0, Some(metrics(1.0, 1.0, 1.0)), 4, 7);
        unknown.replicas.remove(&Role::Decode);
        let d = planner.plan(&unknown);
        assert_eq!(d.reason, Reason::Hold(HoldCause::ReplicasUnknown));
        assert_eq!(d.desired, [(Role::Prefill, 4)].into());
        planner.plan(&obs(120.0, Some(metrics(1.0, 10.0, 1.0)), 4, 7));
        let d = planner.plan(&obs(100.0, Some(metrics(1.0, 10.0, 1.0)), 4, 7));
        assert_eq!(d.reason, Reason::Hold(HoldCause::ClockWentBack));
    }

    #[test]
    fn scale_down_is_stabilised_and_reported() {
        let mut planner = Planner::new(config(Mode::Throughput)).unwrap();
        let high = Some(metrics(40.0, 1000.0, 100.0));
        let low = Some(metrics(8.0, 1000.0, 100.0));
        let d = planner.plan(&obs(0.0, high, 1, 1));
        let (p, dd) = (d.desired[&Role::Prefill], d.desired[&Role::Decode]);
        assert_eq!(p, 5);
        let d = planner.plan(&obs(30.0, low, p, dd));
        assert_eq!(d.reason, Reason::Hold(HoldCause::Stabilizing));
        assert_eq!(d.desired[&Role::Prefill], 5);
        assert_eq!(d.roles[&Role::Prefill].recommended, 1);
        planner.plan(&obs(60.0, low, p, dd));
        planner.plan(&obs(90.0, low, p, dd));
        let d = planner.plan(&obs(120.0, low, p, dd));
        assert_eq!(d.desired[&Role::Prefill], 1, "the 5 left the 90 s window");
    }

    #[test]
    fn the_budget_moves_capacity_between_roles_in_one_step() {
        let mut c = config(Mode::Throughput);
        c.gpu_budget = Some(8);
        let mut planner = Planner::new(c.clone()).unwrap();
        // Prefill-heavy: 48,000 prompt tokens/s → 6 prefill; decode needs 2.
        let prefill_heavy = Some(metrics(48.0, 1000.0, 10.0));
        let d = planner.plan(&obs(0.0, prefill_heavy, 1, 1));
        assert_eq!(d.desired, [(Role::Prefill, 6), (Role::Decode, 1)].into());
        // Decode-heavy: 8 rps × 800 output tokens at a context of 800 (the grid's edge, 1,000:
        // 1,050 tokens/s) → 6.1, 7 decode replicas; prefill needs 1 but its window still
        // holds 6.
        let decode_heavy = Some(metrics(8.0, 400.0, 800.0));
        let d = planner.plan(&obs(30.0, decode_heavy, 6, 1));
        assert_eq!(d.desired, [(Role::Prefill, 1), (Role::Decode, 7)].into());
        assert_eq!(
            d.reason,
            Reason::MovedCapacity {
                from: Role::Prefill,
                to: Role::Decode,
                replicas: 5
            }
        );
        assert!(!d.budget_limited);
        // Two independent loops: decode waits for the prefill window.
        c.move_between_roles = false;
        let mut independent = Planner::new(c).unwrap();
        independent.plan(&obs(0.0, prefill_heavy, 1, 1));
        let d = independent.plan(&obs(30.0, decode_heavy, 6, 1));
        assert_eq!(d.desired, [(Role::Prefill, 6), (Role::Decode, 2)].into());
        assert!(d.budget_limited);
        assert_eq!(
            d.reason,
            Reason::Throughput {
                role: Role::Decode,
                from: 1,
                to: 2
            }
        );
    }

    #[test]
    fn load_mode_steps_one_replica_toward_the_regression_target() {
        let mut c = config(Mode::Load);
        c.profile = None;
        c.roles.remove(&Role::Prefill);
        c.roles.remove(&Role::Decode);
        c.roles.insert(
            Role::Both,
            RoleLimits {
                min_replicas: 1,
                max_replicas: 20,
                gpus_per_replica: 1,
            },
        );
        let mut planner = Planner::new(c).unwrap();
        // TTFT = 200 + 0.1 × prompt tokens/s per replica; ITL well within the SLO.
        let at = |i: u32| f64::from(i) * 30.0;
        let mut replicas = 2;
        let mut trace = Vec::new();
        for i in 0..30 {
            let rps = 20.0;
            let per_replica = rps * 1000.0 / f64::from(replicas);
            let m = Metrics {
                ttft_ms: Some(200.0 + 0.1 * per_replica),
                itl_ms: Some(20.0),
                ..metrics(rps, 1000.0, 100.0)
            };
            let o = Observation {
                at_s: at(i),
                metrics: Some(m),
                replicas: [(Role::Both, replicas)].into(),
                ready: BTreeMap::new(),
            };
            let d = planner.plan(&o);
            let next = d.desired[&Role::Both];
            assert!(next.abs_diff(replicas) <= 1, "±1 per interval");
            replicas = next;
            trace.push(replicas);
        }
        // 20,000 tokens/s, 18,000 per replica at the 2 s target → 2 replicas suffice, but
        // 2 replicas run at 10,000 tokens/s (TTFT 1.2 s): the planner needs no change.
        assert!(trace.iter().all(|&r| r == 2), "{trace:?}");
    }
}
