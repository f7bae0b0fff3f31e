//! Types and schema patterns shared by the pool and objective versions.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Upstream's `Group` pattern: empty (the core group) or a DNS subdomain.
pub const GROUP_PATTERN: &str =
    r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// Upstream's `Kind` pattern.
pub const KIND_PATTERN: &str = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$";
/// Upstream's `LabelValue` pattern.
pub const LABEL_VALUE_PATTERN: &str = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";

/// What the gateway does when the endpoint picker does not answer (upstream
/// `EndpointPickerFailureMode` / `ExtensionFailureMode`; the API default is `FailClose`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum FailureMode {
    /// Forward the request to an endpoint of the gateway's choosing.
    FailOpen,
    /// Drop the request (the default).
    #[default]
    FailClose,
}

/// A Gateway (or other parent) an InferencePool's status is reported for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    /// API group, `gateway.networking.k8s.io` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253), regex(pattern = GROUP_PATTERN))]
    pub group: Option<String>,
    /// Kind, `Gateway` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = KIND_PATTERN))]
    pub kind: Option<String>,
    /// Name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Namespace; the pool's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
}

/// The `Condition` of Kubernetes object status (`metav1.Condition`).
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
