//! Types shared by the pool and objective versions.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
    pub group: Option<String>,
    /// Kind, `Gateway` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name.
    pub name: String,
    /// Namespace; the pool's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// The `Condition` of Kubernetes object status (`metav1.Condition`).
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
