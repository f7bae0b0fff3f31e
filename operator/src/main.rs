//! `kvgate-operator`: see the library crate for what it does.

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    cli_support::exit(kvgate_operator::run(kvgate_operator::Args::parse()))
}
