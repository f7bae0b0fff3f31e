//! Reading Envoy's header maps and writing header mutations.

use std::hash::{BuildHasher as _, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::HeaderMutation;

use super::{
    DESTINATION_ENDPOINT_HEADER, REQUEST_ID_HEADER, SERVED_ENDPOINT_HEADER, SUBSET_HEADER,
};

/// Control headers a client must not send upstream: the EPP's inputs (read, then stripped) and its
/// outputs (only the EPP sets them). GIE's "system-owned" headers
/// (`pkg/epp/util/request/headers.go`), llm-d's spelling of the objective header, plus the P/D
/// prefill target, which a model-server sidecar trusts.
const CONTROL_HEADERS: &[&str] = &[
    DESTINATION_ENDPOINT_HEADER,
    SERVED_ENDPOINT_HEADER,
    SUBSET_HEADER,
    "x-gateway-inference-fairness-id",
    "x-gateway-inference-objective",
    "x-gateway-model-name-rewrite",
    "x-llm-d-inference-fairness-id",
    "x-llm-d-inference-objective",
    "x-llm-d-model-name-rewrite",
    "x-prefiller-host-port",
];

/// Prefix of kvgate's own headers, never accepted from clients.
const KVGATE_PREFIX: &str = "x-kvgate-";

/// Whether a client-sent header must be removed before forwarding.
pub(super) fn is_control_header(name: &str) -> bool {
    name.starts_with(KVGATE_PREFIX) || CONTROL_HEADERS.contains(&name)
}

/// A header's value: Envoy sends `raw_value` bytes (newer) or `value` (older).
pub(super) fn value_of(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// The value of the first header named `name` (lower-case) in `map`.
pub(super) fn find<'a>(map: &'a Option<HeaderMap>, name: &str) -> Option<&'a HeaderValue> {
    map.as_ref()?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
}

/// The request as its headers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RequestHead {
    pub(super) method: String,
    pub(super) path: String,
    /// Regular headers, lower-case names, including an injected `x-request-id`.
    pub(super) headers: Vec<(String, String)>,
    pub(super) content_length: Option<usize>,
    pub(super) request_id: String,
    /// The request id was generated here and must be injected upstream.
    pub(super) request_id_generated: bool,
    /// Control headers the client sent, to remove (deduplicated, lower-case).
    pub(super) strip: Vec<String>,
}

impl RequestHead {
    pub(super) fn parse(map: &Option<HeaderMap>) -> Self {
        let mut head = Self {
            method: String::new(),
            path: String::new(),
            headers: Vec::new(),
            content_length: None,
            request_id: String::new(),
            request_id_generated: false,
            strip: Vec::new(),
        };
        for h in map.iter().flat_map(|m| m.headers.iter()) {
            let name = h.key.to_ascii_lowercase();
            let value = value_of(h);
            match name.as_str() {
                ":method" => head.method = value,
                ":path" => head.path = value,
                n if n.starts_with(':') => {}
                n => {
                    if n == "content-length" {
                        head.content_length = value.trim().parse().ok();
                    }
                    if n == REQUEST_ID_HEADER && head.request_id.is_empty() {
                        head.request_id = value.clone();
                    }
                    if is_control_header(n) && !head.strip.iter().any(|s| s == n) {
                        head.strip.push(name.clone());
                    }
                    head.headers.push((name, value));
                }
            }
        }
        if head.request_id.trim().is_empty() {
            head.request_id = new_request_id();
            head.request_id_generated = true;
            head.headers.retain(|(n, _)| n != REQUEST_ID_HEADER);
            head.headers
                .push((REQUEST_ID_HEADER.to_owned(), head.request_id.clone()));
        }
        head
    }
}

/// A header to set, replacing any value already there.
pub(super) fn set(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A mutation that sets `set_headers` and removes `remove` — except names also set, since Envoy
/// would otherwise drop what we set.
pub(super) fn mutation(set_headers: Vec<HeaderValueOption>, remove: &[String]) -> HeaderMutation {
    let is_set = |name: &str| {
        set_headers
            .iter()
            .any(|o| o.header.as_ref().is_some_and(|h| h.key == name))
    };
    let remove_headers = remove.iter().filter(|n| !is_set(n)).cloned().collect();
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// A fresh request id in UUID v4 layout, from the process's random hasher keys and a counter.
pub(super) fn new_request_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let state = RandomState::new();
    let hi = state.hash_one((n, 0u8));
    let lo = state.hash_one((n, 1u8));
    let hi = (hi & 0xffff_ffff_ffff_0fff) | 0x0000_0000_0000_4000;
    let lo = (lo & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000;
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xffff,
        lo >> 48,
        lo & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
        Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        })
    }

    #[test]
    fn parses_pseudo_headers_and_collects_control_headers() {
        let head = RequestHead::parse(&map(&[
            (":method", "POST"),
            (":path", "/v1/completions"),
            (":authority", "gw"),
            ("Content-Length", "12"),
            ("x-request-id", "abc"),
            ("x-gateway-destination-endpoint", "6.6.6.6:1"),
            ("X-Kvgate-Anything", "1"),
            ("x-prefiller-host-port", "6.6.6.6:2"),
        ]));
        assert_eq!(
            (head.method.as_str(), head.path.as_str()),
            ("POST", "/v1/completions")
        );
        assert_eq!(head.content_length, Some(12));
        assert_eq!(head.request_id, "abc");
        assert!(!head.request_id_generated);
        assert!(head.headers.iter().all(|(n, _)| !n.starts_with(':')));
        assert_eq!(
            head.strip,
            [
                "x-gateway-destination-endpoint",
                "x-kvgate-anything",
                "x-prefiller-host-port"
            ]
        );
    }

    #[test]
    fn value_falls_back_to_the_string_field() {
        let h = HeaderValue {
            key: "a".into(),
            value: "old".into(),
            ..Default::default()
        };
        assert_eq!(value_of(&h), "old");
    }

    #[test]
    fn missing_request_id_is_generated_and_added() {
        let head = RequestHead::parse(&map(&[(":method", "GET"), ("x-request-id", " ")]));
        assert!(head.request_id_generated);
        assert_eq!(head.request_id.len(), 36);
        assert_eq!(head.request_id.as_bytes()[14], b'4');
        let ids: Vec<_> = head
            .headers
            .iter()
            .filter(|(n, _)| n == "x-request-id")
            .collect();
        assert_eq!(ids.len(), 1);
        assert_eq!(ids[0].1, head.request_id);
        assert_ne!(new_request_id(), new_request_id());
    }

    #[test]
    fn removal_never_cancels_a_set_header() {
        let m = mutation(
            vec![set("x-gateway-destination-endpoint", "1.1.1.1:80")],
            &["x-gateway-destination-endpoint".into(), "x-kvgate-x".into()],
        );
        assert_eq!(m.remove_headers, ["x-kvgate-x"]);
        assert_eq!(m.set_headers.len(), 1);
    }
}
