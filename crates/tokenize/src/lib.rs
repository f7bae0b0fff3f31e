//! Text to token ids for kvgate, exactly as vLLM's OpenAI server computes them. Pure: no I/O
//! after loading, no async runtime, no network.
//!
//! The engine simulator and the endpoint picker both tokenize through this crate, so for the
//! same request they produce the same ids, and with a real tokenizer directory those are the
//! ids a real vLLM computes (checked against ids captured from vLLM 0.32):
//!
//! - **Completions** ([`TextTokenizer::encode_prompt`]): the prompt tokenized with
//!   `add_special_tokens=true`.
//! - **Chat** ([`TextTokenizer::encode_chat`]): messages normalized as vLLM normalizes them
//!   (text parts joined with `"\n"`, `reasoning_content` → `reasoning`, tool-call arguments
//!   parsed, unknown fields dropped, content as a string or a list of parts per
//!   [`ContentFormat`]), the chat template
//!   rendered as Hugging Face `apply_chat_template` renders it (jinja2 semantics with
//!   `trim_blocks`/`lstrip_blocks`, `raise_exception`, `strftime_now`, Python `tojson` and string
//!   methods), then tokenized with `add_special_tokens=false`.
//!
//! - **Incrementally** ([`TextTokenizer::prompt_cursor`], [`TextTokenizer::chat_cursor`]): the
//!   same ids chunk by chunk ([`EncodeCursor`]), cut only where tokenization is provably
//!   additive, so a caller can stop once the rest of the prompt cannot matter to it.
//!
//! Without a tokenizer directory, [`TextTokenizer::fallback`] is a deterministic, reversible
//! byte tokenizer ([`ByteTokenizer`]): each token is up to four UTF-8 bytes packed
//! little-endian into the id. Its exact formula is in the [`byte`] module docs and the README.
//!
//! What it is not: a token-id cache (callers that see repeated prefixes cache by message
//! prefix), a multimodal processor (image, audio and video parts are refused with
//! [`TokenizeError::UnsupportedContent`]), or a model downloader (it reads a local directory).
//!
//! Inputs are bounded ([`Limits`]): prompts and rendered chats larger than
//! [`Limits::max_input_bytes`] are refused, and template rendering runs on a fuel budget so a
//! template cannot loop forever.

pub mod byte;
mod cache;
mod config;
mod cursor;
mod cuts;
mod error;
mod fast;
mod hf;
mod messages;
mod pyfmt;
mod strftime;
mod template;

use std::borrow::Cow;
use std::path::Path;

use serde_json::{Map, Value};

pub use byte::{BYTE_EOS_ID, BYTE_VOCAB_SIZE, ByteTokenizer};
pub use cache::{CacheOutcome, SegmentCache};
pub use config::{CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE};
pub use cursor::{DEFAULT_CHUNK_BYTES, EncodeCursor};
pub use error::{BoxError, LoadError, Result, TokenizeError};
pub use hf::{HfTokenizer, TOKENIZER_FILE};
pub use messages::ContentFormat;

/// Bounds on the work one request may cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes of text handed to the tokenizer model: a completions prompt, or a rendered
    /// chat. A chat request (messages, tools and template arguments, measured as JSON) larger
    /// than this is refused before rendering.
    pub max_input_bytes: usize,
    /// The most template instructions one chat render may execute (minijinja fuel).
    pub render_fuel: u64,
}

impl Default for Limits {
    /// 8 MiB of text (about two million tokens) and 50 million template instructions (well under
    /// a second; rendering a message costs tens of instructions).
    fn default() -> Self {
        Self {
            max_input_bytes: 8 * 1024 * 1024,
            render_fuel: 50_000_000,
        }
    }
}

/// How to render a chat: the chat-completions request fields that reach the template.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatOptions {
    /// Append the assistant header (`add_generation_prompt`, default true).
    pub add_generation_prompt: bool,
    /// Leave the final message open so the model continues it (`continue_final_message`).
    /// Requires `add_generation_prompt = false`.
    pub continue_final_message: bool,
    /// `chat_template_kwargs` (such as `enable_thinking`), visible to the template as variables.
    pub template_kwargs: Map<String, Value>,
    /// The request's `tools`, a list of `{"type": "function", "function": {…}}` (or `None`).
    pub tools: Option<Value>,
    /// The request's `documents`, for RAG templates (or `None`).
    pub documents: Option<Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            continue_final_message: false,
            template_kwargs: Map::new(),
            tools: None,
            documents: None,
        }
    }
}

/// The tokenizer behind a [`TextTokenizer`].
#[derive(Debug)]
enum Kind {
    Hf(Box<HfTokenizer>),
    Fallback(ByteTokenizer),
}

/// A tokenizer for OpenAI requests: exact (a Hugging Face directory) or the byte fallback.
///
/// Cheap to share: wrap it in an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct TextTokenizer {
    kind: Kind,
    limits: Limits,
}

impl TextTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (chat template as a string or as a list
    /// of named templates, `bos_token`/`eos_token` as strings or `{"content": …}` objects) from
    /// `dir`, with default [`Limits`]. `chat_template.jinja` and
    /// `additional_chat_templates/*.jinja`, where present, take priority over the config's
    /// templates, as in `transformers`.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        Self::from_dir_with_limits(dir, Limits::default())
    }

    /// [`from_dir`](Self::from_dir) with the given limits.
    pub fn from_dir_with_limits(dir: &Path, limits: Limits) -> Result<Self, LoadError> {
        let hf = HfTokenizer::from_dir(dir, &limits)?;
        Ok(Self {
            kind: Kind::Hf(Box::new(hf)),
            limits,
        })
    }

    /// The byte fallback, with default [`Limits`].
    pub fn fallback() -> Self {
        Self {
            kind: Kind::Fallback(ByteTokenizer::new()),
            limits: Limits::default(),
        }
    }

    /// The same tokenizer with other limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        if let Kind::Hf(hf) = &mut self.kind {
            hf.set_fuel(limits.render_fuel);
        }
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// True for a real tokenizer, false for the byte fallback (whose ids only approximate).
    pub fn is_exact(&self) -> bool {
        matches!(self.kind, Kind::Hf(_))
    }

    /// The Hugging Face tokenizer, when this is one.
    pub fn as_hf(&self) -> Option<&HfTokenizer> {
        match &self.kind {
            Kind::Hf(hf) => Some(hf),
            Kind::Fallback(_) => None,
        }
    }

    fn check_len(&self, what: &'static str, len: usize) -> Result<()> {
        let max = self.limits.max_input_bytes;
        if len > max {
            return Err(TokenizeError::InputTooLarge { what, len, max });
        }
        Ok(())
    }

    /// A completions prompt's ids: vLLM tokenizes it with `add_special_tokens=true`.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.check_len("prompt", text.len())?;
        match &self.kind {
            Kind::Hf(hf) => hf.encode(text, true),
            Kind::Fallback(b) => Ok(b.encode(text)),
        }
    }

    /// The chat prompt text: messages normalized as vLLM does, then the chat template rendered
    /// as `apply_chat_template` does (the fallback renders a fixed ChatML form, see the README).
    pub fn render_chat(&self, messages: &[Value], opts: &ChatOptions) -> Result<String> {
        if opts.add_generation_prompt && opts.continue_final_message {
            return Err(TokenizeError::ConflictingOptions);
        }
        let max = self.limits.max_input_bytes;
        let parts = messages
            .iter()
            .chain(opts.tools.iter())
            .chain(opts.documents.iter())
            .chain(opts.template_kwargs.values());
        let mut total = 0usize;
        for v in parts {
            total = total.saturating_add(messages::json_size(v, max.saturating_sub(total)));
            if total > max {
                return Err(TokenizeError::InputTooLarge {
                    what: "chat request",
                    len: total,
                    max,
                });
            }
        }
        let rendered = match &self.kind {
            Kind::Hf(hf) => hf.render_chat(messages, opts)?,
            Kind::Fallback(_) => byte::render_chatml(messages, opts)?,
        };
        self.check_len("rendered chat", rendered.len())?;
        Ok(rendered)
    }

    /// A chat request's ids: [`render_chat`](Self::render_chat), then tokenized with
    /// `add_special_tokens=false`, exactly as vLLM's OpenAI server does.
    pub fn encode_chat(&self, messages: &[Value], opts: &ChatOptions) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, opts)?;
        match &self.kind {
            Kind::Hf(hf) => hf.encode(&text, false),
            Kind::Fallback(b) => Ok(b.encode(&text)),
        }
    }

    /// [`encode_chat`](Self::encode_chat) with a segment cache: the rendered prompt is cut
    /// before each split-safe special token and only segments missing from `cache` are
    /// tokenized (see [`SegmentCache`]). Gives exactly the ids of `encode_chat`. The byte
    /// fallback is cheap and position-dependent, so it bypasses the cache.
    pub fn encode_chat_cached(
        &self,
        messages: &[Value],
        opts: &ChatOptions,
        cache: &SegmentCache,
    ) -> Result<(Vec<u32>, CacheOutcome)> {
        let mut cursor = self.chat_cursor(messages, opts, Some(cache), usize::MAX)?;
        let mut ids = Vec::with_capacity(cursor.text().len() / 3);
        while let Some(n) = cursor.next_into(&mut ids) {
            n?;
        }
        Ok((ids, cursor.outcome()))
    }

    /// A completions prompt's ids chunk by chunk ([`EncodeCursor`]): the chunks concatenate to
    /// exactly [`encode_prompt`](Self::encode_prompt)'s ids. Chunks end at cuts where
    /// tokenization is additive; within a segment the first chunk is at least `chunk_bytes / 8`
    /// long and each next one at least twice as long, up to `chunk_bytes`. Chunks missing from
    /// `cache` (when given) are tokenized and added to it. A tokenizer whose
    /// post-processor adds ids encodes the prompt in one chunk, uncached.
    pub fn prompt_cursor<'a>(
        &'a self,
        text: &'a str,
        cache: Option<&'a SegmentCache>,
        chunk_bytes: usize,
    ) -> Result<EncodeCursor<'a>> {
        self.check_len("prompt", text.len())?;
        let (engine, cache) = match &self.kind {
            Kind::Hf(hf) if hf.prompt_additive() => (cursor::Engine::Chunked(hf), cache),
            Kind::Hf(hf) => (cursor::Engine::Whole(hf), None),
            Kind::Fallback(_) => (cursor::Engine::Byte, None),
        };
        Ok(EncodeCursor::new(
            Cow::Borrowed(text),
            engine,
            cache,
            chunk_bytes,
        ))
    }

    /// An already rendered chat prompt ([`render_chat`](Self::render_chat)'s text) chunk by
    /// chunk, exactly as [`chat_cursor`](Self::chat_cursor) walks it: for finishing, off the
    /// request path, a prompt whose encoding stopped early, so `cache` holds every chunk.
    pub fn rendered_chat_cursor<'a>(
        &'a self,
        text: &'a str,
        cache: Option<&'a SegmentCache>,
        chunk_bytes: usize,
    ) -> Result<EncodeCursor<'a>> {
        self.check_len("rendered chat", text.len())?;
        Ok(self.rendered_cursor(Cow::Borrowed(text), cache, chunk_bytes))
    }

    /// A chat request's ids chunk by chunk: [`render_chat`](Self::render_chat), then an
    /// [`EncodeCursor`] over the rendered prompt whose chunks concatenate to exactly
    /// [`encode_chat`](Self::encode_chat)'s ids (see [`prompt_cursor`](Self::prompt_cursor)
    /// for the chunks and the cache).
    pub fn chat_cursor<'a>(
        &'a self,
        messages: &[Value],
        opts: &ChatOptions,
        cache: Option<&'a SegmentCache>,
        chunk_bytes: usize,
    ) -> Result<EncodeCursor<'a>> {
        let text = self.render_chat(messages, opts)?;
        Ok(self.rendered_cursor(Cow::Owned(text), cache, chunk_bytes))
    }

    /// The cursor over a rendered chat prompt: chunked at additive cuts through `cache` for a
    /// Hugging Face tokenizer, the byte fallback's own chunks otherwise.
    fn rendered_cursor<'a>(
        &'a self,
        text: Cow<'a, str>,
        cache: Option<&'a SegmentCache>,
        chunk_bytes: usize,
    ) -> EncodeCursor<'a> {
        let (engine, cache) = match &self.kind {
            Kind::Hf(hf) => (cursor::Engine::Chunked(hf), cache),
            Kind::Fallback(_) => (cursor::Engine::Byte, None),
        };
        EncodeCursor::new(text, engine, cache, chunk_bytes)
    }

    /// Text of `ids`, special tokens skipped (`skip_special_tokens=true`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.kind {
            Kind::Hf(hf) => hf.decode(ids),
            Kind::Fallback(b) => b
                .decode(ids)
                .map_err(|id| TokenizeError::UnknownTokenId { id }),
        }
    }

    /// An id the simulator can emit as end-of-sequence: the tokenizer's `eos_token`, or
    /// [`BYTE_EOS_ID`] for the fallback. `None` when the tokenizer has no EOS token.
    pub fn eos_token_id(&self) -> Option<u32> {
        match &self.kind {
            Kind::Hf(hf) => hf.eos_token_id(),
            Kind::Fallback(_) => Some(BYTE_EOS_ID),
        }
    }

    /// A small set of ids whose text is a space and a common lowercase word, each a single
    /// token that encodes back to itself, so any sequence of them re-tokenizes to the same ids:
    /// plausible simulated output that survives a multi-turn round trip.
    pub fn word_token_ids(&self) -> &[u32] {
        match &self.kind {
            Kind::Hf(hf) => hf.word_token_ids(),
            Kind::Fallback(b) => b.word_token_ids(),
        }
    }

    /// The number of distinct ids (for the fallback, 2^31).
    pub fn vocab_size(&self) -> u32 {
        match &self.kind {
            Kind::Hf(hf) => hf.vocab_size(),
            Kind::Fallback(_) => BYTE_VOCAB_SIZE,
        }
    }
}
