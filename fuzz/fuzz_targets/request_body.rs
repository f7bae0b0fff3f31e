//! The EPP's request-body path: `kvgate_epp::routing::request::parse` (completions and chat),
//! keying the parsed request (`routing::keys::Keyer`: tokenize, render the chat, derive block
//! keys) and the model rewrite of the body (`routing::rewrite::rewrite_request_body`).
//!
//! Input: two option bytes (the API keyed first, the salt style, block size, tokenizer chunk
//! size, and the answers of the early-stop probe), then the body. Requests are keyed with the
//! byte fallback tokenizer; a request whose `model` is `qwen3` is keyed with the real Qwen3
//! tokenizer and chat template when its directory is present (`KVGATE_FUZZ_TOKENIZER`, else
//! `.cache/tokenizers/qwen3/package/models`, which `scripts/bootstrap.sh` fetches).
//!
//! Asserts, besides "no panic":
//! - whole-prompt keying keys every full block: `prompt_blocks == keys.len() ==
//!   prompt_tokens / block_size`, `tokenized == prompt_tokens`, and it is deterministic (a
//!   second run gives the same keys; with the real tokenizer, through its warm segment cache);
//! - keying that stops early gives a prefix of those keys, and no fewer estimated blocks;
//! - a parsed body with no floating-point number (whose text need not survive a round trip)
//!   rewrites to a body that parses to the same request, under the rewrite's model, with the
//!   same keys.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kv_events::key::SaltStyle;
use kvgate_epp::routing::keys::{Keyed, Keyer, ModelTokenizer};
use kvgate_epp::routing::request::{Api, ParsedRequest, parse};
use kvgate_epp::routing::rewrite::rewrite_request_body;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tokenize::TextTokenizer;

/// The model name served by the real tokenizer.
const REAL_MODEL: &str = "qwen3";
const DEFAULT_MODEL: &str = "default-model";

/// The keyer with the real tokenizer, when its directory is present.
fn real_keyer() -> Option<&'static Keyer> {
    static KEYER: OnceLock<Option<Keyer>> = OnceLock::new();
    KEYER
        .get_or_init(|| {
            let dir = std::env::var_os("KVGATE_FUZZ_TOKENIZER").map_or_else(
                || {
                    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                        .join("../.cache/tokenizers/qwen3/package/models")
                },
                PathBuf::from,
            );
            let tokenizer = TextTokenizer::from_dir(&dir).ok()?;
            Some(
                Keyer::new(16, SaltStyle::VllmExtraKey, DEFAULT_MODEL)
                    .with_chunk_bytes(64)
                    .with_model(REAL_MODEL, ModelTokenizer::new(tokenizer, 1 << 20)),
            )
        })
        .as_ref()
}

fn has_float(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.is_f64(),
        Value::Array(items) => items.iter().any(has_float),
        Value::Object(map) => map.values().any(has_float),
        Value::Null | Value::Bool(_) | Value::String(_) => false,
    }
}

fn check_full(keyed: &Keyed, block_size: usize) {
    assert!(!keyed.stopped_early);
    assert_eq!(keyed.tokenized, keyed.prompt_tokens);
    assert_eq!(keyed.prompt_blocks as usize, keyed.keys.len());
    let full = (keyed.prompt_tokens as usize)
        .checked_div(block_size)
        .unwrap_or(0);
    assert_eq!(keyed.keys.len(), full, "keys for every full block");
}

fn key_request(req: &ParsedRequest<'_>, fallback: &Keyer, options: u8) -> Option<Keyed> {
    let keyer = match (req.model.as_deref(), real_keyer()) {
        (Some(REAL_MODEL), Some(real)) => real,
        _ => fallback,
    };
    let full = keyer.key(req).ok()?;
    check_full(&full, keyer.block_size());
    let model = req.model.as_deref().unwrap_or(keyer.default_model());
    assert_eq!(full.model, model);
    let again = keyer.key(req).ok()?;
    assert_eq!(again.keys, full.keys, "keying is deterministic");
    assert_eq!(again.prompt_tokens, full.prompt_tokens);

    // Early stop: the probe answers from the option bits, one per question.
    let mut answers = options;
    let mut held = |_| {
        let yes = answers & 1 == 1;
        answers = answers.rotate_right(1);
        yes
    };
    if let Ok(partial) = keyer.key_served(req, None, &mut held) {
        assert!(
            full.keys.starts_with(&partial.keys),
            "early stop keys a prefix"
        );
        assert!(partial.prompt_blocks as usize >= partial.keys.len());
        if !partial.stopped_early {
            assert_eq!(partial.keys, full.keys);
        }
    }
    Some(full)
}

fuzz_target!(|data: &[u8]| {
    let [a, b, body @ ..] = data else {
        return;
    };
    let api = if a & 1 == 0 {
        Api::Completions
    } else {
        Api::Chat
    };
    let style = if a & 2 == 0 {
        SaltStyle::VllmExtraKey
    } else {
        SaltStyle::Seed
    };
    let block_size = [16, 1, 4, 0][usize::from(b & 3)];
    let chunk_bytes = [4096, 1, 7, 64][usize::from((b >> 2) & 3)];
    let fallback = Keyer::new(block_size, style, DEFAULT_MODEL).with_chunk_bytes(chunk_bytes);

    // Both APIs parse every body; the one the option names is keyed.
    let other = if api == Api::Chat {
        Api::Completions
    } else {
        Api::Chat
    };
    let _ = parse(other, body);
    let Ok(req) = parse(api, body) else {
        return;
    };
    let keyed = key_request(&req, &fallback, *a);

    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if has_float(&value) {
        return;
    }
    let target = req.model.as_deref().unwrap_or(DEFAULT_MODEL);
    let rewritten = rewrite_request_body(body, target).expect("a parsed body rewrites");
    let again = parse(api, &rewritten).expect("a rewritten body parses");
    assert_eq!(again.model.as_deref(), Some(target));
    assert_eq!(again.stream, req.stream);
    assert_eq!(again.max_tokens, req.max_tokens);
    assert_eq!(again.cache_salt, req.cache_salt);
    assert_eq!(again.user, req.user);
    assert_eq!(again.transfer_field, req.transfer_field);
    let keyed_again = key_request(&again, &fallback, *a);
    match (keyed, keyed_again) {
        (Some(x), Some(y)) => {
            assert_eq!(x.keys, y.keys, "the rewritten body keys the same");
            assert_eq!(x.prompt_tokens, y.prompt_tokens);
        }
        (None, None) => {}
        (x, y) => panic!(
            "keyed {} before the rewrite, {} after",
            x.is_some(),
            y.is_some()
        ),
    }
});
