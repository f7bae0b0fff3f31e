//! `kvgate-epp`: see the library crate for what it does.

use clap::Parser as _;

/// mimalloc rather than the system allocator: tokenization allocates many small strings per
/// request, and glibc's malloc spent half of a warm decision in its free-list upkeep
/// (docs/benchmarks.md § kvgate-epp: decision cost).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli_support::exit(kvgate_epp::run(kvgate_epp::Args::parse()))
}
