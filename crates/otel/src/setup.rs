//! One `tracing` subscriber per process: the stderr log, and the OTLP exporter when asked for.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SdkTracerProvider};
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, fmt};

use crate::{ArgsError, TARGET, TracingArgs};

/// How long one export may take before the batch is dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// Spans held for export at most; past it new spans are dropped, never the request.
const MAX_QUEUE: usize = 8192;
/// How long the exit waits for the last batch.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A flag is invalid.
    #[error(transparent)]
    Args(#[from] ArgsError),
    /// The exporter could not be built from the endpoint.
    #[error("OTLP exporter: {0}")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// The exporter's gRPC channel needs a Tokio runtime to live on.
    #[error("the OTLP exporter must be set up inside a Tokio runtime")]
    NoRuntime,
    /// Another subscriber was installed first, so spans would not reach the exporter.
    #[error("a tracing subscriber is already installed; the OTLP exporter cannot be added")]
    AlreadyInstalled,
}

/// The process's telemetry: flushes the last spans on [`Telemetry::shutdown`] or drop.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends what is queued and stops the exporter. It blocks until the last batch is out (at
    /// most a few seconds), so call it off the runtime's worker threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take() {
            match provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
                Ok(()) => tracing::debug!("trace exporter flushed"),
                Err(e) => tracing::warn!(error = %e, "trace exporter did not flush"),
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Holds the exporter's tracer in the subscriber [`dispatch`] builds: [`crate::RequestSpan`]
/// finds it by downcasting the current dispatcher. It sees no `tracing` span or event (its
/// filter is off).
#[derive(Debug)]
pub(crate) struct TracerLayer {
    pub(crate) tracer: opentelemetry_sdk::trace::SdkTracer,
}

impl<S: tracing::Subscriber> Layer<S> for TracerLayer {}

/// The stderr log's filter: `RUST_LOG` (default `info`), with request spans kept out of the log
/// unless `RUST_LOG` names [`TARGET`].
fn log_filter() -> EnvFilter {
    let rust_log = std::env::var("RUST_LOG").ok();
    let mut directives = cli_support::log_directives(rust_log.as_deref());
    if !directives.contains(TARGET) {
        directives.push_str(&format!(",{TARGET}=off"));
    }
    EnvFilter::new(directives)
}

/// Installs the process's subscriber: the log on stderr and, when `args` name an endpoint, the
/// OTLP trace exporter for spans of target [`TARGET`]. With an endpoint it must run inside a
/// Tokio runtime (the exporter's channel lives there); the export itself runs on a background
/// thread, batched. Without one, an already-installed subscriber (tests) is left in place.
pub fn init(service: &str, args: &TracingArgs) -> Result<Telemetry, InitError> {
    let (dispatch, telemetry) = dispatch(service, args)?;
    let exporting = telemetry.exporting();
    if tracing::dispatcher::set_global_default(dispatch).is_err() && exporting {
        return Err(InitError::AlreadyInstalled);
    }
    if let Some(endpoint) = &args.otlp_endpoint {
        tracing::info!(
            endpoint = %endpoint,
            sample_ratio = args.trace_sample_ratio,
            "exporting request traces over OTLP"
        );
    }
    Ok(telemetry)
}

/// The subscriber [`init`] installs, without installing it: tests and benches scope it to a
/// thread with `tracing::dispatcher::with_default`. The same requirements as [`init`].
pub fn dispatch(
    service: &str,
    args: &TracingArgs,
) -> Result<(tracing::Dispatch, Telemetry), InitError> {
    args.validate()?;
    let log = fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(log_filter());
    let Some(endpoint) = &args.otlp_endpoint else {
        let subscriber = tracing_subscriber::registry().with(log);
        return Ok((tracing::Dispatch::new(subscriber), Telemetry::default()));
    };
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(InitError::NoRuntime);
    }
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT);
    if endpoint.starts_with("https://") {
        exporter =
            exporter.with_tls_config(tonic::transport::ClientTlsConfig::new().with_enabled_roots());
    }
    let exporter = exporter.build().map_err(InitError::Exporter)?;
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            opentelemetry_sdk::trace::BatchConfigBuilder::default()
                .with_max_queue_size(MAX_QUEUE)
                .build(),
        )
        .build();
    let name = args
        .otel_service_name
        .clone()
        .unwrap_or_else(|| service.to_owned());
    // The ratio is applied by `head` before a request's spans exist; a span started here is
    // one `head` chose (or a child of one), so the SDK keeps what it is given.
    crate::head::set_ratio(args.trace_sample_ratio);
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
        .with_resource(Resource::builder().with_service_name(name).build())
        .build();
    // The `tracing` spans exported here (the sidecar's) say what happened to the request: the
    // source location, thread, target and busy/idle split of each span would cost allocations
    // per span and tell an operator nothing. Nothing in kvgate reads OpenTelemetry's current
    // context (a `tracing` span's parent comes from `tracing`'s span tree, trace headers from
    // the span itself), so entering a span does not activate its context.
    let tracer = provider.tracer(service.to_owned());
    let traces = tracing_opentelemetry::layer()
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_context_activation(false)
        .with_tracked_inactivity(false)
        .with_tracer(tracer.clone())
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::INFO));
    // Request spans (`RequestSpan`) and their stages are built with the same tracer, found
    // through this layer.
    let tracer = TracerLayer { tracer }.with_filter(LevelFilter::OFF);
    let subscriber = tracing_subscriber::registry()
        .with(log)
        .with(traces)
        .with(tracer);
    Ok((
        tracing::Dispatch::new(subscriber),
        Telemetry {
            provider: Some(provider),
        },
    ))
}
