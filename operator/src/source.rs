//! Where the operator reads load and latency: the pool's EPP replicas (their `/metrics`, found
//! through the InferencePool's `endpointPickerRef` Service), or a Prometheus HTTP API. Both end
//! in an [`Observed`]; the EPP's counters need two scrapes, so that source keeps the previous
//! snapshot per autoscaler.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams};

use crate::observe::{Counters, NoObservation, Observed, Snapshot, between};

/// The largest `/metrics` page or Prometheus answer read.
const MAX_BODY: usize = 8 << 20;

/// Why no observation came.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The EPP Service is missing or selects nothing.
    #[error("EPP Service {0}: {1}")]
    Service(String, String),
    /// An API request failed.
    #[error("API: {0}")]
    Api(#[from] kube::Error),
    /// No EPP replica answered.
    #[error("no EPP replica answered: {0}")]
    Unreachable(String),
    /// The first scrape (rates need two).
    #[error("first scrape: rates need a second one")]
    Warming,
    /// The interval's scrapes share no replica, or no time passed.
    #[error("no comparable scrapes ({0:?})")]
    NoObservation(NoObservation),
    /// Prometheus refused or failed.
    #[error("Prometheus {url}: {message}")]
    Prometheus {
        /// Its URL.
        url: String,
        /// What went wrong.
        message: String,
    },
}

impl SourceError {
    /// A bounded reason for conditions and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SourceError::Service(..) => "EppServiceMissing",
            SourceError::Api(_) => "ApiError",
            SourceError::Unreachable(_) => "EppUnreachable",
            SourceError::Warming => "Warming",
            SourceError::NoObservation(_) => "NoComparableScrapes",
            SourceError::Prometheus { .. } => "PrometheusError",
        }
    }
}

/// A bounded HTTP GET client for `/metrics` and the Prometheus API.
#[derive(Debug, Clone)]
pub struct Http {
    client: HttpClient<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl Http {
    /// A client whose requests time out after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            client: HttpClient::builder(TokioExecutor::new()).build_http(),
            timeout,
        }
    }

    /// The body of a 200 answer to `GET url`, at most 8 MiB.
    pub async fn get(&self, url: &str) -> Result<String, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let fut = async {
            let resp = self
                .client
                .get(uri)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| format!("{url}: {e}"))?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("{url}: HTTP {status}"));
            }
            String::from_utf8(body.to_vec()).map_err(|e| format!("{url}: {e}"))
        };
        tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| format!("{url}: no answer within {:?}", self.timeout))?
    }
}

/// The EPP replicas of a pool: the pods the Service selects, and their metrics port.
pub async fn epp_targets(
    client: &kube::Client,
    namespace: &str,
    service: &str,
    port_name: &str,
) -> Result<Vec<(String, String)>, SourceError> {
    let svc = match Api::<Service>::namespaced(client.clone(), namespace)
        .get(service)
        .await
    {
        Ok(s) => s,
        Err(kube::Error::Api(s)) if s.code == 404 => {
            return Err(SourceError::Service(service.into(), "not found".into()));
        }
        Err(e) => return Err(e.into()),
    };
    let spec = svc.spec.unwrap_or_default();
    let selector = spec.selector.unwrap_or_default();
    if selector.is_empty() {
        return Err(SourceError::Service(service.into(), "no selector".into()));
    }
    let port = spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.name.as_deref() == Some(port_name))
        .ok_or_else(|| {
            SourceError::Service(service.into(), format!("no port named {port_name}"))
        })?;
    let target = port.target_port.unwrap_or(IntOrString::Int(port.port));
    let labels = selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&labels))
        .await?;
    let mut out = Vec::new();
    for pod in pods.items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            continue;
        };
        let port = match &target {
            IntOrString::Int(n) => Some(*n),
            IntOrString::String(named) => pod.spec.as_ref().and_then(|s| {
                s.containers.iter().find_map(|c| {
                    c.ports.as_ref()?.iter().find_map(|p| {
                        (p.name.as_deref() == Some(named.as_str())).then_some(p.container_port)
                    })
                })
            }),
        };
        if let Some(port) = port {
            out.push((name, format!("http://{ip}:{port}/metrics")));
        }
    }
    if out.is_empty() {
        return Err(SourceError::Service(
            service.into(),
            "selects no pod with an IP and the metrics port".into(),
        ));
    }
    Ok(out)
}

/// Scrapes every target; `Err` when none answered.
pub async fn scrape(
    http: &Http,
    targets: &[(String, String)],
    at_s: f64,
) -> Result<Snapshot, SourceError> {
    let mut replicas = BTreeMap::new();
    let mut errors = Vec::new();
    for (name, url) in targets {
        match http.get(url).await {
            Ok(page) => match Counters::parse(&page) {
                Ok(c) => {
                    replicas.insert(name.clone(), c);
                }
                Err(e) => errors.push(format!("{url}: {e}")),
            },
            Err(e) => errors.push(e),
        }
    }
    if replicas.is_empty() {
        return Err(SourceError::Unreachable(errors.join("; ")));
    }
    Ok(Snapshot { at_s, replicas })
}

/// The observation between the previous snapshot (if any) and `now`.
pub fn observe(
    previous: Option<&Snapshot>,
    now: &Snapshot,
    percentile: f64,
) -> Result<Observed, SourceError> {
    let previous = previous.ok_or(SourceError::Warming)?;
    between(previous, now, percentile).map_err(SourceError::NoObservation)
}

/// The PromQL the Prometheus source runs, for the series of `namespace`/`pool` over `window`.
pub fn promql(
    namespace: &str,
    pool: &str,
    window_s: u64,
    percentile: f64,
) -> [(String, String); 7] {
    let sel = format!("namespace=\"{namespace}\",pool=\"{pool}\"");
    let w = format!("{window_s}s");
    let q = (percentile / 100.0).clamp(0.0, 1.0);
    [
        (
            "rps".into(),
            format!("sum(rate(inference_objective_request_total{{{sel}}}[{w}]))"),
        ),
        (
            "isl".into(),
            format!(
                "sum(rate(inference_objective_input_tokens_sum{{{sel}}}[{w}])) / sum(rate(inference_objective_input_tokens_count{{{sel}}}[{w}]))"
            ),
        ),
        (
            "osl".into(),
            format!(
                "sum(rate(inference_objective_output_tokens_sum{{{sel}}}[{w}])) / sum(rate(inference_objective_output_tokens_count{{{sel}}}[{w}]))"
            ),
        ),
        (
            "ttft".into(),
            format!(
                "histogram_quantile({q}, sum by (le) (rate(inference_objective_request_ttft_seconds_bucket{{{sel}}}[{w}])))"
            ),
        ),
        (
            "itl".into(),
            format!(
                "histogram_quantile({q}, sum by (le) (rate(inference_objective_request_tpot_seconds_bucket{{{sel}}}[{w}])))"
            ),
        ),
        (
            "queue".into(),
            format!("avg(inference_pool_average_queue_size{{{sel}}})"),
        ),
        (
            "decode".into(),
            format!("avg(kvgate_epp_pool_requests{{{sel},role=\"decode\"}})"),
        ),
    ]
}

/// One scalar from a Prometheus instant-query answer; `None` for an empty result or NaN.
pub fn prometheus_value(answer: &str) -> Result<Option<f64>, String> {
    let v: serde_json::Value = serde_json::from_str(answer).map_err(|e| e.to_string())?;
    if v.get("status").and_then(|s| s.as_str()) != Some("success") {
        return Err(v
            .get("error")
            .and_then(|e| e.as_str())
            .unwrap_or("query failed")
            .to_owned());
    }
    let first = v
        .pointer("/data/result/0/value/1")
        .and_then(|s| s.as_str())
        .map(str::parse::<f64>);
    match first {
        None => Ok(None),
        Some(Ok(x)) if x.is_finite() => Ok(Some(x)),
        Some(Ok(_)) => Ok(None),
        Some(Err(e)) => Err(e.to_string()),
    }
}

/// Queries Prometheus for the pool's load and latency.
pub async fn prometheus(
    http: &Http,
    base: &str,
    namespace: &str,
    pool: &str,
    window_s: u64,
    percentile: f64,
) -> Result<Observed, SourceError> {
    let mut values = BTreeMap::new();
    for (name, query) in promql(namespace, pool, window_s, percentile) {
        let url = format!(
            "{}/api/v1/query?query={}",
            base.trim_end_matches('/'),
            encode(&query)
        );
        let answer = http
            .get(&url)
            .await
            .map_err(|message| SourceError::Prometheus {
                url: base.into(),
                message,
            })?;
        let v = prometheus_value(&answer).map_err(|message| SourceError::Prometheus {
            url: base.into(),
            message,
        })?;
        values.insert(name, v);
    }
    let get = |k: &str| values.get(k).copied().flatten();
    let rps = get("rps").ok_or_else(|| SourceError::Prometheus {
        url: base.into(),
        message: format!("no series of inference_objective_request_total for {namespace}/{pool}"),
    })?;
    Ok(Observed {
        rps,
        isl_tokens: get("isl").unwrap_or(0.0),
        osl_tokens: get("osl").unwrap_or(0.0),
        ttft_ms: get("ttft").map(|s| s * 1000.0),
        itl_ms: get("itl").map(|s| s * 1000.0),
        queue_depth: get("queue"),
        decode_requests: get("decode"),
    })
}

/// Percent-encoding of a query parameter (RFC 3986 unreserved characters kept).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn prometheus_answers_are_read_and_refusals_named() {
        let ok = r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1.0,"12.5"]}]}}"#;
        assert_eq!(prometheus_value(ok), Ok(Some(12.5)));
        let empty = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        assert_eq!(prometheus_value(empty), Ok(None));
        let nan = r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1.0,"NaN"]}]}}"#;
        assert_eq!(prometheus_value(nan), Ok(None));
        let bad = r#"{"status":"error","errorType":"bad_data","error":"parse error"}"#;
        assert_eq!(prometheus_value(bad), Err("parse error".into()));
    }

    #[test]
    fn queries_select_the_pool_and_encode() {
        let q = promql("llm", "qwen", 30, 90.0);
        assert!(q[0].1.contains("namespace=\"llm\",pool=\"qwen\""));
        assert!(q[3].1.starts_with("histogram_quantile(0.9, "));
        assert_eq!(encode("a b{c=\"d\"}"), "a%20b%7Bc%3D%22d%22%7D");
    }
}
