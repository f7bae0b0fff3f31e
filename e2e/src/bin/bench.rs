//! `kvgate-bench`: see [`kvgate_e2e::bench`].

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    cli_support::exit(kvgate_e2e::bench::run(kvgate_e2e::bench::Args::parse()))
}
