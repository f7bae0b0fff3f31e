//! A request's own span on a hot path, held as an OpenTelemetry SDK span rather than a `tracing`
//! span.
//!
//! The EPP's `epp.request` span is created, given a parent, named to the next hop and annotated
//! inside the routing decision, whose cost with tracing on is held to a budget
//! (docs/benchmarks.md, "what tracing costs a decision"). As a `tracing` span each of those steps
//! went through the dispatcher, the registry and the OpenTelemetry layer (its builder, then the
//! SDK span it starts on first use). A [`RequestSpan`] is the SDK span itself: started with the
//! exporting subscriber's tracer, annotated directly, and ended when its last clone drops.
//! Components off the hot path (the sidecar) keep ordinary `tracing` spans with
//! [`crate::set_parent`] and [`crate::trace_headers`].

use std::sync::Arc;

use opentelemetry::trace::{SpanBuilder, SpanKind, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use crate::Parent;
use crate::setup::TracerLayer;

/// A request's span, shared by clones; recording nothing when tracing is off or the request is
/// not sampled. It ends (and is queued for export) when the last clone drops.
#[derive(Debug, Clone, Default)]
pub struct RequestSpan {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    /// Holds the span: the parent context of the request's stages.
    pub(crate) cx: Context,
    pub(crate) tracer: SdkTracer,
}

impl RequestSpan {
    /// A span that records nothing.
    pub const fn none() -> Self {
        Self { inner: None }
    }

    /// Starts a server span named `name` with `attributes`, under `parent` (the caller's
    /// context that [`crate::head`] read; none starts a new trace), with the tracer of the
    /// current dispatcher's exporter. Without an exporter (tracing off, or a subscriber
    /// [`crate::dispatch`] did not build) it records nothing. Call it only for a request
    /// [`crate::head`] says to trace.
    pub fn start(name: &'static str, parent: Option<&Parent>, attributes: Vec<KeyValue>) -> Self {
        let tracer = tracing::dispatcher::get_default(|dispatch| {
            dispatch
                .downcast_ref::<TracerLayer>()
                .map(|sink| sink.tracer.clone())
        });
        let Some(tracer) = tracer else {
            return Self::none();
        };
        let parent = Parent::context(parent);
        let span = tracer.build_with_context(
            SpanBuilder::from_name(name)
                .with_kind(SpanKind::Server)
                .with_attributes(attributes),
            &parent,
        );
        Self {
            inner: Some(Arc::new(Inner {
                cx: parent.with_span(span),
                tracer,
            })),
        }
    }

    /// Whether the span records (the request is traced).
    pub fn is_recording(&self) -> bool {
        self.inner.is_some()
    }

    /// Adds an attribute. The SDK keeps every value it is given: set each key once (a key set
    /// twice is exported twice).
    pub fn set(&self, attribute: KeyValue) {
        if let Some(inner) = &self.inner {
            inner.cx.span().set_attribute(attribute);
        }
    }

    /// Adds several attributes, as [`RequestSpan::set`].
    pub fn set_all(&self, attributes: impl IntoIterator<Item = KeyValue>) {
        if let Some(inner) = &self.inner {
            inner.cx.span().set_attributes(attributes);
        }
    }

    /// The `traceparent` (and `tracestate`, when the trace has one) naming this span as the
    /// parent of the next hop; empty when it records nothing. The sampled flag carries this
    /// hop's decision.
    pub fn trace_headers(&self) -> Vec<(&'static str, String)> {
        match &self.inner {
            Some(inner) => crate::propagate::headers_for(inner.cx.span().span_context()),
            None => Vec::new(),
        }
    }

    pub(crate) fn inner(&self) -> Option<&Arc<Inner>> {
        self.inner.as_ref()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use crate::stages::tests::{Kept, exporting};
    use opentelemetry::trace::SpanKind;

    const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_request_span_continues_the_caller_and_ends_with_its_last_clone() {
        let (exporter, provider, dispatch) = exporting();
        let headers = [("traceparent", CALLER), ("tracestate", "vendor=1")];
        let span = tracing::dispatcher::with_default(&dispatch, || {
            let parent = Parent::from_headers(&headers);
            RequestSpan::start("req", parent.as_ref(), vec![KeyValue::new("a", 1)])
        });
        assert!(span.is_recording());
        let out = span.trace_headers();
        let clone = span.clone();
        span.set(KeyValue::new("b", "x"));
        drop(span);
        provider.force_flush().unwrap();
        assert!(Kept::names(&exporter).is_empty(), "a clone still holds it");
        clone.set_all([KeyValue::new("c", true), KeyValue::new("d", 2.5)]);
        drop(clone);
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(s.name, "req");
        assert_eq!(s.span_kind, SpanKind::Server);
        assert_eq!(
            s.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(s.parent_span_id.to_string(), "00f067aa0ba902b7");
        assert!(s.parent_span_is_remote);
        let want = [
            KeyValue::new("a", 1),
            KeyValue::new("b", "x"),
            KeyValue::new("c", true),
            KeyValue::new("d", 2.5),
        ];
        assert_eq!(s.attributes, want, "the start's, then each set in order");
        // The next hop's parent is this span.
        assert_eq!(
            out[0],
            (
                "traceparent",
                format!(
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01",
                    s.span_context.span_id()
                )
            )
        );
        assert_eq!(out[1], ("tracestate", "vendor=1".to_owned()));
    }

    #[test]
    fn without_context_a_new_trace_and_without_an_exporter_nothing() {
        let (exporter, provider, dispatch) = exporting();
        let span = tracing::dispatcher::with_default(&dispatch, || {
            let malformed = Parent::from_headers(&[("traceparent", "00-zz-00-01")]);
            RequestSpan::start("req", malformed.as_ref(), Vec::new())
        });
        let out = span.trace_headers();
        assert_eq!(out.len(), 1, "no tracestate: {out:?}");
        assert!(!out[0].1.contains("4bf92f35"));
        drop(span);
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans[0].parent_span_id.to_string(), "0000000000000000");

        let plain = tracing::Dispatch::new(tracing_subscriber::registry());
        let off = tracing::dispatcher::with_default(&plain, || {
            RequestSpan::start(
                "req",
                Parent::from_headers(&[("traceparent", CALLER)]).as_ref(),
                Vec::new(),
            )
        });
        assert!(!off.is_recording());
        assert!(off.trace_headers().is_empty());
        off.set(KeyValue::new("a", 1));
    }
}
