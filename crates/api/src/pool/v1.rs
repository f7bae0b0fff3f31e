//! InferencePool `inference.networking.k8s.io/v1` (GA).
//!
//! ```yaml
//! apiVersion: inference.networking.k8s.io/v1
//! kind: InferencePool
//! metadata: {name: qwen, namespace: llm}
//! spec:
//!   selector: {matchLabels: {app: qwen}}
//!   targetPorts: [{number: 8000}, {number: 8001}]   # 1..8, one endpoint per pod and port
//!   appProtocol: http                                # or kubernetes.io/h2c
//!   endpointPickerRef: {name: qwen-epp, port: {number: 9002}, failureMode: FailOpen}
//! ```

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::{Condition, FailureMode, ParentReference};

/// The pool's desired state.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "infpool",
    namespaced,
    status = "InferencePoolStatus",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The model-server pods, in the pool's namespace (`matchLabels` only).
    pub selector: LabelSelector,
    /// The ports each selected pod serves on; each is a separate endpoint (a data-parallel rank).
    #[serde(default)]
    pub target_ports: Vec<Port>,
    /// The application protocol of the target ports (HTTP/1.1 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<AppProtocol>,
    /// The endpoint picker serving this pool (optional in recent releases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// A label selector with equality on labels only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Label pairs a pod must all carry.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// A port number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Port {
    /// 1..=65535.
    pub number: i32,
}

/// The application protocol of a pool's target ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AppProtocol {
    /// HTTP/1.1 (the default).
    #[serde(rename = "http")]
    Http,
    /// HTTP/2 over cleartext.
    #[serde(rename = "kubernetes.io/h2c")]
    H2c,
    /// A value this build does not know (read only; never written by kvgate).
    #[serde(other)]
    Unknown,
}

/// The endpoint picker extension of a pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group of the referent; `""` (core) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the referent; `Service` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the referent.
    pub name: String,
    /// The Service port (required when the kind is Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,
    /// What the gateway does when the picker fails; `FailClose` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

/// The pool's observed state, per parent Gateway.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    /// At most 32 parents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<ParentStatus>,
}

/// The pool's status as one parent sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParentStatus {
    /// The parent.
    pub parent_ref: ParentReference,
    /// The controller that wrote this entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_name: Option<String>,
    /// `Accepted`, `ResolvedRefs`, `Exported` (at most 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
