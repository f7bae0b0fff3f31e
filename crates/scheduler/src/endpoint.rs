//! The endpoints a decision chooses among, and what a decision hands back for each pick.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use kv_index::{EndpointId, NodeId};

/// What an endpoint does in a disaggregated (P/D) pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Role {
    /// Prefill and decode on the same engine (an aggregated pool; the default).
    #[default]
    Both,
    /// Prefill only: chosen as the prefill leg of a disaggregated request, never as primary.
    Prefill,
    /// Decode (and local prefill when no prefill leg is chosen).
    Decode,
}

impl Role {
    /// Whether the endpoint can be a request's primary (the decode side).
    pub const fn serves_decode(self) -> bool {
        matches!(self, Role::Both | Role::Decode)
    }

    /// Whether the endpoint can take a disaggregated request's prefill leg.
    pub const fn is_prefill(self) -> bool {
        matches!(self, Role::Prefill)
    }

    /// The pod-label spelling (`kvgate.io/role`, `llm-d.ai/role`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One engine rank the scheduler may route to (a pod × target port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The id the KV index and the load books know it by.
    pub id: EndpointId,
    /// Where Envoy sends the request (`ip:port`, the destination header's value).
    pub address: SocketAddr,
    /// The node it runs on, when known. The scheduler does not read it: discovery hands it to
    /// `KvIndex::set_endpoint_node` so the node's host/disk tiers are credited to the endpoint.
    pub node: Option<NodeId>,
    /// Whether it may receive requests (pod ready, not draining).
    pub ready: bool,
    /// Its role in a disaggregated pool.
    pub role: Role,
    /// Model and LoRA adapter names it serves; empty means any.
    pub models: BTreeSet<String>,
}

impl Endpoint {
    /// A ready endpoint with role [`Role::Both`] serving any model.
    pub fn new(id: EndpointId, address: SocketAddr) -> Self {
        Self {
            id,
            address,
            node: None,
            ready: true,
            role: Role::Both,
            models: BTreeSet::new(),
        }
    }

    /// Whether it serves `model` (an empty request model matches every endpoint).
    pub fn serves_model(&self, model: &str) -> bool {
        model.is_empty() || self.models.is_empty() || self.models.contains(model)
    }

    /// The pick a decision returns for it.
    pub const fn pick(&self) -> Pick {
        Pick {
            endpoint: self.id,
            address: self.address,
        }
    }
}

/// A chosen endpoint: the id for the load books, the address for the destination header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pick {
    /// The endpoint's id.
    pub endpoint: EndpointId,
    /// Its `ip:port`.
    pub address: SocketAddr,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_split_decode_and_prefill() {
        assert!(Role::Both.serves_decode() && !Role::Both.is_prefill());
        assert!(Role::Decode.serves_decode() && !Role::Decode.is_prefill());
        assert!(!Role::Prefill.serves_decode() && Role::Prefill.is_prefill());
        assert_eq!(Role::default(), Role::Both);
    }

    #[test]
    fn empty_model_set_serves_any_model() {
        let mut e = Endpoint::new(
            EndpointId::new(1).unwrap(),
            "10.0.0.1:8000".parse().unwrap(),
        );
        assert!(e.serves_model("llama") && e.serves_model(""));
        e.models.insert("llama".into());
        e.models.insert("llama-lora-sql".into());
        assert!(e.serves_model("llama") && e.serves_model("llama-lora-sql"));
        assert!(!e.serves_model("qwen"));
        assert!(e.serves_model(""));
    }
}
