//! `GET /metrics` on :9090: kvgate's own `kvgate_epp_*` metrics plus the GIE names existing
//! dashboards use. Everything is read from counters the components already keep; labels are
//! bounded (pool name only).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_index::KvIndex;

use crate::discovery::Datastore;
use crate::ingest::zmq_direct::IngestStats;
use crate::routing::picker::{Picker, PickerStats};

/// What the exposition reads.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Pool name, the only label.
    pub pool: String,
    /// Routing counters.
    pub picker: Arc<PickerStats>,
    /// Direct-ZMQ ingestion counters.
    pub ingest: Option<Arc<IngestStats>>,
    /// Engine-metrics scraping counters.
    pub scrape: Option<Arc<crate::load::ScrapeStats>>,
    /// NATS ingestion and in-flight sharing counters.
    pub nats: Option<Arc<crate::ingest::nats::NatsStats>>,
    /// The index (size).
    pub index: Arc<KvIndex>,
    /// Endpoints (ready count).
    pub datastore: Arc<Datastore>,
    /// The picker: per-request (GIE) metrics and the pool's engine load.
    pub router: Option<Arc<Picker>>,
    /// The response-observer layout's ticket table, when it runs.
    pub handoffs: Option<Arc<crate::extproc::Handoffs>>,
    /// Kubernetes discovery's watches, when it runs.
    pub kube: Option<Arc<crate::discovery::kubernetes::KubeStats>>,
    /// Node names (the block managers' holders in the index), for `/debug/index`.
    pub nodes: Option<Arc<crate::discovery::apply::NodeIds>>,
}

/// Engine load samples older than this are left out of the pool averages.
const POOL_LOAD_MAX_AGE: kv_index::Millis = kv_index::Millis(5_000);

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// Renders the Prometheus text exposition.
pub fn render(s: &Sources) -> String {
    let pool = s.pool.replace(['\\', '"', '\n'], "_");
    let l = format!("pool=\"{pool}\"");
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{l}}} {value}"
        );
    };
    let p = &s.picker;
    let routed = get(&p.routed);
    metric(
        "kvgate_epp_requests_routed_total",
        "counter",
        "Requests given an endpoint.",
        routed as f64,
    );
    metric(
        "kvgate_epp_keys_exact_total",
        "counter",
        "Requests keyed with the model's real tokenizer.",
        get(&p.exact_keys) as f64,
    );
    metric(
        "kvgate_epp_keys_approximate_total",
        "counter",
        "Requests keyed with the byte fallback (no tokenizer configured).",
        get(&p.approximate_keys) as f64,
    );
    metric(
        "kvgate_epp_keying_early_stops_total",
        "counter",
        "Requests whose tokenization stopped at the first chunk no endpoint held (token counts estimated).",
        get(&p.early_stops) as f64,
    );
    metric(
        "kvgate_epp_estimated_prompt_tokens_total",
        "counter",
        "Prompt tokens estimated from the remaining bytes instead of tokenized (early stops).",
        get(&p.estimated_tokens) as f64,
    );
    if let Some(f) = s.router.as_ref().and_then(|r| r.keyer().finish_stats()) {
        metric(
            "kvgate_epp_prompts_finished_total",
            "counter",
            "Early-stopped prompts tokenized to their end in the background (for the next turn's cache).",
            get(&f.finished) as f64,
        );
        metric(
            "kvgate_epp_prompts_finish_dropped_total",
            "counter",
            "Early-stopped prompts not finished because the background queue was full.",
            get(&f.dropped) as f64,
        );
        metric(
            "kvgate_epp_prompts_finish_over_budget_total",
            "counter",
            "Early-stopped prompts not finished because the finisher's byte budget was spent.",
            get(&f.over_budget) as f64,
        );
        metric(
            "kvgate_epp_background_tokenized_bytes_total",
            "counter",
            "Bytes of prompt text tokenized in the background (segment-cache misses).",
            get(&f.tokenized_bytes) as f64,
        );
    }
    metric(
        "kvgate_epp_prompt_blocks_total",
        "counter",
        "Prompt blocks looked up in the index.",
        get(&p.prompt_blocks) as f64,
    );
    metric(
        "kvgate_epp_prompt_blocks_hit_total",
        "counter",
        "Prompt blocks the chosen endpoint already held (credited tiers).",
        get(&p.gpu_hit_blocks) as f64,
    );
    metric(
        "kvgate_epp_decision_seconds_total",
        "counter",
        "Time spent deciding (parse, tokenize, look up, score), summed.",
        get(&p.decision_nanos) as f64 / 1e9,
    );
    let stats = s.index.stats();
    metric(
        "kvgate_epp_index_blocks",
        "gauge",
        "Distinct blocks in the KV index.",
        stats.blocks as f64,
    );
    metric(
        "kvgate_epp_index_residencies",
        "gauge",
        "(block, holder) residencies in the KV index.",
        stats.residencies as f64,
    );
    metric(
        "kvgate_epp_index_evicted_blocks_total",
        "counter",
        "Blocks evicted from the index to stay within capacity.",
        stats.evicted_blocks as f64,
    );
    metric(
        "kvgate_epp_index_blocking_growths_total",
        "counter",
        "Index shard tables doubled in place, holding that shard's lookups for the copy (ingest grows them from a copy instead; alert if this keeps rising).",
        stats.table_growths_blocking as f64,
    );
    metric(
        "kvgate_epp_index_shared_growths_total",
        "counter",
        "Index shard tables grown from a copy built while lookups went on.",
        stats.table_growths_shared as f64,
    );
    metric(
        "kvgate_epp_index_speculation_skipped_total",
        "counter",
        "Speculative residencies dropped because their index shard was being grown.",
        stats.speculation_skipped as f64,
    );
    if let Some(i) = &s.ingest {
        for (name, help, v) in [
            (
                "kvgate_epp_kv_event_batches_total",
                "Engine event batches applied.",
                &i.batches,
            ),
            (
                "kvgate_epp_kv_events_total",
                "Normalised KV events applied to the index.",
                &i.events,
            ),
            (
                "kvgate_epp_kv_event_gaps_total",
                "Sequence gaps detected in engine streams.",
                &i.gaps,
            ),
            (
                "kvgate_epp_kv_event_replays_total",
                "Gaps repaired through the engine's replay socket.",
                &i.replays,
            ),
            (
                "kvgate_epp_kv_event_resyncs_total",
                "Gaps that dropped a source's entries.",
                &i.resyncs,
            ),
            (
                "kvgate_epp_engine_restarts_total",
                "Engine restarts seen in event streams.",
                &i.restarts,
            ),
            (
                "kvgate_epp_kv_event_malformed_total",
                "Malformed frames or payloads skipped.",
                &i.malformed,
            ),
        ] {
            metric(name, "counter", help, get(v) as f64);
        }
    }
    if let Some(sc) = &s.scrape {
        metric(
            "kvgate_epp_engine_scrapes_total",
            "counter",
            "Engine /metrics scrapes that gave a load sample.",
            get(&sc.ok) as f64,
        );
        metric(
            "kvgate_epp_engine_scrape_failures_total",
            "counter",
            "Engine /metrics scrapes that failed (unreachable, bad status, unparsable).",
            get(&sc.failures) as f64,
        );
    }
    let endpoints = s.datastore.snapshot();
    let ready = endpoints.iter().filter(|e| e.ready).count();
    metric(
        "kvgate_epp_endpoints",
        "gauge",
        "Endpoints discovered.",
        endpoints.len() as f64,
    );
    if let Some(router) = &s.router {
        let health = router.health();
        metric(
            "kvgate_epp_endpoints_unreachable",
            "gauge",
            "Endpoints out of rotation: their /metrics failed several scrapes in a row.",
            health.down_count() as f64,
        );
        metric(
            "kvgate_epp_endpoints_unreachable_total",
            "counter",
            "Times an endpoint was taken out of rotation for failed scrapes.",
            health.marked_down_total() as f64,
        );
    }
    let blocks = get(&p.prompt_blocks);
    metric(
        "kvgate_epp_prefix_hit_ratio",
        "gauge",
        "Share of looked-up prompt blocks the chosen endpoint held, since start.",
        if blocks == 0 {
            0.0
        } else {
            get(&p.gpu_hit_blocks) as f64 / blocks as f64
        },
    );
    if let Some(n) = &s.nats {
        n.render_into(&l, &mut out);
    }
    let mut e = telemetry::Exposition::new();
    e.family(
        "kvgate_epp_prompt_blocks_hit_by_tier_total",
        telemetry::Kind::Counter,
        "Prompt blocks the chosen endpoint held, by the tier of its fastest copy (gpu, or the node's host, disk, remote), credited or not.",
    );
    for (counter, tier) in p
        .tier_hit_blocks
        .iter()
        .zip(["gpu", "host", "disk", "remote"])
    {
        #[allow(clippy::cast_precision_loss)]
        e.sample(
            "kvgate_epp_prompt_blocks_hit_by_tier_total",
            &[("pool", &s.pool), ("tier", tier)],
            get(counter) as f64,
        );
    }
    #[allow(clippy::cast_precision_loss)]
    e.single(
        "inference_pool_ready_pods",
        telemetry::Kind::Gauge,
        "GIE: ready endpoints in the pool.",
        &[("name", &s.pool)],
        ready as f64,
    );
    if let Some(router) = &s.router {
        pool_load(&mut e, router, &endpoints, &s.pool);
        router.request_metrics().render(&mut e, &s.pool);
    }
    if let Some(kube) = &s.kube {
        kube_metrics(&mut e, kube, &s.pool);
    }
    if let Some(h) = &s.handoffs {
        handoff_metrics(&mut e, &h.stats(), &s.pool);
        if let Some(relay) = h.relay() {
            relay_metrics(&mut e, &relay.stats(), &s.pool);
        }
    }
    out.push_str(&e.finish());
    out
}

/// The response-observer layout: tickets waiting for their observer, and what became of them.
#[allow(clippy::cast_precision_loss)]
fn handoff_metrics(e: &mut telemetry::Exposition, h: &crate::extproc::HandoffStats, pool: &str) {
    e.single(
        "kvgate_epp_response_handoffs_parked",
        telemetry::Kind::Gauge,
        "Routed requests whose ticket waits for the response observer's stream.",
        &[("pool", pool)],
        h.parked as f64,
    );
    e.single(
        "kvgate_epp_response_handoffs_observed_by_peers",
        telemetry::Kind::Gauge,
        "Routed requests whose response a peer replica's observer reports (relayed), open now.",
        &[("pool", pool)],
        h.relayed as f64,
    );
    e.family(
        "kvgate_epp_response_handoffs_total",
        telemetry::Kind::Counter,
        "Tickets handed to the response observer: claimed; expired (nobody claimed it in time); \
         overflowed or replaced (aborted at once); unmatched (an observer stream found none); \
         relayed_out (an observer stream here relays to the replica that routed its request); \
         relayed_in (a peer's observer claimed a ticket parked here); relay_lost (a relayed \
         ticket aborted: its observer stopped reporting it); relay_unmatched (a relayed event \
         named no ticket here).",
    );
    for (outcome, n) in [
        ("claimed", h.claimed),
        ("expired", h.expired),
        ("overflowed", h.overflowed),
        ("replaced", h.replaced),
        ("unmatched", h.unmatched),
        ("relayed_out", h.relayed_out),
        ("relayed_in", h.relayed_in),
        ("relay_lost", h.relay_lost),
        ("relay_unmatched", h.relay_unmatched),
    ] {
        e.sample(
            "kvgate_epp_response_handoffs_total",
            &[("pool", pool), ("outcome", outcome)],
            n as f64,
        );
    }
}

/// The response relay's observer side: tickets open towards peers, and the queue to NATS.
#[allow(clippy::cast_precision_loss)]
fn relay_metrics(e: &mut telemetry::Exposition, r: &crate::extproc::RelayStats, pool: &str) {
    e.single(
        "kvgate_epp_response_handoffs_relayed",
        telemetry::Kind::Gauge,
        "Responses observed here for requests peer replicas routed, open now.",
        &[("pool", pool)],
        r.open as f64,
    );
    e.family(
        "kvgate_epp_relay_items_total",
        telemetry::Kind::Counter,
        "Relay items (claims, response events, heartbeats) for peer replicas: queued for NATS, \
         or dropped because the queue was full.",
    );
    for (outcome, n) in [("queued", r.queued), ("dropped", r.dropped)] {
        e.sample(
            "kvgate_epp_relay_items_total",
            &[("pool", pool), ("outcome", outcome)],
            n as f64,
        );
    }
}

/// Kubernetes discovery: whether each watch works, how long the view has been stale, failures
/// and relists.
#[allow(clippy::cast_precision_loss)]
fn kube_metrics(
    e: &mut telemetry::Exposition,
    kube: &crate::discovery::kubernetes::KubeStats,
    pool: &str,
) {
    let watches = kube.watches();
    e.family(
        "kvgate_epp_kube_watch_up",
        telemetry::Kind::Gauge,
        "1 when the Kubernetes watch lists and watches (or its resource is not installed), 0 while it fails.",
    );
    for (watch, up, ..) in &watches {
        e.sample(
            "kvgate_epp_kube_watch_up",
            &[("pool", pool), ("watch", watch)],
            if *up { 1.0 } else { 0.0 },
        );
    }
    e.family(
        "kvgate_epp_kube_watch_failures_total",
        telemetry::Kind::Counter,
        "Kubernetes watch failures (each retried after the backoff with a fresh list).",
    );
    for (watch, _, failures, ..) in &watches {
        e.sample(
            "kvgate_epp_kube_watch_failures_total",
            &[("pool", pool), ("watch", watch)],
            *failures as f64,
        );
    }
    e.family(
        "kvgate_epp_kube_relists_total",
        telemetry::Kind::Counter,
        "Kubernetes watches listed again from scratch, after a failure or periodically.",
    );
    for (watch, _, _, after_error, periodic) in &watches {
        for (reason, n) in [("error", after_error), ("periodic", periodic)] {
            e.sample(
                "kvgate_epp_kube_relists_total",
                &[("pool", pool), ("watch", watch), ("reason", reason)],
                *n as f64,
            );
        }
    }
    e.single(
        "kvgate_epp_kube_stale_seconds",
        telemetry::Kind::Gauge,
        "Seconds the EPP's view of the pool has not been refreshable (a watch unavailable or forbidden); 0 when current. The EPP keeps routing on its last view meanwhile.",
        &[("pool", pool)],
        kube.stale_for(std::time::Instant::now()).as_secs_f64(),
    );
}

/// GIE's pool gauges: averages over ready endpoints with a fresh engine load sample.
fn pool_load(
    e: &mut telemetry::Exposition,
    router: &Picker,
    endpoints: &[scheduler::Endpoint],
    pool: &str,
) {
    let now = router.now();
    let samples: Vec<scheduler::EngineLoad> = endpoints
        .iter()
        .filter(|ep| ep.ready)
        .filter_map(|ep| router.loads().fresh(ep.id, now, POOL_LOAD_MAX_AGE))
        .collect();
    // Requests on each role's ready endpoints (running + waiting, fresh samples): the
    // operator's decode concurrency (Little's law) in a disaggregated pool.
    e.family(
        "kvgate_epp_pool_requests",
        telemetry::Kind::Gauge,
        "Requests running or waiting on the ready endpoints of a role, from fresh engine samples.",
    );
    for role in [
        scheduler::Role::Prefill,
        scheduler::Role::Decode,
        scheduler::Role::Both,
    ] {
        let sum: u64 = endpoints
            .iter()
            .filter(|ep| ep.ready && ep.role == role)
            .filter_map(|ep| router.loads().fresh(ep.id, now, POOL_LOAD_MAX_AGE))
            .map(|l| u64::from(l.running) + u64::from(l.waiting))
            .sum();
        #[allow(clippy::cast_precision_loss)]
        e.sample(
            "kvgate_epp_pool_requests",
            &[("pool", pool), ("role", role.as_str())],
            sum as f64,
        );
    }
    #[allow(clippy::cast_precision_loss)]
    let n = samples.len().max(1) as f64;
    let avg = |f: &dyn Fn(&scheduler::EngineLoad) -> f64| samples.iter().map(f).sum::<f64>() / n;
    let label = [("name", pool)];
    use telemetry::Kind::Gauge;
    e.single(
        "inference_pool_average_kv_cache_utilization",
        Gauge,
        "GIE: mean KV-cache usage (0-1) of ready endpoints with a fresh sample.",
        &label,
        avg(&|l| l.kv_usage),
    );
    e.single(
        "inference_pool_average_queue_size",
        Gauge,
        "GIE: mean engine queue length of ready endpoints with a fresh sample.",
        &label,
        avg(&|l| f64::from(l.waiting)),
    );
    e.single(
        "inference_pool_average_running_requests",
        Gauge,
        "GIE: mean running requests of ready endpoints with a fresh sample.",
        &label,
        avg(&|l| f64::from(l.running)),
    );
    #[allow(clippy::cast_precision_loss)]
    e.single(
        "inference_extension_prefix_indexer_size",
        Gauge,
        "GIE: entries in the prefix index (kvgate: resident block-holder pairs).",
        &[],
        router.index_residencies() as f64,
    );
    let stats = router.stats();
    let blocks = get(&stats.prompt_blocks);
    #[allow(clippy::cast_precision_loss)]
    e.single(
        "inference_extension_prefix_indexer_hit_ratio",
        Gauge,
        "GIE: share of prompt blocks the chosen endpoint held, since start.",
        &[],
        if blocks == 0 {
            0.0
        } else {
            get(&stats.gpu_hit_blocks) as f64 / blocks as f64
        },
    );
    #[allow(clippy::cast_precision_loss)]
    e.single(
        "kvgate_epp_requests_shed_total",
        telemetry::Kind::Counter,
        "Sheddable requests (objective priority < 0) refused with 429 while the pool was saturated.",
        &[],
        get(&stats.shed) as f64,
    );
    #[allow(clippy::cast_precision_loss)]
    e.single(
        "inference_extension_model_rewrite_decisions_total",
        telemetry::Kind::Counter,
        "GIE: requests served under a rewritten model name.",
        &[],
        get(&stats.model_rewrites) as f64,
    );
}

/// One endpoint's line in `/debug/index`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct IndexedEndpoint {
    /// The pod name.
    pub pod: String,
    /// The target port.
    pub port: u16,
    /// Whether it is ready.
    pub ready: bool,
    /// Blocks the index holds for it in any of its own tiers (speculative ones included).
    pub blocks: usize,
}

/// One node's line in `/debug/index`: its block manager's blocks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct IndexedNode {
    /// The node name (as discovery reports it).
    pub node: String,
    /// Blocks the index holds for the node's block manager, any tier.
    pub blocks: usize,
}

/// `GET /debug/index`: the index's size and each endpoint's and node's blocks in it, to compare
/// with what the engines and block managers report they hold (a stale index holds blocks they
/// have dropped). Bounded by the pool's size; each call takes one read lock per index shard
/// per endpoint and node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct IndexReport {
    /// Distinct blocks.
    pub blocks: usize,
    /// (block, holder) residencies.
    pub residencies: usize,
    /// The discovered endpoints, by pod name.
    pub endpoints: Vec<IndexedEndpoint>,
    /// The nodes discovery has named, by name.
    pub nodes: Vec<IndexedNode>,
}

/// Builds the `/debug/index` report.
pub fn index_report(s: &Sources) -> IndexReport {
    let stats = s.index.stats();
    let mut endpoints: Vec<IndexedEndpoint> = s
        .datastore
        .snapshot()
        .iter()
        .filter_map(|e| {
            let (pod, port) = s.datastore.key_of(e.id)?;
            Some(IndexedEndpoint {
                pod,
                port,
                ready: e.ready,
                blocks: s.index.residencies_of(kv_index::Holder::Endpoint(e.id)),
            })
        })
        .collect();
    endpoints.sort_by(|a, b| (&a.pod, a.port).cmp(&(&b.pod, b.port)));
    let nodes = s
        .nodes
        .as_ref()
        .map(|n| n.all())
        .unwrap_or_default()
        .into_iter()
        .map(|(node, id)| IndexedNode {
            blocks: s.index.residencies_of(kv_index::Holder::Node(id)),
            node,
        })
        .collect();
    IndexReport {
        blocks: stats.blocks,
        residencies: stats.residencies,
        endpoints,
        nodes,
    }
}

/// Serves `/metrics` and `/debug/index` on `addr` until `shutdown`.
pub async fn serve(
    addr: std::net::SocketAddr,
    sources: Sources,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::routing::get as route_get;
    let debug = sources.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            route_get(move || {
                let s = sources.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4",
                        )],
                        render(&s),
                    )
                }
            }),
        )
        .route(
            "/debug/index",
            route_get(move || {
                let s = debug.clone();
                async move { axum::Json(index_report(&s)) }
            }),
        );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_report_counts_each_endpoints_blocks() {
        let index = Arc::new(KvIndex::new(kv_index::IndexConfig::default()).unwrap());
        let datastore = Arc::new(Datastore::new());
        let key = |pod: &str| (pod.to_owned(), 8000u16);
        let (a, b) = (
            datastore.id_for(&key("sim-1")),
            datastore.id_for(&key("sim-0")),
        );
        let addr = "127.0.0.1:8000".parse().unwrap();
        datastore.replace(vec![
            (key("sim-1"), scheduler::Endpoint::new(a, addr)),
            (key("sim-0"), scheduler::Endpoint::new(b, addr)),
        ]);
        let keys: Vec<kv_events::BlockKey> = (1..=3).map(kv_events::BlockKey).collect();
        index.speculate(a, &keys, kv_index::Millis(0), kv_index::Millis(60_000));
        // Two nodes; the block manager of n-b holds two of the blocks in host memory.
        let nodes = Arc::new(crate::discovery::apply::NodeIds::default());
        let node_b = nodes.id("n-b");
        nodes.id("n-a");
        index.apply(
            kv_index::Holder::Node(node_b),
            &[kv_events::KvEvent::Stored {
                keys: keys[..2].to_vec(),
                parent: None,
                tier: kv_events::Tier::Host,
                lora: None,
                token_count: 0,
            }],
        );
        let s = Sources {
            pool: "p".into(),
            picker: Arc::default(),
            ingest: None,
            scrape: None,
            nats: None,
            index,
            datastore,
            router: None,
            kube: None,
            handoffs: None,
            nodes: Some(Arc::clone(&nodes)),
        };
        let r = index_report(&s);
        assert_eq!((r.blocks, r.residencies), (3, 5));
        let got: Vec<(&str, usize)> = r
            .endpoints
            .iter()
            .map(|e| (e.pod.as_str(), e.blocks))
            .collect();
        assert_eq!(got, vec![("sim-0", 0), ("sim-1", 3)]);
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            json.contains(r#""pod":"sim-1","port":8000,"ready":true,"blocks":3"#),
            "{json}"
        );
        assert!(
            json.contains(r#""nodes":[{"node":"n-a","blocks":0},{"node":"n-b","blocks":2}]"#),
            "{json}"
        );
    }

    #[test]
    fn renders_gie_and_own_names() {
        let picker = Arc::new(PickerStats::default());
        picker.routed.store(3, Ordering::Relaxed);
        picker.prompt_blocks.store(10, Ordering::Relaxed);
        picker.gpu_hit_blocks.store(4, Ordering::Relaxed);
        picker.tier_hit_blocks[2].store(3, Ordering::Relaxed);
        let s = Sources {
            pool: "p\"1".into(),
            picker,
            ingest: Some(Arc::default()),
            scrape: Some(Arc::default()),
            nats: Some(Arc::default()),
            index: Arc::new(KvIndex::new(kv_index::IndexConfig::default()).unwrap()),
            datastore: Arc::new(Datastore::new()),
            router: None,
            kube: Some(Arc::default()),
            handoffs: Some(Arc::new(crate::extproc::Handoffs::new(4))),
            nodes: None,
        };
        let text = render(&s);
        for want in [
            "kvgate_epp_requests_routed_total{pool=\"p_1\"} 3",
            "kvgate_epp_prefix_hit_ratio{pool=\"p_1\"} 0.4",
            "inference_pool_ready_pods{name=\"p\\\"1\"} 0",
            "kvgate_epp_kv_event_gaps_total{pool=\"p_1\"} 0",
            "# TYPE kvgate_epp_index_residencies gauge",
            "kvgate_epp_nats_connected{pool=\"p_1\"} 0",
            "kvgate_epp_kube_watch_up{pool=\"p\\\"1\",watch=\"pods\"} 1",
            "kvgate_epp_kube_stale_seconds{pool=\"p\\\"1\"} 0",
            "kvgate_epp_kube_relists_total{pool=\"p\\\"1\",watch=\"pods\",reason=\"periodic\"} 0",
            "kvgate_epp_prompt_blocks_hit_by_tier_total{pool=\"p\\\"1\",tier=\"disk\"} 3",
            "kvgate_epp_prompt_blocks_hit_by_tier_total{pool=\"p\\\"1\",tier=\"gpu\"} 0",
            "kvgate_epp_response_handoffs_parked{pool=\"p\\\"1\"} 0",
            "kvgate_epp_response_handoffs_total{pool=\"p\\\"1\",outcome=\"expired\"} 0",
        ] {
            assert!(text.contains(want), "missing {want}\n{text}");
        }
    }

    #[test]
    fn sums_requests_per_role_over_ready_endpoints_with_fresh_samples() {
        use crate::routing::keys::Keyer;
        use scheduler::{Endpoint, EngineLoad, InflightTracker, LoadBook, Role, Scheduler};
        let datastore = Arc::new(Datastore::new());
        let roles = [
            (Role::Prefill, true),
            (Role::Decode, true),
            (Role::Decode, true),
            (Role::Decode, false),
        ];
        let eps: Vec<_> = roles
            .iter()
            .enumerate()
            .map(|(i, &(role, ready))| {
                let key = (format!("pod-{i}"), 8000);
                let mut e = Endpoint::new(
                    datastore.id_for(&key),
                    format!("10.0.0.{i}:8000").parse().unwrap(),
                );
                e.role = role;
                e.ready = ready;
                (key, e)
            })
            .collect();
        datastore.replace(eps.clone());
        let index = Arc::new(KvIndex::new(kv_index::IndexConfig::default()).unwrap());
        let router = Arc::new(Picker::new(
            Keyer::new(4, kv_events::key::SaltStyle::VllmExtraKey, "m"),
            Scheduler::new(scheduler::SchedulerConfig::default(), 1).unwrap(),
            Arc::clone(&index),
            Arc::new(InflightTracker::new()),
            Arc::new(LoadBook::new()),
            Arc::clone(&datastore),
        ));
        let now = router.now();
        for (i, (_, e)) in eps.iter().enumerate() {
            let n = u32::try_from(i).unwrap() + 1;
            router.loads().record(
                e.id,
                EngineLoad {
                    waiting: n,
                    running: 10 * n,
                    kv_usage: 0.5,
                    at: now,
                },
            );
        }
        let s = Sources {
            pool: "p".into(),
            picker: Arc::new(PickerStats::default()),
            ingest: None,
            scrape: None,
            nats: None,
            index,
            datastore,
            router: Some(router),
            kube: None,
            handoffs: None,
            nodes: None,
        };
        let text = render(&s);
        // Ready decode endpoints 1 and 2: (2 + 20) + (3 + 30); the unready one is left out.
        for want in [
            "kvgate_epp_pool_requests{pool=\"p\",role=\"prefill\"} 11",
            "kvgate_epp_pool_requests{pool=\"p\",role=\"decode\"} 55",
            "kvgate_epp_pool_requests{pool=\"p\",role=\"both\"} 0",
        ] {
            assert!(text.contains(want), "missing {want}\n{text}");
        }
    }
}
