//! Parity with Hugging Face `transformers` 5.19 / `tokenizers` 0.23 / jinja2 on the Qwen3
//! tokenizer (`fixtures/hf_parity.json`, made by `fixtures/gen_hf_parity.py`): chat requests
//! (tools, tool calls, reasoning, multi-turn, content parts, developer role, continue_final_message,
//! enable_thinking, unicode) and 400 prompts that stress the pre-tokenizer regex.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use std::path::PathBuf;

use serde_json::Value;
use tokenize::ChatOptions;

fn fixture() -> Value {
    common::read_json(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_parity.json"),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

#[test]
fn chat_requests_render_and_encode_like_transformers() {
    let Some(tok) = common::qwen3() else { return };
    let fx = fixture();
    let cases = fx["chats"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let req = &case["request"];
        let opts = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            continue_final_message: case["continue_final_message"].as_bool().unwrap(),
            template_kwargs: case["template_kwargs"].as_object().unwrap().clone(),
            tools: req.get("tools").cloned(),
            documents: None,
        };
        let messages = req["messages"].as_array().unwrap();
        let text = tok
            .render_chat(messages, &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{name}: rendered text"
        );
        let got = tok.encode_chat(messages, &opts).unwrap();
        assert_eq!(got, ids(&case["ids"]), "{name}: ids");
    }
}

#[test]
fn prompts_encode_like_tokenizers() {
    let Some(tok) = common::qwen3() else { return };
    let fx = fixture();
    let cases = fx["prompts"].as_array().unwrap();
    assert!(cases.len() >= 400);
    let mut mismatches = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode_prompt(text).unwrap();
        if got != ids(&case["ids"]) {
            mismatches.push(text.to_owned());
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches, e.g. {:?}",
        mismatches.len(),
        mismatches.first()
    );
}

#[test]
fn prompts_decode_back() {
    let Some(tok) = common::qwen3() else { return };
    let fx = fixture();
    for case in fx["prompts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        // Qwen3 normalizes to NFC; compare with what the tokenizer sees.
        let ids = ids(&case["ids"]);
        let back = tok.decode(&ids).unwrap();
        assert_eq!(tok.encode_prompt(&back).unwrap(), ids, "{text:?}");
    }
}

/// Templates written for these tests, rendered by jinja2 as `transformers` sets it up: whitespace
/// control, macros, namespaces, loops, filters, Python methods and printing, list content.
#[test]
fn templates_render_like_jinja2() {
    let fx = fixture();
    let cases = fx["templates"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for (i, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let dir =
            std::env::temp_dir().join(format!("kvgate-tokenize-parity-{}-{i}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), TINY_TOKENIZER).unwrap();
        let config = serde_json::json!({
            "bos_token": "<s>", "eos_token": "</s>", "chat_template": case["template"]
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = tokenize::TextTokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let req = &case["request"];
        let opts = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            continue_final_message: false,
            template_kwargs: case["template_kwargs"].as_object().unwrap().clone(),
            tools: req.get("tools").cloned(),
            documents: Some(case["documents"].clone()).filter(|d| !d.is_null()),
        };
        let got = tok.render_chat(req["messages"].as_array().unwrap(), &opts);
        match case.get("error").and_then(Value::as_str) {
            Some(message) => {
                let err = got.expect_err(name);
                assert!(err.to_string().contains(message), "{name}: {err}");
            }
            None => {
                let text = got.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(text, case["text"].as_str().unwrap(), "{name}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A word-level `tokenizer.json` for template-only checks.
const TINY_TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "<unk>", "vocab": {"<unk>": 0}}
}"#;

/// The segment cache gives exactly `encode_chat`'s ids on every parity chat, cold and warm, and
/// a growing conversation only tokenizes its new turn.
#[test]
fn cached_chat_encoding_is_exact_and_reuses_history() {
    let Some(tok) = common::qwen3() else { return };
    let fx = fixture();
    let cache = tokenize::SegmentCache::new(1 << 20);
    for pass in 0..2 {
        for case in fx["chats"].as_array().unwrap() {
            let req = &case["request"];
            let opts = ChatOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                continue_final_message: case["continue_final_message"].as_bool().unwrap(),
                template_kwargs: case["template_kwargs"].as_object().unwrap().clone(),
                tools: req.get("tools").cloned(),
                documents: None,
            };
            let messages = req["messages"].as_array().unwrap();
            let (got, outcome) = tok.encode_chat_cached(messages, &opts, &cache).unwrap();
            assert_eq!(got, ids(&case["ids"]), "{} (pass {pass})", case["name"]);
            if pass == 1 {
                assert_eq!(
                    outcome.miss_bytes, 0,
                    "{}: warm pass must hit",
                    case["name"]
                );
            }
        }
    }
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are terse. ".repeat(50)})];
    let opts = ChatOptions::default();
    let mut last_total = 0;
    for turn in 0..4 {
        messages
            .push(serde_json::json!({"role": "user", "content": format!("question {turn}: why?")}));
        let (got, outcome) = tok.encode_chat_cached(&messages, &opts, &cache).unwrap();
        assert_eq!(got, tok.encode_chat(&messages, &opts).unwrap());
        if turn > 0 {
            assert!(
                outcome.hit_bytes >= last_total / 2,
                "turn {turn}: {outcome:?}"
            );
            assert!(
                outcome.miss_bytes < 120,
                "turn {turn} re-tokenized history: {outcome:?}"
            );
        }
        last_total = outcome.hit_bytes + outcome.miss_bytes;
        messages
            .push(serde_json::json!({"role": "assistant", "content": format!("because {turn}")}));
    }
}
