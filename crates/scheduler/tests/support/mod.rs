//! Shared helpers for the integration tests: endpoints, key chains, index population.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;

use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex};
use scheduler::{Endpoint, Millis, Role, ScheduleRequest};

pub fn id(i: u32) -> EndpointId {
    EndpointId::new(i).unwrap()
}

pub fn addr(i: u32) -> SocketAddr {
    SocketAddr::from(([10, 0, (i / 250) as u8, (i % 250) as u8 + 1], 8000))
}

/// `n` ready endpoints of role `Both` serving any model, ids 0..n.
pub fn endpoints(n: u32) -> Vec<Endpoint> {
    (0..n).map(|i| Endpoint::new(id(i), addr(i))).collect()
}

pub fn with_role(mut e: Endpoint, role: Role) -> Endpoint {
    e.role = role;
    e
}

/// A key chain: `len` keys of conversation `conv`.
pub fn chain(conv: u64, len: usize) -> Vec<BlockKey> {
    (0..len as u64)
        .map(|i| BlockKey(mix(conv.wrapping_mul(0x1_0000_0001) ^ i)))
        .collect()
}

pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub fn index() -> KvIndex {
    KvIndex::new(IndexConfig::default()).unwrap()
}

/// Stores `keys` in `tier` of endpoint `i`.
pub fn store(index: &KvIndex, i: u32, keys: &[BlockKey], tier: Tier) {
    index.apply(
        Holder::Endpoint(id(i)),
        &[KvEvent::Stored {
            keys: keys.to_vec(),
            parent: None,
            tier,
            lora: None,
            token_count: 16,
        }],
    );
}

pub fn request<'a>(keys: &'a [BlockKey], now: u64) -> ScheduleRequest<'a> {
    ScheduleRequest {
        keys,
        prompt_tokens: (keys.len() * 16) as u32,
        prompt_blocks: None,
        model: "m",
        subset: None,
        now: Millis(now),
        timed: false,
    }
}
