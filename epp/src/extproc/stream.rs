//! The per-stream state machine: one `ProcessingRequest` in, the `ProcessingResponse`s it calls
//! for out.
//!
//! Request side, by Envoy's request body mode:
//! - no body (headers with `end_of_stream`, or body mode `NONE`): pick on the headers message;
//! - `FULL_DUPLEX_STREAMED`: hold the headers reply, gather the body (bounded) until
//!   `end_of_stream` or trailers, pick, then send the headers reply (the pick), the body as
//!   ≤ 62,000-byte `streamed_response` chunks, and a trailers reply if trailers ended the body;
//! - `BUFFERED` / `BUFFERED_PARTIAL`: empty headers reply, pick on the one body message and answer
//!   it with the pick (and the replacement body, if any).
//!
//! Response side: headers and trailers are passed on unchanged, body chunks too (echoed as
//! `streamed_response` in `FULL_DUPLEX_STREAMED`), while the ticket hears `Headers`, `FirstByte`,
//! `Usage` and one terminal `End` / `Aborted`.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
    TrailersResponse, body_mutation::Mutation, processing_request::Request,
    processing_response::Response,
};

use otel::KeyValue;

use super::DESTINATION_ENDPOINT_HEADER;
use super::body::{BodyBuffer, TooLarge, streamed_chunks};
use super::handoff::{Claimed, Handoffs};
use super::headers::{RequestHead, find, mutation, set, value_of};
use super::immediate::Refusal;
use super::metadata::{destination, served_endpoint, subset_hint};
use super::relay::{
    REPLICA_HEADER, RESPONSE_MODEL_HEADER, RelayTicket, decode_response_model,
    encode_response_model, parse_replica,
};
use super::rewrite::ResponseRewriter;
use super::router::{Decision, ResponseEvent, Router, RoutingInput};
use super::usage::{Limits, Usage, UsageScanner};

/// How Envoy sends a body to the processor (`ProcessingMode.BodySendMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// The body is not sent.
    None,
    /// Chunks, each answered before the next (not supported for requests: the pick must be made
    /// before the headers go upstream).
    Streamed,
    /// The whole body in one message.
    Buffered,
    /// Up to Envoy's buffer limit in one message.
    BufferedPartial,
    /// Chunks as they arrive, answered in any grouping (what GIE deployments use).
    FullDuplexStreamed,
    /// De-framed gRPC messages (not supported).
    Grpc,
}

impl BodyMode {
    fn from_envoy(value: i32) -> Option<Self> {
        Some(match BodySendMode::try_from(value).ok()? {
            BodySendMode::None => Self::None,
            BodySendMode::Streamed => Self::Streamed,
            BodySendMode::Buffered => Self::Buffered,
            BodySendMode::BufferedPartial => Self::BufferedPartial,
            BodySendMode::FullDuplexStreamed => Self::FullDuplexStreamed,
            BodySendMode::Grpc => Self::Grpc,
        })
    }
}

/// Per-stream limits and assumptions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Request body mode assumed when Envoy does not say (`protocol_config` absent).
    pub request_body_mode: BodyMode,
    /// Response body mode assumed when Envoy does not say.
    pub response_body_mode: BodyMode,
    /// Longest SSE line scanned for `usage`.
    pub sse_line_limit: usize,
    /// Tail of a JSON response body kept to find `usage`.
    pub json_tail_limit: usize,
    /// What the destination header carries (the metadata always carries every endpoint).
    pub header_endpoints: HeaderEndpoints,
}

/// What the `x-gateway-destination-endpoint` header carries. GIE's protocol text puts the same
/// list in the header and the `envoy.lb` metadata, but data planes that read the header
/// (Envoy's ORIGINAL_DST clusters, as Envoy AI Gateway configures them, and agentgateway)
/// parse it as one `ip:port`; those that honour fallbacks (Envoy's `override_host`, Istio)
/// read the metadata.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HeaderEndpoints {
    /// The primary endpoint alone (the default).
    #[default]
    Primary,
    /// The primary and its fallbacks, comma-separated.
    All,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 << 20,
            request_body_mode: BodyMode::FullDuplexStreamed,
            response_body_mode: BodyMode::None,
            sse_line_limit: 64 << 10,
            json_tail_limit: 64 << 10,
            header_endpoints: HeaderEndpoints::Primary,
        }
    }
}

/// A message Envoy should not have sent at this point; the stream is ended with an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The message does not fit the stream's phase.
    #[error("unexpected {message} while {phase}")]
    Unexpected {
        /// What arrived.
        message: &'static str,
        /// Where the stream was.
        phase: &'static str,
    },
}

impl StreamError {
    /// Bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Unexpected { .. } => "unexpected_message",
        }
    }
}

/// A routed request's handle: reports events to the router (or, for a request another replica
/// routed, through the relay to that replica) and guarantees exactly one terminal event,
/// `Aborted` when dropped open.
struct Ticket {
    sink: Option<Sink>,
    /// The request's trace span: the router's spans for the response hang under it.
    span: otel::RequestSpan,
}

/// Where a ticket's events go.
enum Sink {
    /// This replica's router.
    Local { id: u64, router: Arc<dyn Router> },
    /// The replica that routed the request.
    Relay(RelayTicket),
}

impl Sink {
    fn report(&self, event: ResponseEvent) {
        match self {
            Self::Local { id, router } => router.on_response(*id, event),
            Self::Relay(relay) => relay.report(event),
        }
    }

    fn close(self, span: &otel::RequestSpan, event: ResponseEvent) {
        span.set(KeyValue::new("outcome", outcome(&event)));
        match self {
            Self::Local { id, router } => router.on_response(id, event),
            Self::Relay(relay) => relay.close(event),
        }
    }
}

impl Ticket {
    fn report(&self, event: ResponseEvent) {
        debug_assert!(!event.is_terminal());
        if let ResponseEvent::Headers { status, .. } = &event {
            self.span.set(KeyValue::new(
                "http.response.status_code",
                otel::int(*status),
            ));
        }
        if let Some(sink) = &self.sink {
            sink.report(event);
        }
    }

    fn close(mut self, event: ResponseEvent) {
        debug_assert!(event.is_terminal());
        if let Some(sink) = self.sink.take() {
            sink.close(&self.span, event);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            sink.close(&self.span, ResponseEvent::Aborted);
        }
    }
}

fn outcome(event: &ResponseEvent) -> &'static str {
    if *event == ResponseEvent::End {
        "completed"
    } else {
        "aborted"
    }
}

/// The span a request's trace is made of in the EPP (`epp.request`): a child of the caller's
/// W3C trace context when the request carried one (`parent`, from [`otel::head`]). The
/// router's stages (parse, tokenize, pick, first token, decode) hang under it; it ends with the
/// response. Records nothing when tracing is off. Create it only for a request [`otel::head`]
/// says to trace.
pub fn request_span(
    method: &str,
    path: &str,
    request_id: &str,
    parent: Option<&otel::Parent>,
) -> otel::RequestSpan {
    otel::RequestSpan::start(
        "epp.request",
        parent,
        vec![
            KeyValue::new("request_id", request_id.to_owned()),
            KeyValue::new("http.request.method", method.to_owned()),
            KeyValue::new("url.path", path.to_owned()),
        ],
    )
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Ticket");
        match &self.sink {
            Some(Sink::Local { id, .. }) => d.field("id", id),
            Some(Sink::Relay(relay)) => d.field("relay", relay),
            None => d.field("open", &false),
        };
        d.finish()
    }
}

/// Where the request side stands.
#[derive(Debug)]
enum RequestPhase {
    /// Nothing seen yet.
    AwaitingHeaders,
    /// Headers seen, body being gathered before the pick.
    Collecting {
        head: RequestHead,
        body: BodyBuffer,
        /// `FULL_DUPLEX_STREAMED` (headers reply held) rather than buffered.
        duplex: bool,
    },
    /// Picked and released upstream.
    Forwarded,
    /// Answered by the EPP itself.
    Refused,
}

impl RequestPhase {
    fn name(&self) -> &'static str {
        match self {
            Self::AwaitingHeaders => "awaiting request headers",
            Self::Collecting { .. } => "collecting the request body",
            Self::Forwarded => "forwarded",
            Self::Refused => "refused",
        }
    }
}

/// What the response side of a routed request has shown so far.
#[derive(Debug)]
enum ResponsePhase {
    AwaitingHeaders,
    Body {
        scanner: UsageScanner,
        first_byte_seen: bool,
    },
}

/// An open ticket and its response progress.
#[derive(Debug)]
pub(super) struct Observer {
    ticket: Ticket,
    phase: ResponsePhase,
    /// Swaps the served model name back to the client's, when the request was rewritten.
    rewriter: Option<ResponseRewriter>,
}

impl Observer {
    /// Reports a non-terminal event to the ticket.
    pub(super) fn report(&self, event: ResponseEvent) {
        self.ticket.report(event);
    }

    /// Closes the ticket with a terminal event.
    pub(super) fn close(self, event: ResponseEvent) {
        self.ticket.close(event);
    }
}

/// How the pick is delivered, by request shape and mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// On the request headers reply (no body).
    Headers,
    /// Headers reply, re-chunked body, and a trailers reply when trailers ended the body.
    Duplex { trailers: bool },
    /// On the (single) request body reply.
    Buffered,
}

/// One ext_proc `Process` stream.
pub struct ExtProcStream {
    router: Arc<dyn Router>,
    config: Arc<StreamConfig>,
    /// With the response-observer layout: where routing streams park their tickets and
    /// observer streams claim them.
    handoffs: Option<Arc<Handoffs>>,
    /// This stream is the response observer's: it never routes, it claims a ticket.
    observes_responses: bool,
    request_body_mode: Option<BodyMode>,
    response_body_mode: Option<BodyMode>,
    subset: Option<Vec<String>>,
    request_id: Option<String>,
    request: RequestPhase,
    response: Option<Observer>,
    /// The request's trace span (`epp.request`), from its headers to the response's end;
    /// recording nothing when tracing is off or the request is not sampled.
    span: otel::RequestSpan,
    /// An unsampled request's generated `traceparent`, sent on so later hops keep the decision.
    unsampled_parent: Option<String>,
}

impl std::fmt::Debug for ExtProcStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtProcStream")
            .field("request", &self.request)
            .field("response", &self.response)
            .field("request_id", &self.request_id)
            .finish_non_exhaustive()
    }
}

impl ExtProcStream {
    /// A stream that routes through `router`.
    pub fn new(router: Arc<dyn Router>, config: Arc<StreamConfig>) -> Self {
        Self {
            router,
            config,
            handoffs: None,
            observes_responses: false,
            request_body_mode: None,
            response_body_mode: None,
            subset: None,
            request_id: None,
            request: RequestPhase::AwaitingHeaders,
            response: None,
            span: otel::RequestSpan::none(),
            unsampled_parent: None,
        }
    }

    /// The same stream in the response-observer layout: a routing stream parks its ticket in
    /// `handoffs` when it picks; the observer's stream (see [`Self::observing_responses`], or
    /// any stream in observability mode) claims it there.
    pub fn with_handoffs(self, handoffs: Arc<Handoffs>) -> Self {
        Self {
            handoffs: Some(handoffs),
            ..self
        }
    }

    /// The same stream as the response observer's: its request headers are never routed; it
    /// claims the ticket parked under their request id, answers every message (continuing, or
    /// swapping a rewritten model's name back in the response body), and reports the response.
    pub fn observing_responses(self) -> Self {
        Self {
            observes_responses: true,
            ..self
        }
    }

    /// The request id, once the request headers were seen (generated when the client sent none).
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// Whether a routed request is still waiting for its response to finish.
    pub fn has_open_ticket(&self) -> bool {
        self.response.is_some()
    }

    /// Handles one message from Envoy; returns the replies to send, in order.
    pub fn on_message(
        &mut self,
        msg: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, StreamError> {
        if self.request_body_mode.is_none() {
            self.learn_modes(msg.protocol_config.as_ref());
        }
        let metadata = msg.metadata_context.as_ref();
        let out = match msg.request {
            None => Ok(Vec::new()),
            Some(Request::RequestHeaders(h))
                if self.observes_responses || msg.observability_mode =>
            {
                self.on_observed_request_headers(&h)
            }
            Some(Request::RequestHeaders(h)) => self.on_request_headers(h, metadata),
            Some(Request::RequestBody(b)) => self.on_request_body(b, metadata),
            Some(Request::RequestTrailers(_)) => self.on_request_trailers(),
            Some(Request::ResponseHeaders(h)) => Ok(self.on_response_headers(&h, metadata)),
            Some(Request::ResponseBody(b)) => Ok(self.on_response_body(b)),
            Some(Request::ResponseTrailers(_)) => Ok(self.on_response_trailers()),
        }?;
        // In observability mode Envoy ignores replies.
        Ok(if msg.observability_mode {
            Vec::new()
        } else {
            out
        })
    }

    /// The stream ended (Envoy closed it, or it broke). Closes an open ticket: `End` when the
    /// response headers were seen and Envoy sends no response body (mode `NONE`), so the stream's
    /// end is all there is to see; `Aborted` otherwise.
    pub fn finish(mut self) {
        if let Some(obs) = self.response.take() {
            let complete = matches!(obs.phase, ResponsePhase::Body { .. })
                && self.response_body_mode == Some(BodyMode::None);
            let event = if complete {
                ResponseEvent::End
            } else {
                ResponseEvent::Aborted
            };
            tracing::debug!(?event, "ext_proc stream closed with the response open");
            obs.ticket.close(event);
        }
    }

    fn learn_modes(&mut self, pc: Option<&ProtocolConfiguration>) {
        let req = pc.and_then(|p| BodyMode::from_envoy(p.request_body_mode));
        let resp = pc.and_then(|p| BodyMode::from_envoy(p.response_body_mode));
        self.request_body_mode = Some(req.unwrap_or(self.config.request_body_mode));
        self.response_body_mode = Some(resp.unwrap_or(self.config.response_body_mode));
    }

    fn request_mode(&self) -> BodyMode {
        self.request_body_mode
            .unwrap_or(self.config.request_body_mode)
    }

    fn response_mode(&self) -> BodyMode {
        self.response_body_mode
            .unwrap_or(self.config.response_body_mode)
    }

    fn unexpected(&self, message: &'static str) -> StreamError {
        StreamError::Unexpected {
            message,
            phase: self.request.name(),
        }
    }

    fn note_subset(&mut self, metadata: Option<&Metadata>) {
        if let Some(hint) = subset_hint(metadata) {
            self.subset = Some(hint);
        }
    }

    /// An observer stream's request headers: never routed; the stream takes over the ticket the
    /// routing stream parked under the request id, if any, and observes the response for it.
    /// Answered with a plain continue (dropped in observability mode).
    fn on_observed_request_headers(
        &mut self,
        h: &HttpHeaders,
    ) -> Result<Vec<ProcessingResponse>, StreamError> {
        if !matches!(self.request, RequestPhase::AwaitingHeaders) {
            return Err(self.unexpected("request_headers"));
        }
        let head = RequestHead::parse(&h.headers);
        tracing::Span::current().record("request_id", head.request_id.as_str());
        self.request = RequestPhase::Forwarded;
        let header = |name: &str| {
            head.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        // A request id the EPP made up here names no parked ticket.
        let claimed = match &self.handoffs {
            Some(handoffs) if !head.request_id_generated => {
                let owner = header(REPLICA_HEADER).and_then(parse_replica);
                handoffs.claim(&head.request_id, owner)
            }
            _ => None,
        };
        self.response = claimed.map(|claimed| match claimed {
            Claimed::Local(observer) => observer,
            Claimed::Relay(relay) => Observer {
                ticket: Ticket {
                    sink: Some(Sink::Relay(relay)),
                    span: otel::RequestSpan::none(),
                },
                phase: ResponsePhase::AwaitingHeaders,
                rewriter: header(RESPONSE_MODEL_HEADER)
                    .and_then(decode_response_model)
                    .map(|m| ResponseRewriter::new(&m.served, &m.client)),
            },
        });
        if self.response.is_none() {
            tracing::debug!(request_id = %head.request_id, "observed a response without a parked ticket");
        }
        self.request_id = Some(head.request_id);
        // The relay's headers are for this stream; the engine need not see them.
        let relay_headers: Vec<String> = [REPLICA_HEADER, RESPONSE_MODEL_HEADER]
            .into_iter()
            .filter(|n| header(n).is_some())
            .map(str::to_owned)
            .collect();
        if relay_headers.is_empty() {
            return Ok(vec![continue_headers()]);
        }
        Ok(vec![ProcessingResponse {
            response: Some(Response::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(mutation(Vec::new(), &relay_headers)),
                    ..Default::default()
                }),
            })),
            ..Default::default()
        }])
    }

    fn on_request_headers(
        &mut self,
        h: HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> Result<Vec<ProcessingResponse>, StreamError> {
        if !matches!(self.request, RequestPhase::AwaitingHeaders) {
            return Err(self.unexpected("request_headers"));
        }
        self.note_subset(metadata);
        let head = RequestHead::parse(&h.headers);
        tracing::Span::current().record("request_id", head.request_id.as_str());
        match otel::head(&head.headers) {
            otel::Head::Trace { parent } => {
                self.span =
                    request_span(&head.method, &head.path, &head.request_id, parent.as_ref());
            }
            otel::Head::Skip { traceparent } => self.unsampled_parent = traceparent,
        }
        self.request_id = Some(head.request_id.clone());
        let mode = self.request_mode();
        if h.end_of_stream || mode == BodyMode::None {
            return Ok(self.route(&head, None, Delivery::Headers));
        }
        let (duplex, reply) = match mode {
            BodyMode::FullDuplexStreamed => (true, None),
            BodyMode::Buffered | BodyMode::BufferedPartial => (false, Some(continue_headers())),
            BodyMode::None | BodyMode::Streamed | BodyMode::Grpc => {
                tracing::error!(
                    ?mode,
                    "unsupported ext_proc request_body_mode; configure FULL_DUPLEX_STREAMED or BUFFERED"
                );
                return Ok(self.refuse(Refusal {
                    status: 500,
                    reason: "unsupported-body-mode",
                    message: format!(
                        "the gateway sends request bodies to the endpoint picker in {mode:?} mode; \
                         it needs FULL_DUPLEX_STREAMED or BUFFERED"
                    ),
                }));
            }
        };
        match BodyBuffer::new(self.config.max_body_bytes, head.content_length) {
            Ok(body) => {
                self.request = RequestPhase::Collecting { head, body, duplex };
                Ok(reply.into_iter().collect())
            }
            Err(too_large) => Ok(self.refuse(too_large_refusal(too_large))),
        }
    }

    fn on_request_body(
        &mut self,
        b: HttpBody,
        metadata: Option<&Metadata>,
    ) -> Result<Vec<ProcessingResponse>, StreamError> {
        self.note_subset(metadata);
        let RequestPhase::Collecting { body, duplex, .. } = &mut self.request else {
            return match self.request {
                RequestPhase::Refused => Ok(Vec::new()),
                _ => Err(self.unexpected("request_body")),
            };
        };
        if let Err(too_large) = body.push(&b.body) {
            return Ok(self.refuse(too_large_refusal(too_large)));
        }
        let duplex = *duplex;
        if duplex && !b.end_of_stream {
            return Ok(Vec::new());
        }
        if !duplex && !b.end_of_stream && self.request_mode() == BodyMode::BufferedPartial {
            return Ok(self.refuse(Refusal {
                status: 413,
                reason: "payload-too-large",
                message: "the request body is larger than the gateway's buffer".into(),
            }));
        }
        let delivery = if duplex {
            Delivery::Duplex { trailers: false }
        } else {
            Delivery::Buffered
        };
        Ok(self.complete_body(delivery))
    }

    fn on_request_trailers(&mut self) -> Result<Vec<ProcessingResponse>, StreamError> {
        match &self.request {
            RequestPhase::Collecting { duplex: true, .. } => {
                Ok(self.complete_body(Delivery::Duplex { trailers: true }))
            }
            RequestPhase::Forwarded => Ok(vec![trailers_reply(Response::RequestTrailers)]),
            RequestPhase::Refused => Ok(Vec::new()),
            RequestPhase::AwaitingHeaders | RequestPhase::Collecting { .. } => {
                Err(self.unexpected("request_trailers"))
            }
        }
    }

    /// The body is complete: route on it.
    fn complete_body(&mut self, delivery: Delivery) -> Vec<ProcessingResponse> {
        match std::mem::replace(&mut self.request, RequestPhase::Forwarded) {
            RequestPhase::Collecting { head, body, .. } => {
                self.route(&head, Some(body.into_inner()), delivery)
            }
            other => {
                // Callers only get here from `Collecting`; keep the phase as it was.
                self.request = other;
                Vec::new()
            }
        }
    }

    fn refuse(&mut self, refusal: Refusal) -> Vec<ProcessingResponse> {
        tracing::debug!(
            status = refusal.status,
            reason = refusal.reason,
            message = %refusal.message,
            "request answered by the EPP"
        );
        self.request = RequestPhase::Refused;
        self.span.set_all([
            KeyValue::new("http.response.status_code", otel::int(refusal.status)),
            KeyValue::new("outcome", refusal.reason),
        ]);
        vec![refusal.into_response(self.request_id.as_deref())]
    }

    fn route(
        &mut self,
        head: &RequestHead,
        body: Option<Vec<u8>>,
        delivery: Delivery,
    ) -> Vec<ProcessingResponse> {
        if self.subset.as_ref().is_some_and(Vec::is_empty) {
            return self.refuse(Refusal {
                status: 503,
                reason: "empty-subset",
                message: "no endpoint is allowed by the gateway's subset hint".into(),
            });
        }
        let input = RoutingInput {
            method: &head.method,
            path: &head.path,
            headers: &head.headers,
            body: body.as_deref(),
            subset: self.subset.clone(),
            request_id: Some(&head.request_id),
            trace: &self.span,
        };
        let decision = match self.router.route(input) {
            Ok(d) => d,
            Err(rejection) => return self.refuse(Refusal::from(&rejection)),
        };
        if let Err(problem) = validate(&decision) {
            tracing::error!(%problem, endpoints = ?decision.endpoints, "router returned an unusable decision");
            // The router's ticket ends here; the span's outcome is the refusal's.
            self.router
                .on_response(decision.ticket, ResponseEvent::Aborted);
            return self.refuse(Refusal {
                status: 503,
                reason: "invalid-decision",
                message: "the endpoint picker could not pick an endpoint".into(),
            });
        }
        let ticket = Ticket {
            sink: Some(Sink::Local {
                id: decision.ticket,
                router: Arc::clone(&self.router),
            }),
            span: self.span.clone(),
        };
        let Decision {
            endpoints,
            body: new_body,
            add_headers,
            response_model,
            ..
        } = decision;
        let header = match self.config.header_endpoints {
            HeaderEndpoints::Primary => endpoints.first().cloned().unwrap_or_default(),
            HeaderEndpoints::All => endpoints.join(","),
        };
        let endpoints = endpoints.join(",");
        tracing::Span::current().record("endpoint", endpoints.as_str());
        if self.span.is_recording() {
            self.span.set(KeyValue::new("endpoints", endpoints.clone()));
        }
        tracing::debug!(endpoint = %endpoints, "picked");

        let body_changed = new_body.is_some();
        let forwarded = new_body.or(body);
        let mut set_headers = vec![set(DESTINATION_ENDPOINT_HEADER, &header)];
        set_headers.extend(
            add_headers
                .iter()
                .map(|(k, v)| set(&k.to_ascii_lowercase(), v)),
        );
        if head.request_id_generated {
            set_headers.push(set(super::REQUEST_ID_HEADER, &head.request_id));
        }
        // An observer stream on another replica relays the response's events back here.
        if let Some(relay) = self.handoffs.as_ref().and_then(|h| h.relay()) {
            set_headers.push(set(REPLICA_HEADER, relay.header_value()));
            if let Some(value) = response_model.as_ref().and_then(encode_response_model) {
                set_headers.push(set(RESPONSE_MODEL_HEADER, &value));
            }
        }
        // The engine's side of the trace continues from this request's span (nothing is
        // written when tracing is off: a client's own `traceparent` passes through).
        set_headers.extend(
            self.span
                .trace_headers()
                .iter()
                .map(|(name, value)| set(name, value)),
        );
        if let Some(parent) = &self.unsampled_parent {
            set_headers.push(set("traceparent", parent));
        }
        let content_length = match delivery {
            Delivery::Duplex { .. } => forwarded.as_ref().map(Vec::len),
            Delivery::Buffered if body_changed => forwarded.as_ref().map(Vec::len),
            Delivery::Buffered | Delivery::Headers => None,
        };
        if let Some(len) = content_length {
            set_headers.push(set("content-length", &len.to_string()));
        }
        let common = CommonResponse {
            header_mutation: Some(mutation(set_headers, &head.strip)),
            clear_route_cache: true,
            ..Default::default()
        };
        let dynamic_metadata = Some(destination(&endpoints));

        self.request = RequestPhase::Forwarded;
        let observer = Observer {
            ticket,
            phase: ResponsePhase::AwaitingHeaders,
            rewriter: response_model.map(|m| ResponseRewriter::new(&m.served, &m.client)),
        };
        // In the response-observer layout the response goes to the observer's stream, which
        // claims the ticket (and the model rewrite) by request id.
        match &self.handoffs {
            Some(handoffs) => handoffs.park(&head.request_id, observer),
            None => self.response = Some(observer),
        }

        match delivery {
            Delivery::Headers => vec![ProcessingResponse {
                response: Some(Response::RequestHeaders(HeadersResponse {
                    response: Some(common),
                })),
                dynamic_metadata,
                ..Default::default()
            }],
            Delivery::Buffered => {
                let common = CommonResponse {
                    body_mutation: body_changed.then(|| BodyMutation {
                        mutation: forwarded.map(Mutation::Body),
                    }),
                    ..common
                };
                vec![ProcessingResponse {
                    response: Some(Response::RequestBody(BodyResponse {
                        response: Some(common),
                    })),
                    dynamic_metadata,
                    ..Default::default()
                }]
            }
            Delivery::Duplex { trailers } => {
                let body = forwarded.unwrap_or_default();
                let mut out = Vec::with_capacity(body.len() / super::MAX_CHUNK_BYTES + 3);
                out.push(ProcessingResponse {
                    response: Some(Response::RequestHeaders(HeadersResponse {
                        response: Some(common),
                    })),
                    dynamic_metadata,
                    ..Default::default()
                });
                out.extend(
                    streamed_chunks(&body, !trailers).map(|c| streamed(c, Response::RequestBody)),
                );
                if trailers {
                    out.push(trailers_reply(Response::RequestTrailers));
                }
                out
            }
        }
    }

    fn on_response_headers(
        &mut self,
        h: &HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        // A rewritten body may change length: let it go out chunked (only when Envoy will send
        // the body to be rewritten).
        let rewriting = self.response_mode() != BodyMode::None
            && self.response.as_ref().is_some_and(|o| o.rewriter.is_some());
        let common = if rewriting {
            CommonResponse {
                header_mutation: Some(mutation(Vec::new(), &["content-length".to_owned()])),
                ..Default::default()
            }
        } else {
            CommonResponse::default()
        };
        let reply = ProcessingResponse {
            response: Some(Response::ResponseHeaders(HeadersResponse {
                response: Some(common),
            })),
            ..Default::default()
        };
        let Some(obs) = self.response.as_mut() else {
            return vec![reply];
        };
        if !matches!(obs.phase, ResponsePhase::AwaitingHeaders) {
            return vec![reply];
        }
        let status = find(&h.headers, ":status")
            .and_then(|v| value_of(v).trim().parse().ok())
            .unwrap_or(0);
        let served = served_endpoint(metadata);
        obs.ticket.report(ResponseEvent::Headers { status, served });
        if h.end_of_stream {
            self.close(ResponseEvent::End);
            return vec![reply];
        }
        let content_type = find(&h.headers, "content-type").map(value_of);
        let content_encoding = find(&h.headers, "content-encoding").map(value_of);
        let limits = Limits {
            line: self.config.sse_line_limit,
            tail: self.config.json_tail_limit,
        };
        obs.phase = ResponsePhase::Body {
            scanner: UsageScanner::for_response(
                content_type.as_deref(),
                content_encoding.as_deref(),
                limits,
            ),
            first_byte_seen: false,
        };
        vec![reply]
    }

    fn on_response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let mode = self.response_mode();
        // Buffered modes deliver the whole body (or all Envoy will send) in this one message.
        let last =
            b.end_of_stream || matches!(mode, BodyMode::Buffered | BodyMode::BufferedPartial);
        let rewritten = self
            .response
            .as_mut()
            .and_then(|o| o.rewriter.as_mut())
            .map(|rw| rw.feed(&b.body, last));
        let mut ended = false;
        if let Some(Observer {
            ticket,
            phase:
                ResponsePhase::Body {
                    scanner,
                    first_byte_seen,
                },
            ..
        }) = self.response.as_mut()
        {
            if !*first_byte_seen && !b.body.is_empty() {
                *first_byte_seen = true;
                ticket.report(ResponseEvent::FirstByte);
            }
            let mut usage = scanner.feed(&b.body);
            if b.end_of_stream {
                usage = scanner.finish().or(usage);
                ended = true;
            }
            if let Some(u) = usage {
                ticket.report(usage_event(u));
            }
        }
        if ended {
            self.close(ResponseEvent::End);
        }
        let reply = if mode == BodyMode::FullDuplexStreamed {
            streamed(
                StreamedBodyResponse {
                    body: rewritten.unwrap_or(b.body),
                    end_of_stream: b.end_of_stream,
                    ..Default::default()
                },
                Response::ResponseBody,
            )
        } else {
            ProcessingResponse {
                response: Some(Response::ResponseBody(BodyResponse {
                    response: Some(CommonResponse {
                        body_mutation: rewritten.map(|body| BodyMutation {
                            mutation: Some(Mutation::Body(body)),
                        }),
                        ..Default::default()
                    }),
                })),
                ..Default::default()
            }
        };
        vec![reply]
    }

    fn on_response_trailers(&mut self) -> Vec<ProcessingResponse> {
        let mut out = Vec::new();
        let held = self
            .response
            .as_mut()
            .and_then(|o| o.rewriter.as_mut())
            .map(ResponseRewriter::flush)
            .unwrap_or_default();
        if !held.is_empty() && self.response_mode() == BodyMode::FullDuplexStreamed {
            out.push(streamed(
                StreamedBodyResponse {
                    body: held,
                    end_of_stream: false,
                    ..Default::default()
                },
                Response::ResponseBody,
            ));
        }
        if let Some(Observer {
            ticket,
            phase: ResponsePhase::Body { scanner, .. },
            ..
        }) = self.response.as_mut()
            && let Some(u) = scanner.finish()
        {
            ticket.report(usage_event(u));
        }
        self.close(ResponseEvent::End);
        out.push(trailers_reply(Response::ResponseTrailers));
        out
    }

    fn close(&mut self, event: ResponseEvent) {
        if let Some(obs) = self.response.take() {
            obs.ticket.close(event);
        }
    }
}

fn validate(decision: &Decision) -> Result<(), String> {
    if decision.endpoints.is_empty() {
        return Err("no endpoint".into());
    }
    if let Some(bad) = decision
        .endpoints
        .iter()
        .find(|e| e.parse::<SocketAddr>().is_err())
    {
        return Err(format!("{bad:?} is not ip:port"));
    }
    if let Some((bad, _)) = decision
        .add_headers
        .iter()
        .find(|(k, _)| k.is_empty() || k.starts_with(':'))
    {
        return Err(format!("header {bad:?} cannot be set"));
    }
    Ok(())
}

fn too_large_refusal(t: TooLarge) -> Refusal {
    Refusal {
        status: 413,
        reason: "payload-too-large",
        message: format!(
            "request body of at least {} bytes is larger than the limit of {} bytes",
            t.seen, t.limit
        ),
    }
}

fn usage_event(u: Usage) -> ResponseEvent {
    ResponseEvent::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_tokens: u.cached_tokens,
    }
}

fn continue_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse::default()),
        })),
        ..Default::default()
    }
}

fn trailers_reply(which: fn(TrailersResponse) -> Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(which(TrailersResponse::default())),
        ..Default::default()
    }
}

fn streamed(
    chunk: StreamedBodyResponse,
    which: fn(BodyResponse) -> Response,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(which(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(Mutation::StreamedResponse(chunk)),
                }),
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
pub(super) mod tests;
