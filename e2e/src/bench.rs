//! `kvgate-bench`: the local stack, the load generator, reports.

/// What to run.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Start Envoy, the EPP, simulated engines with sidecars and NATS on this machine.
    Up(Box<crate::stack::UpArgs>),
    /// Drive an OpenAI endpoint with a workload; records as JSON lines, a summary table.
    Load(Box<crate::load::LoadArgs>),
    /// Summary table and PNG plots (TTFT, throughput vs load) from record files.
    Report(crate::load::ReportArgs),
    /// Start the stack once and run a workload for each EPP policy and load level on the same
    /// engines; records, the side-by-side table, plots and the engines' hit rates.
    Compare(Box<crate::compare::CompareArgs>),
    /// Replay a workload against engine models in virtual time, routed by the EPP's code.
    Replay(Box<crate::replay_cmd::ReplayArgs>),
    /// Measure a replica's performance profile on the engine model; write it as a ConfigMap.
    Profile(Box<crate::profile_cmd::ProfileArgs>),
    /// Run a day-shaped load on an autoscaled prefill/decode pool in virtual time: the
    /// planner against static, HPA and oracle provisioning.
    Autoscale(Box<crate::autoscale_cmd::AutoscaleArgs>),
}

/// kvgate local stack and benchmarks.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-bench", version, about, long_about = None)]
pub struct Args {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Why `kvgate-bench` failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The configuration was refused.
    #[error(transparent)]
    Start(#[from] cli_support::StartError),
    /// The local stack failed.
    #[error(transparent)]
    Stack(#[from] crate::stack::StackError),
    /// The load generator or the report.
    #[error(transparent)]
    Load(#[from] crate::load::LoadError),
    /// A comparison.
    #[error(transparent)]
    Compare(#[from] crate::compare::CompareError),
    /// A discrete-event replay.
    #[error(transparent)]
    Replay(#[from] crate::replay_cmd::ReplayCmdError),
    /// A profile measurement.
    #[error(transparent)]
    Profile(#[from] crate::profile_cmd::ProfileCmdError),
    /// An autoscaling evaluation.
    #[error(transparent)]
    Autoscale(#[from] crate::autoscale_cmd::AutoscaleCmdError),
}

impl cli_support::ExitStatus for BenchError {
    fn exit_code(&self) -> u8 {
        match self {
            Self::Start(e) => e.exit_code(),
            Self::Stack(e) => e.exit_code(),
            Self::Load(e) => e.exit_code(),
            Self::Compare(e) => e.exit_code(),
            Self::Replay(crate::replay_cmd::ReplayCmdError::Options(_)) => cli_support::EXIT_CONFIG,
            Self::Replay(_) => 1,
            Self::Profile(e) if e.is_config() => cli_support::EXIT_CONFIG,
            Self::Autoscale(e) if e.is_config() => cli_support::EXIT_CONFIG,
            Self::Profile(_) | Self::Autoscale(_) => 1,
        }
    }
}

/// Runs the command.
pub fn run(args: Args) -> Result<(), BenchError> {
    match args.command {
        Command::Up(up) => Ok(crate::stack::up::run(&up)?),
        Command::Load(args) => Ok(crate::load::run(*args)?),
        Command::Report(args) => Ok(crate::load::report::run(args)?),
        Command::Compare(args) => Ok(crate::compare::run(&args)?),
        Command::Replay(args) => Ok(crate::replay_cmd::run(&args)?),
        Command::Profile(args) => Ok(crate::profile_cmd::run(&args)?),
        Command::Autoscale(args) => Ok(crate::autoscale_cmd::run(&args)?),
    }
}
