//! Decision cost inside the EPP: parse → tokenize → keys → lookup → score → pick, measured on
//! `Picker::route` (the exact code the ext_proc stream calls) on one thread.
//!
//! Setup (seeded): 64 endpoints; an index holding 20,000 random 32-block chains spread over
//! them plus every measured conversation's history on 4 endpoints; the real Qwen3 tokenizer
//! and chat template (`.cache/tokenizers/qwen3/package/models`, or `KVGATE_TOKENIZER_DIR`).
//! Prompts are chats of seeded English-like text.
//!
//! Scenarios:
//! - `8k warm`: a conversation of ~8,000 tokens whose earlier turns the EPP has already seen
//!   (the multi-turn case the segment cache is for): only the new user turn is tokenized.
//! - `8k cold`: a conversation never seen before: everything is tokenized.
//! - `100k warm` / `100k cold`: the same at ~100,000 tokens.
//!
//! Run: `cargo bench -p kvgate-epp --bench decision` (`-- 8k` or `-- 100k` for one size).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_events::key::SaltStyle;
use kv_events::{BlockKey, KvEvent, Tier};
use kv_index::{Holder, IndexConfig, KvIndex};
use kvgate_epp::discovery::Datastore;
use kvgate_epp::extproc::{ResponseEvent, Router, RoutingInput};
use kvgate_epp::routing::keys::{Keyer, ModelTokenizer};
use kvgate_epp::routing::picker::Picker;
use scheduler::{Endpoint, InflightTracker, LoadBook, Scheduler, SchedulerConfig};
use serde_json::json;

const ENDPOINTS: u16 = 64;
const BLOCK: usize = 16;
const MODEL: &str = "Qwen/Qwen3-0.6B";

const WORDS: &[&str] = &[
    "the", "cache", "request", "model", "token", "prefix", "server", "gateway", "route", "block",
    "memory", "latency", "cluster", "policy", "engine", "decode", "prefill", "batch", "queue",
    "stream", "user", "system", "answer", "question", "data", "value", "index", "node", "pod",
    "service", "deploy", "scale", "update", "config", "result", "error", "retry", "timeout",
    "network", "storage", "compute", "weight", "layer", "attention", "context", "window",
    "summary", "report", "document", "paragraph", "analysis", "describe", "explain", "compare",
    "and", "of", "to", "in", "with", "for", "on", "by", "from", "about", "into", "over", "under",
    "between", "through", "quickly", "carefully", "large", "small", "fast", "slow", "new", "old",
];

/// A tiny seeded generator (xorshift), so inputs are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn text(&mut self, words: usize) -> String {
        let mut s = String::with_capacity(words * 7);
        for i in 0..words {
            if i > 0 {
                s.push(if i % 17 == 0 { '.' } else { ' ' });
                if i % 17 == 0 {
                    s.push(' ');
                }
            }
            s.push_str(WORDS[(self.next() % WORDS.len() as u64) as usize]);
        }
        s
    }
}

/// A conversation of `turns` user/assistant pairs and a final user turn.
fn conversation(rng: &mut Rng, words_per_turn: usize, turns: usize) -> Vec<serde_json::Value> {
    let mut m = vec![json!({"role": "system", "content": rng.text(60)})];
    for _ in 0..turns {
        m.push(json!({"role": "user", "content": rng.text(words_per_turn)}));
        m.push(json!({"role": "assistant", "content": rng.text(words_per_turn / 2)}));
    }
    m.push(json!({"role": "user", "content": rng.text(words_per_turn)}));
    m
}

fn body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "messages": messages, "max_tokens": 64})).unwrap()
}

fn tokenizer_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("KVGATE_TOKENIZER_DIR") {
        return Some(PathBuf::from(d));
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../.cache/tokenizers/qwen3/package/models");
    here.join("tokenizer.json").exists().then_some(here)
}

/// The picker over a populated index. Routing the previous turn leaves its blocks speculated on
/// the chosen endpoint, as serving it would.
fn setup(dir: &PathBuf) -> Picker {
    let tok = tokenize::TextTokenizer::from_dir(dir).expect("tokenizer");
    let keyer = Keyer::new(BLOCK, SaltStyle::VllmExtraKey, MODEL)
        .with_model(MODEL, ModelTokenizer::new(tok, 256 << 20));
    let ds = Arc::new(Datastore::new());
    let eps = (0..ENDPOINTS)
        .map(|i| {
            let key = (format!("pod-{i}"), 8000);
            let id = ds.id_for(&key);
            let addr = format!("10.0.{}.{}:8000", i / 250, i % 250).parse().unwrap();
            (key, Endpoint::new(id, addr))
        })
        .collect();
    ds.replace(eps);
    let index = Arc::new(KvIndex::new(IndexConfig::default()).unwrap());
    let mut rng = Rng(0x5eed);
    let ids: Vec<_> = ds.snapshot().iter().map(|e| e.id).collect();
    for _ in 0..20_000 {
        let holder = Holder::Endpoint(ids[(rng.next() % ids.len() as u64) as usize]);
        let keys: Vec<BlockKey> = (0..32).map(|_| BlockKey(rng.next())).collect();
        index.apply(
            holder,
            &[KvEvent::Stored {
                keys,
                parent: None,
                tier: Tier::Gpu,
                lora: None,
                token_count: 512,
            }],
        );
    }
    Picker::new(
        keyer,
        Scheduler::new(SchedulerConfig::default(), 7).unwrap(),
        index,
        Arc::new(InflightTracker::new()),
        Arc::new(LoadBook::new()),
        ds,
    )
}

fn route(picker: &Picker, body: &[u8]) -> Duration {
    let input = RoutingInput {
        method: "POST",
        path: "/v1/chat/completions",
        headers: &[],
        body: Some(body),
        subset: None,
        request_id: None,
    };
    let t = Instant::now();
    let d = picker.route(input).expect("routed");
    let took = t.elapsed();
    picker.on_response(d.ticket, ResponseEvent::End);
    took
}

fn report(name: &str, tokens: usize, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    let pct = |p: f64| {
        let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
        samples[i].as_secs_f64() * 1e6
    };
    println!(
        "{name:<10} ~{tokens:>6} tokens  n={:<4} p50 {:>9.1} µs  p90 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
        samples.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        samples.last().unwrap().as_secs_f64() * 1e6
    );
}

/// Approximate prompt tokens of a conversation, from the tokenizer.
fn count_tokens(dir: &PathBuf, messages: &[serde_json::Value]) -> usize {
    let tok = tokenize::TextTokenizer::from_dir(dir).unwrap();
    tok.encode_chat(messages, &tokenize::ChatOptions::default())
        .map(|ids| ids.len())
        .unwrap_or(0)
}

fn scenario(dir: &PathBuf, label: &str, words_per_turn: usize, turns: usize, n_warm: usize, n_cold: usize) {
    let picker = setup(dir);
    let mut rng = Rng(0xc0ffee ^ words_per_turn as u64);
    let sample = conversation(&mut rng, words_per_turn, turns);
    let tokens = count_tokens(dir, &sample);

    // Warm: the history was seen in the previous turn's request; the new turn is not.
    let mut warm = Vec::with_capacity(n_warm);
    for _ in 0..n_warm {
        let full = conversation(&mut rng, words_per_turn, turns);
        let previous = &full[..full.len() - 2];
        let _ = route(&picker, &body(previous));
        warm.push(route(&picker, &body(&full)));
    }
    report(&format!("{label} warm"), tokens, warm);

    let mut cold = Vec::with_capacity(n_cold);
    for _ in 0..n_cold {
        let full = conversation(&mut rng, words_per_turn, turns);
        cold.push(route(&picker, &body(&full)));
    }
    report(&format!("{label} cold"), tokens, cold);
}

fn main() {
    if !std::env::args().skip(1).any(|a| a == "--bench") {
        return;
    }
    let Some(dir) = tokenizer_dir() else {
        eprintln!(
            "decision bench: no tokenizer (run scripts/bootstrap.sh, or set KVGATE_TOKENIZER_DIR)"
        );
        std::process::exit(2);
    };
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    println!("decision cost: Picker::route, {ENDPOINTS} endpoints, block {BLOCK}, one thread");
    if which.is_empty() || which == "8k" {
        // ~8k tokens: 12 turns of 400 words (user) + 200 (assistant).
        scenario(&dir, "8k", 400, 12, 300, 100);
    }
    if which.is_empty() || which == "100k" {
        // ~100k tokens: 40 turns of 1,600 words + 800.
        scenario(&dir, "100k", 1600, 40, 40, 15);
    }
}
