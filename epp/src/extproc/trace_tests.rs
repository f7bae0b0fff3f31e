//! A request's trace through the real picker, exported to an in-process OTLP receiver: the
//! caller's W3C context is continued, every stage is a span, the engine is handed this request's
//! span as its parent, and TTFT/ITL land on the request span.

use std::sync::Arc;
use std::time::Duration;

use kv_events::key::SaltStyle;
use kv_index::{IndexConfig, KvIndex};
use otel::receiver::{ReceivedSpan, Receiver};
use scheduler::{Endpoint, InflightTracker, LoadBook, Scheduler, SchedulerConfig};

use super::stream::tests::{duplex, req_body, req_headers, resp_body, resp_headers, set_headers};
use super::{ExtProcStream, Router, StreamConfig};
use crate::discovery::Datastore;
use crate::routing::keys::Keyer;
use crate::routing::picker::Picker;

const CALLER_TRACE: &str = "5b8efff798038103d269b633813fc60c";
const CALLER_SPAN: &str = "eee19b7ec3c1b174";
/// The traced request's body, and the prompt tokens its response's usage reports.
const BODY: &[u8] =
    br#"{"model":"m","prompt":"one two three four five six seven eight nine","stream":true}"#;
const PROMPT_TOKENS: i64 = 9;

fn picker() -> Picker {
    let ds = Arc::new(Datastore::new());
    let eps = (0..3u8)
        .map(|i| {
            let key = (format!("pod-{i}"), 8000);
            let id = ds.id_for(&key);
            let addr = format!("10.0.0.{i}:8000").parse().unwrap();
            (key, Endpoint::new(id, addr))
        })
        .collect();
    ds.replace(eps);
    Picker::new(
        Keyer::new(4, SaltStyle::VllmExtraKey, "m"),
        Scheduler::new(SchedulerConfig::default(), 7).unwrap(),
        Arc::new(KvIndex::new(IndexConfig::default()).unwrap()),
        Arc::new(InflightTracker::new()),
        Arc::new(LoadBook::new()),
        ds,
    )
}

fn named<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

/// Runs one streamed completion through a stream on `router`, under `dispatch`; returns the
/// headers the EPP set towards the engine.
fn one_request(
    dispatch: &tracing::Dispatch,
    router: Arc<dyn Router>,
    headers: &[(&str, &str)],
) -> std::collections::HashMap<String, String> {
    tracing::dispatcher::with_default(dispatch, || {
        // Another test's thread may have registered these callsites while no subscriber wanted
        // them (one process runs many tests under `cargo test`): ask again under this one.
        tracing::callsite::rebuild_interest_cache();
        let mut s = ExtProcStream::new(router, Arc::new(StreamConfig::default()));
        let mut head = vec![
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("content-type", "application/json"),
            ("x-request-id", "req-traced"),
        ];
        head.extend_from_slice(headers);
        let mut first = req_headers(&head, false);
        first.protocol_config = duplex();
        assert!(s.on_message(first).unwrap().is_empty());
        let out = s.on_message(req_body(BODY, true)).unwrap();
        let set = set_headers(&out[0]);
        s.on_message(resp_headers("200", "text/event-stream", false, None))
            .unwrap();
        s.on_message(resp_body(
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
            false,
        ))
        .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n";
        s.on_message(resp_body(usage, true)).unwrap();
        s.finish();
        set
    })
}

/// The EPP's subscriber exporting every trace to a fresh in-process receiver (the runtime
/// carries both).
fn exporting() -> (
    tokio::runtime::Runtime,
    Receiver,
    tracing::Dispatch,
    otel::Telemetry,
) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let args = otel::TracingArgs {
        otlp_endpoint: Some(receiver.endpoint()),
        trace_sample_ratio: 1.0,
        otel_service_name: None,
    };
    let (dispatch, telemetry) = {
        let _rt = runtime.enter();
        otel::dispatch("kvgate-epp", &args).unwrap()
    };
    (runtime, receiver, dispatch, telemetry)
}

#[test]
fn a_traced_request_continues_the_callers_trace_through_every_stage() {
    let (_runtime, receiver, dispatch, telemetry) = exporting();
    let router: Arc<dyn Router> = Arc::new(picker());
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let set = one_request(&dispatch, Arc::clone(&router), &[("traceparent", &caller)]);
    telemetry.shutdown();
    let spans = receiver.spans();

    let request = named(&spans, "epp.request");
    assert_eq!(request.service, "kvgate-epp");
    assert_eq!(request.trace_id, CALLER_TRACE);
    assert_eq!(request.parent_span_id, CALLER_SPAN);
    assert_eq!(request.attr("request_id"), Some("req-traced"));
    assert_eq!(request.attr("outcome"), Some("completed"));
    // Counts and codes are exported as integers, not as text.
    assert_eq!(request.int("http.response.status_code"), Some(200));
    assert_eq!(request.int("completion_tokens"), Some(4));
    assert_eq!(request.int("prompt_tokens"), Some(PROMPT_TOKENS));
    let ttft: f64 = request.attr("ttft_ms").unwrap().parse().unwrap();
    let itl: f64 = request.attr("itl_ms").unwrap().parse().unwrap();
    assert!(
        ttft >= 0.0 && itl >= 30.0 / 3.0,
        "ttft {ttft} ms, itl {itl} ms"
    );

    // The stages, each under the request (the scheduler's under the pick).
    for stage in ["parse", "tokenize", "pick", "first_token", "decode"] {
        let s = named(&spans, stage);
        assert_eq!(s.trace_id, CALLER_TRACE, "{stage}");
        assert_eq!(
            s.parent_span_id, request.span_id,
            "{stage} under epp.request"
        );
    }
    let pick = named(&spans, "pick");
    for stage in ["index_lookup", "score"] {
        assert_eq!(named(&spans, stage).parent_span_id, pick.span_id, "{stage}");
    }
    // Each stage lies within its parent's time, and the stages follow one another.
    let end = |s: &ReceivedSpan| s.start_unix_nanos + s.duration_nanos;
    for stage in ["index_lookup", "score"] {
        let s = named(&spans, stage);
        assert!(
            s.start_unix_nanos >= pick.start_unix_nanos && end(s) <= end(pick),
            "{stage} within pick: {s:?} {pick:?}"
        );
    }
    let order = ["parse", "tokenize", "pick", "first_token", "decode"];
    for pair in order.windows(2) {
        let (a, b) = (named(&spans, pair[0]), named(&spans, pair[1]));
        assert!(
            end(a) <= b.start_unix_nanos,
            "{} before {}",
            pair[0],
            pair[1]
        );
    }
    assert!(
        named(&spans, "decode").duration_nanos >= 30_000_000,
        "decode spans the 30 ms between the first and the last byte"
    );
    let tokenize = named(&spans, "tokenize");
    assert!(tokenize.int("prompt_tokens").is_some_and(|t| t > 0));
    assert!(tokenize.int("prompt_blocks").is_some());
    assert_eq!(tokenize.attr("stopped_early"), Some("false"));
    assert_eq!(
        named(&spans, "parse").int("body_bytes"),
        Some(BODY.len() as i64)
    );
    assert!(pick.int("candidates").is_some_and(|c| c > 0));
    assert!(named(&spans, "index_lookup").int("candidates").is_some());
    let primary = pick.attr("endpoint").unwrap();
    assert!(primary.starts_with("10.0.0."), "{primary}");
    assert!(
        request.attr("endpoints").unwrap().starts_with(primary),
        "the primary, then its fallbacks"
    );
    assert_eq!(named(&spans, "decode").int("completion_tokens"), Some(4));

    // The engine's parent is this request's span, sampled as the caller asked.
    assert_eq!(
        set["traceparent"],
        format!("00-{CALLER_TRACE}-{}-01", request.span_id)
    );
}

#[test]
fn an_unsampled_callers_request_gets_no_span_and_keeps_its_context() {
    let (_runtime, receiver, dispatch, telemetry) = exporting();
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-00");
    let set = one_request(&dispatch, Arc::new(picker()), &[("traceparent", &caller)]);
    telemetry.shutdown();
    assert!(
        !set.contains_key("traceparent"),
        "left as the caller sent it: {set:?}"
    );
    assert!(
        receiver.spans().iter().all(|s| s.trace_id != CALLER_TRACE),
        "{:#?}",
        receiver.spans()
    );
}

#[test]
fn without_a_collector_nothing_is_traced_and_the_callers_header_passes_through() {
    let args = otel::TracingArgs::default();
    let (dispatch, telemetry) = otel::dispatch("kvgate-epp", &args).unwrap();
    assert!(!telemetry.exporting());
    let router: Arc<dyn Router> = Arc::new(picker());
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let set = one_request(&dispatch, router, &[("traceparent", &caller)]);
    assert!(!set.contains_key("traceparent"), "{set:?}");
}

#[test]
fn a_refused_requests_trace_ends_with_the_stage_that_refused_it() {
    let (_runtime, receiver, dispatch, telemetry) = exporting();
    let router: Arc<dyn Router> = Arc::new(picker());
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let body: &[u8] = br#"{"model":"m","prompt":"#;
    tracing::dispatcher::with_default(&dispatch, || {
        tracing::callsite::rebuild_interest_cache();
        let mut s = ExtProcStream::new(router, Arc::new(StreamConfig::default()));
        let mut first = req_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("content-type", "application/json"),
                ("traceparent", &caller),
            ],
            false,
        );
        first.protocol_config = duplex();
        assert!(s.on_message(first).unwrap().is_empty());
        let out = s.on_message(req_body(body, true)).unwrap();
        assert_eq!(out.len(), 1, "answered by the EPP: {out:?}");
        s.finish();
    });
    telemetry.shutdown();
    let spans = receiver.spans();
    let request = named(&spans, "epp.request");
    assert_eq!(request.trace_id, CALLER_TRACE);
    let parse = named(&spans, "parse");
    assert_eq!(parse.parent_span_id, request.span_id);
    assert_eq!(parse.int("body_bytes"), Some(body.len() as i64));
    for later in ["tokenize", "pick", "first_token"] {
        assert!(
            spans.iter().all(|s| s.name != later),
            "no {later} after a refusal: {spans:#?}"
        );
    }
}
