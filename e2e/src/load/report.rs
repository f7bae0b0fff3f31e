//! `kvgate-bench report`: reads record files (from `load` or the discrete-event replay),
//! prints one summary row per (run, load), and draws the sweep as PNG plots.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::PathBuf;

use workload::{RequestRecord, Slo, Summary, Window, render_table, summarize_runs};

use super::error::{LoadError, Result};
use super::plot;

/// Longest record line accepted, in bytes.
const MAX_LINE_BYTES: u64 = 1 << 20;

/// Summarize and plot record files.
#[derive(Debug, Clone, clap::Args)]
pub struct ReportArgs {
    /// JSON-lines record files.
    #[arg(long = "in", required = true, num_args = 1..)]
    pub inputs: Vec<PathBuf>,
    /// Write `ttft.png`, `throughput.png` and `summary.json` here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seconds at the start of each (run, load) left out of its summary.
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,
    /// Goodput objective: TTFT at most this many milliseconds.
    #[arg(long, default_value_t = 600.0)]
    pub slo_ttft_ms: f64,
    /// Goodput objective: TPOT at most this many milliseconds.
    #[arg(long, default_value_t = 60.0)]
    pub slo_tpot_ms: f64,
    /// TrueType font for the plots.
    #[arg(long, default_value = plot::DEFAULT_FONT)]
    pub font: PathBuf,
}

/// Reads one JSON-lines file of records.
pub fn read_records(path: &std::path::Path) -> Result<Vec<RequestRecord>> {
    let file = std::fs::File::open(path).map_err(|source| LoadError::Io {
        context: format!("opening {}", path.display()),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let mut out = Vec::new();
    let mut buf = String::new();
    for line in 1.. {
        buf.clear();
        let n = std::io::Read::take(&mut reader, MAX_LINE_BYTES)
            .read_line(&mut buf)
            .map_err(|source| LoadError::Io {
                context: format!("reading {}:{line}", path.display()),
                source,
            })?;
        if n == 0 {
            break;
        }
        if buf.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(buf.trim_end()).map_err(|source| LoadError::Record {
            path: path.display().to_string(),
            line,
            source,
        })?;
        out.push(record);
    }
    Ok(out)
}

/// Summaries of `records` by (run, load), each over its own span after `warmup_ms`.
pub fn summaries(records: &[RequestRecord], warmup_ms: f64, slo: Slo) -> Vec<Summary> {
    summarize_runs(
        records,
        |group| {
            let all = Window::covering(group);
            Window {
                from_ms: all.from_ms + warmup_ms,
                to_ms: all.to_ms.max(all.from_ms + warmup_ms),
            }
        },
        slo,
    )
}

/// Runs `kvgate-bench report`.
pub fn run(args: ReportArgs) -> Result<()> {
    super::init_tracing();
    let warmup = std::time::Duration::try_from_secs_f64(args.warmup).map_err(|_| {
        LoadError::Config("--warmup must be a non-negative number of seconds".into())
    })?;
    let mut records = Vec::new();
    for path in &args.inputs {
        records.extend(read_records(path)?);
    }
    let slo = Slo {
        ttft_ms: args.slo_ttft_ms,
        tpot_ms: args.slo_tpot_ms,
    };
    let mut summaries = summaries(&records, warmup.as_secs_f64() * 1_000.0, slo);
    summaries.sort_by(|a, b| {
        a.run
            .cmp(&b.run)
            .then(a.load.unwrap_or(0.0).total_cmp(&b.load.unwrap_or(0.0)))
    });
    let _ = std::io::stdout()
        .lock()
        .write_all(render_table(&summaries).as_bytes());
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).map_err(|source| LoadError::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
        let json = serde_json::to_string_pretty(&summaries).map_err(|e| LoadError::Io {
            context: "encoding summary.json".into(),
            source: e.into(),
        })?;
        let path = dir.join("summary.json");
        std::fs::write(&path, json).map_err(|source| LoadError::Io {
            context: format!("writing {}", path.display()),
            source,
        })?;
        plot::register_font(&args.font)?;
        plot::ttft(&summaries, &dir.join("ttft.png"))?;
        plot::throughput(&summaries, &dir.join("throughput.png"))?;
        tracing::info!(dir = %dir.display(), "wrote summary.json, ttft.png and throughput.png");
    }
    Ok(())
}
