//! The prefill allow-list: the ConfigMap the decode pods' sidecars read (`--prefiller-allow-list`,
//! key `prefillers.yaml`) to know which prefill endpoints they may send a prefill leg to. The
//! operator keeps it equal to the pool's ready prefill pods × target ports, in the EPP's
//! discovery format, so prefill/decode works in a cluster without anyone editing it.
//!
//! [`render`] is pure; [`sync`] reads the pool and its pods and applies the ConfigMap when its
//! contents change.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams};

/// The ConfigMap key the sidecars read.
pub const KEY: &str = "prefillers.yaml";
/// The field manager of the operator's writes.
pub const MANAGER: &str = "kvgate-operator";

/// A prefill endpoint's pod.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Prefiller {
    /// The pod's name.
    pub name: String,
    /// Its IP.
    pub ip: String,
}

/// Whether a pod is a ready prefill pod of the pool: label `kvgate.io/role` (else
/// `llm-d.ai/role`) is `prefill` (llm-d's `encode-prefill` counts), it has an IP, its `Ready`
/// condition is `True`, and it is not being deleted.
pub fn prefiller(pod: &Pod) -> Option<Prefiller> {
    let labels = pod.metadata.labels.as_ref()?;
    let role = labels
        .get("kvgate.io/role")
        .or_else(|| labels.get("llm-d.ai/role"))?;
    if !matches!(role.as_str(), "prefill" | "encode-prefill") {
        return None;
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.clone().filter(|ip| !ip.is_empty())?;
    ready.then(|| Prefiller {
        name: pod.metadata.name.clone().unwrap_or_default(),
        ip,
    })
}

/// The allow-list document for `prefillers` on `ports`, stable for equal input.
pub fn render(mut prefillers: Vec<Prefiller>, ports: &[i32]) -> String {
    prefillers.sort();
    prefillers.dedup();
    let mut out = String::from(
        "# Kept by kvgate-operator: the pool's ready prefill pods; changes are overwritten.\n",
    );
    if prefillers.is_empty() {
        out.push_str("endpoints: []\n");
        return out;
    }
    out.push_str("endpoints:\n");
    let ports: Vec<String> = ports.iter().map(i32::to_string).collect();
    for p in &prefillers {
        let _ = writeln!(
            out,
            "  - {{name: {}, address: {}, ports: [{}]}}",
            p.name,
            p.ip,
            ports.join(", ")
        );
    }
    out
}

/// Why the allow-list could not be synced.
#[derive(Debug, thiserror::Error)]
pub enum AllowListError {
    /// The API server refused or failed.
    #[error("prefill allow-list {config_map}: {source}")]
    Api {
        /// The ConfigMap.
        config_map: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
}

/// Lists the pool's pods (`selector`, equality only), renders the allow-list for `ports`, and
/// server-side applies `config_map` in `namespace` when its `prefillers.yaml` differs. Returns
/// the number of prefill pods listed and whether the ConfigMap changed.
pub async fn sync(
    client: &kube::Client,
    namespace: &str,
    config_map: &str,
    selector: &BTreeMap<String, String>,
    ports: &[i32],
) -> Result<(usize, bool), AllowListError> {
    let err = |source| AllowListError::Api {
        config_map: config_map.to_owned(),
        source,
    };
    let label_selector = selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let listed = pods
        .list(&ListParams::default().labels(&label_selector))
        .await
        .map_err(err)?;
    let prefillers: Vec<Prefiller> = listed.items.iter().filter_map(prefiller).collect();
    let count = prefillers.len();
    let text = render(prefillers, ports);
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let current = match maps.get(config_map).await {
        Ok(cm) => cm.data.and_then(|d| d.get(KEY).cloned()),
        Err(kube::Error::Api(s)) if s.code == 404 => None,
        Err(e) => return Err(err(e)),
    };
    if current.as_deref() == Some(text.as_str()) {
        return Ok((count, false));
    }
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(config_map.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(KEY.to_owned(), text)])),
        ..ConfigMap::default()
    };
    maps.patch(
        config_map,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&cm),
    )
    .await
    .map_err(err)?;
    Ok((count, true))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;

    use super::*;

    fn pod(name: &str, role: &str, ip: &str, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": "q", "kvgate.io/role": role}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
        }))
        .unwrap()
    }

    #[test]
    fn ready_prefill_pods_only_in_a_stable_order() {
        let pods = [
            pod("p-b", "prefill", "10.0.0.2", true),
            pod("p-a", "prefill", "10.0.0.1", true),
            pod("p-c", "prefill", "10.0.0.3", false),
            pod("d-a", "decode", "10.0.0.4", true),
            pod("p-d", "prefill", "", true),
        ];
        let listed: Vec<Prefiller> = pods.iter().filter_map(prefiller).collect();
        let text = render(listed, &[8000, 8001]);
        assert_eq!(
            text,
            "# Kept by kvgate-operator: the pool's ready prefill pods; changes are overwritten.\n\
             endpoints:\n  - {name: p-a, address: 10.0.0.1, ports: [8000, 8001]}\n  \
             - {name: p-b, address: 10.0.0.2, ports: [8000, 8001]}\n"
        );
        assert!(render(Vec::new(), &[8000]).ends_with("endpoints: []\n"));
    }
}
