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

/// A caller's trace context, read from a request's `traceparent` and `tracestate`: what
/// [`crate::head`] hands a request it traces, for [`set_parent`] and
/// [`crate::RequestSpan::start`], so the headers are read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent(SpanContext);

impl Parent {
    /// The context in `headers` (names matched without case), when its `traceparent` is valid.
    /// Of the flags only "sampled" is kept, as W3C Trace Context asks; an invalid `tracestate`
    /// is dropped.
    pub fn from_headers<I: AsRef<str>>(headers: &[(I, I)]) -> Option<Self> {
        let (trace, span, flags) = crate::head::traceparent(header(headers, "traceparent")?)?;
        let state = header(headers, "tracestate")
            .and_then(|v| TraceState::from_str(v).ok())
            .unwrap_or_default();
        let flags = TraceFlags::new(flags) & TraceFlags::SAMPLED;
        Some(Self(SpanContext::new(trace, span, flags, true, state)))
    }

    /// Whether the caller sampled the trace.
    pub fn is_sampled(&self) -> bool {
        self.0.is_sampled()
    }

    /// A context holding the caller's span, or an empty one (a new trace, even under another
    /// traced span) without a caller.
    pub(crate) fn context(parent: Option<&Self>) -> Context {
        match parent {
            Some(p) => Context::new().with_remote_span_context(p.0.clone()),
            None => Context::new(),
        }
    }
}

/// Makes `span` a child of the caller's context, or the root of a new trace without one. Call
/// it before the span is first entered; a disabled span (tracing off) is left alone.
pub fn set_parent(span: &tracing::Span, parent: Option<&Parent>) {
    if span.is_disabled() {
        return;
    }
    let parent = Parent::context(parent);
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

    /// Runs `f` under a subscriber whose `tracing` spans are OpenTelemetry spans.
    fn exporting(f: impl FnOnce()) {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f);
    }

    #[test]
    fn a_span_continues_the_callers_trace_and_names_itself_downstream() {
        exporting(|| {
            let span = tracing::info_span!(target: crate::TARGET, "hop");
            let headers = [
                ("Traceparent".to_owned(), PARENT.to_owned()),
                ("tracestate".to_owned(), "vendor=1".to_owned()),
            ];
            set_parent(&span, Parent::from_headers(&headers).as_ref());
            let out = trace_headers(&span);
            let parent = &out.iter().find(|(k, _)| *k == "traceparent").unwrap().1;
            let parts: Vec<&str> = parent.split('-').collect();
            assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736", "same trace");
            assert_ne!(parts[2], "00f067aa0ba902b7", "this hop's own span id");
            assert_eq!(parts[3], "01", "the caller sampled it");
            assert!(out.contains(&("tracestate", "vendor=1".to_owned())));

            // A malformed header starts a new trace.
            let fresh = tracing::info_span!(target: crate::TARGET, "hop");
            set_parent(
                &fresh,
                Parent::from_headers(&[("traceparent", "00-zz-00f067aa0ba902b7-01")]).as_ref(),
            );
            let out = trace_headers(&fresh);
            assert!(!out[0].1.contains("4bf92f3577b34da6a3ce929d0e0e4736"));

            // So does a request without one, even inside another traced span.
            span.in_scope(|| {
                let inner = tracing::info_span!(target: crate::TARGET, "hop");
                set_parent(&inner, Parent::from_headers(&[("x-other", "1")]).as_ref());
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
        exporting(|| {
            let span = tracing::info_span!(target: crate::TARGET, "hop");
            let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03";
            let headers = [("traceparent", caller), ("tracestate", "not valid=")];
            set_parent(&span, Parent::from_headers(&headers).as_ref());
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
        set_parent(
            &span,
            Parent::from_headers(&[("traceparent", PARENT)]).as_ref(),
        );
        assert!(trace_headers(&span).is_empty());
    }
}
