//! kvgate's own KV events: what sidecars and the KV block manager publish, keyed by
//! [`BlockKey`] rather than by any engine's hash.

use serde::{Deserialize, Serialize};

use crate::key::BlockKey;
use crate::tier::Tier;

/// One kvgate KV event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Blocks became resident in `tier`, chained after `parent`.
    Stored {
        /// The blocks' keys, in chain order.
        keys: Vec<BlockKey>,
        /// The key of the block before the first, if any.
        parent: Option<BlockKey>,
        /// Where they are now resident.
        tier: Tier,
        /// The LoRA adapter, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lora: Option<String>,
        /// Tokens covered by the blocks (0 when the engine sent none, e.g. a lower-tier copy).
        token_count: u32,
    },
    /// Blocks stopped being resident in `tier`.
    Removed {
        /// The blocks' keys.
        keys: Vec<BlockKey>,
        /// The tier they left.
        tier: Tier,
    },
    /// Every block of one tier (or of all tiers when `None`) is gone.
    Cleared {
        /// The tier cleared, or all.
        #[serde(default)]
        tier: Option<Tier>,
    },
    /// An event type from a newer kvgate; receivers skip it.
    #[serde(other)]
    Unknown,
}

impl KvEvent {
    /// How many block keys the event carries.
    pub fn key_count(&self) -> usize {
        match self {
            KvEvent::Stored { keys, .. } | KvEvent::Removed { keys, .. } => keys.len(),
            KvEvent::Cleared { .. } | KvEvent::Unknown => 0,
        }
    }
}
