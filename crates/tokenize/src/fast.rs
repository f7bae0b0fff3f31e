//! A faster encoder for the Qwen2/Qwen3 and GPT-4 (cl100k) tokenizer family, giving exactly
//! the ids of the Hugging Face pipeline.
//!
//! The `tokenizers` pipeline builds, for every piece of text, a normalized string with per-byte
//! alignments, then an `Encoding` with offsets, words and masks; at about a microsecond a token
//! that bookkeeping, not the BPE merges, is most of the cost. For the family `cuts.rs` detects
//! (`Split(P, Isolated)` + `ByteLevel(use_regex = false)`, BPE without dropout, no normalizer or
//! NFC, no truncation or padding), the pipeline reduces to:
//!
//! - normalization: NFC leaves ASCII unchanged; other text is put in NFC, stretch by stretch
//!   between added tokens, with the tables the pipeline uses (`unicode-normalization-alignments`);
//! - added tokens: the text is split on them first, leftmost match first and the longest at a
//!   position, each match giving its token's id. The fast path does this for *plain* added
//!   tokens (matched on the raw text, `normalized: false`, and absorbing no whitespace and
//!   matched anywhere: `lstrip`, `rstrip` and `single_word` off), which every added token of
//!   Qwen2/Qwen3 and Llama 3 is. Text holding any other added token, non-ASCII text when the
//!   tokenizer has any other (normalization could make one), and any text when the tokenizer
//!   encodes special tokens as text, go through the full pipeline;
//! - the split pattern `P` (see [`crate::cuts::KNOWN_SPLIT_PATTERNS`]), on each stretch of text
//!   between added tokens alone. On ASCII its classes are `\p{L}` = letters, `\p{N}` = digits
//!   and `\s` = `[\t\n\x0B\x0C\r ]`, and [`piece_end`] follows its alternatives in order with
//!   the regex's backtracking, piece by piece. A stretch holding other characters is split by
//!   `P` itself, compiled with the engine the pipeline uses (`fancy-regex`), whose matches and
//!   the gaps between them are the pieces, as in the pipeline; a regex error (its backtracking
//!   limit) sends the whole text to the pipeline;
//! - `ByteLevel`: each byte becomes its GPT-2 character;
//! - the model: BPE on each piece alone, through the model's own `tokenize` (its merges and
//!   cache).
//!
//! Before the fast path split on added tokens, a prompt holding them (a chat's `<|im_start|>` at
//! every message, or a client's `<|fim_prefix|>` every hundred bytes) paid the pipeline's cost
//! for each chunk holding one: about 13× the fast path's, per byte. Before it took non-ASCII
//! text, a Chinese prompt paid about 3× an English one's cost per byte.
//!
//! The property tests below check the ids against the full pipeline's on random text (letters,
//! digits, every ASCII whitespace, punctuation, contractions, added tokens whole and cut short,
//! and non-ASCII: CJK, Cyrillic, accents composed and decomposed, combining marks, other
//! scripts' digits and spaces, `ſ` and the Kelvin sign after an apostrophe, emoji) with the
//! real Qwen3 tokenizer, with a copy of it without its NFC normalizer, and with a copy whose
//! `<think>` strips whitespace (the fast path must decline text holding it, and non-ASCII
//! text).

use tokenizers::Model;
use tokenizers::models::ModelWrapper;
use unicode_normalization_alignments::UnicodeNormalization;

use crate::cuts::{InnerCuts, KNOWN_SPLIT_PATTERNS};
use crate::error::{Result, TokenizeError};

/// The fast path for one loaded tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct FastPath {
    /// Digits per number piece: 1 for Qwen's `\p{N}`, 3 for cl100k's `\p{N}{1,3}`.
    digits: usize,
    /// The split pattern, for stretches that are not ASCII.
    split: fancy_regex::Regex,
    /// Whether the normalizer is NFC (else there is none).
    nfc: bool,
    /// GPT-2's byte → character map of `ByteLevel`.
    byte_chars: [char; 256],
    /// The plain added tokens (see the module docs) and their ids, longest first, so that the
    /// first one matching at a position is the pipeline's (leftmost-longest) match.
    plain: Vec<(String, u32)>,
    /// Every other added token's content: text holding one takes the full pipeline.
    other: Vec<String>,
    /// Bytes an added token starts with.
    added_firsts: [bool; 256],
}

/// An added token found in a text: where it is and its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AddedMatch {
    start: usize,
    end: usize,
    id: u32,
}

impl FastPath {
    /// The fast path for `tok`, when it belongs to the family (see the module docs).
    pub(crate) fn detect(tok: &tokenizers::Tokenizer) -> Option<Self> {
        if InnerCuts::detect(tok) != InnerCuts::WordSpace || tok.get_encode_special_tokens() {
            return None;
        }
        let pattern = tok
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_value(p).ok())
            .and_then(|v| {
                let p = v
                    .get("pretokenizers")?
                    .get(0)?
                    .get("pattern")?
                    .get("Regex")?;
                p.as_str().map(str::to_owned)
            })?;
        let digits = match KNOWN_SPLIT_PATTERNS.iter().position(|p| *p == pattern)? {
            0 => 1,
            _ => 3,
        };
        let split = fancy_regex::Regex::new(&pattern).ok()?;
        // `InnerCuts::detect` allowed no normalizer or NFC alone.
        let nfc = tok.get_normalizer().is_some();
        let mut plain = Vec::new();
        let mut other = Vec::new();
        for (id, t) in tok.get_added_tokens_decoder() {
            if t.content.is_empty() {
                continue;
            }
            if t.normalized || t.lstrip || t.rstrip || t.single_word {
                other.push(t.content);
            } else {
                plain.push((t.content, id));
            }
        }
        plain.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        let mut added_firsts = [false; 256];
        for t in plain.iter().map(|(t, _)| t).chain(&other) {
            if let Some(slot) = t
                .as_bytes()
                .first()
                .and_then(|&b| added_firsts.get_mut(usize::from(b)))
            {
                *slot = true;
            }
        }
        Some(Self {
            digits,
            split,
            nfc,
            byte_chars: byte_chars(),
            plain,
            other,
            added_firsts,
        })
    }

    /// The added tokens in `text`, in order, as the pipeline's added-token split finds them;
    /// `None` when the text does not qualify: holding an added token that is not plain, or not
    /// ASCII while the tokenizer has such tokens (see the module docs). Tokens are matched on
    /// the bytes: a match of UTF-8 in UTF-8 starts and ends on character boundaries.
    fn added_matches(&self, text: &str) -> Option<Vec<AddedMatch>> {
        let bytes = text.as_bytes();
        if !self.other.is_empty() && !bytes.is_ascii() {
            return None;
        }
        let mut found = Vec::new();
        let mut i = 0;
        while let Some(at) = bytes.get(i..).and_then(|rest| {
            rest.iter()
                .position(|&b| {
                    self.added_firsts
                        .get(usize::from(b))
                        .copied()
                        .unwrap_or(false)
                })
                .map(|off| i + off)
        }) {
            let rest = bytes.get(at..).unwrap_or_default();
            if self.other.iter().any(|t| rest.starts_with(t.as_bytes())) {
                return None;
            }
            match self
                .plain
                .iter()
                .find(|(t, _)| rest.starts_with(t.as_bytes()))
            {
                Some((t, id)) => {
                    found.push(AddedMatch {
                        start: at,
                        end: at + t.len(),
                        id: *id,
                    });
                    i = at + t.len();
                }
                None => i = at + 1,
            }
        }
        Some(found)
    }

    /// Appends the ids of `text` to `out` and returns true, or returns false (and appends
    /// nothing) when the text does not qualify (see the module docs).
    pub(crate) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<bool> {
        let Some(added) = self.added_matches(text) else {
            return Ok(false);
        };
        let before = out.len();
        let mut piece = String::new();
        let mut start = 0;
        for m in added.iter().map(Some).chain(std::iter::once(None)) {
            let end = m.map_or(text.len(), |m| m.start);
            let Some(stretch) = text.get(start..end) else {
                out.truncate(before);
                return Ok(false);
            };
            let done = if stretch.is_ascii() {
                self.encode_ascii(model, stretch.as_bytes(), &mut piece, out)
                    .map(|()| true)
            } else {
                self.encode_unicode(model, stretch, &mut piece, out)
            };
            match done {
                Ok(true) => {}
                Ok(false) => {
                    out.truncate(before);
                    return Ok(false);
                }
                Err(source) => {
                    out.truncate(before);
                    return Err(TokenizeError::Encode { source });
                }
            }
            if let Some(m) = m {
                out.push(m.id);
                start = m.end;
            }
        }
        Ok(true)
    }

    /// Appends the ids of ASCII text holding no added token: split by the pattern, each piece
    /// mapped to GPT-2 characters and tokenized by the model.
    fn encode_ascii(
        &self,
        model: &ModelWrapper,
        bytes: &[u8],
        piece: &mut String,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let mut i = 0;
        while i < bytes.len() {
            let end = piece_end(bytes, i, self.digits);
            self.tokenize_piece(model, bytes.get(i..end).unwrap_or_default(), piece, out)?;
            i = end.max(i + 1);
        }
        Ok(())
    }

    /// Appends the ids of other text holding no added token: normalized, split by the compiled
    /// pattern (its matches and the gaps between them), each piece tokenized as in
    /// [`Self::encode_ascii`]. `Ok(false)` when the regex gives up (its backtracking limit): the
    /// pipeline's split would stop there, and the caller declines the whole text.
    fn encode_unicode(
        &self,
        model: &ModelWrapper,
        text: &str,
        piece: &mut String,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<bool> {
        let normalized: String;
        let text = if self.nfc {
            normalized = text.nfc().map(|(c, _)| c).collect();
            normalized.as_str()
        } else {
            text
        };
        let bytes = text.as_bytes();
        let mut prev = 0;
        for m in self.split.find_iter(text) {
            let Ok(m) = m else {
                return Ok(false);
            };
            for (s, e) in [(prev, m.start()), (m.start(), m.end())] {
                if s < e {
                    self.tokenize_piece(model, bytes.get(s..e).unwrap_or_default(), piece, out)?;
                }
            }
            prev = m.end();
        }
        if prev < bytes.len() {
            self.tokenize_piece(model, bytes.get(prev..).unwrap_or_default(), piece, out)?;
        }
        Ok(true)
    }

    /// Appends the model's ids of one piece, its bytes mapped to GPT-2 characters.
    #[inline]
    fn tokenize_piece(
        &self,
        model: &ModelWrapper,
        bytes: &[u8],
        piece: &mut String,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        piece.clear();
        for &b in bytes {
            piece.push(self.byte_chars.get(usize::from(b)).copied().unwrap_or('?'));
        }
        out.extend(model.tokenize(piece)?.iter().map(|t| t.id));
        Ok(())
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
}

fn is_crlf(b: u8) -> bool {
    matches!(b, b'\r' | b'\n')
}

/// Neither whitespace, letter nor digit: `[^\s\p{L}\p{N}]` on ASCII.
fn is_punct(b: u8) -> bool {
    !is_ws(b) && !b.is_ascii_alphanumeric()
}

/// The end of the first run of bytes satisfying `f` from `i`.
fn run_end(bytes: &[u8], i: usize, f: impl Fn(u8) -> bool) -> usize {
    let len = bytes
        .get(i..)
        .map_or(0, |rest| rest.iter().take_while(|&&b| f(b)).count());
    i + len
}

/// Where the split pattern's match starting at `i` ends, on ASCII `bytes` (`i < bytes.len()`):
/// its alternatives in order, each with the regex's backtracking (see the module docs).
pub(crate) fn piece_end(bytes: &[u8], i: usize, digits: usize) -> usize {
    let Some(&c) = bytes.get(i) else {
        return i;
    };
    let at = |k: usize| bytes.get(k).copied();
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == b'\'' {
        let d = at(i + 1).map(|b| b.to_ascii_lowercase());
        let e = at(i + 2).map(|b| b.to_ascii_lowercase());
        match (d, e) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
            (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return i + 3,
            _ => {}
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if !is_crlf(c)
        && !c.is_ascii_alphanumeric()
        && at(i + 1).is_some_and(|b| b.is_ascii_alphabetic())
    {
        return run_end(bytes, i + 1, |b| b.is_ascii_alphabetic());
    }
    if c.is_ascii_alphabetic() {
        return run_end(bytes, i, |b| b.is_ascii_alphabetic());
    }
    // \p{N} (Qwen) or \p{N}{1,3} (cl100k)
    if c.is_ascii_digit() {
        return i
            + 1
            + bytes.get(i + 1..).map_or(0, |rest| {
                rest.iter()
                    .take(digits.saturating_sub(1))
                    .take_while(|b| b.is_ascii_digit())
                    .count()
            });
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let start = if c == b' ' && at(i + 1).is_some_and(is_punct) {
        i + 1
    } else {
        i
    };
    if at(start).is_some_and(is_punct) {
        let end = run_end(bytes, start, is_punct);
        return run_end(bytes, end, is_crlf);
    }
    // Whitespace from here on: the run is [i, j).
    let j = run_end(bytes, i, is_ws);
    // \s*[\r\n]+ ends after the run's last line break.
    if let Some(p) = (i..j).rev().find(|&k| at(k).is_some_and(is_crlf)) {
        return p + 1;
    }
    // \s+(?!\S): the whole run at the end of the text, else all but its last byte.
    if j == bytes.len() {
        return j;
    }
    if j - i >= 2 {
        return j - 1;
    }
    // \s+
    j.max(i + 1)
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the others to
/// U+0100 onwards, in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in (0..=255u8).zip(out.iter_mut()) {
        *slot = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('?');
            next += 1;
            c
        };
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::strategy::Strategy;

    fn pieces(text: &str, digits: usize) -> Vec<&str> {
        let b = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            let e = piece_end(b, i, digits);
            out.push(&text[i..e]);
            i = e;
        }
        out
    }

    #[test]
    fn pieces_follow_the_pattern() {
        assert_eq!(
            pieces("Hello world's  end 12345 ok?!\n\n  x \t.y", 1),
            vec![
                "Hello", " world", "'s", " ", " end", " ", "1", "2", "3", "4", "5", " ok",
                "?!\n\n", " ", " x", " ", "\t", ".y"
            ]
        );
        assert_eq!(pieces("a 12345", 3), vec!["a", " ", "123", "45"]);
        assert_eq!(pieces("x  \n \n  y", 1), vec!["x", "  \n \n", " ", " y"]);
        assert_eq!(pieces("end   ", 1), vec!["end", "   "]);
        assert_eq!(pieces("'RE'Ll'q", 1), vec!["'RE", "'Ll", "'q"]);
    }

    /// The real Qwen3 tokenizer's file, which `scripts/bootstrap.sh` fetches.
    fn qwen3_file() -> std::path::PathBuf {
        let file = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../.cache/tokenizers/qwen3/package/models/tokenizer.json");
        assert!(
            file.is_file(),
            "the Qwen3 tokenizer is missing at {}: run scripts/bootstrap.sh",
            file.display()
        );
        file
    }

    /// The real Qwen3 tokenizer and its fast path, loaded once.
    fn qwen3() -> &'static (tokenizers::Tokenizer, FastPath) {
        static TOK: std::sync::OnceLock<(tokenizers::Tokenizer, FastPath)> =
            std::sync::OnceLock::new();
        TOK.get_or_init(|| {
            let tok = tokenizers::Tokenizer::from_file(qwen3_file()).unwrap();
            let fast = FastPath::detect(&tok).unwrap();
            (tok, fast)
        })
    }

    /// A copy of Qwen3's tokenizer changed by `edit`, and its fast path.
    fn qwen3_edited(
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> (tokenizers::Tokenizer, FastPath) {
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(qwen3_file()).unwrap()).unwrap();
        edit(&mut json);
        let tok: tokenizers::Tokenizer = json.to_string().parse().unwrap();
        let fast = FastPath::detect(&tok).unwrap();
        (tok, fast)
    }

    /// Qwen3's tokenizer with `<think>` stripping the whitespace before it, and its fast path.
    fn qwen3_lstrip_think() -> &'static (tokenizers::Tokenizer, FastPath) {
        static TOK: std::sync::OnceLock<(tokenizers::Tokenizer, FastPath)> =
            std::sync::OnceLock::new();
        TOK.get_or_init(|| {
            qwen3_edited(|json| {
                for t in json["added_tokens"].as_array_mut().unwrap() {
                    if t["content"] == "<think>" {
                        t["lstrip"] = serde_json::Value::Bool(true);
                    }
                }
            })
        })
    }

    /// Qwen3's tokenizer without its NFC normalizer (as Llama 3's has none), and its fast path.
    fn qwen3_unnormalized() -> &'static (tokenizers::Tokenizer, FastPath) {
        static TOK: std::sync::OnceLock<(tokenizers::Tokenizer, FastPath)> =
            std::sync::OnceLock::new();
        TOK.get_or_init(|| {
            qwen3_edited(|json| {
                assert_eq!(json["normalizer"]["type"], "NFC");
                json["normalizer"] = serde_json::Value::Null;
            })
        })
    }

    /// Text built from parts that exercise the split pattern and the added-token split.
    fn text() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            proptest::prop_oneof![
                "[a-zA-Z]{1,8}",
                "[0-9]{1,6}",
                "[ \t\n\r\x0B\x0C]{1,4}",
                "[!-/:-@\\[-`{-~]{1,4}",
                "'(s|t|re|ve|m|ll|d|S|T|RE|Ve|M|LL|D|x)",
                "[\x00-\x1F\x7F]",
                proptest::sample::select(vec![
                    "<|im_start|>",
                    "<|im_end|>",
                    "<think>",
                    "</think>",
                    "<|endoftext|>",
                    "<|fim_prefix|>",
                    "<tool_call>",
                    "</tool_call>",
                    "<|im_",
                    "<think",
                    "</",
                    "<|",
                    "|>",
                    "  ",
                    // Non-ASCII: composed and decomposed accents (NFC composes these), compat
                    // letters NFC maps (Ångström, Ohm), case-folding lookalikes after an
                    // apostrophe (long s, Kelvin), other scripts' letters, marks and digits,
                    // non-ASCII spaces and breaks, invisible characters, emoji.
                    "é",
                    "e\u{301}",
                    "\u{212B}",
                    "\u{2126}",
                    "'\u{17F}",
                    "'\u{212A}",
                    "日本",
                    "\u{1100}\u{1161}",
                    "가",
                    "ー",
                    "\u{915}\u{93F}",
                    "٣٤",
                    "１２",
                    "Ⅻ½",
                    "\u{A0}",
                    "\u{3000}",
                    "\u{2028}",
                    "\u{85}",
                    "\u{200B}",
                    "\u{FEFF}",
                    "\u{1F600}",
                    "，。",
                ])
                .prop_map(str::to_owned),
                "[\u{4E00}-\u{9FFF}]{1,6}",
                "[а-яА-ЯёЁ]{1,6}",
                proptest::arbitrary::any::<char>().prop_map(String::from),
            ],
            0..40,
        )
        .prop_map(|parts| parts.concat())
    }

    /// Whether the fast path took `text`; when it did, its ids are the pipeline's, and when it
    /// declined, it appended nothing.
    fn took_with_pipelines_ids(
        (tok, fast): &(tokenizers::Tokenizer, FastPath),
        text: &str,
    ) -> Result<bool, proptest::test_runner::TestCaseError> {
        let mut got = Vec::new();
        let took = fast.encode(tok.get_model(), text, &mut got).unwrap();
        if took {
            let want = tok.encode_fast(text, false).unwrap().get_ids().to_vec();
            proptest::prop_assert_eq!(got, want, "{:?}", text);
        } else {
            proptest::prop_assert!(got.is_empty());
        }
        Ok(took)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(1000))]
        /// The fast path takes every text, added tokens, non-ASCII and all, and gives the full
        /// pipeline's ids.
        #[test]
        fn fast_ids_equal_the_pipelines(text in text()) {
            let took = took_with_pipelines_ids(qwen3(), &text)?;
            proptest::prop_assert!(took, "{:?}", text);
        }

        /// The same without a normalizer: the fast path must not put the text in NFC.
        #[test]
        fn without_a_normalizer_the_text_is_split_as_sent(text in text()) {
            let took = took_with_pipelines_ids(qwen3_unnormalized(), &text)?;
            proptest::prop_assert!(took, "{:?}", text);
        }

        /// With an added token that strips whitespace, the fast path declines the text holding
        /// it, and non-ASCII text (normalization could make one), and still gives the
        /// pipeline's ids on the rest.
        #[test]
        fn a_stripping_added_token_takes_the_pipeline(text in text()) {
            let took = took_with_pipelines_ids(qwen3_lstrip_think(), &text)?;
            proptest::prop_assert_eq!(
                took,
                text.is_ascii() && !text.contains("<think>"),
                "{:?}",
                text
            );
        }
    }

    #[test]
    fn added_tokens_split_the_text_with_their_ids() {
        let (tok, fast) = qwen3();
        let text = "<|im_start|>user\nHi<|fim_prefix|><|im_end|>\n<|im_";
        let mut got = Vec::new();
        assert!(fast.encode(tok.get_model(), text, &mut got).unwrap());
        let want = tok.encode_fast(text, false).unwrap().get_ids().to_vec();
        assert_eq!(got, want);
        assert_eq!(got.first(), Some(&151_644), "<|im_start|>");
        assert!(got.contains(&151_659), "<|fim_prefix|>");
        assert!(got.contains(&151_645), "<|im_end|>");
        let (tok, fast) = qwen3_lstrip_think();
        let mut got = Vec::new();
        assert!(
            !fast
                .encode(tok.get_model(), "a <think>b", &mut got)
                .unwrap()
        );
        assert!(got.is_empty());
    }

    #[test]
    fn byte_chars_are_gpt2s() {
        let m = byte_chars();
        assert_eq!(m[usize::from(b'a')], 'a');
        assert_eq!(m[usize::from(b' ')], 'Ġ');
        assert_eq!(m[usize::from(b'\n')], 'Ċ');
        assert_eq!(m[usize::from(b'\t')], 'ĉ');
        assert_eq!(m[0], 'Ā');
    }
}
