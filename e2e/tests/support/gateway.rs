//! A blocking HTTP/1.1 client for requests through the local stack's Envoy that tolerates a
//! response cut short (a stream whose engine died) and sends extra headers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// What came back; `complete` is false when the connection failed or the body was cut short.
#[derive(Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub complete: bool,
}

/// Shows the head and at most 300 bytes of each end of the body.
impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = &self.body;
        let body = if b.len() > 600 {
            let head: String = b.chars().take(300).collect();
            let tail: String = b
                .chars()
                .rev()
                .take(300)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            format!("{head} … ({} bytes) … {tail}", b.len())
        } else {
            b.clone()
        };
        f.debug_struct("Reply")
            .field("status", &self.status)
            .field("complete", &self.complete)
            .field("headers", &self.headers)
            .field("body", &body)
            .finish()
    }
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// `x-kvgate-pod` (the engine that answered).
    pub fn pod(&self) -> &str {
        self.header("x-kvgate-pod").unwrap_or("")
    }

    /// `x-kvgate-dp-rank` (the data-parallel rank that answered).
    pub fn dp_rank(&self) -> &str {
        self.header("x-kvgate-dp-rank").unwrap_or("")
    }

    /// `x-kvgate-upstream` (the host Envoy sent to).
    pub fn upstream(&self) -> &str {
        self.header("x-kvgate-upstream").unwrap_or("")
    }

    /// `x-kvgate-picked`: the EPP's ordered list.
    pub fn picked(&self) -> Vec<String> {
        self.header("x-kvgate-picked")
            .unwrap_or("")
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// A 200 with a whole body (for streams: ending in `[DONE]`).
    pub fn ok(&self) -> bool {
        self.status == 200 && self.complete
    }

    /// `usage.prompt_tokens_details.cached_tokens` of a non-streamed chat answer.
    pub fn cached_tokens(&self) -> u64 {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    }
}

/// POSTs the JSON `body` to `path` on `127.0.0.1:port` with extra `headers`.
pub fn post(port: u16, path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Reply {
    post_bytes(port, path, headers, body.to_string().as_bytes())
}

/// POSTs raw `body` bytes.
pub fn post_bytes(port: u16, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    request(port, "POST", path, headers, body)
}

/// GETs `path`.
pub fn get(port: u16, path: &str) -> Reply {
    request(port, "GET", path, &[], &[])
}

fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let failed = Reply {
        status: 0,
        headers: vec![],
        body: String::new(),
        complete: false,
    };
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return failed;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    if s.write_all(head.as_bytes())
        .and_then(|()| s.write_all(body))
        .is_err()
    {
        return failed;
    }
    let mut raw = Vec::new();
    let read_ok = s.read_to_end(&mut raw).is_ok();
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return failed;
    };
    let text = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = text.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let (body, whole) = if chunked {
        dechunk(rest)
    } else {
        let want = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok());
        (rest.to_vec(), want.is_none_or(|n| n == rest.len()))
    };
    let body = String::from_utf8_lossy(&body).into_owned();
    let streamed = headers
        .iter()
        .any(|(k, v)| k == "content-type" && v.contains("text/event-stream"));
    let complete = read_ok && whole && (!streamed || body.contains("data: [DONE]"));
    Reply {
        status,
        headers,
        body,
        complete,
    }
}

/// The decoded body and whether the terminating chunk arrived.
fn dechunk(mut raw: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return (out, false);
        };
        let Some(size) = std::str::from_utf8(&raw[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
        else {
            return (out, false);
        };
        if size == 0 {
            return (out, true);
        }
        let Some(chunk) = raw.get(eol + 2..eol + 2 + size) else {
            out.extend_from_slice(&raw[eol + 2..]);
            return (out, false);
        };
        out.extend_from_slice(chunk);
        raw = raw.get(eol + 2 + size + 2..).unwrap_or_default();
    }
}

/// A chat request of `max_tokens` tokens over `system` + `user`.
pub fn chat(system: &str, user: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": stream,
    })
}
