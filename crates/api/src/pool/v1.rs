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

use crate::shared::{
    Condition, FailureMode, GROUP_PATTERN, KIND_PATTERN, LABEL_VALUE_PATTERN, ParentReference,
};

/// The `api-approved.kubernetes.io` annotation of upstream's CRD: `*.k8s.io` groups are
/// protected, and an API server refuses their CRDs without it.
pub const API_APPROVED: &str =
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173";

/// The pool's desired state.
///
/// The schema attributes reproduce upstream's validation (required fields, bounds, patterns,
/// enums, CEL rules, defaults), so that the CRD generated from these types accepts and refuses
/// what upstream's does.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "infpool",
    namespaced,
    status = "InferencePoolStatus",
    derive = "PartialEq",
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The model-server pods, in the pool's namespace (`matchLabels` only).
    pub selector: LabelSelector,
    /// The ports each selected pod serves on; each is a separate endpoint (a data-parallel rank).
    #[schemars(length(min = 1, max = 8))]
    #[schemars(extend(
        "x-kubernetes-list-type" = "atomic",
        "x-kubernetes-validations" = [{
            "rule": "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
            "message": "port number must be unique"
        }]
    ))]
    pub target_ports: Vec<Port>,
    /// The application protocol of the target ports (HTTP/1.1 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "AppProtocolSchema", extend("default" = "http"))]
    pub app_protocol: Option<AppProtocol>,
    /// The endpoint picker serving this pool (optional in recent releases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// A label selector with equality on labels only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Label pairs a pod must all carry (1 to 64).
    #[schemars(extend("minProperties" = 1, "maxProperties" = 64))]
    #[schemars(with = "BTreeMap<String, LabelValue>")]
    pub match_labels: BTreeMap<String, String>,
}

/// A label value as upstream validates it (schema only).
#[derive(JsonSchema)]
#[schemars(transparent)]
#[allow(dead_code)]
struct LabelValue(#[schemars(length(max = 63), regex(pattern = LABEL_VALUE_PATTERN))] String);

/// A port number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Port {
    /// 1..=65535.
    #[schemars(range(min = 1, max = 65535))]
    pub number: i32,
}

/// The application protocol of a pool's target ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AppProtocol {
    /// HTTP/1.1 (the default).
    #[serde(rename = "http")]
    Http,
    /// HTTP/2 over cleartext.
    #[serde(rename = "kubernetes.io/h2c")]
    H2c,
    /// A value this build does not know (read only; never written by kvgate, and not part of
    /// the schema).
    #[serde(other)]
    Unknown,
}

/// The schema of `appProtocol`: the values upstream's API allows, `http` by default.
#[derive(JsonSchema)]
#[allow(dead_code)]
enum AppProtocolSchema {
    #[serde(rename = "http")]
    Http,
    #[serde(rename = "kubernetes.io/h2c")]
    H2c,
}

/// The endpoint picker extension of a pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.kind != 'Service' || has(self.port)",
    "message": "port is required when kind is 'Service' or unspecified (defaults to 'Service')"
}]))]
pub struct EndpointPickerRef {
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
    /// The Service port (required when the kind is Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,
    /// What the gateway does when the picker fails; `FailClose` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "FailClose"))]
    pub failure_mode: Option<FailureMode>,
}

/// The pool's observed state, per parent Gateway.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    /// At most 32 parents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "atomic"))]
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
    #[schemars(length(max = 8), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
