//! Finishing early-stopped prompts off the request path.
//!
//! Keying stops at the first chunk no endpoint holds (see `keys.rs`), so the rest of that
//! prompt is never tokenized on the request path. Once the engine has served it, the
//! conversation's next turn resends that text and finds it held, so it would tokenize it there
//! instead. One background thread per keyer walks each stopped prompt to its end through the
//! segment cache (chunks already tokenized are hits), so the next turn finds every chunk cached.
//!
//! The finisher competes for the CPU with the request path (and, in a small pod, with Envoy and
//! the engine), so it is held back three ways ([`FinishConfig`]):
//! - the queue is bounded ([`QUEUE`] prompts); when it is full the prompt is dropped (the next
//!   turn then tokenizes it on its request path, as without the finisher), so an overload sheds
//!   this work first;
//! - an optional byte budget (a token bucket, `budget.rs`) bounds the text it takes per second;
//!   a prompt over budget is dropped the same way;
//! - its thread runs at a low scheduling priority (a `nice` value), so it takes CPU time the
//!   request path leaves idle.
//!
//! Both checks come before the prompt's text is copied, so a dropped prompt costs no copy.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokenize::EncodeCursor;

use super::budget::ByteBudget;
use super::keys::ModelTokenizer;

/// Prompts waiting to be finished, at most.
pub const QUEUE: usize = 8;

/// The finisher thread's default `nice` value: the lowest priority.
pub const DEFAULT_NICE: i32 = 19;

/// How much of the CPU the finisher may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishConfig {
    /// Whether early-stopped prompts are finished at all.
    pub enabled: bool,
    /// Most bytes of prompt text taken per second (a token bucket holding one second's worth);
    /// `None`: no budget beyond the queue bound.
    pub bytes_per_second: Option<u64>,
    /// The thread's `nice` value (−20 to 19; at 19 it gets about 1.5% of a CPU contended by a
    /// default-priority thread, so it runs mostly on idle time; below 0 needs privileges).
    pub nice: i32,
}

impl Default for FinishConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            bytes_per_second: None,
            nice: DEFAULT_NICE,
        }
    }
}

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
    /// Prompts dropped because the byte budget was spent.
    pub over_budget: AtomicU64,
    /// Bytes of text tokenized in the background (cache misses).
    pub tokenized_bytes: AtomicU64,
}

/// The handle to the background thread; dropping it ends the thread once the queue drains.
#[derive(Debug)]
pub struct Finisher {
    tx: SyncSender<Job>,
    /// Prompts queued or being received, at most [`QUEUE`]; checked before a text is copied.
    queued: Arc<AtomicUsize>,
    budget: Option<Mutex<ByteBudget>>,
    /// The budget's clock.
    epoch: Instant,
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
    /// Starts the thread as `config` says; `None` when disabled, or (logged) when the OS
    /// refuses a thread.
    pub fn start(config: FinishConfig) -> Option<Self> {
        if !config.enabled {
            tracing::info!("finishing early-stopped prompts in the background is off");
            return None;
        }
        let (tx, rx) = sync_channel(QUEUE);
        let stats = Arc::new(FinishStats::default());
        let queued = Arc::new(AtomicUsize::new(0));
        let (worker_stats, worker_queued) = (Arc::clone(&stats), Arc::clone(&queued));
        let nice = config.nice;
        match std::thread::Builder::new()
            .name("kvgate-finish-prompts".to_owned())
            .spawn(move || {
                lower_priority(nice);
                run(&rx, &worker_queued, &worker_stats);
            }) {
            Ok(_) => Some(Self {
                tx,
                queued,
                budget: config
                    .bytes_per_second
                    .map(|rate| Mutex::new(ByteBudget::new(rate, 0))),
                epoch: Instant::now(),
                stats,
            }),
            Err(e) => {
                tracing::warn!(error = %e, "no background thread to finish early-stopped prompts");
                None
            }
        }
    }

    /// Queues the rest of `cursor`'s prompt (a rendered chat when `chat`, else a completions
    /// prompt) to be walked to its end through `model`'s cache. Drops it, before copying its
    /// text, when the queue is full or the byte budget is spent.
    pub fn submit(
        &self,
        model: Arc<ModelTokenizer>,
        cursor: EncodeCursor<'_>,
        chat: bool,
        chunk_bytes: usize,
    ) {
        let reserved = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < QUEUE).then_some(q + 1)
            })
            .is_ok();
        if !reserved {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let rest = cursor.text().len().saturating_sub(cursor.consumed_bytes());
        if !self.within_budget(rest) {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.stats.over_budget.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let job = Job::Finish {
            model,
            text: cursor.into_text(),
            chat,
            chunk_bytes,
        };
        if self.tx.try_send(job).is_err() {
            // A flush holds the slot, or the thread is gone.
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Charges `bytes` to the budget, if there is one; false when it is spent.
    fn within_budget(&self, bytes: usize) -> bool {
        let Some(budget) = &self.budget else {
            return true;
        };
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
        match budget.lock() {
            Ok(mut b) => b.try_take(now, bytes),
            // A panic elsewhere while holding the lock: finish nothing more.
            Err(_) => false,
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

/// Sets the calling thread's `nice` value (Linux: per thread); logs when it cannot.
fn lower_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        let tid = rustix::thread::gettid();
        match rustix::process::setpriority_process(Some(tid), nice) {
            Ok(()) => tracing::debug!(nice, "prompt finisher priority set"),
            Err(e) => {
                tracing::warn!(nice, error = %e, "cannot set the prompt finisher's priority");
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    tracing::debug!(
        nice,
        "thread priorities are only set on Linux; the prompt finisher keeps the default"
    );
}

fn run(rx: &Receiver<Job>, queued: &AtomicUsize, stats: &FinishStats) {
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
                queued.fetch_sub(1, Ordering::AcqRel);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use tokenize::TextTokenizer;

    fn model() -> Arc<ModelTokenizer> {
        Arc::new(ModelTokenizer::new(TextTokenizer::fallback(), 1 << 20))
    }

    fn submit(f: &Finisher, model: &Arc<ModelTokenizer>, text: &str) {
        let cursor = model.tokenizer().prompt_cursor(text, None, 64).unwrap();
        f.submit(Arc::clone(model), cursor, false, 64);
    }

    fn count(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    #[test]
    fn disabled_starts_no_thread() {
        let config = FinishConfig {
            enabled: false,
            ..FinishConfig::default()
        };
        assert!(Finisher::start(config).is_none());
    }

    #[test]
    fn prompts_over_the_byte_budget_are_dropped() {
        let f = Finisher::start(FinishConfig {
            bytes_per_second: Some(10),
            ..FinishConfig::default()
        })
        .unwrap();
        let m = model();
        let text = "x".repeat(1000);
        // A full bucket admits one overdraft; the 990 bytes of debt take 99 s to repay.
        submit(&f, &m, &text);
        submit(&f, &m, &text);
        f.wait_idle();
        assert_eq!(count(&f.stats().finished), 1);
        assert_eq!(count(&f.stats().over_budget), 1);
        assert_eq!(count(&f.stats().dropped), 0);
    }

    #[test]
    fn a_full_queue_drops_prompts_and_frees_room_as_they_finish() {
        let f = Finisher::start(FinishConfig::default()).unwrap();
        let m = model();
        // Hold the thread: it blocks answering this flush until the test receives. Until it
        // takes the flush, the flush also holds a channel slot.
        let (tx, rx) = sync_channel(0);
        f.tx.send(Job::Flush(tx)).unwrap();
        for _ in 0..QUEUE + 2 {
            submit(&f, &m, "some prompt text to finish");
        }
        rx.recv().unwrap();
        f.wait_idle();
        let finished = count(&f.stats().finished);
        let dropped = count(&f.stats().dropped);
        let queue = u64::try_from(QUEUE).unwrap();
        assert_eq!(finished + dropped, queue + 2);
        assert!(
            finished == queue || finished == queue - 1,
            "{finished} finished"
        );
        // Room again once the queue drained.
        submit(&f, &m, "one more");
        f.wait_idle();
        assert_eq!(count(&f.stats().finished), finished + 1);
    }
}
