//! A std-thread stress test: one writer per source and several readers. Readers must always
//! see a well-formed answer (each candidate's reaches ordered by tier and within what its
//! writer ever published), and the final state must be exact.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

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
    let reader_threads = 3u64;
    let stop = Arc::new(AtomicBool::new(false));
    // Everyone starts together, and writers wait until readers are looking up.
    let start = Arc::new(Barrier::new(writers as usize + reader_threads as usize));
    let lookups_done = Arc::new(AtomicU64::new(0));
    let eps: Vec<EndpointId> = (0..writers).map(|w| EndpointId::new(w).unwrap()).collect();
    let mut handles = Vec::new();
    for w in 0..writers {
        let idx = Arc::clone(&idx);
        let start = Arc::clone(&start);
        let lookups_done = Arc::clone(&lookups_done);
        handles.push(std::thread::spawn(move || {
            let h = Holder::Endpoint(EndpointId::new(w).unwrap());
            let keys = chain(0, u64::from(w));
            start.wait();
            while lookups_done.load(Ordering::Relaxed) < reader_threads {
                std::thread::yield_now();
            }
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
    for r in 0..reader_threads {
        let idx = Arc::clone(&idx);
        let stop = Arc::clone(&stop);
        let start = Arc::clone(&start);
        let lookups_done = Arc::clone(&lookups_done);
        let eps = eps.clone();
        readers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            start.wait();
            while !stop.load(Ordering::Relaxed) {
                if n == 1 {
                    lookups_done.fetch_add(1, Ordering::Relaxed);
                }
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
    assert!(lookups >= reader_threads);
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

/// Lookups running back to back on every other core must not starve a writer (each lookup
/// lets go of a shard a writer waits for after its current probe batch), and a steady writer
/// must not starve lookups.
#[test]
fn writers_and_back_to_back_lookups_both_progress() {
    let idx = Arc::new(KvIndex::new(IndexConfig::default()).unwrap());
    let prompt: Vec<BlockKey> = (0..512u64)
        .map(|i| BlockKey((i + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        .collect();
    let holder = Holder::Endpoint(EndpointId::new(0).unwrap());
    idx.apply(
        holder,
        &[KvEvent::Stored {
            keys: prompt.clone(),
            parent: None,
            tier: Tier::Gpu,
            lora: None,
            token_count: 0,
        }],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let cands: Vec<EndpointId> = (0..64).map(|e| EndpointId::new(e).unwrap()).collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (idx, stop, prompt, cands) = (
                Arc::clone(&idx),
                Arc::clone(&stop),
                prompt.clone(),
                cands.clone(),
            );
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let got = idx.find_matches(&prompt, &cands);
                    assert_eq!(got[0].reach(Tier::Gpu), 512);
                    n += 1;
                }
                n
            })
        })
        .collect();
    // 20,000 envelopes of 16 stores + 16 removes, each touching most shards.
    let t = Instant::now();
    for round in 0..20_000u64 {
        let fresh: Vec<BlockKey> = (0..16)
            .map(|i| BlockKey(((round * 16 + i + 1) << 20).wrapping_mul(0xD6E8_FEB8_6659_FD93)))
            .collect();
        let w = Holder::Endpoint(EndpointId::new(1).unwrap());
        idx.apply(
            w,
            &[
                KvEvent::Stored {
                    keys: fresh.clone(),
                    parent: None,
                    tier: Tier::Gpu,
                    lora: None,
                    token_count: 0,
                },
                KvEvent::Removed {
                    keys: fresh,
                    tier: Tier::Gpu,
                },
            ],
        );
    }
    let writes = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let lookups: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(lookups > 0);
    // 640,000 block events: seconds at worst on a loaded machine, not minutes.
    assert!(
        writes < Duration::from_secs(60),
        "writer starved: {writes:?}"
    );
    assert_eq!(idx.stats().residencies, 512);
}
