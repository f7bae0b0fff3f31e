//! `kvgate-sim`: a vLLM-compatible engine simulator.
//!
//! The HTTP front end ([`api`]) speaks OpenAI's completions and chat APIs as vLLM does, with
//! vLLM's metrics; the engine model (crate `kvgate-engine-model`) decides batching, caching and
//! step times in model time, which [`driver`] maps to wall time through a time scale; cache
//! events leave through [`publisher`] as vLLM's ZMQ KV events, hashed with vLLM's own
//! `sha256_cbor` ([`vllm_hash`]) and encoded byte for byte as vLLM does ([`events`]). Besides
//! vLLM's NIXL P/D parameters it plays SGLang's bootstrap-based P/D roles ([`bootstrap`]).

pub mod api;
pub mod args;
pub mod bootstrap;
pub mod clock;
pub mod driver;
pub mod events;
pub mod kv_config;
pub mod kvbm;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod publisher;
pub mod vllm_hash;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use args::Args;
use axum::http::{HeaderValue, StatusCode};
use kv_events::engine::WireFormat;
use kv_events::frame::ReplayLayout;

use self::api::{App, Faults};
use self::args::{EventFormat, QueueFullStatus, ReplayLayoutArg};
use self::clock::Clock;
use self::driver::Driver;
use self::events::BatchEncoder;
use self::kv_config::KvEventsConfig;
use self::output::{OutputVocab, SplitMix};
use self::publisher::{Publisher, PublisherConfig};

/// Why the simulator stopped.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Bad configuration.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The tokenizer directory could not be loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The KV-event publisher could not start.
    #[error(transparent)]
    Publisher(#[from] publisher::PublisherError),
    /// Runtime or socket failure.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

impl cli_support::ExitStatus for SimError {
    fn exit_code(&self) -> u8 {
        match self {
            SimError::Start(_) | SimError::Tokenizer(_) => cli_support::EXIT_CONFIG,
            SimError::Publisher(_) | SimError::Io { .. } => 1,
        }
    }
}

fn config_error(msg: impl Into<String>) -> SimError {
    SimError::Start(cli_support::StartError::Config(msg.into()))
}

/// Runs the simulator until SIGINT/SIGTERM.
pub fn run(args: Args) -> Result<(), SimError> {
    args.validate().map_err(config_error)?;
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|source| SimError::Io {
            context: "starting the runtime".into(),
            source,
        })?;
    runtime.block_on(serve(args))
}

fn init_tracing() {
    cli_support::init_tracing();
}

async fn serve(args: Args) -> Result<(), SimError> {
    let config = args.engine_config().map_err(config_error)?;
    let (engine, kvbm) = match &args.kvbm_socket {
        Some(socket) => {
            let layout = args.kvbm_layout(&config);
            tracing::info!(
                socket = %socket.display(),
                model = %layout.model,
                block_bytes = layout.block_bytes,
                "offloading KV blocks to kvgate-kvbm"
            );
            let (tier, handle) = kvbm::KvbmTier::start(kvbm::KvbmConfig {
                socket: socket.clone(),
                layout,
            });
            let engine = engine_model::Engine::with_offload(config.clone(), Box::new(tier));
            (engine, Some(handle))
        }
        None => (engine_model::Engine::new(config.clone()), None),
    };
    let engine = engine.map_err(|e| config_error(format!("engine: {e}")))?;
    let tokenizer = match &args.tokenizer {
        Some(dir) => tokenize::TextTokenizer::from_dir(dir)
            .map_err(|e| SimError::Tokenizer(e.to_string()))?,
        None => {
            tracing::warn!("no --tokenizer: using the byte fallback tokenizer (4 bytes per token)");
            tokenize::TextTokenizer::fallback()
        }
    };
    let vocab = OutputVocab::new(tokenizer.word_token_ids(), |id| {
        tokenizer.decode(&[id]).ok()
    });
    let served = args.served_names();
    let default_model = served.first().cloned().unwrap_or_default();
    if args.startup_delay_ms > 0 {
        tracing::info!(
            ms = args.startup_delay_ms,
            "slow start: waiting before listening"
        );
        tokio::time::sleep(Duration::from_millis(args.startup_delay_ms)).await;
    }
    let kv = args.kv_events_config.clone().unwrap_or_default();
    let publisher = if kv.publishes() {
        let endpoint = KvEventsConfig::endpoint_for_rank(&kv.endpoint, args.data_parallel_rank)
            .map_err(config_error)?;
        let replay_endpoint = kv
            .replay_endpoint
            .as_deref()
            .map(|e| KvEventsConfig::endpoint_for_rank(e, args.data_parallel_rank))
            .transpose()
            .map_err(config_error)?;
        let topic = kv
            .topic
            .clone()
            .unwrap_or_else(|| format!("kv@{}:{}@{}", args.advertise_ip, args.port, default_model));
        tracing::info!(%endpoint, replay = ?replay_endpoint, %topic, "publishing KV events");
        Some(Publisher::start(PublisherConfig {
            endpoint,
            replay_endpoint,
            wildcard_address: args.listen_address,
            topic,
            buffer_steps: kv.buffer_steps,
            hwm: kv.hwm,
            max_queue_size: kv.max_queue_size,
            replay_layout: match args.kv_events_replay_layout {
                ReplayLayoutArg::WithTopic => ReplayLayout::WithTopic,
                ReplayLayoutArg::Legacy => ReplayLayout::Legacy,
            },
        })?)
    } else {
        None
    };
    let publisher_stats = publisher.as_ref().map(Publisher::stats);
    let encoder = BatchEncoder {
        block_size: config.block_size,
        dp_rank: i64::from(args.data_parallel_rank),
        format: match args.kv_events_format {
            EventFormat::Map => WireFormat::VllmMap,
            EventFormat::Array => WireFormat::VllmArray,
        },
    };
    let driver = Driver::spawn(
        engine,
        Clock::new(args.time_scale),
        publisher,
        encoder,
        args.max_waiting,
        kvbm.clone(),
    );
    let pod = args
        .pod_name
        .clone()
        .unwrap_or_else(|| format!("kvgate-sim-{}", args.port));
    let bootstrap = Arc::new(bootstrap::Bootstrap::new(
        args.disaggregation_mode,
        Duration::from_millis(args.disaggregation_bootstrap_timeout_ms),
    ));
    if args.disaggregation_mode == bootstrap::DisaggMode::Prefill {
        let addr = std::net::SocketAddr::new(args.host, args.disaggregation_bootstrap_port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| SimError::Io {
                context: format!("binding the bootstrap port {addr}"),
                source,
            })?;
        tracing::info!(%addr, "serving SGLang bootstrap rooms");
        let rooms = bootstrap::router(bootstrap.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, rooms).await {
                tracing::error!(error = %e, "bootstrap listener failed");
            }
        });
    }
    let app = Arc::new(App {
        driver: driver.clone(),
        tokenizer,
        vocab,
        served,
        root: args.model.clone(),
        none_hash: kv_events::engine_hash::vllm_none_hash(args.python_hash_seed.as_deref()),
        metrics: metrics::SimMetrics::new(
            &default_model,
            config.block_size,
            config.num_gpu_blocks,
            config.enable_prefix_caching,
        ),
        publisher: publisher_stats,
        kvbm: kvbm.map(|h| h.stats),
        pod: HeaderValue::from_str(&pod)
            .map_err(|_| config_error("--pod-name is not a valid header value"))?,
        dp_rank: HeaderValue::from(args.data_parallel_rank),
        advertise: (args.advertise_ip.to_string(), args.port),
        max_model_len: config.max_model_len,
        block_size: config.block_size,
        mean_output_tokens: args.mean_output_tokens,
        max_body_bytes: args.max_body_bytes,
        queue_full: match args.queue_full_status {
            QueueFullStatus::TooMany => StatusCode::TOO_MANY_REQUESTS,
            QueueFullStatus::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        },
        faults: Faults {
            error_rate: args.fault_error_rate,
            status: StatusCode::from_u16(args.fault_status)
                .map_err(|_| config_error("--fault-status is not an HTTP status"))?,
            stall_rate: args.fault_stall_rate,
            stall: Duration::from_millis(args.fault_stall_ms),
            crash_endpoint: args.enable_crash_endpoint,
        },
        ready_at: Instant::now() + Duration::from_millis(args.ready_delay_ms),
        next_id: Default::default(),
        rng: Mutex::new(SplitMix::new(args.seed)),
        bootstrap: bootstrap.clone(),
    });
    let addr = std::net::SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| SimError::Io {
            context: format!("binding {addr}"),
            source,
        })?;
    tracing::info!(
        %addr, model = %default_model, preset = %args.preset, block_size = config.block_size,
        num_gpu_blocks = config.num_gpu_blocks, time_scale = args.time_scale,
        "kvgate-sim listening"
    );
    // TCP_NODELAY, as vLLM's server (asyncio sets it on every TCP connection): without it the
    // first SSE chunk after the response head waits for the peer's delayed ACK (~40 ms on
    // Linux), which showed up as a second TTFT mode in live-vs-replay comparisons.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, api::router(app))
        .with_graceful_shutdown(cli_support::shutdown_signal())
        .await
        .map_err(|source| SimError::Io {
            context: "serving HTTP".into(),
            source,
        })?;
    driver.stop();
    tracing::info!("kvgate-sim stopped");
    Ok(())
}
