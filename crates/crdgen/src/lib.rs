//! The CustomResourceDefinitions generated from kvgate's Rust types, and where they are
//! committed.
//!
//! Two sets:
//!
//! - **owned**: CRDs kvgate defines; they ship in the Helm chart's `crds/` folder: the
//!   operator's `PoolAutoscaler` (`kvgate.io/v1alpha1`).
//! - **test copies**: the upstream CRDs kvgate reads (the Gateway API Inference Extension's
//!   `InferencePool` in both versions, the two `InferenceObjective` groups), generated from
//!   `crates/api`'s types, whose schema attributes reproduce upstream's validation; and the
//!   Gateway API's `GatewayClass`, `Gateway` and `HTTPRoute` (standard channel) from the
//!   `gateway-api` crate's types, which carry upstream's fields, enums and patterns but not its
//!   CEL rules or defaults. They live in `e2e/crds/` and are installed into the test API server;
//!   users install the upstream CRDs.
//!
//! [`documents`] renders every file; the binary writes them and `--check` (and the crate's
//! drift test) fails when a committed copy differs from what the code generates. Pure: no I/O
//! here.

use api::objective::{llm_d, x_k8s};
use api::pool::{v1, v1alpha2};
use gateway_api::apis::standard::{gatewayclasses, gateways, httproutes};
use kube::CustomResourceExt;
use kube4::CustomResourceExt as _;

/// The Gateway API release the `gateway-api` crate's types follow.
pub const GATEWAY_API_BUNDLE: &str = "v1.5.1";
/// Upstream's `api-approved.kubernetes.io` value for the Gateway API (a protected group).
pub const GATEWAY_API_APPROVED: &str = "https://github.com/kubernetes-sigs/gateway-api/pull/1538";

/// Where the test copies are committed, relative to the workspace root.
pub const TEST_COPIES_DIR: &str = "e2e/crds";
/// Where kvgate's own CRDs are committed (the chart's `crds/`), relative to the workspace root.
pub const OWNED_DIR: &str = "charts/kvgate/crds";

/// Why a CRD could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    /// The CRD did not serialise (a bug in a schema attribute).
    #[error("{name}: {source}")]
    Yaml {
        /// The CRD's name.
        name: String,
        /// The serialiser's error.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// The CRD did not convert to JSON.
    #[error("{name}: {source}")]
    Json {
        /// The CRD's name.
        name: String,
        /// The serialiser's error.
        #[source]
        source: serde_json::Error,
    },
}

/// One generated file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// The path relative to the workspace root.
    pub path: String,
    /// The file's contents.
    pub text: String,
}

/// Every generated file, in a fixed order.
pub fn documents() -> Result<Vec<Document>, GenError> {
    let gateway_api = |name: &str, crd: Result<serde_json::Value, serde_json::Error>| {
        crd.map(|mut c| {
            if let Some(meta) = c.get_mut("metadata").and_then(|m| m.as_object_mut()) {
                let annotations = meta
                    .entry("annotations")
                    .or_insert_with(|| serde_json::json!({}));
                if let Some(a) = annotations.as_object_mut() {
                    for (k, v) in [
                        ("api-approved.kubernetes.io", GATEWAY_API_APPROVED),
                        (
                            "gateway.networking.k8s.io/bundle-version",
                            GATEWAY_API_BUNDLE,
                        ),
                        ("gateway.networking.k8s.io/channel", "standard"),
                    ] {
                        a.insert(k.to_owned(), v.into());
                    }
                }
            }
            c
        })
        .map_err(|source| GenError::Json {
            name: name.to_owned(),
            source,
        })
    };
    let json = |name: &str, crd: Result<serde_json::Value, serde_json::Error>| {
        crd.map_err(|source| GenError::Json {
            name: name.to_owned(),
            source,
        })
    };
    let test_copies = [
        (
            json("v1", serde_json::to_value(v1::InferencePool::crd()))?,
            "api::pool::v1::InferencePool",
        ),
        (
            json(
                "v1alpha2",
                serde_json::to_value(v1alpha2::InferencePool::crd()),
            )?,
            "api::pool::v1alpha2::InferencePool",
        ),
        (
            json(
                "llm-d",
                serde_json::to_value(llm_d::InferenceObjective::crd()),
            )?,
            "api::objective::llm_d::InferenceObjective",
        ),
        (
            json(
                "x-k8s",
                serde_json::to_value(x_k8s::InferenceObjective::crd()),
            )?,
            "api::objective::x_k8s::InferenceObjective",
        ),
        (
            gateway_api(
                "GatewayClass",
                serde_json::to_value(gatewayclasses::GatewayClass::crd()),
            )?,
            "gateway_api::apis::standard::gatewayclasses::GatewayClass",
        ),
        (
            gateway_api("Gateway", serde_json::to_value(gateways::Gateway::crd()))?,
            "gateway_api::apis::standard::gateways::Gateway",
        ),
        (
            gateway_api(
                "HTTPRoute",
                serde_json::to_value(httproutes::HttpRoute::crd()),
            )?,
            "gateway_api::apis::standard::httproutes::HttpRoute",
        ),
    ];
    let owned = [(
        json(
            "PoolAutoscaler",
            serde_json::to_value(api::autoscaler::PoolAutoscaler::crd()),
        )?,
        "api::autoscaler::PoolAutoscaler",
    )];
    owned
        .into_iter()
        .map(|(crd, from)| render(&canonical(crd), from, OWNED_DIR, Origin::Owned))
        .chain(
            test_copies.into_iter().map(|(crd, from)| {
                render(&canonical(crd), from, TEST_COPIES_DIR, Origin::TestCopy)
            }),
        )
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Owned,
    TestCopy,
}

/// `value` with every object's keys in sorted order. serde_json keeps insertion order when any
/// crate of the build enables its `preserve_order` feature, and sorted order otherwise; sorting
/// here makes the files the same in every build.
fn canonical(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<(String, serde_json::Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, canonical(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(canonical).collect())
        }
        other => other,
    }
}

fn render(
    crd: &serde_json::Value,
    from: &str,
    dir: &str,
    origin: Origin,
) -> Result<Document, GenError> {
    let name = crd
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or_default()
        .to_owned();
    let yaml = serde_yaml_ng::to_string(crd).map_err(|source| GenError::Yaml {
        name: name.clone(),
        source,
    })?;
    let note = match origin {
        Origin::Owned => "# kvgate's own CRD; Helm installs it from the chart's crds/ folder.\n",
        Origin::TestCopy => {
            "# A test copy of an upstream CRD kvgate reads, for the tests' API server.\n\
             # Users install the upstream CRD, not this file.\n"
        }
    };
    Ok(Document {
        path: format!("{dir}/{name}.yaml"),
        text: format!(
            "# Generated by kvgate-crdgen from {from}; do not edit (cargo run -p kvgate-crdgen).\n\
             {note}{yaml}"
        ),
    })
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

    #[test]
    fn file_names_are_the_crd_names() {
        let docs = documents().unwrap();
        let paths: Vec<&str> = docs.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(
            paths,
            vec![
                "charts/kvgate/crds/poolautoscalers.kvgate.io.yaml",
                "e2e/crds/inferencepools.inference.networking.k8s.io.yaml",
                "e2e/crds/inferencepools.inference.networking.x-k8s.io.yaml",
                "e2e/crds/inferenceobjectives.llm-d.ai.yaml",
                "e2e/crds/inferenceobjectives.inference.networking.x-k8s.io.yaml",
                "e2e/crds/gatewayclasses.gateway.networking.k8s.io.yaml",
                "e2e/crds/gateways.gateway.networking.k8s.io.yaml",
                "e2e/crds/httproutes.gateway.networking.k8s.io.yaml",
            ]
        );
        assert!(docs.iter().all(|d| d.text.starts_with("# Generated by")));
    }
}
