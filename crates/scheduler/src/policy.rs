//! Ranking the filtered candidates under each policy: a cost per candidate, the bounded-load
//! rule (`kv`), the primary (argmin or softmax sample) and the rank order the fallbacks follow.

use std::cmp::Ordering;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use kv_events::Tier;
use kv_index::{EndpointId, Overlap};

use crate::config::{BoundedLoad, Policy, SchedulerConfig};
use crate::cost::{EffectiveLoad, kv_cost, snap};
use crate::decision::Reason;
use crate::rng::SeededRng;

/// A filtered candidate with what the policies read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Candidate {
    pub(crate) id: EndpointId,
    pub(crate) load: EffectiveLoad,
    pub(crate) overlap: Option<Overlap>,
    /// The tier-credited hit (0 when not looked up).
    pub(crate) credit: f64,
    /// This decision's random tie-break key.
    pub(crate) tie: u64,
}

/// One candidate's place in the ranking.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    /// Index into the candidates.
    pub(crate) index: usize,
    pub(crate) cost: f64,
    pub(crate) over_cap: bool,
    tie: u64,
}

impl Row {
    /// Rank order: under the cap first, then cost, then the random tie-break.
    fn rank(&self, other: &Self) -> Ordering {
        self.over_cap
            .cmp(&other.over_cap)
            .then(self.cost.total_cmp(&other.cost))
            .then(self.tie.cmp(&other.tie))
    }
}

/// The outcome of ranking.
#[derive(Debug)]
pub(crate) struct Ranking {
    /// Every candidate, in rank order.
    pub(crate) rows: Vec<Row>,
    /// The primary's position in `rows`.
    pub(crate) primary: usize,
    pub(crate) reason: Reason,
}

/// The most in-flight requests a candidate may reach by taking this request:
/// `max(ceil((1 + ε) × (Σ requests + 1) / n), min_cap)`. The least loaded candidate is always
/// under it (`min + 1 ≤ ⌊Σ/n⌋ + 1 ≤ ⌈(Σ+1)/n⌉`), so the rule never empties the candidate set.
pub(crate) fn load_cap(total_requests: u64, candidates: usize, rule: &BoundedLoad) -> u64 {
    let mean = (total_requests as f64 + 1.0) / candidates.max(1) as f64;
    // The small slack keeps an exact integer product from rounding up past itself.
    let cap = (((1.0 + rule.epsilon) * mean) - 1e-9).ceil().max(1.0) as u64;
    cap.max(rule.min_cap)
}

fn over_cap(cands: &[Candidate], rule: &BoundedLoad) -> impl Fn(&Candidate) -> bool {
    let cap = rule.enabled.then(|| {
        let total = cands.iter().map(|c| c.load.requests).sum();
        load_cap(total, cands.len(), rule)
    });
    move |c| cap.is_some_and(|cap| c.load.requests.saturating_add(1) > cap)
}

/// Sorts rows built from `cost` (and `over`) into rank order.
fn rows(
    cands: &[Candidate],
    cost: impl Fn(usize, &Candidate) -> f64,
    over: impl Fn(&Candidate) -> bool,
) -> Vec<Row> {
    let mut rows: Vec<Row> = cands
        .iter()
        .enumerate()
        .map(|(index, c)| Row {
            index,
            cost: cost(index, c),
            over_cap: over(c),
            tie: c.tie,
        })
        .collect();
    rows.sort_unstable_by(Row::rank);
    rows
}

/// A fraction in `[0, 1)` growing with `x`: breaks ties of an integer cost by a second figure.
fn fraction(x: u64) -> f64 {
    let x = x as f64;
    x / (x + 1.0)
}

/// Ranks `cands` (non-empty) under `config.policy`.
pub(crate) fn rank(
    cands: &[Candidate],
    prompt_blocks: u32,
    config: &SchedulerConfig,
    rng: &SeededRng,
    turn: &AtomicU64,
) -> Ranking {
    let first = |rows: Vec<Row>, reason: Reason| Ranking {
        rows,
        primary: 0,
        reason,
    };
    match config.policy {
        Policy::Kv => kv(cands, prompt_blocks, config, rng),
        Policy::PrefixOnly => {
            let gpu = |c: &Candidate| c.overlap.map_or(0, |o| o.reach(Tier::Gpu));
            let rows = rows(
                cands,
                |_, c| snap(fraction(c.load.requests) - f64::from(gpu(c))),
                |_| false,
            );
            let hit = rows
                .first()
                .and_then(|r| cands.get(r.index))
                .is_some_and(|c| gpu(c) > 0);
            first(
                rows,
                if hit {
                    Reason::PrefixHit
                } else {
                    Reason::PrefixMiss
                },
            )
        }
        Policy::LeastLoad => {
            let rows = rows(
                cands,
                |_, c| snap(c.load.requests as f64 + fraction(c.load.blocks())),
                |_| false,
            );
            first(rows, Reason::LeastLoad)
        }
        Policy::RoundRobin => {
            let n = cands.len().max(1) as u64;
            let start = turn.fetch_add(1, AtomicOrdering::Relaxed) % n;
            let distance = |i: usize, _: &Candidate| ((i as u64 + n - start) % n) as f64;
            first(rows(cands, distance, |_| false), Reason::RoundRobin)
        }
        Policy::Random => {
            // The tie keys are this decision's random permutation.
            let mut rows = rows(cands, |_, _| 0.0, |_| false);
            for (rank, r) in rows.iter_mut().enumerate() {
                r.cost = rank as f64;
            }
            first(rows, Reason::Random)
        }
    }
}

fn kv(
    cands: &[Candidate],
    prompt_blocks: u32,
    config: &SchedulerConfig,
    rng: &SeededRng,
) -> Ranking {
    let rows = rows(
        cands,
        |_, c| kv_cost(prompt_blocks, c.credit, &c.load, &config.weights),
        over_cap(cands, &config.bounded_load),
    );
    // Rows under the cap come first; at least the least loaded candidate is under it.
    let eligible = rows.iter().take_while(|r| !r.over_cap).count().max(1);
    let primary = if config.temperature > 0.0 {
        sample(
            rows.get(..eligible).unwrap_or(&rows),
            config.temperature,
            rng.next_u64(),
        )
    } else {
        0
    };
    let overridden = rows
        .iter()
        .min_by(|a, b| a.cost.total_cmp(&b.cost).then(a.tie.cmp(&b.tie)))
        .is_some_and(|best| best.over_cap);
    let credited = rows
        .get(primary)
        .and_then(|r| cands.get(r.index))
        .is_some_and(|c| c.credit > 0.0);
    let reason = if overridden {
        Reason::BoundedLoadOverride
    } else if primary != 0 {
        Reason::Sampled
    } else if credited {
        Reason::KvHit
    } else {
        Reason::Load
    };
    Ranking {
        rows,
        primary,
        reason,
    }
}

/// Samples a position in `rows` (sorted by cost, non-empty) with probability proportional to
/// `exp(−(c − c_min) / ((c_max − c_min) · T))`: costs min-max normalised to 0..=1, so the
/// temperature means the same whatever the costs' scale. Equal costs: uniform.
fn sample(rows: &[Row], temperature: f64, bits: u64) -> usize {
    let (Some(lo), Some(hi)) = (rows.first(), rows.last()) else {
        return 0;
    };
    let span = hi.cost - lo.cost;
    if span <= 0.0 {
        return SeededRng::below(bits, rows.len());
    }
    let weight = |r: &Row| (-(r.cost - lo.cost) / (span * temperature)).exp();
    let total: f64 = rows.iter().map(weight).sum();
    let mut target = SeededRng::unit(bits) * total;
    for (i, r) in rows.iter().enumerate() {
        target -= weight(r);
        if target < 0.0 {
            return i;
        }
    }
    rows.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::tie_key;

    fn cand(i: u32, requests: u64, credit: f64, salt: u64) -> Candidate {
        Candidate {
            id: EndpointId::new(i).unwrap(),
            load: EffectiveLoad {
                requests,
                prefill_blocks: 0,
                decode_blocks: 0,
            },
            overlap: None,
            credit,
            tie: tie_key(salt, i),
        }
    }

    fn ids(r: &Ranking, cands: &[Candidate]) -> Vec<u32> {
        r.rows.iter().map(|row| cands[row.index].id.get()).collect()
    }

    fn primary(r: &Ranking, cands: &[Candidate]) -> u32 {
        cands[r.rows[r.primary].index].id.get()
    }

    #[test]
    fn the_cap_admits_the_least_loaded() {
        let rule = |epsilon, min_cap| BoundedLoad {
            enabled: true,
            epsilon,
            min_cap,
        };
        assert_eq!(load_cap(0, 64, &rule(0.25, 0)), 1);
        assert_eq!(load_cap(0, 1, &rule(0.25, 0)), 2);
        assert_eq!(load_cap(3, 4, &rule(0.0, 0)), 1);
        assert_eq!(load_cap(7, 4, &rule(0.25, 0)), 3);
        // ε = 1, mean after (15 + 1) / 4 = 4 → cap exactly 8 (not 9 through rounding).
        assert_eq!(load_cap(15, 4, &rule(1.0, 0)), 8);
        // The floor applies only while the proportional cap is below it.
        assert_eq!(load_cap(3, 8, &rule(0.25, 4)), 4);
        assert_eq!(load_cap(63, 8, &rule(0.25, 4)), 10);
        for total in 0..200u64 {
            for n in 1..9usize {
                for eps in [0.0, 0.1, 0.25, 2.0] {
                    let min = total / n as u64;
                    assert!(min < load_cap(total, n, &rule(eps, 0)), "{total} {n} {eps}");
                }
            }
        }
    }

    #[test]
    fn kv_prefers_the_cached_candidate_and_breaks_ties_at_random() {
        let config = SchedulerConfig::default();
        let rng = SeededRng::new(1);
        let cands = [cand(0, 0, 0.0, 5), cand(1, 0, 8.0, 5), cand(2, 0, 3.0, 5)];
        let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
        assert_eq!(ids(&r, &cands), vec![1, 2, 0]);
        assert_eq!(primary(&r, &cands), 1);
        assert_eq!(r.reason, Reason::KvHit);
        // Cold and idle everywhere: every candidate wins some draws.
        let mut wins = [0u32; 3];
        for salt in 0..300 {
            let cands = [
                cand(0, 0, 0.0, salt),
                cand(1, 0, 0.0, salt),
                cand(2, 0, 0.0, salt),
            ];
            let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
            assert_eq!(r.reason, Reason::Load);
            wins[primary(&r, &cands) as usize] += 1;
        }
        assert!(wins.iter().all(|&w| w > 60), "{wins:?}");
    }

    #[test]
    fn bounded_load_overrides_a_hot_candidate() {
        // The rule as stated, without the default floor of 8.
        let mut config = SchedulerConfig::default();
        config.bounded_load.min_cap = 0;
        let rng = SeededRng::new(1);
        // Candidate 0 holds the whole prompt but already has 4 requests; mean after = 5/4.
        let mut cands = [
            cand(0, 4, 10.0, 1),
            cand(1, 0, 0.0, 1),
            cand(2, 1, 0.0, 1),
            cand(3, 0, 0.0, 1),
        ];
        cands[2].load.decode_blocks = 5;
        let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
        assert_eq!(r.reason, Reason::BoundedLoadOverride);
        assert!(matches!(primary(&r, &cands), 1 | 3));
        // Over-cap candidates rank after the rest, even with a lower cost.
        assert_eq!(ids(&r, &cands)[2..], [2, 0]);
        assert!(r.rows[3].over_cap && !r.rows[0].over_cap);
        // Without the rule the hot candidate wins.
        let mut off = config.clone();
        off.bounded_load.enabled = false;
        let r = rank(&cands, 10, &off, &rng, &AtomicU64::new(0));
        assert_eq!(primary(&r, &cands), 0);
        assert_eq!(r.reason, Reason::KvHit);
    }

    #[test]
    fn temperature_samples_by_normalised_cost() {
        let config = SchedulerConfig {
            temperature: 0.5,
            ..SchedulerConfig::default()
        };
        let rng = SeededRng::new(9);
        let cands = [cand(0, 0, 10.0, 3), cand(1, 0, 5.0, 3), cand(2, 0, 0.0, 3)];
        let mut wins = [0u32; 3];
        for _ in 0..3000 {
            let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
            let p = primary(&r, &cands);
            if p != 0 {
                assert_eq!(r.reason, Reason::Sampled);
            }
            wins[p as usize] += 1;
        }
        // Weights exp(0), exp(-1), exp(-2) over T = 0.5 normalisation: ≈ 0.665, 0.245, 0.090.
        assert!((1850..2150).contains(&wins[0]), "{wins:?}");
        assert!((600..870).contains(&wins[1]), "{wins:?}");
        assert!((180..370).contains(&wins[2]), "{wins:?}");
    }

    #[test]
    fn prefix_only_takes_the_longest_gpu_prefix_then_the_least_loaded() {
        let config = SchedulerConfig {
            policy: Policy::PrefixOnly,
            ..SchedulerConfig::default()
        };
        let rng = SeededRng::new(1);
        let with = |i, requests, gpu| {
            let mut c = cand(i, requests, 0.0, 7);
            c.overlap = Some(Overlap::new(c.id, [gpu, gpu, gpu, gpu]));
            c
        };
        let cands = [with(0, 0, 2), with(1, 9, 6), with(2, 3, 6)];
        let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
        assert_eq!(ids(&r, &cands), vec![2, 1, 0]);
        assert_eq!(r.reason, Reason::PrefixHit);
        let cands = [with(0, 5, 0), with(1, 2, 0)];
        let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
        assert_eq!(ids(&r, &cands), vec![1, 0]);
        assert_eq!(r.reason, Reason::PrefixMiss);
    }

    #[test]
    fn least_load_counts_requests_then_blocks() {
        let config = SchedulerConfig {
            policy: Policy::LeastLoad,
            ..SchedulerConfig::default()
        };
        let rng = SeededRng::new(1);
        let mut cands = [cand(0, 2, 9.0, 1), cand(1, 1, 0.0, 1), cand(2, 1, 0.0, 1)];
        cands[1].load.decode_blocks = 50;
        cands[2].load.decode_blocks = 10;
        let r = rank(&cands, 10, &config, &rng, &AtomicU64::new(0));
        assert_eq!(ids(&r, &cands), vec![2, 1, 0]);
        assert_eq!(r.reason, Reason::LeastLoad);
    }

    #[test]
    fn round_robin_takes_turns_and_falls_back_in_turn_order() {
        let config = SchedulerConfig {
            policy: Policy::RoundRobin,
            ..SchedulerConfig::default()
        };
        let rng = SeededRng::new(1);
        let turn = AtomicU64::new(0);
        let cands = [cand(0, 0, 0.0, 1), cand(1, 0, 0.0, 2), cand(2, 0, 0.0, 3)];
        let order: Vec<Vec<u32>> = (0..4)
            .map(|_| ids(&rank(&cands, 1, &config, &rng, &turn), &cands))
            .collect();
        assert_eq!(
            order,
            vec![vec![0, 1, 2], vec![1, 2, 0], vec![2, 0, 1], vec![0, 1, 2]]
        );
    }

    #[test]
    fn random_is_a_uniform_permutation() {
        let config = SchedulerConfig {
            policy: Policy::Random,
            ..SchedulerConfig::default()
        };
        let rng = SeededRng::new(1);
        let mut wins = [0u32; 4];
        for salt in 0..4000 {
            let cands: Vec<_> = (0..4).map(|i| cand(i, 0, 0.0, salt)).collect();
            let r = rank(&cands, 1, &config, &rng, &AtomicU64::new(0));
            assert_eq!(r.reason, Reason::Random);
            let costs: Vec<f64> = r.rows.iter().map(|r| r.cost).collect();
            assert_eq!(costs, vec![0.0, 1.0, 2.0, 3.0]);
            wins[primary(&r, &cands) as usize] += 1;
        }
        assert!(wins.iter().all(|&w| (850..1150).contains(&w)), "{wins:?}");
    }
}
