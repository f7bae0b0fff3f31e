//! Token ids against a real vLLM 0.32 (`shared/fixtures/vllm/v0.32.0-map`): every chat and text
//! completions request the engine received, with the `prompt_token_ids` it returned, or for the
//! ~1850-token prompts whose ids were left out, the `token_ids` of the blocks it published.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use serde_json::Value;
use tokenize::{ChatOptions, TextTokenizer};

/// The token ids of the first (parentless) BlockStored event published during `phase`.
fn stored_prefix(decoded: &Value, phase: &str) -> Vec<u32> {
    decoded["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["phase"] == phase)
        .flat_map(|m| m["batch"]["events"].as_array().unwrap().iter())
        .find(|e| e["type"] == "BlockStored" && e["parent_block_hash"].is_null())
        .map(|e| ids(&e["token_ids"]))
        .unwrap_or_else(|| panic!("no root BlockStored for phase {phase}"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

/// Checks one run; returns (chat requests, text prompts) checked.
fn check_run(tok: &TextTokenizer, suffix: &str) -> (usize, usize) {
    let dir = common::shared().join("fixtures/vllm/v0.32.0-map");
    let requests = common::read_json(dir.join(format!("requests{suffix}.json")));
    let decoded = common::read_json(dir.join(format!("decoded{suffix}.json")));
    let (mut chats, mut prompts) = (0, 0);
    for req in requests["requests"].as_array().unwrap() {
        let phase = req["phase"].as_str().unwrap();
        let body = &req["body"];
        let usage = req["usage"]["prompt_tokens"].as_u64().map(|n| n as usize);
        let got = match req["path"].as_str().unwrap() {
            "/v1/chat/completions" => {
                chats += 1;
                let messages = body["messages"].as_array().unwrap();
                tok.encode_chat(messages, &ChatOptions::default()).unwrap()
            }
            "/v1/completions" => match &body["prompt"] {
                Value::String(prompt) => {
                    prompts += 1;
                    tok.encode_prompt(prompt).unwrap()
                }
                // A prompt of token ids is used as given.
                _ => continue,
            },
            _ => continue,
        };
        assert_eq!(Some(got.len()), usage, "run{suffix} {phase}: prompt_tokens");
        let expected = req
            .get("prompt_token_ids")
            .filter(|v| !v.is_null())
            .map(ids)
            .unwrap_or_default();
        if expected.is_empty() {
            let stored = stored_prefix(&decoded, phase);
            assert!(
                stored.len() >= got.len() / 32 * 32 - 32,
                "run{suffix} {phase}: short"
            );
            assert_eq!(
                &got[..stored.len()],
                stored.as_slice(),
                "run{suffix} {phase}: block ids"
            );
        } else {
            assert_eq!(got, expected, "run{suffix} {phase}: prompt_token_ids");
        }
    }
    (chats, prompts)
}

#[test]
fn qwen3_reproduces_vllm_prompt_token_ids() {
    let Some(tok) = common::qwen3() else { return };
    assert!(tok.is_exact());
    assert_eq!(check_run(tok, ""), (3, 4));
    assert_eq!(check_run(tok, "_evict"), (1, 6));
    assert_eq!(check_run(tok, "_nohashseed"), (2, 0));
}

#[test]
fn qwen3_decodes_the_chat_back() {
    let Some(tok) = common::qwen3() else { return };
    let dir = common::shared().join("fixtures/vllm/v0.32.0-map");
    let requests = common::read_json(dir.join("requests.json"));
    let req = &requests["requests"][0];
    let ids = ids(&req["prompt_token_ids"]);
    let text = tok.decode(&ids).unwrap();
    // Special tokens are skipped; the user's question survives.
    assert!(!text.contains("<|im_start|>"));
    assert!(text.contains("What is the capital of France?"));
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.vocab_size(), 151_669);
}
