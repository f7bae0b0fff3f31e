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

use crate::http::{BaseUrl, get};
use crate::metrics::Metrics;

/// What to scrape and where to publish.
#[derive(Debug, Clone)]
pub struct LoadRelayConfig {
    /// The engine's base URL.
    pub engine: BaseUrl,
    /// Time between scrapes.
    pub interval: Duration,
    /// The subject samples go to.
    pub subject: String,
    /// The source samples name (the pod, rank 0: the engine's gauges are summed over ranks).
    pub source: Source,
}

/// Scrapes and publishes until the task is dropped.
pub async fn run(client: Client, cfg: LoadRelayConfig, metrics: Arc<Metrics>) {
    let mut tick = tokio::time::interval(cfg.interval.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let timeout = cfg
        .interval
        .clamp(Duration::from_millis(20), Duration::from_secs(1));
    let subject = async_nats::Subject::from(cfg.subject.clone());
    let mut failing = false;
    loop {
        tick.tick().await;
        let gauges = match get(&cfg.engine, "/metrics", timeout, MAX_EXPOSITION).await {
            Ok(body) => parse_gauges(&body).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
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

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
