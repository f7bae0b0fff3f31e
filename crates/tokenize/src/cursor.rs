//! Incremental encoding: a prompt's ids chunk by chunk, so a caller can stop early.
//!
//! An [`EncodeCursor`] walks the text from the start. Every chunk ends at a cut where
//! tokenization is additive, so the chunks' ids concatenate to exactly the ids of the whole
//! text:
//! - a Hugging Face tokenizer cuts before each split-safe special token (see `cache.rs`) and,
//!   inside a segment, at the first additive inner cut (see `cuts.rs`) at least a chunk size
//!   after the chunk's start, the size being `chunk_bytes / 8` for a segment's first chunk and
//!   doubling up to `chunk_bytes`; tokenizers without known inner cuts keep segments whole;
//! - the byte fallback cuts at the first boundary of its own chunking at least `chunk_bytes`
//!   after the chunk's start.
//!
//! Where chunks fall depends only on the segment's text, so a later turn of a conversation cuts
//! its history where the earlier turn did, and with a [`SegmentCache`] finds every chunk the
//! earlier turn tokenized. [`EncodeCursor::next_cached_into`] hands out a chunk only when the
//! cache has it, so a caller can check, before a chunk is tokenized, whether it still wants it.
//!
//! Whole segments: a segment that is cut into several chunks and is not the text's last (a chat
//! message, not a completions prompt still growing) is also cached whole once all its chunks
//! have been handed out, and at its start the cursor first looks the whole segment up. A
//! resent history then costs one lookup per message instead of one per chunk. The whole
//! segment's ids are its chunks' ids (tokenization is additive at the cuts), so the ids handed
//! out are the same either way; only the chunking differs.

use std::borrow::Cow;

use crate::byte;
use crate::cache::{self, CacheOutcome, SegmentCache};
use crate::error::Result;
use crate::hf::HfTokenizer;

/// A chunk size that keeps per-call overhead small while bounding the text tokenized past the
/// point where a caller stops: 1 KiB is about 250 tokens of English.
pub const DEFAULT_CHUNK_BYTES: usize = 1024;

/// Segments longer than this are never looked up or cached whole: hashing one that misses
/// would cost more than its chunks' lookups save.
const MAX_WHOLE_SEGMENT: usize = 1 << 20;

/// How chunks are tokenized.
#[derive(Debug)]
pub(crate) enum Engine<'a> {
    /// Hugging Face, chunked at additive cuts.
    Chunked(&'a HfTokenizer),
    /// Hugging Face whose post-processor adds tokens: one chunk, the whole text, with special
    /// tokens added.
    Whole(&'a HfTokenizer),
    /// The byte fallback (no cache: it is cheaper than a lookup).
    Byte,
}

/// Ids of a prompt, chunk by chunk, each chunk ending at a cut where tokenization is additive
/// (see [`crate::TextTokenizer::prompt_cursor`]).
#[derive(Debug)]
pub struct EncodeCursor<'a> {
    text: Cow<'a, str>,
    engine: Engine<'a>,
    cache: Option<&'a SegmentCache>,
    /// Ends of the special-token segments, ascending, the last being the text's length.
    segment_ends: Vec<usize>,
    segment: usize,
    /// The current segment's next chunk size: `chunk_bytes / 8` at its start, doubling up to
    /// `chunk_bytes`.
    next_chunk: usize,
    pos: usize,
    chunk_bytes: usize,
    tokens: usize,
    outcome: CacheOutcome,
    /// The next chunk of a chunked engine, once planned (by [`EncodeCursor::next_cached_into`]
    /// finding it missing from the cache), so that encoding it does not plan it again.
    planned: Option<Planned>,
    /// The current segment as a whole (see the module docs).
    whole: Whole,
    /// The current segment's ids so far, while [`Whole::Collecting`].
    segment_ids: Vec<u32>,
}

/// Where the cursor stands with the current segment as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Whole {
    /// Not looked up yet: the cursor is at the segment's start.
    Unchecked,
    /// Missing from the cache: its chunks' ids are collected and cached whole under this key
    /// once the segment ends.
    Collecting((u64, usize)),
    /// Not cached whole (one chunk, the text's last segment, too long, or no cache).
    Off,
}

/// A chunk of a chunked engine: where it ends, whether that ends its segment, and its cache
/// key.
#[derive(Debug, Clone, Copy)]
struct Planned {
    end: usize,
    ends_segment: bool,
    key: (u64, usize),
}

impl<'a> EncodeCursor<'a> {
    pub(crate) fn new(
        text: Cow<'a, str>,
        engine: Engine<'a>,
        cache: Option<&'a SegmentCache>,
        chunk_bytes: usize,
    ) -> Self {
        let segment_ends = match &engine {
            Engine::Chunked(hf) => {
                let mut ends = cache::cut_points(&text, hf.split_tokens());
                ends.push(text.len());
                ends
            }
            Engine::Whole(_) | Engine::Byte => vec![text.len()],
        };
        Self {
            text,
            engine,
            cache,
            segment_ends,
            segment: 0,
            next_chunk: first_chunk(chunk_bytes),
            pos: 0,
            chunk_bytes: chunk_bytes.max(1),
            tokens: 0,
            outcome: CacheOutcome::default(),
            planned: None,
            whole: Whole::Unchecked,
            segment_ids: Vec::new(),
        }
    }

    /// Appends the next chunk's ids to `out` and returns how many, but only when the cache
    /// holds them: `None`, with the cursor unmoved, when the next chunk would be tokenized,
    /// when the engine does not cache (see [`crate::TextTokenizer::prompt_cursor`]), or once
    /// the text is done. Lets a caller decide, before paying for tokenization, whether to go
    /// on.
    pub fn next_cached_into(&mut self, out: &mut Vec<u32>) -> Option<usize> {
        if self.is_done() {
            return None;
        }
        let (Engine::Chunked(hf), Some(cache)) = (&self.engine, self.cache) else {
            return None;
        };
        let hf: &HfTokenizer = hf;
        let before = out.len();
        let plan = match self.planned {
            Some(p) => p,
            None => {
                let p = self.plan(hf);
                self.planned = Some(p);
                if self.whole_hit(cache, p, out) {
                    let n = out.len() - before;
                    self.tokens += n;
                    return Some(n);
                }
                p
            }
        };
        if !cache.get(plan.key, out) {
            return None;
        }
        let n = out.len() - before;
        self.outcome.hit_bytes += plan.end - self.pos;
        self.collect(out.get(before..).unwrap_or_default());
        self.commit(plan, Some(cache));
        self.tokens += n;
        Some(n)
    }

    /// At a segment's start, with `first` its first chunk: looks the whole segment up when it
    /// qualifies (see [`Whole`]). On a hit appends its ids and moves past it; on a miss starts
    /// collecting its chunks' ids.
    fn whole_hit(&mut self, cache: &SegmentCache, first: Planned, out: &mut Vec<u32>) -> bool {
        if self.whole != Whole::Unchecked {
            return false;
        }
        let seg_end = self.segment_end();
        let is_last = self.segment + 1 >= self.segment_ends.len();
        if first.ends_segment || is_last || seg_end - self.pos > MAX_WHOLE_SEGMENT {
            self.whole = Whole::Off;
            return false;
        }
        let key = cache::key_of(self.text.get(self.pos..seg_end).unwrap_or_default());
        if cache.get(key, out) {
            self.outcome.hit_bytes += seg_end - self.pos;
            let whole = Planned {
                end: seg_end,
                ends_segment: true,
                key,
            };
            self.whole = Whole::Off;
            self.commit(whole, None);
            return true;
        }
        self.whole = Whole::Collecting(key);
        self.segment_ids.clear();
        false
    }

    /// Keeps a chunk's ids while the segment is collected whole.
    fn collect(&mut self, ids: &[u32]) {
        if matches!(self.whole, Whole::Collecting(_)) {
            self.segment_ids.extend_from_slice(ids);
        }
    }

    /// The end of the current segment.
    fn segment_end(&self) -> usize {
        let len = self.text.len();
        self.segment_ends
            .get(self.segment)
            .copied()
            .unwrap_or(len)
            .clamp(self.pos, len)
    }

    /// The next chunk of a chunked engine (see the module docs for where it ends).
    fn plan(&self, hf: &HfTokenizer) -> Planned {
        let start = self.pos;
        let seg_end = self.segment_end();
        let end = hf
            .inner_cuts()
            .next(&self.text, start.saturating_add(self.next_chunk), seg_end)
            .unwrap_or(seg_end);
        let chunk = self.text.get(start..end).unwrap_or_default();
        Planned {
            end,
            ends_segment: end == seg_end,
            key: cache::key_of(chunk),
        }
    }

    /// Moves past a planned chunk; at a segment's end, caches the segment whole when its
    /// chunks' ids were collected.
    fn commit(&mut self, plan: Planned, cache: Option<&SegmentCache>) {
        if plan.ends_segment {
            if let (Whole::Collecting(key), Some(cache)) = (self.whole, cache) {
                cache.put(key, &self.segment_ids);
            }
            self.whole = Whole::Unchecked;
            self.segment_ids.clear();
            self.segment += 1;
            self.next_chunk = first_chunk(self.chunk_bytes);
        } else {
            self.next_chunk = self.next_chunk.saturating_mul(2).min(self.chunk_bytes);
        }
        self.pos = plan.end;
        self.planned = None;
    }

    /// Appends the next chunk's ids to `out` and returns how many; `None` once the whole text
    /// has been encoded. After an error the cursor is done.
    pub fn next_into(&mut self, out: &mut Vec<u32>) -> Option<Result<usize>> {
        if self.is_done() {
            return None;
        }
        let before = out.len();
        let result = self.step(out);
        if result.is_err() {
            self.pos = self.text.len();
            out.truncate(before);
            return Some(result.map(|()| 0));
        }
        let n = out.len() - before;
        self.tokens += n;
        Some(Ok(n))
    }

    fn step(&mut self, out: &mut Vec<u32>) -> Result<()> {
        let start = self.pos;
        let len = self.text.len();
        match self.engine {
            Engine::Byte => {
                let end = byte::boundary_after(
                    self.text.as_bytes(),
                    start,
                    start.saturating_add(self.chunk_bytes),
                );
                let bytes = self.text.as_bytes().get(start..end).unwrap_or_default();
                out.extend(byte::encode_bytes(bytes));
                self.outcome.miss_bytes += end - start;
                self.pos = end;
            }
            Engine::Whole(hf) => {
                out.extend(hf.encode(&self.text, true)?);
                self.outcome.miss_bytes += len;
                self.pos = len;
            }
            Engine::Chunked(hf) => {
                let before = out.len();
                let plan = match self.planned {
                    Some(p) => p,
                    None => {
                        let p = self.plan(hf);
                        if let Some(cache) = self.cache
                            && self.whole_hit(cache, p, out)
                        {
                            return Ok(());
                        }
                        p
                    }
                };
                let chunk = self.text.get(start..plan.end).unwrap_or_default();
                encode_chunk(hf, chunk, plan.key, self.cache, &mut self.outcome, out)?;
                self.collect(out.get(before..).unwrap_or_default());
                self.commit(plan, self.cache);
            }
        }
        Ok(())
    }

    /// Whether every chunk has been handed out.
    pub fn is_done(&self) -> bool {
        self.pos >= self.text.len()
    }

    /// The text being encoded (for a chat, the rendered prompt).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The text, consuming the cursor (to finish encoding it elsewhere).
    pub fn into_text(self) -> String {
        self.text.into_owned()
    }

    /// Bytes of text encoded so far.
    pub fn consumed_bytes(&self) -> usize {
        self.pos
    }

    /// Ids handed out so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Cache use so far (bytes found in the cache, bytes tokenized).
    pub fn outcome(&self) -> CacheOutcome {
        self.outcome
    }

    /// The whole text's token count: exact once done; before that the ids so far plus the
    /// remaining bytes at the ids-per-byte rate seen so far (four bytes a token before any id).
    pub fn estimated_tokens(&self) -> usize {
        let remaining = self.text.len().saturating_sub(self.pos);
        if remaining == 0 {
            return self.tokens;
        }
        let extra = if self.pos == 0 || self.tokens == 0 {
            remaining.div_ceil(4)
        } else {
            let e = (remaining as u128 * self.tokens as u128).div_ceil(self.pos as u128);
            usize::try_from(e).unwrap_or(usize::MAX)
        };
        self.tokens.saturating_add(extra)
    }
}

/// The first chunk of a segment: an eighth of `chunk_bytes` (at least a byte). A new message
/// starts a segment, and a prompt usually stops being cached at a message's start, so a small
/// first chunk bounds what is tokenized past that point; later chunks double up to
/// `chunk_bytes`, keeping per-chunk overhead low on long cached text.
fn first_chunk(chunk_bytes: usize) -> usize {
    (chunk_bytes / 8).max(1)
}

/// Appends `chunk`'s ids from `cache`, or tokenizes it (and caches the ids).
fn encode_chunk(
    hf: &HfTokenizer,
    chunk: &str,
    key: (u64, usize),
    cache: Option<&SegmentCache>,
    outcome: &mut CacheOutcome,
    out: &mut Vec<u32>,
) -> Result<()> {
    if chunk.is_empty() {
        return Ok(());
    }
    if let Some(c) = cache
        && c.get(key, out)
    {
        outcome.hit_bytes += chunk.len();
        return Ok(());
    }
    let ids = hf.encode(chunk, false)?;
    if let Some(c) = cache {
        c.put(key, &ids);
    }
    out.extend_from_slice(&ids);
    outcome.miss_bytes += chunk.len();
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn drain(mut c: EncodeCursor<'_>) -> (Vec<u32>, Vec<usize>) {
        let mut ids = Vec::new();
        let mut ends = Vec::new();
        while let Some(r) = c.next_into(&mut ids) {
            r.unwrap();
            ends.push(c.consumed_bytes());
        }
        assert!(c.is_done());
        assert_eq!(c.estimated_tokens(), ids.len());
        (ids, ends)
    }

    #[test]
    fn byte_chunks_concatenate_to_the_whole_encoding() {
        let text = "abcé😀\0\0xyz and more text";
        for chunk in 1..12 {
            let c = EncodeCursor::new(Cow::Borrowed(text), Engine::Byte, None, chunk);
            let (ids, ends) = drain(c);
            assert_eq!(ids, byte::encode_bytes(text.as_bytes()), "chunk {chunk}");
            assert_eq!(ends.last(), Some(&text.len()));
        }
    }

    #[test]
    fn the_estimate_extrapolates_the_rate_so_far() {
        let text = "a".repeat(400);
        let mut c = EncodeCursor::new(Cow::Borrowed(text.as_str()), Engine::Byte, None, 100);
        assert_eq!(c.estimated_tokens(), 100);
        let mut ids = Vec::new();
        assert_eq!(c.next_into(&mut ids).unwrap().unwrap(), 25);
        assert_eq!(c.consumed_bytes(), 100);
        assert_eq!(c.estimated_tokens(), 100);
        assert!(!c.is_done());
    }
}
