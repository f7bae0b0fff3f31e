//! OpenTelemetry traces for kvgate's components, and the logging set-up that carries them.
//!
//! - [`TracingArgs`]: the flags every traced binary takes (`--otlp-endpoint`,
//!   `--trace-sample-ratio`, `--otel-service-name`, with the standard `OTEL_*` variables).
//! - [`init`]: installs one `tracing` subscriber: the stderr log filtered by `RUST_LOG`, plus,
//!   when an endpoint is set, a layer that exports the spans of target [`TARGET`] over OTLP/gRPC
//!   in batches from a background thread. Without an endpoint, [`TARGET`]'s spans are disabled
//!   at their call sites, so a request pays one cached check per span and nothing else.
//! - [`head`]: the sampling decision, made before any span exists, so that a request that will
//!   not be recorded costs no span (only sampled requests pay for their spans).
//! - [`set_parent`] and [`trace_headers`]: W3C `traceparent`/`tracestate` read from a request and
//!   written towards the next hop, for `tracing` spans (the sidecar's).
//! - [`RequestSpan`]: a request's span on a hot path (the EPP's `epp.request`), an SDK span held
//!   directly, with the same W3C handling; it ends when its last clone drops.
//! - [`StageLog`]: a request's short, nested stages (the EPP's parse, tokenize, pick…) kept as
//!   clock readings and exported as child spans of a [`RequestSpan`] when the log is dropped,
//!   with the SDK's tracer directly: a fraction of what a `tracing` span costs.
//! - `receiver` (feature `receiver`): an in-process OTLP trace receiver for tests and benches.
//!
//! The sidecar's spans are ordinary `tracing` spans with `target: otel::TARGET`. The EPP's are
//! not `tracing` spans at all: a [`RequestSpan`] and its [`StageLog`], found through the
//! subscriber [`init`] installs: a sampled decision pays one SDK span and a clock read per stage,
//! and the seven stage spans are built when the response ends, instead of eight `tracing` spans
//! inside the decision (docs/benchmarks.md, "what tracing costs a decision").

mod args;
mod head;
mod propagate;
#[cfg(feature = "receiver")]
pub mod receiver;
mod request;
mod setup;
mod stages;

pub use args::{ArgsError, TracingArgs};
pub use head::{Head, head};
pub use opentelemetry::KeyValue;
pub use propagate::{Parent, set_parent, trace_headers};
pub use request::RequestSpan;
pub use setup::{InitError, Telemetry, dispatch, init};
pub use stages::{StageId, StageLog};

/// The `tracing` target of the `tracing` spans exported as part of a request's trace (the
/// sidecar's; the EPP's spans are a [`RequestSpan`] and its [`StageLog`], outside `tracing`).
pub const TARGET: &str = "kvgate::trace";

/// A count, size or status code as a span attribute. OpenTelemetry's integers are signed 64-bit,
/// and the exporter's layer takes an unsigned `tracing` value (`u16` to `u64`, `usize`) as text,
/// formatted per record: record such values through this, so they arrive as integers and cost
/// no formatting. Values past `i64::MAX` saturate.
pub fn int<T: TryInto<i64>>(value: T) -> i64 {
    value.try_into().unwrap_or(i64::MAX)
}
