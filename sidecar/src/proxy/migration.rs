//! Mid-stream migration, the I/O: a streamed answer relayed event by event from the local engine;
//! when the engine fails before the answer is finished (the connection breaks, or the stream
//! ends without a finish), the rest is asked of another pool endpoint and spliced into the same
//! response ([`super::migrate`] builds the request and rewrites its events).
//!
//! The other endpoints come from the EPP's fallback list in `x-kvgate-fallback-endpoints` (the
//! EPP sets it; clients cannot, the EPP strips `x-kvgate-*` headers), tried in order and only
//! where SSRF protection allows, at most `--migrate-max-attempts` times per request. Only whole
//! events are relayed, so a client never sees half an event from a dead engine. A pod that dies
//! whole (sidecar included) cannot migrate its streams: nothing is left to do it.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, Response, header};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tracing::Instrument as _;

use super::error::ProxyError;
use super::handler::ProxyState;
use super::headers::strip_hop_by_hop;
use super::metrics::{InFlight, MigrationOutcome};
use super::migrate::{self, EventSplitter, Progress};
use super::rewrite::Api;
use super::ssrf::SsrfPolicy;
use super::upstream::Upstream;

/// The EPP's fallback endpoints (`ip:port`, comma-separated), primary excluded.
pub const FALLBACK_HEADER: &str = "x-kvgate-fallback-endpoints";

/// Most fallback endpoints read from the header.
const MAX_TARGETS: usize = 8;

/// The fallback endpoints SSRF protection allows, in the EPP's order.
pub fn targets(headers: &HeaderMap, ssrf: &SsrfPolicy) -> Vec<SocketAddr> {
    headers
        .get(FALLBACK_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(',')
        .filter_map(|s| s.trim().parse::<SocketAddr>().ok())
        .filter(|a| ssrf.check(a).is_ok())
        .take(MAX_TARGETS)
        .collect()
}

/// A streamed generation request that may be migrated.
#[derive(Debug)]
pub struct Migratable {
    /// The API.
    pub api: Api,
    /// The client's body.
    pub original: Map<String, Value>,
    /// The request path (with query) the continuation is sent to.
    pub path: String,
    /// The request's headers (hop-by-hop and the fallback header removed).
    pub headers: HeaderMap,
    /// Where the rest may be asked for.
    pub targets: Vec<SocketAddr>,
}

/// Relays the engine's streamed answer, migrating it if the engine fails mid-way.
pub fn relay(
    state: &Arc<ProxyState>,
    resp: Response<hyper::body::Incoming>,
    req: Migratable,
    guard: InFlight,
) -> Response<Body> {
    let (mut parts, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.remove(header::CONTENT_LENGTH);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    let state = Arc::clone(state);
    let trace = guard.span().clone();
    tokio::spawn(async move {
        let _guard = guard;
        Pump {
            state: &state,
            req,
            tx,
            progress: Progress::default(),
            attempts: 0,
            trace,
        }
        .run(incoming.boxed())
        .await;
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Response::from_parts(parts, body)
}

type Answer = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

struct Pump<'a> {
    state: &'a ProxyState,
    req: Migratable,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    progress: Progress,
    attempts: u32,
    /// The request's trace span: each migration attempt is a `migrate` span under it.
    trace: tracing::Span,
}

/// How one upstream's stream ended.
enum Ended {
    /// The answer is complete.
    Finished,
    /// The client went away.
    ClientGone,
    /// The upstream failed before the answer was finished.
    Failed(String),
}

impl Pump<'_> {
    async fn run(mut self, mut upstream: Answer) {
        let mut spliced = false;
        loop {
            match self.relay(upstream, spliced).await {
                Ended::Finished | Ended::ClientGone => return,
                Ended::Failed(why) => match self.migrate(&why).await {
                    Some(next) => {
                        upstream = next;
                        spliced = true;
                    }
                    None => {
                        let _ = self
                            .tx
                            .send(Err(std::io::Error::other(format!(
                                "the engine failed mid-stream ({why}) and the answer could not be migrated"
                            ))))
                            .await;
                        return;
                    }
                },
            }
        }
    }

    /// Relays one upstream's events until it ends.
    async fn relay(&mut self, mut upstream: Answer, spliced: bool) -> Ended {
        let api = self.req.api;
        let mut splitter = EventSplitter::default();
        loop {
            let frame = match upstream.frame().await {
                None if self.progress.finished => return Ended::Finished,
                None => return Ended::Failed("the stream ended before the answer".into()),
                Some(Err(e)) => return Ended::Failed(e.to_string()),
                Some(Ok(f)) => f,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let events = match splitter.feed(&data) {
                Ok(ev) => ev,
                Err(e) => return Ended::Failed(e.to_string()),
            };
            for event in events {
                self.progress.observe(api, &event);
                let out = if spliced {
                    migrate::splice(api, &self.progress, &event)
                } else {
                    Some(event.raw)
                };
                if let Some(bytes) = out
                    && self.tx.send(Ok(Bytes::from(bytes))).await.is_err()
                {
                    return Ended::ClientGone;
                }
            }
        }
    }

    /// Asks the next allowed endpoint for the rest; `None` when nothing more can be tried.
    async fn migrate(&mut self, why: &str) -> Option<Answer> {
        let metrics = &self.state.metrics;
        let api = self.req.api;
        if let Some(what) = self.progress.unmigratable {
            tracing::warn!(
                why,
                what,
                "engine failed mid-stream; the answer cannot be migrated"
            );
            metrics.migration(MigrationOutcome::NotMigratable);
            return None;
        }
        let Some(body) = migrate::continuation(api, &self.req.original, &self.progress) else {
            // Nothing left to generate: end the answer as the engine would have.
            let _ = self
                .tx
                .send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
                .await;
            return None;
        };
        let body = Bytes::from(Value::Object(body).to_string());
        while self.attempts < self.state.migrate_max_attempts {
            let Some(target) = self
                .req
                .targets
                .get(self.attempts as usize % self.req.targets.len().max(1))
                .copied()
            else {
                tracing::warn!(
                    why,
                    "engine failed mid-stream; no fallback endpoint to migrate to"
                );
                metrics.migration(MigrationOutcome::NoTarget);
                return None;
            };
            self.attempts += 1;
            metrics.migration_attempt();
            let span = super::handler::child_span(&self.trace, |parent| {
                tracing::info_span!(
                    target: otel::TARGET,
                    parent: parent,
                    "migrate",
                    %target,
                    attempt = otel::int(self.attempts),
                    generated_tokens = otel::int(self.progress.tokens),
                    why,
                    outcome = tracing::field::Empty,
                )
            });
            let trace = otel::trace_headers(&span);
            let sent = send(&self.state.client, target, &self.req, &trace, body.clone())
                .instrument(span.clone())
                .await;
            span.record("outcome", if sent.is_ok() { "migrated" } else { "failed" });
            match sent {
                Ok(next) => {
                    tracing::info!(
                        why,
                        %target,
                        generated = self.progress.tokens,
                        attempt = self.attempts,
                        "engine failed mid-stream; migrated the rest of the answer"
                    );
                    metrics.migration(MigrationOutcome::Migrated);
                    return Some(next);
                }
                Err(e) => {
                    tracing::warn!(%target, error = %e, "migration attempt failed");
                }
            }
        }
        tracing::warn!(
            why,
            attempts = self.attempts,
            "engine failed mid-stream; migration attempts exhausted"
        );
        metrics.migration(MigrationOutcome::Failed);
        None
    }
}

/// Sends the continuation to `target`; its streamed answer when it starts with a 200.
async fn send(
    client: &Upstream,
    target: SocketAddr,
    req: &Migratable,
    trace: &[(&'static str, String)],
    body: Bytes,
) -> Result<Answer, ProxyError> {
    let uri = format!("http://{target}{}", req.path)
        .parse::<axum::http::Uri>()
        .map_err(|e| ProxyError::Engine(format!("bad migration target: {e}")))?;
    let mut out = Request::post(uri)
        .body(Body::from(body.clone()))
        .map_err(|e| ProxyError::Engine(e.to_string()))?;
    *out.headers_mut() = req.headers.clone();
    // The target continues the trace from this attempt's span.
    for (name, value) in trace {
        if let Ok(v) = HeaderValue::from_str(value) {
            out.headers_mut().insert(*name, v);
        }
    }
    out.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    let resp = client
        .request(out)
        .await
        .map_err(|e| ProxyError::Engine(cli_support::one_line(&e)))?;
    if resp.status() != axum::http::StatusCode::OK {
        return Err(ProxyError::Engine(format!(
            "{target} answered {}",
            resp.status()
        )));
    }
    Ok(resp.into_body().boxed())
}
