//! Whether the KV-event stream is live, for readiness (`--require-kv-events`).
//!
//! Live means: the NATS connection is up (events can leave the pod) and every rank's ZMQ receive
//! thread is running (events can arrive). A ZMQ subscriber cannot tell an idle engine from a
//! silent one, so the engine's own liveness stays with the `/health` poller; a gap in the
//! engine's sequence is repaired by replay or a published resync and does not make the pod
//! unready. A watcher task samples both inputs and sets [`Readiness::set_kv_events_live`],
//! logging every change.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::health::Readiness;

/// The decision, pure: NATS connected and all `ranks` receive threads running.
#[must_use]
pub fn is_live(nats_connected: bool, running: usize, ranks: usize) -> bool {
    nats_connected && running >= ranks && ranks > 0
}

/// Counts running receive threads; a [`RunningGuard`] holds one count for a thread's lifetime.
#[derive(Debug, Clone, Default)]
pub struct Running(Arc<AtomicUsize>);

impl Running {
    /// Counts one more running thread until the guard drops (also on a panic's unwind).
    #[must_use]
    pub fn enter(&self) -> RunningGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        RunningGuard(Arc::clone(&self.0))
    }

    /// Threads running now.
    #[must_use]
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// One running thread's count.
#[derive(Debug)]
pub struct RunningGuard(Arc<AtomicUsize>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Samples NATS and the receive threads every `every` and updates `readiness`, until aborted.
pub async fn watch(
    client: async_nats::Client,
    running: Running,
    ranks: usize,
    readiness: Readiness,
    every: Duration,
) {
    let mut was = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let connected = client.connection_state() == async_nats::connection::State::Connected;
        let threads = running.get();
        let live = is_live(connected, threads, ranks);
        if was != Some(live) {
            if live {
                tracing::info!(
                    ranks,
                    "KV-event stream live: NATS connected, every rank subscribed"
                );
            } else {
                tracing::warn!(
                    nats_connected = connected,
                    receive_threads = threads,
                    ranks,
                    "KV-event stream down"
                );
            }
            was = Some(live);
        }
        readiness.set_kv_events_live(live);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn live_needs_nats_and_every_rank() {
        assert!(is_live(true, 2, 2));
        assert!(!is_live(false, 2, 2), "NATS down");
        assert!(!is_live(true, 1, 2), "a rank's thread ended");
        assert!(!is_live(true, 0, 0), "no ranks is not a stream");
    }

    #[test]
    fn guards_count_threads_while_they_live() {
        let r = Running::default();
        let a = r.enter();
        let b = r.enter();
        assert_eq!(r.get(), 2);
        drop(a);
        assert_eq!(r.get(), 1);
        let t = std::thread::spawn({
            let r = r.clone();
            move || {
                let _g = r.enter();
                panic!("receive thread failed");
            }
        });
        assert!(t.join().is_err());
        assert_eq!(r.get(), 1, "a panicking thread's count is released");
        drop(b);
        assert_eq!(r.get(), 0);
    }
}
