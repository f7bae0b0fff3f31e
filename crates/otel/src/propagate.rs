//! W3C trace context (`traceparent`, `tracestate`) between hops.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Request headers as `(lower-case name, value)` pairs.
struct Pairs<'a, I>(&'a [I]);

impl<I: AsRef<str>> Extractor for Pairs<'_, (I, I)> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.as_ref().eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_ref())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

struct Collect(Vec<(&'static str, String)>);

impl Injector for Collect {
    fn set(&mut self, key: &str, value: String) {
        // The trace-context propagator only writes these two.
        let key = match key {
            "traceparent" => "traceparent",
            "tracestate" => "tracestate",
            _ => return,
        };
        self.0.push((key, value));
    }
}

/// Makes `span` a child of the trace context the request carries, if any. Call it before the
/// span is first entered. A malformed `traceparent` is ignored (the span starts a new trace), as
/// the W3C specification asks; a disabled span (tracing off) is left alone.
pub fn set_parent<I: AsRef<str>>(span: &tracing::Span, headers: &[(I, I)]) {
    if span.is_disabled() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Pairs(headers));
    // Only fails when tracing is off (no OpenTelemetry layer) or the span has started: either
    // way the span keeps the parent it has.
    let _ = span.set_parent(cx);
}

/// The `traceparent` (and `tracestate`, when the trace has one) naming `span` as the parent of
/// the next hop; empty when tracing is off. The sampled flag carries this hop's decision.
pub fn trace_headers(span: &tracing::Span) -> Vec<(&'static str, String)> {
    if span.is_disabled() {
        return Vec::new();
    }
    let mut out = Collect(Vec::new());
    TraceContextPropagator::new().inject_context(&span.context(), &mut out);
    out.0
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
        });
    }

    #[test]
    fn nothing_is_written_when_tracing_is_off() {
        let span = tracing::Span::none();
        set_parent(&span, &[("traceparent", PARENT)]);
        assert!(trace_headers(&span).is_empty());
    }
}
