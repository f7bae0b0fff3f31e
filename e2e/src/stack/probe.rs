//! Readiness probes: a TCP connect and a bounded blocking HTTP/1.1 GET on loopback, and a
//! reader for one sample of a Prometheus page.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Largest response a probe reads.
pub const MAX_PROBE_BYTES: u64 = 4 << 20;

/// Whether something accepts TCP connections on `127.0.0.1:port`.
pub fn tcp_open(port: u16, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), timeout).is_ok()
}

/// `GET path` on `127.0.0.1:port`: the status and the body (at most [`MAX_PROBE_BYTES`]).
pub fn http_get(port: u16, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    http_request(port, "GET", path, timeout)
}

/// `method path` with an empty body on `127.0.0.1:port`: the status and the body (at most
/// [`MAX_PROBE_BYTES`]).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    http_request_at(
        SocketAddr::from(([127, 0, 0, 1], port)),
        method,
        path,
        timeout,
    )
}

/// [`http_request`] to any address (a pod's loopback address in the Kubernetes stack).
pub fn http_request_at(
    addr: SocketAddr,
    method: &str,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        addr.ip()
    )?;
    let mut raw = Vec::new();
    s.take(MAX_PROBE_BYTES).read_to_end(&mut raw)?;
    parse_response(&raw).ok_or_else(|| std::io::Error::other("malformed HTTP response"))
}

/// Status and body of a raw `connection: close` response (chunked bodies are decoded).
fn parse_response(raw: &[u8]) -> Option<(u16, String)> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(raw.get(..split)?);
    let body = raw.get(split + 4..)?;
    let mut lines = head.lines();
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")
        })
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(raw.get(..eol)?).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(eol + 2..eol + 2 + size)?);
        raw = raw.get(eol + 2 + size + 2..)?;
    }
}

/// The sum of every sample of metric `name` (any labels) in a Prometheus text page, or `None`
/// when it has none.
pub fn metric_sum(page: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if key.split('{').next() == Some(name)
            && let Ok(v) = value.parse::<f64>()
        {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

/// The value of one series, `name{labels}` as the page writes it (labels in its order), in a
/// Prometheus text page, or `None` when the page has no such series.
pub fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
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
    fn parses_plain_and_chunked_responses() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        assert_eq!(parse_response(plain), Some((200, "ok".into())));
        let chunked = b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Some((503, "abcde".into())));
        assert_eq!(parse_response(b"garbage"), None);
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"),
            None
        );
    }

    #[test]
    fn metric_sum_adds_labelled_samples_and_skips_comments() {
        let page = "# HELP a x\n# TYPE a counter\na{x=\"1\"} 2\na{x=\"2\"} 3.5\nab 7\nb 1\n";
        assert_eq!(metric_sum(page, "a"), Some(5.5));
        assert_eq!(metric_sum(page, "ab"), Some(7.0));
        assert_eq!(metric_sum(page, "c"), None);
    }

    #[test]
    fn sample_reads_one_series_exactly() {
        let page = "# TYPE a counter\na{x=\"1\"} 2\na{x=\"12\"} 3.5\nab 7\n";
        assert_eq!(sample(page, "a{x=\"1\"}"), Some(2.0));
        assert_eq!(sample(page, "a{x=\"12\"}"), Some(3.5));
        assert_eq!(
            sample(page, "a"),
            None,
            "a series is named whole, labels included"
        );
        assert_eq!(sample(page, "ab"), Some(7.0));
    }

    #[test]
    fn closed_ports_are_not_open() {
        // Bound but not listening: refused, and the port stays ours while the test runs.
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = held.local_addr().unwrap().port();
        assert!(!tcp_open(port, Duration::from_millis(200)));
        assert!(http_get(port, "/", Duration::from_millis(200)).is_err());
    }
}
