//! Request → token ids → kvgate block keys, per served model.
//!
//! Each served model has a tokenizer (its `tokenizer.json` and chat template) and a segment cache
//! so a multi-turn conversation only tokenizes its new turn. Without a tokenizer the byte
//! fallback of `crates/tokenize` gives approximate keys (they match `kvgate-sim`'s fallback
//! exactly, and a real engine's never); [`Keyed::exact`] says which, for the metrics.
//!
//! # Stopping at the first miss
//!
//! Text prompts and chats are tokenized chunk by chunk ([`tokenize::EncodeCursor`]), and each
//! chunk's new block keys are derived at once ([`KeyChain`]). Chunks the segment cache holds are
//! keyed without further ado; before a chunk would be tokenized, the caller's probe is asked
//! whether any endpoint holds the newest key. When none does, no endpoint's prefix match can
//! reach past it, so the rest of the prompt cannot change any endpoint's overlap, and keying
//! stops ([`StopRule`]). The prompt's token and block counts are then
//! estimates (tokens so far plus the remaining bytes at the rate so far), flagged by
//! [`Keyed::stopped_early`].

use std::collections::HashMap;
use std::sync::Arc;

use kv_events::BlockKey;
pub use kv_events::key::KeyChain;
use kv_events::key::SaltStyle;
use tokenize::{CacheOutcome, EncodeCursor, SegmentCache, TextTokenizer, TokenizeError};

use super::finish::{FinishConfig, FinishStats, Finisher};
use super::request::{Input, ParsedRequest, Prompt};

/// A served model's tokenizer and its cache.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: TextTokenizer,
    cache: SegmentCache,
}

impl ModelTokenizer {
    /// Wraps a tokenizer with a cache of `cache_bytes`.
    pub fn new(tokenizer: TextTokenizer, cache_bytes: usize) -> Self {
        Self {
            tokenizer,
            cache: SegmentCache::new(cache_bytes),
        }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// Its segment cache.
    pub fn cache(&self) -> &SegmentCache {
        &self.cache
    }
}

/// How a pool's requests are keyed.
#[derive(Debug)]
pub struct Keyer {
    block_size: usize,
    salt_style: SaltStyle,
    default_model: String,
    chunk_bytes: usize,
    models: HashMap<String, Arc<ModelTokenizer>>,
    fallback: Arc<ModelTokenizer>,
    limits: tokenize::Limits,
    finish: FinishConfig,
    finisher: Option<Finisher>,
}

/// A keyed request.
#[derive(Debug, Clone)]
pub struct Keyed {
    /// The model the request names (or the default).
    pub model: String,
    /// Prompt tokens (an estimate when [`Keyed::stopped_early`]).
    pub prompt_tokens: u32,
    /// The prompt's full blocks: `keys.len()`, or an estimate when [`Keyed::stopped_early`].
    pub prompt_blocks: u32,
    /// Keys of the prompt's full blocks, from the first; only a prefix when
    /// [`Keyed::stopped_early`].
    pub keys: Vec<BlockKey>,
    /// Token ids actually computed (`prompt_tokens` unless [`Keyed::stopped_early`]).
    pub tokenized: u32,
    /// Whether keying stopped before the end of the prompt because no endpoint held the newest
    /// key (see the module docs).
    pub stopped_early: bool,
    /// Whether the ids came from the model's real tokenizer.
    pub exact: bool,
    /// Tokenization cache use (text prompts and chats).
    pub cache: CacheOutcome,
}

/// The early-stop rule: whether to tokenize the next chunk of a prompt whose keys so far are
/// `keys`. Chunks found in the segment cache cost a lookup, so they are keyed without asking;
/// before a chunk would be tokenized, `held` is asked whether some endpoint holds the newest key.
/// When none holds key `j`, every endpoint's matched prefix ends at or before `j`, so keys past
/// it change no endpoint's overlap and the chunk is not worth tokenizing. With no keys yet, or
/// the same newest key as the last question, no new question is asked.
#[derive(Debug, Default)]
pub struct StopRule {
    last: Option<(BlockKey, bool)>,
}

impl StopRule {
    /// Whether the next chunk is worth tokenizing (see the type's docs).
    pub fn may_tokenize(
        &mut self,
        keys: &[BlockKey],
        held: &mut dyn FnMut(BlockKey) -> bool,
    ) -> bool {
        let Some(&newest) = keys.last() else {
            return true;
        };
        match self.last {
            Some((k, answer)) if k == newest => answer,
            _ => {
                let answer = held(newest);
                self.last = Some((newest, answer));
                answer
            }
        }
    }
}

impl Keyer {
    /// A keyer for a pool whose engines use `block_size` and fold salts in `salt_style`.
    pub fn new(block_size: usize, salt_style: SaltStyle, default_model: impl Into<String>) -> Self {
        Self {
            block_size,
            salt_style,
            default_model: default_model.into(),
            chunk_bytes: tokenize::DEFAULT_CHUNK_BYTES,
            models: HashMap::new(),
            fallback: Arc::new(ModelTokenizer::new(TextTokenizer::fallback(), 0)),
            limits: tokenize::Limits::default(),
            finish: FinishConfig::default(),
            finisher: None,
        }
    }

    /// How the background finisher is held back (see `finish.rs`); set before [`Self::with_model`].
    #[must_use]
    pub fn with_finish(mut self, config: FinishConfig) -> Self {
        self.finish = config;
        self
    }

    /// Keys prompts and rendered chats of up to `bytes` (more is refused as too large): the
    /// request body limit, so that every body the EPP takes can be keyed. Applies to the
    /// fallback and to the tokenizers of models added after; set before [`Self::with_model`].
    #[must_use]
    pub fn with_max_input_bytes(mut self, bytes: usize) -> Self {
        self.limits.max_input_bytes = bytes;
        self.fallback = Arc::new(ModelTokenizer::new(
            TextTokenizer::fallback().with_limits(self.limits),
            0,
        ));
        self
    }

    /// Serves `model` with `tokenizer` (under this keyer's input limit). The first real
    /// tokenizer starts the background thread that finishes early-stopped prompts (see
    /// `finish.rs`).
    pub fn with_model(mut self, model: impl Into<String>, mut tokenizer: ModelTokenizer) -> Self {
        tokenizer.tokenizer = tokenizer.tokenizer.with_limits(self.limits);
        if self.finisher.is_none() && tokenizer.tokenizer.is_exact() {
            self.finisher = Finisher::start(self.finish);
        }
        self.models.insert(model.into(), Arc::new(tokenizer));
        self
    }

    /// Waits until every early-stopped prompt queued so far is finished (tests, benchmarks).
    pub fn wait_idle(&self) {
        if let Some(f) = &self.finisher {
            f.wait_idle();
        }
    }

    /// The background finisher's counters, when it runs.
    pub fn finish_stats(&self) -> Option<&FinishStats> {
        self.finisher.as_ref().map(Finisher::stats)
    }

    /// Tokenizes in chunks of at least `bytes` (within a segment; see
    /// [`tokenize::EncodeCursor`]) between early-stop checks.
    #[must_use]
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes.max(1);
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The model requests without a `model` field are for.
    pub fn default_model(&self) -> &str {
        &self.default_model
    }

    /// Whether any model has a real tokenizer.
    pub fn has_tokenizers(&self) -> bool {
        !self.models.is_empty()
    }

    /// Keys a parsed request for the model it names, the whole prompt.
    pub fn key(&self, req: &ParsedRequest<'_>) -> Result<Keyed, TokenizeError> {
        self.key_served(req, None, &mut |_| true)
    }

    /// Keys a parsed request that the engine serves as `served` (a model rewrite): tokenized
    /// with the requested model's tokenizer when it has one (a LoRA adapter shares its base's),
    /// keyed under the served name, as the engine caches it. Text prompts and chats stop once
    /// `held` says no endpoint holds the newest key (see the module docs); `|_| true` keys the
    /// whole prompt.
    pub fn key_served(
        &self,
        req: &ParsedRequest<'_>,
        served: Option<&str>,
        held: &mut dyn FnMut(BlockKey) -> bool,
    ) -> Result<Keyed, TokenizeError> {
        let requested = req.model.as_deref().unwrap_or(&self.default_model);
        let model = served.unwrap_or(requested);
        let tok = self
            .models
            .get(requested)
            .or_else(|| self.models.get(model))
            .unwrap_or(&self.fallback);
        let mut chain = KeyChain::new(
            model,
            req.cache_salt.as_deref(),
            self.salt_style,
            self.block_size,
        );
        let chunk = self.chunk_bytes;
        let cache = Some(&tok.cache);
        let cursor = match &req.input {
            Input::Prompt(Prompt::Text(t)) => Some(tok.tokenizer.prompt_cursor(t, cache, chunk)?),
            Input::Prompt(Prompt::Texts(ts)) => match ts.first() {
                Some(t) => Some(tok.tokenizer.prompt_cursor(t, cache, chunk)?),
                None => None,
            },
            Input::Prompt(Prompt::Tokens(_) | Prompt::TokenLists(_)) => None,
            Input::Chat { messages, options } => {
                Some(tok.tokenizer.chat_cursor(messages, options, cache, chunk)?)
            }
        };
        let chat = matches!(req.input, Input::Chat { .. });
        let (tokens, tokenized, stopped_early, cache) = match cursor {
            Some(cursor) => self.key_cursor(cursor, &mut chain, held, (tok, chat))?,
            None => {
                let ids: &[u32] = match &req.input {
                    Input::Prompt(Prompt::Tokens(ids)) => ids,
                    Input::Prompt(Prompt::TokenLists(lists)) => {
                        lists.first().map(Vec::as_slice).unwrap_or_default()
                    }
                    _ => &[],
                };
                chain.advance(ids);
                (ids.len(), ids.len(), false, CacheOutcome::default())
            }
        };
        let keys = chain.into_keys();
        let prompt_blocks = if stopped_early {
            tokens
                .checked_div(self.block_size)
                .unwrap_or(0)
                .max(keys.len())
        } else {
            keys.len()
        };
        Ok(Keyed {
            model: model.to_owned(),
            prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            prompt_blocks: u32::try_from(prompt_blocks).unwrap_or(u32::MAX),
            tokenized: u32::try_from(tokenized).unwrap_or(u32::MAX),
            keys,
            stopped_early,
            exact: tok.tokenizer.is_exact(),
            cache,
        })
    }

    /// Drives `cursor` until the prompt ends or [`StopRule`] says stop; returns the (estimated)
    /// token count, the ids computed, whether it stopped early, and the cache use.
    fn key_cursor(
        &self,
        mut cursor: EncodeCursor<'_>,
        chain: &mut KeyChain,
        held: &mut dyn FnMut(BlockKey) -> bool,
        (model, chat): (&Arc<ModelTokenizer>, bool),
    ) -> Result<(usize, usize, bool, CacheOutcome), TokenizeError> {
        // Most prompts stop after their first chunks: size for a few, grow if the prompt is held.
        let mut ids = Vec::with_capacity(cursor.text().len().min(4 * self.chunk_bytes) / 3);
        let mut rule = StopRule::default();
        while !cursor.is_done() {
            if cursor.next_cached_into(&mut ids).is_some() {
                chain.advance(&ids);
                continue;
            }
            if !rule.may_tokenize(chain.keys(), held) {
                let estimate = cursor.estimated_tokens();
                let outcome = cursor.outcome();
                if let Some(f) = &self.finisher
                    && model.tokenizer.is_exact()
                {
                    f.submit(Arc::clone(model), cursor, chat, self.chunk_bytes);
                }
                return Ok((estimate, ids.len(), true, outcome));
            }
            match cursor.next_into(&mut ids) {
                Some(n) => {
                    n?;
                    chain.advance(&ids);
                }
                None => break,
            }
        }
        Ok((ids.len(), ids.len(), false, cursor.outcome()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::super::request::{Api, parse};
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The rule answers as "nothing keyed, or the newest key is held" on every call, and
        /// asks the probe only when the newest key changed.
        #[test]
        fn stop_rule_equals_asking_every_time(
            steps in prop::collection::vec(0usize..4, 0..30),
            held_keys in prop::collection::hash_set(0u64..40, 0..40),
        ) {
            let all: Vec<BlockKey> = (0..40).map(BlockKey).collect();
            let mut rule = StopRule::default();
            let mut n = 0;
            let mut asked_for: Option<BlockKey> = None;
            for step in steps {
                n = (n + step).min(all.len());
                let keys = &all[..n];
                let mut asked = 0;
                let got = rule.may_tokenize(keys, &mut |k| {
                    asked += 1;
                    held_keys.contains(&k.0)
                });
                let want = keys.last().is_none_or(|k| held_keys.contains(&k.0));
                prop_assert_eq!(got, want);
                let fresh = keys.last().is_some() && keys.last().copied() != asked_for;
                prop_assert_eq!(asked, usize::from(fresh));
                if fresh {
                    asked_for = keys.last().copied();
                }
            }
        }
    }

    #[test]
    fn fallback_keys_equal_the_sims_byte_tokenizer_keys() {
        let keyer = Keyer::new(4, SaltStyle::VllmExtraKey, "m");
        let body = br#"{"prompt":"abcdefghijklmnopqrstuvwxyz0123456789"}"#;
        let req = parse(Api::Completions, body).unwrap();
        let k = keyer.key(&req).unwrap();
        assert!(!k.exact);
        assert!(!k.stopped_early);
        assert_eq!(k.model, "m");
        let ids = TextTokenizer::fallback()
            .encode_prompt("abcdefghijklmnopqrstuvwxyz0123456789")
            .unwrap();
        assert_eq!(k.prompt_tokens as usize, ids.len());
        assert_eq!(k.prompt_blocks as usize, k.keys.len());
        assert_eq!(
            k.keys,
            kv_events::key::block_keys(kv_events::KeySeed::new("m", None), &ids, 4)
        );
    }

    #[test]
    fn token_prompts_salt_and_model_change_the_keys() {
        let keyer = Keyer::new(2, SaltStyle::VllmExtraKey, "m");
        let a = keyer
            .key(&parse(Api::Completions, br#"{"prompt":[1,2,3,4,5]}"#).unwrap())
            .unwrap();
        assert_eq!(a.keys.len(), 2);
        assert_eq!(a.prompt_tokens, 5);
        let salted = keyer
            .key(
                &parse(
                    Api::Completions,
                    br#"{"prompt":[1,2,3,4,5],"cache_salt":"x"}"#,
                )
                .unwrap(),
            )
            .unwrap();
        assert_ne!(a.keys[0], salted.keys[0]);
        let other = keyer
            .key(&parse(Api::Completions, br#"{"model":"n","prompt":[1,2,3,4,5]}"#).unwrap())
            .unwrap();
        assert_ne!(a.keys[0], other.keys[0]);
    }

    /// Keying stops after the first chunk whose newest key nobody holds: the keys are a prefix
    /// of the full keys, and the counts are estimates near the true ones.
    #[test]
    fn keying_stops_when_no_endpoint_holds_the_newest_key() {
        let keyer = Keyer::new(4, SaltStyle::VllmExtraKey, "m").with_chunk_bytes(64);
        let text = "abcdefgh".repeat(100);
        let body = format!(r#"{{"prompt":"{text}"}}"#);
        let req = parse(Api::Completions, body.as_bytes()).unwrap();
        let full = keyer.key(&req).unwrap();
        assert_eq!(full.keys.len(), 50);
        // Endpoints hold the first 20 keys.
        let held_set: Vec<BlockKey> = full.keys[..20].to_vec();
        let mut probes = 0;
        let k = keyer
            .key_served(&req, None, &mut |key| {
                probes += 1;
                held_set.contains(&key)
            })
            .unwrap();
        assert!(k.stopped_early);
        assert!(k.keys.len() > 20 && k.keys.len() < 50, "{}", k.keys.len());
        assert_eq!(k.keys[..], full.keys[..k.keys.len()]);
        assert_eq!(k.prompt_tokens, full.prompt_tokens);
        assert_eq!(k.prompt_blocks, 50);
        assert_eq!(probes, k.keys.len().div_ceil(4));
        // Nothing held: one chunk.
        let cold = keyer.key_served(&req, None, &mut |_| false).unwrap();
        assert!(cold.stopped_early);
        assert_eq!(cold.keys.len(), 4);
    }

    fn qwen3() -> Option<TextTokenizer> {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../.cache/tokenizers/qwen3/package/models");
        dir.join("tokenizer.json")
            .exists()
            .then(|| TextTokenizer::from_dir(&dir).unwrap())
    }

    /// An early-stopped chat is finished in the background: the next request finds every
    /// chunk in the cache and keys the whole prompt without tokenizing.
    #[test]
    fn stopped_prompts_are_finished_off_the_request_path() {
        let Some(tok) = qwen3() else {
            eprintln!("skipping: no Qwen3 tokenizer");
            return;
        };
        let keyer = Keyer::new(16, SaltStyle::VllmExtraKey, "m")
            .with_model("m", ModelTokenizer::new(tok, 1 << 24))
            .with_chunk_bytes(256);
        let content = "the quick brown fox jumps over the lazy dog ".repeat(60);
        let body = serde_json::to_vec(&serde_json::json!({
            "messages": [{"role": "user", "content": content}]
        }))
        .unwrap();
        let req = parse(Api::Chat, &body).unwrap();
        let stopped = keyer.key_served(&req, None, &mut |_| false).unwrap();
        assert!(stopped.stopped_early);
        keyer.wait_idle();
        let stats = keyer.finish_stats().unwrap();
        assert_eq!(stats.finished.load(std::sync::atomic::Ordering::Relaxed), 1);
        let full = keyer.key(&req).unwrap();
        assert!(!full.stopped_early);
        assert_eq!(full.cache.miss_bytes, 0, "{:?}", full.cache);
        assert_eq!(full.keys[..stopped.keys.len()], stopped.keys[..]);
    }
}
