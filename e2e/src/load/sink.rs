//! Where records go: a JSON-lines file written on its own thread, the in-memory list the
//! summary is computed from, and the counters the progress line shows.

use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use workload::{RequestRecord, Status};

use super::error::LoadError;

/// Counts shared with the progress line.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests sent.
    pub sent: AtomicU64,
    /// Requests finished, any status.
    pub done: AtomicU64,
    /// Requests finished with a status other than ok.
    pub failed: AtomicU64,
}

impl Counters {
    /// Sent but not finished.
    pub fn in_flight(&self) -> u64 {
        self.sent
            .load(Ordering::Relaxed)
            .saturating_sub(self.done.load(Ordering::Relaxed))
    }
}

/// The sending half, cloned into every session task.
#[derive(Debug, Clone)]
pub struct Sink {
    tx: mpsc::Sender<RequestRecord>,
    counters: Arc<Counters>,
}

/// The writer thread; [`Writer::finish`] returns every record.
#[derive(Debug)]
pub struct Writer {
    handle: JoinHandle<Result<Vec<RequestRecord>, LoadError>>,
}

/// A sink writing to `out` (when given) and the writer that collects its records.
pub fn open(out: Option<&Path>, counters: Arc<Counters>) -> Result<(Sink, Writer), LoadError> {
    let file = out
        .map(|path| {
            std::fs::File::create(path)
                .map(|f| (path.to_path_buf(), BufWriter::new(f)))
                .map_err(|source| LoadError::Io {
                    context: format!("creating {}", path.display()),
                    source,
                })
        })
        .transpose()?;
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("records".into())
        .spawn(move || collect(&rx, file))
        .map_err(|source| LoadError::Io {
            context: "starting the record writer".into(),
            source,
        })?;
    Ok((Sink { tx, counters }, Writer { handle }))
}

fn collect(
    rx: &mpsc::Receiver<RequestRecord>,
    mut file: Option<(PathBuf, BufWriter<std::fs::File>)>,
) -> Result<Vec<RequestRecord>, LoadError> {
    let mut all = Vec::new();
    for record in rx {
        if let Some((path, w)) = &mut file {
            let io = |source| LoadError::Io {
                context: format!("writing {}", path.display()),
                source,
            };
            serde_json::to_writer(&mut *w, &record).map_err(|e| io(e.into()))?;
            w.write_all(b"\n").map_err(io)?;
        }
        all.push(record);
    }
    if let Some((path, mut w)) = file {
        w.flush().map_err(|source| LoadError::Io {
            context: format!("writing {}", path.display()),
            source,
        })?;
    }
    Ok(all)
}

impl Sink {
    /// A request is about to be sent.
    pub fn sent(&self) {
        self.counters.sent.fetch_add(1, Ordering::Relaxed);
    }

    /// A request finished.
    pub fn record(&self, record: RequestRecord) {
        if record.status != Status::Ok {
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.done.fetch_add(1, Ordering::Relaxed);
        // The writer outlives every sink unless it failed, and then its error is reported.
        let _ = self.tx.send(record);
    }
}

impl Writer {
    /// Waits for every sink to be dropped, then returns the records in arrival order.
    pub fn finish(self) -> Result<Vec<RequestRecord>, LoadError> {
        self.handle
            .join()
            .map_err(|_| LoadError::Internal("the record writer panicked"))?
    }
}
