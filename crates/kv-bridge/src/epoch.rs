//! Random epochs: a fresh 64-bit value per sidecar start (and per resynchronisation), drawn
//! from the standard library's per-process random hasher keys mixed with the clock.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A random, non-zero epoch.
pub fn random_epoch() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_differ() {
        let a: std::collections::HashSet<u64> = (0..1000).map(|_| random_epoch()).collect();
        assert_eq!(a.len(), 1000);
    }
}
