//! Composition: builds the routing state from the arguments, runs discovery, KV-event
//! ingestion and index maintenance beside the ext_proc server, and shuts down on SIGINT/SIGTERM.

use crate::load::health::{HealthBook, HealthConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kv_events::key::SaltStyle;
use kv_index::{IndexConfig, KvIndex};
use scheduler::{InflightTracker, LoadBook, Scheduler, SchedulerConfig};

use crate::args::{Args, Discovery, EngineArg, PoolGroupArg};
use crate::discovery::apply::{NodeIds, Targets, apply};
use crate::discovery::file::{FileWatch, Parsed, parse};
use crate::discovery::kubernetes::{KubeDiscovery, PoolGroup, WatchConfig};
use crate::discovery::{Datastore, Wake};
use crate::extproc::{Handoffs, Relay};
use crate::ingest::nats::{
    NatsConfig, NatsIngest, RelayConfig, SharingConfig, random_replica_id, relay_queue,
};
use crate::ingest::zmq_direct::{DirectSource, Ingester};
use crate::routing::keys::{Keyer, ModelTokenizer};
use crate::routing::picker::Picker;
use crate::server::{Readiness, ServerConfig};

/// How often the endpoints file is checked and speculative entries expire (Kubernetes changes
/// do not wait for it).
const TICK: Duration = Duration::from_millis(500);
/// Bytes of token ids the multi-turn tokenization cache holds per model.
const TOKEN_CACHE_BYTES: usize = 256 << 20;

/// Why the EPP stopped.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Bad configuration.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The server failed.
    #[error("ext_proc server: {0}")]
    Serve(String),
    /// The runtime could not start.
    #[error("runtime: {0}")]
    Runtime(std::io::Error),
}

impl cli_support::ExitStatus for AppError {
    fn exit_code(&self) -> u8 {
        match self {
            AppError::Start(_) => cli_support::EXIT_CONFIG,
            AppError::Serve(_) | AppError::Runtime(_) => 1,
        }
    }
}

fn config_error(msg: impl Into<String>) -> AppError {
    AppError::Start(cli_support::StartError::Config(msg.into()))
}

/// Everything shared between the picker and the background work.
struct State {
    index: Arc<KvIndex>,
    inflight: Arc<InflightTracker>,
    loads: Arc<LoadBook>,
    datastore: Arc<Datastore>,
    scheduler_for_upkeep: Scheduler,
    nodes: Arc<NodeIds>,
}

/// Most tickets parked for a response observer at once (each is claimed within milliseconds,
/// or aborted within two seconds).
const HANDOFF_CAPACITY: usize = 1 << 16;
/// Most relayed items queued for publishing (a few per request; drained continuously).
const RELAY_QUEUE: usize = 1 << 16;
// A heartbeat lists every relayed ticket open towards one owner; a receiver refuses a longer
// list, so the relay may never hold more.
const _: () = assert!(HANDOFF_CAPACITY <= crate::ingest::nats::relay_wire::MAX_OBSERVING);

/// Runs the EPP until a shutdown signal.
pub fn run(args: Args) -> Result<(), AppError> {
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if args.worker_threads > 0 {
        runtime.worker_threads(args.worker_threads);
    }
    let runtime = runtime.enable_all().build().map_err(AppError::Runtime)?;
    // The log, and the trace exporter whose channel lives on the runtime.
    let telemetry = {
        let _runtime = runtime.enter();
        otel::init("kvgate-epp", &args.tracing).map_err(|e| config_error(e.to_string()))?
    };
    args.validate().map_err(config_error)?;
    let scheduler_config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| config_error(format!("{}: {e}", path.display())))?;
            SchedulerConfig::from_yaml(&text)
                .map_err(|e| config_error(format!("{}: {e}", path.display())))?
        }
        None => SchedulerConfig::default(),
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let scheduler = Scheduler::new(scheduler_config.clone(), seed)
        .map_err(|e| config_error(format!("scheduler: {e}")))?;
    let upkeep = Scheduler::new(scheduler_config, seed)
        .map_err(|e| config_error(format!("scheduler: {e}")))?;
    let keyer = keyer(&args)?;
    let index = Arc::new(
        KvIndex::new(IndexConfig::default()).map_err(|e| config_error(format!("index: {e}")))?,
    );
    let state = Arc::new(State {
        index: Arc::clone(&index),
        inflight: Arc::new(InflightTracker::new()),
        loads: Arc::new(LoadBook::new()),
        datastore: Arc::new(Datastore::new()),
        scheduler_for_upkeep: upkeep,
        nodes: Arc::new(NodeIds::default()),
    });
    let rewrites = match &args.model_rewrites {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| config_error(format!("{}: {e}", path.display())))?;
            let rules = crate::routing::rewrite::RewriteRules::from_yaml(&text)
                .map_err(|e| config_error(format!("{}: {e}", path.display())))?;
            tracing::info!(rules = rules.rules.len(), path = %path.display(), "model rewrite rules loaded");
            rules
        }
        None => crate::routing::rewrite::RewriteRules::default(),
    };
    let wake = Arc::new(Wake::default());
    let feed = start_feed(&args, runtime.handle(), Arc::clone(&wake))?;
    let mut picker = Picker::new(
        keyer,
        scheduler,
        Arc::clone(&state.index),
        Arc::clone(&state.inflight),
        Arc::clone(&state.loads),
        Arc::clone(&state.datastore),
    )
    .with_rewrites(rewrites)
    .with_client_transfer_fields(args.allow_client_transfer_params);
    if args.allow_client_transfer_params {
        tracing::warn!(
            "clients may set kv_transfer_params and bootstrap_*: engines will pull KV from hosts they name"
        );
    }
    if let Feed::Kube(kube) = &feed {
        let objectives: Arc<dyn crate::routing::picker::Objectives> =
            Arc::clone(kube.objectives()) as _;
        picker = picker.with_objectives(objectives);
    }
    let health = Arc::new(HealthBook::new(HealthConfig::default()));
    let picker = Arc::new(picker.with_health(Arc::clone(&health)));
    let readiness = Readiness::new();
    let stop = Arc::new(AtomicBool::new(false));
    let ingester = Ingester::new(Arc::clone(&state.index));
    let scraper = {
        let p = Arc::clone(&picker);
        crate::load::Scraper::new(
            Arc::clone(&state.loads),
            health,
            Arc::new(move || p.now()),
            crate::load::ScrapeConfig::default(),
        )
    };
    // One id per start names this replica to its peers (in-flight sharing, the response relay).
    let replica = random_replica_id();
    let (handoffs, relay) = handoff_table(&args, replica);
    let nats = match nats_config(&args, replica) {
        Some(config) => {
            let shared = crate::ingest::nats::Shared {
                index: Arc::clone(&state.index),
                loads: Arc::clone(&state.loads),
                inflight: Arc::clone(&state.inflight),
                datastore: Arc::clone(&state.datastore),
                nodes: Arc::clone(&state.nodes),
                model: Arc::from(args.model.as_str()),
                clock: {
                    let p = Arc::clone(&picker);
                    Arc::new(move || p.now())
                },
            };
            let started = runtime
                .block_on(NatsIngest::start_with_relay(config, shared, relay))
                .map_err(|e| config_error(e.to_string()))?;
            Some(started)
        }
        None => {
            tracing::info!("no --nats-url: NATS ingestion and in-flight sharing are off");
            None
        }
    };
    let metrics_sources = crate::metrics::Sources {
        handoffs: handoffs.clone(),
        pool: args.pool_name.clone(),
        picker: picker.stats(),
        router: Some(Arc::clone(&picker)),
        ingest: Some(ingester.stats()),
        scrape: Some(scraper.stats()),
        nats: nats.as_ref().map(NatsIngest::stats),
        index: Arc::clone(&state.index),
        datastore: Arc::clone(&state.datastore),
        nodes: Some(Arc::clone(&state.nodes)),
        kube: match &feed {
            Feed::Kube(kube) => Some(Arc::clone(kube.stats())),
            Feed::File(_) => None,
        },
    };
    let background = {
        let (state, stop, readiness, picker) = (
            Arc::clone(&state),
            Arc::clone(&stop),
            readiness.clone(),
            Arc::clone(&picker),
        );
        let (model, block_size) = (args.model.clone(), args.block_size);
        std::thread::Builder::new()
            .name("discovery".into())
            .spawn(move || {
                background_loop(
                    &state, &picker, ingester, &scraper, feed, &model, block_size, &readiness,
                    &stop, &wake,
                )
            })
            .map_err(AppError::Runtime)?
    };
    let metrics_addr = std::net::SocketAddr::new(args.listen_address, args.metrics_port);
    runtime.spawn(async move {
        if let Err(e) =
            crate::metrics::serve(metrics_addr, metrics_sources, std::future::pending()).await
        {
            tracing::error!(addr = %metrics_addr, error = %e, "metrics server failed");
        }
    });
    let served = runtime.block_on(crate::server::serve(
        ServerConfig::from_args(&args),
        handoffs,
        picker,
        readiness,
        cli_support::shutdown_signal(),
    ));
    if let Some(nats) = nats {
        runtime.block_on(nats.shutdown());
    }
    stop.store(true, Ordering::Relaxed);
    let _ = background.join();
    telemetry.shutdown();
    served.map_err(|e| AppError::Serve(e.to_string()))
}

/// How the pool's requests are keyed: the engines' block size and salt style, the model's
/// tokenizer when given, and inputs as large as the bodies the EPP accepts.
fn keyer(args: &Args) -> Result<Keyer, AppError> {
    let salt_style = match args.engine {
        EngineArg::Vllm => SaltStyle::VllmExtraKey,
        EngineArg::Sglang => SaltStyle::Seed,
    };
    let mut keyer = Keyer::new(args.block_size as usize, salt_style, args.model.clone())
        .with_finish(args.finish())
        .with_max_input_bytes(args.max_body_bytes);
    match &args.tokenizer_dir {
        Some(dir) => {
            let tok = tokenize::TextTokenizer::from_dir(dir)
                .map_err(|e| config_error(format!("tokenizer: {e}")))?;
            keyer = keyer.with_model(
                args.model.clone(),
                ModelTokenizer::new(tok, TOKEN_CACHE_BYTES),
            );
        }
        None => tracing::warn!(
            "no --tokenizer-dir: keys are approximate (byte fallback); prefix routing only matches \
             engines using the same fallback"
        ),
    }
    Ok(keyer)
}

/// The response observer's ticket table, when the gateway runs that layout; with NATS, it relays
/// observed responses of requests other replicas routed (the loop's config is returned too).
fn handoff_table(args: &Args, replica: u64) -> (Option<Arc<Handoffs>>, Option<RelayConfig>) {
    if !args.response_observer {
        return (None, None);
    }
    let table = Handoffs::new(HANDOFF_CAPACITY);
    if args.nats().is_none() {
        tracing::info!(
            "response observer without --nats-url: a response observed by another EPP replica \
             is not reported to the replica that routed it"
        );
        return (Some(Arc::new(table)), None);
    }
    let (sink, outbox) = relay_queue(RELAY_QUEUE);
    let relay = Relay::new(replica, Arc::new(sink), HANDOFF_CAPACITY);
    let handoffs = Arc::new(table.with_relay(Arc::new(relay)));
    let config = RelayConfig::new(Arc::clone(&handoffs), outbox);
    (Some(handoffs), Some(config))
}

/// The NATS configuration, when `--nats-url` is set.
fn nats_config(args: &Args, replica: u64) -> Option<NatsConfig> {
    let url = args.nats()?;
    let sync = kv_sync::SyncConfig {
        snapshot_timeout: kv_index::Millis(args.snapshot_timeout_ms),
        ..Default::default()
    };
    Some(NatsConfig {
        url: url.to_owned(),
        namespace: args.pool_namespace.clone(),
        pool: args.pool_name.clone(),
        sync,
        limits: kv_events::envelope::EnvelopeLimits::default(),
        sharing: args.inflight_sharing.then(|| SharingConfig::new(replica)),
    })
}

/// Where endpoints come from.
enum Feed {
    /// The endpoints file, polled.
    File(FileWatch),
    /// Kubernetes watchers on their own thread.
    Kube(Box<KubeDiscovery>),
}

fn start_feed(
    args: &Args,
    runtime: &tokio::runtime::Handle,
    wake: Arc<Wake>,
) -> Result<Feed, AppError> {
    Ok(match args.discovery {
        Discovery::File => Feed::File(FileWatch::new(
            args.endpoints_file.clone().unwrap_or_default(),
        )),
        Discovery::Kubernetes => {
            let group = match args.pool_group {
                PoolGroupArg::Auto => PoolGroup::Auto,
                PoolGroupArg::V1 => PoolGroup::V1,
                PoolGroupArg::V1Alpha2 => PoolGroup::V1Alpha2,
            };
            let config = WatchConfig {
                group,
                max_backoff: Duration::from_millis(args.kube_max_backoff_ms),
                relist_every: (args.kube_relist_seconds > 0)
                    .then(|| Duration::from_secs(args.kube_relist_seconds)),
                ..WatchConfig::new(args.pool_name.clone(), args.pool_namespace.clone())
            };
            Feed::Kube(Box::new(
                KubeDiscovery::start(config, runtime, wake)
                    .map_err(|e| config_error(e.to_string()))?,
            ))
        }
    })
}

/// Discovery, ingestion and expiry, on one thread: each tick, or at once when Kubernetes
/// discovery publishes a change.
#[allow(clippy::too_many_arguments)]
fn background_loop(
    state: &State,
    picker: &Picker,
    mut ingester: Ingester,
    scraper: &crate::load::Scraper,
    mut feed: Feed,
    model: &str,
    block_size: u32,
    readiness: &Readiness,
    stop: &AtomicBool,
    wake: &Wake,
) {
    let mut warned = false;
    let mut install = |parsed: Vec<Parsed>| {
        let sources = direct_sources(state, &parsed, model, block_size);
        let targets = Targets {
            datastore: &state.datastore,
            index: &state.index,
            inflight: &state.inflight,
            loads: &state.loads,
            scheduler: &state.scheduler_for_upkeep,
            nodes: &state.nodes,
        };
        let (count, removed) = apply(&targets, parsed);
        ingester.sync(sources);
        scraper.sync(
            state
                .datastore
                .snapshot()
                .iter()
                .map(|e| (e.id, e.address))
                .collect(),
        );
        (count, removed, ingester.len())
    };
    while !stop.load(Ordering::Relaxed) {
        match &mut feed {
            Feed::File(watch) => match watch.poll() {
                Ok(Some(text)) => match parse(watch.path(), &text) {
                    Ok(parsed) => {
                        let (count, removed, subscriptions) = install(parsed);
                        tracing::info!(
                            endpoints = count,
                            removed,
                            subscriptions,
                            "endpoints loaded from {}",
                            watch.path().display()
                        );
                        readiness.set(count > 0);
                        warned = false;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "endpoints file refused; keeping the previous endpoints")
                    }
                },
                Ok(None) => {}
                Err(e) if !warned => {
                    tracing::error!(error = %e, "endpoints file unreadable; keeping the previous endpoints");
                    warned = true;
                }
                Err(_) => {}
            },
            Feed::Kube(kube) => {
                if let Some(snapshot) = kube.changed() {
                    let ready_endpoints = snapshot.endpoints.iter().filter(|e| e.ready).count();
                    let (count, removed, subscriptions) = install(snapshot.endpoints);
                    tracing::info!(
                        endpoints = count,
                        ready_endpoints,
                        removed,
                        subscriptions,
                        synced = snapshot.ready,
                        objectives = kube.objectives().len(),
                        "endpoints updated from Kubernetes"
                    );
                    readiness.set(snapshot.ready);
                }
            }
        }
        state
            .scheduler_for_upkeep
            .expire(&state.index, picker.now());
        wake.wait(TICK);
    }
}

fn direct_sources(
    state: &State,
    parsed: &[Parsed],
    model: &str,
    block_size: u32,
) -> Vec<DirectSource> {
    parsed
        .iter()
        .filter_map(|p| {
            let publisher = p.events.clone()?;
            Some(DirectSource {
                endpoint: state.datastore.id_for(&p.key),
                model: p
                    .models
                    .iter()
                    .next()
                    .cloned()
                    .unwrap_or_else(|| model.to_owned()),
                block_size,
                publisher,
                replay: p.replay.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser as _;

    use super::*;
    use crate::routing::request::{Api, parse};

    fn chat_of(bytes: usize) -> Vec<u8> {
        serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": "word ".repeat(bytes / 5)}],
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn every_chat_the_body_limit_lets_in_is_keyed_and_larger_ones_are_too_large() {
        let args = Args::try_parse_from(["kvgate-epp", "--pool-name", "p"]).unwrap();
        let keyer = keyer(&args).unwrap();
        let body = chat_of(args.max_body_bytes - 1024);
        assert!(body.len() <= args.max_body_bytes && body.len() > 9 << 20);
        let keyed = keyer.key(&parse(Api::Chat, &body).unwrap()).unwrap();
        assert!(keyed.prompt_tokens > 1 << 20);

        let args = Args::try_parse_from([
            "kvgate-epp",
            "--pool-name",
            "p",
            "--max-body-bytes",
            "65536",
        ])
        .unwrap();
        let err = keyer_err(&args, &chat_of(100_000));
        assert!(
            matches!(err, tokenize::TokenizeError::InputTooLarge { .. }),
            "{err}"
        );
    }

    fn keyer_err(args: &Args, body: &[u8]) -> tokenize::TokenizeError {
        keyer(args)
            .unwrap()
            .key(&parse(Api::Chat, body).unwrap())
            .unwrap_err()
    }
}
