//! The InferenceObjective: a named per-request priority in a pool. A request names its
//! objective in the header `x-gateway-inference-objective` (llm-d's spelling:
//! `x-llm-d-inference-objective`); higher priority is more important, negative priorities are
//! sheddable, and an unset priority is 0.
//!
//! The same spec lives in two groups: [`llm_d`] (`llm-d.ai/v1alpha2`, where the API moved) and
//! [`x_k8s`] (`inference.networking.x-k8s.io/v1alpha2`, GIE's release line up to v1.5).
//! [`ObjectiveView`] is the version-independent view.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::{Condition, GROUP_PATTERN, KIND_PATTERN};

pub mod llm_d;
pub mod x_k8s;

/// The group of the llm-d InferenceObjective.
pub const GROUP_LLM_D: &str = "llm-d.ai";

/// A reference to an InferencePool in the objective's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolObjectReference {
    /// Group; `inference.networking.k8s.io` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253), regex(pattern = GROUP_PATTERN), extend("default" = "inference.networking.k8s.io"))]
    pub group: Option<String>,
    /// Kind; `InferencePool` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = KIND_PATTERN), extend("default" = "InferencePool"))]
    pub kind: Option<String>,
    /// Name of the pool.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

impl PoolObjectReference {
    /// Whether this names the InferencePool `pool` (either InferencePool group).
    pub fn refers_to_pool(&self, pool: &str) -> bool {
        let kind_ok = self.kind.as_deref().is_none_or(|k| k == "InferencePool");
        let group_ok = self
            .group
            .as_deref()
            .is_none_or(|g| g == crate::pool::GROUP_V1 || g == crate::pool::GROUP_V1ALPHA2);
        kind_ok && group_ok && self.name == pool
    }
}

/// The objective's observed state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InferenceObjectiveStatus {
    /// `Accepted` (at most 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// A version-independent view of an objective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectiveView {
    /// The pool it belongs to.
    pub pool: PoolObjectReference,
    /// Its priority (0 when unset).
    pub priority: i32,
}

impl From<&llm_d::InferenceObjectiveSpec> for ObjectiveView {
    fn from(spec: &llm_d::InferenceObjectiveSpec) -> Self {
        Self {
            pool: spec.pool_ref.clone(),
            priority: spec.priority.unwrap_or(0),
        }
    }
}

impl From<&x_k8s::InferenceObjectiveSpec> for ObjectiveView {
    fn from(spec: &x_k8s::InferenceObjectiveSpec) -> Self {
        Self {
            pool: spec.pool_ref.clone(),
            priority: spec.priority.unwrap_or(0),
        }
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
    use super::*;

    fn r(group: Option<&str>, kind: Option<&str>, name: &str) -> PoolObjectReference {
        PoolObjectReference {
            group: group.map(str::to_owned),
            kind: kind.map(str::to_owned),
            name: name.to_owned(),
        }
    }

    #[test]
    fn pool_references_default_to_inference_pools() {
        assert!(r(None, None, "p").refers_to_pool("p"));
        assert!(!r(None, None, "p").refers_to_pool("q"));
        assert!(r(Some("inference.networking.x-k8s.io"), None, "p").refers_to_pool("p"));
        assert!(
            r(
                Some("inference.networking.k8s.io"),
                Some("InferencePool"),
                "p"
            )
            .refers_to_pool("p")
        );
        assert!(!r(Some("apps"), None, "p").refers_to_pool("p"));
        assert!(!r(None, Some("Service"), "p").refers_to_pool("p"));
    }
}
