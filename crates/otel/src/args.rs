//! The tracing flags shared by kvgate's binaries.

/// How a binary exports its request traces. Off unless an endpoint is given.
#[derive(Debug, Clone, clap::Args)]
pub struct TracingArgs {
    /// OTLP/gRPC collector to send request traces to (e.g. `http://otel-collector:4317`;
    /// `https://` uses TLS with the system's roots). Tracing is off when unset, and then costs
    /// nothing per request.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// Head sampling: the share of traces started here that are recorded, 0.0 to 1.0. A request
    /// that arrives with a W3C `traceparent` follows its caller's decision instead.
    #[arg(
        long,
        env = "OTEL_TRACES_SAMPLER_ARG",
        default_value_t = 0.1,
        value_name = "RATIO"
    )]
    pub trace_sample_ratio: f64,

    /// The `service.name` the spans carry (defaults to the binary's name).
    #[arg(long, env = "OTEL_SERVICE_NAME", value_name = "NAME")]
    pub otel_service_name: Option<String>,
}

impl Default for TracingArgs {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            trace_sample_ratio: 0.1,
            otel_service_name: None,
        }
    }
}

/// A tracing flag that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ArgsError {
    /// The ratio is outside 0..=1 (or not a number).
    #[error("--trace-sample-ratio must be between 0.0 and 1.0, got {0}")]
    SampleRatio(f64),
    /// The endpoint is not an http(s) URL.
    #[error("--otlp-endpoint must be an http:// or https:// URL with a host, got {0:?}")]
    Endpoint(String),
}

impl TracingArgs {
    /// Checks the flags without touching the network.
    pub fn validate(&self) -> Result<(), ArgsError> {
        if !(0.0..=1.0).contains(&self.trace_sample_ratio) {
            return Err(ArgsError::SampleRatio(self.trace_sample_ratio));
        }
        if let Some(url) = &self.otlp_endpoint {
            let rest = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or(""));
            if host.is_none_or(str::is_empty) || url.chars().any(char::is_whitespace) {
                return Err(ArgsError::Endpoint(url.clone()));
            }
        }
        Ok(())
    }

    /// Whether spans are exported.
    pub fn enabled(&self) -> bool {
        self.otlp_endpoint.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(endpoint: Option<&str>, ratio: f64) -> TracingArgs {
        TracingArgs {
            otlp_endpoint: endpoint.map(str::to_owned),
            trace_sample_ratio: ratio,
            otel_service_name: None,
        }
    }

    #[test]
    fn good_flags_pass_and_bad_ones_say_which() {
        assert_eq!(with(None, 0.1).validate(), Ok(()));
        assert_eq!(with(Some("http://collector:4317"), 1.0).validate(), Ok(()));
        assert_eq!(with(Some("https://c.example/"), 0.0).validate(), Ok(()));
        assert_eq!(with(None, 1.5).validate(), Err(ArgsError::SampleRatio(1.5)));
        assert!(matches!(
            with(None, f64::NAN).validate(),
            Err(ArgsError::SampleRatio(_))
        ));
        for bad in ["collector:4317", "http://", "grpc://c:4317", "http://a b"] {
            assert_eq!(
                with(Some(bad), 0.1).validate(),
                Err(ArgsError::Endpoint(bad.into())),
                "{bad}"
            );
        }
        assert!(!with(None, 1.0).enabled());
        assert!(with(Some("http://c:4317"), 1.0).enabled());
    }
}
