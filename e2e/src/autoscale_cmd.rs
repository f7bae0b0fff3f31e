//! `kvgate-bench autoscale`: the planner evaluated in virtual time. A day-shaped load built
//! from the Mooncake trace's arrivals (`workload::day`: diurnal ramp, bursts, a prefill-heavy
//! and a decode-heavy hour) runs on a prefill/decode pool of engine models
//! (`replay::autoscale`) whose replicas each scaler changes as the day goes: kvgate's planner,
//! the same planner with two independent loops (no capacity moved between roles), static
//! provisioning for the peak, an HPA on queue depth, and an oracle with perfect foresight of
//! the load. Prints SLA attainment and GPU-hours per scaler, writes records, ticks, a summary
//! and plots of replicas and latency over the day. `docs/autoscaling.md` explains it.

mod plot;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use engine_model::{Nanos, Preset};
use planner::{
    Mode, Planner, PlannerConfig, PredictorKind, Profile, Role, RoleLimits, Slo, Tuning,
};
use replay::autoscale::{
    AutoscaleConfig, AutoscaleError, AutoscaleOutput, Hpa, HpaConfig, OracleOptions, Scaler,
    Schedule, Sla, autoscale, gpu_hours, interval_loads, oracle_schedule, peak, sla,
};
use replay::profiler::{ProfileOptions, ProfilerError, measure};
use replay::{MS, ReplayConfig};
use scheduler::SchedulerConfig;
use workload::{DayOptions, MooncakeOptions, Workload};

/// Nanoseconds per second.
const S: Nanos = 1_000 * MS;

/// The scalers compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum ScalerKind {
    /// kvgate's planner, moving capacity between roles when the budget binds.
    Planner,
    /// The same planner as two independent loops (no capacity moved).
    Independent,
    /// Static provisioning for the day's peak.
    Static,
    /// An HPA per role on engine queue depth.
    Hpa,
    /// Perfect foresight of the load.
    Oracle,
}

impl ScalerKind {
    fn name(self) -> &'static str {
        match self {
            Self::Planner => "planner",
            Self::Independent => "independent",
            Self::Static => "static",
            Self::Hpa => "hpa",
            Self::Oracle => "oracle",
        }
    }
}

/// Which predictor the planner uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PredictorName {
    /// The last interval.
    Constant,
    /// A moving average of `--window` intervals.
    MovingAverage,
    /// Holt's linear trend (`--alpha`, `--beta`).
    Holt,
    /// A local-linear-trend Kalman filter (`--process-noise`, `--measurement-noise`).
    Kalman,
}

/// The planner's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeName {
    /// From the profile.
    Throughput,
    /// From latency regression, ±1 replica per interval.
    Load,
    /// Load mode above the throughput floor.
    Both,
}

/// `kvgate-bench autoscale` options.
#[derive(Debug, Clone, clap::Args)]
pub struct AutoscaleArgs {
    /// The Mooncake trace (default: `$KVGATE_SHARED/traces/mooncake_conversation_trace.jsonl`,
    /// else `../shared/traces/…`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Engine preset of every replica (`h200-llama70b-fp8`: one GPU per replica).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    pub preset: Preset,
    /// GPUs per replica (for GPU-hours and the budget).
    #[arg(long, default_value_t = 1)]
    pub gpus_per_replica: u32,
    /// Hours in the day.
    #[arg(long, default_value_t = 24)]
    pub hours: u32,
    /// Virtual seconds per hour of the day (300: the day runs in 2 hours).
    #[arg(long, default_value_t = 300)]
    pub hour_s: u64,
    /// Request rate at the diurnal peak, before bursts.
    #[arg(long, default_value_t = 6.0)]
    pub peak_rps: f64,
    /// Rate at the trough as a fraction of the peak.
    #[arg(long, default_value_t = 0.25)]
    pub trough: f64,
    /// No bursts.
    #[arg(long)]
    pub no_bursts: bool,
    /// No prefill-heavy or decode-heavy hour.
    #[arg(long)]
    pub no_shift: bool,
    /// Longest prompt, tokens (longer trace prompts are cut).
    #[arg(long, default_value_t = 16_384)]
    pub max_prompt_tokens: u32,
    /// TTFT objective, ms.
    #[arg(long, default_value_t = 6000.0)]
    pub ttft_ms: f64,
    /// ITL objective, ms.
    #[arg(long, default_value_t = 50.0)]
    pub itl_ms: f64,
    /// The objectives' percentile.
    #[arg(long, default_value_t = 90.0)]
    pub percentile: f64,
    /// Seconds between scaling decisions.
    #[arg(long, default_value_t = 30)]
    pub interval_s: u64,
    /// Seconds from a replica's creation to its first request.
    #[arg(long, default_value_t = 60)]
    pub start_up_s: u64,
    /// The planner's and the HPA's scale-down stabilisation window, seconds.
    #[arg(long, default_value_t = 120)]
    pub stabilization_s: u64,
    /// The planner's minimum replica lifetime, seconds.
    #[arg(long, default_value_t = 120)]
    pub lifetime_s: u64,
    /// The planner's mode.
    #[arg(long, value_enum, default_value = "both")]
    pub mode: ModeName,
    /// The planner's predictor.
    #[arg(long, value_enum, default_value = "holt")]
    pub predictor: PredictorName,
    /// Holt's level smoothing.
    #[arg(long, default_value_t = 0.5)]
    pub alpha: f64,
    /// Holt's trend smoothing.
    #[arg(long, default_value_t = 0.3)]
    pub beta: f64,
    /// Moving-average window, intervals.
    #[arg(long, default_value_t = 4)]
    pub window: u32,
    /// Kalman process noise.
    #[arg(long, default_value_t = 1e-3)]
    pub process_noise: f64,
    /// Kalman measurement noise.
    #[arg(long, default_value_t = 1e-2)]
    pub measurement_noise: f64,
    /// The planner's target utilisation of profiled capacity (the oracle plans for the same).
    #[arg(long, default_value_t = 0.85)]
    pub utilisation: f64,
    /// The planner's GPU budget (planner and independent runs); none: unbounded.
    #[arg(long)]
    pub budget: Option<u32>,
    /// Most replicas per role.
    #[arg(long, default_value_t = 64)]
    pub max_replicas: u32,
    /// Route prefill legs without counting them on their prefill engines while they run
    /// (the EPP before it did; `docs/autoscaling.md` shows what that costs).
    #[arg(long)]
    pub no_prefill_accounting: bool,
    /// The HPA's target requests waiting per ready replica.
    #[arg(long, default_value_t = 1.0)]
    pub hpa_queue: f64,
    /// Scalers to run (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "planner,independent,static,hpa,oracle"
    )]
    pub scalers: Vec<ScalerKind>,
    /// A profile (a ConfigMap from `kvgate-bench profile`, or bare profile YAML); none:
    /// measured on the engine model at the day's mean prompt length.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// SLA windows, seconds.
    #[arg(long, default_value_t = 60)]
    pub window_s: u64,
    /// Runs at once (threads).
    #[arg(long, default_value_t = 2)]
    pub jobs: usize,
    /// Seeds the day's content and the routers.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output directory: records, ticks, summary, plots, the profile.
    #[arg(long, default_value = "autoscale-out")]
    pub out: PathBuf,
    /// TrueType font for the plots.
    #[arg(long, default_value = crate::load::plot::DEFAULT_FONT)]
    pub font: PathBuf,
    /// No plots.
    #[arg(long)]
    pub no_plots: bool,
}

/// Why `kvgate-bench autoscale` failed.
#[derive(Debug, thiserror::Error)]
pub enum AutoscaleCmdError {
    /// Inconsistent options.
    #[error("{0}")]
    Options(String),
    /// A file.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The trace.
    #[error("trace")]
    Trace(#[from] workload::MooncakeError),
    /// The day's options.
    #[error("day")]
    Day(#[from] workload::DayError),
    /// Measuring the profile.
    #[error("profile")]
    Profiler(#[from] ProfilerError),
    /// Reading the profile.
    #[error("profile YAML")]
    ProfileYaml(#[from] serde_yaml_ng::Error),
    /// The planner's configuration.
    #[error("planner configuration")]
    Planner(#[from] planner::ConfigError),
    /// A run.
    #[error("autoscaled replay")]
    Autoscale(#[from] AutoscaleError),
    /// JSON output.
    #[error("JSON")]
    Json(#[from] serde_json::Error),
    /// A plot.
    #[error("plotting {path}: {reason}")]
    Plot {
        /// The image.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A run's thread panicked.
    #[error("a run panicked")]
    Panicked,
}

impl AutoscaleCmdError {
    /// Whether the options were at fault (exit code 2).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Self::Options(_)
                | Self::Day(_)
                | Self::Planner(_)
                | Self::Profiler(ProfilerError::Options(_))
        )
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> AutoscaleCmdError + '_ {
    move |source| AutoscaleCmdError::Io {
        path: path.to_owned(),
        source,
    }
}

fn trace_path(args: &AutoscaleArgs) -> PathBuf {
    args.trace.clone().unwrap_or_else(|| {
        std::env::var_os("KVGATE_SHARED")
            .map_or_else(|| PathBuf::from("../shared"), PathBuf::from)
            .join("traces/mooncake_conversation_trace.jsonl")
    })
}

impl AutoscaleArgs {
    /// The day's shape.
    pub fn day_options(&self) -> DayOptions {
        let base = DayOptions::default();
        DayOptions {
            hours: self.hours,
            hour: Duration::from_secs(self.hour_s),
            peak_rps: self.peak_rps,
            trough: self.trough,
            bursts: if self.no_bursts {
                Vec::new()
            } else {
                base.bursts.clone()
            },
            prefill_heavy_hour: base.prefill_heavy_hour.filter(|_| !self.no_shift),
            decode_heavy_hour: base.decode_heavy_hour.filter(|_| !self.no_shift),
            max_prompt_tokens: self.max_prompt_tokens,
            seed: self.seed,
            ..base
        }
    }

    fn slo(&self) -> Slo {
        Slo {
            ttft_ms: self.ttft_ms,
            itl_ms: self.itl_ms,
            percentile: self.percentile,
        }
    }

    fn limits(&self) -> BTreeMap<Role, RoleLimits> {
        let l = RoleLimits {
            min_replicas: 1,
            max_replicas: self.max_replicas,
            gpus_per_replica: self.gpus_per_replica,
        };
        [(Role::Prefill, l), (Role::Decode, l)].into()
    }

    fn horizon(&self) -> Nanos {
        u64::from(self.hours) * self.hour_s * S
    }

    /// The planner's configuration (`move_between_roles` for [`ScalerKind::Planner`]).
    pub fn planner_config(&self, profile: &Profile, moving: bool) -> PlannerConfig {
        PlannerConfig {
            mode: match self.mode {
                ModeName::Throughput => Mode::Throughput,
                ModeName::Load => Mode::Load,
                ModeName::Both => Mode::Both,
            },
            interval_s: self.interval_s as f64,
            predictor: match self.predictor {
                PredictorName::Constant => PredictorKind::Constant,
                PredictorName::MovingAverage => PredictorKind::MovingAverage {
                    window: self.window,
                },
                PredictorName::Holt => PredictorKind::Holt {
                    alpha: self.alpha,
                    beta: self.beta,
                },
                PredictorName::Kalman => PredictorKind::Kalman {
                    process_noise: self.process_noise,
                    measurement_noise: self.measurement_noise,
                },
            },
            scale_down_stabilization_s: self.stabilization_s as f64,
            min_replica_lifetime_s: self.lifetime_s as f64,
            gpu_budget: self.budget,
            roles: self.limits(),
            slo: self.slo(),
            profile: Some(profile.clone()),
            move_between_roles: moving,
            tuning: Tuning {
                target_utilisation: self.utilisation,
                ..Tuning::default()
            },
        }
    }

    fn oracle_options(&self, profile: &Profile) -> OracleOptions {
        OracleOptions {
            profile: profile.clone(),
            slo: self.slo(),
            utilisation: self.utilisation,
            interval: self.interval_s * S,
            start_up: self.start_up_s * S,
            limits: self.limits(),
        }
    }

    /// The hours whose requests are prefill- or decode-heavy, as a span of virtual ms.
    fn shift_span_ms(&self) -> Option<(f64, f64)> {
        let d = self.day_options();
        let (p, q) = (d.prefill_heavy_hour?, d.decode_heavy_hour?);
        let hour_ms = self.hour_s as f64 * 1e3;
        Some((
            f64::from(p.min(q)) * hour_ms,
            f64::from(p.max(q) + 1) * hour_ms,
        ))
    }
}

/// One scaler's run and its figures.
#[derive(Debug)]
pub struct Outcome {
    /// The scaler.
    pub kind: ScalerKind,
    /// The run.
    pub output: AutoscaleOutput,
    /// SLA over the day.
    pub day: Sla,
    /// SLA over the prefill- and decode-heavy hours.
    pub shift: Option<Sla>,
    /// GPU-hours over those hours.
    pub shift_gpu_hours: Option<f64>,
    /// Wall-clock time of the run.
    pub wall: Duration,
}

/// Everything a run of the command needs, built once.
#[derive(Debug)]
pub struct Setup {
    /// The day.
    pub workload: Workload,
    /// The profile planner and oracle use.
    pub profile: Profile,
    /// The oracle's replicas per tick.
    pub oracle: Vec<BTreeMap<Role, u32>>,
    /// Static provisioning.
    pub peak: BTreeMap<Role, u32>,
}

/// Reads the trace, builds the day, reads or measures the profile, plans the oracle.
pub fn setup(args: &AutoscaleArgs) -> Result<Setup, AutoscaleCmdError> {
    if args.interval_s == 0 || args.hour_s == 0 || args.window_s == 0 {
        return Err(AutoscaleCmdError::Options(
            "--interval-s, --hour-s and --window-s must be positive".into(),
        ));
    }
    let path = trace_path(args);
    let file = File::open(&path).map_err(io(&path))?;
    let trace = workload::read_mooncake(BufReader::new(file), &MooncakeOptions::default())?;
    let workload = workload::day(&trace, &args.day_options())?;
    let profile = match &args.profile {
        Some(p) => crate::profile_cmd::read_profile(&std::fs::read_to_string(p).map_err(io(p))?)?,
        None => {
            // The day's prompt lengths outside its shifted hours: the traffic the profile is
            // for (the planner's corrections follow the shifted hours).
            let d = args.day_options();
            let shifted = [d.prefill_heavy_hour, d.decode_heavy_hour];
            let lengths: Vec<u32> = workload
                .sessions
                .iter()
                .filter(|s| !shifted.contains(&Some(s.group)))
                .filter_map(|s| s.turns.first())
                .map(|t| t.user.iter().map(|s| s.len).sum::<u32>().max(1))
                .collect();
            measure(&ProfileOptions {
                prompt_tokens: lengths,
                percentile: args.percentile,
                seed: args.seed,
                ..ProfileOptions::new(args.preset.config())
            })?
        }
    };
    let o = args.oracle_options(&profile);
    let loads = interval_loads(&workload, o.interval, args.horizon());
    Ok(Setup {
        oracle: oracle_schedule(&loads, &o),
        peak: peak(&loads, &o),
        workload,
        profile,
    })
}

/// Runs one scaler over the day.
pub fn run_one(
    args: &AutoscaleArgs,
    setup: &Setup,
    kind: ScalerKind,
) -> Result<Outcome, AutoscaleCmdError> {
    let initial = match kind {
        ScalerKind::Static => setup.peak.clone(),
        _ => setup.oracle.first().cloned().unwrap_or_default(),
    };
    let mut scaler = match kind {
        ScalerKind::Planner | ScalerKind::Independent => Scaler::Planner(Box::new(Planner::new(
            args.planner_config(&setup.profile, kind == ScalerKind::Planner),
        )?)),
        ScalerKind::Static => Scaler::Schedule(Schedule {
            ticks: vec![setup.peak.clone()],
        }),
        ScalerKind::Hpa => Scaler::Hpa(Hpa::new(HpaConfig {
            target_queue: args.hpa_queue,
            tolerance: 0.1,
            stabilization: args.stabilization_s * S,
            limits: args.limits(),
        })),
        ScalerKind::Oracle => Scaler::Schedule(Schedule {
            ticks: setup.oracle.clone(),
        }),
    };
    let prefill = initial.get(&Role::Prefill).copied().unwrap_or(1) as usize;
    let decode = initial.get(&Role::Decode).copied().unwrap_or(1) as usize;
    let mut replay = ReplayConfig::new(prefill + decode, args.preset.config());
    replay.prefill_engines = prefill;
    replay.scheduler = SchedulerConfig::default();
    replay.scheduler.disaggregation.enabled = true;
    replay.account_prefill_legs = !args.no_prefill_accounting;
    replay.seed = args.seed;
    replay.run = kind.name().into();
    let config = AutoscaleConfig {
        replay,
        interval: args.interval_s * S,
        start_up: args.start_up_s * S,
        gpus_per_replica: args.gpus_per_replica,
        slo: args.slo(),
        horizon: args.horizon(),
    };
    let started = Instant::now();
    let output = autoscale(&setup.workload, &config, &mut scaler)?;
    let wall = started.elapsed();
    let slo = args.slo();
    let window_ms = args.window_s as f64 * 1e3;
    let horizon_ms = args.horizon() as f64 / 1e6;
    let records = &output.replay.records;
    let day = sla(records, &slo, window_ms, 0.0, horizon_ms);
    let shift = args
        .shift_span_ms()
        .map(|(from, to)| sla(records, &slo, window_ms, from, to));
    let shift_gpu_hours = args.shift_span_ms().map(|(from, to)| {
        gpu_hours(
            &output.replay.lives,
            args.gpus_per_replica,
            (from * 1e6) as Nanos,
            (to * 1e6) as Nanos,
        )
    });
    Ok(Outcome {
        kind,
        output,
        day,
        shift,
        shift_gpu_hours,
        wall,
    })
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn ms(x: Option<f64>) -> String {
    x.map_or_else(
        || "—".into(),
        |v| {
            if v.is_finite() {
                format!("{v:.0}")
            } else {
                "∞".into()
            }
        },
    )
}

/// The comparison table (Markdown).
pub fn table(outcomes: &[Outcome]) -> String {
    let gpu = |k: ScalerKind| {
        outcomes
            .iter()
            .find(|o| o.kind == k)
            .map(|o| o.output.gpu_hours)
    };
    let (oracle, fixed) = (gpu(ScalerKind::Oracle), gpu(ScalerKind::Static));
    let mut out = String::from(
        "| scaler | GPU-hours | × oracle | vs static | SLA attainment (windows) | requests within SLO \
         | TTFT p | ITL p | shifting hours: SLA, GPU-hours |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for o in outcomes {
        let g = o.output.gpu_hours;
        let shift = match (o.shift, o.shift_gpu_hours) {
            (Some(s), Some(h)) => format!("{}, {h:.2}", pct(s.attainment())),
            _ => "—".into(),
        };
        out.push_str(&format!(
            "| {} | {g:.2} | {} | {} | {} ({}/{}) | {} | {} | {} | {shift} |\n",
            o.kind.name(),
            oracle.map_or_else(|| "—".into(), |h| format!("{:.2}", g / h)),
            fixed.map_or_else(|| "—".into(), |h| format!("{:+.1}%", 100.0 * (g / h - 1.0))),
            pct(o.day.attainment()),
            o.day.windows_met,
            o.day.windows,
            pct(o.day.request_attainment()),
            ms(o.day.ttft_ms),
            ms(o.day.itl_ms),
        ));
    }
    out
}

fn write_outputs(
    args: &AutoscaleArgs,
    setup: &Setup,
    outcomes: &[Outcome],
) -> Result<(), AutoscaleCmdError> {
    let dir = &args.out;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join("profile.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&setup.profile)?).map_err(io(&path))?;
    let mut summary = Vec::new();
    for o in outcomes {
        let name = o.kind.name();
        let path = dir.join(format!("records-{name}.jsonl"));
        let mut w = BufWriter::new(File::create(&path).map_err(io(&path))?);
        for r in &o.output.replay.records {
            serde_json::to_writer(&mut w, r)?;
            w.write_all(b"\n").map_err(io(&path))?;
        }
        w.flush().map_err(io(&path))?;
        let path = dir.join(format!("ticks-{name}.jsonl"));
        let mut w = BufWriter::new(File::create(&path).map_err(io(&path))?);
        for t in &o.output.ticks {
            serde_json::to_writer(
                &mut w,
                &serde_json::json!({
                    "at_s": t.at_s,
                    "replicas": t.replicas,
                    "ready": t.ready,
                    "desired": t.desired,
                    "metrics": t.metrics,
                    "label": t.label,
                    "reason": t.reason,
                    "budget_limited": t.budget_limited,
                    "need": t.need,
                    "corrections": t.corrections,
                }),
            )?;
            w.write_all(b"\n").map_err(io(&path))?;
        }
        w.flush().map_err(io(&path))?;
        summary.push(serde_json::json!({
            "scaler": name,
            "gpu_hours": o.output.gpu_hours,
            "sla_windows": o.day.windows,
            "sla_windows_met": o.day.windows_met,
            "requests": o.day.requests,
            "requests_within_slo": o.day.requests_met,
            "ttft_ms": o.day.ttft_ms,
            "itl_ms": o.day.itl_ms,
            "shift_sla_windows": o.shift.map(|s| s.windows),
            "shift_sla_windows_met": o.shift.map(|s| s.windows_met),
            "shift_gpu_hours": o.shift_gpu_hours,
            "engines_started": o.output.replay.lives.len(),
            "wall_s": o.wall.as_secs_f64(),
        }));
    }
    let path = dir.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?).map_err(io(&path))?;
    if !args.no_plots {
        plots(args, outcomes)?;
    }
    Ok(())
}

fn plots(args: &AutoscaleArgs, outcomes: &[Outcome]) -> Result<(), AutoscaleCmdError> {
    crate::load::plot::register_font(&args.font).map_err(|e| AutoscaleCmdError::Plot {
        path: args.font.clone(),
        reason: e.to_string(),
    })?;
    let hour = args.hour_s as f64;
    let line = |o: &Outcome, f: &dyn Fn(&replay::autoscale::Tick) -> Option<f64>| -> plot::Line {
        (
            o.kind.name().to_owned(),
            o.output
                .ticks
                .iter()
                .filter_map(|t| f(t).map(|v| (t.at_s / hour, v)))
                .collect(),
        )
    };
    let replicas = |role: Role| -> Vec<plot::Line> {
        outcomes
            .iter()
            .map(|o| line(o, &|t| t.desired.get(&role).map(|&n| f64::from(n))))
            .collect()
    };
    let (prefill, decode) = (replicas(Role::Prefill), replicas(Role::Decode));
    let ttft: Vec<plot::Line> = outcomes
        .iter()
        .map(|o| line(o, &|t| t.metrics.ttft_ms))
        .collect();
    let itl: Vec<plot::Line> = outcomes
        .iter()
        .map(|o| line(o, &|t| t.metrics.itl_ms))
        .collect();
    let hours = f64::from(args.hours);
    let path = args.out.join("replicas.png");
    plot::draw(
        &path,
        &[
            plot::Panel {
                title: "Prefill replicas",
                y_desc: "replicas",
                lines: &prefill,
                objective: None,
                y_cap: None,
            },
            plot::Panel {
                title: "Decode replicas",
                y_desc: "replicas",
                lines: &decode,
                objective: None,
                y_cap: None,
            },
        ],
        hours,
    )
    .map_err(|reason| AutoscaleCmdError::Plot {
        path: path.clone(),
        reason,
    })?;
    let path = args.out.join("latency.png");
    let p = args.percentile;
    let (t_title, i_title) = (
        format!("TTFT p{p} per {} s interval", args.interval_s),
        format!("ITL p{p} per {} s interval", args.interval_s),
    );
    plot::draw(
        &path,
        &[
            plot::Panel {
                title: &t_title,
                y_desc: "ms",
                lines: &ttft,
                objective: Some(args.ttft_ms),
                y_cap: Some(4.0 * args.ttft_ms),
            },
            plot::Panel {
                title: &i_title,
                y_desc: "ms",
                lines: &itl,
                objective: Some(args.itl_ms),
                y_cap: Some(4.0 * args.itl_ms),
            },
        ],
        hours,
    )
    .map_err(|reason| AutoscaleCmdError::Plot { path, reason })
}

/// Runs every scaler over the day and reports.
pub fn run(args: &AutoscaleArgs) -> Result<(), AutoscaleCmdError> {
    let setup = setup(args)?;
    let mut kinds = args.scalers.clone();
    kinds.sort();
    kinds.dedup();
    let jobs = args.jobs.max(1);
    let mut outcomes: Vec<Outcome> = Vec::new();
    for chunk in kinds.chunks(jobs) {
        let results: Vec<Result<Outcome, AutoscaleCmdError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&k| {
                    let setup = &setup;
                    scope.spawn(move || run_one(args, setup, k))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err(AutoscaleCmdError::Panicked)))
                .collect()
        });
        for r in results {
            outcomes.push(r?);
        }
    }
    write_outputs(args, &setup, &outcomes)?;
    let notes: Vec<String> = outcomes
        .iter()
        .map(|o| {
            format!(
                "{}: {} requests, {} engines started, {} steps, wall {:.1} s",
                o.kind.name(),
                o.output.replay.records.len(),
                o.output.replay.lives.len(),
                o.output.replay.steps,
                o.wall.as_secs_f64()
            )
        })
        .collect();
    let text = format!(
        "day: {} requests over {} h × {} s; static peak {:?}; profile: {}\n\n{}\n{}\noutputs: {}\n",
        setup.workload.sessions.len(),
        args.hours,
        args.hour_s,
        setup.peak,
        setup.profile.description,
        table(&outcomes),
        notes.join("\n"),
        args.out.display()
    );
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .map_err(io(Path::new("stdout")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
    use super::*;
    use clap::Parser as _;

    fn args(extra: &[&str]) -> AutoscaleArgs {
        let mut argv = vec!["kvgate-bench", "autoscale"];
        argv.extend_from_slice(extra);
        match crate::bench::Args::parse_from(argv).command {
            crate::bench::Command::Autoscale(a) => *a,
            other => panic!("{other:?}"),
        }
    }

    /// A small day (three hours of 60 s) on the default preset: every scaler, then the planner
    /// under a GPU budget below the peak. Checks what the command promises, not figures.
    #[test]
    fn a_small_day_runs_every_scaler_and_writes_its_outputs() {
        let dir = std::env::temp_dir().join(format!("kvgate-autoscale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shared = std::env::var_os("KVGATE_SHARED").map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
            PathBuf::from,
        );
        let trace = shared.join("traces/mooncake_conversation_trace.jsonl");
        // A coarse profile of the same preset, measured once for both runs.
        let mut options = ProfileOptions::new(Preset::H200Llama70bFp8.config());
        options.prompt_tokens = vec![512, 2048];
        options.loads = vec![0.2, 0.5, 0.8, 1.0];
        options.requests_per_load = 200;
        options.pool = 2;
        options.contexts = vec![1024, 4096];
        options.batches = vec![1, 8, 32];
        options.decode_tokens = 8;
        let profile = measure(&options).unwrap();
        let profile_path = dir.join("profile.yaml");
        std::fs::write(&profile_path, serde_yaml_ng::to_string(&profile).unwrap()).unwrap();
        let out = dir.join("all");
        let common = [
            "--trace",
            trace.to_str().unwrap(),
            "--profile",
            profile_path.to_str().unwrap(),
            "--hours",
            "3",
            "--hour-s",
            "60",
            "--peak-rps",
            "8",
            "--max-prompt-tokens",
            "2048",
            "--interval-s",
            "10",
            "--start-up-s",
            "10",
            "--stabilization-s",
            "30",
            "--lifetime-s",
            "30",
            "--window-s",
            "30",
            "--ttft-ms",
            "3000",
            "--max-replicas",
            "6",
        ];
        let mut a = args(&common);
        a.out = out.clone();
        a.no_plots = !Path::new(&a.font).exists();
        assert!(
            !a.no_plots || std::env::var_os("CI").is_none(),
            "the plots' font {} is missing (scripts/bootstrap.sh installs it)",
            a.font.display()
        );
        let setup = setup(&a).unwrap();
        assert!(!setup.workload.sessions.is_empty());
        // Static provisioning is the oracle's largest interval.
        for (role, &n) in &setup.peak {
            assert!(
                setup
                    .oracle
                    .iter()
                    .all(|t| t.get(role).copied().unwrap_or(0) <= n)
            );
        }
        run(&a).unwrap();
        let summary: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        let names: Vec<&str> = summary
            .iter()
            .map(|s| s["scaler"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["planner", "independent", "static", "hpa", "oracle"]);
        let gpu = |name: &str| {
            summary.iter().find(|s| s["scaler"] == name).unwrap()["gpu_hours"]
                .as_f64()
                .unwrap()
        };
        let peak: u32 = setup.peak.values().sum();
        assert!(
            peak >= 3,
            "a day this small needs no scaling: {:?}",
            setup.peak
        );
        let day_h = 3.0 * 60.0 / 3600.0;
        assert!(
            (gpu("static") - f64::from(peak) * day_h).abs() < 1e-6,
            "static: {} GPU-hours for {peak} replicas",
            gpu("static")
        );
        assert!(gpu("oracle") <= gpu("static") + 1e-9);
        for s in &summary {
            let name = s["scaler"].as_str().unwrap();
            assert_eq!(s["requests"], setup.workload.sessions.len(), "{name}");
            assert!(s["sla_windows_met"].as_u64() <= s["sla_windows"].as_u64());
            let records = std::fs::read_to_string(out.join(format!("records-{name}.jsonl")));
            assert_eq!(
                records.unwrap().lines().count(),
                setup.workload.sessions.len(),
                "{name}"
            );
            for line in std::fs::read_to_string(out.join(format!("ticks-{name}.jsonl")))
                .unwrap()
                .lines()
            {
                let t: serde_json::Value = serde_json::from_str(line).unwrap();
                for role in ["prefill", "decode"] {
                    let n = t["desired"][role].as_u64().unwrap();
                    assert!((1..=6).contains(&n), "{name} {role}: {n} at {}", t["at_s"]);
                }
            }
        }
        for png in ["replicas.png", "latency.png"] {
            assert_eq!(out.join(png).exists(), !a.no_plots, "{png}");
        }
        // Under a budget below the peak the planner never asks for more.
        let budget = peak - 1;
        let mut b = args(&common);
        b.out = dir.join("budget");
        b.no_plots = true;
        b.budget = Some(budget);
        b.scalers = vec![ScalerKind::Planner];
        run(&b).unwrap();
        let ticks = std::fs::read_to_string(b.out.join("ticks-planner.jsonl")).unwrap();
        for line in ticks.lines() {
            let t: serde_json::Value = serde_json::from_str(line).unwrap();
            let total: u64 = ["prefill", "decode"]
                .iter()
                .map(|r| t["desired"][r].as_u64().unwrap())
                .sum();
            assert!(total <= u64::from(budget), "{total} GPUs at {}", t["at_s"]);
        }
        // Options that cannot work are refused as the user's mistake.
        let mut bad = args(&common);
        bad.interval_s = 0;
        assert!(setup_err_is_config(&bad));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn setup_err_is_config(a: &AutoscaleArgs) -> bool {
        setup(a).err().is_some_and(|e| e.is_config())
    }
}
