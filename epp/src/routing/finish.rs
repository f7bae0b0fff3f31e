//! Finishing early-stopped prompts off the request path.
//!
//! Keying stops at the first chunk no endpoint holds (see `keys.rs`), so the rest of that
//! prompt is never tokenized on the request path. Once the engine has served it, the
//! conversation's next turn resends that text and finds it held, so it would tokenize it there
//! instead. One background thread per keyer walks each stopped prompt to its end through the
//! segment cache (chunks already tokenized are hits), so the next turn finds every chunk cached.
//!
//! The queue is bounded ([`QUEUE`] prompts); when it is full the prompt is dropped (the next
//! turn then tokenizes it on its request path, as without the finisher), so an overload sheds
//! this work first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use super::keys::ModelTokenizer;

/// Prompts waiting to be finished, at most.
pub const QUEUE: usize = 8;

/// One prompt to finish: its tokenizer and cache, the text and whether it is a rendered chat.
enum Job {
    Finish {
        model: Arc<ModelTokenizer>,
        text: String,
        chat: bool,
        chunk_bytes: usize,
    },
    /// Answers once every earlier job is done.
    Flush(SyncSender<()>),
}

/// Counts of the finisher's work.
#[derive(Debug, Default)]
pub struct FinishStats {
    /// Prompts finished in the background.
    pub finished: AtomicU64,
    /// Prompts dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Bytes of text tokenized in the background (cache misses).
    pub tokenized_bytes: AtomicU64,
}

/// The handle to the background thread; dropping it ends the thread once the queue drains.
#[derive(Debug)]
pub struct Finisher {
    tx: SyncSender<Job>,
    stats: Arc<FinishStats>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Finish { text, chat, .. } => f
                .debug_struct("Finish")
                .field("bytes", &text.len())
                .field("chat", chat)
                .finish_non_exhaustive(),
            Job::Flush(_) => f.write_str("Flush"),
        }
    }
}

impl Finisher {
    /// Starts the thread; `None` (logged) when the OS refuses one.
    pub fn start() -> Option<Self> {
        let (tx, rx) = sync_channel(QUEUE);
        let stats = Arc::new(FinishStats::default());
        let worker_stats = Arc::clone(&stats);
        match std::thread::Builder::new()
            .name("kvgate-finish-prompts".to_owned())
            .spawn(move || run(&rx, &worker_stats))
        {
            Ok(_) => Some(Self { tx, stats }),
            Err(e) => {
                tracing::warn!(error = %e, "no background thread to finish early-stopped prompts");
                None
            }
        }
    }

    /// Queues `text` (a rendered chat when `chat`, else a completions prompt) to be walked to
    /// its end through `model`'s cache; drops it when the queue is full.
    pub fn submit(&self, model: Arc<ModelTokenizer>, text: String, chat: bool, chunk_bytes: usize) {
        let job = Job::Finish {
            model,
            text,
            chat,
            chunk_bytes,
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(job) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until every prompt queued before the call is finished (tests and benchmarks).
    pub fn wait_idle(&self) {
        let (tx, rx) = sync_channel(1);
        if self.tx.send(Job::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// The counters.
    pub fn stats(&self) -> &FinishStats {
        &self.stats
    }
}

fn run(rx: &Receiver<Job>, stats: &FinishStats) {
    for job in rx {
        match job {
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Finish {
                model,
                text,
                chat,
                chunk_bytes,
            } => {
                let tok = model.tokenizer();
                let cache = Some(model.cache());
                let cursor = if chat {
                    tok.rendered_chat_cursor(&text, cache, chunk_bytes)
                } else {
                    tok.prompt_cursor(&text, cache, chunk_bytes)
                };
                let Ok(mut cursor) = cursor else { continue };
                let mut ids = Vec::new();
                while let Some(n) = cursor.next_into(&mut ids) {
                    if n.is_err() {
                        break;
                    }
                    ids.clear();
                }
                let miss = cursor.outcome().miss_bytes;
                stats
                    .tokenized_bytes
                    .fetch_add(u64::try_from(miss).unwrap_or(u64::MAX), Ordering::Relaxed);
                stats.finished.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
