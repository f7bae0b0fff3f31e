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

use std::ops::Range;

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
/// (or LoRA adapter) name, with the cache salt folded in as the engine does. The whole prompt
/// at once; [`KeyChain`] gives the same keys as the ids arrive.
pub fn request_block_keys(
    model_or_lora: &str,
    cache_salt: Option<&str>,
    style: SaltStyle,
    tokens: &[u32],
    block_size: usize,
) -> Vec<BlockKey> {
    let mut chain = KeyChain::new(model_or_lora, cache_salt, style, block_size);
    chain.reserve(tokens.len() / block_size.max(1));
    chain.advance(tokens);
    chain.into_keys()
}

/// A request's block keys derived as its prompt's token ids arrive, a longer prefix at a time:
/// the one place a request's seed and salt are resolved (see [`request_block_keys`]).
///
/// A salt in [`SaltStyle::VllmExtraKey`] is the first block's extra key and leaves the seed
/// unsalted; in [`SaltStyle::Seed`] it goes into the seed.
#[derive(Debug, Clone)]
pub struct KeyChain {
    seed: KeySeed,
    first_extra: Option<Vec<u8>>,
    block_size: usize,
    hasher: KeyHasher,
    keys: Vec<BlockKey>,
}

impl KeyChain {
    /// A chain for `model_or_lora` with the request's `cache_salt` folded in `style`.
    pub fn new(
        model_or_lora: &str,
        cache_salt: Option<&str>,
        style: SaltStyle,
        block_size: usize,
    ) -> Self {
        let (seed, first_extra) = match (cache_salt, style) {
            (Some(salt), SaltStyle::VllmExtraKey) => (
                KeySeed::new(model_or_lora, None),
                Some(vllm_salt_extra_key(salt)),
            ),
            (salt, _) => (KeySeed::new(model_or_lora, salt), None),
        };
        Self {
            seed,
            first_extra,
            block_size,
            hasher: KeyHasher::new(),
            keys: Vec::new(),
        }
    }

    /// Room for `additional` more keys.
    pub fn reserve(&mut self, additional: usize) {
        self.keys.reserve(additional);
    }

    /// Keys every full block of `ids` (the prompt's ids so far, a longer prefix on each call)
    /// not keyed yet; returns the indices of the new keys. A zero block size keys nothing.
    pub fn advance(&mut self, ids: &[u32]) -> Range<usize> {
        let start = self.keys.len();
        if self.block_size == 0 {
            return start..start;
        }
        let from = start.saturating_mul(self.block_size);
        let rest = ids.get(from..).unwrap_or_default();
        let mut prev = self.keys.last().map(|k| k.0);
        for block in rest.chunks_exact(self.block_size) {
            let key = match prev {
                Some(p) => self.hasher.next(p, block, None),
                None => self
                    .hasher
                    .next(self.seed.0, block, self.first_extra.as_deref()),
            };
            self.keys.push(key);
            prev = Some(key.0);
        }
        start..self.keys.len()
    }

    /// The keys so far.
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// The keys, consuming the chain.
    pub fn into_keys(self) -> Vec<BlockKey> {
        self.keys
    }
}

/// The keys of every full block of a prompt (convenience for one-off use).
pub fn block_keys(seed: KeySeed, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    KeyHasher::new().extend(seed, None, tokens, block_size, &mut out);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    /// The documented formula, spelled out on its own: the salt is block 0's extra key (vLLM)
    /// or part of the seed (SGLang).
    fn naive_request_keys(
        salt: Option<&str>,
        style: SaltStyle,
        ids: &[u32],
        block: usize,
    ) -> Vec<BlockKey> {
        if block == 0 {
            return Vec::new();
        }
        let (seed, extra) = match (salt, style) {
            (Some(s), SaltStyle::VllmExtraKey) => {
                (KeySeed::new("m", None), Some(vllm_salt_extra_key(s)))
            }
            (s, _) => (KeySeed::new("m", s), None),
        };
        let mut prev = seed.0;
        let mut out = Vec::new();
        for (i, b) in ids.chunks_exact(block).enumerate() {
            let mut bytes = prev.to_le_bytes().to_vec();
            for t in b {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            if i == 0
                && let Some(e) = &extra
            {
                bytes.extend_from_slice(e);
            }
            prev = xxh3_64(&bytes);
            out.push(BlockKey(prev));
        }
        out
    }

    proptest! {
        /// A chain fed growing prefixes gives the formula's keys, and so does
        /// `request_block_keys`, however the ids arrive, salted or not.
        #[test]
        fn chains_equal_the_formula_however_ids_arrive(
            ids in prop::collection::vec(0u32..1000, 0..200),
            cuts in prop::collection::vec(0usize..200, 0..8),
            block in 0usize..9,
            salt in prop::option::of("[a-z]{1,4}"),
            vllm in any::<bool>(),
        ) {
            let style = if vllm { SaltStyle::VllmExtraKey } else { SaltStyle::Seed };
            let want = naive_request_keys(salt.as_deref(), style, &ids, block);
            let mut chain = KeyChain::new("m", salt.as_deref(), style, block);
            let mut cuts = cuts;
            cuts.push(ids.len());
            cuts.sort_unstable();
            let mut seen = 0;
            for c in cuts {
                let new = chain.advance(&ids[..c.min(ids.len())]);
                prop_assert_eq!(new.start, seen);
                prop_assert_eq!(&chain.keys()[..new.end], &want[..new.end]);
                seen = new.end;
            }
            prop_assert_eq!(chain.keys(), &want[..]);
            let whole = request_block_keys("m", salt.as_deref(), style, &ids, block);
            prop_assert_eq!(whole, want);
        }
    }

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

    /// Golden values: the Python connector (`connectors/vllm/tests/test_keys.py`) pins the same
    /// ones, so the two implementations of the formula cannot drift apart.
    #[test]
    fn keys_match_the_python_connectors_golden_values() {
        let tokens: Vec<u32> = (1..=64).collect();
        let plain = request_block_keys("tiny", None, SaltStyle::VllmExtraKey, &tokens, 32);
        assert_eq!(
            plain,
            [
                BlockKey(0x0fc2_27e9_5bb2_e74f),
                BlockKey(0x0830_08a9_c290_7837)
            ]
        );
        let salted = request_block_keys("tiny", Some("s1"), SaltStyle::VllmExtraKey, &tokens, 32);
        assert_eq!(
            salted,
            [
                BlockKey(0x63e1_920f_49cb_ab14),
                BlockKey(0xc853_cc2a_069d_d863)
            ]
        );
    }
}
