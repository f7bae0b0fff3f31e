//! `PoolAutoscaler` (`kvgate.io/v1alpha1`): kvgate's own CRD, the operator's input. It names an
//! InferencePool, the workloads serving each of its roles (anything with a `/scale`
//! subresource), the latency SLO, the GPU budget and how the planner runs; its status is what
//! the operator observed and decided.
//!
//! ```yaml
//! apiVersion: kvgate.io/v1alpha1
//! kind: PoolAutoscaler
//! metadata: {name: qwen3, namespace: llm}
//! spec:
//!   poolRef: {name: kvgate}
//!   roles:
//!     prefill: {scaleTargetRef: {apiVersion: apps/v1, kind: Deployment, name: qwen3-prefill},
//!               minReplicas: 1, maxReplicas: 8, gpusPerReplica: 1}
//!     decode:  {scaleTargetRef: {apiVersion: apps/v1, kind: Deployment, name: qwen3-decode},
//!               minReplicas: 1, maxReplicas: 8, gpusPerReplica: 1}
//!   slo: {ttftMs: 500, itlMs: 50, percentile: 90}
//!   gpuBudget: 12
//!   planner: {mode: Both, intervalSeconds: 30, predictor: {kind: holt}}
//!   metrics: {source: Epp}
//! ```

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::Condition;

/// The DNS-subdomain pattern of object names.
const NAME_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

/// The autoscaler's desired state.
// Clippy reads the `printcolumn` entries' repeated keys as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvgate.io",
    version = "v1alpha1",
    kind = "PoolAutoscaler",
    plural = "poolautoscalers",
    shortname = "pas",
    namespaced,
    status = "PoolAutoscalerStatus",
    derive = "PartialEq",
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.poolRef.name"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.planner.mode"),
    printcolumn(
        name = "Prefill",
        type_ = "integer",
        json_path = ".status.roles.prefill.desiredReplicas"
    ),
    printcolumn(
        name = "Decode",
        type_ = "integer",
        json_path = ".status.roles.decode.desiredReplicas"
    ),
    printcolumn(
        name = "Both",
        type_ = "integer",
        json_path = ".status.roles.both.desiredReplicas"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.gpuBudget) || self.gpuBudget >= (has(self.roles.both) ? self.roles.both.minReplicas * self.roles.both.gpusPerReplica : 0) + (has(self.roles.prefill) ? self.roles.prefill.minReplicas * self.roles.prefill.gpusPerReplica : 0) + (has(self.roles.decode) ? self.roles.decode.minReplicas * self.roles.decode.gpusPerReplica : 0)",
        "message": "gpuBudget must cover every role's minReplicas × gpusPerReplica"
    },
    {
        "rule": "self.planner.mode == 'Load' || has(self.profile)",
        "message": "the Throughput and Both modes need a profile"
    },
    {
        "rule": "self.metrics.source != 'Prometheus' || has(self.metrics.prometheus)",
        "message": "metrics.prometheus is required when metrics.source is Prometheus"
    }
]))]
pub struct PoolAutoscalerSpec {
    /// The InferencePool whose model servers are scaled (in this namespace).
    pub pool_ref: PoolRef,
    /// The workload serving each role.
    pub roles: Roles,
    /// The latency objective.
    pub slo: Slo,
    /// GPUs the roles may use together; unbounded when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub gpu_budget: Option<i32>,
    /// How the planner runs.
    #[serde(default)]
    pub planner: PlannerSpec,
    /// Where load and latency are read.
    #[serde(default)]
    pub metrics: MetricsSpec,
    /// The performance profile (per-replica throughput), for the Throughput and Both modes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileRef>,
    /// Keep the ConfigMap of prefill endpoints the decode pods' sidecars may call (their
    /// prefill/decode allow-list): the pool's ready prefill pods × target ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefiller_allow_list: Option<AllowListSpec>,
}

/// The InferencePool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolRef {
    /// Its name.
    #[schemars(length(min = 1, max = 253), regex(pattern = NAME_PATTERN))]
    pub name: String,
    /// Its API group: `inference.networking.k8s.io` (the default) or
    /// `inference.networking.x-k8s.io`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<PoolGroup>")]
    pub group: Option<String>,
}

/// The InferencePool API groups (schema only).
#[derive(JsonSchema)]
#[allow(dead_code)]
enum PoolGroup {
    #[serde(rename = "inference.networking.k8s.io")]
    V1,
    #[serde(rename = "inference.networking.x-k8s.io")]
    V1Alpha2,
}

/// The pool's roles: `both` alone, or `prefill` and `decode` together.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "has(self.both) != (has(self.prefill) || has(self.decode))",
        "message": "give roles.both alone, or roles.prefill and roles.decode"
    },
    {
        "rule": "has(self.prefill) == has(self.decode)",
        "message": "roles.prefill and roles.decode come together"
    }
]))]
pub struct Roles {
    /// The prefill workload (`kvgate.io/role: prefill` pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<RoleTarget>,
    /// The decode workload (`kvgate.io/role: decode` pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<RoleTarget>,
    /// The workload of a pool without disaggregation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub both: Option<RoleTarget>,
}

/// One role's workload and its bounds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must not exceed maxReplicas"}
]))]
pub struct RoleTarget {
    /// The workload: any kind with a `/scale` subresource (Deployment, StatefulSet,
    /// LeaderWorkerSet), in this namespace.
    pub scale_target_ref: ScaleTargetRef,
    /// Fewest replicas (1 unless set; the operator never scales below it).
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 10000), extend("default" = 1))]
    pub min_replicas: i32,
    /// Most replicas.
    #[schemars(range(min = 1, max = 10000))]
    pub max_replicas: i32,
    /// GPUs one replica uses (counted against `gpuBudget`).
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1024), extend("default" = 1))]
    pub gpus_per_replica: i32,
}

fn one() -> i32 {
    1
}

/// A scalable workload (`autoscaling/v1` `CrossVersionObjectReference`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleTargetRef {
    /// Its API version, e.g. `apps/v1` or `leaderworkerset.x-k8s.io/v1`.
    #[schemars(length(min = 1, max = 253))]
    pub api_version: String,
    /// Its kind.
    #[schemars(length(min = 1, max = 63))]
    pub kind: String,
    /// Its name.
    #[schemars(length(min = 1, max = 253), regex(pattern = NAME_PATTERN))]
    pub name: String,
}

/// The latency objective: TTFT and inter-token latency at a percentile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Slo {
    /// Time to first token, milliseconds.
    #[schemars(range(min = 1, max = 600000))]
    pub ttft_ms: i32,
    /// Inter-token latency, milliseconds.
    #[schemars(range(min = 1, max = 60000))]
    pub itl_ms: i32,
    /// The percentile both are measured at (e.g. 90, 99).
    #[serde(default = "p90")]
    #[schemars(range(min = 1, max = 100), extend("default" = 90))]
    pub percentile: i32,
}

fn p90() -> i32 {
    90
}

/// How the planner runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannerSpec {
    /// `Throughput` (replicas from the profile and the predicted load), `Load` (±1 replica per
    /// interval from latency under load), or `Both` (load mode above the throughput floor).
    #[serde(default)]
    pub mode: PlannerMode,
    /// Seconds between decisions.
    #[serde(default = "interval_default")]
    #[schemars(range(min = 5, max = 3600), extend("default" = 30))]
    pub interval_seconds: i32,
    /// How the next interval's load is predicted.
    #[serde(default)]
    pub predictor: PredictorSpec,
    /// A scale-down waits until the recommendation has stayed lower for this long.
    #[serde(default = "stabilization_default")]
    #[schemars(range(min = 0, max = 86400), extend("default" = 300))]
    pub scale_down_stabilization_seconds: i32,
    /// A replica lives at least this long before it may be removed.
    #[serde(default = "lifetime_default")]
    #[schemars(range(min = 0, max = 86400), extend("default" = 300))]
    pub min_replica_lifetime_seconds: i32,
    /// When the GPU budget binds, move replicas between prefill and decode in one step.
    #[serde(default = "yes")]
    #[schemars(extend("default" = true))]
    pub move_between_roles: bool,
}

impl Default for PlannerSpec {
    fn default() -> Self {
        Self {
            mode: PlannerMode::default(),
            interval_seconds: interval_default(),
            predictor: PredictorSpec::default(),
            scale_down_stabilization_seconds: stabilization_default(),
            min_replica_lifetime_seconds: lifetime_default(),
            move_between_roles: true,
        }
    }
}

fn interval_default() -> i32 {
    30
}

fn stabilization_default() -> i32 {
    300
}

fn lifetime_default() -> i32 {
    300
}

fn yes() -> bool {
    true
}

/// The planner's mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PlannerMode {
    /// From the profile and the predicted load.
    Throughput,
    /// From latency under load, one replica per interval.
    #[default]
    Load,
    /// Load mode with the throughput mode's answer as a floor.
    Both,
}

/// The load predictor.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PredictorSpec {
    /// `constant` (the last value), `moving-average`, `holt` (level and trend) or `kalman`.
    #[serde(default)]
    pub kind: PredictorKind,
    /// Intervals averaged (`moving-average`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub window: Option<i32>,
    /// Level smoothing, 0–1 (`holt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub alpha: Option<f64>,
    /// Trend smoothing, 0–1 (`holt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub beta: Option<f64>,
    /// Process noise (`kalman`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub process_noise: Option<f64>,
    /// Measurement noise (`kalman`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub measurement_noise: Option<f64>,
}

/// The predictors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PredictorKind {
    /// The last observation.
    Constant,
    /// The mean of the last `window` observations.
    MovingAverage,
    /// Holt's linear trend.
    #[default]
    Holt,
    /// A one-dimensional Kalman filter.
    Kalman,
}

/// Where load and latency are read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSpec {
    /// `Epp`: scrape the pool's EPP replicas (found through the InferencePool's
    /// `endpointPickerRef` Service) on their metrics port; `Prometheus`: query a Prometheus.
    #[serde(default)]
    pub source: MetricsSource,
    /// The EPP Service's port (by name) serving `/metrics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub epp_metrics_port_name: Option<String>,
    /// The Prometheus HTTP API, for `source: Prometheus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<PrometheusSpec>,
}

/// The metrics sources.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MetricsSource {
    /// The EPP replicas' `/metrics`.
    #[default]
    Epp,
    /// A Prometheus HTTP API.
    Prometheus,
}

/// A Prometheus HTTP API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrometheusSpec {
    /// Its base URL, e.g. `http://prometheus.monitoring:9090`.
    #[schemars(length(min = 1), regex(pattern = "^https?://"))]
    pub url: String,
}

/// Where the profile is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileRef {
    /// A ConfigMap in this namespace (made by `kvgate-bench profile`).
    #[schemars(length(min = 1, max = 253), regex(pattern = NAME_PATTERN))]
    pub config_map_name: String,
    /// Its key holding the profile (YAML).
    #[serde(default = "profile_key")]
    #[schemars(length(min = 1, max = 253), extend("default" = "profile.yaml"))]
    pub key: String,
}

fn profile_key() -> String {
    "profile.yaml".into()
}

/// The prefill allow-list ConfigMap the operator keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowListSpec {
    /// The ConfigMap's name (the chart's is `<release>-prefillers`); key `prefillers.yaml`.
    #[schemars(length(min = 1, max = 253), regex(pattern = NAME_PATTERN))]
    pub config_map_name: String,
}

/// What the operator observed and decided.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolAutoscalerStatus {
    /// The generation these fields answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Per role.
    #[serde(default)]
    pub roles: RoleStatuses,
    /// The load and latency last observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedLoad>,
    /// The load predicted for the next interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<ObservedLoad>,
    /// Why the last decision was made (bounded text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_decision: Option<String>,
    /// When it was made (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_decision_time: Option<String>,
    /// GPUs the desired replicas use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<i32>,
    /// `Ready`, `Scaling`, `MetricsAvailable`, `BudgetLimited`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Per-role status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleStatuses {
    /// Prefill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<RoleStatus>,
    /// Decode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<RoleStatus>,
    /// Both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub both: Option<RoleStatus>,
}

/// One role's replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleStatus {
    /// The target's replicas (`/scale` spec).
    #[serde(default)]
    pub current_replicas: i32,
    /// What the planner wants.
    #[serde(default)]
    pub desired_replicas: i32,
    /// When the operator last scaled the target (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<String>,
}

/// Load and latency (observed or predicted).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObservedLoad {
    /// Requests per second.
    pub rps: f64,
    /// Mean input length, tokens.
    pub isl_tokens: f64,
    /// Mean output length, tokens.
    pub osl_tokens: f64,
    /// TTFT at the SLO's percentile, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Inter-token latency at the SLO's percentile, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
}
