//! kvgate block keys: a chained xxh3 over full blocks of token ids.
//!
//! ```text
//! seed  = xxh3_64(model_or_lora_name ‖ 0x00 ‖ cache_salt)
//! key_0 = xxh3_64(seed ‖ tokens_0 [‖ extra_0])
//! key_i = xxh3_64(key_{i-1} ‖ tokens_i [‖ extra_i])
//! ```
//! Seeds and keys enter the hash as 8 little-endian bytes, tokens as little-endian u32. Only
//! full blocks are keyed. A block's extra keys (multimodal hashes etc., the raw MessagePack
//! bytes the engine published for that block) are appended after its tokens; since a block's
//! token bytes have a fixed length, the concatenation is unambiguous. The keys do not depend on
//! the engine's own hash algorithm or seed, so the EPP can compute them from a request alone.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// A kvgate block key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

/// The start of a key chain: identifies the model (or LoRA adapter) and the cache salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeySeed(pub u64);

impl KeySeed {
    /// The seed for a model or LoRA adapter name and an optional cache salt.
    pub fn new(model_or_lora: &str, cache_salt: Option<&str>) -> Self {
        let salt = cache_salt.unwrap_or("");
        let mut buf = Vec::with_capacity(model_or_lora.len() + 1 + salt.len());
        buf.extend_from_slice(model_or_lora.as_bytes());
        buf.push(0);
        buf.extend_from_slice(salt.as_bytes());
        KeySeed(xxh3_64(&buf))
    }
}

/// Computes chained keys, reusing one scratch buffer.
#[derive(Debug, Default, Clone)]
pub struct KeyHasher {
    buf: Vec<u8>,
}

impl KeyHasher {
    /// A hasher with an empty scratch buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of one block whose predecessor is `prev` (the seed's value for block 0).
    pub fn next(&mut self, prev: u64, tokens: &[u32], extra: Option<&[u8]>) -> BlockKey {
        self.buf.clear();
        self.buf.extend_from_slice(&prev.to_le_bytes());
        for &t in tokens {
            self.buf.extend_from_slice(&t.to_le_bytes());
        }
        if let Some(extra) = extra {
            self.buf.extend_from_slice(extra);
        }
        BlockKey(xxh3_64(&self.buf))
    }

    /// Appends the keys of every full block of `tokens` to `out`, continuing the chain from
    /// `parent` (or starting it at `seed`). A partial last block is not keyed. A zero block
    /// size keys nothing.
    pub fn extend(
        &mut self,
        seed: KeySeed,
        parent: Option<BlockKey>,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<BlockKey>,
    ) {
        if block_size == 0 {
            return;
        }
        let mut prev = parent.map_or(seed.0, |k| k.0);
        for block in tokens.chunks_exact(block_size) {
            let key = self.next(prev, block, None);
            out.push(key);
            prev = key.0;
        }
    }
}

/// How an engine folds a request's `cache_salt` into its published blocks, and so how a router
/// must key a salted request to match the keys the normaliser derives from the engine's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaltStyle {
    /// vLLM: the salt is the first block's extra key, the tuple `(cache_salt,)`, published as
    /// MessagePack in `extra_keys` and mixed after that block's tokens.
    VllmExtraKey,
    /// SGLang: the salt is published beside the event and goes into the seed.
    Seed,
}

/// The MessagePack bytes vLLM publishes as a salted first block's `extra_keys` entry: the
/// one-element tuple `(cache_salt,)`.
pub fn vllm_salt_extra_key(salt: &str) -> Vec<u8> {
    let mut w = crate::msgpack::Writer::new();
    w.array(1);
    w.str(salt);
    w.into_inner()
}

/// The keys a router computes for a request's prompt: every full block, seeded by the model
/// (or LoRA adapter) name, with the cache salt folded in as the engine does.
pub fn request_block_keys(
    model_or_lora: &str,
    cache_salt: Option<&str>,
    style: SaltStyle,
    tokens: &[u32],
    block_size: usize,
) -> Vec<BlockKey> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return out;
    }
    let mut hasher = KeyHasher::new();
    match (cache_salt, style) {
        (Some(salt), SaltStyle::VllmExtraKey) => {
            let Some(first) = tokens.get(..block_size) else {
                return out;
            };
            let extra = vllm_salt_extra_key(salt);
            let key0 = hasher.next(KeySeed::new(model_or_lora, None).0, first, Some(&extra));
            out.push(key0);
            let rest = tokens.get(block_size..).unwrap_or_default();
            hasher.extend(
                KeySeed::new(model_or_lora, None),
                Some(key0),
                rest,
                block_size,
                &mut out,
            );
        }
        (salt, _) => {
            hasher.extend(
                KeySeed::new(model_or_lora, salt),
                None,
                tokens,
                block_size,
                &mut out,
            );
        }
    }
    out
}

/// The keys of every full block of a prompt (convenience for one-off use).
pub fn block_keys(seed: KeySeed, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    KeyHasher::new().extend(seed, None, tokens, block_size, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salted_vllm_keys_mix_the_salt_into_the_first_block_only() {
        let t: Vec<u32> = (0..40).collect();
        let plain = request_block_keys("m", None, SaltStyle::VllmExtraKey, &t, 16);
        assert_eq!(plain, block_keys(KeySeed::new("m", None), &t, 16));
        let salted = request_block_keys("m", Some("s"), SaltStyle::VllmExtraKey, &t, 16);
        assert_eq!(salted.len(), 2);
        let extra = vllm_salt_extra_key("s");
        assert_eq!(extra, vec![0x91, 0xa1, b's']);
        let k0 = KeyHasher::new().next(KeySeed::new("m", None).0, &t[..16], Some(&extra));
        assert_eq!(salted[0], k0);
        assert_eq!(salted[1], KeyHasher::new().next(k0.0, &t[16..32], None));
        let sglang = request_block_keys("m", Some("s"), SaltStyle::Seed, &t, 16);
        assert_eq!(sglang, block_keys(KeySeed::new("m", Some("s")), &t, 16));
        assert!(
            request_block_keys("m", Some("s"), SaltStyle::VllmExtraKey, &t[..3], 16).is_empty()
        );
    }

    #[test]
    fn keys_follow_the_documented_formula() {
        let seed = KeySeed::new("m", Some("s"));
        assert_eq!(seed.0, xxh3_64(b"m\0s"));
        assert_eq!(KeySeed::new("m", None).0, xxh3_64(b"m\0"));
        let tokens = [1u32, 2, 3, 4, 5];
        let keys = block_keys(seed, &tokens, 2);
        assert_eq!(keys.len(), 2, "the partial block [5] is not keyed");
        let mut b0 = seed.0.to_le_bytes().to_vec();
        b0.extend([1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(keys[0].0, xxh3_64(&b0));
        let mut b1 = keys[0].0.to_le_bytes().to_vec();
        b1.extend([3, 0, 0, 0, 4, 0, 0, 0]);
        assert_eq!(keys[1].0, xxh3_64(&b1));
    }

    #[test]
    fn chains_depend_on_model_salt_and_prefix() {
        let t: Vec<u32> = (0..64).collect();
        let a = block_keys(KeySeed::new("a", None), &t, 16);
        let b = block_keys(KeySeed::new("b", None), &t, 16);
        let salted = block_keys(KeySeed::new("a", Some("x")), &t, 16);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert!(a.iter().zip(&salted).all(|(x, y)| x != y));
        // Continuing from a parent equals keying the whole prefix at once.
        let mut h = KeyHasher::new();
        let mut tail = Vec::new();
        h.extend(KeySeed::new("a", None), Some(a[1]), &t[32..], 16, &mut tail);
        assert_eq!(tail, a[2..]);
        assert!(block_keys(KeySeed::new("a", None), &t, 0).is_empty());
    }
}
