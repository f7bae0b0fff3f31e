//! The live progress line on stderr: requests done, in flight, failed, and the completion rate
//! over the last second. On a terminal it is rewritten in place about once a second; otherwise
//! a line is printed every ten seconds.

use std::io::{IsTerminal as _, Write as _};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::sink::Counters;

/// Shows progress until aborted.
pub async fn show(counters: Arc<Counters>) {
    let tty = std::io::stderr().is_terminal();
    let period = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(10)
    };
    let start = Instant::now();
    let mut last = (Instant::now(), 0u64);
    let mut tick = tokio::time::interval(period);
    tick.tick().await;
    loop {
        tick.tick().await;
        let done = counters.done.load(Ordering::Relaxed);
        let now = Instant::now();
        let rate =
            (done - last.1.min(done)) as f64 / now.duration_since(last.0).as_secs_f64().max(1e-3);
        last = (now, done);
        let line = format!(
            "{:>6.0}s  done {done}  in flight {}  failed {}  {rate:.1} req/s",
            start.elapsed().as_secs_f64(),
            counters.in_flight(),
            counters.failed.load(Ordering::Relaxed),
        );
        let mut err = std::io::stderr().lock();
        let _ = if tty {
            write!(err, "\r\x1b[2K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }
}

/// Ends the in-place line, if any.
pub fn clear() {
    if std::io::stderr().is_terminal() {
        let _ = writeln!(std::io::stderr().lock());
    }
}
