//! The fallback tokenizer: up to four UTF-8 bytes per token, packed little-endian into the id.
//!
//! # The exact formula
//!
//! Text is cut into chunks from left to right. At byte offset `p`, with `b` the text's bytes:
//!
//! 1. `n = min(4, len - p)`;
//! 2. if `n == 4` and `b[p + 3] >= 0x80`, then `n = 3` (so that the id stays below 2^31);
//! 3. while `n > 1` and `b[p + n - 1] == 0x00`, `n -= 1` (a chunk never ends in a NUL byte,
//!    except the one-byte chunk of a NUL itself);
//! 4. the token id is `b[p] | b[p+1] << 8 | b[p+2] << 16 | b[p+3] << 24` over the `n` bytes of the
//!    chunk (missing bytes count as zero), and `p += n`.
//!
//! Decoding inverts it: id `0` is the single byte `0x00`; any other id gives its four
//! little-endian bytes with the trailing zero bytes removed. Every id is below 2^31. Chunks need
//! not end on character boundaries, so decoding a slice of a sequence can give invalid UTF-8,
//! which decodes lossily (U+FFFD) as Hugging Face does; a whole sequence always decodes to the
//! original text.
//!
//! The id `255` (the lone byte `0xFF`, which never occurs in UTF-8) is the end-of-sequence id;
//! decoding skips it, as `skip_special_tokens` does for a real tokenizer.

use serde_json::Value;

use crate::ChatOptions;
use crate::error::Result;
use crate::messages::{self, ContentFormat};

/// The end-of-sequence id of the fallback: the byte `0xFF`, never produced from UTF-8 text.
pub const BYTE_EOS_ID: u32 = 0xFF;

/// The fallback's vocabulary size: every id below 2^31 decodes.
pub const BYTE_VOCAB_SIZE: u32 = 1 << 31;

/// Words of exactly four bytes (a space and three letters), so that any sequence of them
/// re-encodes to the same ids.
const WORDS: [&str; 32] = [
    " the", " and", " for", " are", " but", " not", " you", " all", " any", " can", " had", " her",
    " was", " one", " our", " out", " day", " get", " has", " him", " his", " how", " man", " new",
    " now", " old", " see", " two", " way", " who", " its", " say",
];

/// The deterministic, reversible fallback tokenizer. See the [module docs](self) for the formula.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ByteTokenizer {
    words: Vec<u32>,
}

impl Default for ByteTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl ByteTokenizer {
    /// The fallback tokenizer.
    pub fn new() -> Self {
        let words = WORDS.iter().map(|w| pack(w.as_bytes())).collect::<Vec<_>>();
        Self { words }
    }

    /// Token ids of `text`, by the formula in the [module docs](self).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        encode_bytes(text.as_bytes())
    }

    /// Text of `ids`; invalid UTF-8 (from a partial sequence) decodes lossily.
    pub fn decode(&self, ids: &[u32]) -> Result<String, u32> {
        let bytes = decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Ids of a few common English words, each one token whose text is a space and three letters.
    pub fn word_token_ids(&self) -> &[u32] {
        &self.words
    }
}

/// The fallback's chat prompt: a fixed ChatML form over the messages normalized as for a real
/// template (string content, text parts joined with `"\n"`):
///
/// ```text
/// [<|im_start|>tools\n{tool JSON}\n{tool JSON}…<|im_end|>\n]       when tools are given
/// <|im_start|>{role}\n{content}[\n<tool_call>\n{function JSON}\n</tool_call>…]<|im_end|>\n   per message
/// [<|im_start|>assistant\n]                                    when add_generation_prompt
/// ```
///
/// JSON is compact, keys in request order. With `continue_final_message` the last message's
/// `<|im_end|>\n` is left out.
pub fn render_chatml(messages: &[Value], opts: &ChatOptions) -> Result<String> {
    let msgs = messages::normalize(messages, ContentFormat::String, true)?;
    let mut out = String::new();
    if let Some(tools) = opts.tools.as_ref().filter(|t| !t.is_null()) {
        let tools = messages::normalize_tools(tools)?;
        let list = tools.as_array().map(Vec::as_slice).unwrap_or_default();
        if !list.is_empty() {
            out.push_str("<|im_start|>tools\n");
            for (i, tool) in list.iter().enumerate() {
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(&tool.to_string());
            }
            out.push_str("<|im_end|>\n");
        }
    }
    let last = msgs.len().saturating_sub(1);
    for (i, m) in msgs.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        let content = m.get("content").and_then(Value::as_str).unwrap_or_default();
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
        out.push_str(content);
        if let Some(Value::Array(calls)) = m.get("tool_calls") {
            for call in calls {
                out.push_str("\n<tool_call>\n");
                out.push_str(&call.get("function").unwrap_or(call).to_string());
                out.push_str("\n</tool_call>");
            }
        }
        if !(opts.continue_final_message && i == last) {
            out.push_str("<|im_end|>\n");
        }
    }
    if opts.add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    Ok(out)
}

/// Packs a chunk of one to four bytes, little-endian.
fn pack(chunk: &[u8]) -> u32 {
    chunk
        .iter()
        .enumerate()
        .fold(0u32, |id, (i, &b)| id | u32::from(b) << (8 * i))
}

/// The chunking and packing of the module docs.
pub(crate) fn encode_bytes(bytes: &[u8]) -> Vec<u32> {
    let mut ids = Vec::with_capacity(bytes.len().div_ceil(4));
    let mut rest = bytes;
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(chunk_len(rest));
        ids.push(pack(chunk));
        rest = tail;
    }
    ids
}

/// The length of the chunk starting at `rest` (steps 1–3 of the formula); 0 for empty input.
fn chunk_len(rest: &[u8]) -> usize {
    let mut n = rest.len().min(4);
    if n == 4 && rest.get(3).is_some_and(|&b| b >= 0x80) {
        n = 3;
    }
    while n > 1 && rest.get(n - 1) == Some(&0) {
        n -= 1;
    }
    n
}

/// The first chunk boundary at or after `min`, walking from `from`, itself a boundary (0, or
/// an earlier result). Cutting at a boundary is additive: a chunk only looks at bytes after its
/// start, and no chunk crosses a boundary, so `encode(text[..c]) ++ encode(text[c..])` is
/// `encode(text)`.
pub(crate) fn boundary_after(bytes: &[u8], from: usize, min: usize) -> usize {
    let mut p = from.min(bytes.len());
    while p < min && p < bytes.len() {
        p += chunk_len(bytes.get(p..).unwrap_or_default()).max(1);
    }
    p.min(bytes.len())
}

/// Inverts [`encode_bytes`], skipping [`BYTE_EOS_ID`]; an id of 2^31 or more is returned as the error.
pub(crate) fn decode_bytes(ids: &[u32]) -> Result<Vec<u8>, u32> {
    let mut out = Vec::with_capacity(ids.len() * 4);
    for &id in ids {
        if id >= BYTE_VOCAB_SIZE {
            return Err(id);
        }
        if id == BYTE_EOS_ID {
            continue;
        }
        if id == 0 {
            out.push(0);
            continue;
        }
        let le = id.to_le_bytes();
        let len = 4 - (id.leading_zeros() / 8) as usize;
        out.extend(le.iter().take(len));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascii_packs_four_bytes_little_endian() {
        let t = ByteTokenizer::new();
        assert_eq!(t.encode("abcd"), vec![0x6463_6261]);
        assert_eq!(t.encode("abcde"), vec![0x6463_6261, 0x65]);
        assert_eq!(t.encode(""), Vec::<u32>::new());
    }

    #[test]
    fn fourth_byte_with_high_bit_shortens_the_chunk() {
        // "abc" then "é" (C3 A9): the 4th byte C3 has its high bit set.
        let t = ByteTokenizer::new();
        let ids = t.encode("abcé");
        assert_eq!(ids, vec![0x0063_6261, 0xA9C3]);
        assert!(ids.iter().all(|&id| id < BYTE_VOCAB_SIZE));
        assert_eq!(t.decode(&ids).unwrap(), "abcé");
        // A four-byte character: F0 9F 98 80.
        let ids = t.encode("😀");
        assert_eq!(ids, vec![0x0098_9FF0, 0x80]);
        assert_eq!(t.decode(&ids).unwrap(), "😀");
    }

    #[test]
    fn nul_bytes_round_trip() {
        let t = ByteTokenizer::new();
        for s in ["\0", "\0\0", "a\0", "a\0\0\0b", "\0\0\0\0\0", "ab\0\0"] {
            let ids = t.encode(s);
            assert_eq!(t.decode(&ids).unwrap(), s, "{s:?} -> {ids:?}");
        }
        assert_eq!(t.encode("\0"), vec![0]);
        assert_eq!(t.encode("a\0"), vec![0x61, 0]);
    }

    #[test]
    fn eos_is_never_produced_and_is_skipped() {
        let t = ByteTokenizer::new();
        assert_eq!(t.decode(&[0x61, BYTE_EOS_ID]).unwrap(), "a");
        assert_eq!(t.decode(&[u32::MAX]), Err(u32::MAX));
    }

    #[test]
    fn words_are_single_tokens_and_concatenate_stably() {
        let t = ByteTokenizer::new();
        let words = t.word_token_ids().to_vec();
        assert_eq!(words.len(), WORDS.len());
        let text = t.decode(&words).unwrap();
        assert_eq!(t.encode(&text), words);
        assert!(!words.contains(&BYTE_EOS_ID));
    }

    #[test]
    fn partial_sequences_decode_lossily() {
        let t = ByteTokenizer::new();
        let ids = t.encode("😀");
        assert_eq!(t.decode(&ids[..1]).unwrap(), "\u{FFFD}");
    }
}
