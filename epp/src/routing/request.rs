//! OpenAI request bodies as the EPP needs them: which API, which model, and the prompt to key.
//!
//! The body is parsed once, straight from the buffer Envoy sent; strings without escapes are
//! borrowed from it. Chat messages are kept as JSON values for the chat template.
//!
//! It also notes the prefill/decode transfer fields a client set ([`TRANSFER_FIELDS`]): vLLM's
//! `kv_transfer_params` and SGLang's `bootstrap_host`/`bootstrap_port`/`bootstrap_room` tell an
//! engine where to pull a prompt's KV cache from. kvgate's sidecar sets them itself on the P/D
//! path; from a client they would make the engine connect to a host of the client's choosing
//! and take its KV blocks as the prompt's, so the picker refuses them unless told otherwise.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

/// Request fields that direct an engine's KV transfer (see the module docs), in the order they
/// are reported.
pub const TRANSFER_FIELDS: [&str; 4] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

/// Which OpenAI API a path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
    /// Anything else (models, health, embeddings…): routed on load alone.
    Other,
}

impl Api {
    /// The API of a request path (query string ignored).
    pub fn of_path(path: &str) -> Self {
        let path = path.split(['?', '#']).next().unwrap_or_default();
        match path.trim_end_matches('/') {
            "/v1/completions" => Api::Completions,
            "/v1/chat/completions" => Api::Chat,
            _ => Api::Other,
        }
    }
}

/// A completions prompt in any OpenAI shape.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt<'a> {
    /// One text.
    Text(#[serde(borrow)] Cow<'a, str>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Several texts (the first is keyed: one routing decision per HTTP request).
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    /// Several token-id prompts.
    TokenLists(Vec<Vec<u32>>),
}

/// A string borrowed from the body when it has no escapes (serde only borrows a `Cow` that is
/// a field's direct type, so options wrap it).
#[derive(Debug, Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

#[derive(Debug, Deserialize)]
struct Raw<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
    #[serde(borrow, default)]
    user: Option<Str<'a>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    // The transfer fields: only whether they are set (null counts as absent, as engines read it).
    #[serde(default)]
    kv_transfer_params: Option<IgnoredAny>,
    #[serde(default)]
    bootstrap_host: Option<IgnoredAny>,
    #[serde(default)]
    bootstrap_port: Option<IgnoredAny>,
    #[serde(default)]
    bootstrap_room: Option<IgnoredAny>,
}

impl Raw<'_> {
    /// The first of [`TRANSFER_FIELDS`] the body sets.
    fn transfer_field(&self) -> Option<&'static str> {
        let set = [
            self.kv_transfer_params.is_some(),
            self.bootstrap_host.is_some(),
            self.bootstrap_port.is_some(),
            self.bootstrap_room.is_some(),
        ];
        TRANSFER_FIELDS
            .iter()
            .zip(set)
            .find_map(|(&f, set)| set.then_some(f))
    }
}

/// What the EPP keys a request on.
#[derive(Debug, Clone)]
pub enum Input<'a> {
    /// A completions prompt.
    Prompt(Prompt<'a>),
    /// A chat conversation and the template options it asked for.
    Chat {
        /// The messages.
        messages: Vec<Value>,
        /// Template options (boxed: they are large and only chat needs them).
        options: Box<tokenize::ChatOptions>,
    },
}

/// A parsed request.
#[derive(Debug, Clone)]
pub struct ParsedRequest<'a> {
    /// The requested model (the pool's default when absent).
    pub model: Option<Cow<'a, str>>,
    /// Whether the response streams.
    pub stream: bool,
    /// Output length bound, if given.
    pub max_tokens: Option<u64>,
    /// vLLM's cache salt.
    pub cache_salt: Option<Cow<'a, str>>,
    /// OpenAI `user`.
    pub user: Option<Cow<'a, str>>,
    /// The prompt.
    pub input: Input<'a>,
    /// The first P/D transfer field the client set ([`TRANSFER_FIELDS`]), if any.
    pub transfer_field: Option<&'static str>,
}

/// Why a body is refused (400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// Not JSON, or a field of the wrong type.
    #[error("request body is not valid OpenAI JSON: {0}")]
    Json(String),
    /// A required field is absent.
    #[error("request body has no `{field}` (required by {api})")]
    Missing {
        /// The field.
        field: &'static str,
        /// The endpoint.
        api: &'static str,
    },
    /// A field is present but unusable.
    #[error("`{field}`: {why}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        why: &'static str,
    },
}

impl ParseError {
    /// Bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ParseError::Json(_) => "json",
            ParseError::Missing { .. } => "missing-field",
            ParseError::Invalid { .. } => "invalid-field",
        }
    }
}

/// Parses a completions or chat body. `Api::Other` is not parsed (the caller routes on load).
pub fn parse(api: Api, body: &[u8]) -> Result<ParsedRequest<'_>, ParseError> {
    let raw: Raw<'_> = serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let transfer_field = raw.transfer_field();
    let input = match api {
        Api::Completions => {
            let prompt = raw.prompt.ok_or(ParseError::Missing {
                field: "prompt",
                api: "/v1/completions",
            })?;
            let empty = match &prompt {
                Prompt::Text(_) => false,
                Prompt::Tokens(t) => t.is_empty(),
                Prompt::Texts(t) => t.is_empty(),
                Prompt::TokenLists(t) => t.first().is_none_or(Vec::is_empty),
            };
            if empty {
                return Err(ParseError::Invalid {
                    field: "prompt",
                    why: "must not be empty",
                });
            }
            Input::Prompt(prompt)
        }
        Api::Chat | Api::Other => {
            let messages = raw.messages.ok_or(ParseError::Missing {
                field: "messages",
                api: "/v1/chat/completions",
            })?;
            if messages.is_empty() {
                return Err(ParseError::Invalid {
                    field: "messages",
                    why: "must not be empty",
                });
            }
            if messages.iter().any(|m| !m.is_object()) {
                return Err(ParseError::Invalid {
                    field: "messages",
                    why: "every message must be an object",
                });
            }
            let continue_final = raw.continue_final_message.unwrap_or(false);
            Input::Chat {
                messages,
                options: Box::new(tokenize::ChatOptions {
                    add_generation_prompt: raw.add_generation_prompt.unwrap_or(!continue_final),
                    continue_final_message: continue_final,
                    template_kwargs: raw.chat_template_kwargs.unwrap_or_default(),
                    tools: raw.tools,
                    ..tokenize::ChatOptions::default()
                }),
            }
        }
    };
    Ok(ParsedRequest {
        model: raw.model.map(|s| s.0),
        stream: raw.stream.unwrap_or(false),
        max_tokens: raw.max_completion_tokens.or(raw.max_tokens),
        cache_salt: raw.cache_salt.map(|s| s.0),
        user: raw.user.map(|s| s.0),
        input,
        transfer_field,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_the_api() {
        assert_eq!(Api::of_path("/v1/completions"), Api::Completions);
        assert_eq!(Api::of_path("/v1/chat/completions?x=1"), Api::Chat);
        assert_eq!(Api::of_path("/v1/chat/completions/"), Api::Chat);
        assert_eq!(Api::of_path("/v1/models"), Api::Other);
    }

    #[test]
    fn completions_in_every_shape_borrow_from_the_body() {
        let body =
            br#"{"model":"m","prompt":"hello","stream":true,"max_tokens":7,"cache_salt":"s"}"#;
        let r = parse(Api::Completions, body).unwrap();
        assert!(matches!(r.model, Some(Cow::Borrowed("m"))));
        assert!(matches!(
            r.input,
            Input::Prompt(Prompt::Text(Cow::Borrowed("hello")))
        ));
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        let r = parse(Api::Completions, br#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(r.input, Input::Prompt(Prompt::Tokens(ref t)) if t == &[1, 2, 3]));
        let r = parse(Api::Completions, br#"{"prompt":["a\nb","c"]}"#).unwrap();
        assert!(matches!(r.input, Input::Prompt(Prompt::Texts(ref t)) if t[0] == "a\nb"));
        let r = parse(Api::Completions, br#"{"prompt":[[5],[6]]}"#).unwrap();
        assert!(matches!(r.input, Input::Prompt(Prompt::TokenLists(_))));
    }

    #[test]
    fn chat_keeps_messages_and_options() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "max_completion_tokens":3,"max_tokens":9,"chat_template_kwargs":{"enable_thinking":false}}"#;
        let r = parse(Api::Chat, body).unwrap();
        assert_eq!(r.max_tokens, Some(3));
        let Input::Chat { messages, options } = r.input else {
            panic!()
        };
        assert_eq!(messages.len(), 1);
        assert!(options.add_generation_prompt);
        assert_eq!(options.template_kwargs["enable_thinking"], false);
    }

    #[test]
    fn transfer_fields_are_noted_however_written() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            parse(Api::Chat, body.as_bytes()).unwrap().transfer_field
        };
        assert_eq!(chat(""), None);
        assert_eq!(chat(r#","kv_transfer_params":null"#), None);
        assert_eq!(
            chat(r#","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"x"}"#),
            Some("kv_transfer_params")
        );
        // An escaped key is the same key to the engine's JSON parser, and to this one.
        assert_eq!(
            chat(r#","kv\u005ftransfer_params":{}"#),
            Some("kv_transfer_params")
        );
        assert_eq!(
            chat(r#","bootstrap_room":7,"bootstrap_host":"10.0.0.9""#),
            Some("bootstrap_host")
        );
        assert_eq!(chat(r#","bootstrap_port":8998"#), Some("bootstrap_port"));
        assert_eq!(chat(r#","bootstrap_room":7"#), Some("bootstrap_room"));
        // Inside a message it is text, not a field.
        let body = br#"{"messages":[{"role":"user","content":"\"kv_transfer_params\": {}"}]}"#;
        assert_eq!(parse(Api::Chat, body).unwrap().transfer_field, None);
        let r = parse(Api::Completions, br#"{"prompt":"x","bootstrap_host":"h"}"#).unwrap();
        assert_eq!(r.transfer_field, Some("bootstrap_host"));
    }

    #[test]
    fn bad_bodies_are_400_with_a_helpful_message() {
        let e = parse(Api::Chat, b"{").unwrap_err();
        assert!(e.to_string().contains("not valid OpenAI JSON"), "{e}");
        assert_eq!(
            parse(Api::Chat, br#"{"model":"m"}"#).unwrap_err(),
            ParseError::Missing {
                field: "messages",
                api: "/v1/chat/completions"
            }
        );
        assert_eq!(
            parse(Api::Completions, br#"{"prompt":[]}"#)
                .unwrap_err()
                .metric_label(),
            "invalid-field"
        );
        assert!(parse(Api::Chat, br#"{"messages":[]}"#).is_err());
        assert!(parse(Api::Chat, br#"{"messages":["x"]}"#).is_err());
        assert!(parse(Api::Completions, br#"{"prompt":{"a":1}}"#).is_err());
        assert!(parse(Api::Completions, br#"{"prompt":"x","max_tokens":"many"}"#).is_err());
    }
}
