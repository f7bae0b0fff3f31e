//! A model of the peer routers' cache-aware policy, so the replay can compare kvgate with it
//! on traces the live stack cannot run on this machine (the Mooncake hour on 16 engines).
//!
//! SGLang's router, its successor smg, and vLLM's router (a fork of SGLang's) share one
//! cache-aware algorithm (facts in `../shared/reference/dynamo_sglang.md` §4.2, from the
//! routers' sources and docs; no code was taken from them):
//!
//! - an *approximate* prefix tree per worker, filled from the router's own decisions: every
//!   routed prompt is inserted under the chosen worker, whatever the branch that chose it; the
//!   engines' evictions are never seen;
//! - load is the router's count of its own in-flight requests per worker;
//! - *imbalanced* ⇔ `max − min > balance_abs_threshold` **and** `max > balance_rel_threshold ·
//!   min`: then the least-loaded worker wins;
//! - otherwise `match_rate = matched / prompt length` against the best-matching worker; above
//!   `cache_threshold` that worker wins, else the least-loaded one (smg's documented choice).
//!
//! Modelling choices, each one stated so a reader can weigh the comparison:
//! - the tree is over the replay's block keys (a prompt's prefix in whole blocks), where the
//!   routers' HTTP mode matches raw characters: a match is rounded down to a block;
//! - among equally long matches, and among equally loaded workers, the lowest index wins
//!   (the routers take the first of an iteration order that is not specified);
//! - no tree eviction: smg evicts least-recently-used leaves only once a worker's tree passes
//!   `max_tree_size` (2^26 characters); the Mooncake hour inserts ~150 M tokens over 16
//!   workers, below that bound per worker at any characters-per-token ratio above ~0.2;
//! - defaults are smg's CLI defaults: threshold 0.3, absolute 64, relative 1.5.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use kv_events::key::BlockKey;
use scheduler::{Policy, UnknownPolicy};

/// What places a replay's requests: one of the EPP's policies, or the peer routers' model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayPolicy {
    /// The EPP's scheduler with this policy.
    Epp(Policy),
    /// The cache-aware model of SGLang's router, smg and vLLM's router ([`CacheAware`]).
    CacheAware,
}

impl ReplayPolicy {
    /// The model's name on the command line and in records.
    pub const CACHE_AWARE: &'static str = "sglang-cache-aware";
}

impl fmt::Display for ReplayPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayPolicy::Epp(p) => p.fmt(f),
            ReplayPolicy::CacheAware => f.write_str(Self::CACHE_AWARE),
        }
    }
}

impl FromStr for ReplayPolicy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == Self::CACHE_AWARE {
            Ok(ReplayPolicy::CacheAware)
        } else {
            s.parse().map(ReplayPolicy::Epp)
        }
    }
}

/// The cache-aware policy's thresholds (smg's CLI defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// Least match rate (matched / prompt, exclusive) that routes to the best-matching worker.
    pub cache_threshold: f64,
    /// Imbalance needs `max − min` in-flight requests above this.
    pub balance_abs_threshold: u64,
    /// … and `max` above this multiple of `min`.
    pub balance_rel_threshold: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
        }
    }
}

/// Which branch of the policy chose a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheAwareBranch {
    /// Loads were imbalanced: the least-loaded worker.
    Imbalanced,
    /// The best match was above the threshold.
    Match,
    /// No match above the threshold: the least-loaded worker.
    LowMatch,
}

impl CacheAwareBranch {
    /// The label the replay's notes count decisions under.
    pub const fn as_str(self) -> &'static str {
        match self {
            CacheAwareBranch::Imbalanced => "imbalanced",
            CacheAwareBranch::Match => "cache-match",
            CacheAwareBranch::LowMatch => "low-match",
        }
    }
}

/// One decision of the cache-aware model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheAwarePick {
    /// The chosen worker's index.
    pub worker: usize,
    /// Blocks of the prompt the chosen worker's approximate tree held (what the router
    /// believed; the engine may have evicted them).
    pub matched_blocks: u32,
    /// Why.
    pub branch: CacheAwareBranch,
}

/// The approximate trees of `workers` workers and the policy over them. Pure: the caller
/// supplies each decision's in-flight loads.
#[derive(Debug, Clone)]
pub struct CacheAware {
    config: CacheAwareConfig,
    workers: usize,
    /// Block key → bit set of the workers whose tree holds it (`words` words per key).
    holders: HashMap<u64, Box<[u64]>>,
    words: usize,
    /// Scratch: the workers still matching during a walk.
    alive: Vec<u64>,
    next: Vec<u64>,
}

impl CacheAware {
    /// An empty model over `workers` workers (at least one).
    pub fn new(workers: usize, config: CacheAwareConfig) -> Self {
        let workers = workers.max(1);
        let words = workers.div_ceil(64);
        Self {
            config,
            workers,
            holders: HashMap::new(),
            words,
            alive: vec![0; words],
            next: vec![0; words],
        }
    }

    /// The longest prefix of `keys` (in blocks) some worker's tree holds, and the lowest-index
    /// worker holding it (`None` when no worker holds `keys[0]`).
    pub fn best_match(&mut self, keys: &[BlockKey]) -> (u32, Option<usize>) {
        self.alive.fill(u64::MAX);
        let mut matched = 0u32;
        for key in keys {
            let Some(set) = self.holders.get(&key.0) else {
                break;
            };
            let mut any = false;
            for ((n, a), s) in self.next.iter_mut().zip(&self.alive).zip(set.iter()) {
                *n = a & s;
                any |= *n != 0;
            }
            if !any {
                break;
            }
            std::mem::swap(&mut self.alive, &mut self.next);
            matched += 1;
        }
        if matched == 0 {
            return (0, None);
        }
        let first = self
            .alive
            .iter()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| i * 64 + w.trailing_zeros() as usize);
        (matched, first)
    }

    /// Chooses a worker for a prompt of `keys` (`prompt_tokens` tokens), given every worker's
    /// in-flight requests, and inserts the prompt into the chosen worker's tree.
    pub fn pick(&mut self, keys: &[BlockKey], prompt_tokens: u32, loads: &[u64]) -> CacheAwarePick {
        let load = |i: usize| loads.get(i).copied().unwrap_or(0);
        let least = (0..self.workers).min_by_key(|&i| load(i)).unwrap_or(0);
        let max = (0..self.workers).map(load).max().unwrap_or(0);
        let min = load(least);
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max as f64 > self.config.balance_rel_threshold * min as f64;
        let (blocks, best) = self.best_match(keys);
        let block_tokens = if keys.is_empty() {
            0
        } else {
            prompt_tokens.div_ceil(u32::try_from(keys.len()).unwrap_or(u32::MAX))
        };
        let rate = if prompt_tokens == 0 {
            0.0
        } else {
            (f64::from(blocks) * f64::from(block_tokens)).min(f64::from(prompt_tokens))
                / f64::from(prompt_tokens)
        };
        let (worker, branch) = match best {
            _ if imbalanced => (least, CacheAwareBranch::Imbalanced),
            Some(w) if rate > self.config.cache_threshold => (w, CacheAwareBranch::Match),
            _ => (least, CacheAwareBranch::LowMatch),
        };
        let matched_blocks = self.held_prefix(keys, worker);
        self.insert(keys, worker);
        CacheAwarePick {
            worker,
            matched_blocks,
            branch,
        }
    }

    /// Adds `keys` to `worker`'s tree.
    pub fn insert(&mut self, keys: &[BlockKey], worker: usize) {
        if worker >= self.workers {
            return;
        }
        let words = self.words;
        for key in keys {
            let set = self
                .holders
                .entry(key.0)
                .or_insert_with(|| vec![0; words].into_boxed_slice());
            if let Some(w) = set.get_mut(worker / 64) {
                *w |= 1 << (worker % 64);
            }
        }
    }

    /// How many leading blocks of `keys` `worker`'s tree holds.
    pub fn held_prefix(&self, keys: &[BlockKey], worker: usize) -> u32 {
        let mut n = 0;
        for key in keys {
            let held = self
                .holders
                .get(&key.0)
                .and_then(|s| s.get(worker / 64))
                .is_some_and(|w| w & (1 << (worker % 64)) != 0);
            if !held {
                break;
            }
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use proptest::prelude::*;

    use super::*;

    /// The naive model: each worker's inserted prompts as a list, matched by a linear scan.
    #[derive(Default)]
    struct Naive {
        prompts: Vec<Vec<Vec<BlockKey>>>,
    }

    impl Naive {
        fn held(&self, keys: &[BlockKey], w: usize) -> u32 {
            // A key chain is a prefix path: key i held means the worker saw a prompt whose
            // i-th key is it (keys are chained, so equal keys imply equal prefixes).
            let mut n = 0;
            for (i, k) in keys.iter().enumerate() {
                let seen = self.prompts[w].iter().any(|p| p.get(i) == Some(k));
                if !seen {
                    break;
                }
                n += 1;
            }
            n
        }
    }

    /// Chained keys: key i depends on every token block before it, as the EPP's keys do.
    fn chain(blocks: &[u8]) -> Vec<BlockKey> {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        blocks
            .iter()
            .map(|b| {
                h = (h ^ u64::from(*b)).wrapping_mul(0x1000_0000_01b3);
                BlockKey(h)
            })
            .collect()
    }

    #[test]
    fn imbalance_beats_a_perfect_match() {
        let mut m = CacheAware::new(2, CacheAwareConfig::default());
        let keys = chain(&[1, 2, 3, 4]);
        m.insert(&keys, 0);
        // Worker 0 holds everything but has 100 requests; worker 1 has 10.
        let p = m.pick(&keys, 64, &[100, 10]);
        assert_eq!((p.worker, p.branch), (1, CacheAwareBranch::Imbalanced));
        // Both thresholds are needed: 100 vs 40 is 60 apart (≤ 64).
        let p = m.pick(&keys, 64, &[100, 40]);
        assert_eq!((p.worker, p.branch), (0, CacheAwareBranch::Match));
    }

    #[test]
    fn a_low_match_goes_to_the_least_loaded_worker() {
        let mut m = CacheAware::new(3, CacheAwareConfig::default());
        let long = chain(&[9, 1, 2, 3, 4, 5, 6, 7, 8, 10]);
        m.insert(&long[..1], 0);
        // 1 of 10 blocks matched (0.1 ≤ 0.3): least loaded, worker 2.
        let p = m.pick(&long, 160, &[4, 3, 1]);
        assert_eq!((p.worker, p.branch), (2, CacheAwareBranch::LowMatch));
        // The prompt is now in worker 2's tree, whatever the branch.
        assert_eq!(m.held_prefix(&long, 2), 10);
        let p = m.pick(&long, 160, &[0, 3, 5]);
        assert_eq!(
            (p.worker, p.branch, p.matched_blocks),
            (2, CacheAwareBranch::Match, 10)
        );
    }

    proptest! {
        #[test]
        fn matches_equal_a_linear_scan(
            ops in prop::collection::vec(
                (0usize..5, prop::collection::vec(0u8..3, 0..8)), 1..60),
        ) {
            let workers = 5;
            let mut m = CacheAware::new(workers, CacheAwareConfig::default());
            let mut naive = Naive { prompts: vec![Vec::new(); workers] };
            for (w, blocks) in ops {
                let keys = chain(&blocks);
                let want: Vec<u32> = (0..workers).map(|i| naive.held(&keys, i)).collect();
                for (i, n) in want.iter().enumerate() {
                    prop_assert_eq!(m.held_prefix(&keys, i), *n);
                }
                let best = want.iter().copied().max().unwrap();
                let (got, first) = m.best_match(&keys);
                prop_assert_eq!(got, best);
                let want_first = (best > 0).then(|| want.iter().position(|n| *n == best).unwrap());
                prop_assert_eq!(first, want_first);
                m.insert(&keys, w);
                naive.prompts[w].push(keys);
            }
        }
    }
}
