//! Pods as a kubelet would report them: kapi runs no controllers, so tests create the Pod
//! objects of their processes and set their status (IP, readiness) themselves.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Container, Namespace, Pod};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::KapiError;

/// A pod to register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// Its name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// The node it runs on.
    pub node: String,
    /// Its IP (`status.podIP`).
    pub ip: IpAddr,
    /// Whether its `Ready` condition is `True`.
    pub ready: bool,
}

/// Creates `namespace` unless it exists.
pub async fn ensure_namespace(client: &kube::Client, namespace: &str) -> Result<(), KapiError> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates the pod (one container named `engine`) and sets its status: phase Running, the IP,
/// and the `Ready` condition.
pub async fn create(
    client: &kube::Client,
    namespace: &str,
    pod: &PodInfo,
) -> Result<Pod, KapiError> {
    let engine = Container {
        name: "engine".to_owned(),
        image: Some("engine".to_owned()),
        ..Container::default()
    };
    create_with_containers(client, namespace, pod, &[engine]).await
}

/// As [`create`], with the pod's `spec.containers` as given (names, images, ports: what readers
/// of the pod such as a Service's named `targetPort` resolve against). At least one container.
pub async fn create_with_containers(
    client: &kube::Client,
    namespace: &str,
    pod: &PodInfo,
    containers: &[Container],
) -> Result<Pod, KapiError> {
    if containers.is_empty() {
        return Err(KapiError::io(
            format!("build Pod {}", pod.name),
            std::io::Error::other("a pod needs at least one container"),
        ));
    }
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let object: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod.name, "namespace": namespace, "labels": pod.labels},
        "spec": {"nodeName": pod.node, "containers": containers},
    }))
    .map_err(|e| KapiError::io("build a Pod", std::io::Error::other(e)))?;
    api.create(&PostParams::default(), &object).await?;
    set_status(client, namespace, &pod.name, pod.ip, pod.ready).await
}

/// Sets the pod's status as a kubelet would: Running, `podIP` and `podIPs`, and `Ready`.
pub async fn set_status(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    ip: IpAddr,
    ready: bool,
) -> Result<Pod, KapiError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let status = if ready { "True" } else { "False" };
    let patch = json!({"status": {
        "phase": "Running",
        "podIP": ip.to_string(),
        "podIPs": [{"ip": ip.to_string()}],
        "conditions": [
            {"type": "Ready", "status": status},
            {"type": "ContainersReady", "status": status},
        ],
    }});
    Ok(api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}

/// Flips only the pod's `Ready` condition.
pub async fn set_ready(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    ready: bool,
) -> Result<Pod, KapiError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let current = api.get_status(name).await?;
    let ip = current
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .ok_or_else(|| {
            KapiError::io(
                format!("pod {name} has no IP"),
                std::io::Error::other("status.podIP unset"),
            )
        })?;
    set_status(client, namespace, name, ip, ready).await
}
