//! Direct-ZMQ ingestion of frames captured from a real vLLM 0.32 (`../shared/fixtures`): the
//! index ends up holding the keys a router computes from the request's token ids; gaps are
//! repaired by replay or, without one, resynchronised.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use base64::Engine as _;
use kv_events::Tier;
use kv_events::key::{SaltStyle, request_block_keys};
use kv_index::{EndpointId, IndexConfig, KvIndex};
use kvgate_epp::ingest::zmq_direct::{DirectSource, Ingester};

fn shared() -> PathBuf {
    std::env::var_os("KVGATE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}

/// Run A's frames before the prefix-cache reset, as multipart messages.
fn frames() -> Vec<Vec<Vec<u8>>> {
    let text =
        std::fs::read_to_string(shared().join("fixtures/vllm/v0.32.0-map/frames.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .take_while(|v| !v["note"].as_str().unwrap().contains("AllBlocksCleared"))
        .map(|v| {
            v["frames_b64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    base64::engine::general_purpose::STANDARD
                        .decode(f.as_str().unwrap())
                        .unwrap()
                })
                .collect()
        })
        .collect()
}

fn request_a_keys() -> Vec<kv_events::BlockKey> {
    let text =
        std::fs::read_to_string(shared().join("fixtures/vllm/v0.32.0-map/requests.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let a = v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["phase"] == "a")
        .unwrap();
    let ids: Vec<u32> = a["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    request_block_keys("tiny", None, SaltStyle::VllmExtraKey, &ids, 32)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Setup {
    index: Arc<KvIndex>,
    ingester: Ingester,
    publisher: zmq::Socket,
    ep: EndpointId,
    _ctx: zmq::Context,
}

fn setup(replay: Option<u16>) -> Setup {
    let ctx = zmq::Context::new();
    let port = free_port();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    let index = Arc::new(KvIndex::new(IndexConfig::default()).unwrap());
    let mut ingester = Ingester::new(Arc::clone(&index));
    let ep = EndpointId::new(3).unwrap();
    ingester.sync(vec![DirectSource {
        endpoint: ep,
        model: "tiny".into(),
        block_size: 32,
        publisher: format!("tcp://127.0.0.1:{port}"),
        replay: replay.map(|p| format!("tcp://127.0.0.1:{p}")),
    }]);
    std::thread::sleep(Duration::from_millis(500));
    Setup {
        index,
        ingester,
        publisher,
        ep,
        _ctx: ctx,
    }
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn in_order_frames_fill_the_index_with_the_routers_keys() {
    let s = setup(None);
    let frames = frames();
    for f in &frames {
        s.publisher.send_multipart(f, 0).unwrap();
    }
    let stats = s.ingester.stats();
    wait_for("all batches", || {
        stats.batches.load(Ordering::Relaxed) >= frames.len() as u64
    });
    let keys = request_a_keys();
    assert_eq!(keys.len(), 6);
    let m = s.index.find_matches(&keys, &[s.ep]);
    assert_eq!(
        m[0].reach(Tier::Gpu),
        6,
        "the prompt's six blocks are indexed under the endpoint"
    );
    assert_eq!(stats.gaps.load(Ordering::Relaxed), 0);
}

#[test]
fn a_gap_without_replay_resyncs_the_source() {
    let s = setup(None);
    let frames = frames();
    s.publisher.send_multipart(&frames[0], 0).unwrap();
    let stats = s.ingester.stats();
    wait_for("first batch", || stats.batches.load(Ordering::Relaxed) == 1);
    assert_eq!(
        s.index.find_matches(&request_a_keys(), &[s.ep])[0].reach(Tier::Gpu),
        6
    );
    // seq 1 is lost.
    for f in &frames[2..] {
        s.publisher.send_multipart(f, 0).unwrap();
    }
    wait_for("resync", || stats.resyncs.load(Ordering::Relaxed) == 1);
    assert_eq!(stats.gaps.load(Ordering::Relaxed), 1);
    // The source's entries from before the gap were dropped rather than left possibly stale.
    wait_for("drain", || stats.batches.load(Ordering::Relaxed) >= 2);
    assert_eq!(
        s.index.find_matches(&request_a_keys(), &[s.ep])[0].reach(Tier::Gpu),
        0
    );
}

#[test]
fn a_gap_is_repaired_through_the_replay_router() {
    let ctx = zmq::Context::new();
    let rport = free_port();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.bind(&format!("tcp://127.0.0.1:{rport}")).unwrap();
    let frames = frames();
    let served = frames.clone();
    let replayer = std::thread::spawn(move || {
        router.set_rcvtimeo(10_000).unwrap();
        let req = router.recv_multipart(0).unwrap();
        let start = u64::from_be_bytes(req[2].clone().try_into().unwrap());
        for f in &served {
            let seq = u64::from_be_bytes(f[1].clone().try_into().unwrap());
            if seq >= start {
                router
                    .send_multipart(
                        [
                            req[0].clone(),
                            vec![],
                            f[0].clone(),
                            f[1].clone(),
                            f[2].clone(),
                        ],
                        0,
                    )
                    .unwrap();
            }
        }
        router
            .send_multipart(
                [
                    req[0].clone(),
                    vec![],
                    vec![],
                    u64::MAX.to_be_bytes().to_vec(),
                    vec![],
                ],
                0,
            )
            .unwrap();
        start
    });
    let s = setup(Some(rport));
    // Joining mid-stream: the first live frame is seq 2, so seqs 0..2 are replayed.
    for f in &frames[2..] {
        s.publisher.send_multipart(f, 0).unwrap();
    }
    assert_eq!(
        replayer.join().unwrap(),
        0,
        "replay starts at the first seq never seen"
    );
    let stats = s.ingester.stats();
    wait_for("replay", || stats.replays.load(Ordering::Relaxed) == 1);
    wait_for("all batches", || {
        stats.batches.load(Ordering::Relaxed) >= frames.len() as u64
    });
    assert_eq!(stats.resyncs.load(Ordering::Relaxed), 0);
    assert_eq!(
        s.index.find_matches(&request_a_keys(), &[s.ep])[0].reach(Tier::Gpu),
        6
    );
}
