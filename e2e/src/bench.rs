//! `kvgate-bench`: configuration of the local stack and benchmarks.

/// What to run.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Start Envoy, the EPP, simulated engines with sidecars and NATS on this machine.
    Up(crate::stack::UpArgs),
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
}

impl cli_support::ExitStatus for BenchError {
    fn exit_code(&self) -> u8 {
        match self {
            BenchError::Start(e) => e.exit_code(),
            BenchError::Stack(e) => e.exit_code(),
        }
    }
}

/// Runs the command.
pub fn run(args: Args) -> Result<(), BenchError> {
    match args.command {
        Command::Up(up) => Ok(crate::stack::up::run(&up)?),
    }
}
