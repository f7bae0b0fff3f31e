//! The prefill leg of the P/D flow: the rewritten request to the named prefiller, retried per
//! [`RetryPolicy`]. For the NIXL connector it is answered by the `kv_transfer_params` the decode
//! leg needs; for SGLang's bootstrap connector any 2xx answer means the prefill is done (the KV
//! moved between the engines themselves).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, Uri, header};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use serde_json::Value;

use super::body::collect;
use super::error::ProxyError;
use super::metrics::ProxyMetrics;
use super::retry::{Failure, Retrier, RetryPolicy, Step};
use super::rewrite;
use super::upstream::Upstream;

/// What the prefill leg needs.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// Retries.
    pub retry: RetryPolicy,
    /// Per attempt: response head and body within this.
    pub timeout: Duration,
    /// Largest prefill response body read.
    pub max_body: usize,
}

/// A connector's prefill leg: what a successful answer must contain, and which failures may be
/// retried. The answer's type is the leg's, so a caller never handles another leg's outcome.
pub trait Leg {
    /// What a 2xx answer yields for the decode leg.
    type Answer: Send;
    /// Whether this leg may try again after `failure`.
    fn may_retry(failure: Failure) -> bool;
    /// Reads a 2xx answer's body; `Err` is a bad response (the reason).
    fn read(body: &[u8]) -> Result<Self::Answer, String>;
}

/// vLLM NIXL: the answer must carry `kv_transfer_params`; every retryable failure is retried.
#[derive(Debug)]
pub struct Nixl;

impl Leg for Nixl {
    type Answer = Value;

    fn may_retry(failure: Failure) -> bool {
        failure.retryable()
    }

    fn read(body: &[u8]) -> Result<Value, String> {
        rewrite::transfer_params(body).map_err(|e| e.to_string())
    }
}

/// SGLang bootstrap: any 2xx answer will do. Only failures where the prefiller cannot have
/// started the request (connect errors, 502/503/504) are retried: a retry reuses the room the
/// decode engine is waiting in, and two prefills in one room must never happen, so a timeout
/// or a connection broken mid-request is final.
#[derive(Debug)]
pub struct Bootstrap;

impl Leg for Bootstrap {
    type Answer = ();

    fn may_retry(failure: Failure) -> bool {
        matches!(
            failure,
            Failure::Connect | Failure::Status502 | Failure::Status503 | Failure::Status504
        )
    }

    fn read(_: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

/// How the leg ended, when it did not fail.
#[derive(Debug)]
pub enum Prefilled<T> {
    /// The prefiller answered 2xx: what the leg read from it ([`Leg::Answer`]).
    Ready(T),
    /// The prefiller refused the request itself (4xx): the client gets that answer as is.
    Refused(StatusCode, Bytes),
}

/// One failed attempt.
#[derive(Debug)]
struct AttemptError {
    failure: Failure,
    reason: String,
    refused: Option<(StatusCode, Bytes)>,
}

impl AttemptError {
    fn new(failure: Failure, reason: impl Into<String>) -> Self {
        Self {
            failure,
            reason: reason.into(),
            refused: None,
        }
    }
}

/// One prefill leg to send.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    /// The prefiller.
    pub prefiller: SocketAddr,
    /// The request path (`/v1/completions` or `/v1/chat/completions`).
    pub path: &'a str,
    /// The client's headers (hop-by-hop and control headers already removed).
    pub headers: &'a HeaderMap,
    /// The rewritten body.
    pub body: Bytes,
}

/// Runs the leg. Returns the outcome and the time spent waiting on the prefiller (attempts and
/// backoff), which is not the proxy's own overhead.
pub async fn run<L: Leg>(
    client: &Upstream,
    config: &PrefillConfig,
    metrics: &ProxyMetrics,
    call: Call<'_>,
) -> (Result<Prefilled<L::Answer>, ProxyError>, Duration) {
    let Call {
        prefiller,
        path,
        headers,
        body,
    } = call;
    let started = Instant::now();
    let mut retrier = Retrier::new(config.retry);
    loop {
        let attempt = retrier.start_attempt();
        metrics.prefill_attempt();
        let result = tokio::time::timeout(
            config.timeout,
            once::<L>(client, config, prefiller, path, headers, body.clone()),
        )
        .await
        .unwrap_or_else(|_| {
            Err(AttemptError::new(
                Failure::Timeout,
                format!("no answer within {} ms", config.timeout.as_millis()),
            ))
        });
        let err = match result {
            Ok(done) => return (Ok(done), started.elapsed()),
            Err(e) => e,
        };
        metrics.prefill_failure(err.failure);
        tracing::warn!(%prefiller, attempt, reason = %err.reason, "prefill attempt failed");
        if let Some((status, body)) = err.refused {
            return (Ok(Prefilled::Refused(status, body)), started.elapsed());
        }
        let step = if L::may_retry(err.failure) {
            retrier.after_failure(err.failure)
        } else {
            Step::GiveUp
        };
        match step {
            Step::RetryAfter(delay) => tokio::time::sleep(delay).await,
            Step::GiveUp => {
                let e = ProxyError::PrefillFailed {
                    prefiller: prefiller.to_string(),
                    attempts: retrier.attempts(),
                    reason: err.reason,
                };
                return (Err(e), started.elapsed());
            }
        }
    }
}

async fn once<L: Leg>(
    client: &Upstream,
    config: &PrefillConfig,
    prefiller: SocketAddr,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Prefilled<L::Answer>, AttemptError> {
    let uri: Uri = format!("http://{prefiller}{path}")
        .parse()
        .map_err(|e| AttemptError::new(Failure::Connect, format!("bad prefiller URI: {e}")))?;
    let mut req = Request::post(uri)
        .body(Body::from(body.clone()))
        .map_err(|e| AttemptError::new(Failure::Connect, e.to_string()))?;
    *req.headers_mut() = headers.clone();
    req.headers_mut().remove(header::HOST);
    req.headers_mut().remove(header::ACCEPT_ENCODING);
    req.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = client.request(req).await.map_err(|e| {
        let chain = cli_support::one_line(&e);
        if e.is_connect() {
            AttemptError::new(Failure::Connect, format!("connect failed: {chain}"))
        } else {
            AttemptError::new(Failure::Io, format!("request failed: {chain}"))
        }
    })?;
    let status = resp.status();
    let bytes = match collect(
        Body::new(resp.into_body().map_err(axum::Error::new)),
        config.max_body,
    )
    .await
    {
        Ok(b) => b,
        Err(e) => {
            return Err(AttemptError::new(
                Failure::Io,
                format!("reading the response: {e}"),
            ));
        }
    };
    if let Some(failure) = Failure::from_status(status) {
        let reason = format!(
            "status {}: {}",
            status.as_u16(),
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(200)
                .collect::<String>()
        );
        let mut err = AttemptError::new(failure, reason);
        if status.is_client_error() {
            err.refused = Some((status, bytes));
        }
        return Err(err);
    }
    L::read(&bytes)
        .map(Prefilled::Ready)
        .map_err(|reason| AttemptError::new(Failure::BadResponse, reason))
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
    fn bootstrap_legs_retry_only_what_never_reached_the_prefiller() {
        for f in Failure::ALL {
            assert_eq!(Nixl::may_retry(f), f.retryable(), "{f:?}");
        }
        let retried: Vec<Failure> = Failure::ALL
            .into_iter()
            .filter(|f| Bootstrap::may_retry(*f))
            .collect();
        assert_eq!(
            retried,
            vec![
                Failure::Connect,
                Failure::Status502,
                Failure::Status503,
                Failure::Status504
            ]
        );
    }
}
