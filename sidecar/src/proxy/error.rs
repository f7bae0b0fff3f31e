//! The proxy's failures and how each one is answered: an HTTP status and an OpenAI-shaped error
//! body (`{"error": {"message", "type", "param", "code"}}`), as the engines answer theirs.

use axum::body::Body;
use axum::http::{HeaderValue, Response, StatusCode, header};

/// Why the proxy answered a request itself instead of relaying the engine's answer.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request body was not the JSON object the P/D flow rewrites.
    #[error("invalid request body: {0}")]
    BadBody(String),
    /// The `x-prefiller-host-port` header is not an `ip:port`.
    #[error("invalid x-prefiller-host-port header {0:?}: expected ip:port")]
    BadPrefillerHeader(String),
    /// The request body is larger than `--proxy-max-body-bytes`.
    #[error("request body exceeds the {limit}-byte limit")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The named prefiller is not in the allow-list (SSRF protection).
    #[error("prefiller {0} is not an endpoint of this pool")]
    PrefillerNotAllowed(String),
    /// SSRF protection is on but no allow-list has been loaded.
    #[error("no prefiller allow-list is loaded; P/D requests are refused")]
    NoAllowList,
    /// The prefill leg failed after every attempt.
    #[error("prefill on {prefiller} failed after {attempts} attempt(s): {reason}")]
    PrefillFailed {
        /// The prefiller.
        prefiller: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        reason: String,
    },
    /// The local engine could not be reached or broke off.
    #[error("engine unreachable: {0}")]
    Engine(String),
}

impl ProxyError {
    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadBody(_) | Self::BadPrefillerHeader(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::PrefillerNotAllowed(_) | Self::NoAllowList => StatusCode::FORBIDDEN,
            Self::PrefillFailed { .. } | Self::Engine(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// A bounded label for logs and metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::BadBody(_) => "bad_body",
            Self::BadPrefillerHeader(_) => "bad_prefiller_header",
            Self::TooLarge { .. } => "too_large",
            Self::PrefillerNotAllowed(_) => "prefiller_not_allowed",
            Self::NoAllowList => "no_allow_list",
            Self::PrefillFailed { .. } => "prefill_failed",
            Self::Engine(_) => "engine_unreachable",
        }
    }

    fn error_type(&self) -> &'static str {
        match self.status() {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "BadRequestError",
            StatusCode::FORBIDDEN => "PermissionDeniedError",
            _ => "BadGatewayError",
        }
    }

    /// The OpenAI-shaped error body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.error_type(),
                "param": null,
                "code": self.status().as_u16(),
            }
        })
    }

    /// The whole response.
    pub fn into_response(self) -> Response<Body> {
        let mut resp = Response::new(Body::from(self.body().to_string()));
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp.headers_mut().insert(
            "x-kvgate-proxy-error",
            HeaderValue::from_static(self.metric_label()),
        );
        resp
    }
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

    #[test]
    fn prefill_failure_is_a_502_naming_the_reason() {
        let e = ProxyError::PrefillFailed {
            prefiller: "10.0.0.1:8000".into(),
            attempts: 3,
            reason: "status 503".into(),
        };
        assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
        let body = e.body();
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("10.0.0.1:8000") && msg.contains("3 attempt") && msg.contains("503"));
        assert_eq!(body["error"]["code"], 502);
    }

    #[test]
    fn refusals_are_403_and_oversize_413() {
        assert_eq!(ProxyError::NoAllowList.status(), StatusCode::FORBIDDEN);
        assert_eq!(
            ProxyError::PrefillerNotAllowed("1.2.3.4:5".into()).status(),
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            ProxyError::TooLarge { limit: 1 }.status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
    }
}
