//! SGLang's bootstrap-based P/D flow (`--kv-connector sglang`), as SGLang's own routers run it
//! (the mini load balancer and sgl-router's PD mode) and llm-d's pd-sidecar `sglang` connector:
//!
//! 1. the SSRF check and the bounded body, as for every P/D request (`handler::prepare`);
//! 2. one body for both legs: the client's request plus `bootstrap_host` (the prefiller's IP),
//!    `bootstrap_port` (`--sglang-bootstrap-port`) and a random 63-bit `bootstrap_room`
//!    ([`super::bootstrap`]); `stream`, `max_tokens` and the rest stay as the client sent them;
//! 3. both legs sent **at once**: the prefill leg to the prefiller (retried only while it cannot
//!    have started, see [`Bootstrap`]) and the decode leg to the local engine;
//! 4. which answer the client gets is decided by [`Dual`]: the decode answer is released only
//!    once the prefill leg succeeded — as sgl-router does — and then relayed frame by frame (SSE
//!    never buffered). If the prefill leg fails, the client gets 502 naming the prefiller and
//!    the decode request is dropped (its connection closes, so the engine aborts it) instead of
//!    leaving the decode engine waiting in an empty room; a 4xx from the prefiller is returned
//!    as is. A decode answer that fails or is not 2xx is returned at once (the prefill leg is
//!    dropped).

use std::net::SocketAddr;
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, header};
use bytes::Bytes;

use super::bootstrap::{self, Target};
use super::dual::{DecodeHead, Dual, PrefillEnd, Verdict};
use super::error::ProxyError;
use super::handler::{ProxyState, engine_error, engine_uri, prepare, refused, relay};
use super::metrics::{InFlight, Mode};
use super::prefill::{self, Bootstrap, Prefilled};
use super::rewrite;

/// Runs the flow for a request naming `prefiller`.
pub async fn run(
    state: &ProxyState,
    req: Request<Body>,
    prefiller: SocketAddr,
    started: Instant,
    guard: InFlight,
) -> Result<Response<Body>, ProxyError> {
    let (mut parts, api, original) = prepare(state, req, &prefiller).await?;
    let target = Target::for_prefiller(prefiller, state.bootstrap_port);
    let (body, rooms) =
        bootstrap::inject(api, original, &target, crate::bridge::epoch::random_epoch)
            .map_err(|e| ProxyError::BadBody(e.to_string()))?;
    if let Some(room) = rooms.first() {
        tracing::Span::current().record("bootstrap_room", room);
    }
    tracing::debug!(
        bootstrap_host = %target.host,
        bootstrap_port = target.port,
        rooms = rooms.len(),
        "bootstrap fields set"
    );
    let bytes = Bytes::from(rewrite::to_bytes(&body));
    let path = parts.uri.path().to_owned();
    let prefill_headers = parts.headers.clone();
    let call = prefill::Call {
        prefiller,
        path: &path,
        headers: &prefill_headers,
        body: bytes.clone(),
    };
    let prefill_leg =
        prefill::run::<Bootstrap>(&state.client, &state.prefill, &state.metrics, call);
    parts.uri = engine_uri(state, &parts.uri)?;
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    let dispatched = Instant::now();
    let decode_leg = state
        .client
        .request(Request::from_parts(parts, Body::from(bytes)));
    tokio::pin!(prefill_leg, decode_leg);

    let mut dual = Dual::new();
    let mut prefill_ended = false;
    let (mut head, mut decode_error, mut prefill_error, mut refusal) = (None, None, None, None);
    loop {
        let verdict = tokio::select! {
            (outcome, _) = &mut prefill_leg, if !prefill_ended => {
                prefill_ended = true;
                match outcome {
                    Ok(Prefilled::Ready(())) => dual.prefill(PrefillEnd::Done),
                    Ok(Prefilled::Refused(status, body)) => {
                        refusal = Some(refused(status, body));
                        dual.prefill(PrefillEnd::Refused)
                    }
                    Err(e) => {
                        prefill_error = Some(e);
                        dual.prefill(PrefillEnd::Failed)
                    }
                }
            }
            answer = &mut decode_leg, if dual.awaiting_decode() => match answer {
                Ok(resp) => {
                    let kind = if resp.status().is_success() { DecodeHead::Ok } else { DecodeHead::NotOk };
                    head = Some(resp);
                    dual.decode(kind)
                }
                Err(e) => {
                    decode_error = Some(engine_error(state, &e));
                    dual.decode(DecodeHead::Failed)
                }
            },
        };
        let lost = || ProxyError::Engine("the decode leg's answer was lost".into());
        match verdict {
            Verdict::Wait => {}
            Verdict::Decode => {
                let resp = head.take().ok_or_else(lost)?;
                if resp.status().is_success() {
                    state.metrics.added_latency(
                        Mode::Pd,
                        started.elapsed().saturating_sub(dispatched.elapsed()),
                    );
                } else {
                    tracing::warn!(
                        status = resp.status().as_u16(),
                        "the decode engine refused the request; prefill leg dropped"
                    );
                }
                return Ok(relay(resp, guard));
            }
            Verdict::DecodeFailed => return Err(decode_error.take().unwrap_or_else(lost)),
            Verdict::PrefillRefused => return refusal.take().ok_or_else(lost),
            Verdict::PrefillFailed => {
                return Err(prefill_error
                    .take()
                    .unwrap_or_else(|| ProxyError::PrefillFailed {
                        prefiller: prefiller.to_string(),
                        attempts: 0,
                        reason: "the prefill leg's error was lost".into(),
                    }));
            }
        }
    }
}
