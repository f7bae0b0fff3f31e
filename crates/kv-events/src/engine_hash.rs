//! The engines' own block hashes, reproduced for verification and for the simulator.
//!
//! vLLM (`--prefix-caching-hash-algo sha256_cbor`):
//! `digest_i = SHA-256(cbor_canonical((parent_digest or NONE_HASH, tokens_i, extra_keys_i)))`,
//! `NONE_HASH = SHA-256(cbor(PYTHONHASHSEED))`, or of `"vllm-none-hash"` when the variable is
//! unset (vLLM ≥ 0.26 behaviour; older releases used random bytes), published as the digest's
//! last 8 bytes read big-endian.
//!
//! SGLang: `digest_i = SHA-256(digest_{i-1} ‖ tokens_i as u32 LE)` with nothing before the first
//! page, published as the digest's first 8 bytes read as a signed big-endian integer.

use sha2::{Digest as _, Sha256};

use crate::engine::EngineHash;

/// A SHA-256 block digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The value vLLM publishes: the last 8 bytes, big-endian.
    pub fn vllm_published(&self) -> EngineHash {
        let mut be = [0u8; 8];
        be.copy_from_slice(self.0.get(24..).unwrap_or(&[0; 8]));
        EngineHash(u64::from_be_bytes(be))
    }

    /// The value SGLang publishes: the first 8 bytes as a signed big-endian integer.
    pub fn sglang_published(&self) -> EngineHash {
        let mut be = [0u8; 8];
        be.copy_from_slice(self.0.get(..8).unwrap_or(&[0; 8]));
        EngineHash(u64::from_be_bytes(be))
    }
}

fn sha256(bytes: &[u8]) -> Digest {
    Digest(Sha256::digest(bytes).into())
}

/// A CBOR value, for the extra keys vLLM mixes into a block hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CborValue {
    /// `null`.
    Null,
    /// An integer.
    Int(i64),
    /// A text string.
    Text(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// An array (Python tuples and lists).
    Array(Vec<CborValue>),
}

/// Canonical (RFC 8949 §4.2.1 length-first core) CBOR encoding of the few types vLLM hashes.
#[derive(Debug, Default)]
struct Cbor(Vec<u8>);

impl Cbor {
    fn head(&mut self, major: u8, v: u64) {
        let m = major << 5;
        if v < 24 {
            self.0.push(m | v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.0.extend_from_slice(&[m | 24, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.0.push(m | 25);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.0.push(m | 26);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(m | 27);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn value(&mut self, v: &CborValue) {
        match v {
            CborValue::Null => self.0.push(0xf6),
            CborValue::Int(i) if *i >= 0 => self.head(0, i.unsigned_abs()),
            CborValue::Int(i) => self.head(1, (-1 - *i).unsigned_abs()),
            CborValue::Text(s) => {
                self.head(3, s.len() as u64);
                self.0.extend_from_slice(s.as_bytes());
            }
            CborValue::Bytes(b) => {
                self.head(2, b.len() as u64);
                self.0.extend_from_slice(b);
            }
            CborValue::Array(items) => {
                self.head(4, items.len() as u64);
                for item in items {
                    self.value(item);
                }
            }
        }
    }
}

/// vLLM's `NONE_HASH` for a `PYTHONHASHSEED` value (`None` when the variable is unset).
pub fn vllm_none_hash(python_hash_seed: Option<&str>) -> Digest {
    let seed = python_hash_seed.unwrap_or("vllm-none-hash");
    let mut c = Cbor::default();
    c.value(&CborValue::Text(seed.to_owned()));
    sha256(&c.0)
}

/// vLLM's `sha256_cbor` digest of one block.
pub fn vllm_block_digest(parent: &Digest, tokens: &[u32], extra: Option<&CborValue>) -> Digest {
    let mut c = Cbor(Vec::with_capacity(48 + tokens.len() * 5));
    c.head(4, 3);
    c.head(2, 32);
    c.0.extend_from_slice(&parent.0);
    c.head(4, tokens.len() as u64);
    for &t in tokens {
        c.head(0, u64::from(t));
    }
    c.value(extra.unwrap_or(&CborValue::Null));
    sha256(&c.0)
}

/// vLLM's digests of every full block of `tokens`, continuing from `parent` (or NONE_HASH).
pub fn vllm_block_digests(
    none_hash: &Digest,
    parent: Option<&Digest>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<Digest> {
    let mut prev = *parent.unwrap_or(none_hash);
    let mut out = Vec::new();
    if block_size == 0 {
        return out;
    }
    for block in tokens.chunks_exact(block_size) {
        prev = vllm_block_digest(&prev, block, None);
        out.push(prev);
    }
    out
}

/// SGLang's digests of every full page of `tokens`, continuing from `parent`.
pub fn sglang_page_digests(
    parent: Option<&Digest>,
    tokens: &[u32],
    page_size: usize,
) -> Vec<Digest> {
    let mut prev = parent.copied();
    let mut out = Vec::new();
    if page_size == 0 {
        return out;
    }
    let mut buf = Vec::with_capacity(32 + page_size * 4);
    for page in tokens.chunks_exact(page_size) {
        buf.clear();
        if let Some(p) = prev {
            buf.extend_from_slice(&p.0);
        }
        for &t in page {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let d = sha256(&buf);
        out.push(d);
        prev = Some(d);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_matches_real_vllm() {
        assert_eq!(
            hex::encode(vllm_none_hash(Some("0")).0),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
        assert_eq!(
            hex::encode(vllm_none_hash(None).0),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }

    #[test]
    fn cbor_heads_are_minimal() {
        let mut c = Cbor::default();
        c.value(&CborValue::Array(vec![
            CborValue::Int(23),
            CborValue::Int(24),
            CborValue::Int(-1),
            CborValue::Int(-25),
            CborValue::Int(65536),
        ]));
        assert_eq!(
            c.0,
            [0x85, 0x17, 0x18, 0x18, 0x20, 0x38, 0x18, 0x1a, 0, 1, 0, 0]
        );
    }
}
