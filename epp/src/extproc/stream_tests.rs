//! Message-by-message tests of [`ExtProcStream`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpTrailers, ImmediateResponse};
use envoy_types::pb::google::protobuf::{ListValue, Value, value::Kind};
use proptest::prelude::*;

use super::*;
use crate::extproc::metadata::tests::with;
use crate::extproc::router::{Rejection, ResponseModel};
use crate::extproc::{MAX_CHUNK_BYTES, SUBSET_METADATA_KEY, SUBSET_METADATA_NAMESPACE};

/// What the router was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Option<Vec<u8>>,
    subset: Option<Vec<String>>,
    request_id: Option<String>,
}

type Decide = dyn Fn(&Seen) -> Result<Decision, Rejection> + Send + Sync;

struct FakeRouter {
    decide: Box<Decide>,
    next: AtomicU64,
    seen: Mutex<Vec<Seen>>,
    events: Mutex<Vec<(u64, ResponseEvent)>>,
}

impl FakeRouter {
    fn new(
        decide: impl Fn(&Seen) -> Result<Decision, Rejection> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            decide: Box::new(decide),
            next: AtomicU64::new(1),
            seen: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
        })
    }

    fn picking(endpoints: &[&str]) -> Arc<Self> {
        let endpoints: Vec<String> = endpoints.iter().map(|e| (*e).to_owned()).collect();
        Self::new(move |_| {
            Ok(Decision {
                endpoints: endpoints.clone(),
                body: None,
                add_headers: Vec::new(),
                ticket: 0,
                response_model: None,
            })
        })
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn events(&self) -> Vec<(u64, ResponseEvent)> {
        self.events.lock().unwrap().clone()
    }
}

impl Router for FakeRouter {
    fn route(&self, input: RoutingInput<'_>) -> Result<Decision, Rejection> {
        let seen = Seen {
            method: input.method.to_owned(),
            path: input.path.to_owned(),
            headers: input.headers.to_vec(),
            body: input.body.map(<[u8]>::to_vec),
            subset: input.subset,
            request_id: input.request_id.map(str::to_owned),
        };
        self.seen.lock().unwrap().push(seen.clone());
        let mut d = (self.decide)(&seen)?;
        d.ticket = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(d)
    }

    fn on_response(&self, ticket: u64, event: ResponseEvent) {
        self.events.lock().unwrap().push((ticket, event));
    }
}

fn stream(router: &Arc<FakeRouter>) -> ExtProcStream {
    stream_with(router, StreamConfig::default())
}

fn stream_with(router: &Arc<FakeRouter>, config: StreamConfig) -> ExtProcStream {
    let r: Arc<dyn Router> = router.clone();
    ExtProcStream::new(r, Arc::new(config))
}

pub(crate) fn header_map(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    })
}

pub(crate) fn modes(
    request: BodySendMode,
    response: BodySendMode,
) -> Option<ProtocolConfiguration> {
    Some(ProtocolConfiguration {
        request_body_mode: request as i32,
        response_body_mode: response as i32,
        ..Default::default()
    })
}

pub(crate) fn req_headers(pairs: &[(&str, &str)], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: header_map(pairs),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn post(pc: Option<ProtocolConfiguration>) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: pc,
        ..req_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("content-type", "application/json"),
                ("x-request-id", "req-1"),
            ],
            false,
        )
    }
}

pub(crate) fn req_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn req_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestTrailers(HttpTrailers::default())),
        ..Default::default()
    }
}

pub(crate) fn resp_headers(
    status: &str,
    content_type: &str,
    eos: bool,
    served: Option<&str>,
) -> ProcessingRequest {
    ProcessingRequest {
        metadata_context: served.map(|s| {
            with(
                "envoy.lb",
                "x-gateway-destination-endpoint-served",
                Kind::StringValue(s.into()),
            )
        }),
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: header_map(&[(":status", status), ("content-type", content_type)]),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(crate) fn resp_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn resp_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseTrailers(HttpTrailers::default())),
        ..Default::default()
    }
}

fn kind(r: &ProcessingResponse) -> &'static str {
    match &r.response {
        Some(Response::RequestHeaders(_)) => "request_headers",
        Some(Response::RequestBody(_)) => "request_body",
        Some(Response::RequestTrailers(_)) => "request_trailers",
        Some(Response::ResponseHeaders(_)) => "response_headers",
        Some(Response::ResponseBody(_)) => "response_body",
        Some(Response::ResponseTrailers(_)) => "response_trailers",
        Some(Response::ImmediateResponse(_)) => "immediate",
        Some(Response::StreamedImmediateResponse(_)) => "streamed_immediate",
        None => "none",
    }
}

fn kinds(out: &[ProcessingResponse]) -> Vec<&'static str> {
    out.iter().map(kind).collect()
}

fn common(r: &ProcessingResponse) -> &CommonResponse {
    let c = match &r.response {
        Some(Response::RequestHeaders(h) | Response::ResponseHeaders(h)) => h.response.as_ref(),
        Some(Response::RequestBody(b) | Response::ResponseBody(b)) => b.response.as_ref(),
        _ => None,
    };
    c.unwrap_or_else(|| panic!("no common response in {r:?}"))
}

pub(crate) fn set_headers(r: &ProcessingResponse) -> HashMap<String, String> {
    common(r)
        .header_mutation
        .iter()
        .flat_map(|m| m.set_headers.iter())
        .filter_map(|o| o.header.as_ref())
        .map(|h| {
            (
                h.key.clone(),
                String::from_utf8(h.raw_value.clone()).unwrap(),
            )
        })
        .collect()
}

fn removed_headers(r: &ProcessingResponse) -> Vec<String> {
    common(r)
        .header_mutation
        .as_ref()
        .map(|m| m.remove_headers.clone())
        .unwrap_or_default()
}

fn metadata_endpoint(r: &ProcessingResponse) -> Option<String> {
    let lb = r.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = &lb.kind else {
        return None;
    };
    match &s.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

fn streamed_chunk(r: &ProcessingResponse) -> &StreamedBodyResponse {
    match common(r)
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::StreamedResponse(c)) => c,
        other => panic!("not a streamed body: {other:?}"),
    }
}

fn immediate(r: &ProcessingResponse) -> &ImmediateResponse {
    match &r.response {
        Some(Response::ImmediateResponse(i)) => i,
        other => panic!("not an immediate response: {other:?}"),
    }
}

fn immediate_header(i: &ImmediateResponse, name: &str) -> Option<String> {
    i.headers
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

pub(crate) fn duplex() -> Option<ProtocolConfiguration> {
    modes(
        BodySendMode::FullDuplexStreamed,
        BodySendMode::FullDuplexStreamed,
    )
}

#[test]
fn the_header_carries_every_endpoint_when_asked() {
    let router = FakeRouter::picking(&["10.0.0.1:8000", "10.0.0.2:8000"]);
    let config = StreamConfig {
        header_endpoints: HeaderEndpoints::All,
        ..StreamConfig::default()
    };
    let mut s = stream_with(&router, config);
    let out = s
        .on_message(ProcessingRequest {
            protocol_config: duplex(),
            ..req_headers(&[(":method", "GET"), (":path", "/v1/models")], true)
        })
        .unwrap();
    assert_eq!(
        set_headers(&out[0])["x-gateway-destination-endpoint"],
        "10.0.0.1:8000,10.0.0.2:8000"
    );
    assert_eq!(
        metadata_endpoint(&out[0]).as_deref(),
        Some("10.0.0.1:8000,10.0.0.2:8000")
    );
}

#[test]
fn header_only_get_is_picked_on_the_headers_message() {
    let router = FakeRouter::picking(&["10.0.0.1:8000", "10.0.0.2:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(ProcessingRequest {
            protocol_config: duplex(),
            ..req_headers(
                &[
                    (":method", "GET"),
                    (":path", "/v1/models"),
                    ("x-request-id", "g1"),
                ],
                true,
            )
        })
        .unwrap();
    assert_eq!(kinds(&out), ["request_headers"]);
    let h = set_headers(&out[0]);
    assert_eq!(
        h["x-gateway-destination-endpoint"], "10.0.0.1:8000",
        "the header carries the primary alone"
    );
    assert!(!h.contains_key("content-length"));
    assert!(
        !h.contains_key("x-request-id"),
        "the client's id is kept, not re-set"
    );
    assert!(common(&out[0]).clear_route_cache);
    assert_eq!(
        metadata_endpoint(&out[0]).as_deref(),
        Some("10.0.0.1:8000,10.0.0.2:8000")
    );
    let seen = router.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("GET", "/v1/models")
    );
    assert_eq!(seen[0].body, None);
    assert_eq!(seen[0].request_id.as_deref(), Some("g1"));
    assert_eq!(seen[0].subset, None);
    assert!(s.has_open_ticket());
}

#[test]
fn duplex_defers_the_headers_reply_until_the_body_is_complete() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    assert!(s.on_message(post(duplex())).unwrap().is_empty());
    assert!(
        s.on_message(req_body(br#"{"model":"m","#, false))
            .unwrap()
            .is_empty()
    );
    assert!(
        router.seen().is_empty(),
        "no pick before the body is complete"
    );
    let out = s.on_message(req_body(br#""prompt":"hi"}"#, true)).unwrap();
    assert_eq!(kinds(&out), ["request_headers", "request_body"]);
    assert_eq!(
        router.seen()[0].body.as_deref(),
        Some(&br#"{"model":"m","prompt":"hi"}"#[..])
    );
    let h = set_headers(&out[0]);
    assert_eq!(h["x-gateway-destination-endpoint"], "10.0.0.1:8000");
    assert_eq!(h["content-length"], "27");
    assert!(common(&out[0]).clear_route_cache);
    assert_eq!(metadata_endpoint(&out[0]).as_deref(), Some("10.0.0.1:8000"));
    let chunk = streamed_chunk(&out[1]);
    assert_eq!(chunk.body, br#"{"model":"m","prompt":"hi"}"#);
    assert!(chunk.end_of_stream);
}

#[test]
fn duplex_large_body_is_rechunked_intact() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let body: Vec<u8> = (0..(3 << 20) / 2).map(|i| b'a' + (i % 26) as u8).collect();
    assert!(s.on_message(post(duplex())).unwrap().is_empty());
    let mut out = Vec::new();
    let pieces: Vec<&[u8]> = body.chunks(16_384).collect();
    for (i, piece) in pieces.iter().enumerate() {
        out.extend(
            s.on_message(req_body(piece, i + 1 == pieces.len()))
                .unwrap(),
        );
    }
    assert_eq!(kind(&out[0]), "request_headers");
    assert_eq!(
        set_headers(&out[0])["content-length"],
        body.len().to_string()
    );
    let chunks: Vec<_> = out[1..].iter().map(streamed_chunk).collect();
    assert_eq!(chunks.len(), body.len().div_ceil(MAX_CHUNK_BYTES));
    assert!(chunks.iter().all(|c| c.body.len() <= MAX_CHUNK_BYTES));
    assert_eq!(chunks.iter().filter(|c| c.end_of_stream).count(), 1);
    assert!(chunks.last().unwrap().end_of_stream);
    let joined: Vec<u8> = chunks.iter().flat_map(|c| c.body.iter().copied()).collect();
    assert_eq!(joined, body);
}

#[test]
fn duplex_body_rewrite_sets_the_new_length() {
    let router = FakeRouter::new(|_| {
        Ok(Decision {
            endpoints: vec!["10.0.0.1:8000".into()],
            body: Some(br#"{"model":"base-model-long-name"}"#.to_vec()),
            add_headers: vec![("X-Prefiller-Host-Port".into(), "10.0.0.9:8000".into())],
            ticket: 0,
            response_model: None,
        })
    });
    let mut s = stream(&router);
    s.on_message(ProcessingRequest {
        protocol_config: duplex(),
        ..req_headers(
            &[
                (":method", "POST"),
                ("content-length", "15"),
                ("x-prefiller-host-port", "6.6.6.6:1"),
            ],
            false,
        )
    })
    .unwrap();
    let out = s.on_message(req_body(br#"{"model":"lo"}"#, true)).unwrap();
    let h = set_headers(&out[0]);
    assert_eq!(h["content-length"], "32");
    assert_eq!(h["x-prefiller-host-port"], "10.0.0.9:8000");
    assert!(
        !removed_headers(&out[0]).contains(&"x-prefiller-host-port".to_owned()),
        "a header the router sets is not also removed"
    );
    assert_eq!(
        streamed_chunk(&out[1]).body,
        br#"{"model":"base-model-long-name"}"#
    );
}

#[test]
fn duplex_trailers_end_the_body_and_get_their_reply() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    assert!(s.on_message(req_body(b"{}", false)).unwrap().is_empty());
    let out = s.on_message(req_trailers()).unwrap();
    assert_eq!(
        kinds(&out),
        ["request_headers", "request_body", "request_trailers"]
    );
    assert!(
        !streamed_chunk(&out[1]).end_of_stream,
        "trailers follow the body"
    );
    assert_eq!(router.seen()[0].body.as_deref(), Some(&b"{}"[..]));
}

#[test]
fn empty_duplex_body_still_ends_the_stream() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    let out = s.on_message(req_body(b"", true)).unwrap();
    assert_eq!(kinds(&out), ["request_headers", "request_body"]);
    assert!(streamed_chunk(&out[1]).end_of_stream);
    assert_eq!(set_headers(&out[0])["content-length"], "0");
}

#[test]
fn buffered_mode_answers_headers_then_picks_on_the_body() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(post(modes(BodySendMode::Buffered, BodySendMode::None)))
        .unwrap();
    assert_eq!(kinds(&out), ["request_headers"]);
    assert!(common(&out[0]).header_mutation.is_none(), "plain CONTINUE");
    let out = s.on_message(req_body(br#"{"prompt":"x"}"#, true)).unwrap();
    assert_eq!(kinds(&out), ["request_body"]);
    let h = set_headers(&out[0]);
    assert_eq!(h["x-gateway-destination-endpoint"], "10.0.0.1:8000");
    assert!(
        !h.contains_key("content-length"),
        "unchanged body keeps its length"
    );
    assert!(common(&out[0]).clear_route_cache);
    assert!(common(&out[0]).body_mutation.is_none());
    assert_eq!(metadata_endpoint(&out[0]).as_deref(), Some("10.0.0.1:8000"));
}

#[test]
fn buffered_rewrite_replaces_the_body_and_its_length() {
    let router = FakeRouter::new(|_| {
        Ok(Decision {
            endpoints: vec!["10.0.0.1:8000".into()],
            body: Some(b"{\"model\":\"x\"}".to_vec()),
            add_headers: Vec::new(),
            ticket: 0,
            response_model: None,
        })
    });
    let mut s = stream(&router);
    s.on_message(post(modes(BodySendMode::Buffered, BodySendMode::None)))
        .unwrap();
    let out = s
        .on_message(req_body(b"{\"model\":\"alias\"}", true))
        .unwrap();
    assert_eq!(set_headers(&out[0])["content-length"], "13");
    match common(&out[0])
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::Body(b)) => assert_eq!(b, b"{\"model\":\"x\"}"),
        other => panic!("expected a body replacement, got {other:?}"),
    }
}

#[test]
fn buffered_partial_truncated_body_is_too_large() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(modes(
        BodySendMode::BufferedPartial,
        BodySendMode::None,
    )))
    .unwrap();
    let out = s.on_message(req_body(b"{\"prompt\":", false)).unwrap();
    assert_eq!(immediate(&out[0]).status.unwrap().code, 413);
    assert!(router.seen().is_empty());
}

#[test]
fn body_limit_gives_413_announced_or_streamed() {
    let config = StreamConfig {
        max_body_bytes: 10,
        ..StreamConfig::default()
    };
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream_with(&router, config.clone());
    let out = s
        .on_message(ProcessingRequest {
            protocol_config: duplex(),
            ..req_headers(&[(":method", "POST"), ("content-length", "11")], false)
        })
        .unwrap();
    let ir = immediate(&out[0]);
    assert_eq!(ir.status.unwrap().code, 413);
    assert_eq!(
        immediate_header(ir, "x-kvgate-drop-reason").as_deref(),
        Some("payload-too-large")
    );
    assert!(
        s.on_message(req_body(b"0123456789a", true))
            .unwrap()
            .is_empty(),
        "late body ignored"
    );

    let mut s = stream_with(&router, config);
    s.on_message(post(duplex())).unwrap();
    assert!(
        s.on_message(req_body(b"0123456", false))
            .unwrap()
            .is_empty()
    );
    let out = s.on_message(req_body(b"7890", false)).unwrap();
    assert_eq!(immediate(&out[0]).status.unwrap().code, 413);
    assert!(router.seen().is_empty());
    assert!(!s.has_open_ticket());
}

fn subset_list(items: &[&str]) -> Kind {
    Kind::ListValue(ListValue {
        values: items
            .iter()
            .map(|s| Value {
                kind: Some(Kind::StringValue((*s).to_owned())),
            })
            .collect(),
    })
}

fn routed_subset(hint: Kind) -> (Arc<FakeRouter>, Vec<ProcessingResponse>) {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(ProcessingRequest {
            metadata_context: Some(with(SUBSET_METADATA_NAMESPACE, SUBSET_METADATA_KEY, hint)),
            protocol_config: duplex(),
            ..req_headers(&[(":method", "GET")], true)
        })
        .unwrap();
    (router, out)
}

#[test]
fn subset_hint_reaches_the_router_in_every_form() {
    let (router, _) = routed_subset(subset_list(&["10.0.0.1:8000", "10.0.0.2"]));
    assert_eq!(
        router.seen()[0].subset,
        Some(vec!["10.0.0.1:8000".into(), "10.0.0.2".into()])
    );
    let (router, _) = routed_subset(Kind::StringValue("10.0.0.1:8000,10.0.0.3".into()));
    assert_eq!(
        router.seen()[0].subset,
        Some(vec!["10.0.0.1:8000".into(), "10.0.0.3".into()])
    );
    let (router, _) = routed_subset(Kind::StringValue("10.0.0.4".into()));
    assert_eq!(router.seen()[0].subset, Some(vec!["10.0.0.4".into()]));
}

#[test]
fn empty_subset_is_503_without_asking_the_router() {
    for hint in [
        subset_list(&[]),
        Kind::StringValue(" ".into()),
        subset_list(&["not-an-ip"]),
    ] {
        let (router, out) = routed_subset(hint);
        let ir = immediate(&out[0]);
        assert_eq!(ir.status.unwrap().code, 503);
        assert_eq!(
            immediate_header(ir, "x-kvgate-drop-reason").as_deref(),
            Some("empty-subset")
        );
        assert!(router.seen().is_empty());
    }
}

#[test]
fn subset_hint_on_a_body_message_counts() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    s.on_message(ProcessingRequest {
        metadata_context: Some(with(
            SUBSET_METADATA_NAMESPACE,
            SUBSET_METADATA_KEY,
            subset_list(&["10.0.0.1:8000"]),
        )),
        ..req_body(b"{}", true)
    })
    .unwrap();
    assert_eq!(router.seen()[0].subset, Some(vec!["10.0.0.1:8000".into()]));
}

#[test]
fn router_rejections_become_immediate_responses() {
    let cases = [
        (
            Rejection::BadRequest("invalid JSON at byte 3".into()),
            400,
            "bad-request",
        ),
        (
            Rejection::PayloadTooLarge("too many tokens".into()),
            413,
            "payload-too-large",
        ),
        (
            Rejection::TooManyRequests("shed".into()),
            429,
            "too-many-requests",
        ),
        (
            Rejection::Unavailable("no ready endpoint".into()),
            503,
            "unavailable",
        ),
    ];
    for (rejection, status, reason) in cases {
        let message = rejection.message().to_owned();
        let router = FakeRouter::new(move |_| Err(rejection.clone()));
        let mut s = stream(&router);
        s.on_message(post(duplex())).unwrap();
        let out = s.on_message(req_body(b"{nope", true)).unwrap();
        assert_eq!(kinds(&out), ["immediate"]);
        let ir = immediate(&out[0]);
        assert_eq!(ir.status.unwrap().code, status);
        assert_eq!(
            immediate_header(ir, "x-kvgate-drop-reason").as_deref(),
            Some(reason)
        );
        assert_eq!(
            immediate_header(ir, "x-request-id").as_deref(),
            Some("req-1")
        );
        let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
        assert_eq!(body["error"]["message"], message.as_str());
        assert!(!s.has_open_ticket());
        s.finish();
        assert!(router.events().is_empty(), "no ticket, no events");
    }
}

#[test]
fn control_headers_are_stripped_and_a_request_id_injected() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(ProcessingRequest {
            protocol_config: duplex(),
            ..req_headers(
                &[
                    (":method", "GET"),
                    ("x-gateway-destination-endpoint", "6.6.6.6:80"),
                    ("x-gateway-destination-endpoint-served", "6.6.6.6:80"),
                    ("x-gateway-destination-endpoint-subset", "6.6.6.6"),
                    ("x-gateway-model-name-rewrite", "other"),
                    ("x-kvgate-debug", "1"),
                    ("user-agent", "t"),
                ],
                true,
            )
        })
        .unwrap();
    let removed = removed_headers(&out[0]);
    for h in [
        "x-gateway-destination-endpoint-served",
        "x-gateway-destination-endpoint-subset",
        "x-gateway-model-name-rewrite",
        "x-kvgate-debug",
    ] {
        assert!(
            removed.contains(&h.to_owned()),
            "{h} not removed: {removed:?}"
        );
    }
    assert!(!removed.contains(&"user-agent".to_owned()));
    let set = set_headers(&out[0]);
    assert_eq!(set["x-gateway-destination-endpoint"], "10.0.0.1:8000");
    let id = &set["x-request-id"];
    assert_eq!(id.len(), 36);
    let seen = &router.seen()[0];
    assert_eq!(seen.request_id.as_deref(), Some(id.as_str()));
    assert!(
        seen.headers
            .contains(&("x-gateway-model-name-rewrite".into(), "other".into())),
        "the router still reads control headers"
    );
    assert!(seen.headers.contains(&("x-request-id".into(), id.clone())));
    assert_eq!(s.request_id(), Some(id.as_str()));
}

#[test]
fn unusable_decisions_are_503_and_their_ticket_is_aborted() {
    for endpoints in [vec![], vec!["pod-a".to_owned()]] {
        let router = FakeRouter::new(move |_| {
            Ok(Decision {
                endpoints: endpoints.clone(),
                body: None,
                add_headers: Vec::new(),
                ticket: 0,
                response_model: None,
            })
        });
        let mut s = stream(&router);
        let out = s
            .on_message(req_headers(&[(":method", "GET")], true))
            .unwrap();
        let ir = immediate(&out[0]);
        assert_eq!(ir.status.unwrap().code, 503);
        assert_eq!(
            immediate_header(ir, "x-kvgate-drop-reason").as_deref(),
            Some("invalid-decision")
        );
        assert_eq!(router.events(), [(1, ResponseEvent::Aborted)]);
        s.finish();
        assert_eq!(router.events().len(), 1);
    }
}

const SSE: &[&str] = &[
    "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
    "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usa",
    "ge\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
    "data: [DONE]\n\n",
];

#[test]
fn streaming_sse_response_reports_first_byte_usage_and_end() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    s.on_message(req_body(b"{\"stream\":true}", true)).unwrap();
    let out = s
        .on_message(resp_headers(
            "200",
            "text/event-stream",
            false,
            Some("10.0.0.1:8000"),
        ))
        .unwrap();
    assert_eq!(kinds(&out), ["response_headers"]);
    for (i, chunk) in SSE.iter().enumerate() {
        let out = s
            .on_message(resp_body(chunk.as_bytes(), i + 1 == SSE.len()))
            .unwrap();
        assert_eq!(kinds(&out), ["response_body"]);
        let echoed = streamed_chunk(&out[0]);
        assert_eq!(
            echoed.body,
            chunk.as_bytes(),
            "duplex response bodies are echoed"
        );
        assert_eq!(echoed.end_of_stream, i + 1 == SSE.len());
    }
    assert!(!s.has_open_ticket());
    s.finish();
    assert_eq!(
        router.events(),
        [
            (
                1,
                ResponseEvent::Headers {
                    status: 200,
                    served: Some("10.0.0.1:8000".into())
                }
            ),
            (1, ResponseEvent::FirstByte),
            (
                1,
                ResponseEvent::Usage {
                    prompt_tokens: 40,
                    completion_tokens: 2,
                    cached_tokens: Some(32)
                }
            ),
            (1, ResponseEvent::End),
        ]
    );
}

#[test]
fn buffered_json_response_reports_usage() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(modes(BodySendMode::Buffered, BodySendMode::Buffered)))
        .unwrap();
    s.on_message(req_body(b"{}", true)).unwrap();
    s.on_message(resp_headers("200", "application/json", false, None))
        .unwrap();
    let out = s
        .on_message(resp_body(
            br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}"#,
            true,
        ))
        .unwrap();
    assert!(
        common(&out[0]).body_mutation.is_none(),
        "buffered bodies pass unchanged"
    );
    assert_eq!(
        router.events(),
        [
            (
                1,
                ResponseEvent::Headers {
                    status: 200,
                    served: None
                }
            ),
            (1, ResponseEvent::FirstByte),
            (
                1,
                ResponseEvent::Usage {
                    prompt_tokens: 5,
                    completion_tokens: 1,
                    cached_tokens: None
                }
            ),
            (1, ResponseEvent::End),
        ]
    );
}

#[test]
fn response_trailers_end_the_response() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(req_headers(&[(":method", "GET")], true))
        .unwrap();
    s.on_message(resp_headers("200", "application/grpc", false, None))
        .unwrap();
    s.on_message(resp_body(b"\0\0\0\0\0", false)).unwrap();
    let out = s.on_message(resp_trailers()).unwrap();
    assert_eq!(kinds(&out), ["response_trailers"]);
    assert_eq!(router.events().last(), Some(&(1, ResponseEvent::End)));
}

#[test]
fn header_only_response_ends_at_once() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(req_headers(&[(":method", "GET")], true))
        .unwrap();
    s.on_message(resp_headers("204", "text/plain", true, None))
        .unwrap();
    assert_eq!(
        router.events(),
        [
            (
                1,
                ResponseEvent::Headers {
                    status: 204,
                    served: None
                }
            ),
            (1, ResponseEvent::End)
        ]
    );
}

#[test]
fn disconnect_mid_stream_aborts_exactly_once() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    s.on_message(req_body(b"{}", true)).unwrap();
    s.on_message(resp_headers("200", "text/event-stream", false, None))
        .unwrap();
    s.on_message(resp_body(SSE[0].as_bytes(), false)).unwrap();
    s.finish();
    let events = router.events();
    assert_eq!(events.iter().filter(|(_, e)| e.is_terminal()).count(), 1);
    assert_eq!(events.last(), Some(&(1, ResponseEvent::Aborted)));
}

#[test]
fn dropping_the_stream_aborts_too() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(req_headers(&[(":method", "GET")], true))
        .unwrap();
    drop(s);
    assert_eq!(router.events(), [(1, ResponseEvent::Aborted)]);
}

#[test]
fn without_response_bodies_the_stream_end_is_the_response_end() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(ProcessingRequest {
        protocol_config: modes(BodySendMode::FullDuplexStreamed, BodySendMode::None),
        ..req_headers(&[(":method", "GET")], true)
    })
    .unwrap();
    s.on_message(resp_headers("200", "text/event-stream", false, None))
        .unwrap();
    s.finish();
    assert_eq!(router.events().last(), Some(&(1, ResponseEvent::End)));

    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    s.on_message(req_headers(&[(":method", "GET")], true))
        .unwrap();
    s.finish();
    assert_eq!(
        router.events(),
        [(1, ResponseEvent::Aborted)],
        "no response at all"
    );
}

#[test]
fn defaults_apply_when_envoy_names_no_mode() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream_with(
        &router,
        StreamConfig {
            request_body_mode: BodyMode::Buffered,
            ..StreamConfig::default()
        },
    );
    assert_eq!(
        kinds(&s.on_message(post(None)).unwrap()),
        ["request_headers"]
    );
    assert_eq!(
        kinds(&s.on_message(req_body(b"{}", true)).unwrap()),
        ["request_body"]
    );
}

#[test]
fn unsupported_request_body_mode_is_a_clear_500() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(post(modes(BodySendMode::Streamed, BodySendMode::None)))
        .unwrap();
    let ir = immediate(&out[0]);
    assert_eq!(ir.status.unwrap().code, 500);
    assert_eq!(
        immediate_header(ir, "x-kvgate-drop-reason").as_deref(),
        Some("unsupported-body-mode")
    );
}

#[test]
fn request_body_mode_none_picks_on_headers() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(post(modes(BodySendMode::None, BodySendMode::None)))
        .unwrap();
    assert_eq!(kinds(&out), ["request_headers"]);
    assert_eq!(router.seen()[0].body, None);
}

#[test]
fn out_of_order_messages_are_errors() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    assert!(matches!(
        s.on_message(req_body(b"x", true)),
        Err(StreamError::Unexpected {
            message: "request_body",
            ..
        })
    ));
    s.on_message(req_headers(&[(":method", "GET")], true))
        .unwrap();
    let err = s
        .on_message(req_headers(&[(":method", "GET")], true))
        .unwrap_err();
    assert_eq!(err.metric_label(), "unexpected_message");
    assert!(err.to_string().contains("request_headers"));
}

#[test]
fn observability_mode_sends_no_replies() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut s = stream(&router);
    let out = s
        .on_message(ProcessingRequest {
            observability_mode: true,
            ..req_headers(&[(":method", "GET")], true)
        })
        .unwrap();
    assert!(out.is_empty());
}

/// One step of an arbitrary (possibly nonsensical) Envoy conversation.
#[derive(Debug, Clone)]
enum Step {
    ReqHeaders(bool),
    ReqBody(usize, bool),
    ReqTrailers,
    RespHeaders(bool),
    RespBody(bool),
    RespTrailers,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<bool>().prop_map(Step::ReqHeaders),
        (0usize..200_000, any::<bool>()).prop_map(|(n, e)| Step::ReqBody(n, e)),
        Just(Step::ReqTrailers),
        any::<bool>().prop_map(Step::RespHeaders),
        any::<bool>().prop_map(Step::RespBody),
        Just(Step::RespTrailers),
    ]
}

fn body_mode() -> impl Strategy<Value = BodySendMode> {
    prop_oneof![
        Just(BodySendMode::None),
        Just(BodySendMode::Buffered),
        Just(BodySendMode::BufferedPartial),
        Just(BodySendMode::FullDuplexStreamed),
        Just(BodySendMode::Streamed),
    ]
}

proptest! {
    /// Whatever Envoy sends and however the stream ends, every routed ticket hears exactly one
    /// terminal event, last; replies never carry a body chunk over the limit.
    #[test]
    fn exactly_one_terminal_event_per_routed_ticket(
        req_mode in body_mode(),
        resp_mode in body_mode(),
        reject in any::<bool>(),
        steps in proptest::collection::vec(step(), 0..12),
        drop_instead_of_finish in any::<bool>(),
    ) {
        let router = FakeRouter::new(move |_| {
            if reject {
                Err(Rejection::TooManyRequests("busy".into()))
            } else {
                Ok(Decision { endpoints: vec!["10.0.0.1:8000".into()], body: None, add_headers: Vec::new(), ticket: 0, response_model: None })
            }
        });
        let mut s = stream_with(&router, StreamConfig { max_body_bytes: 300_000, ..StreamConfig::default() });
        let mut first = true;
        for st in steps {
            let mut msg = match st {
                Step::ReqHeaders(eos) => req_headers(&[(":method", "POST")], eos),
                Step::ReqBody(n, eos) => req_body(&vec![b'x'; n], eos),
                Step::ReqTrailers => req_trailers(),
                Step::RespHeaders(eos) => resp_headers("200", "text/event-stream", eos, None),
                Step::RespBody(eos) => resp_body(SSE[2].as_bytes(), eos),
                Step::RespTrailers => resp_trailers(),
            };
            if first {
                msg.protocol_config = modes(req_mode, resp_mode);
                first = false;
            }
            if let Ok(out) = s.on_message(msg) {
                for r in &out {
                    if let Some(Response::RequestBody(_) | Response::ResponseBody(_)) = &r.response
                        && let Some(Mutation::StreamedResponse(c)) = common(r).body_mutation.as_ref().and_then(|m| m.mutation.as_ref())
                    {
                        prop_assert!(c.body.len() <= MAX_CHUNK_BYTES.max(SSE[2].len()));
                    }
                }
            }
        }
        if drop_instead_of_finish { drop(s) } else { s.finish() }
        let events = router.events();
        let tickets = router.seen().len() as u64;
        for t in 1..=tickets {
            if reject { break; }
            let mine: Vec<_> = events.iter().filter(|(id, _)| *id == t).map(|(_, e)| e.clone()).collect();
            prop_assert_eq!(mine.iter().filter(|e| e.is_terminal()).count(), 1, "ticket {} events {:?}", t, mine);
            prop_assert!(mine.last().is_some_and(ResponseEvent::is_terminal));
            let headers = mine.iter().filter(|e| matches!(e, ResponseEvent::Headers { .. })).count();
            let first_bytes = mine.iter().filter(|e| matches!(e, ResponseEvent::FirstByte)).count();
            prop_assert!(headers <= 1 && first_bytes <= 1, "ticket {} events {:?}", t, mine);
        }
        if reject {
            prop_assert!(events.is_empty());
        }
        prop_assert!(events.iter().all(|(id, _)| *id >= 1 && *id <= tickets));
    }
}

fn rewriting_router() -> Arc<FakeRouter> {
    FakeRouter::new(|seen| {
        let body = seen.body.clone().unwrap_or_default();
        let text = String::from_utf8(body).unwrap();
        Ok(Decision {
            endpoints: vec!["10.0.0.1:8000".into()],
            body: Some(text.replace("\"llama\"", "\"llama-lora-a\"").into_bytes()),
            add_headers: Vec::new(),
            ticket: 0,
            response_model: Some(ResponseModel {
                served: "llama-lora-a".into(),
                client: "llama".into(),
            }),
        })
    })
}

#[test]
fn model_rewrite_round_trip_in_duplex_mode() {
    let router = rewriting_router();
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    let out = s
        .on_message(req_body(br#"{"model":"llama","stream":true}"#, true))
        .unwrap();
    let sent = r#"{"model":"llama-lora-a","stream":true}"#;
    assert_eq!(
        set_headers(&out[0])["content-length"],
        sent.len().to_string()
    );
    assert_eq!(streamed_chunk(&out[1]).body, sent.as_bytes());

    let out = s
        .on_message(resp_headers("200", "text/event-stream", false, None))
        .unwrap();
    assert!(
        removed_headers(&out[0]).contains(&"content-length".to_owned()),
        "a rewritten response body may change length"
    );
    // The served name straddles the chunk boundary.
    let first = s
        .on_message(resp_body(
            b"data: {\"id\":\"1\",\"model\":\"llama-lo",
            false,
        ))
        .unwrap();
    let second = s
        .on_message(resp_body(
            b"ra-a\",\"choices\":[]}\n\ndata: [DONE]\n\n",
            true,
        ))
        .unwrap();
    let mut client = streamed_chunk(&first[0]).body.clone();
    client.extend_from_slice(&streamed_chunk(&second[0]).body);
    assert_eq!(
        String::from_utf8(client).unwrap(),
        "data: {\"id\":\"1\",\"model\":\"llama\",\"choices\":[]}\n\ndata: [DONE]\n\n"
    );
    assert!(streamed_chunk(&second[0]).end_of_stream);
}

#[test]
fn model_rewrite_in_buffered_mode_mutates_the_whole_body() {
    let router = rewriting_router();
    let mut s = stream(&router);
    s.on_message(post(modes(BodySendMode::Buffered, BodySendMode::Buffered)))
        .unwrap();
    s.on_message(req_body(br#"{"model":"llama"}"#, true))
        .unwrap();
    s.on_message(resp_headers("200", "application/json", false, None))
        .unwrap();
    let out = s
        .on_message(resp_body(br#"{"model": "llama-lora-a","usage":{}}"#, true))
        .unwrap();
    let Some(Mutation::Body(body)) = common(&out[0])
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    else {
        panic!("expected a body mutation: {out:?}");
    };
    assert_eq!(body.as_slice(), br#"{"model": "llama","usage":{}}"#);
}

#[test]
fn held_back_bytes_are_released_before_response_trailers() {
    let router = rewriting_router();
    let mut s = stream(&router);
    s.on_message(post(duplex())).unwrap();
    s.on_message(req_body(br#"{"model":"llama"}"#, true))
        .unwrap();
    s.on_message(resp_headers("200", "application/json", false, None))
        .unwrap();
    let out = s.on_message(resp_body(b"{\"x\":1,\"mod", false)).unwrap();
    assert_eq!(streamed_chunk(&out[0]).body, b"{\"x\":1,");
    let out = s.on_message(resp_trailers()).unwrap();
    assert_eq!(kinds(&out), ["response_body", "response_trailers"]);
    assert_eq!(streamed_chunk(&out[0]).body, b"\"mod");
}

// ---- The response-observer layout: routing streams park tickets, observer streams claim them.

fn observed(msg: ProcessingRequest) -> ProcessingRequest {
    ProcessingRequest {
        observability_mode: true,
        ..msg
    }
}

/// The routing filter of the observer layout: request phases only, responses skipped.
fn routing_only() -> Option<ProtocolConfiguration> {
    modes(BodySendMode::FullDuplexStreamed, BodySendMode::None)
}

/// The observer filter: request headers, then the response streamed, in observability mode.
fn observer_modes() -> Option<ProtocolConfiguration> {
    modes(BodySendMode::None, BodySendMode::Streamed)
}

fn observer_stream(router: &Arc<FakeRouter>, handoffs: &Arc<Handoffs>) -> ExtProcStream {
    stream(router).with_handoffs(Arc::clone(handoffs))
}

#[test]
fn a_routing_stream_parks_its_ticket_and_the_observer_stream_reports_the_response() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let handoffs = Arc::new(Handoffs::new(16));
    let mut routing = observer_stream(&router, &handoffs);
    routing.on_message(post(routing_only())).unwrap();
    let out = routing.on_message(req_body(b"{}", true)).unwrap();
    assert_eq!(kinds(&out), ["request_headers", "request_body"]);
    assert!(!routing.has_open_ticket(), "the ticket is parked, not kept");
    // The routing stream ends at once (no response phase): nothing is aborted.
    routing.finish();
    assert!(router.events().is_empty(), "{:?}", router.events());
    assert_eq!(handoffs.stats().parked, 1);

    let mut observer = observer_stream(&router, &handoffs);
    let headers = ProcessingRequest {
        protocol_config: observer_modes(),
        ..observed(req_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("x-request-id", "req-1"),
            ],
            false,
        ))
    };
    assert!(observer.on_message(headers).unwrap().is_empty());
    assert!(observer.has_open_ticket(), "claimed");
    assert_eq!(router.seen().len(), 1, "an observer stream never routes");
    let out = observer
        .on_message(observed(resp_headers(
            "200",
            "text/event-stream",
            false,
            None,
        )))
        .unwrap();
    assert!(out.is_empty(), "observability mode: no replies");
    for (i, chunk) in SSE.iter().enumerate() {
        observer
            .on_message(observed(resp_body(chunk.as_bytes(), i + 1 == SSE.len())))
            .unwrap();
    }
    observer.finish();
    let events: Vec<ResponseEvent> = router.events().into_iter().map(|(_, e)| e).collect();
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[1], ResponseEvent::FirstByte);
    assert!(matches!(
        events[2],
        ResponseEvent::Usage {
            completion_tokens: 2,
            ..
        }
    ));
    assert_eq!(events[3], ResponseEvent::End);
    let stats = handoffs.stats();
    assert_eq!((stats.parked, stats.claimed, stats.unmatched), (0, 1, 0));
}

#[test]
fn an_unclaimed_ticket_is_aborted_by_the_second_sweep() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let handoffs = Arc::new(Handoffs::new(16));
    let mut routing = observer_stream(&router, &handoffs);
    routing.on_message(post(routing_only())).unwrap();
    routing.on_message(req_body(b"{}", true)).unwrap();
    routing.finish();
    assert_eq!(handoffs.sweep(), 0, "parked since the last sweep: kept");
    assert!(router.events().is_empty());
    assert_eq!(handoffs.sweep(), 1);
    assert_eq!(router.events(), [(1, ResponseEvent::Aborted)]);
    // An observer arriving later finds nothing and reports nothing.
    let mut observer = observer_stream(&router, &handoffs);
    observer
        .on_message(observed(req_headers(&[("x-request-id", "req-1")], true)))
        .unwrap();
    assert!(!observer.has_open_ticket());
    observer.finish();
    assert_eq!(router.events().len(), 1);
    let stats = handoffs.stats();
    assert_eq!((stats.expired, stats.unmatched), (1, 1));
}

#[test]
fn the_observer_stream_swaps_a_rewritten_model_back_and_answers_every_message() {
    let router = FakeRouter::new(|_| {
        Ok(Decision {
            endpoints: vec!["10.0.0.1:8000".into()],
            body: Some(b"{\"model\":\"served\"}".to_vec()),
            add_headers: Vec::new(),
            ticket: 0,
            response_model: Some(ResponseModel {
                served: "served".into(),
                client: "alias".into(),
            }),
        })
    });
    let handoffs = Arc::new(Handoffs::new(16));
    let mut routing = observer_stream(&router, &handoffs);
    routing.on_message(post(routing_only())).unwrap();
    routing
        .on_message(req_body(b"{\"model\":\"alias\"}", true))
        .unwrap();
    assert!(!routing.has_open_ticket());
    routing.finish();
    // The observer filter proper (not observability mode): STREAMED response bodies, each
    // answered before Envoy sends it on.
    let mut observer = observer_stream(&router, &handoffs).observing_responses();
    let out = observer
        .on_message(ProcessingRequest {
            protocol_config: observer_modes(),
            ..req_headers(&[("x-request-id", "req-1")], false)
        })
        .unwrap();
    assert_eq!(kinds(&out), ["request_headers"]);
    assert!(
        common(&out[0]).header_mutation.is_none(),
        "a plain continue"
    );
    assert_eq!(router.seen().len(), 1, "never routed");
    let out = observer
        .on_message(resp_headers("200", "application/json", false, None))
        .unwrap();
    assert_eq!(removed_headers(&out[0]), ["content-length"]);
    let out = observer
        .on_message(resp_body(b"{\"model\":\"served\"}", true))
        .unwrap();
    assert_eq!(kinds(&out), ["response_body"]);
    match common(&out[0])
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::Body(b)) => assert_eq!(b, b"{\"model\":\"alias\"}"),
        other => panic!("expected the chunk replaced, got {other:?}"),
    }
    observer.finish();
    assert_eq!(router.events().last(), Some(&(1, ResponseEvent::End)));
}

#[test]
fn without_a_handoff_table_an_observer_stream_neither_routes_nor_reports() {
    let router = FakeRouter::picking(&["10.0.0.1:8000"]);
    let mut observer = stream(&router);
    observer
        .on_message(observed(req_headers(&[("x-request-id", "r")], false)))
        .unwrap();
    observer
        .on_message(observed(resp_headers(
            "200",
            "application/json",
            true,
            None,
        )))
        .unwrap();
    observer.finish();
    assert!(router.seen().is_empty() && router.events().is_empty());
}

/// One operation on the handoff table.
#[derive(Debug, Clone)]
enum HandoffOp {
    Park(u8),
    Claim(u8),
    Sweep,
}

fn handoff_op() -> impl Strategy<Value = HandoffOp> {
    prop_oneof![
        (0u8..6).prop_map(HandoffOp::Park),
        (0u8..6).prop_map(HandoffOp::Claim),
        Just(HandoffOp::Sweep),
    ]
}

proptest! {
    /// The table against a naive model (a list of (id, ticket, sweeps when parked)): claims
    /// find exactly what the model holds, sweeps abort what was parked before the previous
    /// sweep, a full table or a reused id aborts at once, and every ticket ends exactly once
    /// (claimed tickets are closed by their observer here).
    #[test]
    fn handoffs_match_a_naive_model(ops in proptest::collection::vec(handoff_op(), 1..80)) {
        const CAPACITY: usize = 4;
        let router = FakeRouter::picking(&["10.0.0.1:8000"]);
        let handoffs = Arc::new(Handoffs::new(CAPACITY));
        let mut model: Vec<(u8, u64, u64)> = Vec::new();
        let mut sweeps = 0u64;
        let mut tickets = 0u64;
        let mut aborted_by_model = std::collections::BTreeSet::new();
        for op in ops {
            match op {
                HandoffOp::Park(id) => {
                    tickets += 1;
                    let mut routing = observer_stream(&router, &handoffs);
                    let rid = format!("r{id}");
                    routing.on_message(ProcessingRequest {
                        protocol_config: routing_only(),
                        ..req_headers(&[(":method", "GET"), ("x-request-id", &rid)], true)
                    }).unwrap();
                    routing.finish();
                    if let Some(pos) = model.iter().position(|(m, _, _)| *m == id) {
                        aborted_by_model.insert(model.remove(pos).1);
                        model.push((id, tickets, sweeps));
                    } else if model.len() >= CAPACITY {
                        aborted_by_model.insert(tickets);
                    } else {
                        model.push((id, tickets, sweeps));
                    }
                }
                HandoffOp::Claim(id) => {
                    let mut observer = observer_stream(&router, &handoffs);
                    observer.on_message(observed(req_headers(&[("x-request-id", &format!("r{id}"))], true))).unwrap();
                    let want = model.iter().position(|(m, _, _)| *m == id).map(|p| model.remove(p));
                    prop_assert_eq!(observer.has_open_ticket(), want.is_some());
                    if let Some((_, ticket, _)) = want {
                        // A header-only response: the observer closes it with End.
                        observer.on_message(observed(resp_headers("200", "application/json", true, None))).unwrap();
                        prop_assert_eq!(router.events().last().cloned(), Some((ticket, ResponseEvent::End)));
                    }
                    observer.finish();
                }
                HandoffOp::Sweep => {
                    let cutoff = sweeps;
                    sweeps += 1;
                    let (stale, kept): (Vec<_>, Vec<_>) = model.iter().partition(|(_, _, s)| *s < cutoff);
                    prop_assert_eq!(handoffs.sweep(), stale.len());
                    aborted_by_model.extend(stale.iter().map(|(_, t, _)| *t));
                    model = kept;
                }
            }
            prop_assert_eq!(handoffs.stats().parked, model.len() as u64);
        }
        let events = router.events();
        let aborted: std::collections::BTreeSet<u64> = events
            .iter()
            .filter(|(_, e)| *e == ResponseEvent::Aborted)
            .map(|(t, _)| *t)
            .collect();
        prop_assert_eq!(aborted, aborted_by_model);
        let terminal = events.iter().filter(|(_, e)| e.is_terminal()).count();
        let terminal_tickets: std::collections::BTreeSet<u64> =
            events.iter().filter(|(_, e)| e.is_terminal()).map(|(t, _)| *t).collect();
        prop_assert_eq!(terminal, terminal_tickets.len(), "a ticket ended twice");
        prop_assert_eq!(terminal + model.len(), tickets as usize);
    }
}

#[path = "relay_tests.rs"]
mod relay_tests;
