//! The OpenAI-compatible request and response shapes the simulator speaks, as vLLM 0.32 writes
//! them, and its error responses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` (and `"usage": null` on the others).
    #[serde(default)]
    pub include_usage: bool,
    /// Put the running usage on every chunk.
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// A completions prompt in any of the shapes OpenAI allows.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// Several texts: one choice each.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// Served model name; the default model when absent.
    pub model: Option<String>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Generate exactly `max_tokens` tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Choices per prompt; only 1 is supported.
    pub n: Option<u32>,
    /// vLLM's per-request prefix-cache salt.
    pub cache_salt: Option<String>,
    /// vLLM's disaggregated-serving (NIXL connector) parameters.
    pub kv_transfer_params: Option<serde_json::Value>,
    /// Return the prompt and output token ids (vLLM ≥ 0.10).
    #[serde(default)]
    pub return_token_ids: bool,
    /// SGLang P/D: the prefill server's host (a list for a batch).
    pub bootstrap_host: Option<serde_json::Value>,
    /// SGLang P/D: its bootstrap port (a list for a batch).
    pub bootstrap_port: Option<serde_json::Value>,
    /// SGLang P/D: the rendezvous room (a list for a batch).
    pub bootstrap_room: Option<serde_json::Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: Prompt,
    /// Output length bound (default 16, as OpenAI).
    pub max_tokens: Option<u32>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation, kept as JSON for the chat template.
    pub messages: Vec<serde_json::Value>,
    /// Output length bound (deprecated name).
    pub max_tokens: Option<u32>,
    /// Output length bound.
    pub max_completion_tokens: Option<u32>,
    /// Extra variables for the chat template.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Append the assistant header (default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of opening a new one.
    #[serde(default)]
    pub continue_final_message: bool,
    /// Tools, passed to the chat template.
    pub tools: Option<serde_json::Value>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt plus completion tokens.
    pub total_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Cache details.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    /// Usage for one or more choices.
    pub fn new(prompt: u32, completion: u32, cached: u32) -> Self {
        Self {
            prompt_tokens: prompt,
            total_tokens: prompt + completion,
            completion_tokens: completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
}

impl ApiError {
    /// 400 Bad Request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
        }
    }

    /// vLLM's context-length error (400).
    pub fn context_length(max_model_len: u32, prompt: u32, max_tokens: u32) -> Self {
        Self::bad_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, you \
             requested {} tokens ({prompt} in the messages, {max_tokens} in the completion). \
             Please reduce the length of the messages or completion.",
            u64::from(prompt) + u64::from(max_tokens)
        ))
    }

    fn type_name(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::PAYLOAD_TOO_LARGE => "RequestEntityTooLarge",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.type_name(),
                "param": null,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Reads a request body as JSON of type `T`, with OpenAI-shaped errors.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("invalid request body: {e} (expected OpenAI JSON)"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_in_every_shape() {
        for (json, want) in [
            (r#"{"prompt":"hi"}"#, "Text"),
            (r#"{"prompt":["a","b"]}"#, "Texts"),
            (r#"{"prompt":[1,2,3]}"#, "Tokens"),
            (r#"{"prompt":[[1],[2,3]]}"#, "TokenLists"),
        ] {
            let r: CompletionRequest = parse_body(json.as_bytes()).unwrap();
            assert!(format!("{:?}", r.prompt).starts_with(want), "{json}");
        }
        let err = parse_body::<CompletionRequest>(br#"{"prompt":{}}"#).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        let err = parse_body::<CompletionRequest>(b"{").unwrap_err();
        assert!(err.message.contains("invalid request body"));
    }

    #[test]
    fn error_shape_is_openai() {
        let body = ApiError::unknown_model("x").body();
        assert_eq!(body["error"]["code"], 404);
        assert_eq!(body["error"]["type"], "NotFoundError");
        assert_eq!(body["error"]["message"], "The model `x` does not exist.");
        let body = ApiError::context_length(2048, 2000, 100).body();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("2100 tokens")
        );
    }
}
