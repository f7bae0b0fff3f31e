//! Identities: endpoints (pod × data-parallel rank), nodes, and the holders they pack into.

use thiserror::Error;

/// The largest raw id an [`EndpointId`] or [`NodeId`] may carry (31 bits: the top bit of a
/// packed holder says endpoint or node).
pub const MAX_ID: u32 = (1 << 31) - 1;

/// An id was too large to pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("id {0} exceeds the largest holder id {MAX_ID}")]
pub struct IdOutOfRange(pub u32);

impl IdOutOfRange {
    /// A bounded label value for metrics.
    pub const fn metric_label(&self) -> &'static str {
        "id_out_of_range"
    }
}

/// An endpoint: one engine rank that serves requests (pod × dp rank). Ids are chosen by the
/// caller (the EPP's endpoint table); dense ids are fastest (a lookup's per-thread scratch is
/// then indexed by id; with sparse ids it is a small hash table sized by the candidate count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(u32);

impl EndpointId {
    /// An endpoint id; fails above [`MAX_ID`].
    pub const fn new(raw: u32) -> Result<Self, IdOutOfRange> {
        if raw > MAX_ID {
            Err(IdOutOfRange(raw))
        } else {
            Ok(Self(raw))
        }
    }

    /// The raw id.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// A node: the machine whose KV block manager publishes host/disk/remote tiers shared by every
/// endpoint running on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    /// A node id; fails above [`MAX_ID`].
    pub const fn new(raw: u32) -> Result<Self, IdOutOfRange> {
        if raw > MAX_ID {
            Err(IdOutOfRange(raw))
        } else {
            Ok(Self(raw))
        }
    }

    /// A node id, [`MAX_ID`] for anything above it: for allocators that count names and
    /// would rather share the last id than fail.
    pub const fn saturating(raw: u32) -> Self {
        if raw > MAX_ID {
            Self(MAX_ID)
        } else {
            Self(raw)
        }
    }

    /// The raw id.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// Who holds a block, and who publishes events about it: an endpoint's engine (via its
/// sidecar) or a node's KV block manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Holder {
    /// An endpoint's own tiers (GPU, and the engine's own CPU/disk offload).
    Endpoint(EndpointId),
    /// A node's shared tiers.
    Node(NodeId),
}

const NODE_BIT: u32 = 1 << 31;

impl Holder {
    /// The 32-bit packed form stored in the index.
    pub(crate) const fn pack(self) -> u32 {
        match self {
            Holder::Endpoint(e) => e.0,
            Holder::Node(n) => n.0 | NODE_BIT,
        }
    }

    /// The inverse of [`Holder::pack`].
    pub(crate) const fn unpack(raw: u32) -> Self {
        if raw & NODE_BIT == 0 {
            Holder::Endpoint(EndpointId(raw))
        } else {
            Holder::Node(NodeId(raw & !NODE_BIT))
        }
    }
}

impl From<EndpointId> for Holder {
    fn from(e: EndpointId) -> Self {
        Holder::Endpoint(e)
    }
}

impl From<NodeId> for Holder {
    fn from(n: NodeId) -> Self {
        Holder::Node(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_round_trip_through_packing() {
        for raw in [0, 1, 77, MAX_ID] {
            let e = Holder::Endpoint(EndpointId::new(raw).unwrap());
            let n = Holder::Node(NodeId::new(raw).unwrap());
            assert_eq!(Holder::unpack(e.pack()), e);
            assert_eq!(Holder::unpack(n.pack()), n);
            assert_ne!(e.pack(), n.pack());
        }
        assert_eq!(EndpointId::new(MAX_ID + 1), Err(IdOutOfRange(MAX_ID + 1)));
        assert!(NodeId::new(u32::MAX).is_err());
    }

    #[test]
    fn saturating_node_ids_stop_at_the_largest() {
        assert_eq!(NodeId::saturating(5).get(), 5);
        assert_eq!(NodeId::saturating(MAX_ID).get(), MAX_ID);
        assert_eq!(NodeId::saturating(u32::MAX).get(), MAX_ID);
    }
}
