//! The simulator's KV events, decoded with `crates/kv-events` as a consumer of real vLLM would.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use base64::Engine as _;
use kv_events::engine::{EngineEvent, decode_batch};
use kv_events::frame::{KvFrame, ReplayReply, replay_request};
use kv_events::key::{KeySeed, block_keys};
use kv_events::normalize::{Normalizer, NormalizerConfig};
use serde_json::json;
use support::{Sim, free_ports};

fn subscriber(ctx: &zmq::Context, port: u16) -> zmq::Socket {
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
    // Let the subscription reach the publisher before anything is sent.
    std::thread::sleep(Duration::from_millis(300));
    sub
}

/// A simulator with a 40-block cache of 16-token blocks (so a few dozen requests evict), model
/// `m`, publishing with `config`, plus `extra` arguments.
fn small_cache_sim(config: &str, extra: &[&str]) -> Sim {
    let mut args = vec![
        "--model",
        "m",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "40",
        "--max-model-len",
        "512",
        "--time-scale",
        "50",
        "--kv-events-config",
        config,
    ];
    args.extend_from_slice(extra);
    Sim::start(&args)
}

/// Every message until `quiet` passes without one.
fn drain(sub: &zmq::Socket, quiet: Duration) -> Vec<Vec<Vec<u8>>> {
    sub.set_rcvtimeo(quiet.as_millis() as i32).unwrap();
    let mut out = Vec::new();
    while let Ok(parts) = sub.recv_multipart(0) {
        out.push(parts);
    }
    out
}

fn events_config(pub_port: u16, replay_port: u16, topic: Option<&str>) -> String {
    let mut v = json!({
        "enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{pub_port}"),
        "replay_endpoint": format!("tcp://*:{replay_port}"),
    });
    if let Some(t) = topic {
        v["topic"] = json!(t);
    }
    v.to_string()
}

/// With the real Qwen3 tokenizer, vLLM's block size, model name, topic and PYTHONHASHSEED, the
/// first batch the simulator publishes for the captured request is byte-identical to what real
/// vLLM 0.32 published, apart from the timestamp.
#[test]
fn first_batch_is_byte_identical_to_real_vllm() {
    let shared = support::shared();
    let fixtures = shared.join("fixtures/vllm/v0.32.0-map");
    let requests: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("requests.json")).unwrap())
            .unwrap();
    let request_a = requests["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["phase"] == "a")
        .unwrap()
        .clone();
    let frames = std::fs::read_to_string(fixtures.join("frames.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(frames.lines().next().unwrap()).unwrap();
    let parts: Vec<Vec<u8>> = first["frames_b64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            base64::engine::general_purpose::STANDARD
                .decode(f.as_str().unwrap())
                .unwrap()
        })
        .collect();
    let want = KvFrame::from_parts(&parts).unwrap();
    assert_eq!(want.seq, 0);

    let [p, r] = free_ports::<2>();
    let tokenizer = support::qwen3_dir();
    let config = events_config(p, r, Some(want.topic));
    let sim = Sim::start_env(
        &[
            "--model",
            "tiny",
            "--block-size",
            "32",
            "--max-model-len",
            "2048",
            "--time-scale",
            "20",
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--kv-events-config",
            &config,
        ],
        &[("PYTHONHASHSEED", "0")],
    );
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, p);
    let resp = sim.post("/v1/chat/completions", &request_a["body"]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = resp.json();
    assert_eq!(
        resp["usage"]["prompt_tokens"],
        request_a["usage"]["prompt_tokens"]
    );
    assert_eq!(
        resp["prompt_token_ids"], request_a["prompt_token_ids"],
        "token ids differ from vLLM's"
    );
    let got = drain(&sub, Duration::from_millis(500));
    let got = KvFrame::from_parts(&got[0]).unwrap();
    assert_eq!(got.topic, want.topic);
    assert_eq!(got.seq, 0);
    // [fixarray 3, 0xcb, 8 bytes of f64 ts, …]: mask the timestamp.
    let mask = |b: &[u8]| {
        let mut b = b.to_vec();
        assert_eq!(&b[..2], &[0x93, 0xcb]);
        b[2..10].fill(0);
        b
    };
    assert_eq!(
        mask(got.payload),
        mask(want.payload),
        "payload differs from real vLLM's"
    );
}

/// Under eviction pressure every stored block is later removed or still resident, removals
/// only name resident blocks, sequence numbers are contiguous, the keys a router computes from
/// the prompt's token ids equal the normalised keys of the events, and replay returns the
/// same bytes.
#[test]
fn event_stream_accounts_for_every_block() {
    let [p, r] = free_ports::<2>();
    let config = events_config(p, r, None);
    let sim = small_cache_sim(&config, &[]);
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, p);
    let port = sim.port;
    let mut prompts = Vec::new();
    let handles: Vec<_> = (0..24)
        .map(|i| {
            // Four shared 64-byte stems (16 tokens) and distinct tails: hits and evictions.
            let prompt = format!("{}{}", format!("stem{}", i % 4).repeat(16), format!("tail-{i:03}-").repeat(12));
            prompts.push(prompt.clone());
            std::thread::spawn(move || {
                let body = json!({"prompt": prompt, "max_tokens": 20, "ignore_eos": true, "return_token_ids": true});
                support::try_request(port, "POST", "/v1/completions", Some(body.to_string().as_bytes())).unwrap()
            })
        })
        .collect();
    let mut prompt_ids = Vec::new();
    for h in handles {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        prompt_ids.push(r.json()["choices"][0]["prompt_token_ids"].clone());
    }
    let live = drain(&sub, Duration::from_millis(700));
    assert!(!live.is_empty());
    // vLLM does not de-duplicate: two blocks may hold the same hash, each stored and removed.
    let mut resident: HashMap<u64, u32> = HashMap::new();
    let mut normalizer = Normalizer::new(NormalizerConfig::new("m", 16));
    let mut keys_seen = HashSet::new();
    let (mut stored, mut removed) = (0, 0);
    for (i, parts) in live.iter().enumerate() {
        let frame = KvFrame::from_parts(parts).unwrap();
        assert_eq!(frame.seq, i as u64, "contiguous seq from 0");
        assert!(frame.topic.starts_with("kv@127.0.0.1:"), "{}", frame.topic);
        let batch = decode_batch(frame.payload).unwrap();
        assert_eq!(batch.dp_rank, Some(0));
        for e in &batch.events {
            let mut out = Vec::new();
            normalizer.apply(e, &mut out).unwrap();
            for k in &out {
                if let kv_events::event::KvEvent::Stored { keys, .. } = k {
                    keys_seen.extend(keys.iter().copied());
                }
            }
            match e {
                EngineEvent::BlockStored(s) => {
                    for h in &s.block_hashes {
                        *resident.entry(h.0).or_default() += 1;
                        stored += 1;
                    }
                }
                EngineEvent::BlockRemoved(rm) => {
                    assert_eq!(rm.block_hashes.len(), 1, "vLLM removes one block per event");
                    for h in &rm.block_hashes {
                        let n = resident
                            .get_mut(&h.0)
                            .expect("removal of a block never stored");
                        *n -= 1;
                        if *n == 0 {
                            resident.remove(&h.0);
                        }
                        removed += 1;
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert!(removed > 0, "the test must exercise eviction");
    assert!(stored > 40);
    let copies: u32 = resident.values().sum();
    assert_eq!(f64::from(copies), sim.metric("kvgate_sim_cached_blocks"));
    assert_eq!(
        resident.len() as f64,
        sim.metric("kvgate_sim_distinct_cached_blocks"),
        "the distinct blocks the events leave resident"
    );
    // The router's view: keys of each prompt's full blocks were all published (some later evicted).
    for ids in &prompt_ids {
        let ids: Vec<u32> = ids
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        for key in block_keys(KeySeed::new("m", None), &ids, 16) {
            assert!(
                keys_seen.contains(&key),
                "a prompt block's kvgate key was never published"
            );
        }
    }
    // Replay from seq 0 returns the live bytes.
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(5000).unwrap();
    dealer.connect(&format!("tcp://127.0.0.1:{r}")).unwrap();
    dealer.send_multipart(replay_request(0), 0).unwrap();
    let mut replayed = 0;
    loop {
        let parts = dealer.recv_multipart(0).unwrap();
        match ReplayReply::from_parts(&parts).unwrap() {
            ReplayReply::Batch { frame, .. } => {
                let live_frame = KvFrame::from_parts(&live[frame.seq as usize]).unwrap();
                assert_eq!(frame, live_frame);
                replayed += 1;
            }
            ReplayReply::End => break,
        }
    }
    assert_eq!(replayed, live.len());
    // A reset publishes AllBlocksCleared.
    assert_eq!(sim.post("/reset_prefix_cache", &json!({})).status, 200);
    let after = drain(&sub, Duration::from_millis(500));
    let batch = decode_batch(KvFrame::from_parts(&after[0]).unwrap().payload).unwrap();
    assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);
    assert_eq!(sim.metric("kvgate_sim_cached_blocks"), 0.0);
}

/// With `--kv-offloading-size`, the blocks the GPU caches are copied to the host tier and
/// published as vLLM's offloading connector does (`BlockStored` with the `CPU` medium, hashes
/// only), which the normaliser turns into host-tier residencies of the same keys; a prompt whose
/// blocks the GPU evicted is served from the host tier (every full block counted as cached).
#[test]
fn offloaded_blocks_are_published_with_the_cpu_medium_and_served_back() {
    use kv_events::Tier;
    use kv_events::event::KvEvent;
    use kv_events::tier::Medium;
    let [p, r] = free_ports::<2>();
    let config = events_config(p, r, None);
    // `small`: 128 KiB of KV per token, so 2 MiB blocks of 16 tokens; 1 GiB holds 512.
    let sim = small_cache_sim(&config, &["--preset", "small", "--kv-offloading-size", "1"]);
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, p);
    let prompt = |i: usize| format!("unique-{i:03}-").repeat(16);
    let complete = |i: usize| {
        let body = json!({"prompt": prompt(i), "max_tokens": 4, "ignore_eos": true});
        let r = support::try_request(
            sim.port,
            "POST",
            "/v1/completions",
            Some(body.to_string().as_bytes()),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    // Twenty distinct 176-byte prompts (44 tokens with the byte tokenizer: two full blocks,
    // three with the output): 60 blocks through a 39-block GPU cache, so the first prompts'
    // blocks are evicted.
    for i in 0..20 {
        complete(i);
    }
    let first = complete(0);
    let cached = first["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, 32, "both full blocks served again: {first}");
    let live = drain(&sub, Duration::from_millis(700));
    let mut normalizer = Normalizer::new(NormalizerConfig::new("m", 16));
    let (mut gpu, mut host) = (HashSet::new(), HashSet::new());
    let (mut gpu_removed, mut host_stores) = (0, 0);
    let mut host_keys = 0;
    for parts in &live {
        let batch = decode_batch(KvFrame::from_parts(parts).unwrap().payload).unwrap();
        for e in &batch.events {
            match e {
                EngineEvent::BlockStored(s) if s.medium == Some(Medium::Cpu) => {
                    assert!(s.token_ids.is_empty(), "host copies carry hashes only");
                    for h in &s.block_hashes {
                        assert!(
                            gpu.contains(&h.0),
                            "host copy of a block the GPU never cached"
                        );
                        assert!(host.insert(h.0), "host copy published twice");
                        host_stores += 1;
                    }
                }
                EngineEvent::BlockStored(s) => {
                    assert_eq!(s.medium, Some(Medium::Gpu));
                    gpu.extend(s.block_hashes.iter().map(|h| h.0));
                }
                EngineEvent::BlockRemoved(rm) if rm.medium == Some(Medium::Cpu) => {
                    panic!("nothing should leave a 512-block host tier: {rm:?}");
                }
                EngineEvent::BlockRemoved(_) => gpu_removed += 1,
                other => panic!("unexpected {other:?}"),
            }
            let mut out = Vec::new();
            normalizer.apply(e, &mut out).unwrap();
            host_keys += out
                .iter()
                .filter_map(|k| match k {
                    KvEvent::Stored {
                        keys,
                        tier: Tier::Host,
                        ..
                    } => Some(keys.len()),
                    _ => None,
                })
                .sum::<usize>();
        }
    }
    assert!(gpu_removed > 0, "the test must evict from the GPU");
    assert!(host_stores >= 40, "{host_stores}");
    assert_eq!(
        host_keys, host_stores,
        "every host copy resolves to its key"
    );
    assert_eq!(sim.metric("kvgate_sim_host_blocks"), host.len() as f64);
    assert!(sim.metric("kvgate_sim_host_hit_tokens_total") > 0.0);
}

#[test]
fn array_format_and_salt_are_what_vllm_0_23_consumers_expect() {
    let [p, r] = free_ports::<2>();
    let config = events_config(p, r, Some(""));
    let sim = Sim::start_env(
        &[
            "--model",
            "m",
            "--block-size",
            "16",
            "--time-scale",
            "50",
            "--kv-events-format",
            "array",
            "--kv-events-config",
            &config,
        ],
        &[("PYTHONHASHSEED", "7")],
    );
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, p);
    let body = json!({"prompt": "abcd".repeat(33), "max_tokens": 1, "cache_salt": "tenant-a", "return_token_ids": true});
    let resp = sim.post("/v1/completions", &body).json();
    let ids: Vec<u32> = resp["choices"][0]["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let msgs = drain(&sub, Duration::from_millis(500));
    let frame = KvFrame::from_parts(&msgs[0]).unwrap();
    assert_eq!(frame.topic, "");
    assert_eq!(frame.payload[2 + 8], 0x91, "events array of one");
    assert_eq!(
        frame.payload[2 + 8 + 1] & 0xf0,
        0x90,
        "event encoded as a positional array"
    );
    let batch = decode_batch(frame.payload).unwrap();
    let EngineEvent::BlockStored(s) = &batch.events[0] else {
        panic!()
    };
    // Hashes are vLLM's sha256_cbor with the salt in the first block's extra keys.
    let none = kv_events::engine_hash::vllm_none_hash(Some("7"));
    let salt =
        kv_events::engine_hash::CborValue::Array(vec![kv_events::engine_hash::CborValue::Text(
            "tenant-a".into(),
        )]);
    let d0 = kv_events::engine_hash::vllm_block_digest(&none, &ids[..16], Some(&salt));
    let d1 = kv_events::engine_hash::vllm_block_digest(&d0, &ids[16..32], None);
    assert_eq!(s.block_hashes[0], d0.vllm_published());
    assert_eq!(s.block_hashes[1], d1.vllm_published());
    let extra = s.extra_keys.as_ref().unwrap();
    assert!(extra[0].is_some() && extra[1].is_none());
    // A router keying the salted request gets the keys the normaliser derives from the events.
    let mut normalizer = Normalizer::new(NormalizerConfig::new("m", 16));
    let mut out = Vec::new();
    normalizer.apply(&batch.events[0], &mut out).unwrap();
    let kv_events::event::KvEvent::Stored { keys, .. } = &out[0] else {
        panic!()
    };
    let want = kv_events::key::request_block_keys(
        "m",
        Some("tenant-a"),
        kv_events::key::SaltStyle::VllmExtraKey,
        &ids,
        16,
    );
    assert_eq!(keys[..], want[..keys.len()]);
    assert_eq!(keys.len(), 2);
}
