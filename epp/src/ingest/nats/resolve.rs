//! Who an envelope's [`Source`] is in this EPP: a live endpoint (by pod name and port, else by
//! IP and port) or a node discovery knows, whose block manager serves this pool's model (a node
//! may run one block manager per model; the index keeps one node holder, for this model).
//! Sources discovery does not know resolve to `None`; the caller counts them and tries again
//! later.

use std::net::IpAddr;

use kv_events::Source;
use kv_index::Holder;

use crate::discovery::Datastore;
use crate::discovery::apply::NodeIds;

/// Maps sources to index holders through the discovery state.
#[derive(Debug, Clone, Copy)]
pub struct Resolver<'a> {
    /// Endpoints.
    pub datastore: &'a Datastore,
    /// Node names.
    pub nodes: &'a NodeIds,
    /// The pool's served model: node sources of other models are not this EPP's.
    pub model: &'a str,
}

impl Resolver<'_> {
    /// The holder `source` publishes for, if discovery knows it.
    pub fn holder(&self, source: &Source) -> Option<Holder> {
        if source.pod.is_none() && source.ip.is_none() {
            if source.model != self.model {
                return None;
            }
            return source
                .node
                .as_deref()
                .and_then(|n| self.nodes.get(n))
                .map(Holder::Node);
        }
        let port = source.port?;
        if let Some(pod) = &source.pod
            && let Some(id) = self.datastore.live_id(&(pod.clone(), port))
        {
            return Some(Holder::Endpoint(id));
        }
        let ip: IpAddr = source.ip.as_deref()?.parse().ok()?;
        self.datastore
            .snapshot()
            .iter()
            .find(|e| e.address.ip() == ip && e.address.port() == port)
            .map(|e| Holder::Endpoint(e.id))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use kv_events::envelope::EngineKind;
    use scheduler::Endpoint;

    use super::*;

    fn source(pod: Option<&str>, ip: Option<&str>, port: Option<u16>) -> Source {
        Source {
            namespace: "ns".into(),
            pool: pod.map(|_| "p".into()),
            pod: pod.map(Into::into),
            ip: ip.map(Into::into),
            port,
            dp_rank: 0,
            node: Some("node-a".into()),
            model: "m".into(),
            engine: EngineKind::Vllm,
            block_size: 16,
        }
    }

    #[test]
    fn by_pod_then_address_then_node() {
        let ds = Datastore::new();
        let nodes = NodeIds::default();
        let key = ("pod-a".to_owned(), 8000);
        let id = ds.id_for(&key);
        ds.replace(vec![(
            key,
            Endpoint::new(id, "10.0.0.5:8000".parse().unwrap()),
        )]);
        let r = Resolver {
            datastore: &ds,
            nodes: &nodes,
            model: "m",
        };
        let want = Some(Holder::Endpoint(id));
        assert_eq!(r.holder(&source(Some("pod-a"), None, Some(8000))), want);
        assert_eq!(
            r.holder(&source(Some("renamed"), Some("10.0.0.5"), Some(8000))),
            want
        );
        assert_eq!(r.holder(&source(Some("pod-a"), None, Some(8001))), None);
        assert_eq!(
            r.holder(&source(Some("x"), Some("bad ip"), Some(8000))),
            None
        );
        assert_eq!(r.holder(&source(None, None, None)), None, "unknown node");
        let n = nodes.id("node-a");
        assert_eq!(r.holder(&source(None, None, None)), Some(Holder::Node(n)));
        let mut other = source(None, None, None);
        other.model = "another-pool's-model".into();
        assert_eq!(r.holder(&other), None, "another model's block manager");
    }
}
