//! The EPP's per-stream ext_proc state machine (`kvgate_epp::extproc::ExtProcStream`), fed a
//! sequence of up to 24 Envoy `ProcessingRequest` messages built from the input: request
//! headers (pseudo-headers, `content-length`, request id, control headers, `end_of_stream`),
//! request body chunks (some around or past the 62,000-byte re-chunking size) with or without
//! `end_of_stream`, request trailers, response headers, body chunks and trailers, each with an
//! optional protocol configuration (any body modes, known or not), subset-hint or
//! served-endpoint metadata, and observability mode. The stream's limits come from the input
//! too, and so does the router behind it: endpoints (usable or not), a replacement body, extra
//! headers, a model rewrite, or a rejection. The stream is finished after the last message, or
//! after the first one it refuses, as the gRPC server does.
//!
//! Asserts, besides "no panic":
//! - the router is asked at most once per stream;
//! - its ticket hears at most one `Headers`, at most one `FirstByte`, no `FirstByte` or `Usage`
//!   before `Headers`, nothing after its terminal event, and exactly one terminal event once the
//!   stream is finished (`Aborted` alone when the decision was unusable);
//! - every body chunk sent back as a `streamed_response` is at most `MAX_CHUNK_BYTES`;
//! - a `FULL_DUPLEX_STREAMED` request's re-sent body chunks join to exactly the body forwarded
//!   (the router's replacement, else the body it was shown), and only the last may carry
//!   `end_of_stream`;
//! - with a model rewrite and `FULL_DUPLEX_STREAMED` responses, the rewritten chunks of a
//!   response body that ended join to what rewriting the whole body at once gives.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation::Mutation, processing_request::Request,
    processing_response::Response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvgate_epp::extproc::{
    BodyMode, Decision, ExtProcStream, HeaderEndpoints, MAX_CHUNK_BYTES, Rejection, ResponseEvent,
    ResponseModel, ResponseRewriter, Router, RoutingInput, StreamConfig,
};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const TICKET: u64 = 7;
const MAX_MESSAGES: usize = 24;

/// What the router answers, drawn from the input before the messages.
#[derive(Debug, Clone)]
enum Plan {
    Reject(Rejection),
    Decide {
        decision: Decision,
        /// Whether `decision` passes the stream's checks (by construction).
        usable: bool,
    },
}

/// What the router saw and heard.
#[derive(Debug, Default)]
struct Record {
    routes: usize,
    /// The body it was shown, when it decided.
    body: Option<Option<Vec<u8>>>,
    events: Vec<(u64, ResponseEvent)>,
}

#[derive(Debug)]
struct FuzzRouter {
    plan: Plan,
    record: Mutex<Record>,
}

impl Router for FuzzRouter {
    fn route(&self, input: RoutingInput<'_>) -> std::result::Result<Decision, Rejection> {
        let mut r = self.record.lock().unwrap();
        r.routes += 1;
        match &self.plan {
            Plan::Reject(rejection) => Err(rejection.clone()),
            Plan::Decide { decision, .. } => {
                r.body = Some(input.body.map(<[u8]>::to_vec));
                Ok(decision.clone())
            }
        }
    }

    fn on_response(&self, ticket: u64, event: ResponseEvent) {
        self.record.lock().unwrap().events.push((ticket, event));
    }
}

fn text(u: &mut Unstructured<'_>, max: usize) -> Result<String> {
    let len = u.arbitrary_len::<u8>()?.min(max);
    Ok(String::from_utf8_lossy(u.bytes(len)?).into_owned())
}

fn blob(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<u8>> {
    let len = u.arbitrary_len::<u8>()?.min(max);
    Ok(u.bytes(len)?.to_vec())
}

fn pick<'a>(u: &mut Unstructured<'_>, options: &[&'a str]) -> Result<String> {
    // The last choice is a string from the input.
    let i = u.int_in_range(0..=options.len())?;
    match options.get(i) {
        Some(s) => Ok((*s).to_owned()),
        None => text(u, 40),
    }
}

fn body_mode(u: &mut Unstructured<'_>) -> Result<BodyMode> {
    Ok(*u.choose(&[
        BodyMode::None,
        BodyMode::Streamed,
        BodyMode::Buffered,
        BodyMode::BufferedPartial,
        BodyMode::FullDuplexStreamed,
        BodyMode::Grpc,
    ])?)
}

fn config(u: &mut Unstructured<'_>) -> Result<StreamConfig> {
    Ok(StreamConfig {
        max_body_bytes: *u.choose(&[0, 16, 1000, 70_000, 16 << 20])?,
        request_body_mode: body_mode(u)?,
        response_body_mode: body_mode(u)?,
        sse_line_limit: *u.choose(&[0, 16, 64 << 10])?,
        json_tail_limit: *u.choose(&[0, 16, 64 << 10])?,
        header_endpoints: if u.arbitrary()? {
            HeaderEndpoints::All
        } else {
            HeaderEndpoints::Primary
        },
    })
}

fn plan(u: &mut Unstructured<'_>) -> Result<Plan> {
    let message = text(u, 20)?;
    Ok(match u.int_in_range(0..=5u8)? {
        0 => Plan::Reject(Rejection::BadRequest(message)),
        1 => Plan::Reject(Rejection::PayloadTooLarge(message)),
        2 => Plan::Reject(Rejection::TooManyRequests(message)),
        3 => Plan::Reject(Rejection::Unavailable(message)),
        _ => {
            let mut usable = true;
            let mut endpoints = Vec::new();
            for _ in 0..u.int_in_range(0..=3u8)? {
                let e = pick(u, &["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::7]:8200"])?;
                usable &= e.parse::<std::net::SocketAddr>().is_ok();
                endpoints.push(e);
            }
            usable &= !endpoints.is_empty();
            let mut add_headers = Vec::new();
            for _ in 0..u.int_in_range(0..=2u8)? {
                let k = pick(u, &["x-prefiller-host-port", "X-Kvgate-Leg", ":path", ""])?;
                usable &= !k.is_empty() && !k.starts_with(':');
                add_headers.push((k, text(u, 20)?));
            }
            let body = if u.arbitrary()? {
                Some(blob(u, 200)?)
            } else {
                None
            };
            let response_model = if u.arbitrary()? {
                Some(ResponseModel {
                    served: pick(u, &["lora-a", "m"])?,
                    client: pick(u, &["llama", "m", ""])?,
                })
            } else {
                None
            };
            Plan::Decide {
                decision: Decision {
                    endpoints,
                    body,
                    add_headers,
                    ticket: TICKET,
                    response_model,
                },
                usable,
            }
        }
    })
}

fn headers(u: &mut Unstructured<'_>, response: bool) -> Result<Option<HeaderMap>> {
    if u.ratio(1, 16)? {
        return Ok(None);
    }
    let keys: &[&str] = if response {
        &[
            ":status",
            "content-type",
            "content-encoding",
            "content-length",
        ]
    } else {
        &[
            ":method",
            ":path",
            "content-type",
            "content-length",
            "x-request-id",
            "x-gateway-destination-endpoint",
            "x-gateway-destination-endpoint-subset",
            "x-gateway-inference-objective",
            "x-kvgate-drop-reason",
        ]
    };
    let mut out = Vec::new();
    for _ in 0..u.int_in_range(0..=6u8)? {
        let key = pick(u, keys)?;
        let value = match key.as_str() {
            ":method" => pick(u, &["POST", "GET"])?,
            ":path" => pick(
                u,
                &["/v1/completions", "/v1/chat/completions", "/v1/models"],
            )?,
            ":status" => pick(u, &["200", "500", " 200 "])?,
            "content-type" => pick(
                u,
                &[
                    "application/json",
                    "text/event-stream",
                    "text/event-stream; charset=utf-8",
                ],
            )?,
            "content-encoding" => pick(u, &["gzip", "identity"])?,
            "content-length" => pick(u, &["0", "12", "100000", "18446744073709551616", "-1"])?,
            _ => text(u, 40)?,
        };
        // Envoy sends `raw_value` (newer) or `value` (older).
        out.push(if u.arbitrary()? {
            HeaderValue {
                key,
                raw_value: value.into_bytes(),
                ..Default::default()
            }
        } else {
            HeaderValue {
                key,
                value,
                ..Default::default()
            }
        });
    }
    Ok(Some(HeaderMap { headers: out }))
}

fn metadata(u: &mut Unstructured<'_>) -> Result<Option<Metadata>> {
    let (namespace, key) = match u.int_in_range(0..=3u8)? {
        0 | 1 => return Ok(None),
        2 => (
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
        ),
        _ => ("envoy.lb", "x-gateway-destination-endpoint-served"),
    };
    let entries = [
        "10.0.0.1",
        "10.0.0.1:8000",
        "[fd00::7]",
        "10.0.0.2:8000,x",
        "",
    ];
    let kind = match u.int_in_range(0..=3u8)? {
        0 => Kind::NullValue(0),
        1 => Kind::BoolValue(true),
        2 => Kind::StringValue(pick(u, &entries)?),
        _ => {
            let mut values = Vec::new();
            for _ in 0..u.int_in_range(0..=3u8)? {
                values.push(Value {
                    kind: Some(Kind::StringValue(pick(u, &entries)?)),
                });
            }
            Kind::ListValue(ListValue { values })
        }
    };
    Ok(Some(Metadata {
        filter_metadata: HashMap::from([(
            namespace.to_owned(),
            Struct {
                fields: HashMap::from([(key.to_owned(), Value { kind: Some(kind) })]),
            },
        )]),
        ..Default::default()
    }))
}

fn request_body(u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
    let body = blob(u, 512)?;
    // Now and then around or past one re-sent chunk (62,000 bytes), the input's bytes repeated.
    if !body.is_empty() && u.ratio(1, 8)? {
        let len = *u.choose(&[
            MAX_CHUNK_BYTES - 1,
            MAX_CHUNK_BYTES,
            MAX_CHUNK_BYTES + 1,
            130_000,
        ])?;
        let mut big = body.repeat(len / body.len() + 1);
        big.truncate(len);
        return Ok(big);
    }
    Ok(body)
}

fn response_body(u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
    let mut body = blob(u, 256)?;
    let piece = pick(
        u,
        &[
            "\"model\":\"lora-a\"",
            "\"model\": \"lora-a\"",
            "data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n",
            "{\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":1}}}",
        ],
    )?;
    let at = u.int_in_range(0..=body.len())?;
    body.splice(at..at, piece.into_bytes());
    Ok(body)
}

fn message(u: &mut Unstructured<'_>) -> Result<ProcessingRequest> {
    let protocol_config = if u.ratio(1, 4)? {
        Some(ProtocolConfiguration {
            request_body_mode: u.int_in_range(0..=6)?,
            response_body_mode: u.int_in_range(0..=6)?,
            ..Default::default()
        })
    } else {
        None
    };
    let request = match u.int_in_range(0..=6u8)? {
        0 => None,
        1 => Some(Request::RequestHeaders(HttpHeaders {
            headers: headers(u, false)?,
            end_of_stream: u.arbitrary()?,
            ..Default::default()
        })),
        2 => Some(Request::RequestBody(HttpBody {
            body: request_body(u)?,
            end_of_stream: u.arbitrary()?,
            ..Default::default()
        })),
        3 => Some(Request::RequestTrailers(HttpTrailers::default())),
        4 => Some(Request::ResponseHeaders(HttpHeaders {
            headers: headers(u, true)?,
            end_of_stream: u.ratio(1, 4)?,
            ..Default::default()
        })),
        5 => Some(Request::ResponseBody(HttpBody {
            body: response_body(u)?,
            end_of_stream: u.ratio(1, 3)?,
            ..Default::default()
        })),
        _ => Some(Request::ResponseTrailers(HttpTrailers::default())),
    };
    Ok(ProcessingRequest {
        metadata_context: metadata(u)?,
        observability_mode: u.ratio(1, 32)?,
        protocol_config,
        request,
        ..Default::default()
    })
}

/// The streamed body chunks of one kind of reply.
fn streamed_chunks(replies: &[ProcessingResponse], response_side: bool) -> Vec<(Vec<u8>, bool)> {
    replies
        .iter()
        .filter_map(|r| {
            let body: &BodyResponse = match (&r.response, response_side) {
                (Some(Response::RequestBody(b)), false)
                | (Some(Response::ResponseBody(b)), true) => b,
                _ => return None,
            };
            match body
                .response
                .as_ref()?
                .body_mutation
                .as_ref()?
                .mutation
                .as_ref()?
            {
                Mutation::StreamedResponse(c) => Some((c.body.clone(), c.end_of_stream)),
                Mutation::Body(_) | Mutation::ClearBody(_) => None,
            }
        })
        .collect()
}

/// Response body chunks seen while a model rewrite was active, and what came out.
#[derive(Debug, Default)]
struct RewriteCheck {
    fed: Vec<u8>,
    out: Vec<u8>,
    headers_seen: bool,
    /// The segment ended (end of stream or trailers) and can be compared.
    closed: bool,
    /// Replies were dropped (observability mode) or the segment ended before any body.
    void: bool,
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let config = Arc::new(config(u)?);
    let plan = plan(u)?;
    let router = Arc::new(FuzzRouter {
        plan: plan.clone(),
        record: Mutex::default(),
    });
    let dyn_router: Arc<dyn Router> = router.clone();
    let mut stream = ExtProcStream::new(dyn_router, Arc::clone(&config));

    let mut messages = Vec::new();
    while messages.len() < MAX_MESSAGES && !u.is_empty() {
        messages.push(message(u)?);
    }
    // The response body mode the stream learns from the first message (as Envoy sends it).
    let response_mode = messages
        .first()
        .and_then(|m| m.protocol_config.as_ref())
        .and_then(|p| BodySendMode::try_from(p.response_body_mode).ok())
        .map_or(
            config.response_body_mode == BodyMode::FullDuplexStreamed,
            |m| m == BodySendMode::FullDuplexStreamed,
        );
    let rewriting = response_mode
        && matches!(&plan, Plan::Decide { decision, usable: true } if decision.response_model.is_some());

    let mut request_chunks = Vec::new();
    let mut check = RewriteCheck::default();
    for msg in messages {
        let observed = msg.observability_mode;
        let routed_before = router.record.lock().unwrap().routes > 0;
        let kind = msg.request.clone();
        let replies = match stream.on_message(msg) {
            Ok(replies) => replies,
            Err(_) => break,
        };
        for r in &replies {
            if let Some(Response::RequestBody(b) | Response::ResponseBody(b)) = &r.response
                && let Some(Mutation::StreamedResponse(c)) = b
                    .response
                    .as_ref()
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.as_ref())
            {
                assert!(c.body.len() <= MAX_CHUNK_BYTES, "streamed chunk too large");
            }
        }
        request_chunks.extend(streamed_chunks(&replies, false));

        // Follow the response side of a rewritten request (routed on an earlier message).
        if rewriting && routed_before && !check.closed {
            check.void |= observed;
            match kind {
                Some(Request::ResponseHeaders(h)) if !check.headers_seen => {
                    check.headers_seen = true;
                    if h.end_of_stream {
                        check.closed = true;
                        check.void = true;
                    }
                }
                Some(Request::ResponseBody(b)) => {
                    check.fed.extend_from_slice(&b.body);
                    for (c, _) in streamed_chunks(&replies, true) {
                        check.out.extend(c);
                    }
                    check.closed |= b.end_of_stream;
                }
                Some(Request::ResponseTrailers(_)) => {
                    for (c, _) in streamed_chunks(&replies, true) {
                        check.out.extend(c);
                    }
                    check.closed = true;
                }
                _ => {}
            }
        }
    }
    stream.finish();

    let record = router.record.lock().unwrap();
    assert!(record.routes <= 1, "router asked {} times", record.routes);
    let events: Vec<&ResponseEvent> = record
        .events
        .iter()
        .map(|(ticket, e)| {
            assert_eq!(*ticket, TICKET, "event for a ticket never issued");
            e
        })
        .collect();
    match (&plan, &record.body) {
        (Plan::Decide { usable, .. }, Some(_)) => {
            let terminal = events.iter().filter(|e| e.is_terminal()).count();
            assert_eq!(terminal, 1, "ticket closed {terminal} times: {events:?}");
            assert!(events.last().is_some_and(|e| e.is_terminal()), "{events:?}");
            if !usable {
                assert_eq!(events, [&ResponseEvent::Aborted], "unusable decision");
            }
            let count = |f: fn(&ResponseEvent) -> bool| events.iter().filter(|e| f(e)).count();
            assert!(count(|e| matches!(e, ResponseEvent::Headers { .. })) <= 1);
            assert!(count(|e| matches!(e, ResponseEvent::FirstByte)) <= 1);
            let first_headers = events
                .iter()
                .position(|e| matches!(e, ResponseEvent::Headers { .. }));
            for (i, e) in events.iter().enumerate() {
                if matches!(e, ResponseEvent::FirstByte | ResponseEvent::Usage { .. }) {
                    assert!(first_headers.is_some_and(|h| h < i), "{e:?} before headers");
                }
            }
        }
        _ => assert!(events.is_empty(), "events without a ticket: {events:?}"),
    }

    // The re-sent request body.
    if !request_chunks.is_empty() {
        let Plan::Decide { decision, .. } = &plan else {
            panic!("request body re-sent without a decision");
        };
        let shown = record.body.clone().flatten();
        let forwarded = decision.body.clone().or(shown).unwrap_or_default();
        let joined = request_chunks
            .iter()
            .map(|(c, _)| c.as_slice())
            .collect::<Vec<_>>()
            .concat();
        assert_eq!(
            joined, forwarded,
            "re-sent body differs from the forwarded one"
        );
        let ends = request_chunks.iter().filter(|(_, eos)| *eos).count();
        assert!(ends <= 1, "{ends} chunks carry end_of_stream");
        if ends == 1 {
            assert!(request_chunks.last().is_some_and(|(_, eos)| *eos));
        }
    }

    // The rewritten response body, chunked versus whole.
    if rewriting && check.closed && !check.void {
        let Plan::Decide { decision, .. } = &plan else {
            return Ok(());
        };
        if let Some(m) = &decision.response_model {
            let whole = ResponseRewriter::new(&m.served, &m.client).feed(&check.fed, true);
            assert_eq!(check.out, whole, "chunked rewrite differs from the whole");
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
