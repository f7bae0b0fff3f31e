//! `kvgate-bench load`: a load generator for any OpenAI-compatible endpoint, and
//! `kvgate-bench report`: tables and PNG plots from its records.
//!
//! The workloads come from the pure `kvgate-workload` crate; [`driver`] paces their sessions
//! (open or closed loop) and sends each turn through [`client`], a pooled hyper client that
//! streams `/v1/completions` with a token-id prompt and reads the events with [`sse`]. Every
//! request becomes a [`workload::RequestRecord`] written as a JSON line by [`sink`]; at the end
//! the run's summary table goes to stdout. [`progress`] shows a live line on stderr.

pub mod args;
pub mod client;
pub mod driver;
pub mod error;
pub mod plot;
pub mod progress;
pub mod report;
pub mod sink;
pub mod sse;

use std::io::Write as _;
use std::sync::Arc;

pub use args::{LoadArgs, WorkloadKind};
pub use error::LoadError;
pub use report::ReportArgs;
use workload::{Window, render_table, summarize};

use self::error::Result;

/// Runs `kvgate-bench load`.
pub fn run(args: LoadArgs) -> Result<()> {
    args.validate()?;
    init_tracing();
    let workload = args.workload()?;
    let client = client::Client::new(&args.url, args.model.clone(), args.timeout()?)
        .map_err(|e| LoadError::Config(e.to_string()))?
        .with_text_prompts(args.text_prompts);
    let plan = driver::Plan {
        speedup: args.speedup,
        time_scale: args.time_scale,
        run: args.run.clone(),
        load: Some(args.load_label(&workload)),
        deadline: args.deadline()?,
        max_requests: args.max_requests,
    };
    tracing::info!(
        workload = %workload.name,
        sessions = workload.sessions.len(),
        requests = workload.requests(),
        pacing = ?workload.pacing,
        url = %args.url,
        "starting"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| LoadError::Io {
            context: "starting the runtime".into(),
            source,
        })?;
    let counters = Arc::new(sink::Counters::default());
    let (sink, writer) = sink::open(args.out.as_deref(), Arc::clone(&counters))?;
    let drain = args.drain()?;
    let deadline = plan.deadline;
    let quiet = args.quiet;
    runtime.block_on(async move {
        let progress = (!quiet).then(|| tokio::spawn(progress::show(Arc::clone(&counters))));
        let drive = driver::drive(Arc::new(workload), client, sink, plan);
        let give_up = async {
            match deadline {
                Some(d) => tokio::time::sleep(d + drain).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = drive => {}
            () = give_up => tracing::warn!(in_flight = counters.in_flight(), "abandoning requests still in flight after --drain"),
            () = cli_support::shutdown_signal() => tracing::warn!(in_flight = counters.in_flight(), "interrupted: abandoning requests in flight"),
        }
        if let Some(p) = progress {
            p.abort();
            progress::clear();
        }
    });
    // Abandoned request tasks hold sinks; shutting the runtime down drops them.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    let records = writer.finish()?;
    // The window in record time (model time under --time-scale).
    let scale = 1_000.0 * args.time_scale;
    let warmup_ms = args.warmup()?.as_secs_f64() * scale;
    let window = match args.deadline()? {
        Some(d) => Window {
            from_ms: warmup_ms,
            to_ms: d.as_secs_f64() * scale,
        },
        None => Window {
            from_ms: warmup_ms,
            to_ms: Window::covering(&records).to_ms.max(warmup_ms),
        },
    };
    let summary = summarize(&records, window, args.slo());
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(render_table(std::slice::from_ref(&summary)).as_bytes());
    if let Some(path) = &args.out {
        tracing::info!(records = records.len(), path = %path.display(), "records written");
    }
    Ok(())
}

pub(crate) fn init_tracing() {
    cli_support::init_tracing();
}
