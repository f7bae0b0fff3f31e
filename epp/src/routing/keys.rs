//! Request → token ids → kvgate block keys, per served model.
//!
//! Each served model has a tokenizer (its `tokenizer.json` and chat template) and a segment cache
//! so a multi-turn conversation only tokenizes its new turn. Without a tokenizer the byte
//! fallback of `crates/tokenize` gives approximate keys (they match `kvgate-sim`'s fallback
//! exactly, and a real engine's never); [`Keyed::exact`] says which, for the metrics.

use std::collections::HashMap;
use std::sync::Arc;

use kv_events::BlockKey;
use kv_events::key::{SaltStyle, request_block_keys};
use tokenize::{CacheOutcome, SegmentCache, TextTokenizer, TokenizeError};

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
}

/// How a pool's requests are keyed.
#[derive(Debug)]
pub struct Keyer {
    block_size: usize,
    salt_style: SaltStyle,
    default_model: String,
    models: HashMap<String, Arc<ModelTokenizer>>,
    fallback: Arc<ModelTokenizer>,
}

/// A keyed request.
#[derive(Debug, Clone)]
pub struct Keyed {
    /// The model the request names (or the default).
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Keys of the prompt's full blocks.
    pub keys: Vec<BlockKey>,
    /// Whether the ids came from the model's real tokenizer.
    pub exact: bool,
    /// Tokenization cache use (chat only).
    pub cache: CacheOutcome,
}

impl Keyer {
    /// A keyer for a pool whose engines use `block_size` and fold salts in `salt_style`.
    pub fn new(block_size: usize, salt_style: SaltStyle, default_model: impl Into<String>) -> Self {
        Self {
            block_size,
            salt_style,
            default_model: default_model.into(),
            models: HashMap::new(),
            fallback: Arc::new(ModelTokenizer::new(TextTokenizer::fallback(), 0)),
        }
    }

    /// Serves `model` with `tokenizer`.
    pub fn with_model(mut self, model: impl Into<String>, tokenizer: ModelTokenizer) -> Self {
        self.models.insert(model.into(), Arc::new(tokenizer));
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

    /// Keys a parsed request for the model it names.
    pub fn key(&self, req: &ParsedRequest<'_>) -> Result<Keyed, TokenizeError> {
        self.key_served(req, None)
    }

    /// Keys a parsed request that the engine serves as `served` (a model rewrite): tokenized
    /// with the requested model's tokenizer when it has one (a LoRA adapter shares its base's),
    /// keyed under the served name, as the engine caches it.
    pub fn key_served(
        &self,
        req: &ParsedRequest<'_>,
        served: Option<&str>,
    ) -> Result<Keyed, TokenizeError> {
        let requested = req.model.as_deref().unwrap_or(&self.default_model);
        let model = served.unwrap_or(requested);
        let tok = self
            .models
            .get(requested)
            .or_else(|| self.models.get(model))
            .unwrap_or(&self.fallback);
        let mut cache = CacheOutcome::default();
        let ids: Vec<u32> = match &req.input {
            Input::Prompt(Prompt::Text(t)) => tok.tokenizer.encode_prompt(t)?,
            Input::Prompt(Prompt::Texts(ts)) => match ts.first() {
                Some(t) => tok.tokenizer.encode_prompt(t)?,
                None => Vec::new(),
            },
            Input::Prompt(Prompt::Tokens(ids)) => ids.clone(),
            Input::Prompt(Prompt::TokenLists(lists)) => lists.first().cloned().unwrap_or_default(),
            Input::Chat { messages, options } => {
                let (ids, outcome) = tok
                    .tokenizer
                    .encode_chat_cached(messages, options, &tok.cache)?;
                cache = outcome;
                ids
            }
        };
        let keys = request_block_keys(
            model,
            req.cache_salt.as_deref(),
            self.salt_style,
            &ids,
            self.block_size,
        );
        Ok(Keyed {
            model: model.to_owned(),
            prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            keys,
            exact: tok.tokenizer.is_exact(),
            cache,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::request::{Api, parse};
    use super::*;

    #[test]
    fn fallback_keys_equal_the_sims_byte_tokenizer_keys() {
        let keyer = Keyer::new(4, SaltStyle::VllmExtraKey, "m");
        let body = br#"{"prompt":"abcdefghijklmnopqrstuvwxyz0123456789"}"#;
        let req = parse(Api::Completions, body).unwrap();
        let k = keyer.key(&req).unwrap();
        assert!(!k.exact);
        assert_eq!(k.model, "m");
        let ids = TextTokenizer::fallback()
            .encode_prompt("abcdefghijklmnopqrstuvwxyz0123456789")
            .unwrap();
        assert_eq!(k.prompt_tokens as usize, ids.len());
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
}
