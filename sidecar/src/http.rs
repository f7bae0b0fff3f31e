//! A minimal async HTTP/1.1 `GET` for the engine's `/metrics` on loopback: one request per
//! connection, `Content-Length`, chunked or close-delimited bodies, bounded size and time.

use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Connecting, writing or reading failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The response did not arrive in time.
    #[error("timed out")]
    Timeout,
    /// The response is larger than allowed.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// Not a well-formed HTTP/1.x response.
    #[error("malformed HTTP response: {0}")]
    Malformed(&'static str),
    /// A status other than 200.
    #[error("HTTP status {0}")]
    Status(u16),
}

/// An `http://host:port[/prefix]` base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// `host:port`.
    pub authority: String,
    /// Path prefix without a trailing slash (may be empty).
    pub prefix: String,
}

impl BaseUrl {
    /// Parses a base URL; only plain `http://` is accepted (the engine is on loopback).
    pub fn parse(url: &str) -> Result<Self, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("engine URL {url:?} must start with http://"))?;
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        if authority.is_empty() || !authority.contains(':') {
            return Err(format!("engine URL {url:?} must name host:port"));
        }
        let prefix = path.trim_end_matches('/');
        Ok(Self {
            authority: authority.to_owned(),
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("/{prefix}")
            },
        })
    }
}

/// Fetches `path` under `base` within `timeout`, returning the body of a 200 response of at
/// most `max_body` bytes.
pub async fn get(
    base: &BaseUrl,
    path: &str,
    timeout: Duration,
    max_body: usize,
) -> Result<Vec<u8>, FetchError> {
    tokio::time::timeout(timeout, get_inner(base, path, max_body))
        .await
        .map_err(|_| FetchError::Timeout)?
}

async fn get_inner(base: &BaseUrl, path: &str, max_body: usize) -> Result<Vec<u8>, FetchError> {
    let mut stream = TcpStream::connect(&base.authority).await?;
    stream.set_nodelay(true)?;
    let request = format!(
        "GET {}{path} HTTP/1.1\r\nHost: {}\r\nAccept: text/plain\r\nUser-Agent: kvgate-sidecar\r\nConnection: close\r\n\r\n",
        base.prefix, base.authority
    );
    stream.write_all(request.as_bytes()).await?;
    let limit = max_body + 16 * 1024;
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if buf.len() > limit {
            return Err(FetchError::TooLarge(max_body));
        }
        if let Some(body) = complete(&buf)? {
            return check(body, max_body);
        }
    }
    let (head, body) = split_head(&buf).ok_or(FetchError::Malformed("no header end"))?;
    let head = Head::parse(head)?;
    if head.status != 200 {
        return Err(FetchError::Status(head.status));
    }
    let body = match head.framing {
        Framing::Length(n) => body
            .get(..n)
            .ok_or(FetchError::Malformed("short body"))?
            .to_vec(),
        Framing::Chunked => {
            dechunk(body)?.ok_or(FetchError::Malformed("truncated chunked body"))?
        }
        Framing::Close => body.to_vec(),
    };
    check(body, max_body)
}

fn check(body: Vec<u8>, max_body: usize) -> Result<Vec<u8>, FetchError> {
    if body.len() > max_body {
        Err(FetchError::TooLarge(max_body))
    } else {
        Ok(body)
    }
}

/// The body once the response is complete (for length-framed and chunked responses).
fn complete(buf: &[u8]) -> Result<Option<Vec<u8>>, FetchError> {
    let Some((head, body)) = split_head(buf) else {
        return Ok(None);
    };
    let head = Head::parse(head)?;
    if head.status != 200 {
        return Err(FetchError::Status(head.status));
    }
    match head.framing {
        Framing::Length(n) => Ok(body.get(..n).map(<[u8]>::to_vec)),
        Framing::Chunked => dechunk(body),
        Framing::Close => Ok(None),
    }
}

fn split_head(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    Some((buf.get(..at)?, buf.get(at + 4..)?))
}

enum Framing {
    Length(usize),
    Chunked,
    Close,
}

struct Head {
    status: u16,
    framing: Framing,
}

impl Head {
    fn parse(head: &[u8]) -> Result<Self, FetchError> {
        let text =
            std::str::from_utf8(head).map_err(|_| FetchError::Malformed("head not UTF-8"))?;
        let mut lines = text.split("\r\n");
        let status_line = lines
            .next()
            .ok_or(FetchError::Malformed("no status line"))?;
        let mut parts = status_line.split(' ');
        if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
            return Err(FetchError::Malformed("not HTTP/1.x"));
        }
        let status = parts
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or(FetchError::Malformed("bad status"))?;
        let mut framing = Framing::Close;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                let n = value
                    .parse()
                    .map_err(|_| FetchError::Malformed("bad content-length"))?;
                framing = Framing::Length(n);
            } else if name.eq_ignore_ascii_case("transfer-encoding")
                && value.to_ascii_lowercase().contains("chunked")
            {
                framing = Framing::Chunked;
                break;
            }
        }
        Ok(Self { status, framing })
    }
}

/// Decodes a chunked body; `None` while incomplete.
fn dechunk(mut rest: &[u8]) -> Result<Option<Vec<u8>>, FetchError> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let size_line = std::str::from_utf8(rest.get(..eol).unwrap_or_default())
            .map_err(|_| FetchError::Malformed("chunk size"))?;
        let size_hex = size_line.split(';').next().unwrap_or("").trim();
        let size =
            usize::from_str_radix(size_hex, 16).map_err(|_| FetchError::Malformed("chunk size"))?;
        let data_start = eol + 2;
        if size == 0 {
            return Ok(Some(out));
        }
        let Some(data) = rest.get(data_start..data_start + size) else {
            return Ok(None);
        };
        out.extend_from_slice(data);
        let Some(after) = rest.get(data_start + size + 2..) else {
            return Ok(None);
        };
        rest = after;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_base_urls() {
        let b = BaseUrl::parse("http://127.0.0.1:8200").unwrap();
        assert_eq!(
            (b.authority.as_str(), b.prefix.as_str()),
            ("127.0.0.1:8200", "")
        );
        let b = BaseUrl::parse("http://h:1/x/").unwrap();
        assert_eq!(b.prefix, "/x");
        assert!(BaseUrl::parse("https://h:1").is_err());
        assert!(BaseUrl::parse("http://h").is_err());
    }

    #[test]
    fn frames_length_chunked_and_errors() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc";
        assert_eq!(complete(r).unwrap().unwrap(), b"abc");
        let r =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n";
        assert_eq!(complete(r).unwrap().unwrap(), b"abc");
        let partial = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\na";
        assert!(complete(partial).unwrap().is_none());
        assert!(matches!(
            complete(b"HTTP/1.1 503 X\r\n\r\n"),
            Err(FetchError::Status(503))
        ));
        assert!(complete(b"SPDY 200\r\n\r\n").is_err());
    }

    #[tokio::test]
    async fn fetches_from_a_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await.unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\n\r\nvllm:num_requests_running 3\n")
                .await
                .unwrap();
        });
        let base = BaseUrl::parse(&format!("http://{addr}")).unwrap();
        let body = get(&base, "/metrics", Duration::from_secs(2), 1024)
            .await
            .unwrap();
        assert_eq!(body, b"vllm:num_requests_running 3\n");
    }
}
