//! Health and lifecycle: liveness (`/health`), readiness (`/ready`: engine healthy, canary
//! passing, KV-event stream live when required, not draining), the pollers feeding readiness,
//! and the drain sequence on SIGTERM.
//!
//! [`router`] gives the two routes for whatever server hosts them (the sidecar's :9091).

pub mod canary;
pub mod drain;
pub mod engine;
pub mod readiness;

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse as _;
use axum::routing::get;

pub use drain::{DrainHook, DrainReport, HookFuture, NoHook};
pub use readiness::{NotReady, Readiness};

/// Health, readiness and drain flags.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// After SIGTERM, how long in-flight responses may run before they are cut.
    #[arg(long, default_value_t = 30)]
    pub drain_grace_seconds: u64,
    /// Readiness also requires the KV-event stream to be live.
    #[arg(long)]
    pub require_kv_events: bool,
    /// How often the engine's /health is polled.
    #[arg(long, default_value_t = 1000)]
    pub engine_health_interval_ms: u64,
    /// An engine /health answer must come within this.
    #[arg(long, default_value_t = 1000)]
    pub engine_health_timeout_ms: u64,
    /// Probe generation with a one-token completion (the canary).
    #[arg(long)]
    pub canary: bool,
    /// Between canary probes.
    #[arg(long, default_value_t = 10_000)]
    pub canary_interval_ms: u64,
    /// A canary token must come back within this.
    #[arg(long, default_value_t = 5000)]
    pub canary_deadline_ms: u64,
    /// Consecutive canary failures that make the pod unready.
    #[arg(long, default_value_t = 3)]
    pub canary_failures: u32,
}

impl HealthArgs {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.engine_health_interval_ms == 0 || self.engine_health_timeout_ms == 0 {
            return Err(
                "--engine-health-interval-ms and --engine-health-timeout-ms must be positive"
                    .into(),
            );
        }
        if self.canary
            && (self.canary_interval_ms == 0
                || self.canary_deadline_ms == 0
                || self.canary_failures == 0)
        {
            return Err(
                "--canary-interval-ms, --canary-deadline-ms and --canary-failures must be positive"
                    .into(),
            );
        }
        Ok(())
    }

    /// The drain grace period.
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.drain_grace_seconds)
    }
}

/// `GET /health` (always 200 while the process serves) and `GET /ready` (200 or 503 with the
/// blocking conditions as JSON).
pub fn router(readiness: Readiness) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route(
            "/ready",
            get(move || {
                let r = readiness.clone();
                async move {
                    let blockers: Vec<&str> =
                        r.blockers().into_iter().map(NotReady::label).collect();
                    let status = if blockers.is_empty() {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    };
                    let body =
                        serde_json::json!({"ready": blockers.is_empty(), "not_ready": blockers});
                    (status, axum::Json(body)).into_response()
                }
            }),
        )
}
