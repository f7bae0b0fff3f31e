//! The exporter end to end: spans of `otel::TARGET` reach an OTLP receiver with the caller's
//! trace, other spans and the log stay out, and bad set-ups are refused.

use otel::receiver::Receiver;
use otel::{InitError, TracingArgs};

const CALLER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[test]
fn spans_reach_the_collector_in_the_callers_trace() {
    // Outside a runtime the exporter cannot be built: a clear error, nothing installed.
    let args = TracingArgs {
        otlp_endpoint: Some("http://127.0.0.1:1".into()),
        trace_sample_ratio: 1.0,
        otel_service_name: None,
    };
    assert!(matches!(
        otel::init("test", &args),
        Err(InitError::NoRuntime)
    ));
    let bad = TracingArgs {
        trace_sample_ratio: 2.0,
        ..args.clone()
    };
    assert!(matches!(otel::init("test", &bad), Err(InitError::Args(_))));

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let args = TracingArgs {
        otlp_endpoint: Some(receiver.endpoint()),
        otel_service_name: Some("kvgate-test".into()),
        ..args
    };
    let telemetry = {
        let _rt = runtime.enter();
        otel::init("test", &args).unwrap()
    };
    assert!(telemetry.exporting());

    let downstream = {
        let root = tracing::info_span!(target: otel::TARGET, "request", answer = 42);
        otel::set_parent(
            &root,
            otel::Parent::from_headers(&[("traceparent", CALLER)]).as_ref(),
        );
        let _in = root.enter();
        let _noise = tracing::info_span!("not_traced").entered();
        let child = tracing::info_span!(target: otel::TARGET, "step");
        let _c = child.enter();
        tracing::info!(target: otel::TARGET, "inside");
        otel::trace_headers(&child)
    };
    // A second subscriber cannot take the exporter's place.
    {
        let _rt = runtime.enter();
        assert!(matches!(
            otel::init("test", &args),
            Err(InitError::AlreadyInstalled)
        ));
    }
    telemetry.shutdown();

    let spans = receiver.spans();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let root = spans.iter().find(|s| s.name == "request").unwrap();
    let step = spans.iter().find(|s| s.name == "step").unwrap();
    assert_eq!(root.service, "kvgate-test");
    assert_eq!(root.trace_id, "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(root.parent_span_id, "b7ad6b7169203331");
    assert_eq!(root.attr("answer"), Some("42"));
    assert_eq!(step.trace_id, root.trace_id);
    assert_eq!(
        step.parent_span_id, root.span_id,
        "the untraced span is skipped"
    );
    assert_eq!(step.events, ["inside"]);
    let parent = &downstream[0].1;
    assert_eq!(
        parent,
        &format!("00-{}-{}-01", step.trace_id, step.span_id),
        "the next hop's parent is the span that sent it"
    );
    drop(runtime);
}
