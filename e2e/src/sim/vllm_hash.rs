//! vLLM's `sha256_cbor` block-hash chain, as the engine model's [`BlockHashChain`].
//!
//! `digest_i = SHA-256(cbor((digest_{i-1} or NONE_HASH, tokens_i, extra_i)))`, where `NONE_HASH`
//! derives from `PYTHONHASHSEED` and `extra_0 = (cache_salt,)` for a salted request (vLLM puts
//! the salt into the first block's extra keys only). The published hash is the digest's last
//! 8 bytes, big-endian.

use engine_model::BlockHashChain;
use kv_events::engine_hash::{CborValue, Digest, vllm_block_digest};

/// One request's chain.
#[derive(Debug, Clone)]
pub struct VllmChain {
    prev: Digest,
    salt: Option<String>,
    index: u32,
}

impl VllmChain {
    /// A chain starting at `none_hash` for a request with an optional cache salt.
    pub fn new(none_hash: Digest, salt: Option<String>) -> Self {
        Self {
            prev: none_hash,
            salt,
            index: 0,
        }
    }
}

impl BlockHashChain for VllmChain {
    fn next_block(&mut self, tokens: &[u32]) -> u64 {
        let extra = match (&self.salt, self.index) {
            (Some(salt), 0) => Some(CborValue::Array(vec![CborValue::Text(salt.clone())])),
            _ => None,
        };
        self.prev = vllm_block_digest(&self.prev, tokens, extra.as_ref());
        self.index += 1;
        self.prev.vllm_published().0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::engine_hash::{vllm_block_digests, vllm_none_hash};

    #[test]
    fn unsalted_chain_equals_kv_events_digests() {
        let none = vllm_none_hash(Some("0"));
        let tokens: Vec<u32> = (0..64).collect();
        let want: Vec<u64> = vllm_block_digests(&none, None, &tokens, 16)
            .iter()
            .map(|d| d.vllm_published().0)
            .collect();
        let mut chain = VllmChain::new(none, None);
        let got: Vec<u64> = tokens.chunks(16).map(|b| chain.next_block(b)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn salt_changes_every_hash_through_the_chain() {
        let none = vllm_none_hash(Some("0"));
        let tokens: Vec<u32> = (0..32).collect();
        let mut plain = VllmChain::new(none, None);
        let mut salted = VllmChain::new(none, Some("s".into()));
        for b in tokens.chunks(16) {
            assert_ne!(plain.next_block(b), salted.next_block(b));
        }
    }
}
