//! The request handler on :8000: pass-through to the local engine, or the P/D flow of the
//! configured connector when the request names a prefiller (`x-prefiller-host-port`): vLLM's
//! NIXL flow here, SGLang's bootstrap flow in [`super::sglang`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Request, Response, Uri, header};
use bytes::Bytes;
use tracing::Instrument as _;

use super::body::{Tracked, collect, is_over_limit, limited};
use super::connector::Connector;
use super::error::ProxyError;
use super::headers::{PREFILLER_HEADER, Prefiller, prefiller, strip_hop_by_hop};
use super::metrics::{InFlight, Mode, ProxyMetrics};
use super::migration;
use super::prefill::{self, Nixl, PrefillConfig, Prefilled};
use super::rewrite::{self, Api};
use super::ssrf::SsrfPolicy;
use super::upstream::Upstream;

/// Everything a request needs, shared.
#[derive(Debug)]
pub struct ProxyState {
    /// Client for the engine and prefillers.
    pub client: Upstream,
    /// The engine's authority (`127.0.0.1:8200`).
    pub engine: String,
    /// Which prefillers may be contacted.
    pub ssrf: SsrfPolicy,
    /// The prefill leg's settings.
    pub prefill: PrefillConfig,
    /// The P/D protocol.
    pub connector: Connector,
    /// The prefill servers' bootstrap port (SGLang connector).
    pub bootstrap_port: u16,
    /// Largest request body accepted.
    pub max_body: usize,
    /// Mid-stream migration attempts per request (0: off).
    pub migrate_max_attempts: u32,
    /// Counters.
    pub metrics: Arc<ProxyMetrics>,
}

/// The axum handler for every method and path.
pub async fn handle(
    State(state): State<Arc<ProxyState>>,
    mut req: Request<Body>,
) -> Response<Body> {
    let started = Instant::now();
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let trace = request_span(&mut req, &request_id);
    let guard = state.metrics.in_flight().traced(trace.clone());
    let target = match prefiller(req.headers()) {
        Prefiller::At(addr) if Api::from_path(req.uri().path()).is_some() => Ok(Some(addr)),
        Prefiller::Malformed(raw) if Api::from_path(req.uri().path()).is_some() => {
            Err(ProxyError::BadPrefillerHeader(raw))
        }
        _ => Ok(None),
    };
    trace.record(
        "mode",
        if matches!(target, Ok(None)) {
            Mode::Passthrough.label()
        } else {
            Mode::Pd.label()
        },
    );
    let (mode, result) = match target {
        Ok(None) => {
            let span = tracing::debug_span!("proxy", mode = "passthrough", %request_id, path = %req.uri().path());
            (
                Mode::Passthrough,
                passthrough(&state, req, started, guard)
                    .instrument(span)
                    .instrument(trace.clone())
                    .await,
            )
        }
        Ok(Some(addr)) => {
            let span = tracing::info_span!(
                "proxy",
                mode = "pd",
                connector = state.connector.label(),
                %request_id,
                prefiller = %addr,
                bootstrap_room = tracing::field::Empty,
            );
            let flow = async {
                match state.connector {
                    Connector::Nixlv2 => pd(&state, req, addr, started, guard).await,
                    Connector::Sglang => {
                        super::sglang::run(&state, req, addr, started, guard).await
                    }
                }
            };
            (
                Mode::Pd,
                flow.instrument(span).instrument(trace.clone()).await,
            )
        }
        Err(e) => (Mode::Pd, Err(e)),
    };
    let resp = result.unwrap_or_else(|e| {
        if matches!(e, ProxyError::PrefillerNotAllowed(_) | ProxyError::NoAllowList) {
            state.metrics.ssrf_refusal();
        }
        tracing::warn!(mode = mode.label(), %request_id, reason = e.metric_label(), error = %e, "proxy answered with an error");
        e.into_response()
    });
    state.metrics.request(mode, resp.status().as_u16());
    trace.record(
        "http.response.status_code",
        otel::int(resp.status().as_u16()),
    );
    resp
}

/// A span under a traced request's span, made by `make`; none for an untraced request (a
/// `parent: none` span would start a trace of its own).
pub(super) fn child_span(
    request: &tracing::Span,
    make: impl FnOnce(&tracing::Span) -> tracing::Span,
) -> tracing::Span {
    if request.is_disabled() {
        tracing::Span::none()
    } else {
        make(request)
    }
}

/// The request's span in the sidecar (target [`otel::TARGET`]): a child of the trace the EPP
/// (or the client) started, per the request's `traceparent`; it ends with the response body.
/// The request's `traceparent`/`tracestate` are replaced by this span's, so the engine, a
/// prefiller and a migration target continue the trace from here. Tracing off, or a request
/// head sampling leaves out: no span, and the headers go on as they came (with a generated
/// unsampled `traceparent` when they had none, so the engine keeps the decision).
fn request_span(req: &mut Request<Body>, request_id: &str) -> tracing::Span {
    let incoming: Vec<(&str, &str)> = ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|name| {
            let value = req.headers().get(name)?.to_str().ok()?;
            Some((name, value))
        })
        .collect();
    let parent = match otel::head(&incoming) {
        otel::Head::Trace { parent } => parent,
        otel::Head::Skip { traceparent } => {
            if let Some(v) = traceparent.and_then(|tp| HeaderValue::from_str(&tp).ok()) {
                req.headers_mut().insert("traceparent", v);
            }
            return tracing::Span::none();
        }
    };
    let span = tracing::info_span!(
        target: otel::TARGET,
        "sidecar.proxy",
        otel.kind = "server",
        request_id,
        url.path = req.uri().path(),
        mode = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    if span.is_disabled() {
        return span;
    }
    otel::set_parent(&span, parent.as_ref());
    let headers = req.headers_mut();
    headers.remove("tracestate");
    for (name, value) in otel::trace_headers(&span) {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    }
    span
}

/// The local engine's URI for a request target.
pub(super) fn engine_uri(state: &ProxyState, uri: &Uri) -> Result<Uri, ProxyError> {
    let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
    format!("http://{}{pq}", state.engine)
        .parse()
        .map_err(|e| ProxyError::BadBody(format!("bad request target: {e}")))
}

/// Sends a prepared request to the engine and relays its answer as it arrives.
async fn to_engine(
    state: &ProxyState,
    mode: Mode,
    req: Request<Body>,
    started: Instant,
    upstream_before: Duration,
    guard: InFlight,
) -> Result<Response<Body>, ProxyError> {
    let resp = send_to_engine(state, mode, req, started, upstream_before).await?;
    Ok(relay(resp, guard))
}

/// Sends a prepared request to the engine and records the time the proxy added before its
/// response head; the answer is the caller's to relay.
async fn send_to_engine(
    state: &ProxyState,
    mode: Mode,
    req: Request<Body>,
    started: Instant,
    upstream_before: Duration,
) -> Result<Response<hyper::body::Incoming>, ProxyError> {
    let sent = Instant::now();
    let resp = state
        .client
        .request(req)
        .await
        .map_err(|e| engine_error(state, &e))?;
    let waited = upstream_before + sent.elapsed();
    state
        .metrics
        .added_latency(mode, started.elapsed().saturating_sub(waited));
    Ok(resp)
}

/// The error a failed engine request is.
pub(super) fn engine_error(
    state: &ProxyState,
    e: &hyper_util::client::legacy::Error,
) -> ProxyError {
    if is_over_limit(e) {
        ProxyError::TooLarge {
            limit: state.max_body,
        }
    } else {
        ProxyError::Engine(cli_support::one_line(e))
    }
}

/// An engine's answer as the client gets it: hop-by-hop headers removed, the body relayed frame
/// by frame while the request stays counted in flight.
pub(super) fn relay(resp: Response<hyper::body::Incoming>, guard: InFlight) -> Response<Body> {
    let (mut parts, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, Body::new(Tracked::new(incoming, guard)))
}

/// The prefiller's own 4xx answer, returned to the client as is.
pub(super) fn refused(status: axum::http::StatusCode, body: Bytes) -> Response<Body> {
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

async fn passthrough(
    state: &Arc<ProxyState>,
    req: Request<Body>,
    started: Instant,
    guard: InFlight,
) -> Result<Response<Body>, ProxyError> {
    let (mut parts, body) = req.into_parts();
    let targets = if state.migrate_max_attempts > 0 {
        migration::targets(&parts.headers, &state.ssrf)
    } else {
        Vec::new()
    };
    parts.headers.remove(migration::FALLBACK_HEADER);
    let migratable = Api::from_path(parts.uri.path()).filter(|_| !targets.is_empty());
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    parts.uri = engine_uri(state, &parts.uri)?;
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.remove(PREFILLER_HEADER);
    if let Some(api) = migratable {
        let plan = migration::Migratable {
            api,
            original: rewrite::Request::new(),
            path,
            headers: parts.headers.clone(),
            targets,
        };
        return migrating(state, parts, body, plan, started, guard).await;
    }
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.max_body as u64) {
        return Err(ProxyError::TooLarge {
            limit: state.max_body,
        });
    }
    let req = Request::from_parts(parts, limited(body, state.max_body));
    to_engine(
        state,
        Mode::Passthrough,
        req,
        started,
        Duration::ZERO,
        guard,
    )
    .await
}

/// The common start of every P/D flow: the SSRF check (before anything else, so a refused
/// prefiller is never contacted), the generation API, the bounded body parsed as a JSON object,
/// and the request head with hop-by-hop, control and length headers removed.
pub(super) async fn prepare(
    state: &ProxyState,
    req: Request<Body>,
    prefiller: &std::net::SocketAddr,
) -> Result<(axum::http::request::Parts, Api, rewrite::Request), ProxyError> {
    state.ssrf.check(prefiller)?;
    let api = Api::from_path(req.uri().path())
        .ok_or_else(|| ProxyError::BadBody("not a generation path".into()))?;
    let (mut parts, body) = req.into_parts();
    let bytes = collect(body, state.max_body).await?;
    let original =
        rewrite::parse_request(&bytes).map_err(|e| ProxyError::BadBody(e.to_string()))?;
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.remove(PREFILLER_HEADER);
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok((parts, api, original))
}

async fn pd(
    state: &ProxyState,
    req: Request<Body>,
    prefiller: std::net::SocketAddr,
    started: Instant,
    guard: InFlight,
) -> Result<Response<Body>, ProxyError> {
    let (mut parts, api, original) = prepare(state, req, &prefiller).await?;

    let prefill_body = Bytes::from(rewrite::to_bytes(&rewrite::prefill_request(api, &original)));
    let path = parts.uri.path().to_owned();
    // A traced request's prefill leg is a span of its own, and the prefiller continues from it.
    let span = child_span(
        guard.span(),
        |parent| tracing::info_span!(target: otel::TARGET, parent: parent, "prefill", %prefiller),
    );
    let traced_headers;
    let headers = if span.is_disabled() {
        &parts.headers
    } else {
        let mut h = parts.headers.clone();
        for (name, value) in otel::trace_headers(&span) {
            if let Ok(v) = HeaderValue::from_str(&value) {
                h.insert(name, v);
            }
        }
        traced_headers = h;
        &traced_headers
    };
    let call = prefill::Call {
        prefiller,
        path: &path,
        headers,
        body: prefill_body,
    };
    let (outcome, waited) =
        prefill::run::<Nixl>(&state.client, &state.prefill, &state.metrics, call)
            .instrument(span)
            .await;
    let params = match outcome? {
        Prefilled::Ready(p) => p,
        Prefilled::Refused(status, body) => return Ok(refused(status, body)),
    };
    tracing::debug!(?params, "prefill done");
    let decode = rewrite::to_bytes(&rewrite::decode_request(original, params));
    parts.uri = engine_uri(state, &parts.uri)?;
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(decode.len()));
    let req = Request::from_parts(parts, Body::from(decode));
    to_engine(state, Mode::Pd, req, started, waited, guard).await
}

/// A generation request with fallback endpoints (`parts` already aimed at the engine): its body
/// is read (bounded) so that, when it is a streamed answer that can be carried over, an engine
/// failing mid-stream can be replaced ([`migration`]); anything else goes to the engine as it
/// came.
async fn migrating(
    state: &Arc<ProxyState>,
    parts: axum::http::request::Parts,
    body: Body,
    mut plan: migration::Migratable,
    started: Instant,
    guard: InFlight,
) -> Result<Response<Body>, ProxyError> {
    let bytes = collect(body, state.max_body).await?;
    let original = rewrite::parse_request(&bytes)
        .ok()
        .filter(|req| super::migrate::migratable(plan.api, req).is_ok());
    let req = Request::from_parts(parts, Body::from(bytes));
    let Some(original) = original else {
        return to_engine(
            state,
            Mode::Passthrough,
            req,
            started,
            Duration::ZERO,
            guard,
        )
        .await;
    };
    let resp = send_to_engine(state, Mode::Passthrough, req, started, Duration::ZERO).await?;
    let streamed = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if resp.status() != axum::http::StatusCode::OK || !streamed {
        return Ok(relay(resp, guard));
    }
    plan.original = original;
    Ok(migration::relay(state, resp, plan, guard))
}
