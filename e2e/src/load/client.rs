//! One streaming completion against an OpenAI base URL, measured.
//!
//! `POST {base}/v1/completions` with a token-id prompt (or its [`text_prompt`] rendering, for
//! routers that refuse token ids), `stream`, `stream_options.include_usage`,
//! `ignore_eos` and `return_token_ids`, over a pooled HTTP/1.1 keep-alive client (hyper) with
//! `TCP_NODELAY`. The clock starts before the request is written; TTFT is the first chunk that
//! carries output; E2E ends at the last byte of the body.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::Request;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use workload::Status;

use super::sse::{SseDecoder, Step, StreamState};

/// The response header naming the engine that served a request.
pub const POD_HEADER: &str = "x-kvgate-pod";

/// Longest error body kept, in bytes.
const MAX_ERROR_BODY: usize = 4 << 10;

/// How a completion went, before it becomes a record.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// How it ended.
    pub status: Status,
    /// HTTP status, when a response head arrived.
    pub http_status: Option<u16>,
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Send to last byte (or to the failure).
    pub e2e: Duration,
    /// Prompt tokens by the server's usage, when reported.
    pub prompt_tokens: Option<u32>,
    /// Output tokens received.
    pub output_tokens: u32,
    /// Cached prompt tokens, when reported.
    pub cached_tokens: Option<u32>,
    /// The output ids, when the server returned all of them.
    pub output_ids: Option<Vec<u32>>,
    /// `x-kvgate-pod`, when present.
    pub endpoint: Option<String>,
    /// A short reason for a failure.
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Ids(&'a [u32]),
    Text(String),
}

/// Base-36 digits of [`text_prompt`].
const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
/// Distinct four-character words: ids are rendered modulo this.
const WORDS: u32 = 36 * 36 * 36 * 36;

/// The text form of a token-id prompt: every id as exactly four ASCII characters (base 36,
/// modulo 36^4 = 1,679,616; the workloads' ids are below 100,000). `kvgate-sim`'s byte tokenizer
/// cuts ASCII text into four-byte tokens, so the text is again one token per id and two prompts
/// sharing an id prefix share a token prefix of the same length: block-level sharing, and so
/// the routing problem, is unchanged. Real tokenizers would not keep that property.
pub fn text_prompt(ids: &[u32]) -> String {
    let mut out = String::with_capacity(ids.len() * 4);
    for &id in ids {
        let mut v = id % WORDS;
        let mut word = [b'0'; 4];
        for slot in word.iter_mut().rev() {
            *slot = DIGITS.get((v % 36) as usize).copied().unwrap_or(b'0');
            v /= 36;
        }
        out.extend(word.iter().map(|&b| char::from(b)));
    }
    out
}

#[derive(Debug, Serialize)]
struct Body<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    prompt: Prompt<'a>,
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
    ignore_eos: bool,
    return_token_ids: bool,
}

#[derive(Debug, Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// A pooled client for one base URL.
#[derive(Debug, Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    completions: hyper::Uri,
    model: Option<String>,
    timeout: Duration,
    text_prompts: bool,
}

/// A base URL that is not `http://host[:port][/path]`.
#[derive(Debug, thiserror::Error)]
#[error("--url {url}: {reason}")]
pub struct BadUrl {
    url: String,
    reason: String,
}

impl Client {
    /// A client for `base` (`http://host:port`, optionally with a path prefix), sending `model`
    /// when given and giving up on a request after `timeout`.
    pub fn new(base: &str, model: Option<String>, timeout: Duration) -> Result<Self, BadUrl> {
        let bad = |reason: &str| BadUrl {
            url: base.to_owned(),
            reason: reason.to_owned(),
        };
        let trimmed = base.trim_end_matches('/');
        let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let completions: hyper::Uri = format!("{trimmed}/v1/completions")
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        if completions.scheme_str() != Some("http") || completions.authority().is_none() {
            return Err(bad("expected http://host:port (TLS is not supported)"));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(10)));
        let http = HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(usize::MAX)
            .build(connector);
        Ok(Self {
            http,
            completions,
            model,
            timeout,
            text_prompts: false,
        })
    }

    /// Sends prompts as [`text_prompt`]s instead of token ids.
    #[must_use]
    pub fn with_text_prompts(mut self, text: bool) -> Self {
        self.text_prompts = text;
        self
    }

    /// Sends one completion and measures it. Never fails: every outcome is a [`Reply`].
    pub async fn complete(&self, prompt: &[u32], max_tokens: u32) -> Reply {
        let started = Instant::now();
        let mut progress = Progress::default();
        match tokio::time::timeout(
            self.timeout,
            self.exchange(prompt, max_tokens, started, &mut progress),
        )
        .await
        {
            Ok(reply) => reply,
            Err(_) => progress.finish(
                Status::Timeout,
                started.elapsed(),
                Some(format!("no complete answer within {:?}", self.timeout)),
            ),
        }
    }

    async fn exchange(
        &self,
        prompt: &[u32],
        max_tokens: u32,
        started: Instant,
        progress: &mut Progress,
    ) -> Reply {
        let body = Body {
            model: self.model.as_deref(),
            prompt: if self.text_prompts {
                Prompt::Text(text_prompt(prompt))
            } else {
                Prompt::Ids(prompt)
            },
            max_tokens,
            stream: true,
            stream_options: StreamOptions {
                include_usage: true,
            },
            ignore_eos: true,
            return_token_ids: true,
        };
        let json = match serde_json::to_vec(&body) {
            Ok(json) => json,
            Err(e) => return progress.fail(Status::Transport, started, format!("encoding: {e}")),
        };
        let request = Request::post(self.completions.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(Full::new(Bytes::from(json)));
        let request = match request {
            Ok(r) => r,
            Err(e) => return progress.fail(Status::Transport, started, format!("request: {e}")),
        };
        let response = match self.http.request(request).await {
            Ok(r) => r,
            Err(e) => {
                return progress.fail(Status::Transport, started, cli_support::one_line(&e));
            }
        };
        progress.http_status = Some(response.status().as_u16());
        progress.endpoint = response
            .headers()
            .get(POD_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let ok = response.status().is_success();
        let mut body = response.into_body();
        let mut decoder = SseDecoder::default();
        let mut error_body = Vec::new();
        loop {
            let frame = match body.frame().await {
                None => break,
                Some(Ok(frame)) => frame,
                Some(Err(e)) => {
                    let status = if ok {
                        Status::Transport
                    } else {
                        Status::HttpError
                    };
                    return progress.fail(
                        status,
                        started,
                        format!("body: {}", cli_support::one_line(&e)),
                    );
                }
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if !ok {
                let room = MAX_ERROR_BODY.saturating_sub(error_body.len());
                error_body.extend_from_slice(data.get(..room.min(data.len())).unwrap_or_default());
                continue;
            }
            let events = match decoder.feed(&data) {
                Ok(events) => events,
                Err(e) => return progress.fail(Status::Transport, started, e.to_string()),
            };
            for event in events {
                if progress.stream.apply(&event) == Step::FirstToken {
                    progress.ttft = Some(started.elapsed());
                }
            }
        }
        let e2e = started.elapsed();
        if !ok {
            let text = String::from_utf8_lossy(&error_body);
            let status = progress.http_status.unwrap_or_default();
            return progress.finish(
                Status::HttpError,
                e2e,
                Some(format!("HTTP {status}: {}", text.trim())),
            );
        }
        if let Some(message) = progress.stream.error.clone() {
            return progress.finish(
                Status::Transport,
                e2e,
                Some(format!("error event: {message}")),
            );
        }
        if !progress.stream.done {
            return progress.finish(
                Status::Transport,
                e2e,
                Some("the stream ended before [DONE]".into()),
            );
        }
        progress.finish(Status::Ok, e2e, None)
    }
}

/// What is known of a request while it runs.
#[derive(Debug, Default)]
struct Progress {
    http_status: Option<u16>,
    endpoint: Option<String>,
    ttft: Option<Duration>,
    stream: StreamState,
}

impl Progress {
    fn fail(&mut self, status: Status, started: Instant, error: String) -> Reply {
        std::mem::take(self).finish(status, started.elapsed(), Some(error))
    }

    fn finish(&mut self, status: Status, e2e: Duration, error: Option<String>) -> Reply {
        let this = std::mem::take(self);
        Reply {
            status,
            http_status: this.http_status,
            ttft: this.ttft,
            e2e,
            prompt_tokens: this.stream.prompt_tokens,
            output_tokens: this.stream.output_tokens(),
            cached_tokens: this.stream.cached_tokens,
            output_ids: this.stream.output_ids().map(<[u32]>::to_vec),
            endpoint: this.endpoint,
            error,
        }
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
    fn text_prompts_are_one_byte_tokenizer_token_per_id_and_keep_prefixes() {
        let tok = tokenize::ByteTokenizer::new();
        let a = [1_000_u32, 99_999, 42, 1_679_615];
        let b = [1_000_u32, 99_999, 7];
        let (ta, tb) = (text_prompt(&a), text_prompt(&b));
        assert_eq!(ta.len(), 16);
        assert!(ta.is_ascii());
        let (ia, ib) = (tok.encode(&ta), tok.encode(&tb));
        assert_eq!((ia.len(), ib.len()), (4, 3));
        assert_eq!(ia[..2], ib[..2]);
        assert_ne!(ia[2], ib[2]);
        assert_ne!(text_prompt(&[5]), text_prompt(&[6]));
        assert_eq!(text_prompt(&[0]), "0000");
        assert_eq!(text_prompt(&[35]), "000z");
    }
}
