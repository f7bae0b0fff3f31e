//! `kvgate-kvbm-bandwidth`: measures the block manager's copy paths against their baselines.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvbm_gpu::bandwidth::{self, BenchError, Config, Report};

/// Measures the block manager's copy paths against their baselines in one run: the per-layer
/// copy plan against one memcpy (host), O_DIRECT writes and reads (disk), and, when a CUDA
/// device and GPUDirect Storage are present, the plan's cuMemcpy2DAsync copies against one
/// cuMemcpyAsync, and cuFileRead against O_DIRECT plus a host → device copy. Paths this
/// machine lacks are listed as skipped with the reason; the command never needs a GPU.
#[derive(Debug, Parser)]
#[command(name = "kvgate-kvbm-bandwidth", version)]
struct Args {
    /// Attention layers per block.
    #[arg(long, default_value_t = 32)]
    layers: u32,
    /// Planes per layer (2: separate K and V halves; 1: blocks-first or MLA caches).
    #[arg(long, default_value_t = 2)]
    planes: u32,
    /// Bytes of one block in one plane (block size × KV heads × head size × dtype bytes; the
    /// default is 16 tokens × 8 heads × 128 × 2 bytes, a Llama-3-8B block).
    #[arg(long, default_value_t = 32768)]
    plane_block_bytes: u64,
    /// Blocks per batch.
    #[arg(long, default_value_t = 64)]
    blocks: u32,
    /// Consecutive engine blocks per run (runs are spread over a cache twice the batch).
    #[arg(long, default_value_t = 8)]
    run: u32,
    /// Timed repetitions per row; the median is reported.
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Directory for the disk rows' file (an NVMe mount to measure the disk tier's drive).
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// Skip the disk rows.
    #[arg(long)]
    no_disk: bool,
    /// The CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error(transparent)]
    Bench(#[from] BenchError),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl cli_support::ExitStatus for Error {
    fn exit_code(&self) -> u8 {
        match self {
            Error::Args(_)
            | Error::Bench(BenchError::Layout(_))
            | Error::Bench(BenchError::TooLarge(_)) => cli_support::EXIT_CONFIG,
            _ => 1,
        }
    }
}

fn main() -> ExitCode {
    cli_support::init_tracing();
    cli_support::exit(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Error> {
    if args.blocks == 0 || args.iterations == 0 {
        return Err(Error::Args(
            "--blocks and --iterations must be positive".into(),
        ));
    }
    let cfg = Config {
        layers: args.layers,
        planes: args.planes,
        plane_block_bytes: args.plane_block_bytes,
        blocks: args.blocks,
        run: args.run.max(1),
        iterations: args.iterations,
        dir: (!args.no_disk).then_some(args.dir),
        device: args.device,
    };
    let report = bandwidth::run(&cfg)?;
    print(&report).map_err(|source| Error::Write {
        path: "stdout".into(),
        source,
    })?;
    if let Some(path) = args.json {
        let json = serde_json::to_vec_pretty(&report).map_err(|e| Error::Write {
            path: path.clone(),
            source: e.into(),
        })?;
        std::fs::write(&path, json).map_err(|source| Error::Write { path, source })?;
    }
    Ok(())
}

fn print(r: &Report) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "batch: {} blocks of {} bytes ({:.1} MiB), {} copies per direction",
        r.blocks,
        r.block_bytes,
        (u64::from(r.blocks) * r.block_bytes) as f64 / (1u64 << 20) as f64,
        r.copies_per_batch
    )?;
    writeln!(out, "{:<72} {:>9} {:>8}", "path", "GB/s", "ratio")?;
    for row in &r.rows {
        let ratio = row
            .versus
            .as_ref()
            .map_or(String::new(), |(_, x)| format!("{x:.2}×"));
        writeln!(out, "{:<72} {:>9.2} {:>8}", row.name, row.gb_per_s, ratio)?;
    }
    for s in &r.skipped {
        writeln!(out, "skipped: {s}")?;
    }
    Ok(())
}
