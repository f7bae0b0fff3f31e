//! Shared pieces of the ext_proc integration tests: a recording fake router and message builders.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse, body_mutation::Mutation,
    processing_request::Request, processing_response::Response,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kvgate_epp::extproc::{Decision, Rejection, ResponseEvent, Router, RoutingInput};

/// What the router was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    pub subset: Option<Vec<String>>,
    pub request_id: Option<String>,
}

type Decide = dyn Fn(&Seen) -> Result<Decision, Rejection> + Send + Sync;

/// A router that answers with a closure and records everything.
pub struct FakeRouter {
    decide: Box<Decide>,
    next: AtomicU64,
    seen: Mutex<Vec<Seen>>,
    events: Mutex<Vec<(u64, ResponseEvent)>>,
}

impl FakeRouter {
    pub fn new(
        decide: impl Fn(&Seen) -> Result<Decision, Rejection> + Send + Sync + 'static,
    ) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            decide: Box::new(decide),
            next: AtomicU64::new(1),
            seen: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
        })
    }

    /// Always picks `endpoints`.
    pub fn picking(endpoints: &[&str]) -> std::sync::Arc<Self> {
        let endpoints: Vec<String> = endpoints.iter().map(|e| (*e).to_owned()).collect();
        Self::new(move |_| Ok(decision(&endpoints)))
    }

    /// How many tickets were handed out (ticket ids run from 1).
    pub fn tickets_issued(&self) -> u64 {
        self.next.load(Ordering::Relaxed) - 1
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn events(&self) -> Vec<(u64, ResponseEvent)> {
        self.events.lock().unwrap().clone()
    }

    /// Waits (bounded) until `ticket` heard a terminal event; returns its events.
    pub async fn until_terminal(&self, ticket: u64) -> Vec<ResponseEvent> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mine: Vec<_> = self
                .events()
                .into_iter()
                .filter(|(t, _)| *t == ticket)
                .map(|(_, e)| e)
                .collect();
            if mine.iter().any(ResponseEvent::is_terminal) {
                return mine;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "ticket {ticket} never ended: {mine:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub fn decision(endpoints: &[String]) -> Decision {
    Decision {
        endpoints: endpoints.to_vec(),
        body: None,
        add_headers: Vec::new(),
        ticket: 0,
        response_model: None,
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

pub fn header_map(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
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

pub fn modes(request: BodySendMode, response: BodySendMode) -> Option<ProtocolConfiguration> {
    Some(ProtocolConfiguration {
        request_body_mode: request as i32,
        response_body_mode: response as i32,
        ..Default::default()
    })
}

pub fn duplex() -> Option<ProtocolConfiguration> {
    modes(
        BodySendMode::FullDuplexStreamed,
        BodySendMode::FullDuplexStreamed,
    )
}

pub fn req_headers(
    pairs: &[(&str, &str)],
    eos: bool,
    pc: Option<ProtocolConfiguration>,
) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: pc,
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: header_map(pairs),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn post(pc: Option<ProtocolConfiguration>) -> ProcessingRequest {
    req_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("x-request-id", "it-1"),
        ],
        false,
        pc,
    )
}

pub fn req_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn resp_headers(status: &str, content_type: &str, served: Option<&str>) -> ProcessingRequest {
    ProcessingRequest {
        metadata_context: served.map(|s| {
            metadata(
                "envoy.lb",
                "x-gateway-destination-endpoint-served",
                Kind::StringValue(s.into()),
            )
        }),
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: header_map(&[(":status", status), ("content-type", content_type)]),
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn resp_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn metadata(namespace: &str, key: &str, kind: Kind) -> Metadata {
    Metadata {
        filter_metadata: HashMap::from([(
            namespace.to_owned(),
            Struct {
                fields: HashMap::from([(key.to_owned(), Value { kind: Some(kind) })]),
            },
        )]),
        ..Default::default()
    }
}

pub fn common(r: &ProcessingResponse) -> &CommonResponse {
    let c = match &r.response {
        Some(Response::RequestHeaders(h) | Response::ResponseHeaders(h)) => h.response.as_ref(),
        Some(Response::RequestBody(b) | Response::ResponseBody(b)) => b.response.as_ref(),
        _ => None,
    };
    c.unwrap_or_else(|| panic!("no common response in {r:?}"))
}

pub fn set_headers(r: &ProcessingResponse) -> HashMap<String, String> {
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

pub fn metadata_endpoint(r: &ProcessingResponse) -> Option<String> {
    let lb = r.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = &lb.kind else {
        return None;
    };
    match &s.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

pub fn streamed_chunk(r: &ProcessingResponse) -> &StreamedBodyResponse {
    match common(r)
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::StreamedResponse(c)) => c,
        other => panic!("not a streamed body: {other:?}"),
    }
}

pub fn immediate(r: &ProcessingResponse) -> &ImmediateResponse {
    match &r.response {
        Some(Response::ImmediateResponse(i)) => i,
        other => panic!("not an immediate response: {other:?}"),
    }
}

pub fn immediate_header(i: &ImmediateResponse, name: &str) -> Option<String> {
    i.headers
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

pub fn is_request_headers(r: &ProcessingResponse) -> bool {
    matches!(r.response, Some(Response::RequestHeaders(_)))
}
