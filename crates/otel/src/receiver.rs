//! An in-process OTLP/gRPC trace receiver: what a collector would get, for tests and benches.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tonic::{Request, Response, Status};

/// One exported span, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The exporting service's `service.name`.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits, empty for a root span.
    pub parent_span_id: String,
    /// Attributes, values rendered as text.
    pub attributes: Vec<(String, String)>,
    /// The attributes whose values are integers (OTLP `int_value`), also in `attributes`.
    pub ints: Vec<(String, i64)>,
    /// Event names, in order.
    pub events: Vec<String>,
    /// Start, in nanoseconds since the Unix epoch.
    pub start_unix_nanos: u64,
    /// End minus start, in nanoseconds.
    pub duration_nanos: u64,
}

impl ReceivedSpan {
    /// An attribute's value, if present.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// An attribute's value if it was exported as an integer (not as text).
    pub fn int(&self, key: &str) -> Option<i64> {
        self.ints.iter().find(|(k, _)| k == key).map(|&(_, v)| v)
    }
}

type Store = Arc<Mutex<Vec<ReceivedSpan>>>;

#[derive(Debug, Clone)]
struct Service(Store);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| {
                            (
                                kv.key.clone(),
                                text(kv.value.as_ref().and_then(|v| v.value.as_ref())),
                            )
                        })
                        .collect(),
                    ints: span
                        .attributes
                        .iter()
                        .filter_map(
                            |kv| match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                                Some(Value::IntValue(i)) => Some((kv.key.clone(), *i)),
                                _ => None,
                            },
                        )
                        .collect(),
                    events: span.events.into_iter().map(|e| e.name).collect(),
                    start_unix_nanos: span.start_time_unix_nano,
                    duration_nanos: span
                        .end_time_unix_nano
                        .saturating_sub(span.start_time_unix_nano),
                });
            }
        }
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(got);
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver on a loopback port; stops when the runtime does.
#[derive(Debug, Clone)]
pub struct Receiver {
    addr: SocketAddr,
    spans: Store,
}

impl Receiver {
    /// Binds `127.0.0.1:0` and serves on the current runtime.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let spans = Store::default();
        let service = TraceServiceServer::new(Service(Arc::clone(&spans)));
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
            {
                tracing::warn!(error = %e, "OTLP receiver stopped");
            }
        });
        Ok(Self { addr, spans })
    }

    /// The endpoint to give an exporter.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits (polling) until `done` holds for the spans received, or `timeout` passes; returns
    /// the spans either way.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
