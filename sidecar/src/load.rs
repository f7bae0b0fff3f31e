//! The load relay: scrapes the engine's Prometheus `/metrics` on loopback at a short interval
//! and publishes a [`LoadSample`] per scrape on `kvgate.load.<ns>.<pool>.<pod>`, so EPP
//! replicas need not scrape every pod themselves. While NATS is away samples are not queued
//! (a stale load sample is worth nothing); scraping continues so staleness stays visible.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::Client;
use bytes::Bytes;
use engine_metrics::{MAX_EXPOSITION, parse_gauges};
use kv_events::Source;
use kv_events::envelope::ENVELOPE_VERSION;
use kv_events::load::LoadSample;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt as _;

use crate::metrics::Metrics;
use crate::proxy::upstream::Upstream;

/// What to scrape and where to publish.
#[derive(Debug, Clone)]
pub struct LoadRelayConfig {
    /// The engine's `host:port`.
    pub engine: String,
    /// Time between scrapes.
    pub interval: Duration,
    /// The subject samples go to.
    pub subject: String,
    /// The source samples name (the pod, rank 0: the engine's gauges are summed over ranks).
    pub source: Source,
}

/// Scrapes and publishes until the task is dropped.
pub async fn run(client: Client, http: Upstream, cfg: LoadRelayConfig, metrics: Arc<Metrics>) {
    let mut tick = tokio::time::interval(cfg.interval.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let timeout = cfg
        .interval
        .clamp(Duration::from_millis(20), Duration::from_secs(1));
    let subject = async_nats::Subject::from(cfg.subject.clone());
    let mut failing = false;
    loop {
        tick.tick().await;
        let gauges = match fetch_metrics(&http, &cfg.engine, timeout).await {
            Ok(body) => parse_gauges(&body).map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        let gauges = match gauges {
            Ok(g) => {
                if failing {
                    failing = false;
                    tracing::info!("engine /metrics scrapes succeed again");
                }
                metrics.scraped();
                g
            }
            Err(e) => {
                metrics.scrape_errors.fetch_add(1, Ordering::Relaxed);
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "engine /metrics scrape failed");
                }
                continue;
            }
        };
        if !metrics.nats_connected.load(Ordering::Relaxed) {
            continue;
        }
        let sample = LoadSample {
            v: ENVELOPE_VERSION,
            source: cfg.source.clone(),
            unix_ms: unix_ms(),
            waiting: gauges.waiting_count(),
            running: gauges.running_count(),
            kv_usage: gauges.kv_usage_fraction(),
        };
        let Ok(bytes) = sample.encode() else {
            continue;
        };
        if client
            .publish(subject.clone(), Bytes::from(bytes))
            .await
            .is_ok()
        {
            metrics.load_samples.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// `GET http://<engine>/metrics` with the proxy's pooled client, bounded in time and size.
async fn fetch_metrics(http: &Upstream, engine: &str, timeout: Duration) -> Result<Bytes, String> {
    let req = Request::get(format!("http://{engine}/metrics"))
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let fetch = async {
        let resp = http.request(req).await.map_err(|e| e.to_string())?;
        if resp.status() != StatusCode::OK {
            return Err(format!("HTTP status {}", resp.status().as_u16()));
        }
        http_body_util::Limited::new(resp.into_body(), MAX_EXPOSITION)
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| format!("reading the body: {e}"))
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| "timed out".to_owned())?
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
