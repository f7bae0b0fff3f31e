//! Upstream-shaped manifests (written from the API definitions) deserialise into the Rust types,
//! keep their meaning through a round trip, and the resource identities are the upstream ones.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use api::objective::{self, ObjectiveView};
use api::pool::{self, PoolView};
use api::shared::FailureMode;
use kube::{CustomResourceExt, Resource};

const POOL_V1: &str = r#"
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata:
  name: vllm-qwen3-32b
  namespace: llm
spec:
  selector:
    matchLabels:
      app: vllm-qwen3-32b
      tier: gpu
  targetPorts:
    - number: 8000
    - number: 8001
  appProtocol: kubernetes.io/h2c
  endpointPickerRef:
    name: vllm-qwen3-32b-epp
    port:
      number: 9002
    failureMode: FailOpen
status:
  parents:
    - parentRef:
        group: gateway.networking.k8s.io
        kind: Gateway
        name: inference-gateway
        namespace: llm
      controllerName: istio.io/gateway-controller
      conditions:
        - type: Accepted
          status: "True"
          reason: Accepted
          message: ""
          lastTransitionTime: "2026-01-02T03:04:05Z"
          observedGeneration: 2
"#;

const POOL_V1ALPHA2: &str = r#"
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata:
  name: vllm-llama3-8b
spec:
  selector:
    app: vllm-llama3-8b
  targetPortNumber: 8000
  extensionRef:
    name: vllm-llama3-8b-epp
    portNumber: 9002
    failureMode: FailClose
status:
  parent:
    - parentRef:
        kind: Status
        name: default
      conditions:
        - type: Accepted
          status: Unknown
          reason: Pending
          message: Waiting for controller
          lastTransitionTime: "1970-01-01T00:00:00Z"
"#;

#[test]
fn v1_pool_reads_every_field() {
    let p: pool::v1::InferencePool = serde_yaml_ng::from_str(POOL_V1).unwrap();
    assert_eq!(p.metadata.name.as_deref(), Some("vllm-qwen3-32b"));
    assert_eq!(p.metadata.namespace.as_deref(), Some("llm"));
    let s = &p.spec;
    assert_eq!(s.selector.match_labels["app"], "vllm-qwen3-32b");
    assert_eq!(
        s.target_ports,
        vec![
            pool::v1::Port { number: 8000 },
            pool::v1::Port { number: 8001 }
        ]
    );
    assert_eq!(s.app_protocol, Some(pool::v1::AppProtocol::H2c));
    let epp = s.endpoint_picker_ref.as_ref().unwrap();
    assert_eq!(epp.name, "vllm-qwen3-32b-epp");
    assert_eq!(epp.port, Some(pool::v1::Port { number: 9002 }));
    assert_eq!(epp.failure_mode, Some(FailureMode::FailOpen));
    assert_eq!(epp.kind, None);
    let status = p.status.as_ref().unwrap();
    assert_eq!(status.parents[0].parent_ref.name, "inference-gateway");
    assert_eq!(
        status.parents[0].controller_name.as_deref(),
        Some("istio.io/gateway-controller")
    );
    assert_eq!(status.parents[0].conditions[0].type_, "Accepted");
    assert_eq!(status.parents[0].conditions[0].observed_generation, Some(2));
    let view = PoolView::from(s);
    assert_eq!(view.target_ports, vec![8000, 8001]);
    assert_eq!(
        view.label_selector().as_deref(),
        Some("app=vllm-qwen3-32b,tier=gpu")
    );
}

#[test]
fn v1alpha2_pool_reads_every_field() {
    let p: pool::v1alpha2::InferencePool = serde_yaml_ng::from_str(POOL_V1ALPHA2).unwrap();
    let s = &p.spec;
    assert_eq!(s.selector["app"], "vllm-llama3-8b");
    assert_eq!(s.target_port_number, 8000);
    let ext = s.extension_ref.as_ref().unwrap();
    assert_eq!(
        (ext.name.as_str(), ext.port_number),
        ("vllm-llama3-8b-epp", Some(9002))
    );
    assert_eq!(ext.failure_mode, Some(FailureMode::FailClose));
    let status = p.status.as_ref().unwrap();
    assert_eq!(status.parents[0].parent_ref.kind.as_deref(), Some("Status"));
    assert_eq!(status.parents[0].conditions[0].reason, "Pending");
    let view = PoolView::from(s);
    assert_eq!(view.target_ports, vec![8000]);
}

#[test]
fn minimal_pools_and_unknown_fields_are_accepted() {
    let v1 = "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: p}\nspec:\n  selector: {matchLabels: {app: p}}\n  targetPorts: [{number: 8000, appProtocol: http}]\n  someFutureField: 1\n";
    let p: pool::v1::InferencePool = serde_yaml_ng::from_str(v1).unwrap();
    assert_eq!(p.spec.endpoint_picker_ref, None);
    assert_eq!(p.spec.app_protocol, None);
    assert!(p.status.is_none());
    let weird = "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: p}\nspec:\n  selector: {matchLabels: {app: p}}\n  targetPorts: [{number: 8000}]\n  appProtocol: grpc-something\n";
    let p: pool::v1::InferencePool = serde_yaml_ng::from_str(weird).unwrap();
    assert_eq!(p.spec.app_protocol, Some(pool::v1::AppProtocol::Unknown));
    let bad = "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\nmetadata: {name: p}\nspec:\n  selector: {app: p}\n";
    assert!(
        serde_yaml_ng::from_str::<pool::v1alpha2::InferencePool>(bad).is_err(),
        "targetPortNumber is required"
    );
}

#[test]
fn pools_round_trip_in_upstream_spelling() {
    let p: pool::v1::InferencePool = serde_yaml_ng::from_str(POOL_V1).unwrap();
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["spec"]["targetPorts"][1]["number"], 8001);
    assert_eq!(json["spec"]["appProtocol"], "kubernetes.io/h2c");
    assert_eq!(json["spec"]["endpointPickerRef"]["failureMode"], "FailOpen");
    assert_eq!(
        json["status"]["parents"][0]["controllerName"],
        "istio.io/gateway-controller"
    );
    assert_eq!(
        serde_json::from_value::<pool::v1::InferencePool>(json).unwrap(),
        p
    );
    let q: pool::v1alpha2::InferencePool = serde_yaml_ng::from_str(POOL_V1ALPHA2).unwrap();
    let json = serde_json::to_value(&q).unwrap();
    assert_eq!(json["spec"]["targetPortNumber"], 8000);
    assert_eq!(json["spec"]["extensionRef"]["portNumber"], 9002);
    assert_eq!(json["status"]["parent"][0]["parentRef"]["name"], "default");
    assert_eq!(
        serde_json::from_value::<pool::v1alpha2::InferencePool>(json).unwrap(),
        q
    );
}

#[test]
fn objectives_in_both_groups() {
    for group in ["llm-d.ai", "inference.networking.x-k8s.io"] {
        let text = format!(
            "apiVersion: {group}/v1alpha2\nkind: InferenceObjective\nmetadata: {{name: critical, namespace: llm}}\nspec:\n  priority: -5\n  poolRef:\n    group: inference.networking.k8s.io\n    kind: InferencePool\n    name: vllm-qwen3-32b\nstatus:\n  conditions:\n    - {{type: Accepted, status: \"True\", reason: Accepted, message: ok, lastTransitionTime: \"2026-01-01T00:00:00Z\"}}\n"
        );
        let view = if group == "llm-d.ai" {
            let o: objective::llm_d::InferenceObjective = serde_yaml_ng::from_str(&text).unwrap();
            assert_eq!(o.status.as_ref().unwrap().conditions[0].type_, "Accepted");
            ObjectiveView::from(&o.spec)
        } else {
            let o: objective::x_k8s::InferenceObjective = serde_yaml_ng::from_str(&text).unwrap();
            ObjectiveView::from(&o.spec)
        };
        assert_eq!(view.priority, -5);
        assert!(view.pool.refers_to_pool("vllm-qwen3-32b"));
    }
    let unset = "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: std}\nspec:\n  poolRef: {name: p}\n";
    let o: objective::llm_d::InferenceObjective = serde_yaml_ng::from_str(unset).unwrap();
    assert_eq!(
        ObjectiveView::from(&o.spec).priority,
        0,
        "an unset priority is 0"
    );
    assert!(
        serde_json::to_value(&o).unwrap()["spec"]
            .get("priority")
            .is_none()
    );
}

#[test]
fn resource_identities_match_upstream() {
    let ids = [
        (
            pool::v1::InferencePool::group(&()).into_owned(),
            pool::v1::InferencePool::version(&()).into_owned(),
            pool::v1::InferencePool::plural(&()).into_owned(),
        ),
        (
            pool::v1alpha2::InferencePool::group(&()).into_owned(),
            pool::v1alpha2::InferencePool::version(&()).into_owned(),
            pool::v1alpha2::InferencePool::plural(&()).into_owned(),
        ),
        (
            objective::llm_d::InferenceObjective::group(&()).into_owned(),
            objective::llm_d::InferenceObjective::version(&()).into_owned(),
            objective::llm_d::InferenceObjective::plural(&()).into_owned(),
        ),
        (
            objective::x_k8s::InferenceObjective::group(&()).into_owned(),
            objective::x_k8s::InferenceObjective::version(&()).into_owned(),
            objective::x_k8s::InferenceObjective::plural(&()).into_owned(),
        ),
    ];
    let want = [
        (pool::GROUP_V1, "v1", "inferencepools"),
        (pool::GROUP_V1ALPHA2, "v1alpha2", "inferencepools"),
        (objective::GROUP_LLM_D, "v1alpha2", "inferenceobjectives"),
        (pool::GROUP_V1ALPHA2, "v1alpha2", "inferenceobjectives"),
    ];
    for (got, want) in ids.iter().zip(want) {
        assert_eq!((got.0.as_str(), got.1.as_str(), got.2.as_str()), want);
    }
    let crd = pool::v1::InferencePool::crd();
    assert_eq!(crd.spec.names.short_names, Some(vec!["infpool".to_owned()]));
    assert_eq!(crd.spec.scope, "Namespaced");
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["required"],
        serde_json::json!(["selector", "targetPorts"])
    );
    assert!(spec["properties"]["targetPorts"].is_object());
}

/// A real API server refuses a CRD of a `*.k8s.io` group without upstream's approval
/// annotation, and the read-only `Unknown` protocol must not become an allowed value.
#[test]
fn generated_crds_carry_upstream_approval_and_allowed_values_only() {
    let v1 = pool::v1::InferencePool::crd();
    let annotations = v1.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get("api-approved.kubernetes.io")
            .map(String::as_str),
        Some(pool::v1::API_APPROVED)
    );
    let alpha = pool::v1alpha2::InferencePool::crd();
    assert_eq!(
        alpha
            .metadata
            .annotations
            .unwrap_or_default()
            .get("api-approved.kubernetes.io")
            .map(String::as_str),
        Some(pool::v1alpha2::API_APPROVED)
    );
    let schema = serde_json::to_value(&v1.spec.versions[0].schema).unwrap();
    let spec = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"];
    assert_eq!(
        spec["appProtocol"]["enum"],
        serde_json::json!(["http", "kubernetes.io/h2c"])
    );
    assert_eq!(spec["appProtocol"]["default"], "http");
    assert_eq!(spec["targetPorts"]["maxItems"], 8);
    assert_eq!(
        spec["endpointPickerRef"]["properties"]["failureMode"]["enum"],
        serde_json::json!(["FailOpen", "FailClose"])
    );
}
