//! `kvgate-sim`: see [`kvgate_e2e::sim`].

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    cli_support::exit(kvgate_e2e::sim::run(kvgate_e2e::sim::Args::parse()))
}
