//! InferenceObjective `inference.networking.x-k8s.io/v1alpha2` (GIE up to v1.5).
//!
//! ```yaml
//! apiVersion: inference.networking.x-k8s.io/v1alpha2
//! kind: InferenceObjective
//! metadata: {name: chat-critical}
//! spec:
//!   priority: 10                  # optional, 0 when unset; negative = sheddable
//!   poolRef: {name: qwen}         # group inference.networking.k8s.io, kind InferencePool by default
//! ```

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use super::InferenceObjectiveStatus;
use super::PoolObjectReference;

/// The objective's desired state.
// Clippy reads the `printcolumn` entries' repeated keys as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceObjective",
    plural = "inferenceobjectives",
    namespaced,
    status = "InferenceObjectiveStatus",
    derive = "PartialEq",
    printcolumn(
        name = "Inference Pool",
        type_ = "string",
        json_path = ".spec.poolRef.name"
    ),
    printcolumn(name = "Priority", type_ = "string", json_path = ".spec.priority"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// Higher is more important; negative is sheddable; 0 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The pool this objective belongs to (same namespace).
    pub pool_ref: PoolObjectReference,
}
