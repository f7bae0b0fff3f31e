//! A request's short, nested stages recorded as data and exported as spans in one go, outside
//! `tracing`.
//!
//! A `tracing` span exported by the OpenTelemetry layer costs about 5 k instructions across its
//! creation, entry, exit and close (the registry's slot and extensions, the per-layer filters'
//! bookkeeping, the layer's span builder), before the SDK builds and queues the span itself
//! (docs/benchmarks.md, "what tracing costs a decision"). The stages of a routing decision are
//! short, strictly nested and known only to the code that runs them, so a [`StageLog`] keeps
//! their clock readings and attributes, and builds the spans with the SDK's tracer when it is
//! dropped, as children of the request's span ([`RequestSpan`]). The decision pays a clock read per
//! stage boundary; building and queueing the spans happens when the log is dropped, which the
//! EPP does at the response's end.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use opentelemetry::trace::{Span as _, SpanBuilder, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};

use crate::request::{Inner, RequestSpan};

/// A stage of a [`StageLog`], to name as a later stage's parent or to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageId(usize);

#[derive(Debug)]
struct Stage {
    name: &'static str,
    parent: Option<StageId>,
    start: Instant,
    /// `None` while open: the stage then ends when the log is dropped.
    end: Option<Instant>,
    attributes: Vec<KeyValue>,
}

/// Stages recorded under a sampled request's span; exported as its child spans on drop.
/// Inactive (every call a no-op that reads no clock) for a request that is not traced.
#[derive(Debug)]
pub struct StageLog {
    active: Option<Active>,
}

#[derive(Debug)]
struct Active {
    /// The request's span (kept open until the stages are exported) and the tracer.
    request: Arc<Inner>,
    /// One reading of both clocks: stages are timed on the monotonic clock and exported on
    /// the wall clock.
    wall: SystemTime,
    mono: Instant,
    stages: Vec<Stage>,
}

/// Stages of a decision and its response, with room to spare.
const EXPECTED_STAGES: usize = 8;

impl StageLog {
    /// A log that records nothing.
    pub fn none() -> Self {
        Self { active: None }
    }

    /// A log under `request`; inactive when the request is not traced.
    pub fn start(request: &RequestSpan) -> Self {
        let Some(inner) = request.inner() else {
            return Self::none();
        };
        Self {
            active: Some(Active {
                request: Arc::clone(inner),
                wall: SystemTime::now(),
                mono: Instant::now(),
                stages: Vec::with_capacity(EXPECTED_STAGES),
            }),
        }
    }

    /// Whether stages are recorded: check it before computing attributes.
    pub fn is_active(&self) -> bool {
        self.active.is_some()
    }

    /// Opens a stage now, under `parent` (a stage of this log) or under the request.
    pub fn open(&mut self, name: &'static str, parent: Option<StageId>) -> StageId {
        match &self.active {
            Some(_) => self.open_at(name, parent, Instant::now()),
            None => StageId(usize::MAX),
        }
    }

    /// Opens a stage that started at `start`.
    pub fn open_at(
        &mut self,
        name: &'static str,
        parent: Option<StageId>,
        start: Instant,
    ) -> StageId {
        let Some(active) = &mut self.active else {
            return StageId(usize::MAX);
        };
        active.stages.push(Stage {
            name,
            // Only an earlier stage can be a parent: the export builds them in order.
            parent: parent.filter(|p| p.0 < active.stages.len()),
            start,
            end: None,
            attributes: Vec::new(),
        });
        StageId(active.stages.len() - 1)
    }

    /// Closes a stage now, adding `attributes`.
    pub fn close(&mut self, id: StageId, attributes: impl IntoIterator<Item = KeyValue>) {
        if self.active.is_some() {
            self.close_at(id, Instant::now(), attributes);
        }
    }

    /// Closes a stage at `end`, adding `attributes`. Closing a closed stage moves its end.
    pub fn close_at(
        &mut self,
        id: StageId,
        end: Instant,
        attributes: impl IntoIterator<Item = KeyValue>,
    ) {
        let Some(stage) = self.stage(id) else {
            return;
        };
        stage.end = Some(end.max(stage.start));
        stage.attributes.extend(attributes);
    }

    /// Adds attributes to a stage, open or closed.
    pub fn annotate(&mut self, id: StageId, attributes: impl IntoIterator<Item = KeyValue>) {
        if let Some(stage) = self.stage(id) {
            stage.attributes.extend(attributes);
        }
    }

    /// A stage that ran from `start` to `end`.
    pub fn record(
        &mut self,
        name: &'static str,
        parent: Option<StageId>,
        start: Instant,
        end: Instant,
        attributes: impl IntoIterator<Item = KeyValue>,
    ) -> StageId {
        let id = self.open_at(name, parent, start);
        self.close_at(id, end, attributes);
        id
    }

    fn stage(&mut self, id: StageId) -> Option<&mut Stage> {
        self.active.as_mut()?.stages.get_mut(id.0)
    }
}

impl Active {
    fn wall(&self, at: Instant) -> SystemTime {
        if at >= self.mono {
            self.wall + (at - self.mono)
        } else {
            self.wall
                .checked_sub(self.mono - at)
                .unwrap_or(SystemTime::UNIX_EPOCH)
        }
    }

    /// Builds and ends every stage's span: parents before their children (a parent is always
    /// an earlier stage), each ended at its recorded end, or now if it was left open.
    fn export(mut self) {
        let request = self.request.cx.clone();
        let now = Instant::now();
        let stages = std::mem::take(&mut self.stages);
        let is_parent: Vec<bool> = (0..stages.len())
            .map(|i| stages.iter().any(|s| s.parent == Some(StageId(i))))
            .collect();
        // A parent's span lives in its context until its children are built.
        let mut parents: Vec<Option<(Context, SystemTime)>> = Vec::with_capacity(stages.len());
        for (stage, is_parent) in stages.into_iter().zip(is_parent) {
            let cx = stage
                .parent
                .and_then(|p| parents.get(p.0))
                .and_then(|p| p.as_ref().map(|(cx, _)| cx))
                .unwrap_or(&request);
            let builder = SpanBuilder::from_name(stage.name)
                .with_start_time(self.wall(stage.start))
                .with_attributes(stage.attributes);
            let mut span = self.request.tracer.build_with_context(builder, cx);
            let end = self.wall(stage.end.unwrap_or(now).max(stage.start));
            if is_parent {
                parents.push(Some((cx.with_span(span), end)));
            } else {
                span.end_with_timestamp(end);
                parents.push(None);
            }
        }
        for (cx, end) in parents.into_iter().flatten().rev() {
            cx.span().end_with_timestamp(end);
        }
    }
}

impl Drop for StageLog {
    fn drop(&mut self) {
        if let Some(active) = self.active.take() {
            active.export();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use crate::setup::TracerLayer;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
    use std::sync::Mutex;
    use std::time::Duration;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt;

    /// Keeps every exported span.
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Kept(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Kept {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    impl Kept {
        pub(crate) fn get_finished_spans(&self) -> Result<Vec<SpanData>, ()> {
            Ok(self.0.lock().unwrap().clone())
        }

        pub(crate) fn names(&self) -> Vec<String> {
            self.0
                .lock()
                .unwrap()
                .iter()
                .map(|s| s.name.to_string())
                .collect()
        }
    }

    /// A subscriber with the tracer layer, exporting each ended span at once to `Kept`.
    pub(crate) fn exporting() -> (Kept, SdkTracerProvider, tracing::Dispatch) {
        let exporter = Kept::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let tracer = provider.tracer("test");
        let layer = TracerLayer { tracer }.with_filter(tracing::level_filters::LevelFilter::OFF);
        let subscriber = tracing_subscriber::registry().with(layer);
        (exporter, provider, tracing::Dispatch::new(subscriber))
    }

    fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans.iter().find(|s| s.name == name).unwrap()
    }

    fn request(dispatch: &tracing::Dispatch) -> RequestSpan {
        tracing::dispatcher::with_default(dispatch, || {
            RequestSpan::start("request", None, Vec::new())
        })
    }

    #[test]
    fn stages_become_children_of_the_request_with_their_own_times() {
        let (exporter, provider, dispatch) = exporting();
        let request = request(&dispatch);
        let mut log = StageLog::start(&request);
        assert!(log.is_active());
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        log.record("parse", None, ms(0), ms(1), [KeyValue::new("bytes", 10)]);
        let pick = log.open_at("pick", None, ms(1));
        log.record("lookup", Some(pick), ms(1), ms(2), []);
        log.record("score", Some(pick), ms(2), ms(4), []);
        log.close_at(pick, ms(5), [KeyValue::new("endpoint", "a")]);
        let open = log.open_at("first_token", None, ms(5));
        log.annotate(open, [KeyValue::new("late", true)]);
        drop(request);
        provider.force_flush().unwrap();
        assert!(
            Kept::names(&exporter).is_empty(),
            "the log keeps the request open: {:?}",
            Kept::names(&exporter)
        );
        drop(log);
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(
            spans.last().map(|s| s.name.to_string()).as_deref(),
            Some("request"),
            "the request ends after its stages"
        );
        let request = named(&spans, "request");
        let id = request.span_context.span_id();
        for name in ["parse", "pick", "first_token"] {
            let s = named(&spans, name);
            assert_eq!(s.parent_span_id, id, "{name} under the request");
            assert_eq!(s.span_context.trace_id(), request.span_context.trace_id());
            assert!(!s.parent_span_is_remote, "{name}");
        }
        let pick = named(&spans, "pick");
        for name in ["lookup", "score"] {
            let s = named(&spans, name);
            assert_eq!(s.parent_span_id, pick.span_context.span_id(), "{name}");
            assert!(s.start_time >= pick.start_time && s.end_time <= pick.end_time);
        }
        let took = |s: &SpanData| s.end_time.duration_since(s.start_time).unwrap();
        assert_eq!(took(named(&spans, "score")), Duration::from_millis(2));
        assert_eq!(took(pick), Duration::from_millis(4));
        assert!(
            named(&spans, "parse")
                .attributes
                .contains(&KeyValue::new("bytes", 10))
        );
        assert!(pick.attributes.contains(&KeyValue::new("endpoint", "a")));
        // Left open: it ends when the log is dropped, after it started.
        let open = named(&spans, "first_token");
        assert!(open.end_time >= open.start_time);
        assert!(open.attributes.contains(&KeyValue::new("late", true)));
        assert_eq!(spans.len(), 6);
    }

    #[test]
    fn nothing_is_recorded_for_an_untraced_request() {
        let mut log = StageLog::start(&RequestSpan::none());
        assert!(!log.is_active());
        let id = log.open("parse", None);
        log.close(id, [KeyValue::new("bytes", 1)]);
        log.annotate(id, [KeyValue::new("bytes", 1)]);
        assert!(!StageLog::none().is_active());
    }

    #[test]
    fn a_parent_must_come_first_and_ends_are_never_before_starts() {
        let (exporter, provider, dispatch) = exporting();
        let request = request(&dispatch);
        let mut log = StageLog::start(&request);
        let t0 = Instant::now();
        // A parent that does not exist (yet) is ignored: the stage hangs under the request.
        log.record("orphan", Some(StageId(5)), t0, t0, []);
        // An end before the start is clamped to the start.
        let late = t0 + Duration::from_millis(3);
        log.record("backwards", None, late, t0, []);
        drop(log);
        drop(request);
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let request = named(&spans, "request").span_context.span_id();
        assert_eq!(named(&spans, "orphan").parent_span_id, request);
        let b = named(&spans, "backwards");
        assert_eq!(b.end_time, b.start_time);
    }
}
