//! `kvgate-bench replay`: a workload against N engine models in virtual time, once per (policy,
//! load), routed by the EPP's own code (`kvgate-replay`); records as JSON lines, a summary table
//! on stdout.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write as _};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use engine_model::{EngineConfig, EngineStats, Preset};
use replay::{CacheAwareConfig, MS, ReplayConfig, ReplayOutput, ReplayPolicy, replay};
use scheduler::SchedulerConfig;
use workload::{
    DoksOptions, MooncakeOptions, RequestRecord, SharedPrefixOptions, Slo, Window, Workload,
};

/// Which workload to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Seed 001's multi-turn conversations, closed loop at each `--concurrency`.
    Doks,
    /// The Mooncake conversation trace, open loop at each `--speedup`.
    Mooncake,
    /// llm-d-style shared prefixes, Poisson arrivals at each `--qps`.
    SharedPrefix,
}

/// `kvgate-bench replay` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// The workload.
    #[arg(long, value_enum)]
    pub workload: WorkloadKind,
    /// Engines.
    #[arg(long, default_value_t = 3)]
    pub engines: usize,
    /// Engine preset (`h200-llama70b-fp8`, `h100x4-llama70b-tp4`, `small`).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    pub preset: Preset,
    /// Host (CPU) memory per engine for KV offloading, GiB (vLLM's `--kv-offloading-size`,
    /// Dynamo KVBM's G2): every block the GPU caches is copied there (least recently used
    /// dropped), and a prompt's blocks found there load back at PCIe speed instead of being
    /// recomputed; the engines publish them as host-tier blocks, which the `kv` policy credits
    /// at its `host` weight. 0: no offloading (the presets' default). Every policy of the run
    /// gets the same engines.
    #[arg(long, default_value_t = 0.0)]
    pub kv_offloading_gib: f64,
    /// Host memory of the node's KV block manager (`kvgate-kvbm`), GiB: all the engines are
    /// on one node whose daemon takes every block they cache and serves the blocks after a
    /// prompt's GPU hit to any of them, its tiers credited to every engine (as `kvgate-bench
    /// up --kvbm` runs it live). 0 with `--kvbm-disk-gib` 0: no block manager.
    #[arg(long, default_value_t = 0.0)]
    pub kvbm_host_gib: f64,
    /// The block manager's disk tier, GiB (host-memory evictions are demoted there; loads
    /// from it run at the engine's `disk_load_bandwidth`).
    #[arg(long, default_value_t = 0.0)]
    pub kvbm_disk_gib: f64,
    /// A what-if for the engines' connector to the block manager: hits with disk blocks load
    /// while the request waits and other steps run (as vLLM's `OffloadingConnector` loads),
    /// host-memory hits in the step. Without it, every hit loads in the step that schedules
    /// the request, as kvgate's vLLM connector does.
    #[arg(long)]
    pub kvbm_async_disk_loads: bool,
    /// GPU KV cache per engine, in blocks (default: the preset's).
    #[arg(long)]
    pub num_gpu_blocks: Option<u32>,
    /// Context length (default: the preset's; at most the GPU cache).
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Analysis only, not a real engine: prefill costs the engines no compute and no KV reads,
    /// as if every prompt were cached wherever it lands. Run a policy with it against a normal
    /// run of another (two invocations) to bound what any router could gain over the other
    /// by avoiding prefill. Applies to every policy of the run; the notes say so.
    #[arg(long)]
    pub free_prefill: bool,
    /// Policies, one run each (comma-separated): the EPP's (`kv`, `round-robin`, `random`,
    /// `least-load`, `prefix-only`), or `sglang-cache-aware`, a model of the cache-aware
    /// policy of SGLang's router, smg and vLLM's router (approximate tree from routing
    /// decisions, balance thresholds; see the replay crate's `peer` module).
    #[arg(long, value_delimiter = ',', default_value = "kv,round-robin")]
    pub policy: Vec<ReplayPolicy>,
    /// Scheduler YAML (the EPP's `--scheduler-config`); `--policy` overrides its `policy`.
    #[arg(long)]
    pub scheduler_config: Option<PathBuf>,
    /// `doks`: conversations in flight, one run each.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "60,80,100,120,140,160,180"
    )]
    pub concurrency: Vec<u32>,
    /// `mooncake`: replay speed-ups, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub speedup: Vec<f64>,
    /// `shared-prefix`: mean request rates, one run each.
    #[arg(long, value_delimiter = ',', default_value = "10")]
    pub qps: Vec<f64>,
    /// `mooncake`: the trace file.
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_conversation_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// `mooncake`: keep only the first this many seconds of the trace (trace time).
    #[arg(long)]
    pub trace_seconds: Option<u64>,
    /// Closed loop: the measured window starts after this warm-up (virtual seconds).
    #[arg(long, default_value_t = 60)]
    pub warmup_s: u64,
    /// Closed loop: the measured window's length; no request is sent after warm-up + this.
    #[arg(long, default_value_t = 300)]
    pub duration_s: u64,
    /// From the client's send to the engine (gateway, frontend, network), ms.
    #[arg(long, default_value_t = 0)]
    pub request_latency_ms: u64,
    /// `doks`: think time before each follow-up turn (the seed's user is a small model writing
    /// the next question), ms.
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// From an engine step's end to its KV events reaching the index, ms.
    #[arg(long, default_value_t = 5)]
    pub event_delay_ms: u64,
    /// Engine load samples' interval, ms (0: none; the EPP's own accounting only).
    #[arg(long, default_value_t = 200)]
    pub load_interval_ms: u64,
    /// Seeds the workload generators and the scheduler.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write the records (JSON lines).
    #[arg(long, default_value = "replay-records.jsonl")]
    pub out: PathBuf,
}

/// Why a replay command failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayCmdError {
    /// Inconsistent options.
    #[error("{0}")]
    Options(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The trace could not be read.
    #[error("trace: {0}")]
    Trace(#[from] workload::MooncakeError),
    /// The shared-prefix options are invalid.
    #[error("shared-prefix: {0}")]
    SharedPrefix(#[from] workload::SharedPrefixError),
    /// The scheduler YAML is invalid.
    #[error("scheduler config: {0}")]
    Scheduler(#[from] scheduler::ConfigError),
    /// The replay could not start.
    #[error("replay: {0}")]
    Replay(#[from] replay::ReplayError),
}

fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ReplayCmdError + '_ {
    move |source| ReplayCmdError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One (policy, load) run's workload, label and measured window.
struct Plan {
    workload: Workload,
    load: f64,
    stop_at: Option<u64>,
    window: Option<Window>,
}

fn plans(args: &ReplayArgs) -> Result<Vec<Plan>, ReplayCmdError> {
    match args.workload {
        WorkloadKind::Doks => {
            let stop_s = args.warmup_s + args.duration_s;
            args.concurrency
                .iter()
                .map(|&c| {
                    if c == 0 {
                        return Err(ReplayCmdError::Options("--concurrency must be ≥ 1".into()));
                    }
                    // A conversation lasts ≥ 3 turns of ≥ 10 s; twice what the window can use.
                    let sessions = (c as usize) * (2 + stop_s as usize / 15);
                    let workload = workload::doks(&DoksOptions {
                        sessions,
                        concurrency: c,
                        seed: args.seed,
                        think: Duration::from_millis(args.think_ms),
                        ..DoksOptions::default()
                    });
                    Ok(Plan {
                        workload,
                        load: f64::from(c),
                        stop_at: Some(stop_s * 1_000 * MS),
                        window: Some(Window {
                            from_ms: args.warmup_s as f64 * 1e3,
                            to_ms: stop_s as f64 * 1e3,
                        }),
                    })
                })
                .collect()
        }
        WorkloadKind::Mooncake => args
            .speedup
            .iter()
            .map(|&speedup| {
                let file = File::open(&args.trace).map_err(io(&args.trace))?;
                let workload = workload::read_mooncake(
                    BufReader::new(file),
                    &MooncakeOptions {
                        speedup,
                        window: args
                            .trace_seconds
                            .map(|s| Duration::ZERO..Duration::from_secs(s)),
                        ..MooncakeOptions::default()
                    },
                )?;
                Ok(Plan {
                    workload,
                    load: speedup,
                    stop_at: None,
                    window: None,
                })
            })
            .collect(),
        WorkloadKind::SharedPrefix => args
            .qps
            .iter()
            .map(|&qps| {
                Ok(Plan {
                    workload: workload::shared_prefix(&SharedPrefixOptions {
                        qps,
                        seed: args.seed,
                        ..SharedPrefixOptions::default()
                    })?,
                    load: qps,
                    stop_at: None,
                    window: None,
                })
            })
            .collect(),
    }
}

/// The engines' own prefix-cache hit rate (vLLM's `prefix_cache_hits / queries`).
fn engine_hit_rate(engines: &[EngineStats]) -> f64 {
    let (h, q) = engines.iter().fold((0u64, 0u64), |(h, q), e| {
        (h + e.prefix_cache_hits, q + e.prefix_cache_queries)
    });
    if q == 0 { 0.0 } else { h as f64 / q as f64 }
}

/// Runs every (policy, load) replay, writes the records and prints the table.
pub fn run(args: &ReplayArgs) -> Result<(), ReplayCmdError> {
    if args.engines == 0 {
        return Err(ReplayCmdError::Options(
            "--engines must be at least 1".into(),
        ));
    }
    let base = match &args.scheduler_config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(io(path))?;
            SchedulerConfig::from_yaml(&text)?
        }
        None => SchedulerConfig::default(),
    };
    let plans = plans(args)?;
    // Every option is checked before the records file is created (or truncated): a bad
    // flag must not cost the records of an earlier run.
    let engine = engine_config(args)?;
    let node = node_tier(args, &engine)?;
    let out_file = File::create(&args.out).map_err(io(&args.out))?;
    let mut out = BufWriter::new(out_file);
    let mut summaries = Vec::new();
    let mut notes = Vec::new();
    for plan in &plans {
        for &policy in &args.policy {
            let mut config = ReplayConfig::new(args.engines, engine.clone());
            config.run = policy.to_string();
            config.load = Some(plan.load);
            match policy {
                ReplayPolicy::Epp(policy) => {
                    config.scheduler = SchedulerConfig {
                        policy,
                        ..base.clone()
                    };
                }
                ReplayPolicy::CacheAware => config.cache_aware = Some(CacheAwareConfig::default()),
            }
            config.seed = args.seed;
            config.request_latency = args.request_latency_ms * MS;
            config.event_delay = args.event_delay_ms * MS;
            config.load_interval = args.load_interval_ms * MS;
            config.stop_at = plan.stop_at;
            config.node_tier = node;
            let started = Instant::now();
            let result = replay(&plan.workload, config)?;
            let wall = started.elapsed();
            write_records(&mut out, &result.records).map_err(io(&args.out))?;
            let window = plan
                .window
                .unwrap_or_else(|| Window::covering(&result.records));
            summaries.push(workload::summarize(&result.records, window, Slo::default()));
            let mut line = note(policy, plan.load, &result, wall);
            if args.free_prefill {
                line.push_str(
                    ", FREE PREFILL (--free-prefill: an analysis bound, not a real engine)",
                );
            }
            notes.push(line);
        }
    }
    out.flush().map_err(io(&args.out))?;
    let mut stdout = std::io::stdout().lock();
    let table = workload::render_table(&summaries);
    let text = format!(
        "{table}\n{}\nrecords: {}\n",
        notes.join("\n"),
        args.out.display()
    );
    stdout
        .write_all(text.as_bytes())
        .map_err(io(std::path::Path::new("stdout")))?;
    Ok(())
}

/// The block manager `--kvbm-host-gib` and `--kvbm-disk-gib` give, in the engines' blocks.
fn node_tier(
    args: &ReplayArgs,
    engine: &EngineConfig,
) -> Result<Option<replay::NodeTierConfig>, ReplayCmdError> {
    let blocks = |flag: &str, gib: f64| {
        engine
            .blocks_in_gib(gib)
            .map(|b| b as usize)
            .map_err(|e| ReplayCmdError::Options(format!("{flag}: {e}")))
    };
    let host_blocks = blocks("--kvbm-host-gib", args.kvbm_host_gib)?;
    let disk_blocks = blocks("--kvbm-disk-gib", args.kvbm_disk_gib)?;
    if args.kvbm_async_disk_loads && disk_blocks == 0 {
        return Err(ReplayCmdError::Options(
            "--kvbm-async-disk-loads needs the block manager's disk tier (--kvbm-disk-gib)".into(),
        ));
    }
    if host_blocks + disk_blocks == 0 {
        return Ok(None);
    }
    if args.kv_offloading_gib > 0.0 {
        return Err(ReplayCmdError::Options(
            "--kv-offloading-gib and --kvbm-*-gib are two offloading connectors: give one".into(),
        ));
    }
    Ok(Some(replay::NodeTierConfig {
        host_blocks,
        disk_blocks,
        async_disk_loads: args.kvbm_async_disk_loads,
    }))
}

/// The preset's engine configuration with `--kv-offloading-gib` turned into host blocks and
/// the cache and context overrides applied.
fn engine_config(args: &ReplayArgs) -> Result<EngineConfig, ReplayCmdError> {
    let mut c = args.preset.config();
    if let Some(n) = args.num_gpu_blocks {
        c.num_gpu_blocks = n;
    }
    if let Some(n) = args.max_model_len {
        c.max_model_len = n;
    }
    c.set_offloading_gib(args.kv_offloading_gib)
        .map_err(|e| ReplayCmdError::Options(format!("--kv-offloading-gib: {e}")))?;
    c.free_prefill = args.free_prefill;
    Ok(c)
}

fn write_records(out: &mut impl std::io::Write, records: &[RequestRecord]) -> std::io::Result<()> {
    for r in records {
        serde_json::to_writer(&mut *out, r)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}

fn note(policy: ReplayPolicy, load: f64, r: &ReplayOutput, wall: Duration) -> String {
    let preemptions: u64 = r.engines.iter().map(|e| e.num_preemptions).sum();
    let reasons: Vec<String> = r
        .router
        .reasons
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let host_hits: u64 = r.engines.iter().map(|e| e.host_hit_tokens).sum();
    let queried: u64 = r.engines.iter().map(|e| e.prefix_cache_queries).sum();
    format!(
        "{policy} @ {load}: engine prefix hit {:.1}% (+{:.1}% loaded from host), {} requests, \
         {} steps, {} events, virtual {:.0} s, wall {:.2} s, preemptions {preemptions}, \
         normalise errors {}, reasons [{}]",
        100.0 * engine_hit_rate(&r.engines),
        100.0 * host_hits as f64 / queried.max(1) as f64,
        r.records.len(),
        r.steps,
        r.events,
        r.end as f64 / 1e9,
        wall.as_secs_f64(),
        r.router.normalize_errors,
        reasons.join(" "),
    ) + &r.node.map_or_else(String::new, |n| {
        format!(
            ", kvbm: {} blocks offloaded, onboarded {} from host and {} from disk, \
             {} in host memory and {} on disk at the end",
            n.offloaded, n.onboarded_host, n.onboarded_disk, n.host_blocks, n.disk_blocks
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;
    use clap::Parser as _;
    use scheduler::Policy;

    fn args(extra: &[&str]) -> ReplayArgs {
        let mut argv = vec!["kvgate-bench", "replay"];
        argv.extend_from_slice(extra);
        match crate::bench::Args::parse_from(argv).command {
            crate::bench::Command::Replay(a) => *a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn doks_plans_follow_the_levels_think_time_and_window() {
        let a = args(&[
            "--workload",
            "doks",
            "--concurrency",
            "2,3",
            "--think-ms",
            "1500",
            "--warmup-s",
            "10",
            "--duration-s",
            "20",
            "--policy",
            "kv,round-robin",
        ]);
        assert_eq!(
            a.policy,
            vec![
                ReplayPolicy::Epp(Policy::Kv),
                ReplayPolicy::Epp(Policy::RoundRobin)
            ]
        );
        let p = plans(&a).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].load, 3.0);
        assert_eq!(p[0].stop_at, Some(30 * 1_000 * MS));
        let w = p[0].window.unwrap();
        assert_eq!((w.from_ms, w.to_ms), (10_000.0, 30_000.0));
        for s in &p[0].workload.sessions {
            assert_eq!(s.turns[0].think, Duration::ZERO);
            assert!(
                s.turns[1..]
                    .iter()
                    .all(|t| t.think == Duration::from_millis(1500))
            );
        }
        let zero = args(&["--workload", "doks", "--concurrency", "0"]);
        assert!(matches!(plans(&zero), Err(ReplayCmdError::Options(_))));
    }

    #[test]
    fn offloading_gib_and_free_prefill_set_the_engine_config() {
        let off = engine_config(&args(&["--workload", "mooncake", "--preset", "small"])).unwrap();
        assert_eq!(off.num_host_blocks, 0);
        let on = engine_config(&args(&[
            "--workload",
            "mooncake",
            "--preset",
            "small",
            "--kv-offloading-gib",
            "64",
        ]))
        .unwrap();
        assert!(!off.free_prefill && !on.free_prefill);
        let free = engine_config(&args(&["--workload", "doks", "--free-prefill"])).unwrap();
        assert!(free.free_prefill);
        let block = on.kv_bytes_per_token * u64::from(on.block_size);
        assert_eq!(u64::from(on.num_host_blocks), (64u64 << 30) / block);
        on.validate().unwrap();
        for bad in [
            "--kv-offloading-gib=-1",
            "--kv-offloading-gib=NaN",
            "--kv-offloading-gib=1e30",
        ] {
            let a = args(&["--workload", "mooncake", bad]);
            assert!(
                matches!(engine_config(&a), Err(ReplayCmdError::Options(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_block_manager_flags_size_one_node_store_in_the_engines_blocks() {
        let a = args(&[
            "--workload",
            "mooncake",
            "--preset",
            "small",
            "--kvbm-host-gib",
            "1",
            "--kvbm-disk-gib",
            "2",
            "--num-gpu-blocks",
            "4096",
            "--max-model-len",
            "32768",
        ]);
        let engine = engine_config(&a).unwrap();
        assert_eq!((engine.num_gpu_blocks, engine.max_model_len), (4096, 32768));
        // The small preset's blocks are 2 MiB.
        let node = node_tier(&a, &engine).unwrap().unwrap();
        assert_eq!((node.host_blocks, node.disk_blocks), (512, 1024));
        assert!(!node.async_disk_loads);
        let mut what_if = a.clone();
        what_if.kvbm_async_disk_loads = true;
        assert!(
            node_tier(&what_if, &engine)
                .unwrap()
                .unwrap()
                .async_disk_loads
        );
        let none = args(&["--workload", "mooncake"]);
        assert_eq!(
            node_tier(&none, &engine_config(&none).unwrap()).unwrap(),
            None
        );
        for bad in [
            vec!["--kvbm-host-gib=-1"],
            vec!["--kvbm-disk-gib=NaN"],
            vec!["--kvbm-host-gib=1", "--kv-offloading-gib=1"],
            vec!["--kvbm-host-gib=1", "--kvbm-async-disk-loads"],
        ] {
            let mut v = vec!["--workload", "mooncake"];
            v.extend(bad.iter().copied());
            let a = args(&v);
            assert!(
                matches!(
                    node_tier(&a, &engine_config(&a).unwrap()),
                    Err(ReplayCmdError::Options(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_tiny_shared_prefix_run_writes_one_record_per_request() {
        let dir = std::env::temp_dir().join(format!("kvgate-replay-cmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("records.jsonl");
        let mut a = args(&[
            "--workload",
            "shared-prefix",
            "--preset",
            "small",
            "--engines",
            "2",
            "--qps",
            "50",
            "--policy",
            "kv,round-robin,sglang-cache-aware",
        ]);
        assert_eq!(a.policy[2], ReplayPolicy::CacheAware);
        a.out = out.clone();
        run(&a).unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        let records: Vec<RequestRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let per_run = SharedPrefixOptions::default().groups
            * SharedPrefixOptions::default().users_per_group
            * SharedPrefixOptions::default().questions_per_user;
        assert_eq!(records.len(), 3 * per_run as usize);
        assert_eq!(
            records
                .iter()
                .filter(|r| r.run == "sglang-cache-aware")
                .count(),
            per_run as usize
        );
        assert!(records.iter().all(|r| r.load == Some(50.0)));
        // A bad flag is refused before the records file is touched.
        let mut bad = a.clone();
        bad.kvbm_host_gib = 1.0;
        bad.kvbm_async_disk_loads = true;
        assert!(matches!(run(&bad), Err(ReplayCmdError::Options(_))));
        assert_eq!(std::fs::read_to_string(&out).unwrap(), text);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_engine_hit_rate_is_hits_over_queries() {
        let e = |h, q| EngineStats {
            prefix_cache_hits: h,
            prefix_cache_queries: q,
            ..EngineStats::default()
        };
        assert_eq!(engine_hit_rate(&[e(1, 4), e(3, 4)]), 0.5);
        assert_eq!(engine_hit_rate(&[]), 0.0);
    }
}
