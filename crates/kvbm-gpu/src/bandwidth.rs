//! The bandwidth benchmark behind `kvgate-kvbm-bandwidth`: the block manager's copy paths
//! against their baselines, in the same run.
//!
//! A batch is `blocks` kvgate blocks of a `layers × planes × plane_block_bytes` layout, taken
//! from a cache of twice as many blocks in runs of `run` consecutive blocks (an engine's
//! allocator hands out runs; a prefix spread over the cache is the common case), going to
//! consecutive host slots. Rows, each the median of `iterations`:
//!
//! - host: one `memcpy` of the batch's bytes (baseline); the plan executed by [`HostMover`]
//!   both ways (what a CPU engine's connector does).
//! - disk: the batch's bytes written and read back with `O_DIRECT` (the disk tier's path).
//! - CUDA, when a device opens: one `cuMemcpyAsync` of the batch's bytes between pinned host
//!   memory and the device (baseline, both ways); the plan's per-layer `cuMemcpy2DAsync`s.
//! - GDS, when cuFile opens: the batch's file read into the device with `cuFileRead`, against
//!   `O_DIRECT` into pinned memory followed by one host → device copy.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::cuda::{Cuda, CudaError, CudaMover};
use crate::gds::{Gds, GdsError};
use crate::layout::{DeviceLayout, LayoutError};
use crate::mover::{HostMover, OutOfBounds, enqueue};
use crate::plan::{BlockPair, Direction, PlanError, plan};

/// The alignment `O_DIRECT` needs (of buffers, offsets and lengths) on common file systems.
pub const DIRECT_ALIGN: usize = 4096;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Config {
    /// Attention layers.
    pub layers: u32,
    /// Planes per layer (2: K and V halves).
    pub planes: u32,
    /// Bytes of one block in one plane.
    pub plane_block_bytes: u64,
    /// Blocks per batch.
    pub blocks: u32,
    /// Consecutive engine blocks per run.
    pub run: u32,
    /// Timed repetitions per row (the median is reported).
    pub iterations: u32,
    /// Where the disk rows write their file (`None`: no disk rows).
    pub dir: Option<PathBuf>,
    /// The CUDA device to open.
    pub device: usize,
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// Bytes moved per repetition.
    pub bytes: u64,
    /// Median seconds per repetition.
    pub seconds: f64,
    /// `bytes / seconds`, in GB/s.
    pub gb_per_s: f64,
    /// The row this one is compared with, and the ratio of their bandwidths.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub versus: Option<(String, f64)>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Bytes per kvgate block.
    pub block_bytes: u64,
    /// Blocks per batch.
    pub blocks: u32,
    /// Copies the plan issues per batch (per direction).
    pub copies_per_batch: usize,
    /// The rows.
    pub rows: Vec<Row>,
    /// Paths that were not measured and why (no device, no cuFile, no `O_DIRECT`).
    pub skipped: Vec<String>,
}

/// Why the benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The layout is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The batch is invalid.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A host copy went out of bounds (a bug: the plan was checked).
    #[error(transparent)]
    Host(#[from] OutOfBounds),
    /// A CUDA call failed on a device that opened.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A GDS read failed with a driver that opened.
    #[error(transparent)]
    Gds(#[from] GdsError),
    /// The disk rows' file could not be written or read.
    #[error("disk I/O on {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The batch does not fit in memory addressable here.
    #[error("a batch of {0} bytes is too large for this machine")]
    TooLarge(u64),
}

/// The batch: engine block `(i / run) · 2 · run + i % run` to host slot `i`.
pub fn batch(blocks: u32, run: u32) -> Vec<BlockPair> {
    let run = run.max(1);
    (0..blocks)
        .map(|i| BlockPair {
            device_block: (i / run) * 2 * run + i % run,
            host_slot: i,
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn row(name: &str, bytes: u64, seconds: f64) -> Row {
    Row {
        name: name.to_owned(),
        bytes,
        seconds,
        gb_per_s: bytes as f64 / seconds / 1e9,
        versus: None,
    }
}

fn versus(mut r: Row, base: &Row) -> Row {
    r.versus = Some((base.name.clone(), r.gb_per_s / base.gb_per_s));
    r
}

fn timed(
    iterations: u32,
    mut f: impl FnMut() -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    f()?; // warm-up: first-touch page faults, lazy driver set-up
    let mut times = Vec::with_capacity(iterations as usize);
    for _ in 0..iterations.max(1) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

fn usize_of(bytes: u64) -> Result<usize, BenchError> {
    usize::try_from(bytes).map_err(|_| BenchError::TooLarge(bytes))
}

/// Runs every row this machine can run.
pub fn run(cfg: &Config) -> Result<Report, BenchError> {
    let cache_blocks = cfg
        .blocks
        .checked_mul(2)
        .and_then(|b| b.checked_add(cfg.run))
        .ok_or(BenchError::TooLarge(u64::from(cfg.blocks)))?;
    let layout = DeviceLayout::contiguous(
        0,
        cfg.layers,
        cfg.planes,
        cfg.plane_block_bytes,
        cache_blocks,
    )?;
    let pairs = batch(cfg.blocks, cfg.run);
    let the_plan = plan(&layout, &pairs, cfg.blocks)?;
    let bytes = the_plan.bytes();
    let batch_len = usize_of(bytes)?;
    let span = usize_of(layout.device_span())?;
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    tracing::info!(
        block_bytes = layout.block_bytes(),
        blocks = cfg.blocks,
        copies = the_plan.copies().count(),
        "measuring"
    );

    // Host rows.
    let src: Vec<u8> = (0..batch_len).map(|i| i as u8).collect();
    let mut dst = vec![0u8; batch_len];
    let memcpy = row(
        "host: one memcpy (baseline)",
        bytes,
        timed(cfg.iterations, || {
            dst.copy_from_slice(&src);
            Ok(())
        })?,
    );
    let mut cache = vec![1u8; span];
    let mut host = vec![0u8; batch_len];
    let gather = timed(cfg.iterations, || {
        let mut m = HostMover::new(0, &mut cache, &mut host);
        enqueue(&mut m, Direction::ToHost, &the_plan)?;
        Ok(())
    })?;
    let scatter = timed(cfg.iterations, || {
        let mut m = HostMover::new(0, &mut cache, &mut host);
        enqueue(&mut m, Direction::ToDevice, &the_plan)?;
        Ok(())
    })?;
    rows.push(versus(
        row("host: plan, cache → slots", bytes, gather),
        &memcpy,
    ));
    rows.push(versus(
        row("host: plan, slots → cache", bytes, scatter),
        &memcpy,
    ));
    rows.insert(0, memcpy);
    drop((cache, dst));

    // Disk rows.
    let file = match &cfg.dir {
        Some(dir) if batch_len % DIRECT_ALIGN == 0 => {
            let path = dir.join(format!("kvgate-kvbm-bandwidth-{}.bin", std::process::id()));
            match disk_rows(&path, &src, cfg.iterations) {
                Ok(r) => {
                    rows.extend(r);
                    Some(path)
                }
                Err(BenchError::Io { source, .. }) if source.raw_os_error() == Some(22) => {
                    let _ = std::fs::remove_file(&path);
                    skipped.push(format!("disk: {} refuses O_DIRECT", dir.display()));
                    None
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
            }
        }
        Some(_) => {
            skipped.push(format!(
                "disk: the batch ({bytes} bytes) is not a multiple of {DIRECT_ALIGN}, which O_DIRECT needs"
            ));
            None
        }
        None => None,
    };
    drop(src);

    // CUDA rows.
    let cuda_result = match Cuda::open(cfg.device) {
        Ok(cuda) => cuda_rows(&cuda, cfg, &layout, &the_plan, file.as_deref()).map(|(r, s)| {
            rows.extend(r);
            skipped.extend(s);
        }),
        Err(e) => {
            skipped.push(format!(
                "cuda: {}",
                cli_support::render(&e).trim_start_matches("error: ")
            ));
            Ok(())
        }
    };
    if let Some(path) = &file {
        let _ = std::fs::remove_file(path);
    }
    cuda_result?;
    Ok(Report {
        block_bytes: layout.block_bytes(),
        blocks: cfg.blocks,
        copies_per_batch: the_plan.copies().count(),
        rows,
        skipped,
    })
}

/// A `len`-byte, [`DIRECT_ALIGN`]-aligned region of a fresh vector (safe code: the vector is
/// over-allocated and the aligned window taken from it).
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let buf = vec![0u8; len + DIRECT_ALIGN];
    let misalign = buf.as_ptr() as usize % DIRECT_ALIGN;
    let start = (DIRECT_ALIGN - misalign) % DIRECT_ALIGN;
    (buf, start)
}

fn open_direct(path: &Path, write: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(!write)
        .write(write)
        .create(write)
        .truncate(write)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
}

fn disk_rows(path: &Path, data: &[u8], iterations: u32) -> Result<Vec<Row>, BenchError> {
    let io = |source| BenchError::Io {
        path: path.to_owned(),
        source,
    };
    let len = data.len();
    let (mut buf, start) = aligned(len);
    let window = buf
        .get_mut(start..start + len)
        .ok_or(BenchError::TooLarge(len as u64))?;
    window.copy_from_slice(data);
    let write = timed(iterations, || {
        let mut f = open_direct(path, true).map_err(io)?;
        f.write_all(window).map_err(io)
    })?;
    let read = timed(iterations, || {
        let mut f = open_direct(path, false).map_err(io)?;
        f.read_exact(window).map_err(io)
    })?;
    Ok(vec![
        row("disk: O_DIRECT write", len as u64, write),
        row("disk: O_DIRECT read", len as u64, read),
    ])
}

fn cuda_rows(
    cuda: &Cuda,
    cfg: &Config,
    layout: &DeviceLayout,
    the_plan: &crate::plan::Plan,
    file: Option<&Path>,
) -> Result<(Vec<Row>, Vec<String>), BenchError> {
    let bytes = the_plan.bytes();
    let batch_len = usize_of(bytes)?;
    let stream = cuda.stream()?;
    let mut device = cuda.alloc(&stream, usize_of(layout.device_span())?)?;
    let mut pinned = cuda.pinned(batch_len)?;
    let name = cuda.name()?;
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let sync = |stream: &cudarc::driver::CudaStream| {
        stream.synchronize().map_err(|source| CudaError::Driver {
            what: "cuStreamSynchronize",
            source,
        })
    };

    // Timed on the stream with events, so the figures are the copy engine's, not the host's:
    // `f` only enqueues.
    let on_stream =
        |pinned: &mut crate::cuda::PinnedBuffer,
         f: &mut dyn FnMut(&mut crate::cuda::PinnedBuffer) -> Result<(), BenchError>|
         -> Result<f64, BenchError> {
            f(pinned)?; // warm-up
            sync(&stream)?;
            let mut times = Vec::new();
            for _ in 0..cfg.iterations.max(1) {
                let start = cuda.timing_event(&stream)?;
                f(pinned)?;
                let end = cuda.timing_event(&stream)?;
                let ms = start.elapsed_ms(&end).map_err(|source| CudaError::Driver {
                    what: "cuEventElapsedTime",
                    source,
                })?;
                times.push(f64::from(ms) / 1e3);
            }
            Ok(median(times))
        };
    for (direction, label) in [
        (Direction::ToDevice, "host → device"),
        (Direction::ToHost, "device → host"),
    ] {
        let whole = on_stream(&mut pinned, &mut |p| {
            Ok(cuda.copy_whole(&stream, direction, p, &device, batch_len)?)
        })?;
        let planned = on_stream(&mut pinned, &mut |p| {
            let mut m = CudaMover::new(cuda, stream.clone(), p, &device);
            enqueue(&mut m, direction, the_plan)?;
            Ok(())
        })?;
        let base = row(
            &format!("{name}: {label}, one cuMemcpyAsync (baseline)"),
            bytes,
            whole,
        );
        let r = row(
            &format!("{name}: {label}, plan (per-layer cuMemcpy2DAsync)"),
            bytes,
            planned,
        );
        rows.push(base.clone());
        rows.push(versus(r, &base));
    }
    sync(&stream)?;

    match (file, Gds::open(cuda)) {
        (Some(path), Ok(gds)) => {
            let io = |source| BenchError::Io {
                path: path.to_owned(),
                source,
            };
            // Both host-synchronous, so timed by the clock: each opens the file, reads the
            // batch into device memory and returns once it is there.
            let staged = timed(cfg.iterations, || {
                let mut f = open_direct(path, false).map_err(io)?;
                f.read_exact(pinned.as_mut_slice()).map_err(io)?;
                cuda.copy_whole(
                    &stream,
                    Direction::ToDevice,
                    &mut pinned,
                    &device,
                    batch_len,
                )?;
                sync(&stream)?;
                Ok(())
            })?;
            let direct = timed(cfg.iterations, || {
                let registered = gds.register(open_direct(path, false).map_err(io)?)?;
                let n = registered.read(0, &mut device, batch_len)?;
                if n != batch_len {
                    return Err(BenchError::Io {
                        path: path.to_owned(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!("cuFileRead returned {n} of {batch_len} bytes"),
                        ),
                    });
                }
                Ok(())
            })?;
            let base = row(
                "disk → device: O_DIRECT + one host → device copy (baseline)",
                bytes,
                staged,
            );
            rows.push(base.clone());
            rows.push(versus(
                row(
                    "disk → device: cuFileRead (unregistered buffer)",
                    bytes,
                    direct,
                ),
                &base,
            ));
        }
        (None, _) => skipped.push("gds: no disk rows to compare with".to_owned()),
        (_, Err(e)) => skipped.push(format!("gds: {e}")),
    }
    Ok((rows, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_takes_runs_with_gaps_between_them() {
        let b = batch(6, 2);
        let blocks: Vec<u32> = b.iter().map(|p| p.device_block).collect();
        assert_eq!(blocks, vec![0, 1, 4, 5, 8, 9]);
        assert!(b.iter().enumerate().all(|(i, p)| p.host_slot == i as u32));
    }

    #[test]
    fn a_small_run_measures_the_host_and_disk_rows_and_names_what_it_skipped() {
        let dir = std::env::temp_dir();
        let cfg = Config {
            layers: 4,
            planes: 2,
            plane_block_bytes: 512,
            blocks: 16,
            run: 4,
            iterations: 2,
            dir: Some(dir),
            device: 0,
        };
        let r = run(&cfg).expect("runs");
        assert_eq!(r.block_bytes, 4 * 2 * 512);
        // 4 runs × 4 layers × 2 planes.
        assert_eq!(r.copies_per_batch, 32);
        let names: Vec<&str> = r.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names[0], "host: one memcpy (baseline)");
        assert!(names.contains(&"host: plan, cache → slots"));
        assert!(
            r.rows
                .iter()
                .all(|r| r.gb_per_s > 0.0 && r.bytes == 16 * 4096)
        );
        let disk = names.iter().any(|n| n.starts_with("disk:"));
        let refused = r.skipped.iter().any(|s| s.contains("O_DIRECT"));
        assert!(disk ^ refused, "{names:?} {:?}", r.skipped);
        if Cuda::open(0).is_err() {
            assert!(
                r.skipped.iter().any(|s| s.starts_with("cuda: ")),
                "{:?}",
                r.skipped
            );
        }
    }
}
