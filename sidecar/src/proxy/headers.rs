//! Header handling at the proxy's edges: hop-by-hop headers (RFC 9110 §7.6.1) are not
//! forwarded in either direction, nor is the P/D control header; the prefiller named by
//! `x-prefiller-host-port` is parsed as an `ip:port`.

use std::net::SocketAddr;

use axum::http::{HeaderMap, HeaderName, header};

/// The header the EPP sets to ask for a remote prefill (llm-d's name).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// Hop-by-hop headers, always removed.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers, those the `Connection` header names, and `Upgrade`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
}

/// What the request asks of the P/D flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prefiller {
    /// No header: a plain local request.
    None,
    /// A well-formed `ip:port`.
    At(SocketAddr),
    /// A header that is not an `ip:port` (the raw value, lossy).
    Malformed(String),
}

/// Reads `x-prefiller-host-port`. Only the first value counts; an empty value means none.
pub fn prefiller(headers: &HeaderMap) -> Prefiller {
    let Some(value) = headers.get(PREFILLER_HEADER) else {
        return Prefiller::None;
    };
    let text = String::from_utf8_lossy(value.as_bytes());
    // llm-d sends one address; tolerate a list by taking its first entry.
    let first = text.split(',').next().unwrap_or("").trim();
    if first.is_empty() {
        return Prefiller::None;
    }
    match first.parse::<SocketAddr>() {
        Ok(addr) => Prefiller::At(addr),
        Err(_) => Prefiller::Malformed(text.chars().take(128).collect()),
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
    use axum::http::HeaderValue;

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        strip_hop_by_hop(&mut h);
        let left: Vec<_> = h.keys().map(|k| k.as_str().to_owned()).collect();
        assert_eq!(left, vec!["content-type", "x-request-id"]);
    }

    #[test]
    fn prefiller_header_forms() {
        let mut h = HeaderMap::new();
        assert_eq!(prefiller(&h), Prefiller::None);
        h.insert(PREFILLER_HEADER, HeaderValue::from_static("10.0.0.7:8000"));
        assert_eq!(
            prefiller(&h),
            Prefiller::At("10.0.0.7:8000".parse().unwrap())
        );
        h.insert(
            PREFILLER_HEADER,
            HeaderValue::from_static("[::1]:8000, 10.0.0.8:8000"),
        );
        assert_eq!(prefiller(&h), Prefiller::At("[::1]:8000".parse().unwrap()));
        h.insert(
            PREFILLER_HEADER,
            HeaderValue::from_static("evil.example.com:80"),
        );
        assert!(matches!(prefiller(&h), Prefiller::Malformed(_)));
        h.insert(PREFILLER_HEADER, HeaderValue::from_static("10.0.0.7"));
        assert!(matches!(prefiller(&h), Prefiller::Malformed(_)));
        h.insert(PREFILLER_HEADER, HeaderValue::from_static(" "));
        assert_eq!(prefiller(&h), Prefiller::None);
    }
}
