//! A std-thread stress test: one writer per source and several readers. Readers must always
//! see a well-formed answer (each candidate's reaches ordered by tier and within what its
//! writer ever published), and the final state must be exact.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{EndpointId, Holder, IndexConfig, KvIndex};

const LEN: u64 = 64;

fn chain(shared: u64, own: u64) -> Vec<BlockKey> {
    // The first 16 keys are shared by every writer; the rest are the writer's own.
    (0..LEN)
        .map(|p| {
            let id = if p < 16 { p + shared } else { own * 1000 + p };
            BlockKey((id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        })
        .collect()
}

#[test]
fn readers_see_well_formed_prefixes_while_writers_run() {
    let idx = Arc::new(
        KvIndex::new(IndexConfig {
            shards: 8,
            capacity: 1 << 20,
        })
        .unwrap(),
    );
    let writers = 4u32;
    let stop = Arc::new(AtomicBool::new(false));
    let eps: Vec<EndpointId> = (0..writers).map(|w| EndpointId::new(w).unwrap()).collect();
    let mut handles = Vec::new();
    for w in 0..writers {
        let idx = Arc::clone(&idx);
        handles.push(std::thread::spawn(move || {
            let h = Holder::Endpoint(EndpointId::new(w).unwrap());
            let keys = chain(0, u64::from(w));
            for round in 0..300 {
                // Grow the chain block by block, then shrink it from the tail, as an engine
                // evicting leaves first would.
                for k in &keys {
                    idx.apply(
                        h,
                        &[KvEvent::Stored {
                            keys: vec![*k],
                            parent: None,
                            tier: Tier::Gpu,
                            lora: None,
                            token_count: 16,
                        }],
                    );
                }
                if round % 7 == 0 {
                    idx.apply(h, &[KvEvent::Cleared { tier: None }]);
                } else {
                    for k in keys.iter().rev() {
                        idx.apply(
                            h,
                            &[KvEvent::Removed {
                                keys: vec![*k],
                                tier: Tier::Gpu,
                            }],
                        );
                    }
                }
            }
            idx.apply(
                h,
                &[KvEvent::Stored {
                    keys: keys.clone(),
                    parent: None,
                    tier: Tier::Host,
                    lora: None,
                    token_count: 0,
                }],
            );
        }));
    }
    let mut readers = Vec::new();
    for r in 0..3u64 {
        let idx = Arc::clone(&idx);
        let stop = Arc::clone(&stop);
        let eps = eps.clone();
        readers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let keys = chain(0, (n + r) % u64::from(writers));
                for o in idx.find_matches(&keys, &eps) {
                    let rs = o.reaches();
                    assert!(rs.windows(2).all(|w| w[0] <= w[1]), "{rs:?}");
                    assert!(rs[3] <= LEN as u32);
                    let own = (n + r) % u64::from(writers);
                    if u64::from(o.endpoint.get()) != own {
                        assert!(
                            rs[3] <= 16,
                            "another writer's chain diverges after 16: {rs:?}"
                        );
                    }
                }
                n += 1;
            }
            n
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let lookups: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(lookups > 0);
    for w in 0..writers {
        let got = idx.find_matches(&chain(0, u64::from(w)), &eps);
        for o in got {
            let want = if o.endpoint.get() == w {
                LEN as u32
            } else {
                16
            };
            assert_eq!(o.reaches(), [0, want, want, want]);
        }
    }
    assert_eq!(
        idx.stats().residencies,
        (16 * writers + (LEN as u32 - 16) * writers) as usize
    );
}
