//! W3C trace context (`traceparent`, `tracestate`) between hops.

use std::str::FromStr as _;

use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, TraceContextExt as _, TraceFlags, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The value of header `name` (matched without case), if present.
fn header<'a, I: AsRef<str>>(headers: &'a [(I, I)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.as_ref().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_ref())
}

/// The caller's context from a valid `traceparent` (the same rule as the sampling decision,
/// [`crate::head`]) and its `tracestate`, if any. Of the flags only "sampled" is kept, as W3C
/// Trace Context asks; an invalid `tracestate` is dropped.
pub(crate) fn caller<I: AsRef<str>>(headers: &[(I, I)]) -> Option<SpanContext> {
    let (trace, span, flags) = crate::head::traceparent(header(headers, "traceparent")?)?;
    let state = header(headers, "tracestate")
        .and_then(|v| TraceState::from_str(v).ok())
        .unwrap_or_default();
    let flags = TraceFlags::new(flags) & TraceFlags::SAMPLED;
    Some(SpanContext::new(trace, span, flags, true, state))
}

/// Makes `span` a child of the trace context the request carries, if any. Call it before the
/// span is first entered. A malformed `traceparent` is ignored (the span starts a new trace), as
/// the W3C specification asks; a disabled span (tracing off) is left alone.
pub fn set_parent<I: AsRef<str>>(span: &tracing::Span, headers: &[(I, I)]) {
    if span.is_disabled() {
        return;
    }
    // An empty context makes the span a root even under another traced span.
    let parent = match caller(headers) {
        Some(caller) => Context::new().with_remote_span_context(caller),
        None => Context::new(),
    };
    // Only fails when tracing is off (no OpenTelemetry layer) or the span has started: either
    // way the span keeps the parent it has.
    let _ = span.set_parent(parent);
}

/// The `traceparent` (and `tracestate`, when the trace has one) naming `span` as the parent of
/// the next hop; empty when tracing is off. The sampled flag carries this hop's decision.
pub fn trace_headers(span: &tracing::Span) -> Vec<(&'static str, String)> {
    if span.is_disabled() {
        return Vec::new();
    }
    headers_for(span.context().span().span_context())
}

/// `traceparent` (and a non-empty `tracestate`) naming `sc` as the next hop's parent; empty for
/// an invalid context. Only the sampled flag is sent.
pub(crate) fn headers_for(sc: &SpanContext) -> Vec<(&'static str, String)> {
    if !sc.is_valid() {
        return Vec::new();
    }
    let flags = (sc.trace_flags() & TraceFlags::SAMPLED).to_u8();
    let mut out = Vec::with_capacity(2);
    out.push((
        "traceparent",
        format!(
            "00-{:032x}-{:016x}-{flags:02x}",
            sc.trace_id(),
            sc.span_id()
        ),
    ));
    let state = sc.trace_state().header();
    if !state.is_empty() {
        out.push(("tracestate", state));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_span_continues_the_callers_trace_and_names_itself_downstream() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(target: crate::TARGET, "hop");
            let headers = [
                ("Traceparent".to_owned(), PARENT.to_owned()),
                ("tracestate".to_owned(), "vendor=1".to_owned()),
            ];
            set_parent(&span, &headers);
            let out = trace_headers(&span);
            let parent = &out.iter().find(|(k, _)| *k == "traceparent").unwrap().1;
            let parts: Vec<&str> = parent.split('-').collect();
            assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736", "same trace");
            assert_ne!(parts[2], "00f067aa0ba902b7", "this hop's own span id");
            assert_eq!(parts[3], "01", "the caller sampled it");
            assert!(out.contains(&("tracestate", "vendor=1".to_owned())));

            // A malformed header starts a new trace.
            let fresh = tracing::info_span!(target: crate::TARGET, "hop");
            set_parent(&fresh, &[("traceparent", "00-zz-00f067aa0ba902b7-01")]);
            let out = trace_headers(&fresh);
            assert!(!out[0].1.contains("4bf92f3577b34da6a3ce929d0e0e4736"));

            // So does a request without one, even inside another traced span.
            span.in_scope(|| {
                let inner = tracing::info_span!(target: crate::TARGET, "hop");
                set_parent(&inner, &[("x-other", "1")]);
                let out = trace_headers(&inner);
                assert!(
                    !out[0].1.contains("4bf92f3577b34da6a3ce929d0e0e4736"),
                    "{out:?}"
                );
            });
        });
    }

    #[test]
    fn only_the_sampled_flag_goes_on_and_no_empty_tracestate() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(target: crate::TARGET, "hop");
            let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03";
            set_parent(
                &span,
                &[("traceparent", caller), ("tracestate", "not valid=")],
            );
            let out = trace_headers(&span);
            assert_eq!(out.len(), 1, "an invalid tracestate is dropped: {out:?}");
            let (name, value) = &out[0];
            assert_eq!(*name, "traceparent");
            assert!(
                value.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
                "{value}"
            );
            assert!(
                value.ends_with("-01"),
                "unknown flags are not passed on: {value}"
            );
            assert_eq!(value.len(), 55, "{value}");
        });
    }

    #[test]
    fn nothing_is_written_when_tracing_is_off() {
        let span = tracing::Span::none();
        set_parent(&span, &[("traceparent", PARENT)]);
        assert!(trace_headers(&span).is_empty());
    }
}
