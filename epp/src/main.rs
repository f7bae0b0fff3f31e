//! `kvgate-epp`: see the library crate for what it does.

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    cli_support::exit(kvgate_epp::run(kvgate_epp::Args::parse()))
}
