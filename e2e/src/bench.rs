//! `kvgate-bench`: configuration of the local stack and benchmarks.

/// What to run.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Start Envoy, the EPP, simulated engines with sidecars and NATS on this machine.
    Up {
        /// Simulated engines.
        #[arg(long, default_value_t = 4)]
        engines: u32,
    },
    /// Drive an OpenAI endpoint with a workload; records as JSON lines, a summary table.
    Load(Box<crate::load::LoadArgs>),
    /// Summary table and PNG plots (TTFT, throughput vs load) from record files.
    Report(crate::load::ReportArgs),
}

/// Why `kvgate-bench` failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Bad configuration, or a capability not in this build.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The load generator or the report.
    #[error(transparent)]
    Load(#[from] crate::load::LoadError),
}

impl cli_support::ExitStatus for BenchError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Start(e) => e.exit_code(),
            Self::Load(e) => e.exit_code(),
        }
    }
}

/// kvgate local stack and benchmarks.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-bench", version, about, long_about = None)]
pub struct Args {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Validates the configuration, then runs the command.
pub fn run(args: Args) -> Result<(), BenchError> {
    match args.command {
        Command::Load(args) => Ok(crate::load::run(*args)?),
        Command::Report(args) => Ok(crate::load::report::run(args)?),
        Command::Up { engines: 0 } => {
            Err(cli_support::StartError::Config("--engines must be at least 1".into()).into())
        }
        Command::Up { .. } => Err(cli_support::StartError::from(cli_support::NotInThisBuild {
            component: "kvgate-bench",
            capability: "the local stack",
            issue: 7,
        })
        .into()),
    }
}
