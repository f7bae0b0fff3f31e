//! The exact tokenizer: a Hugging Face `tokenizer.json` plus the chat templates of its directory.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::config::{self, SPECIAL_TOKEN_NAMES};
use crate::cuts::{self, InnerCuts};
use crate::error::{LoadError, Result, TokenizeError};
use crate::fast::FastPath;
use crate::messages::ContentFormat;
use crate::template::ChatTemplates;
use crate::{ChatOptions, Limits};

/// `tokenizer.json`'s file name.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// How many "word" ids [`HfTokenizer::word_token_ids`] collects at most.
const MAX_WORDS: usize = 128;

/// A Hugging Face tokenizer with its chat templates, as loaded by
/// [`TextTokenizer::from_dir`](crate::TextTokenizer::from_dir). Tokenize through
/// [`TextTokenizer`](crate::TextTokenizer), which enforces the input limits; this type only
/// describes what was loaded.
pub struct HfTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    templates: ChatTemplates,
    eos_token_id: Option<u32>,
    words: Vec<u32>,
    split_tokens: Vec<String>,
    inner_cuts: InnerCuts,
    prompt_additive: bool,
    clean_up_tokenization_spaces: bool,
    fast: Option<FastPath>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("eos_token_id", &self.eos_token_id)
            .field("templates", &self.templates)
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (and `chat_template.jinja` or
    /// `additional_chat_templates/*.jinja` where present) from `dir`.
    pub(crate) fn from_dir(dir: &Path, limits: &Limits) -> Result<Self, LoadError> {
        let file = dir.join(TOKENIZER_FILE);
        let bytes = std::fs::read(&file).map_err(|source| LoadError::Read {
            file: file.clone(),
            source,
        })?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|source| LoadError::Tokenizer {
                file: file.clone(),
                source,
            })?;
        drop(bytes);

        let config = config::load(dir)?;
        let special_tokens = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|name| {
                config
                    .special_token(name)
                    .map(|v| ((*name).to_owned(), v.to_owned()))
            })
            .collect();
        let templates = ChatTemplates::new(&config.templates, special_tokens, limits)?;
        let eos_token_id = config
            .special_token("eos_token")
            .and_then(|t| tokenizer.token_to_id(t));
        let mut this = Self {
            dir: dir.to_owned(),
            tokenizer,
            templates,
            eos_token_id,
            words: Vec::new(),
            split_tokens: Vec::new(),
            inner_cuts: InnerCuts::None,
            prompt_additive: false,
            clean_up_tokenization_spaces: config.clean_up_tokenization_spaces,
            fast: None,
        };
        this.words = this.find_words();
        this.split_tokens = this.find_split_tokens();
        this.inner_cuts = InnerCuts::detect(&this.tokenizer);
        this.prompt_additive = cuts::post_processor_adds_nothing(&this.tokenizer);
        this.fast = FastPath::detect(&this.tokenizer);
        Ok(this)
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Token ids of `text`: through the fast path when the tokenizer and the text qualify
    /// (see `fast.rs`; special tokens added only when the post-processor adds none), else the
    /// full pipeline.
    pub(crate) fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        if let Some(fast) = &self.fast
            && (!add_special_tokens || self.prompt_additive)
        {
            let mut ids = Vec::with_capacity(text.len() / 3);
            if fast.encode(self.tokenizer.get_model(), text, &mut ids)? {
                return Ok(ids);
            }
        }
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizeError::Encode { source })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub(crate) fn decode(&self, ids: &[u32]) -> Result<String> {
        let text = self
            .tokenizer
            .decode(ids, true)
            .map_err(|source| TokenizeError::Decode { source })?;
        Ok(if self.clean_up_tokenization_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// Renders the chat template (see [`crate::TextTokenizer::render_chat`]).
    pub(crate) fn render_chat(&self, messages: &[Value], opts: &ChatOptions) -> Result<String> {
        if self.templates.is_empty() {
            return Err(TokenizeError::NoChatTemplate);
        }
        self.templates.render(messages, opts)
    }

    /// Whether the directory has a chat template.
    pub fn has_chat_template(&self) -> bool {
        !self.templates.is_empty()
    }

    /// The content format vLLM would detect for the template a request with (or without) tools uses.
    pub fn content_format(&self, with_tools: bool) -> Option<ContentFormat> {
        self.templates.content_format(with_tools)
    }

    /// The file the chat template for a request with (or without) tools comes from.
    pub fn chat_template_file(&self, with_tools: bool) -> Option<&Path> {
        self.templates.file(with_tools)
    }

    /// The id of `eos_token`.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> u32 {
        u32::try_from(self.tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX)
    }

    /// Ids of common words (a space and 3 to 8 lowercase ASCII letters) that are one token each
    /// and encode back to themselves, lowest ids (most frequent merges) first.
    pub fn word_token_ids(&self) -> &[u32] {
        &self.words
    }

    /// Special tokens a prompt may be cut before without changing its ids (see `cache.rs`).
    pub(crate) fn split_tokens(&self) -> &[String] {
        &self.split_tokens
    }

    /// Whether cuts inside a segment are known to be additive for this tokenizer (see
    /// `cuts.rs`); without them, segments between special tokens are tokenized whole.
    pub fn has_inner_cuts(&self) -> bool {
        self.inner_cuts != InnerCuts::None
    }

    pub(crate) fn inner_cuts(&self) -> InnerCuts {
        self.inner_cuts
    }

    /// Whether `add_special_tokens = true` adds no ids, so a completions prompt may be encoded
    /// in chunks like a chat.
    pub(crate) fn prompt_additive(&self) -> bool {
        self.prompt_additive
    }

    fn find_split_tokens(&self) -> Vec<String> {
        let mut tokens: Vec<String> = self
            .tokenizer
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.normalized && !t.lstrip && !t.single_word)
            .filter(|t| !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        tokens.sort();
        tokens.dedup();
        tokens
    }

    pub(crate) fn set_fuel(&mut self, fuel: u64) {
        self.templates.set_fuel(fuel);
    }

    fn find_words(&self) -> Vec<u32> {
        let added = self.tokenizer.get_added_tokens_decoder();
        let mut words = Vec::new();
        for id in 0..self.vocab_size() {
            if words.len() >= MAX_WORDS {
                break;
            }
            if added.contains_key(&id) {
                continue;
            }
            let Ok(text) = self.tokenizer.decode(&[id], false) else {
                continue;
            };
            let Some(word) = text.strip_prefix(' ') else {
                continue;
            };
            if !(3..=8).contains(&word.len()) || !word.bytes().all(|b| b.is_ascii_lowercase()) {
                continue;
            }
            if self.encode(&text, false).ok().as_deref() == Some(&[id][..]) {
                words.push(id);
            }
        }
        words
    }
}

/// `transformers`' `clean_up_tokenization`: removes the space before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_up_matches_transformers() {
        assert_eq!(
            clean_up_tokenization("Hi , it 's done . Is n't it ?"),
            "Hi, it's done. Isn't it?"
        );
    }
}
