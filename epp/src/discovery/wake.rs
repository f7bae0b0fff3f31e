//! Wakes the discovery thread when there is something to install, instead of leaving it to
//! its next tick: a Kubernetes change reaches the routing table as soon as the watch delivers
//! it.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// A level-triggered wake-up: [`notify`](Wake::notify) sets it, [`wait`](Wake::wait) clears it.
#[derive(Debug, Default)]
pub struct Wake {
    pending: Mutex<bool>,
    cond: Condvar,
}

impl Wake {
    /// Marks work pending and wakes the waiter.
    pub fn notify(&self) {
        *self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.cond.notify_all();
    }

    /// Waits until notified or `timeout` passes; returns whether it was notified. A
    /// notification that came before the call returns at once.
    pub fn wait(&self, timeout: Duration) -> bool {
        let guard = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut pending, _) = self
            .cond
            .wait_timeout_while(guard, timeout, |pending| !*pending)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut *pending)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_notification_is_kept_until_taken_and_wakes_a_waiter() {
        let w = Wake::default();
        assert!(!w.wait(Duration::from_millis(1)));
        w.notify();
        assert!(w.wait(Duration::from_secs(10)), "kept until taken");
        assert!(!w.wait(Duration::from_millis(1)), "taken once");
        let w = Arc::new(w);
        let t = {
            let w = Arc::clone(&w);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                w.notify();
            })
        };
        let start = Instant::now();
        assert!(w.wait(Duration::from_secs(10)));
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
    }
}
