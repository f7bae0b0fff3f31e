//! Requests the EPP answers itself: Envoy `ImmediateResponse`s with an OpenAI-style error body.

use envoy_types::pb::envoy::service::ext_proc::v3::{
    ImmediateResponse, ProcessingResponse, processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;

use super::headers::{mutation, set};
use super::router::Rejection;
use super::{DROP_REASON_HEADER, REQUEST_ID_HEADER};

/// An answer the EPP gives in place of the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) status: u16,
    /// Bounded label, sent as `x-kvgate-drop-reason`.
    pub(super) reason: &'static str,
    pub(super) message: String,
}

impl From<&Rejection> for Refusal {
    fn from(r: &Rejection) -> Self {
        Self {
            status: r.status(),
            reason: r.reason(),
            message: r.message().to_owned(),
        }
    }
}

impl Refusal {
    /// OpenAI's error `type` for the status.
    fn error_type(&self) -> &'static str {
        match self.status {
            400..=413 => "invalid_request_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    /// `{"error": {"message", "type", "param": null, "code"}}`.
    fn body(&self) -> Vec<u8> {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.error_type(),
                "param": null,
                "code": self.reason,
            }
        })
        .to_string()
        .into_bytes()
    }

    pub(super) fn into_response(self, request_id: Option<&str>) -> ProcessingResponse {
        let mut headers = vec![
            set("content-type", "application/json"),
            set(DROP_REASON_HEADER, self.reason),
        ];
        if let Some(id) = request_id {
            headers.push(set(REQUEST_ID_HEADER, id));
        }
        ProcessingResponse {
            response: Some(Response::ImmediateResponse(ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(self.status),
                }),
                headers: Some(mutation(headers, &[])),
                body: self.body(),
                details: format!("kvgate_{}", self.reason.replace('-', "_")),
                ..Default::default()
            })),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejection_becomes_status_reason_and_openai_error() {
        let r = Refusal::from(&Rejection::TooManyRequests("pool saturated".into()));
        let ProcessingResponse {
            response: Some(Response::ImmediateResponse(ir)),
            ..
        } = r.into_response(Some("rid"))
        else {
            panic!("not an immediate response");
        };
        assert_eq!(ir.status.map(|s| s.code), Some(429));
        let set: Vec<_> = ir
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|o| {
                let h = o.header.unwrap();
                (h.key, String::from_utf8(h.raw_value).unwrap())
            })
            .collect();
        assert!(set.contains(&("x-kvgate-drop-reason".into(), "too-many-requests".into())));
        assert!(set.contains(&("x-request-id".into(), "rid".into())));
        let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
        assert_eq!(body["error"]["message"], "pool saturated");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["code"], "too-many-requests");
        assert_eq!(ir.details, "kvgate_too_many_requests");
    }

    #[test]
    fn statuses_follow_the_protocol() {
        let cases = [
            (Rejection::BadRequest(String::new()), 400),
            (Rejection::PayloadTooLarge(String::new()), 413),
            (Rejection::TooManyRequests(String::new()), 429),
            (Rejection::Unavailable(String::new()), 503),
        ];
        for (r, status) in cases {
            assert_eq!(Refusal::from(&r).status, status);
        }
    }
}
