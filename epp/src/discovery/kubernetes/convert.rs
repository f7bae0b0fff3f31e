//! Pure conversion: a Pod into the facts discovery needs ([`PodView`]), and a pool with its pods
//! into the endpoint list the file discovery also produces ([`Parsed`]), which
//! [`apply`](crate::discovery::apply::apply) installs.
//!
//! - A pod without an IP, or in phase `Succeeded`/`Failed`, yields nothing.
//! - A pod is ready when its `Ready` condition is `True` and it is not being deleted
//!   (`deletionTimestamp` set). Not-ready pods stay in the list with `ready: false`, so their
//!   KV-index entries survive a readiness blip; they are never picked.
//! - Each valid target port is an endpoint `podIP:port`; its index in `targetPorts` is the
//!   data-parallel rank. Ports outside 1..=65535 and repeats are skipped.
//! - The role comes from the label `kvgate.io/role` (`prefill`, `decode`, `both`), else from
//!   `llm-d.ai/role` (whose combined values `prefill-decode`, `encode-prefill`, … are read by their
//!   prefill/decode parts; an encode-only pod is no endpoint), else `both`.
//! - The node name (`spec.nodeName`) links the endpoint to its node's KV tiers.
//! - Direct-ZMQ mode: annotations `kvgate.io/kv-events-port` and `kvgate.io/kv-replay-port`
//!   give the engine's KV-event PUB and replay ROUTER ports on the pod IP (rank *i* adds *i*).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use api::pool::PoolView;
use k8s_openapi::api::core::v1::Pod;
use scheduler::Role;

use crate::discovery::file::Parsed;

/// kvgate's role label.
pub const ROLE_LABEL: &str = "kvgate.io/role";
/// llm-d's role label, read when kvgate's is absent.
pub const LLM_D_ROLE_LABEL: &str = "llm-d.ai/role";
/// Annotation: the engine's KV-event PUB port (direct-ZMQ mode).
pub const EVENTS_PORT_ANNOTATION: &str = "kvgate.io/kv-events-port";
/// Annotation: the engine's KV-event replay ROUTER port.
pub const REPLAY_PORT_ANNOTATION: &str = "kvgate.io/kv-replay-port";
/// Most target ports read from a pool (the API allows 8).
pub const MAX_TARGET_PORTS: usize = 8;

/// What discovery keeps of a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// Pod name (identity with the port).
    pub name: String,
    /// Its labels, to re-check the pool's selector.
    pub labels: BTreeMap<String, String>,
    /// Pod IP.
    pub ip: IpAddr,
    /// Ready and not terminating.
    pub ready: bool,
    /// Node name.
    pub node: Option<String>,
    /// Role in a disaggregated pool.
    pub role: Role,
    /// KV-event PUB port (rank 0), direct-ZMQ mode.
    pub events_port: Option<u16>,
    /// KV-event replay port (rank 0).
    pub replay_port: Option<u16>,
}

/// The role a pod's labels give it; `None` for a pod that serves neither prefill nor decode.
pub fn role_of(labels: &BTreeMap<String, String>) -> Option<Role> {
    let value = labels
        .get(ROLE_LABEL)
        .or_else(|| labels.get(LLM_D_ROLE_LABEL));
    let Some(value) = value else {
        return Some(Role::Both);
    };
    let parts: BTreeSet<&str> = value.split('-').map(str::trim).collect();
    match (
        parts.contains("prefill"),
        parts.contains("decode"),
        parts.contains("both"),
    ) {
        (true, true, _) | (_, _, true) => Some(Role::Both),
        (true, false, false) => Some(Role::Prefill),
        (false, true, false) => Some(Role::Decode),
        (false, false, false) if parts.iter().all(|p| *p == "encode") => None,
        (false, false, false) => {
            tracing::debug!(role = %value, "unknown role label value; treating the pod as both");
            Some(Role::Both)
        }
    }
}

/// The facts of a pod, or `None` when it can serve nothing (no IP, finished, no name).
pub fn pod_view(pod: &Pod) -> Option<PodView> {
    let name = pod.metadata.name.clone()?;
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let ready_condition = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ready = ready_condition && pod.metadata.deletion_timestamp.is_none();
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let role = role_of(&labels)?;
    let annotation = |key: &str| -> Option<u16> {
        let value = pod.metadata.annotations.as_ref()?.get(key)?;
        value.trim().parse::<u16>().ok().filter(|p| *p != 0)
    };
    Some(PodView {
        name,
        ip,
        ready,
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        role,
        events_port: annotation(EVENTS_PORT_ANNOTATION),
        replay_port: annotation(REPLAY_PORT_ANNOTATION),
        labels,
    })
}

/// The pool's valid target ports in rank order (1..=65535, first occurrence kept, at most
/// [`MAX_TARGET_PORTS`]). A repeated port keeps its first rank.
pub fn target_ports(pool: &PoolView) -> Vec<(usize, u16)> {
    let mut seen = BTreeSet::new();
    pool.target_ports
        .iter()
        .take(MAX_TARGET_PORTS)
        .enumerate()
        .filter_map(|(rank, p)| {
            let port = u16::try_from(*p).ok().filter(|p| *p != 0)?;
            seen.insert(port).then_some((rank, port))
        })
        .collect()
}

fn zmq_endpoint(ip: IpAddr, base: Option<u16>, rank: usize) -> Option<String> {
    let port = base?.checked_add(u16::try_from(rank).ok()?)?;
    Some(format!("tcp://{}", SocketAddr::new(ip, port)))
}

/// The endpoints of `pods` under `pool`: every selected pod × every target port, in pod-name
/// then rank order.
pub fn endpoints<'a>(pool: &PoolView, pods: impl IntoIterator<Item = &'a PodView>) -> Vec<Parsed> {
    let ports = target_ports(pool);
    let mut out = Vec::new();
    let mut selected: Vec<&PodView> = pods
        .into_iter()
        .filter(|p| pool.selects(&p.labels))
        .collect();
    selected.sort_by(|a, b| a.name.cmp(&b.name));
    for pod in selected {
        for &(rank, port) in &ports {
            out.push(Parsed {
                key: (pod.name.clone(), port),
                address: SocketAddr::new(pod.ip, port),
                node: pod.node.clone(),
                role: pod.role,
                ready: pod.ready,
                models: BTreeSet::new(),
                events: zmq_endpoint(pod.ip, pod.events_port, rank),
                replay: zmq_endpoint(pod.ip, pod.replay_port, rank),
            });
        }
    }
    out
}

#[cfg(test)]
#[path = "convert_tests.rs"]
mod tests;
