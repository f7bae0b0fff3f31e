//! The scheduler's typed configuration (YAML), its defaults and its validation. Every field is
//! documented in the crate README.

use std::fmt;
use std::str::FromStr;

use kv_index::Millis;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The most fallbacks a decision may return (the destination header stays short).
pub const MAX_FALLBACKS: usize = 16;

/// How the primary is chosen among the filtered candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Tier-credited prefix cost plus load, with bounded load and temperature (the default).
    #[default]
    Kv,
    /// The longest GPU-resident prefix; ties by in-flight load. No bounded load.
    PrefixOnly,
    /// The fewest in-flight requests; ties by in-flight blocks.
    LeastLoad,
    /// The candidates in turn.
    RoundRobin,
    /// Uniformly at random.
    Random,
}

impl Policy {
    /// Every policy, for help texts and tests.
    pub const ALL: [Policy; 5] = [
        Policy::Kv,
        Policy::PrefixOnly,
        Policy::LeastLoad,
        Policy::RoundRobin,
        Policy::Random,
    ];

    /// The config spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::PrefixOnly => "prefix-only",
            Policy::LeastLoad => "least-load",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is not one of [`Policy::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "unknown scheduling policy `{0}` (expected kv, prefix-only, least-load, round-robin or random)"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// Weights of the `kv` cost's terms (all in blocks).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    /// Per prompt block left to compute after the cache credit.
    pub overlap: f64,
    /// Per block held by the candidate's decoding requests. Default 0.02, not Dynamo's 1: with
    /// long contexts the in-flight sum (thousands of blocks) swamps the blocks a cache hit saves
    /// (tens to a hundred), and `kv` degenerates into least-load. At 0.02 the term separates
    /// candidates of equal overlap and bounded load caps imbalance; measured with the
    /// discrete-event replay on seed 001's workload and the Mooncake trace
    /// (`docs/benchmarks.md`, "Discrete-event replay").
    pub decode: f64,
    /// Per block queued for prefill on the candidate.
    pub queue: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            overlap: 1.0,
            decode: 0.02,
            queue: 1.0,
        }
    }
}

/// How much a cached block is worth, by the tier it is found in (a GPU hit is worth 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierCredit {
    /// A block in host memory (engine CPU offload or the node's G2).
    pub host: f64,
    /// A block on local disk (G3).
    pub disk: f64,
    /// A block in remote storage (G4).
    pub remote: f64,
}

impl Default for TierCredit {
    fn default() -> Self {
        Self {
            host: 0.75,
            disk: 0.25,
            remote: 0.0,
        }
    }
}

/// The bounded-load rule of the `kv` policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BoundedLoad {
    /// Whether the rule applies.
    pub enabled: bool,
    /// No endpoint is given a request that takes it above `ceil((1 + epsilon) × mean)`
    /// in-flight requests, the mean taken over the candidates with this request counted.
    pub epsilon: f64,
    /// The cap is never below this many in-flight requests (0: the rule as stated). Keeps
    /// concurrent same-prefix requests together while the pool is nearly idle. Default 8: an
    /// engine batches 8 requests at little cost, while a spread request recomputes its prefix;
    /// measured with the discrete-event replay (`docs/benchmarks.md`, "bounded-load floor").
    pub min_cap: u64,
}

impl Default for BoundedLoad {
    fn default() -> Self {
        Self {
            enabled: true,
            epsilon: 0.25,
            min_cap: 8,
        }
    }
}

/// Speculative index entries written on every decision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Speculation {
    /// Whether decisions speculate.
    pub enabled: bool,
    /// How long a speculative entry lives unless the engine's event confirms it.
    pub ttl_ms: u64,
}

impl Default for Speculation {
    fn default() -> Self {
        Self {
            enabled: true,
            ttl_ms: 2_000,
        }
    }
}

/// Approximate mode, for pools whose engines publish no KV events.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Approximate {
    /// Whether decisions feed the approximate tracker (instead of speculating).
    pub enabled: bool,
    /// How long a routed block is assumed cached after its last use.
    pub ttl_ms: u64,
    /// The most blocks assumed cached per endpoint.
    pub capacity_blocks: usize,
}

impl Default for Approximate {
    fn default() -> Self {
        Self {
            enabled: false,
            ttl_ms: 120_000,
            capacity_blocks: 65_536,
        }
    }
}

/// How engine-reported load samples refine the EPP's own accounting.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineLoadConfig {
    /// Samples older than this are ignored.
    pub max_age_ms: u64,
    /// Blocks one engine-reported waiting request is assumed to need (0: ignore `waiting`).
    pub waiting_request_blocks: u32,
    /// The engines' KV cache size in blocks, turning `kv_usage` into blocks (0: ignore it).
    pub kv_capacity_blocks: u64,
}

impl Default for EngineLoadConfig {
    fn default() -> Self {
        Self {
            max_age_ms: 5_000,
            waiting_request_blocks: 32,
            kv_capacity_blocks: 0,
        }
    }
}

/// When a request also gets a prefill endpoint (decode-first P/D).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Disaggregation {
    /// Whether decisions consider a remote prefill at all.
    pub enabled: bool,
    /// The least prompt blocks the chosen decode endpoint must lack.
    pub min_uncached_blocks: u32,
    /// The least prompt length, in tokens.
    pub min_prompt_tokens: u32,
}

impl Default for Disaggregation {
    fn default() -> Self {
        Self {
            enabled: false,
            min_uncached_blocks: 32,
            min_prompt_tokens: 0,
        }
    }
}

/// Everything the scheduler can be told. Every field has a default; unknown fields are errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// The selection policy.
    pub policy: Policy,
    /// How many fallbacks follow the primary (at most [`MAX_FALLBACKS`]).
    pub fallbacks: usize,
    /// `kv` only: 0 picks the lowest cost; above 0 samples a softmax over normalised costs.
    pub temperature: f64,
    /// The `kv` cost's weights.
    pub weights: Weights,
    /// Cache credit per tier.
    pub credit: TierCredit,
    /// The `kv` policy's bounded-load rule.
    pub bounded_load: BoundedLoad,
    /// Speculative index entries.
    pub speculation: Speculation,
    /// Approximate mode.
    pub approximate: Approximate,
    /// Engine-reported load.
    pub engine_load: EngineLoadConfig,
    /// Decode-first P/D.
    pub disaggregation: Disaggregation,
    /// When sheddable requests (objective priority < 0) are refused.
    pub admission: Admission,
}

/// GIE's saturation rule: an endpoint is saturated when its engine reports a queue of at least
/// `queue_depth_threshold` or a KV-cache usage of at least `kv_usage_threshold`; the pool is
/// saturated when every ready endpoint that could take the request is. Sheddable requests
/// (InferenceObjective priority below 0) are refused with 429 while the pool is saturated.
///
/// Unlike GIE, an endpoint without a fresh engine sample counts as *not* saturated: the EPP's
/// own in-flight accounting still steers load, and an EPP without engine metrics must not shed
/// everything.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Admission {
    /// Engine queue length at which an endpoint is saturated.
    pub queue_depth_threshold: u32,
    /// Engine KV-cache usage (0..=1) at which an endpoint is saturated.
    pub kv_usage_threshold: f64,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            queue_depth_threshold: 5,
            kv_usage_threshold: 0.8,
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Kv,
            fallbacks: 3,
            temperature: 0.0,
            weights: Weights::default(),
            credit: TierCredit::default(),
            bounded_load: BoundedLoad::default(),
            speculation: Speculation::default(),
            approximate: Approximate::default(),
            engine_load: EngineLoadConfig::default(),
            disaggregation: Disaggregation::default(),
            admission: Admission::default(),
        }
    }
}

/// A configuration the scheduler cannot use.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The text is not YAML of the config's shape (unknown field, wrong type, bad policy).
    #[error("scheduler config does not parse")]
    Parse(#[source] serde_yaml_ng::Error),
    /// A field's value is outside its range.
    #[error("scheduler config field `{field}` = {value} is out of range: expected {expected}")]
    OutOfRange {
        /// The field's path, e.g. `weights.overlap`.
        field: &'static str,
        /// The value given.
        value: f64,
        /// The accepted range, in words.
        expected: &'static str,
    },
}

impl ConfigError {
    /// A bounded label value for metrics: `parse` or the offending field's path.
    pub const fn metric_label(&self) -> &'static str {
        match self {
            ConfigError::Parse(_) => "parse",
            ConfigError::OutOfRange { field, .. } => field,
        }
    }
}

/// Checks `lo <= value <= hi` (and finiteness) for `field`.
fn check(
    field: &'static str,
    value: f64,
    lo: f64,
    hi: f64,
    expected: &'static str,
) -> Result<(), ConfigError> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value,
            expected,
        })
    }
}

const WEIGHT: &str = "a finite number in 0..=1000000";
const CREDIT: &str = "a finite number in 0..=1";
const TTL: &str = "1..=86400000 milliseconds";

impl SchedulerConfig {
    /// Parses and validates a YAML document (an empty document is the default config).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = if text.trim().is_empty() {
            Self::default()
        } else {
            serde_yaml_ng::from_str(text).map_err(ConfigError::Parse)?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks every field's range; the error names the first offending field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let day = 86_400_000.0;
        check(
            "fallbacks",
            self.fallbacks as f64,
            0.0,
            MAX_FALLBACKS as f64,
            "0..=16",
        )?;
        check(
            "temperature",
            self.temperature,
            0.0,
            100.0,
            "a finite number in 0..=100",
        )?;
        check("weights.overlap", self.weights.overlap, 0.0, 1e6, WEIGHT)?;
        check("weights.decode", self.weights.decode, 0.0, 1e6, WEIGHT)?;
        check("weights.queue", self.weights.queue, 0.0, 1e6, WEIGHT)?;
        check("credit.host", self.credit.host, 0.0, 1.0, CREDIT)?;
        check("credit.disk", self.credit.disk, 0.0, 1.0, CREDIT)?;
        check("credit.remote", self.credit.remote, 0.0, 1.0, CREDIT)?;
        check(
            "bounded_load.epsilon",
            self.bounded_load.epsilon,
            0.0,
            100.0,
            "a finite number in 0..=100",
        )?;
        check(
            "speculation.ttl_ms",
            self.speculation.ttl_ms as f64,
            1.0,
            day,
            TTL,
        )?;
        check(
            "approximate.ttl_ms",
            self.approximate.ttl_ms as f64,
            1.0,
            day,
            TTL,
        )?;
        check(
            "approximate.capacity_blocks",
            self.approximate.capacity_blocks as f64,
            1.0,
            f64::MAX,
            "at least 1",
        )?;
        check(
            "engine_load.max_age_ms",
            self.engine_load.max_age_ms as f64,
            1.0,
            day,
            TTL,
        )?;
        check(
            "disaggregation.min_uncached_blocks",
            f64::from(self.disaggregation.min_uncached_blocks),
            1.0,
            f64::MAX,
            "at least 1",
        )?;
        check(
            "admission.kv_usage_threshold",
            self.admission.kv_usage_threshold,
            0.0,
            1.0,
            "a fraction in 0..=1",
        )?;
        Ok(())
    }

    /// [`Speculation::ttl_ms`] as [`Millis`].
    pub const fn speculation_ttl(&self) -> Millis {
        Millis(self.speculation.ttl_ms)
    }

    /// [`EngineLoadConfig::max_age_ms`] as [`Millis`].
    pub const fn engine_load_max_age(&self) -> Millis {
        Millis(self.engine_load.max_age_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_an_empty_document_is_the_default() {
        SchedulerConfig::default().validate().unwrap();
        assert_eq!(
            SchedulerConfig::from_yaml("").unwrap(),
            SchedulerConfig::default()
        );
        assert_eq!(
            SchedulerConfig::from_yaml("{}\n").unwrap(),
            SchedulerConfig::default()
        );
    }

    #[test]
    fn parses_every_section() {
        let c = SchedulerConfig::from_yaml(
            "policy: prefix-only\nfallbacks: 5\ntemperature: 0.5\n\
             weights: {overlap: 2, decode: 0.5, queue: 3}\n\
             credit: {host: 0.5, disk: 0.1, remote: 0.05}\n\
             bounded_load: {enabled: false, epsilon: 1, min_cap: 4}\n\
             speculation: {enabled: false, ttl_ms: 500}\n\
             approximate: {enabled: true, ttl_ms: 1000, capacity_blocks: 10}\n\
             engine_load: {max_age_ms: 100, waiting_request_blocks: 0, kv_capacity_blocks: 4096}\n\
             disaggregation: {enabled: true, min_uncached_blocks: 8, min_prompt_tokens: 256}\n",
        )
        .unwrap();
        assert_eq!(c.policy, Policy::PrefixOnly);
        assert_eq!(c.fallbacks, 5);
        assert_eq!(c.weights.queue, 3.0);
        assert_eq!(c.credit.remote, 0.05);
        assert!(!c.bounded_load.enabled && !c.speculation.enabled && c.approximate.enabled);
        assert_eq!(c.engine_load.kv_capacity_blocks, 4096);
        assert_eq!(c.disaggregation.min_prompt_tokens, 256);
        // Partial sections keep the other fields' defaults.
        let c = SchedulerConfig::from_yaml("weights: {decode: 2}").unwrap();
        assert_eq!(c.weights.overlap, 1.0);
        assert_eq!(c.weights.decode, 2.0);
        // And it round-trips.
        let again = SchedulerConfig::from_yaml(&serde_yaml_ng::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn unknown_fields_and_policies_are_rejected() {
        for bad in [
            "polcy: kv",
            "weights: {overlap: 1, prefill: 2}",
            "policy: best",
            "bounded_load: {eps: 1}",
            "fallbacks: -1",
        ] {
            let err = SchedulerConfig::from_yaml(bad).unwrap_err();
            assert!(matches!(err, ConfigError::Parse(_)), "{bad}: {err}");
            assert_eq!(err.metric_label(), "parse");
        }
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        for (yaml, field) in [
            ("fallbacks: 17", "fallbacks"),
            ("temperature: -0.1", "temperature"),
            ("temperature: .nan", "temperature"),
            ("weights: {overlap: .inf}", "weights.overlap"),
            ("weights: {queue: -1}", "weights.queue"),
            ("credit: {host: 1.5}", "credit.host"),
            ("credit: {disk: -0.25}", "credit.disk"),
            ("bounded_load: {epsilon: -1}", "bounded_load.epsilon"),
            ("speculation: {ttl_ms: 0}", "speculation.ttl_ms"),
            (
                "approximate: {capacity_blocks: 0}",
                "approximate.capacity_blocks",
            ),
            ("engine_load: {max_age_ms: 0}", "engine_load.max_age_ms"),
            (
                "disaggregation: {min_uncached_blocks: 0}",
                "disaggregation.min_uncached_blocks",
            ),
        ] {
            let err = SchedulerConfig::from_yaml(yaml).unwrap_err();
            assert_eq!(err.metric_label(), field, "{yaml}");
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    #[test]
    fn policies_round_trip_through_their_names() {
        for p in Policy::ALL {
            assert_eq!(p.as_str().parse::<Policy>().unwrap(), p);
            assert_eq!(p.to_string(), p.as_str());
        }
        assert!("lru".parse::<Policy>().is_err());
    }
}
