//! Token usage read from response bodies, in bounded memory.
//!
//! Server-sent events (`text/event-stream`) are scanned line by line: every `data: {…}` line that
//! mentions `"usage"` is parsed, lines longer than the line limit are skipped. JSON bodies keep only
//! their tail; at the end the whole body is parsed when it fitted, else the last `"usage":` object
//! of the tail (OpenAI-compatible servers put `usage` last).

use serde::Deserialize;

/// Usage as OpenAI-compatible servers report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Usage {
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
    pub(super) cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<WireDetails>,
}

#[derive(Deserialize)]
struct WireDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<WireUsage>,
}

impl From<WireUsage> for Usage {
    fn from(w: WireUsage) -> Self {
        Self {
            prompt_tokens: w.prompt_tokens,
            completion_tokens: w.completion_tokens,
            cached_tokens: w.prompt_tokens_details.and_then(|d| d.cached_tokens),
        }
    }
}

/// Limits of the scanner's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    /// Longest SSE line kept.
    pub(super) line: usize,
    /// Bytes of a JSON body's tail kept.
    pub(super) tail: usize,
}

/// How the body is scanned, decided from the response headers.
#[derive(Debug)]
pub(super) enum UsageScanner {
    /// Not a format we read (or compressed).
    Off,
    /// `text/event-stream`: the current partial line.
    Sse {
        line: Vec<u8>,
        overflow: bool,
        limit: usize,
    },
    /// JSON: the last `limit` bytes, and whether anything was dropped before them.
    Json {
        tail: Vec<u8>,
        truncated: bool,
        limit: usize,
    },
}

impl UsageScanner {
    pub(super) fn for_response(
        content_type: Option<&str>,
        content_encoding: Option<&str>,
        limits: Limits,
    ) -> Self {
        let encoded = content_encoding
            .map(str::trim)
            .is_some_and(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity"));
        let media = content_type
            .and_then(|c| c.split(';').next())
            .map(|m| m.trim().to_ascii_lowercase());
        match media.as_deref() {
            _ if encoded => Self::Off,
            Some("text/event-stream") => Self::Sse {
                line: Vec::new(),
                overflow: false,
                limit: limits.line,
            },
            Some("application/json") => Self::Json {
                tail: Vec::new(),
                truncated: false,
                limit: limits.tail,
            },
            _ => Self::Off,
        }
    }

    /// Feeds a body chunk; returns the last usage completed in it.
    pub(super) fn feed(&mut self, chunk: &[u8]) -> Option<Usage> {
        match self {
            Self::Off => None,
            Self::Sse {
                line,
                overflow,
                limit,
            } => {
                let mut found = None;
                let mut rest = chunk;
                while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
                    let (head, tail) = rest.split_at(pos);
                    if !*overflow && line.len() + head.len() <= *limit {
                        line.extend_from_slice(head);
                        found = sse_line(line).or(found);
                    }
                    line.clear();
                    *overflow = false;
                    rest = tail.get(1..).unwrap_or_default();
                }
                if !*overflow {
                    if line.len() + rest.len() <= *limit {
                        line.extend_from_slice(rest);
                    } else {
                        line.clear();
                        *overflow = true;
                    }
                }
                found
            }
            Self::Json {
                tail,
                truncated,
                limit,
            } => {
                tail.extend_from_slice(chunk);
                if tail.len() > 2 * *limit {
                    let cut = tail.len() - *limit;
                    tail.drain(..cut);
                    *truncated = true;
                }
                None
            }
        }
    }

    /// The body ended: usage from what is left (a final SSE line without newline, a JSON body).
    pub(super) fn finish(&mut self) -> Option<Usage> {
        match std::mem::replace(self, Self::Off) {
            Self::Off => None,
            Self::Sse { line, overflow, .. } => (!overflow).then(|| sse_line(&line)).flatten(),
            Self::Json {
                tail, truncated, ..
            } => {
                if !truncated && let Ok(w) = serde_json::from_slice::<WithUsage>(&tail) {
                    return w.usage.map(Usage::from);
                }
                last_usage_object(&tail)
            }
        }
    }
}

/// One SSE line: `data: {...}` with a non-null `usage`.
fn sse_line(line: &[u8]) -> Option<Usage> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let data = line.strip_prefix(b"data:")?.trim_ascii_start();
    if !data.starts_with(b"{") || find(data, b"\"usage\"").is_none() {
        return None;
    }
    serde_json::from_slice::<WithUsage>(data)
        .ok()?
        .usage
        .map(Usage::from)
}

/// The object after the last `"usage":` key in a JSON fragment.
fn last_usage_object(fragment: &[u8]) -> Option<Usage> {
    let key = b"\"usage\"";
    let at = rfind(fragment, key)?;
    let rest = fragment.get(at + key.len()..)?.trim_ascii_start();
    let rest = rest.strip_prefix(b":")?.trim_ascii_start();
    let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<Option<WireUsage>>();
    values.next()?.ok()?.map(Usage::from)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn rfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        line: 1024,
        tail: 256,
    };

    fn sse() -> UsageScanner {
        UsageScanner::for_response(Some("text/event-stream; charset=utf-8"), None, LIMITS)
    }

    fn json() -> UsageScanner {
        UsageScanner::for_response(Some("application/json"), None, LIMITS)
    }

    const FINAL: &str = r#"data: {"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":8}}}"#;

    #[test]
    fn sse_usage_found_across_any_split() {
        let stream = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"hi\"}}}}],\"usage\":null}}\n\n{FINAL}\n\ndata: [DONE]\n\n"
        );
        let want = Usage {
            prompt_tokens: 12,
            completion_tokens: 3,
            cached_tokens: Some(8),
        };
        for split in 0..stream.len() {
            let mut s = sse();
            let (a, b) = stream.as_bytes().split_at(split);
            let got = [s.feed(a), s.feed(b), s.finish()];
            let got: Vec<_> = got.into_iter().flatten().collect();
            assert_eq!(got, [want], "split at {split}");
        }
    }

    #[test]
    fn sse_final_line_without_newline_and_crlf() {
        let mut s = sse();
        assert_eq!(
            s.feed(b"data: {\"usage\":{\"prompt_tokens\":1}}\r\n"),
            Some(Usage {
                prompt_tokens: 1,
                completion_tokens: 0,
                cached_tokens: None
            })
        );
        assert_eq!(
            s.feed(b"data:{\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":5}}"),
            None
        );
        assert_eq!(s.finish().map(|u| u.prompt_tokens), Some(2));
    }

    #[test]
    fn sse_overlong_lines_are_skipped_not_buffered() {
        let mut s = sse();
        let long = format!(
            "data: {{\"usage\":{{\"prompt_tokens\":9}},\"pad\":\"{}\"}}",
            "x".repeat(5000)
        );
        for piece in long.as_bytes().chunks(100) {
            assert_eq!(s.feed(piece), None);
            if let UsageScanner::Sse { line, .. } = &s {
                assert!(line.len() <= LIMITS.line);
            }
        }
        assert_eq!(s.feed(b"\n"), None);
        assert_eq!(
            s.feed(b"data: {\"usage\":{\"prompt_tokens\":4}}\n")
                .map(|u| u.prompt_tokens),
            Some(4)
        );
    }

    #[test]
    fn json_small_body_is_parsed_whole() {
        let mut s = json();
        let body = br#"{"id":"x","choices":[{"text":"\"usage\": {\"prompt_tokens\": 99}"}],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#;
        for piece in body.chunks(7) {
            assert_eq!(s.feed(piece), None);
        }
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 2,
                cached_tokens: None
            })
        );
    }

    #[test]
    fn json_large_body_keeps_a_bounded_tail() {
        let mut s = json();
        let body = format!(
            r#"{{"choices":[{{"text":"{}"}}],"usage": {{"prompt_tokens":70000,"completion_tokens":20,"prompt_tokens_details":null}}}}"#,
            "y".repeat(100_000)
        );
        for piece in body.as_bytes().chunks(1000) {
            s.feed(piece);
            if let UsageScanner::Json { tail, .. } = &s {
                assert!(tail.len() <= 2 * LIMITS.tail + 1000);
            }
        }
        assert_eq!(
            s.finish().map(|u| (u.prompt_tokens, u.completion_tokens)),
            Some((70000, 20))
        );
    }

    #[test]
    fn json_without_usage_and_other_types_report_nothing() {
        let mut s = json();
        s.feed(br#"{"usage":null}"#);
        assert_eq!(s.finish(), None);
        let mut s = UsageScanner::for_response(Some("text/plain"), None, LIMITS);
        assert_eq!(s.feed(FINAL.as_bytes()), None);
        let mut s = UsageScanner::for_response(Some("text/event-stream"), Some("gzip"), LIMITS);
        assert_eq!(s.feed(format!("{FINAL}\n").as_bytes()), None);
        assert!(matches!(
            UsageScanner::for_response(Some("application/json"), Some("identity"), LIMITS),
            UsageScanner::Json { .. }
        ));
    }
}
