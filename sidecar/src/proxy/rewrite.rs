//! Pure request rewriting for the P/D flow (vLLM NIXL connector semantics, as llm-d's
//! routing sidecar does it):
//!
//! - the **prefill leg** is the client's request with `kv_transfer_params` asking for a remote
//!   decode, `stream: false`, no `stream_options`, and one output token (`max_tokens: 1`, plus
//!   `max_completion_tokens: 1` for chat, where that field wins);
//! - the **decode leg** is the client's request unchanged except for `kv_transfer_params`, which
//!   is the object the prefiller returned.
//!
//! No I/O here; the handler feeds bytes in and sends bytes out.

use serde_json::{Map, Value};

/// Which OpenAI generation API a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

impl Api {
    /// The API a request path names, if it is one the P/D flow handles.
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/completions" => Some(Self::Completions),
            "/v1/chat/completions" => Some(Self::Chat),
            _ => None,
        }
    }
}

/// Why a body could not be rewritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RewriteError {
    /// The client's body is not JSON.
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    /// The client's body is JSON but not an object.
    #[error("request body must be a JSON object")]
    NotObject,
    /// The prefiller's answer is not JSON.
    #[error("prefill response is not valid JSON: {0}")]
    ResponseNotJson(String),
    /// The prefiller's answer carries no `kv_transfer_params` object.
    #[error("prefill response has no kv_transfer_params object")]
    NoTransferParams,
}

/// A parsed client request body (a JSON object).
pub type Request = Map<String, Value>;

/// Parses the client's body.
pub fn parse_request(body: &[u8]) -> Result<Request, RewriteError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(RewriteError::NotObject),
        Err(e) => Err(RewriteError::NotJson(e.to_string())),
    }
}

/// The `kv_transfer_params` a prefill leg sends: prefill here, decode remotely.
pub fn prefill_transfer_params() -> Value {
    serde_json::json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// The prefill leg's body.
pub fn prefill_request(api: Api, original: &Request) -> Request {
    let mut req = original.clone();
    req.insert("kv_transfer_params".into(), prefill_transfer_params());
    req.insert("stream".into(), Value::Bool(false));
    req.remove("stream_options");
    req.insert("max_tokens".into(), Value::from(1));
    if api == Api::Chat {
        req.insert("max_completion_tokens".into(), Value::from(1));
    }
    req
}

/// The decode leg's body: the original request with the prefiller's `kv_transfer_params`.
pub fn decode_request(mut original: Request, params: Value) -> Request {
    original.insert("kv_transfer_params".into(), params);
    original
}

/// The `kv_transfer_params` object of a prefill response body.
pub fn transfer_params(response: &[u8]) -> Result<Value, RewriteError> {
    let value: Value = serde_json::from_slice(response)
        .map_err(|e| RewriteError::ResponseNotJson(e.to_string()))?;
    match value.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => Ok(p.clone()),
        _ => Err(RewriteError::NoTransferParams),
    }
}

/// Serialises a body (a JSON object always serialises).
pub fn to_bytes(req: &Request) -> Vec<u8> {
    serde_json::to_vec(req).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Request {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn completions_stream_prefill_is_non_stream_one_token() {
        let orig = obj(json!({
            "model": "m", "prompt": "hi", "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 50
        }));
        let p = prefill_request(Api::Completions, &orig);
        assert_eq!(p["stream"], json!(false));
        assert!(!p.contains_key("stream_options"));
        assert_eq!(p["max_tokens"], json!(1));
        assert!(!p.contains_key("max_completion_tokens"));
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], json!(true));
        assert_eq!(p["kv_transfer_params"]["do_remote_prefill"], json!(false));
        for k in [
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        ] {
            assert_eq!(p["kv_transfer_params"][k], Value::Null, "{k}");
        }
        assert_eq!(p["prompt"], json!("hi"));
        // The original is untouched.
        assert_eq!(orig["max_tokens"], json!(50));
    }

    #[test]
    fn chat_prefill_caps_both_token_fields() {
        let orig = obj(json!({
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 99
        }));
        let p = prefill_request(Api::Chat, &orig);
        assert_eq!(p["max_completion_tokens"], json!(1));
        assert_eq!(p["max_tokens"], json!(1));
        assert_eq!(p["stream"], json!(false));
    }

    #[test]
    fn missing_fields_are_added_not_required() {
        let orig = obj(json!({"prompt": [1, 2, 3]}));
        let p = prefill_request(Api::Completions, &orig);
        assert_eq!(p["stream"], json!(false));
        assert_eq!(p["max_tokens"], json!(1));
        let d = decode_request(orig.clone(), json!({"remote_block_ids": [1]}));
        assert!(!d.contains_key("stream"));
        assert!(!d.contains_key("max_tokens"));
    }

    #[test]
    fn client_kv_transfer_params_are_replaced_in_both_legs() {
        let orig = obj(json!({"prompt": "x", "kv_transfer_params": {"evil": 1}}));
        let p = prefill_request(Api::Completions, &orig);
        assert!(p["kv_transfer_params"].get("evil").is_none());
        let d = decode_request(orig, json!({"do_remote_prefill": true}));
        assert_eq!(d["kv_transfer_params"], json!({"do_remote_prefill": true}));
    }

    #[test]
    fn decode_keeps_stream_flags_and_token_limits() {
        for (api, stream) in [(Api::Completions, true), (Api::Chat, false)] {
            let orig = obj(json!({
                "stream": stream, "stream_options": {"include_usage": true},
                "max_tokens": 7, "max_completion_tokens": 8
            }));
            let _ = prefill_request(api, &orig);
            let d = decode_request(orig.clone(), json!({"remote_host": "h"}));
            assert_eq!(d["stream"], json!(stream));
            assert_eq!(d["stream_options"], json!({"include_usage": true}));
            assert_eq!(d["max_tokens"], json!(7));
            assert_eq!(d["max_completion_tokens"], json!(8));
            assert_eq!(d["kv_transfer_params"]["remote_host"], json!("h"));
        }
    }

    #[test]
    fn bad_json_and_non_objects_are_refused() {
        assert!(matches!(
            parse_request(b"{nope"),
            Err(RewriteError::NotJson(_))
        ));
        assert!(matches!(parse_request(b""), Err(RewriteError::NotJson(_))));
        assert_eq!(parse_request(b"[1,2]"), Err(RewriteError::NotObject));
        assert_eq!(parse_request(b"\"s\""), Err(RewriteError::NotObject));
        assert!(parse_request(br#"{"a":1}"#).is_ok());
    }

    #[test]
    fn transfer_params_are_read_from_the_prefill_response() {
        let body =
            br#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[3]}}"#;
        assert_eq!(
            transfer_params(body).unwrap(),
            json!({"do_remote_prefill": true, "remote_block_ids": [3]})
        );
        assert_eq!(
            transfer_params(br#"{"id":"x"}"#),
            Err(RewriteError::NoTransferParams)
        );
        assert_eq!(
            transfer_params(br#"{"kv_transfer_params":null}"#),
            Err(RewriteError::NoTransferParams)
        );
        assert!(matches!(
            transfer_params(b"<html>"),
            Err(RewriteError::ResponseNotJson(_))
        ));
    }

    #[test]
    fn paths() {
        assert_eq!(Api::from_path("/v1/completions"), Some(Api::Completions));
        assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::Chat));
        assert_eq!(Api::from_path("/v1/models"), None);
    }
}
