//! Two real NIXL agents in one process moving bytes with READs over UCX.
//!
//! Needs NIXL's C API: `KVGATE_TEST_NIXL_LIBRARY` names `libnixl_capi.so` (scripts/bootstrap.sh
//! unpacks NIXL's libraries from the `nixl-cu12` wheel and scripts/test.sh sets it). Without
//! it these tests fail: they never pass vacuously.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvbm_nixl::{Nixl, Offer, PoolConfig, ReadError, agent_name};

const POOL: PoolConfig = PoolConfig {
    buffers: 3,
    buffer_bytes: 4 << 20,
};

fn library() -> PathBuf {
    let Some(path) = std::env::var_os("KVGATE_TEST_NIXL_LIBRARY") else {
        panic!(
            "KVGATE_TEST_NIXL_LIBRARY is not set: run scripts/bootstrap.sh, then the tests through scripts/test.sh"
        );
    };
    PathBuf::from(path)
}

fn agent(name: &str) -> Nixl {
    match Nixl::load(name, Some(&library()), POOL) {
        Ok(nixl) => nixl,
        Err(e) => panic!("NIXL agent {name}: {e}"),
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn expose(nixl: &Nixl, bytes: &[u8]) -> Result<kvbm_nixl::Exposed, ReadError> {
    nixl.expose(bytes.len() as u64, |out| out.copy_from_slice(bytes))
}

fn read(nixl: &Nixl, node: &str, offer: &Offer) -> Result<Vec<u8>, ReadError> {
    nixl.read(node, offer, soon(), <[u8]>::to_vec)
}

#[test]
fn a_peer_reads_what_another_agent_exposes_and_buffers_are_reused() {
    let (holder, puller) = (
        agent(&agent_name("holder-a", 0xa1)),
        agent(&agent_name("puller-a", 0xa2)),
    );
    let read = |nixl: &Nixl, offer: &Offer| read(nixl, "holder-a", offer);
    // As many exposures at once as the pool has buffers, of sizes that are not multiples of a
    // page, read out of order.
    let sizes = [4096, (2 << 20) + 17, 1];
    let mut exposed: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| expose(&holder, &pattern(len, i as u8)).unwrap())
        .collect();
    for (i, e) in exposed.iter().enumerate().rev() {
        assert_eq!(e.offer().len, sizes[i] as u64);
        assert_eq!(
            read(&puller, e.offer()).unwrap(),
            pattern(sizes[i], i as u8),
            "exposure {i}"
        );
    }
    // The same offer reads again while it stays exposed.
    assert_eq!(
        read(&puller, exposed[1].offer()).unwrap(),
        pattern(sizes[1], 1)
    );
    // The pool is spent until an exposure is dropped; then its buffer serves the next one.
    assert!(matches!(expose(&holder, b"more"), Err(ReadError::Busy(3))));
    let gone = exposed.remove(0);
    let addr = gone.offer().addr;
    drop(gone);
    let next = expose(&holder, &pattern(100, 9)).unwrap();
    assert_eq!(next.offer().addr, addr, "the freed buffer is reused");
    assert_eq!(read(&puller, next.offer()).unwrap(), pattern(100, 9));
    // The largest exposure a buffer holds, and one byte more.
    drop(next);
    let full = expose(&holder, &pattern(POOL.buffer_bytes, 3)).unwrap();
    assert_eq!(
        read(&puller, full.offer()).unwrap(),
        pattern(POOL.buffer_bytes, 3)
    );
    assert!(matches!(
        expose(&holder, &pattern(POOL.buffer_bytes + 1, 3)),
        Err(ReadError::TooLarge(_))
    ));
}

#[test]
fn bad_offers_fail_cleanly_and_give_their_buffer_back() {
    let (holder, puller) = (
        agent(&agent_name("holder-b", 0xb1)),
        agent(&agent_name("puller-b", 0xb2)),
    );
    let read = |nixl: &Nixl, offer: &Offer| read(nixl, "holder-b", offer);
    let exposed = expose(&holder, &pattern(8192, 7)).unwrap();
    let offer = exposed.offer().clone();
    // Outside every buffer the holder registered.
    let outside = Offer {
        addr: offer.addr + 2 * POOL.buffer_bytes as u64,
        ..offer.clone()
    };
    // The right agent name at its head, then garbage: NIXL refuses the rest.
    let name = agent_name("holder-b", 0xb1);
    let head = 16 + std::mem::size_of::<usize>() + name.len() + 1;
    let mut truncated = offer.metadata[..head].to_vec();
    truncated.extend_from_slice(b"garbage");
    assert_eq!(kvbm_nixl::metadata_agent(&truncated), Some(name.as_str()));
    let garbage = Offer {
        metadata: truncated,
        ..offer.clone()
    };
    // Not metadata at all: refused before NIXL sees it.
    let nonsense = Offer {
        metadata: b"not metadata".to_vec(),
        ..offer.clone()
    };
    // More failures than the pool has buffers: each gives its buffer back.
    for _ in 0..2 {
        assert!(matches!(
            read(&puller, &outside),
            Err(ReadError::Nixl { .. })
        ));
        assert!(matches!(
            read(&puller, &garbage),
            Err(ReadError::Nixl { .. })
        ));
        assert!(matches!(
            read(&puller, &nonsense),
            Err(ReadError::Impostor { .. })
        ));
    }
    let empty = Offer {
        len: 0,
        ..offer.clone()
    };
    assert!(matches!(read(&puller, &empty), Err(ReadError::Empty)));
    let huge = Offer {
        len: POOL.buffer_bytes as u64 + 1,
        ..offer.clone()
    };
    assert!(matches!(read(&puller, &huge), Err(ReadError::TooLarge(_))));
    assert!(matches!(expose(&holder, &[]), Err(ReadError::Empty)));
    // Metadata of another node's agent, offered by this one, is refused.
    assert!(matches!(
        puller.read("holder-c", &offer, soon(), <[u8]>::to_vec),
        Err(ReadError::Impostor { .. })
    ));
    assert_eq!(read(&puller, &offer).unwrap(), pattern(8192, 7));
}

#[test]
fn a_restarted_peer_is_read_from_its_new_agent() {
    let puller = agent(&agent_name("puller-c", 0xc0));
    for epoch in [0xc1, 0xc2] {
        // The node's daemon restarts with a new agent name; the old one is dropped.
        let holder = agent(&agent_name("holder-c", epoch));
        let exposed = expose(&holder, &pattern(4096, 2)).unwrap();
        assert_eq!(
            read(&puller, "holder-c", exposed.offer()).unwrap(),
            pattern(4096, 2)
        );
    }
}
