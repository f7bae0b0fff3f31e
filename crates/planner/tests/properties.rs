//! Properties of the planner over random configurations and observation sequences:
//!
//! - no decision is ever outside a role's bounds or the GPU budget, whatever it observes;
//! - missing or invalid metrics hold the current replicas;
//! - under a constant load, against a plant whose latency follows the profile (off by a
//!   constant factor), the replicas settle and then stay put;
//! - a step in load is followed within a stated number of intervals;
//! - stabilisation and the minimum lifetime match a naive model that replays the whole
//!   history at every step.

use std::collections::BTreeMap;

use planner::{
    Decision, DecodeTable, HoldCause, Metrics, Mode, Observation, Planner, PlannerConfig,
    PredictorKind, PrefillPoint, Profile, Reason, Role, RoleLimits, Slo, Tuning,
};
use proptest::prelude::*;

/// A profile shaped like a real engine's: TTFT flat at 400 ms up to 5,000 prompt tokens/s, then
/// rising; decode throughput growing with the allowed ITL and falling with the context.
fn profile() -> Profile {
    let contexts = vec![1000.0, 4000.0, 16000.0];
    let itls = vec![20.0, 40.0, 80.0, 160.0];
    Profile {
        description: "properties".into(),
        prefill: [
            (1000.0, 400.0),
            (5000.0, 400.0),
            (8000.0, 1500.0),
            (10000.0, 6000.0),
        ]
        .iter()
        .map(|&(tokens_per_s, ttft_ms)| PrefillPoint {
            tokens_per_s,
            ttft_ms,
        })
        .collect(),
        decode: DecodeTable {
            tokens_per_s: contexts
                .iter()
                .map(|&c| {
                    itls.iter()
                        .map(|&l| 40.0 * (l - 15.0) * 4000.0 / (c + 3000.0))
                        .collect()
                })
                .collect(),
            context_tokens: contexts,
            itl_ms: itls,
        },
    }
}

fn slo() -> Slo {
    Slo {
        ttft_ms: 1500.0,
        itl_ms: 80.0,
        percentile: 90.0,
    }
}

fn predictor() -> impl Strategy<Value = PredictorKind> {
    prop_oneof![
        Just(PredictorKind::Constant),
        (1u32..5).prop_map(|window| PredictorKind::MovingAverage { window }),
        (0.2f64..1.0, 0.0f64..0.5).prop_map(|(alpha, beta)| PredictorKind::Holt { alpha, beta }),
        Just(PredictorKind::Kalman {
            process_noise: 1e-3,
            measurement_noise: 1e-2
        }),
    ]
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![Just(Mode::Throughput), Just(Mode::Load), Just(Mode::Both)]
}

fn limits() -> impl Strategy<Value = RoleLimits> {
    (0u32..3, 1u32..10, 0u32..3).prop_map(|(min, span, gpus)| RoleLimits {
        min_replicas: min,
        max_replicas: min.max(1) + span,
        gpus_per_replica: gpus,
    })
}

/// Any valid configuration.
fn config() -> impl Strategy<Value = PlannerConfig> {
    (
        mode(),
        predictor(),
        prop_oneof![Just(0.0), Just(60.0), Just(300.0)],
        prop_oneof![Just(0.0), Just(60.0), Just(200.0)],
        any::<bool>(),
        limits(),
        limits(),
        proptest::option::of(0u32..20),
        any::<bool>(),
    )
        .prop_map(
            |(mode, predictor, window, lifetime, disaggregated, a, b, slack, moving)| {
                let roles: BTreeMap<Role, RoleLimits> = if disaggregated {
                    [(Role::Prefill, a), (Role::Decode, b)].into()
                } else {
                    [(Role::Both, a)].into()
                };
                let floor: u32 = roles
                    .values()
                    .map(|l| l.min_replicas * l.gpus_per_replica)
                    .sum();
                PlannerConfig {
                    mode,
                    interval_s: 30.0,
                    predictor,
                    scale_down_stabilization_s: window,
                    min_replica_lifetime_s: lifetime,
                    gpu_budget: slack.map(|s| floor + s),
                    roles,
                    slo: slo(),
                    profile: Some(profile()),
                    move_between_roles: moving,
                    tuning: Tuning::default(),
                }
            },
        )
}

/// Any metrics, sane or not.
fn metrics() -> impl Strategy<Value = Option<Metrics>> {
    let number = prop_oneof![
        8 => 0.0f64..50_000.0,
        1 => Just(0.0),
        1 => Just(f64::NAN),
        1 => Just(-1.0),
        1 => Just(f64::INFINITY),
    ];
    let latency = proptest::option::of(prop_oneof![
        8 => 1.0f64..20_000.0,
        1 => Just(f64::NAN),
    ]);
    proptest::option::of(
        (
            prop_oneof![4 => 0.0f64..60.0, 1 => number.clone()],
            number.clone(),
            prop_oneof![4 => 1.0f64..2_000.0, 1 => number],
            latency.clone(),
            latency,
        )
            .prop_map(|(rps, isl, osl, ttft, itl)| Metrics {
                rps,
                isl_tokens: isl,
                osl_tokens: osl,
                ttft_ms: ttft,
                itl_ms: itl,
                queue_depth: None,
                decode_requests: None,
            }),
    )
}

/// One step of a random observation sequence: time advance, metrics, replicas (missing
/// sometimes), ready replicas.
/// Time advance, metrics, replicas per role (in the configuration's role order), ready.
type Step = (f64, Option<Metrics>, [Option<u32>; 3], u32);

fn steps() -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(
        (
            prop_oneof![8 => Just(30.0), 1 => Just(0.0), 1 => Just(-10.0), 1 => Just(400.0)],
            metrics(),
            [
                proptest::option::weighted(0.95, 0u32..16),
                proptest::option::weighted(0.95, 0u32..16),
                proptest::option::weighted(0.95, 0u32..16),
            ],
            0u32..16,
        ),
        1..60,
    )
}

fn check_bounds(c: &PlannerConfig, d: &Decision) -> Result<(), TestCaseError> {
    for (role, &n) in &d.desired {
        let l = c.roles.get(role);
        prop_assert!(l.is_some(), "unknown role {role}");
        if let Some(l) = l {
            prop_assert!(
                (l.min_replicas..=l.max_replicas).contains(&n),
                "{role}: {n} outside {}..={}",
                l.min_replicas,
                l.max_replicas
            );
        }
    }
    if let Some(budget) = c.gpu_budget {
        prop_assert!(c.gpus(&d.desired) <= u64::from(budget), "{d:?}");
    }
    if d.reason != Reason::Hold(HoldCause::ReplicasUnknown) {
        prop_assert_eq!(d.desired.len(), c.roles.len());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn never_outside_bounds_or_budget(config in config(), steps in steps(), follow in any::<bool>()) {
        let mut planner = Planner::new(config.clone()).unwrap();
        let mut at = 0.0;
        let mut last: BTreeMap<Role, u32> = BTreeMap::new();
        for (dt, metrics, counts, ready) in steps {
            at += dt;
            let replicas: BTreeMap<Role, u32> = config
                .roles
                .keys()
                .zip(counts)
                .filter_map(|(&r, n)| {
                    // Either the controller applied the last decision, or the replicas moved
                    // by themselves (someone scaled by hand).
                    let followed = if follow { last.get(&r).copied() } else { None };
                    Some((r, followed.or(n)?))
                })
                .collect();
            let obs = Observation {
                at_s: at,
                metrics,
                ready: replicas.keys().map(|&r| (r, ready)).collect(),
                replicas: replicas.clone(),
            };
            let d = planner.plan(&obs);
            check_bounds(&config, &d)?;
            let good = metrics.is_some_and(|m| m.is_valid());
            if !good && replicas.len() == config.roles.len() {
                // Bad or missing metrics: the current replicas (clamped), never a move toward
                // zero or max on their account.
                prop_assert!(d.reason.is_hold(), "{:?}", d.reason);
                let clamped: BTreeMap<Role, u32> = replicas
                    .iter()
                    .map(|(r, &n)| {
                        let l = &config.roles[r];
                        (*r, n.clamp(l.min_replicas, l.max_replicas))
                    })
                    .collect();
                let fits = config.gpu_budget.is_none_or(|b| config.gpus(&clamped) <= u64::from(b));
                for (r, &n) in &clamped {
                    prop_assert!(d.desired[r] <= n.max(config.roles[r].min_replicas));
                    if fits {
                        prop_assert_eq!(d.desired[r], n);
                    }
                }
            }
            last = d.desired;
        }
    }
}

/// A pool as a plant: replicas become ready `startup` intervals after they are asked for;
/// TTFT and ITL follow the profile at the load per ready replica, times `k_prefill` and
/// `k_decode` (a profile that is off by a constant factor), and grow without bound past the
/// profiled range.
struct Plant {
    profile: Profile,
    k_prefill: f64,
    k_decode: f64,
    startup: usize,
    history: Vec<BTreeMap<Role, u32>>,
}

impl Plant {
    fn ready(&self) -> BTreeMap<Role, u32> {
        let now = self.history.last().cloned().unwrap_or_default();
        let then = self
            .history
            .len()
            .checked_sub(1 + self.startup)
            .and_then(|i| self.history.get(i));
        now.iter()
            .map(|(&r, &n)| (r, then.and_then(|t| t.get(&r)).map_or(0, |&m| n.min(m))))
            .collect()
    }

    fn metrics(&self, rps: f64, isl: f64, osl: f64) -> Metrics {
        let ready = self.ready();
        let serving = |role: Role| {
            let n = ready.get(&role).or_else(|| ready.get(&Role::Both)).copied();
            f64::from(n.unwrap_or(0))
        };
        let (p, d) = (serving(Role::Prefill), serving(Role::Decode));
        let ctx = isl + osl / 2.0;
        let ttft = if p > 0.0 {
            self.k_prefill * self.profile.expected_ttft(rps * isl / p)
        } else {
            1e6
        };
        let itl = if d > 0.0 {
            let y = rps * osl / d;
            let top = self.profile.decode.itl_ms.last().copied().unwrap_or(1.0);
            let cap = self.profile.decode_capacity(top, ctx);
            let base = if y > cap {
                top * y / cap
            } else {
                self.profile.expected_itl(y, ctx)
            };
            self.k_decode * base
        } else {
            1e6
        };
        Metrics {
            rps,
            isl_tokens: isl,
            osl_tokens: osl,
            ttft_ms: Some(ttft),
            itl_ms: Some(itl),
            queue_depth: None,
            decode_requests: None,
        }
    }
}

/// Runs `planner` against `plant` for `loads.len()` intervals; returns the replicas per
/// interval.
fn drive(
    planner: &mut Planner,
    plant: &mut Plant,
    loads: &[(f64, f64, f64)],
) -> Vec<BTreeMap<Role, u32>> {
    let mut out = Vec::new();
    for (i, &(rps, isl, osl)) in loads.iter().enumerate() {
        let replicas = plant.history.last().cloned().unwrap_or_default();
        let obs = Observation {
            at_s: i as f64 * 30.0,
            metrics: Some(plant.metrics(rps, isl, osl)),
            ready: plant.ready(),
            replicas,
        };
        let d = planner.plan(&obs);
        plant.history.push(d.desired.clone());
        out.push(d.desired);
    }
    out
}

fn pd_config(mode: Mode, predictor: PredictorKind) -> PlannerConfig {
    let limits = RoleLimits {
        min_replicas: 1,
        max_replicas: 40,
        gpus_per_replica: 1,
    };
    PlannerConfig {
        mode,
        interval_s: 30.0,
        predictor,
        scale_down_stabilization_s: 120.0,
        min_replica_lifetime_s: 60.0,
        gpu_budget: None,
        roles: [(Role::Prefill, limits), (Role::Decode, limits)].into(),
        slo: slo(),
        profile: Some(profile()),
        move_between_roles: true,
        tuning: Tuning::default(),
    }
}

fn plant(k_prefill: f64, k_decode: f64, startup: usize) -> Plant {
    Plant {
        profile: profile(),
        k_prefill,
        k_decode,
        startup,
        history: vec![[(Role::Prefill, 1), (Role::Decode, 1)].into()],
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// After 300 intervals of a constant load the replicas do not change in the next 100 (the
    /// load model may start far above its need and come down one replica per stabilisation
    /// window).
    #[test]
    fn constant_load_settles_without_oscillation(
        mode in mode(),
        predictor in predictor(),
        rps in 2.0f64..30.0,
        isl in 500.0f64..4000.0,
        osl in 50.0f64..800.0,
        k_prefill in 0.7f64..1.5,
        k_decode in 0.7f64..1.5,
        startup in 0usize..3,
    ) {
        let mut planner = Planner::new(pd_config(mode, predictor)).unwrap();
        let mut plant = plant(k_prefill, k_decode, startup);
        let trace = drive(&mut planner, &mut plant, &vec![(rps, isl, osl); 400]);
        let settled = &trace[300];
        for (i, t) in trace.iter().enumerate().skip(300) {
            prop_assert_eq!(t, settled, "changed at interval {}: {:?}", i, &trace[290..]);
        }
    }

    /// A step up in load: the throughput model (alone or as the floor) follows within one
    /// interval with the constant predictor, three with Holt (α 0.5, β 0.3) or a 3-interval
    /// moving average; the load model within (replicas to add) × (start-up delay + 1) + 2
    /// intervals.
    #[test]
    fn a_load_step_is_followed_within_n_intervals(
        mode in mode(),
        kind in 0usize..3,
        rps in 2.0f64..6.0,
        factor in 2.0f64..4.0,
        isl in 1000.0f64..3000.0,
        osl in 100.0f64..400.0,
    ) {
        let (predictor, n) = match kind {
            0 => (PredictorKind::Constant, 1),
            1 => (PredictorKind::Holt { alpha: 0.5, beta: 0.3 }, 3),
            _ => (PredictorKind::MovingAverage { window: 3 }, 3),
        };
        let startup = 1;
        let mut planner = Planner::new(pd_config(mode, predictor)).unwrap();
        let mut plant = plant(1.0, 1.0, startup);
        let mut loads = vec![(rps, isl, osl); 40];
        loads.extend(vec![(rps * factor, isl, osl); 40]);
        let trace = drive(&mut planner, &mut plant, &loads);
        let before = &trace[39];
        let targets: BTreeMap<Role, (u32, usize)> = match mode {
            // What the throughput model asks for at the new load with exact corrections (the
            // plant's latency is the profile's, so they stay at 1 or above).
            Mode::Throughput | Mode::Both => {
                let p = profile();
                let u = Tuning::default().target_utilisation;
                let load = rps * factor;
                let prefill = load * isl / (p.prefill_capacity(slo().ttft_ms) * u);
                let decode = load * osl / (p.decode_capacity(slo().itl_ms, isl + osl / 2.0) * u);
                let whole = |x: f64| ((x - 1e-9).ceil() as u32).clamp(1, 40);
                [(Role::Prefill, (whole(prefill), n)), (Role::Decode, (whole(decode), n))].into()
            }
            // The fewest replicas that meet the SLO at the new load (the plant is the
            // profile): one replica per interval while the regression sees the need, one per
            // start-up delay + interval while only the observed latency does (a replica still
            // starting is not counted against the SLO), plus two intervals for the overload
            // to show.
            Mode::Load => {
                let load = rps * factor;
                let p = profile();
                let fits = |r: Role, n: u32| {
                    let n = f64::from(n);
                    match r {
                        Role::Prefill => p.expected_ttft(load * isl / n) <= slo().ttft_ms,
                        _ => {
                            let y = load * osl / n;
                            let top = p.decode.itl_ms[p.decode.itl_ms.len() - 1];
                            y <= p.decode_capacity(top, isl + osl / 2.0)
                                && p.expected_itl(y, isl + osl / 2.0) <= slo().itl_ms
                        }
                    }
                };
                [Role::Prefill, Role::Decode]
                    .into_iter()
                    .map(|r| {
                        let need = (1..=40).find(|&n| fits(r, n)).unwrap_or(40);
                        let from = before[&r].min(trace[40][&r]);
                        (r, (need, need.saturating_sub(from) as usize * (startup + 1) + 2))
                    })
                    .collect()
            }
        };
        for (r, &(want, within)) in &targets {
            let reached = (40..80).find(|&i| trace[i][r] >= want);
            prop_assert!(
                reached.is_some_and(|i| i < 40 + within),
                "{mode:?} {predictor:?} {r}: {want} reached at {reached:?}, within {within}: {:?}",
                &trace[38..50]
            );
        }
    }
}

/// The naive model of one role's stabilisation and lifetime: it keeps every recommendation
/// and every change ever made, and decides from the whole history.
#[derive(Default)]
struct Naive {
    recommendations: Vec<(f64, u32)>,
    increases: Vec<f64>,
}

impl Naive {
    fn decide(&mut self, at: f64, current: u32, rec: u32, window: f64, lifetime: f64) -> u32 {
        self.recommendations.push((at, rec));
        if rec >= current {
            return rec;
        }
        if self.increases.iter().any(|&t| at - t < lifetime) {
            return current;
        }
        let highest = self
            .recommendations
            .iter()
            .filter(|&&(t, _)| t >= at - window)
            .map(|&(_, r)| r)
            .max()
            .unwrap_or(rec);
        highest.min(current)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Without a budget, each role's decision is the naive model's answer for the
    /// recommendations the planner reports, in every mode.
    #[test]
    fn stabilisation_and_lifetime_match_the_naive_model(
        mode in mode(),
        window in prop_oneof![Just(0.0), Just(45.0), Just(90.0), Just(300.0)],
        lifetime in prop_oneof![Just(0.0), Just(30.0), Just(100.0)],
        steps in proptest::collection::vec(
            (prop_oneof![Just(15.0), Just(30.0), Just(31.0)], 0.0f64..40.0, 1.0f64..3000.0),
            1..80,
        ),
        follow in proptest::collection::vec(any::<bool>(), 80),
    ) {
        let mut c = pd_config(mode, PredictorKind::Constant);
        c.scale_down_stabilization_s = window;
        c.min_replica_lifetime_s = lifetime;
        let config_roles = c.roles.clone();
        let mut planner = Planner::new(c).unwrap();
        let mut naive: BTreeMap<Role, Naive> =
            [(Role::Prefill, Naive::default()), (Role::Decode, Naive::default())].into();
        let mut current: BTreeMap<Role, u32> = [(Role::Prefill, 1), (Role::Decode, 1)].into();
        let mut at = 0.0;
        for (i, (dt, rps, isl)) in steps.into_iter().enumerate() {
            at += dt;
            let obs = Observation {
                at_s: at,
                // Latencies rising with the load per replica, so the load model has a fit.
                metrics: Some(Metrics {
                    rps,
                    isl_tokens: isl,
                    osl_tokens: 200.0,
                    ttft_ms: Some(100.0 + 0.2 * rps * isl / f64::from(current[&Role::Prefill].max(1))),
                    itl_ms: Some(10.0 + 0.01 * rps * 200.0 / f64::from(current[&Role::Decode].max(1))),
                    queue_depth: None,
                    decode_requests: None,
                }),
                replicas: current.clone(),
                ready: BTreeMap::new(),
            };
            let d = planner.plan(&obs);
            for (role, rd) in &d.roles {
                let model = naive.get_mut(role).unwrap();
                let l = config_roles[role];
                let want = model
                    .decide(at, rd.current, rd.recommended, window, lifetime)
                    .clamp(l.min_replicas, l.max_replicas);
                prop_assert_eq!(rd.desired, want, "{} at {}", role, at);
                if rd.desired > rd.current {
                    model.increases.push(at);
                }
            }
            // Sometimes the controller does not apply the decision (a failed /scale write).
            if follow[i % follow.len()] {
                current = d.desired;
            }
        }
    }
}
