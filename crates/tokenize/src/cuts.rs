//! Cut points *inside* a segment at which a Hugging Face tokenizer is additive:
//! `ids(a + b) == ids(a) ++ ids(b)`.
//!
//! Special tokens already cut a prompt into segments (see `cache.rs`). Inside a segment, a cut
//! is additive only if the normalizer, the added-token split, the pre-tokenizer and the model
//! all treat the text on either side independently. kvgate knows one such cut, for one family
//! of tokenizers, and detects that family from the loaded tokenizer; any other tokenizer gets
//! no inner cuts (segments stay whole), so an unknown tokenizer is never cut wrongly.
//!
//! # The word-space cut
//!
//! The cut sits right before a space that follows an ASCII letter and precedes an ASCII letter
//! (`…a| b…`). It is additive when:
//!
//! - the normalizer is absent or NFC. A space never composes with the character before it and
//!   has canonical combining class 0, so `NFC(a + b) == NFC(a) + NFC(b)` when `b` starts with
//!   one; the letter before the cut is ASCII and stays what it is;
//! - no added token contains a space (no added-token match can span the cut), and none has
//!   `rstrip` (a token ending at the cut would absorb the space in `a + b` but not in `a`);
//!   `lstrip` and `single_word` look only at the space, which both sides see alike;
//! - the pre-tokenizer is `Sequence[Split(P, Isolated), ByteLevel(use_regex = false)]` with `P`
//!   the GPT-4 (cl100k, Llama 3) or Qwen2 split pattern ([`KNOWN_SPLIT_PATTERNS`]). In `P` only
//!   the contraction branch and `\p{L}+` consume letters, and neither consumes a space, so the
//!   regex match that holds the letter before the cut ends exactly at the cut and the next
//!   search starts there. `P` has no look-behind and no anchors, and its one look-ahead
//!   (`\s+(?!\S)`) never reads past a letter, so matching `a` alone and `b` alone gives the
//!   same pieces as matching `a + b`. `ByteLevel` without its regex maps each piece's bytes;
//! - the model is BPE without dropout (tokenizes each piece alone, deterministically), and
//!   neither truncation nor padding is configured.
//!
//! The property test `tests/additive_cuts.rs` checks the claim against whole-text tokenization
//! with the real Qwen3 tokenizer.

use serde_json::Value;
use tokenizers::models::ModelWrapper;

/// Split patterns for which the word-space cut is additive: Qwen2/Qwen3 (`\p{N}`), and GPT-4's
/// cl100k as Llama 3 ships it (`\p{N}{1,3}`).
pub(crate) const KNOWN_SPLIT_PATTERNS: [&str; 2] = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Which cuts inside a segment a tokenizer is known to be additive at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InnerCuts {
    /// None: segments are tokenized whole.
    None,
    /// Before a space between two ASCII letters (see the module docs).
    WordSpace,
}

impl InnerCuts {
    /// What `tok` allows, by the conditions in the module docs.
    pub(crate) fn detect(tok: &tokenizers::Tokenizer) -> Self {
        let plain = tok.get_truncation().is_none() && tok.get_padding().is_none();
        let bpe = matches!(tok.get_model(), ModelWrapper::BPE(m) if m.dropout.is_none());
        let normalizer_ok = match tok.get_normalizer() {
            None => true,
            Some(n) => serde_json::to_value(n).is_ok_and(|v| type_is(&v, "NFC")),
        };
        let added_ok = tok
            .get_added_tokens_decoder()
            .values()
            .all(|t| !t.rstrip && !t.content.contains(' '));
        let pre_ok = tok
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_value(p).ok())
            .is_some_and(|v| known_pre_tokenizer(&v));
        if plain && bpe && normalizer_ok && added_ok && pre_ok {
            Self::WordSpace
        } else {
            Self::None
        }
    }

    /// The first cut `c` with `from <= c` and `c + 1 < end` (the letter after the space lies
    /// before `end`), or `None`. `from` must be above the segment's start.
    pub(crate) fn next(self, text: &str, from: usize, end: usize) -> Option<usize> {
        match self {
            Self::None => None,
            Self::WordSpace => {
                let bytes = text.as_bytes();
                let end = end.min(bytes.len());
                let start = from.max(1);
                let window = bytes.get(start.saturating_sub(1)..end)?;
                window
                    .windows(3)
                    .position(|w| {
                        matches!(w, [l, b' ', r] if l.is_ascii_alphabetic() && r.is_ascii_alphabetic())
                    })
                    .map(|i| start + i)
            }
        }
    }
}

/// Whether the post-processor adds nothing with `add_special_tokens = true` (none, or
/// `ByteLevel`, which only trims offsets): then a completions prompt is additive at the same
/// cuts as a chat.
pub(crate) fn post_processor_adds_nothing(tok: &tokenizers::Tokenizer) -> bool {
    match tok.get_post_processor() {
        None => true,
        Some(p) => serde_json::to_value(p).is_ok_and(|v| type_is(&v, "ByteLevel")),
    }
}

fn type_is(v: &Value, name: &str) -> bool {
    v.get("type").and_then(Value::as_str) == Some(name)
}

/// `Sequence[Split(known pattern, Isolated, invert = false), ByteLevel(add_prefix_space =
/// false, use_regex = false)]`.
fn known_pre_tokenizer(v: &Value) -> bool {
    if !type_is(v, "Sequence") {
        return false;
    }
    let Some([split, byte_level]) = v
        .get("pretokenizers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    else {
        return false;
    };
    let pattern = split
        .get("pattern")
        .and_then(|p| p.get("Regex"))
        .and_then(Value::as_str);
    let split_ok = type_is(split, "Split")
        && pattern.is_some_and(|p| KNOWN_SPLIT_PATTERNS.contains(&p))
        && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
        && split.get("invert").and_then(Value::as_bool) == Some(false);
    let byte_level_ok = type_is(byte_level, "ByteLevel")
        && byte_level.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
        && byte_level.get("use_regex").and_then(Value::as_bool) == Some(false);
    split_ok && byte_level_ok
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn word_space_cuts_sit_before_a_space_between_ascii_letters() {
        let c = InnerCuts::WordSpace;
        let t = "ab cd  ef g1 h é i j";
        assert_eq!(c.next(t, 1, t.len()), Some(2));
        assert_eq!(c.next(t, 3, t.len()), Some(9));
        // Not after a digit, nor around a non-ASCII letter.
        assert_eq!(c.next(t, 10, t.len()), Some(19));
        // The letter after the space must lie before `end`.
        assert_eq!(c.next(t, 1, 3), None);
        assert_eq!(c.next(t, 1, 4), Some(2));
        assert_eq!(c.next(" a", 0, 2), None);
        assert_eq!(InnerCuts::None.next(t, 1, t.len()), None);
    }

    fn tokenizer(pre: &str, normalizer: &str, added: &str) -> tokenizers::Tokenizer {
        let json = format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{added}],
              "normalizer": {normalizer}, "pre_tokenizer": {pre}, "post_processor": null,
              "decoder": null,
              "model": {{"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": {{"a": 0}}, "merges": []}}}}"#
        );
        tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap()
    }

    fn qwen_pre(pattern: &str) -> String {
        let p = serde_json::to_string(pattern).unwrap();
        format!(
            r#"{{"type": "Sequence", "pretokenizers": [
                {{"type": "Split", "pattern": {{"Regex": {p}}}, "behavior": "Isolated", "invert": false}},
                {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}}]}}"#
        )
    }

    #[test]
    fn detection_accepts_the_known_family_only() {
        let nfc = r#"{"type": "NFC"}"#;
        for p in KNOWN_SPLIT_PATTERNS {
            assert_eq!(
                InnerCuts::detect(&tokenizer(&qwen_pre(p), nfc, "")),
                InnerCuts::WordSpace
            );
            assert_eq!(
                InnerCuts::detect(&tokenizer(&qwen_pre(p), "null", "")),
                InnerCuts::WordSpace
            );
        }
        let qwen = qwen_pre(KNOWN_SPLIT_PATTERNS[0]);
        let other = qwen_pre(r"\p{L}+|\s+");
        let lower = r#"{"type": "Lowercase"}"#;
        let spaced = r#"{"id": 1, "content": "a b", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}"#;
        let rstrip = r#"{"id": 1, "content": "<x>", "single_word": false, "lstrip": false,
            "rstrip": true, "normalized": false, "special": true}"#;
        let whitespace = r#"{"type": "Whitespace"}"#;
        for (pre, norm, added) in [
            (other.as_str(), nfc, ""),
            (qwen.as_str(), lower, ""),
            (qwen.as_str(), nfc, spaced),
            (qwen.as_str(), nfc, rstrip),
            (whitespace, nfc, ""),
        ] {
            assert_eq!(
                InnerCuts::detect(&tokenizer(pre, norm, added)),
                InnerCuts::None,
                "{pre} {norm} {added}"
            );
        }
    }
}
