//! Chunked encoding equals whole-text encoding: the cuts an `EncodeCursor` makes inside a
//! segment are additive, for the real Qwen3 tokenizer (word-space cuts) and the byte fallback
//! (its own chunk boundaries), on random text with unicode, digits, whitespace runs, newlines,
//! contractions and special tokens.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use proptest::prelude::*;
use tokenize::{ChatOptions, EncodeCursor, SegmentCache, TextTokenizer};

/// Pieces random texts are built from; several are chosen to sit next to a word-space cut.
const PIECES: &[&str] = &[
    "a",
    "the",
    "Cache",
    "token",
    "I",
    "x",
    " ",
    " ",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "0",
    "7",
    "123",
    "45678",
    "'s",
    "'T",
    "'ll",
    "n't",
    ".",
    ",",
    "!?",
    "...",
    "-",
    "(",
    ")",
    "\"",
    "#",
    "é",
    "e\u{301}",
    "ü",
    "Ω",
    "中文",
    "日本",
    "😀",
    "\u{a0}",
    "\u{3000}",
    "ß",
    "İ",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|endoftext|>",
    "<|im_start",
    "<|",
    "|>",
    "<",
    ">",
];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(0..PIECES.len(), 0..120)
        .prop_map(|ix| ix.into_iter().map(|i| PIECES[i]).collect::<String>())
}

fn drain(mut cursor: EncodeCursor<'_>) -> (Vec<u32>, usize) {
    let mut ids = Vec::new();
    let mut chunks = 0;
    while let Some(n) = cursor.next_into(&mut ids) {
        n.unwrap();
        chunks += 1;
        assert!(cursor.consumed_bytes() <= cursor.text().len());
    }
    assert_eq!(cursor.estimated_tokens(), ids.len());
    assert_eq!(cursor.tokens(), ids.len());
    (ids, chunks)
}

fn check_prompt(tok: &TextTokenizer, text: &str, chunk: usize) {
    let whole = tok.encode_prompt(text).unwrap();
    let (ids, _) = drain(tok.prompt_cursor(text, None, chunk).unwrap());
    assert_eq!(ids, whole, "prompt {text:?}, chunk {chunk}");
    let cache = SegmentCache::new(1 << 20);
    for pass in 0..2 {
        let cursor = tok.prompt_cursor(text, Some(&cache), chunk).unwrap();
        let (ids, _) = drain(cursor);
        assert_eq!(ids, whole, "cached pass {pass}: {text:?}, chunk {chunk}");
    }
}

fn check_chat(tok: &TextTokenizer, user: &str, answer: &str, chunk: usize) {
    let messages = vec![
        serde_json::json!({"role": "system", "content": "You are a terse assistant."}),
        serde_json::json!({"role": "user", "content": user}),
        serde_json::json!({"role": "assistant", "content": answer}),
        serde_json::json!({"role": "user", "content": user}),
    ];
    let opts = ChatOptions::default();
    let whole = tok.encode_chat(&messages, &opts).unwrap();
    let cache = SegmentCache::new(1 << 20);
    for pass in 0..2 {
        let cursor = tok
            .chat_cursor(&messages, &opts, Some(&cache), chunk)
            .unwrap();
        let (ids, _) = drain(cursor);
        assert_eq!(
            ids, whole,
            "pass {pass}: {user:?} / {answer:?}, chunk {chunk}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn qwen3_chunks_concatenate_to_whole_text_ids(t in text(), u in text(), chunk in 1usize..160) {
        let Some(tok) = common::qwen3() else { return Ok(()) };
        check_prompt(tok, &t, chunk);
        check_chat(tok, &t, &u, chunk);
    }

    #[test]
    fn byte_chunks_concatenate_to_whole_text_ids(t in text(), u in text(), chunk in 1usize..40) {
        let tok = TextTokenizer::fallback();
        check_prompt(&tok, &t, chunk);
        check_chat(&tok, &t, &u, chunk);
    }
}

/// Qwen3 is detected as having word-space cuts, and English text is cut inside one message:
/// many chunks, each hit on a second pass.
#[test]
fn qwen3_cuts_inside_a_message_and_the_cache_serves_every_chunk() {
    let Some(tok) = common::qwen3() else { return };
    assert!(tok.as_hf().unwrap().has_inner_cuts());
    let content = "the quick brown fox jumps over the lazy dog and ".repeat(200);
    let messages = vec![serde_json::json!({"role": "user", "content": content})];
    let opts = ChatOptions::default();
    let whole = tok.encode_chat(&messages, &opts).unwrap();
    let cache = SegmentCache::new(1 << 22);
    let (ids, chunks) = drain(
        tok.chat_cursor(&messages, &opts, Some(&cache), 256)
            .unwrap(),
    );
    assert_eq!(ids, whole);
    assert!(chunks >= 30, "only {chunks} chunks");
    let mut warm = tok
        .chat_cursor(&messages, &opts, Some(&cache), 256)
        .unwrap();
    let mut again = Vec::new();
    while let Some(n) = warm.next_into(&mut again) {
        n.unwrap();
    }
    assert_eq!(again, whole);
    assert_eq!(warm.outcome().miss_bytes, 0, "{:?}", warm.outcome());
    // Stopping after the first chunk leaves an estimate near the true count.
    let mut early = tok.chat_cursor(&messages, &opts, None, 256).unwrap();
    let mut first = Vec::new();
    early.next_into(&mut first).unwrap().unwrap();
    assert!(!early.is_done());
    let est = early.estimated_tokens();
    assert!(
        est * 10 >= whole.len() * 8 && est * 10 <= whole.len() * 12,
        "estimate {est} vs {}",
        whole.len()
    );
}

/// Steps `cursor` through `next_cached_into` only: the ids and the number of lookups that hit.
fn drain_cached(mut cursor: EncodeCursor<'_>) -> (Vec<u32>, usize) {
    let mut ids = Vec::new();
    let mut steps = 0;
    while cursor.next_cached_into(&mut ids).is_some() {
        steps += 1;
    }
    assert!(
        cursor.is_done(),
        "a lookup missed at byte {}",
        cursor.consumed_bytes()
    );
    assert_eq!(cursor.outcome().miss_bytes, 0);
    (ids, steps)
}

/// A resent message is found whole, one lookup instead of one per chunk, with the same ids:
/// whichever way the first pass walked it (tokenizing, as the finisher does, or looking each
/// chunk up first, as the request path does).
#[test]
fn qwen3_resent_messages_are_found_whole() {
    let Some(tok) = common::qwen3() else { return };
    let content = "the quick brown fox jumps over the lazy dog and ".repeat(200);
    let messages = vec![
        serde_json::json!({"role": "user", "content": content}),
        serde_json::json!({"role": "assistant", "content": "It sleeps."}),
        serde_json::json!({"role": "user", "content": "And then?"}),
    ];
    let opts = ChatOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let whole = tok.encode_chat(&messages, &opts).unwrap();
    for request_path_first in [false, true] {
        let cache = SegmentCache::new(1 << 22);
        let mut first = tok
            .chat_cursor(&messages, &opts, Some(&cache), 256)
            .unwrap();
        let mut ids = Vec::new();
        let mut chunks = 0;
        while !first.is_done() {
            chunks += 1;
            if request_path_first && first.next_cached_into(&mut ids).is_some() {
                continue;
            }
            first.next_into(&mut ids).unwrap().unwrap();
        }
        assert_eq!(ids, whole);
        assert!(chunks >= 30, "only {chunks} chunks");
        let (again, steps) = drain_cached(
            tok.chat_cursor(&messages, &opts, Some(&cache), 256)
                .unwrap(),
        );
        assert_eq!(again, whole);
        // One lookup per segment: the three messages' openings and endings and the
        // generation prompt, not the long message's 30+ chunks.
        assert!(steps <= 8, "{steps} lookups");
    }
}

/// A segment first seen as the text's last (a growing completions prompt: cached by chunks
/// only) is cached whole once it is seen followed by more text, and found whole after that.
#[test]
fn qwen3_segment_cached_whole_once_not_last() {
    let Some(tok) = common::qwen3() else { return };
    let long = "the quick brown fox jumps over the lazy dog and ".repeat(100);
    let followed = format!("{long}<|im_end|>");
    let cache = SegmentCache::new(1 << 22);
    let (ids, chunks) = drain(tok.prompt_cursor(&long, Some(&cache), 256).unwrap());
    assert_eq!(ids, tok.encode_prompt(&long).unwrap());
    assert!(chunks >= 10, "only {chunks} chunks");
    let expect = tok.encode_prompt(&followed).unwrap();
    // Its chunks hit one by one; the segment is collected and cached whole.
    let mut second = tok.prompt_cursor(&followed, Some(&cache), 256).unwrap();
    let mut ids = Vec::new();
    let mut hits = 0;
    while second.next_cached_into(&mut ids).is_some() {
        hits += 1;
    }
    assert_eq!(hits, chunks, "every chunk of the first pass hits");
    second.next_into(&mut ids).unwrap().unwrap();
    assert!(second.is_done());
    assert_eq!(ids, expect);
    // Now one lookup finds it.
    let (third, steps) = drain_cached(tok.prompt_cursor(&followed, Some(&cache), 256).unwrap());
    assert_eq!(third, expect);
    assert_eq!(steps, 2);
}
