//! SGLang's bootstrap-based P/D flow (`--kv-connector sglang`), as SGLang's own routers run it
//! (the mini load balancer and sgl-router's PD mode) and llm-d's pd-sidecar `sglang` connector:
//!
//! 1. the SSRF check and the bounded body, as for every P/D request ([`super::handler::prepare`]);
//! 2. one body for both legs: the client's request plus `bootstrap_host` (the prefiller's IP),
//!    `bootstrap_port` (`--sglang-bootstrap-port`) and a random 63-bit `bootstrap_room`
//!    ([`super::bootstrap`]); `stream`, `max_tokens` and the rest stay as the client sent them;
//! 3. both legs sent **at once**: the prefill leg to the prefiller (retried only while it cannot
//!    have started, see [`Leg::Bootstrap`]) and the decode leg to the local engine;
//! 4. the decode answer is released to the client only once the prefill leg succeeded — as
//!    sgl-router does — and then relayed frame by frame (SSE never buffered). If the prefill leg
//!    fails, the client gets 502 naming the prefiller and the decode request is dropped (its
//!    connection closes, so the engine aborts it) instead of leaving the decode engine waiting
//!    in an empty room; a 4xx from the prefiller is returned as is. A decode answer that fails
//!    or is not 2xx is returned at once (the prefill leg is dropped).

use std::net::SocketAddr;
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, header};
use bytes::Bytes;

use super::bootstrap::{self, Target};
use super::error::ProxyError;
use super::handler::{ProxyState, engine_error, engine_uri, prepare, refused, relay};
use super::metrics::{InFlight, Mode};
use super::prefill::{self, Leg, Prefilled};
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
        leg: Leg::Bootstrap,
    };
    let prefill_leg = prefill::run(&state.client, &state.prefill, &state.metrics, call);
    parts.uri = engine_uri(state, &parts.uri)?;
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    let dispatched = Instant::now();
    let decode_leg = state
        .client
        .request(Request::from_parts(parts, Body::from(bytes)));
    tokio::pin!(prefill_leg, decode_leg);

    let mut decode_head = None;
    let outcome = loop {
        tokio::select! {
            (outcome, _) = &mut prefill_leg => break outcome,
            answer = &mut decode_leg, if decode_head.is_none() => {
                let resp = answer.map_err(|e| engine_error(state, &e))?;
                if !resp.status().is_success() {
                    tracing::warn!(status = resp.status().as_u16(), "decode engine refused the request; prefill leg dropped");
                    return Ok(relay(resp, guard));
                }
                decode_head = Some(resp);
            }
        }
    };
    match outcome? {
        Prefilled::Done | Prefilled::Params(_) => {}
        Prefilled::Refused(status, body) => return Ok(refused(status, body)),
    }
    let resp = match decode_head {
        Some(resp) => resp,
        None => decode_leg.await.map_err(|e| engine_error(state, &e))?,
    };
    state.metrics.added_latency(
        Mode::Pd,
        started.elapsed().saturating_sub(dispatched.elapsed()),
    );
    Ok(relay(resp, guard))
}
