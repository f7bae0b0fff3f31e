//! Tokenization cache for multi-turn chat: only the new turn is tokenized.
//!
//! A rendered chat prompt is cut right before every *split-safe* special token: an added,
//! special, un-normalized token that does not absorb the whitespace before it (`lstrip`) and is
//! not `single_word`. A Hugging Face tokenizer splits its input on added tokens before any
//! normalization or pre-tokenization, so the ids of the whole text are exactly the
//! concatenation of the ids of those segments. Conversations resend their history, so every
//! segment but the newest turn's is found in the cache.
//!
//! The cache is keyed by the segment's xxh3 hash and text length, bounded by the bytes of ids it
//! holds, and evicts with CLOCK (second chance) under one short mutex.

use std::collections::HashMap;
use std::sync::Mutex;

use xxhash_rust::xxh3::xxh3_64;

/// What one cached encode did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheOutcome {
    /// Bytes of rendered text whose ids came from the cache.
    pub hit_bytes: usize,
    /// Bytes of rendered text that were tokenized.
    pub miss_bytes: usize,
}

#[derive(Debug)]
struct Entry {
    ids: Vec<u32>,
    referenced: bool,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<(u64, usize), Entry>,
    ring: Vec<(u64, usize)>,
    hand: usize,
    bytes: usize,
}

/// A bounded cache of segment → token ids. Share one per tokenizer.
#[derive(Debug)]
pub struct SegmentCache {
    inner: Mutex<Inner>,
    max_bytes: usize,
}

impl SegmentCache {
    /// A cache holding at most `max_bytes` of token ids (4 bytes each).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            max_bytes,
        }
    }

    /// Bytes of ids held.
    pub fn bytes(&self) -> usize {
        self.inner.lock().map_or(0, |i| i.bytes)
    }

    pub(crate) fn get(&self, key: (u64, usize), out: &mut Vec<u32>) -> bool {
        let Ok(mut inner) = self.inner.lock() else {
            return false;
        };
        match inner.map.get_mut(&key) {
            Some(e) => {
                e.referenced = true;
                out.extend_from_slice(&e.ids);
                true
            }
            None => false,
        }
    }

    pub(crate) fn put(&self, key: (u64, usize), ids: &[u32]) {
        let size = ids.len() * 4 + 64;
        if size > self.max_bytes {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if inner.map.contains_key(&key) {
            return;
        }
        while inner.bytes + size > self.max_bytes && !inner.ring.is_empty() {
            let hand = inner.hand % inner.ring.len();
            let Some(&victim) = inner.ring.get(hand) else {
                break;
            };
            let second_chance = inner
                .map
                .get_mut(&victim)
                .is_some_and(|e| std::mem::replace(&mut e.referenced, false));
            if second_chance {
                inner.hand = hand + 1;
                continue;
            }
            if let Some(e) = inner.map.remove(&victim) {
                inner.bytes -= e.ids.len() * 4 + 64;
            }
            inner.ring.swap_remove(hand);
            inner.hand = hand;
        }
        inner.bytes += size;
        inner.ring.push(key);
        inner.map.insert(
            key,
            Entry {
                ids: ids.to_vec(),
                referenced: false,
            },
        );
    }
}

pub(crate) fn key_of(segment: &str) -> (u64, usize) {
    (xxh3_64(segment.as_bytes()), segment.len())
}

/// Byte offsets at which `text` may be cut: before each occurrence of a split-safe token
/// (never 0).
///
/// Linear in the text: only positions whose byte can start a token are tested against the
/// tokens. Special tokens start with a handful of bytes (usually just `<`), so those positions
/// are found with `memchr` (a vectorised scan) when there are at most three such bytes, and
/// with a per-byte table lookup otherwise.
pub(crate) fn cut_points(text: &str, tokens: &[String]) -> Vec<usize> {
    let mut firsts: Vec<u8> = tokens
        .iter()
        .filter_map(|t| t.as_bytes().first().copied())
        .collect();
    firsts.sort_unstable();
    firsts.dedup();
    let bytes = text.as_bytes();
    let is_cut = |&i: &usize| {
        i > 0
            && bytes
                .get(i..)
                .is_some_and(|rest| tokens.iter().any(|t| rest.starts_with(t.as_bytes())))
            && text.is_char_boundary(i)
    };
    match firsts[..] {
        [] => Vec::new(),
        [a] => memchr::memchr_iter(a, bytes).filter(is_cut).collect(),
        [a, b] => memchr::memchr2_iter(a, b, bytes).filter(is_cut).collect(),
        [a, b, c] => memchr::memchr3_iter(a, b, c, bytes)
            .filter(is_cut)
            .collect(),
        _ => {
            let mut starts = [false; 256];
            for &f in &firsts {
                if let Some(slot) = starts.get_mut(usize::from(f)) {
                    *slot = true;
                }
            }
            (0..bytes.len())
                .filter(|&i| {
                    bytes
                        .get(i)
                        .is_some_and(|&b| starts.get(usize::from(b)).copied().unwrap_or(false))
                })
                .filter(is_cut)
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    /// Every position tested against every token.
    fn naive_cut_points(text: &str, tokens: &[String]) -> Vec<usize> {
        (1..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .filter(|&i| tokens.iter().any(|t| text[i..].starts_with(t.as_str())))
            .collect()
    }

    proptest! {
        /// The scan finds exactly the naive cuts, with one to five distinct first bytes.
        #[test]
        fn cut_points_equal_the_naive_scan(
            text in "[<|>a{}éx ]{0,60}",
            tokens in prop::collection::vec("[<{é|x][a|>}]{0,3}", 0..6),
        ) {
            let tokens: Vec<String> = tokens.into_iter().filter(|t| !t.is_empty()).collect();
            prop_assert_eq!(cut_points(&text, &tokens), naive_cut_points(&text, &tokens));
        }
    }

    #[test]
    fn cuts_before_each_token_but_not_at_the_start() {
        let t = vec!["<|s|>".to_owned()];
        assert_eq!(cut_points("<|s|>a<|s|>bb<|s|>", &t), vec![6, 13]);
        assert!(cut_points("plain", &t).is_empty());
        let two = vec!["<|s|>".to_owned(), "[X]".to_owned()];
        assert_eq!(cut_points("a[X]<|s|>[X", &two), vec![1, 4]);
        assert_eq!(cut_points("é<|s|>", &two), vec![2]);
    }

    #[test]
    fn clock_evicts_within_the_byte_bound() {
        let c = SegmentCache::new(3 * (64 + 40));
        for k in 0..10u64 {
            c.put((k, 1), &[1; 10]);
            assert!(c.bytes() <= 3 * (64 + 40));
        }
        let mut out = Vec::new();
        assert!(c.get((9, 1), &mut out));
        assert_eq!(out, vec![1; 10]);
        assert!(!c.get((0, 1), &mut out));
    }
}
