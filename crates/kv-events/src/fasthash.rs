//! A hasher for maps keyed by values that are already uniformly distributed 64-bit hashes
//! (engine block hashes, kvgate block keys). SipHash would add ~20 ns per lookup for nothing.
//!
//! Keys here come from SHA-256 (engine hashes) or xxh3 over tokens (kvgate keys); the final
//! multiply-xorshift spreads any structure left in the low bits that the table indexes by.

use std::hash::{BuildHasherDefault, Hasher};

/// Hashes one `u64` with a multiply and an xor-shift.
#[derive(Debug, Default, Clone, Copy)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys that are not a single u64; fold the bytes in.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x100_0000_01B3);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// The `BuildHasher` for [`U64Hasher`].
pub type BuildU64Hasher = BuildHasherDefault<U64Hasher>;

/// A `HashMap` keyed by well-distributed 64-bit values.
pub type U64Map<K, V> = std::collections::HashMap<K, V, BuildU64Hasher>;
