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

use crate::shared::{Condition, FailureMode, ParentReference};

/// The pool's desired state.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferencePool",
    plural = "inferencepools",
    namespaced,
    status = "InferencePoolStatus",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Labels a model-server pod must all carry (same namespace).
    pub selector: BTreeMap<String, String>,
    /// The one port the pods serve on.
    pub target_port_number: i32,
    /// The endpoint picker extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extension_ref: Option<Extension>,
}

/// The endpoint picker extension (`ExtensionReference` and `ExtensionConnection` inlined).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Extension {
    /// API group of the referent; `""` (core) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the referent; `Service` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the referent.
    pub name: String,
    /// The Service port; 9002 is implied when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_number: Option<i32>,
    /// What the gateway does when the picker fails; `FailClose` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

/// The pool's observed state (the field is named `parent` in this version).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct InferencePoolStatus {
    /// At most 32 parents.
    #[serde(default, rename = "parent", skip_serializing_if = "Vec::is_empty")]
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
    pub conditions: Vec<Condition>,
}
