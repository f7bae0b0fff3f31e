//! InferencePool `inference.networking.x-k8s.io/v1alpha2` (pre-GA).
//!
//! ```yaml
//! apiVersion: inference.networking.x-k8s.io/v1alpha2
//! kind: InferencePool
//! metadata: {name: qwen}
//! spec:
//!   selector: {app: qwen}            # a plain label map
//!   targetPortNumber: 8000           # a single port
//!   extensionRef: {name: qwen-epp, portNumber: 9002, failureMode: FailClose}
//! ```

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::{
    Condition, FailureMode, GROUP_PATTERN, KIND_PATTERN, LABEL_VALUE_PATTERN, ParentReference,
};

/// Upstream's `api-approved.kubernetes.io` value for its experimental group (not a protected
/// group; the annotation only marks the API as experimental).
pub const API_APPROVED: &str = "unapproved, experimental-only";

/// The pool's desired state.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferencePool",
    plural = "inferencepools",
    namespaced,
    status = "InferencePoolStatus",
    derive = "PartialEq",
    annotation("api-approved.kubernetes.io", "unapproved, experimental-only")
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Labels a model-server pod must all carry (same namespace).
    #[schemars(with = "BTreeMap<String, LabelValue>")]
    pub selector: BTreeMap<String, String>,
    /// The one port the pods serve on.
    #[schemars(range(min = 1, max = 65535))]
    pub target_port_number: i32,
    /// The endpoint picker extension (required by the API; read leniently).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(required)]
    pub extension_ref: Option<Extension>,
}

/// A label value as upstream validates it (schema only).
#[derive(JsonSchema)]
#[schemars(transparent)]
#[allow(dead_code)]
struct LabelValue(#[schemars(length(max = 63), regex(pattern = LABEL_VALUE_PATTERN))] String);

/// The endpoint picker extension (`ExtensionReference` and `ExtensionConnection` inlined).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Extension {
    /// API group of the referent; `""` (core) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253), regex(pattern = GROUP_PATTERN), extend("default" = ""))]
    pub group: Option<String>,
    /// Kind of the referent; `Service` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = KIND_PATTERN), extend("default" = "Service"))]
    pub kind: Option<String>,
    /// Name of the referent.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The Service port; 9002 is implied when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port_number: Option<i32>,
    /// What the gateway does when the picker fails; `FailClose` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "FailClose"))]
    pub failure_mode: Option<FailureMode>,
}

/// The pool's observed state (the field is named `parent` in this version).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InferencePoolStatus {
    /// At most 32 parents.
    #[serde(default, rename = "parent", skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub parents: Vec<PoolStatus>,
}

/// The pool's status as one Gateway sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// The Gateway.
    pub parent_ref: ParentReference,
    /// `Accepted`, `ResolvedRefs` (at most 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
