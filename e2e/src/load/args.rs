//! `kvgate-bench load` arguments and the workload they select.

use std::io::BufReader;
use std::path::PathBuf;
use std::time::Duration;

use workload::{DoksOptions, MooncakeOptions, Pacing, SharedPrefixOptions, Slo, Workload};

use super::error::{LoadError, Result};

/// Which workload to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// The Mooncake conversation trace: single requests at their timestamps.
    Mooncake,
    /// Seed 001's multi-turn conversations over shared starters, closed loop.
    Doks,
    /// Groups of users behind long shared system prompts, Poisson arrivals.
    SharedPrefix,
}

/// Drive an OpenAI-compatible endpoint with a workload and measure every request.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// The OpenAI base URL (`http://host:port`; a trailing `/v1` is accepted).
    #[arg(long)]
    pub url: String,
    /// The model to name in requests; the server's default when absent.
    #[arg(long)]
    pub model: Option<String>,
    /// The workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Doks)]
    pub workload: WorkloadKind,
    /// Seeds the synthetic workloads.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Closed loop with this many sessions in flight (any workload); the DOKS workload's
    /// default is 60. Without it, mooncake and shared-prefix run open loop.
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Open loop: replay session start times this many times faster.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// The engines are `kvgate-sim --time-scale F`: pace the workload F× faster and record every
    /// time multiplied by F, so records and summaries are in model time. Client-side and network
    /// overheads are multiplied too. `--warmup`, `--duration`, `--timeout` and `--drain` stay in
    /// wall seconds.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Stop starting requests after warm-up plus this many seconds; the summary covers them.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Seconds at the start that the summary leaves out (records are still written).
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,
    /// Stop after this many requests.
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Per-request deadline in seconds; a request still running is a `timeout` record.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// Seconds to wait for requests in flight once no new ones may start.
    #[arg(long, default_value_t = 120.0)]
    pub drain: f64,
    /// Write one JSON record per request to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The run label of the records (the policy or router under test).
    #[arg(long, default_value = "run")]
    pub run: String,
    /// The load label of the records; default: the concurrency (closed loop), the QPS
    /// (shared-prefix) or the speed-up (mooncake).
    #[arg(long)]
    pub load: Option<f64>,
    /// Goodput objective: TTFT at most this many milliseconds.
    #[arg(long, default_value_t = 600.0)]
    pub slo_ttft_ms: f64,
    /// Goodput objective: TPOT at most this many milliseconds.
    #[arg(long, default_value_t = 60.0)]
    pub slo_tpot_ms: f64,
    /// No progress line on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// doks: think time before each follow-up turn, ms (the replay's `--think-ms`; 3000 in its
    /// seed-001 fidelity calibration).
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// Send prompts as text, each token id as four ASCII characters, which kvgate-sim's byte
    /// tokenizer maps back to one token per id (for routers that refuse token-id prompts, such
    /// as smg). Prompt lengths and shared prefixes are unchanged; ids themselves differ.
    #[arg(long)]
    pub text_prompts: bool,

    /// mooncake: the trace file.
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_conversation_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// mooncake: keep rows from this trace second on (before speed-up).
    #[arg(long, default_value_t = 0.0)]
    pub trace_from: f64,
    /// mooncake: keep rows before this trace second.
    #[arg(long)]
    pub trace_to: Option<f64>,
    /// mooncake: at most this many rows.
    #[arg(long)]
    pub trace_limit: Option<usize>,

    /// doks: conversations to generate (default: 200 per unit of concurrency).
    #[arg(long)]
    pub sessions: Option<usize>,

    /// shared-prefix: groups.
    #[arg(long, default_value_t = 8)]
    pub groups: u32,
    /// shared-prefix: users per group.
    #[arg(long, default_value_t = 8)]
    pub users_per_group: u32,
    /// shared-prefix: questions per user.
    #[arg(long, default_value_t = 4)]
    pub questions_per_user: u32,
    /// shared-prefix: system prompt tokens.
    #[arg(long, default_value_t = 2_000)]
    pub system_prompt_tokens: u32,
    /// shared-prefix: question tokens.
    #[arg(long, default_value_t = 50)]
    pub question_tokens: u32,
    /// shared-prefix: output tokens.
    #[arg(long, default_value_t = 50)]
    pub output_tokens: u32,
    /// shared-prefix: requests per second.
    #[arg(long, default_value_t = 10.0)]
    pub qps: f64,
}

fn seconds(name: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        LoadError::Config(format!("--{name} must be a non-negative number of seconds"))
    })
}

impl LoadArgs {
    /// Checks what can be checked before anything starts.
    pub fn validate(&self) -> Result<()> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(LoadError::Config(
                "--time-scale must be finite and positive".into(),
            ));
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(LoadError::Config(
                "--speedup must be finite and positive".into(),
            ));
        }
        if self.concurrency == Some(0) {
            return Err(LoadError::Config("--concurrency must be at least 1".into()));
        }
        if self.timeout <= 0.0 {
            return Err(LoadError::Config("--timeout must be positive".into()));
        }
        for (name, v) in [
            ("warmup", Some(self.warmup)),
            ("duration", self.duration),
            ("timeout", Some(self.timeout)),
            ("drain", Some(self.drain)),
        ] {
            if let Some(v) = v {
                seconds(name, v)?;
            }
        }
        if self.max_requests == Some(0) {
            return Err(LoadError::Config(
                "--max-requests must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// Per-request deadline.
    pub fn timeout(&self) -> Result<Duration> {
        seconds("timeout", self.timeout)
    }

    /// Wait for requests in flight after the last may start.
    pub fn drain(&self) -> Result<Duration> {
        seconds("drain", self.drain)
    }

    /// Warm-up.
    pub fn warmup(&self) -> Result<Duration> {
        seconds("warmup", self.warmup)
    }

    /// When requests stop starting: warm-up plus duration.
    pub fn deadline(&self) -> Result<Option<Duration>> {
        self.duration
            .map(|d| Ok(self.warmup()? + seconds("duration", d)?))
            .transpose()
    }

    /// The goodput objective.
    pub fn slo(&self) -> Slo {
        Slo {
            ttft_ms: self.slo_ttft_ms,
            tpot_ms: self.slo_tpot_ms,
        }
    }

    /// The selected workload, with `--concurrency` applied.
    pub fn workload(&self) -> Result<Workload> {
        let mut w = match self.workload {
            WorkloadKind::Mooncake => {
                let from = seconds("trace-from", self.trace_from)?;
                let to = self.trace_to.map(|t| seconds("trace-to", t)).transpose()?;
                let options = MooncakeOptions {
                    window: Some(from..to.unwrap_or(Duration::MAX)),
                    limit: self.trace_limit,
                    ..MooncakeOptions::default()
                };
                let file = std::fs::File::open(&self.trace).map_err(|source| LoadError::Io {
                    context: format!("opening the trace {}", self.trace.display()),
                    source,
                })?;
                workload::read_mooncake(BufReader::new(file), &options)?
            }
            WorkloadKind::Doks => {
                let concurrency = self.concurrency.unwrap_or(60);
                workload::doks(&DoksOptions {
                    sessions: self.sessions.unwrap_or(concurrency as usize * 200),
                    concurrency,
                    seed: self.seed,
                    think: Duration::from_millis(self.think_ms),
                    ..DoksOptions::default()
                })
            }
            WorkloadKind::SharedPrefix => workload::shared_prefix(&SharedPrefixOptions {
                groups: self.groups,
                users_per_group: self.users_per_group,
                questions_per_user: self.questions_per_user,
                system_prompt_tokens: self.system_prompt_tokens,
                question_tokens: self.question_tokens,
                output_tokens: self.output_tokens,
                qps: self.qps,
                seed: self.seed,
                ..SharedPrefixOptions::default()
            })
            .map_err(|e| LoadError::Config(e.to_string()))?,
        };
        if let Some(concurrency) = self.concurrency {
            w.pacing = Pacing::Closed { concurrency };
        }
        Ok(w)
    }

    /// The load label: `--load`, else what the run was driven at.
    pub fn load_label(&self, w: &Workload) -> f64 {
        self.load.unwrap_or(match (w.pacing, self.workload) {
            (Pacing::Closed { concurrency }, _) => f64::from(concurrency),
            (Pacing::Open, WorkloadKind::SharedPrefix) => self.qps * self.speedup,
            (Pacing::Open, _) => self.speedup,
        })
    }
}
