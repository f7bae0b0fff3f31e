//! The remote tier (G4) at the edge: a Redis client ([`redis`]) over a bounded RESP2 codec
//! ([`resp`]), and the names blocks take there.
//!
//! Redis is shared by every node's daemon, so a block's name carries what makes its bytes
//! interchangeable: the layout's [fingerprint](crate::store::Layout::fingerprint) (not the
//! per-daemon [`LayoutId`](crate::store::LayoutId)) and the kvgate key. Two nodes that offload
//! the same block write the same bytes under the same name.

pub mod redis;
pub mod resp;

use kv_events::BlockKey;

/// The Redis key of a block: `kvgate:kvbm:<layout fingerprint>:<block key>`, both 16 hex
/// digits.
pub fn block_name(layout_fingerprint: u64, key: BlockKey) -> String {
    format!("kvgate:kvbm:{layout_fingerprint:016x}:{:016x}", key.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_fixed_width_and_layout_scoped() {
        assert_eq!(
            block_name(0xab, BlockKey(1)),
            "kvgate:kvbm:00000000000000ab:0000000000000001"
        );
        assert_ne!(block_name(1, BlockKey(7)), block_name(2, BlockKey(7)));
    }
}
