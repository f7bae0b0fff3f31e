//! The two error enums: [`LoadError`] (reading a tokenizer directory) and [`TokenizeError`]
//! (turning one request into token ids, or ids back into text).

use std::path::PathBuf;

/// A boxed error from the `tokenizers` crate, which reports everything this way.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a tokenizer directory could not be loaded. Every variant names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file is missing or unreadable.
    #[error("cannot read {}: {source}", file.display())]
    Read {
        /// The file that was read.
        file: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON, or not the JSON shape expected.
    #[error("{} is not valid JSON: {source}", file.display())]
    Json {
        /// The file that was parsed.
        file: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// `tokenizer.json` parsed as JSON but the `tokenizers` crate rejected it.
    #[error("{} is not a usable tokenizer: {source}", file.display())]
    Tokenizer {
        /// The file that was loaded.
        file: PathBuf,
        /// The `tokenizers` error.
        #[source]
        source: BoxError,
    },
    /// A field of the file has the wrong type or value.
    #[error("{}: field `{field}`: {reason}", file.display())]
    Field {
        /// The file that holds the field.
        file: PathBuf,
        /// The field's name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A chat template does not compile.
    #[error("{}: chat template `{name}` does not compile: {source}", file.display())]
    Template {
        /// The file the template came from.
        file: PathBuf,
        /// The template's name (`default`, `tool_use`, …).
        name: String,
        /// The template error, with line information.
        #[source]
        source: minijinja::Error,
    },
}

impl LoadError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            LoadError::Read { .. } => "read",
            LoadError::Json { .. } => "json",
            LoadError::Tokenizer { .. } => "tokenizer",
            LoadError::Field { .. } => "field",
            LoadError::Template { .. } => "template",
        }
    }
}

/// Why a request could not be tokenized (or ids decoded).
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The input is larger than [`Limits::max_input_bytes`](crate::Limits::max_input_bytes).
    #[error("{what} is {len} bytes, more than the limit of {max} bytes")]
    InputTooLarge {
        /// What was measured: the prompt, the chat request, or the rendered chat.
        what: &'static str,
        /// Its size in bytes (for the chat request: at least this many).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A message is malformed (not an object, no string `role`, content of the wrong type…).
    #[error("message {index}: {reason}")]
    InvalidMessage {
        /// The message's position in the request.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A content part that this text-only tokenizer cannot render (image, audio, video…).
    #[error("message {index}: content part type `{part_type}` is not supported (text only)")]
    UnsupportedContent {
        /// The message's position in the request.
        index: usize,
        /// The part's `type` (or the key that identified it).
        part_type: String,
    },
    /// `tools` is not a list of `{"type": "function", "function": {"name": …}}` objects.
    #[error("tools: {reason}")]
    InvalidTools {
        /// What is wrong.
        reason: String,
    },
    /// `add_generation_prompt` and `continue_final_message` were both set.
    #[error("cannot set both `continue_final_message` and `add_generation_prompt` to true")]
    ConflictingOptions,
    /// `continue_final_message` is set but the final message cannot be continued.
    #[error("continue_final_message: {reason}")]
    ContinueFinalMessage {
        /// Why not.
        reason: String,
    },
    /// The tokenizer has no chat template (or none under the name the request selects).
    #[error("the tokenizer has no chat template")]
    NoChatTemplate,
    /// Rendering the chat template failed: `raise_exception`, a type error, fuel exhausted…
    #[error("chat template: {source}")]
    Template {
        /// The template error, with the message given to `raise_exception` where there was one.
        #[source]
        source: minijinja::Error,
    },
    /// The `tokenizers` model failed to encode the text.
    #[error("encode: {source}")]
    Encode {
        /// The `tokenizers` error.
        #[source]
        source: BoxError,
    },
    /// The `tokenizers` model failed to decode the ids.
    #[error("decode: {source}")]
    Decode {
        /// The `tokenizers` error.
        #[source]
        source: BoxError,
    },
    /// An id that the tokenizer cannot produce.
    #[error("token id {id} is out of range")]
    UnknownTokenId {
        /// The id.
        id: u32,
    },
}

impl TokenizeError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            TokenizeError::InputTooLarge { .. } => "input_too_large",
            TokenizeError::InvalidMessage { .. } => "invalid_message",
            TokenizeError::UnsupportedContent { .. } => "unsupported_content",
            TokenizeError::InvalidTools { .. } => "invalid_tools",
            TokenizeError::ConflictingOptions => "conflicting_options",
            TokenizeError::ContinueFinalMessage { .. } => "continue_final_message",
            TokenizeError::NoChatTemplate => "no_chat_template",
            TokenizeError::Template { .. } => "template",
            TokenizeError::Encode { .. } => "encode",
            TokenizeError::Decode { .. } => "decode",
            TokenizeError::UnknownTokenId { .. } => "unknown_token_id",
        }
    }

    /// Whether the request itself is at fault (an HTTP 400), rather than the tokenizer's files.
    pub fn is_client_error(&self) -> bool {
        !matches!(
            self,
            TokenizeError::NoChatTemplate
                | TokenizeError::Encode { .. }
                | TokenizeError::Decode { .. }
        )
    }
}

/// Result of tokenizing.
pub type Result<T, E = TokenizeError> = std::result::Result<T, E>;
