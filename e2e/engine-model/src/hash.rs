//! Block hashing: the per-request chain that names full blocks in the prefix cache.
//!
//! vLLM hashes a request's blocks as tokens fill them (prompt blocks when the request arrives,
//! generated-token blocks as they complete), each hash chained on the previous one and seeded
//! with whatever makes the request's cache namespace (LoRA, cache salt, multimodal keys). The
//! engine model only needs the sequence of hashes, so the chain is a trait: the live simulator
//! plugs in vLLM's own `sha256_cbor` chain, while tests and the discrete-event replay use
//! [`XxhChain`].

use xxhash_rust::xxh3::xxh3_64;

/// Hashes the full blocks of one request, in order.
///
/// Implementations capture the request's salt, LoRA and seed; the engine calls
/// [`next_block`](Self::next_block) once per full block, first block first, and never skips one.
pub trait BlockHashChain: Send + std::fmt::Debug {
    /// Hash of the next full block (`tokens.len() == block_size`), chained on the previous ones.
    fn next_block(&mut self, tokens: &[u32]) -> u64;
}

/// A chained xxh3-64 over full blocks.
///
/// `h_0 = xxh3_64(seed ‖ tokens_0)`, `h_i = xxh3_64(h_{i-1} ‖ tokens_i)`, with the previous hash
/// (or the seed) as 8 little-endian bytes and tokens as little-endian `u32`. This is the same
/// encoding as kvgate's own block keys (`kv-events`' `key` module), so with the same seed the
/// engine's hashes equal the keys the EPP computes.
#[derive(Debug, Clone)]
pub struct XxhChain {
    prev: u64,
    buf: Vec<u8>,
}

impl XxhChain {
    /// A chain whose first block is chained on `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            prev: seed,
            buf: Vec::new(),
        }
    }
}

impl BlockHashChain for XxhChain {
    fn next_block(&mut self, tokens: &[u32]) -> u64 {
        self.buf.clear();
        self.buf.extend_from_slice(&self.prev.to_le_bytes());
        for &t in tokens {
            self.buf.extend_from_slice(&t.to_le_bytes());
        }
        self.prev = xxh3_64(&self.buf);
        self.prev
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(prev: u64, tokens: &[u32]) -> Vec<u8> {
        let mut b = prev.to_le_bytes().to_vec();
        for t in tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        b
    }

    #[test]
    fn chain_matches_the_documented_encoding() {
        let mut c = XxhChain::new(7);
        let h0 = c.next_block(&[1, 2]);
        let h1 = c.next_block(&[3, 4]);
        assert_eq!(h0, xxh3_64(&bytes(7, &[1, 2])));
        assert_eq!(h1, xxh3_64(&bytes(h0, &[3, 4])));
    }

    #[test]
    fn seed_and_order_change_the_hashes() {
        let a = XxhChain::new(1).next_block(&[1, 2]);
        let b = XxhChain::new(2).next_block(&[1, 2]);
        assert_ne!(a, b);
        let mut c = XxhChain::new(1);
        c.next_block(&[9, 9]);
        assert_ne!(
            c.next_block(&[1, 2]),
            a,
            "same tokens after a different parent"
        );
    }
}
