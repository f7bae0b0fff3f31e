//! Engine load scraping: one thread polls every endpoint's Prometheus `/metrics` round-robin
//! each interval, reads the queue, running and KV-cache gauges (`engine_metrics`) and records them in
//! the shared [`LoadBook`].
//!
//! Samples are stamped with the caller's clock (the one the scheduler reads freshness with).
//! The scraper never removes samples from the book: discovery does that when an endpoint leaves.
//! Each scrape's outcome also feeds the endpoints' health ([`health`]): one that cannot be
//! scraped a few times in a row is out of rotation until it can.

pub mod health;
mod http;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_index::{EndpointId, Millis};
use scheduler::LoadBook;

pub use engine_metrics::{Gauges, MAX_EXPOSITION, ParseError, parse_gauges};
pub use http::FetchError;

/// The gauges as the scheduler's load sample stamped `at`.
pub fn to_load(gauges: &Gauges, at: Millis) -> scheduler::EngineLoad {
    scheduler::EngineLoad {
        waiting: gauges.waiting_count(),
        running: gauges.running_count(),
        kv_usage: gauges.kv_usage_fraction(),
        at,
    }
}

/// How and how often endpoints are scraped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// Time from the start of one round over all endpoints to the start of the next.
    pub interval: Duration,
    /// Connect timeout per scrape.
    pub connect_timeout: Duration,
    /// Time allowed for the whole response once connected.
    pub read_timeout: Duration,
    /// The metrics path.
    pub path: String,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(200),
            connect_timeout: Duration::from_millis(100),
            read_timeout: Duration::from_millis(100),
            path: "/metrics".to_owned(),
        }
    }
}

/// Counters, for metrics.
#[derive(Debug, Default)]
pub struct ScrapeStats {
    /// Scrapes that produced a sample.
    pub ok: AtomicU64,
    /// Scrapes that failed (connect, HTTP, or exposition).
    pub failures: AtomicU64,
    /// Rounds over all endpoints completed.
    pub rounds: AtomicU64,
}

/// Why one scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The HTTP fetch failed.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The exposition could not be used.
    #[error(transparent)]
    Parse(#[from] ParseError),
}

/// The monotonic clock samples are stamped with.
pub type Clock = Arc<dyn Fn() -> Millis + Send + Sync>;

/// Scrapes `addr` once and returns its gauges stamped with `clock()` (read when the response
/// is complete).
pub fn scrape_once(
    addr: SocketAddr,
    config: &ScrapeConfig,
    clock: &dyn Fn() -> Millis,
) -> Result<scheduler::EngineLoad, ScrapeError> {
    let body = http::get(
        addr,
        &config.path,
        config.connect_timeout,
        config.read_timeout,
    )?;
    let gauges = parse_gauges(&body)?;
    Ok(to_load(&gauges, clock()))
}

type Targets = Arc<Mutex<Vec<(EndpointId, SocketAddr)>>>;

/// The scraping thread and its target list, kept in step with discovery by
/// [`Scraper::sync`]. Dropping it stops the thread.
pub struct Scraper {
    targets: Targets,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<ScrapeStats>,
    health: Arc<health::HealthBook>,
}

impl std::fmt::Debug for Scraper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scraper")
            .field("targets", &self.len())
            .field("running", &self.thread.is_some())
            .finish_non_exhaustive()
    }
}

impl Scraper {
    /// Starts the scraping thread (with no targets yet), recording into `book` with samples
    /// stamped by `clock`, and each scrape's outcome into `health`.
    pub fn new(
        book: Arc<LoadBook>,
        health: Arc<health::HealthBook>,
        clock: Clock,
        config: ScrapeConfig,
    ) -> Self {
        let targets: Targets = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let stats: Arc<ScrapeStats> = Arc::default();
        let (t, s, st) = (Arc::clone(&targets), Arc::clone(&stop), Arc::clone(&stats));
        let h = Arc::clone(&health);
        let thread = std::thread::Builder::new()
            .name("load-scraper".to_owned())
            .spawn(move || run(&t, &s, &st, (&book, &health), &*clock, &config))
            .map_err(|e| tracing::error!(error = %e, "cannot start the engine load scraper"))
            .ok();
        Self {
            targets,
            stop,
            thread,
            stats,
            health: h,
        }
    }

    /// The counters.
    pub fn stats(&self) -> Arc<ScrapeStats> {
        Arc::clone(&self.stats)
    }

    /// Replaces the endpoints scraped (their metrics addresses); takes effect from the next
    /// scrape.
    pub fn sync(&self, targets: Vec<(EndpointId, SocketAddr)>) {
        self.health
            .retain(&targets.iter().map(|(id, _)| *id).collect());
        *self.targets.lock().unwrap_or_else(PoisonError::into_inner) = targets;
    }

    /// Endpoints scraped.
    pub fn len(&self) -> usize {
        self.targets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether nothing is scraped.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

fn run(
    targets: &Mutex<Vec<(EndpointId, SocketAddr)>>,
    stop: &AtomicBool,
    stats: &ScrapeStats,
    (book, health): (&LoadBook, &health::HealthBook),
    clock: &dyn Fn() -> Millis,
    config: &ScrapeConfig,
) {
    let mut round = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        round.clone_from(&*targets.lock().unwrap_or_else(PoisonError::into_inner));
        for &(id, addr) in &round {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match scrape_once(addr, config, clock) {
                Ok(sample) => {
                    book.record(id, sample);
                    health.observe(id, addr, true);
                    stats.ok.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    health.observe(id, addr, false);
                    stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(endpoint = id.get(), %addr, error = %e, "engine load scrape failed");
                }
            }
        }
        stats.rounds.fetch_add(1, Ordering::Relaxed);
        let next = started + config.interval;
        loop {
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() || stop.load(Ordering::Relaxed) {
                break;
            }
            std::thread::park_timeout(left);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    const EXPOSITION: &str = "# HELP vllm:num_requests_waiting Waiting.\n\
        # TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
        vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.625\n";

    /// Serves `EXPOSITION` to every connection, alternating content-length and chunked framing.
    fn serve() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { continue };
                let mut req = Vec::new();
                let mut b = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut b) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => req.extend_from_slice(&b[..k]),
                    }
                }
                assert!(req.starts_with(b"GET /metrics HTTP/1.1\r\n"));
                let body = EXPOSITION.as_bytes();
                let resp = if n % 2 == 0 {
                    let mut r = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                         Content-Length: {}\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    r.extend_from_slice(body);
                    r
                } else {
                    let (a, rest) = body.split_at(10);
                    let mut r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
                    for part in [a, rest] {
                        r.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
                        r.extend_from_slice(part);
                        r.extend_from_slice(b"\r\n");
                    }
                    r.extend_from_slice(b"0\r\n\r\n");
                    r
                };
                // Dribble the response to exercise partial reads.
                for piece in resp.chunks(37) {
                    let _ = conn.write_all(piece);
                    let _ = conn.flush();
                }
            }
        });
        addr
    }

    fn ep(i: u32) -> EndpointId {
        EndpointId::new(i).unwrap()
    }

    #[test]
    fn scrape_once_reads_both_framings() {
        let addr = serve();
        let config = ScrapeConfig {
            read_timeout: Duration::from_secs(2),
            ..ScrapeConfig::default()
        };
        for _ in 0..2 {
            let load = scrape_once(addr, &config, &|| Millis(9)).unwrap();
            assert_eq!((load.waiting, load.running, load.kv_usage), (4, 2, 0.625));
            assert_eq!(load.at, Millis(9));
        }
    }

    #[test]
    fn scraper_records_into_the_book_and_counts_failures() {
        let addr = serve();
        // A port nothing listens on.
        let dead = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let book = Arc::new(LoadBook::new());
        let epoch = Instant::now();
        let clock: Clock =
            Arc::new(move || Millis(u64::try_from(epoch.elapsed().as_millis()).unwrap()));
        let config = ScrapeConfig {
            interval: Duration::from_millis(20),
            read_timeout: Duration::from_secs(1),
            ..ScrapeConfig::default()
        };
        let health = Arc::new(health::HealthBook::new(health::HealthConfig {
            fail_after: 2,
        }));
        let scraper = Scraper::new(
            Arc::clone(&book),
            Arc::clone(&health),
            Arc::clone(&clock),
            config,
        );
        scraper.sync(vec![(ep(1), addr), (ep(2), dead)]);
        assert_eq!(scraper.len(), 2);
        let stats = scraper.stats();
        let deadline = Instant::now() + Duration::from_secs(10);
        while (stats.ok.load(Ordering::Relaxed) < 3 || stats.failures.load(Ordering::Relaxed) < 2)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let sample = book
            .fresh(ep(1), clock(), Millis(5_000))
            .expect("a fresh sample");
        assert_eq!(
            (sample.waiting, sample.running, sample.kv_usage),
            (4, 2, 0.625)
        );
        assert!(book.fresh(ep(2), clock(), Millis(5_000)).is_none());
        // The dead endpoint is out of rotation, the live one in.
        assert_eq!(health.down_count(), 1);
        let eps = Arc::new(vec![
            scheduler::Endpoint::new(ep(1), addr),
            scheduler::Endpoint::new(ep(2), dead),
        ]);
        let ready: Vec<bool> = health.mask(eps).iter().map(|e| e.ready).collect();
        assert_eq!(ready, [true, false]);
        scraper.sync(vec![(ep(1), addr)]);
        assert_eq!(health.down_count(), 0, "a departed endpoint is forgotten");
        assert!(stats.ok.load(Ordering::Relaxed) >= 3);
        assert!(stats.failures.load(Ordering::Relaxed) >= 1);
        drop(scraper);
    }
}
