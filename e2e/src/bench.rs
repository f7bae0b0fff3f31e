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
    /// Replay a workload against engine models in virtual time, routed by the EPP's code.
    Replay(Box<crate::replay_cmd::ReplayArgs>),
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
pub fn run(args: Args) -> Result<(), cli_support::StartError> {
    match args.command {
        Command::Up { engines: 0 } => Err(cli_support::StartError::Config(
            "--engines must be at least 1".into(),
        )),
        Command::Replay(a) => {
            crate::replay_cmd::run(&a).map_err(|e| cli_support::StartError::Config(e.to_string()))
        }
        Command::Up { .. } => Err(cli_support::NotInThisBuild {
            component: "kvgate-bench",
            capability: "the local stack",
            issue: 7,
        }
        .into()),
    }
}
