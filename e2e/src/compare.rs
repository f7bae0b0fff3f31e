//! `kvgate-bench compare`: one workload, several EPP policies and load levels, the same engines.
//!
//! Starts the local stack once ([`crate::stack`]), then for every policy restarts only the EPP
//! with it ([`Stack::set_policy`]) and, for every load level, clears the engines' prefix caches
//! (so no run inherits another's cache), drives the workload through Envoy with the load
//! generator ([`crate::load`]) and reads the engines' own prefix-cache counters before and after.
//! Each run's records go to `<out>/<policy>-<load>.jsonl`; at the end the report
//! ([`crate::load::report`]) writes the side-by-side table, `summary.json` and the plots into
//! `<out>`, and `engines.tsv` holds the engines' hit rates per run.
//!
//! The load level means what the workload is paced by: the concurrency for `doks` (and any
//! workload run closed loop), the QPS for `shared-prefix`, the speed-up for `mooncake`.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser as _;
use scheduler::Policy;

use crate::load::{LoadArgs, LoadError, ReportArgs, WorkloadKind};
use crate::stack::probe::{http_request, metric_sum};
use crate::stack::{Router, Stack, StackError, UpArgs};

/// Options of `kvgate-bench compare`.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// The stack (its `--policy` is replaced by each of `--policies` in turn).
    #[command(flatten)]
    pub stack: UpArgs,
    /// Policies to compare, in order.
    #[arg(long, value_delimiter = ',', default_value = "kv,round-robin")]
    pub policies: Vec<Policy>,
    /// Peer routers to run after the policies, on the same engines and sidecars, each with
    /// `--router-policy` (default `cache_aware`): `vllm-router`, `smg` (found as for
    /// `kvgate-bench up --router`). Their records are labelled with the router's name.
    #[arg(long, value_delimiter = ',')]
    pub routers: Vec<Router>,
    /// Load levels, in order: concurrency (doks, or with `--concurrency`), QPS
    /// (shared-prefix) or speed-up (mooncake).
    #[arg(long, value_delimiter = ',', required = true)]
    pub loads: Vec<f64>,
    /// Where records, tables and plots go (default: `<run dir>/compare`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Keep the engines' prefix caches between runs (default: cleared before each run).
    #[arg(long)]
    pub keep_caches: bool,
    /// TrueType font for the plots.
    #[arg(long, default_value = crate::load::plot::DEFAULT_FONT)]
    pub font: PathBuf,
    /// `kvgate-bench load` options after `--` (workload, duration, warm-up, …); `--url`,
    /// `--run`, `--load` and `--out` are set per run.
    #[arg(last = true, allow_hyphen_values = true)]
    pub load_args: Vec<String>,
}

/// Why `compare` failed.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// Bad options.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The stack.
    #[error(transparent)]
    Stack(#[from] StackError),
    /// A run or the report.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A file.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

impl cli_support::ExitStatus for CompareError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Config(_) => cli_support::EXIT_CONFIG,
            Self::Stack(e) => e.exit_code(),
            Self::Load(e) => e.exit_code(),
            Self::Io { .. } => 1,
        }
    }
}

#[derive(Debug, clap::Parser)]
#[command(name = "load", no_binary_name = true)]
struct LoadCli {
    #[command(flatten)]
    load: LoadArgs,
}

/// The load options of `compare`, parsed as `kvgate-bench load` would (`--url` is a placeholder
/// until the stack is up).
fn load_template(extra: &[String]) -> Result<LoadArgs, CompareError> {
    for reserved in ["--url", "--run", "--load", "--out"] {
        if extra
            .iter()
            .any(|a| a == reserved || a.starts_with(&format!("{reserved}=")))
        {
            return Err(CompareError::Config(format!(
                "{reserved} is set by compare for each run; leave it out of the load options"
            )));
        }
    }
    let argv = ["--url", "http://placeholder"]
        .into_iter()
        .map(String::from)
        .chain(extra.iter().cloned());
    let cli = LoadCli::try_parse_from(argv)
        .map_err(|e| CompareError::Config(format!("load options: {e}")))?;
    cli.load.validate()?;
    Ok(cli.load)
}

/// The load options of one run: `template` driven at `level` under `policy`.
/// `time_scale`, when given, replaces the load options' (the stack's engines run that much faster
/// than their model, and the load generator paces and records in model time).
fn run_args(
    template: &LoadArgs,
    stack: (&str, Option<f64>),
    label: &str,
    level: f64,
    out: &Path,
) -> LoadArgs {
    let (url, time_scale) = stack;
    let mut a = template.clone();
    if let Some(scale) = time_scale {
        a.time_scale = scale;
    }
    a.url = url.to_owned();
    a.run = label.to_owned();
    a.load = Some(level);
    a.out = Some(out.to_path_buf());
    a.quiet = true;
    let closed = a.concurrency.is_some() || a.workload == WorkloadKind::Doks;
    if closed {
        // Load levels are whole sessions in flight; `validate` refused zero already.
        a.concurrency = Some(level.round().clamp(1.0, f64::from(u32::MAX)) as u32);
    } else if a.workload == WorkloadKind::SharedPrefix {
        a.qps = level;
    } else {
        a.speedup = level;
    }
    a
}

/// Whether the load options choose their own `--time-scale`.
fn sets_time_scale(extra: &[String]) -> bool {
    extra
        .iter()
        .any(|a| a == "--time-scale" || a.starts_with("--time-scale="))
}

/// File name of a run's records.
fn records_name(label: &str, level: f64) -> String {
    format!("{label}-{level}.jsonl")
}

/// The engines' summed prefix-cache counters (tokens): (hits, queries).
fn engine_cache_counters(stack: &Stack) -> (f64, f64) {
    let (mut hits, mut queries) = (0.0, 0.0);
    for i in 0..stack.config().engine_processes() {
        if let Ok(page) = stack.engine_metrics(i) {
            hits += metric_sum(&page, "vllm:prefix_cache_hits_total").unwrap_or(0.0);
            queries += metric_sum(&page, "vllm:prefix_cache_queries_total").unwrap_or(0.0);
        }
    }
    (hits, queries)
}

/// What routes one set of runs: the EPP with a policy, or a peer router.
#[derive(Debug, Clone, Copy)]
enum Front {
    Policy(Policy),
    Router(Router),
}

impl Front {
    /// The runs' label: the policy, or the router's program name.
    fn label(self) -> String {
        match self {
            Front::Policy(p) => p.to_string(),
            Front::Router(r) => r.program().to_owned(),
        }
    }
}

/// Clears every engine's prefix cache (vLLM's `POST /reset_prefix_cache`), retrying briefly
/// while requests still hold blocks (409).
fn reset_caches(stack: &Stack) -> Result<(), CompareError> {
    for i in 0..stack.config().engine_processes() {
        let port = stack.ports().engine_http(i).unwrap_or(0);
        let mut last = None;
        for _ in 0..50 {
            match http_request(port, "POST", "/reset_prefix_cache", Duration::from_secs(2)) {
                Ok((200, _)) => {
                    last = None;
                    break;
                }
                Ok((status, body)) => last = Some(format!("HTTP {status}: {body}")),
                Err(e) => last = Some(e.to_string()),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        if let Some(why) = last {
            return Err(CompareError::Config(format!(
                "engine {i} would not clear its prefix cache: {why}"
            )));
        }
    }
    Ok(())
}

/// Runs `kvgate-bench compare`.
pub fn run(args: &CompareArgs) -> Result<(), CompareError> {
    if args.policies.is_empty() || args.loads.is_empty() {
        return Err(CompareError::Config(
            "--policies and --loads need at least one value each".into(),
        ));
    }
    if let Some(bad) = args.loads.iter().find(|l| !(l.is_finite() && **l > 0.0)) {
        return Err(CompareError::Config(format!(
            "load level {bad} must be finite and positive"
        )));
    }
    if args.stack.router != Router::EnvoyEpp || args.routers.contains(&Router::EnvoyEpp) {
        return Err(CompareError::Config(
            "compare runs the policies through Envoy + EPP first: leave --router at envoy-epp \
             and name peer routers (vllm-router, smg) with --routers"
                .into(),
        ));
    }
    let mut template = load_template(&args.load_args)?;
    crate::load::init_tracing();
    let mut config = args.stack.config()?;
    // Name the stack's model in every request: some peer routers (smg) require the field.
    template.model.get_or_insert_with(|| config.model.clone());
    config.scheduler.policy = args.policies.first().copied().unwrap_or_default();
    let mut stack = Stack::start(config)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| stack.run_dir().join("compare"));
    let result = sweep(args, &template, &mut stack, &out);
    stack.stop();
    let files = result?;
    let report = ReportArgs {
        inputs: files,
        out: Some(out.clone()),
        warmup: template.warmup,
        slo_ttft_ms: template.slo_ttft_ms,
        slo_tpot_ms: template.slo_tpot_ms,
        font: args.font.clone(),
    };
    crate::load::report::run(report)?;
    tracing::info!(dir = %out.display(), "comparison written");
    Ok(())
}

fn sweep(
    args: &CompareArgs,
    template: &LoadArgs,
    stack: &mut Stack,
    out: &Path,
) -> Result<Vec<PathBuf>, CompareError> {
    std::fs::create_dir_all(out).map_err(|source| CompareError::Io {
        what: format!("creating {}", out.display()),
        source,
    })?;
    let mut files = Vec::new();
    let mut engines = String::from("policy\tload\tengine_prefix_hit_rate\n");
    let fronts = args
        .policies
        .iter()
        .map(|p| Front::Policy(*p))
        .chain(args.routers.iter().map(|r| Front::Router(*r)));
    for (n, front) in fronts.enumerate() {
        match front {
            Front::Policy(policy) if n > 0 => stack.set_policy(policy)?,
            Front::Policy(_) => {}
            Front::Router(router) => stack.set_router(router)?,
        }
        let label = front.label();
        for level in &args.loads {
            if !args.keep_caches {
                reset_caches(stack)?;
            }
            let path = out.join(records_name(&label, *level));
            let before = engine_cache_counters(stack);
            tracing::info!(run = %label, load = level, records = %path.display(), "run starting");
            let scale = (!sets_time_scale(&args.load_args)).then_some(stack.config().time_scale);
            let url = stack.base_url();
            crate::load::run(run_args(template, (&url, scale), &label, *level, &path))?;
            stack.check()?;
            let after = engine_cache_counters(stack);
            let queries = after.1 - before.1;
            let rate = if queries > 0.0 {
                (after.0 - before.0) / queries
            } else {
                0.0
            };
            let _ = writeln!(engines, "{label}\t{level}\t{rate:.4}");
            files.push(path);
        }
    }
    let path = out.join("engines.tsv");
    std::fs::write(&path, &engines).map_err(|source| CompareError::Io {
        what: format!("writing {}", path.display()),
        source,
    })?;
    let _ = std::io::stdout()
        .lock()
        .write_all(format!("engines' own prefix-cache hit rate (tokens)\n{engines}").as_bytes());
    Ok(files)
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

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn load_levels_drive_what_the_workload_is_paced_by() {
        let doks = load_template(&strings(&["--workload", "doks", "--duration", "30"])).unwrap();
        let a = run_args(&doks, ("http://x", Some(10.0)), "kv", 120.0, Path::new("a"));
        assert_eq!((a.concurrency, a.time_scale), (Some(120), 10.0));
        assert_eq!(
            (a.run.as_str(), a.load, a.url.as_str()),
            ("kv", Some(120.0), "http://x")
        );

        let sp = load_template(&strings(&["--workload", "shared-prefix"])).unwrap();
        let b = run_args(&sp, ("http://x", None), "round-robin", 40.0, Path::new("b"));
        assert_eq!((b.qps, b.concurrency, b.time_scale), (40.0, None, 1.0));
        assert!(sets_time_scale(&strings(&["--time-scale=5"])));
        assert!(!sets_time_scale(&strings(&["--qps", "5"])));

        let mc = load_template(&strings(&["--workload", "mooncake"])).unwrap();
        let c = run_args(&mc, ("http://x", None), "kv", 4.0, Path::new("c"));
        assert_eq!((c.speedup, c.concurrency), (4.0, None));

        let closed =
            load_template(&strings(&["--workload", "mooncake", "--concurrency", "8"])).unwrap();
        let d = run_args(&closed, ("http://x", None), "kv", 16.0, Path::new("d"));
        assert_eq!((d.concurrency, d.speedup), (Some(16), 1.0));
    }

    #[test]
    fn per_run_options_are_refused_in_the_load_options() {
        for reserved in ["--url", "--run=kv", "--out", "--load"] {
            let err = load_template(&strings(&[reserved, "x"])).unwrap_err();
            assert!(matches!(err, CompareError::Config(_)), "{reserved}");
        }
        assert!(load_template(&strings(&["--bogus"])).is_err());
    }

    #[test]
    fn record_files_are_named_by_policy_and_load() {
        assert_eq!(records_name("round-robin", 60.0), "round-robin-60.jsonl");
        assert_eq!(records_name("kv", 2.5), "kv-2.5.jsonl");
    }
}
