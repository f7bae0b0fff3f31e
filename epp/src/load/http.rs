//! A minimal blocking HTTP/1.1 `GET` for metrics endpoints: one request per connection,
//! `Content-Length`, chunked or close-delimited bodies, bounded size and time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use engine_metrics::MAX_EXPOSITION;

/// Largest response head accepted.
const MAX_HEAD: usize = 16 * 1024;

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Connecting, writing or reading failed (timeouts included).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The whole response did not arrive within the time allowed.
    #[error("response incomplete after the deadline")]
    Deadline,
    /// The response or its body is larger than allowed.
    #[error("response too large")]
    TooLarge,
    /// The response is not well-formed HTTP/1.x.
    #[error("malformed HTTP response: {0}")]
    Malformed(&'static str),
    /// The server answered with a status other than 200.
    #[error("HTTP status {0}")]
    Status(u16),
}

/// Fetches `path` from `addr`, connecting within `connect_timeout` and receiving the whole
/// response within `read_timeout`; returns the (de-chunked) body of a 200 response.
pub(super) fn get(
    addr: SocketAddr,
    path: &str,
    connect_timeout: Duration,
    read_timeout: Duration,
) -> Result<Vec<u8>, FetchError> {
    let mut stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
    let deadline = Instant::now() + read_timeout;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(read_timeout))?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain\r\nUser-Agent: kvgate-epp\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes())?;

    let mut buf = Vec::with_capacity(64 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    let mut head: Option<Head> = None;
    loop {
        if head.is_none() {
            head = parse_head(&buf)?;
        }
        if let Some(h) = &head {
            let body = buf.get(h.len..).unwrap_or_default();
            if let Some(done) = h.complete_body(body)? {
                return Ok(done);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(FetchError::Deadline);
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut chunk) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(FetchError::Deadline);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            // The server closed: only a close-delimited body is complete now.
            return match head {
                Some(Head {
                    len,
                    framing: Framing::Close,
                }) => Ok(buf.get(len..).unwrap_or_default().to_vec()),
                Some(_) => Err(FetchError::Malformed("connection closed mid-body")),
                None => Err(FetchError::Malformed("connection closed mid-head")),
            };
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if buf.len() > MAX_HEAD + MAX_EXPOSITION + 64 * 1024 {
            return Err(FetchError::TooLarge);
        }
    }
}

/// How the body's end is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
    Close,
}

/// A parsed 200 response head.
#[derive(Debug, Clone, Copy)]
struct Head {
    /// Bytes of the head, blank line included.
    len: usize,
    framing: Framing,
}

impl Head {
    /// The body if `body` (what followed the head so far) holds all of it.
    fn complete_body(&self, body: &[u8]) -> Result<Option<Vec<u8>>, FetchError> {
        match self.framing {
            Framing::Length(n) => Ok(body.get(..n).map(<[u8]>::to_vec)),
            Framing::Chunked => dechunk(body),
            Framing::Close => {
                if body.len() > MAX_EXPOSITION {
                    Err(FetchError::TooLarge)
                } else {
                    Ok(None)
                }
            }
        }
    }
}

/// Parses the response head once `buf` holds all of it.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, FetchError> {
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Err(FetchError::TooLarge)
        } else {
            Ok(None)
        };
    };
    let text = std::str::from_utf8(buf.get(..end).unwrap_or_default())
        .map_err(|_| FetchError::Malformed("head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(FetchError::Malformed("not an HTTP/1.x status line"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or(FetchError::Malformed("bad status code"))?;
    if status != 200 {
        return Err(FetchError::Status(status));
    }
    let mut framing = Framing::Close;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(FetchError::Malformed("bad header line"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            if value
                .rsplit(',')
                .next()
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("chunked"))
            {
                framing = Framing::Chunked;
            }
        } else if name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let n: usize = value
                .parse()
                .map_err(|_| FetchError::Malformed("bad Content-Length"))?;
            if n > MAX_EXPOSITION {
                return Err(FetchError::TooLarge);
            }
            framing = Framing::Length(n);
        }
    }
    Ok(Some(Head {
        len: end + 4,
        framing,
    }))
}

/// Decodes a chunked body; `None` while more bytes are needed.
fn dechunk(mut body: &[u8]) -> Result<Option<Vec<u8>>, FetchError> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = find(body, b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(body.get(..eol).unwrap_or_default())
            .map_err(|_| FetchError::Malformed("bad chunk size"))?;
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| FetchError::Malformed("bad chunk size"))?;
        body = body.get(eol + 2..).unwrap_or_default();
        if size == 0 {
            // Trailers, then a blank line.
            loop {
                let Some(eol) = find(body, b"\r\n") else {
                    return Ok(None);
                };
                if eol == 0 {
                    return Ok(Some(out));
                }
                body = body.get(eol + 2..).unwrap_or_default();
            }
        }
        if out.len().saturating_add(size) > MAX_EXPOSITION {
            return Err(FetchError::TooLarge);
        }
        let Some(data) = body.get(..size) else {
            return Ok(None);
        };
        match body.get(size..size + 2) {
            None => return Ok(None),
            Some(b"\r\n") => {}
            Some(_) => return Err(FetchError::Malformed("chunk not followed by CRLF")),
        }
        out.extend_from_slice(data);
        body = body.get(size + 2..).unwrap_or_default();
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunks_across_partial_input() {
        let full = b"4;ext=1\r\nabcd\r\n3\r\nefg\r\n0\r\nX-Trailer: 1\r\n\r\n";
        for cut in 0..full.len() {
            assert_eq!(dechunk(&full[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(dechunk(full).unwrap().as_deref(), Some(&b"abcdefg"[..]));
        assert!(dechunk(b"zz\r\n").is_err());
        assert!(dechunk(b"2\r\nabXX").is_err());
    }

    #[test]
    fn reads_the_head() {
        let h = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            .unwrap()
            .unwrap();
        assert_eq!((h.len, h.framing), (38, Framing::Length(5)));
        let h = parse_head(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        assert!(parse_head(b"HTTP/1.1 200 OK\r\n").unwrap().is_none());
        assert!(matches!(
            parse_head(b"HTTP/1.1 503 Unavailable\r\n\r\n"),
            Err(FetchError::Status(503))
        ));
    }
}
