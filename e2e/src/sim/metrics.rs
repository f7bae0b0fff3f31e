//! `GET /metrics`: vLLM's metric names (so the sidecar, the EPP and GIE dashboards read the
//! simulator as they read vLLM) plus the simulator's own `kvgate_sim_*` counters.
//!
//! Latencies are observed in the engine's *model* time (wall time × time scale), so a simulator
//! running faster than real time still reports the latencies the modelled GPU would have.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use engine_model::EngineStats;

use super::driver::LagStats;
use super::publisher::PublisherStats;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds).
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets (seconds), used for e2e and queue time.
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b)
            && let Some(c) = self.counts.get_mut(i)
        {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

/// Why a request finished, as vLLM labels `vllm:request_success_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// EOS.
    Stop,
    /// Aborted by the client.
    Abort,
}

/// Per-request timings, in model seconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestTimings {
    /// Arrival → first token.
    pub ttft: Option<f64>,
    /// Arrival → scheduled.
    pub queue: Option<f64>,
    /// Arrival → last token.
    pub e2e: f64,
}

/// The simulator's metrics.
#[derive(Debug)]
pub struct SimMetrics {
    labels: String,
    cache_config: String,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    e2e: Mutex<Histogram>,
    queue: Mutex<Histogram>,
    finished: [AtomicU64; 3],
    /// Requests refused because the waiting queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Requests refused as invalid (4xx other than 404).
    pub rejected_invalid: AtomicU64,
    /// Errors injected by the fault configuration.
    pub faults_injected: AtomicU64,
    /// Streams stalled by the fault configuration.
    pub stalls_injected: AtomicU64,
}

impl SimMetrics {
    /// Metrics for a served model with vLLM's `cache_config_info` labels.
    pub fn new(model: &str, block_size: u32, num_gpu_blocks: u32, prefix_caching: bool) -> Self {
        let model = model.replace(['\\', '"', '\n'], "_");
        Self {
            labels: format!("engine=\"0\",model_name=\"{model}\""),
            cache_config: format!(
                "block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",\
                 engine=\"0\",num_gpu_blocks=\"{num_gpu_blocks}\"",
                if prefix_caching { "True" } else { "False" }
            ),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
            e2e: Mutex::new(Histogram::new(REQUEST_BUCKETS)),
            queue: Mutex::new(Histogram::new(REQUEST_BUCKETS)),
            finished: Default::default(),
            rejected_queue_full: AtomicU64::new(0),
            rejected_invalid: AtomicU64::new(0),
            faults_injected: AtomicU64::new(0),
            stalls_injected: AtomicU64::new(0),
        }
    }

    /// Records one inter-token gap.
    pub fn observe_itl(&self, seconds: f64) {
        if let Ok(mut h) = self.itl.lock() {
            h.observe(seconds);
        }
    }

    /// Records a finished request.
    pub fn observe_finished(&self, finish: Finish, t: RequestTimings) {
        if let Some(c) = self.finished.get(finish as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if let (Some(ttft), Ok(mut h)) = (t.ttft, self.ttft.lock()) {
            h.observe(ttft);
        }
        if let (Some(q), Ok(mut h)) = (t.queue, self.queue.lock()) {
            h.observe(q);
        }
        if let Ok(mut h) = self.e2e.lock() {
            h.observe(t.e2e);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(
        &self,
        s: &EngineStats,
        publisher: Option<&PublisherStats>,
        lag: &LagStats,
    ) -> String {
        let l = &self.labels;
        let mut out = String::with_capacity(8 << 10);
        let mut gauge = |name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v:?}"
            );
        };
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            f64::from(s.running),
        );
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            f64::from(s.waiting),
        );
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_usage,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{}}} 1.0",
            self.cache_config
        );
        let mut counter = |name: &str, help: &str, v: u64, extra: &str| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}_total{{{l}{extra}}} {v}.0"
            );
        };
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
            "",
        );
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
            "",
        );
        counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
            "",
        );
        counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens,
            "",
        );
        counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
            "",
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success Count of successfully processed requests.\n\
             # TYPE vllm:request_success counter"
        );
        for (i, reason) in ["length", "stop", "abort"].iter().enumerate() {
            let v = self
                .finished
                .get(i)
                .map_or(0, |c| c.load(Ordering::Relaxed));
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {v}.0"
            );
        }
        let hist = |out: &mut String, h: &Mutex<Histogram>, name: &str, help: &str| {
            if let Ok(h) = h.lock() {
                h.render(out, name, help, l);
            }
        };
        hist(
            &mut out,
            &self.ttft,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        );
        hist(
            &mut out,
            &self.itl,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
        );
        hist(
            &mut out,
            &self.e2e,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
        );
        hist(
            &mut out,
            &self.queue,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        );
        gauge_own(
            &mut out,
            "kvgate_sim_cached_blocks",
            "Blocks holding a cached hash (in use or free).",
            u64::from(s.cached_blocks),
        );
        gauge_own(
            &mut out,
            "kvgate_sim_distinct_cached_blocks",
            "Distinct hashes among the cached blocks: what the KV events leave in a router's index.",
            u64::from(s.distinct_cached_blocks),
        );
        gauge_own(
            &mut out,
            "kvgate_sim_host_blocks",
            "Blocks in the KV offloading host tier (0 when --kv-offloading-size is 0).",
            u64::from(s.host_blocks),
        );
        let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(
            out,
            "# HELP kvgate_sim_step_lag_seconds Wall time by which steps were delivered late \
             (the simulator could not keep up with its model).\n\
             # TYPE kvgate_sim_step_lag_seconds summary\n\
             kvgate_sim_step_lag_seconds_sum {}\nkvgate_sim_step_lag_seconds_count {}\n\
             # HELP kvgate_sim_step_lag_max_seconds Largest step-delivery lag.\n\
             # TYPE kvgate_sim_step_lag_max_seconds gauge\nkvgate_sim_step_lag_max_seconds {}",
            secs(&lag.sum_ns),
            lag.steps.load(Ordering::Relaxed),
            secs(&lag.max_ns),
        );
        let mut own = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        own(
            "kvgate_sim_host_hit_tokens_total",
            "Prompt tokens loaded from the KV offloading host tier instead of computed.",
            s.host_hit_tokens,
        );
        own(
            "kvgate_sim_rejected_queue_full_total",
            "Requests refused because the waiting queue was full.",
            self.rejected_queue_full.load(Ordering::Relaxed),
        );
        own(
            "kvgate_sim_rejected_invalid_total",
            "Requests refused as invalid.",
            self.rejected_invalid.load(Ordering::Relaxed),
        );
        own(
            "kvgate_sim_faults_injected_total",
            "Error responses injected by the fault configuration.",
            self.faults_injected.load(Ordering::Relaxed),
        );
        own(
            "kvgate_sim_stalls_injected_total",
            "Streams stalled by the fault configuration.",
            self.stalls_injected.load(Ordering::Relaxed),
        );
        if let Some(p) = publisher {
            own(
                "kvgate_sim_kv_event_batches_published_total",
                "KV-event batches sent on the PUB socket.",
                p.published.load(Ordering::Relaxed),
            );
            own(
                "kvgate_sim_kv_event_batches_dropped_total",
                "KV-event batches dropped because the publisher queue was full.",
                p.dropped.load(Ordering::Relaxed),
            );
            own(
                "kvgate_sim_kv_event_replays_total",
                "Replay requests answered.",
                p.replays.load(Ordering::Relaxed),
            );
        }
        out
    }
}

fn gauge_own(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.7, 9.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "help", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"1.0\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"2.0\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_count{a=\"b\"} 4\n"), "{out}");
    }

    #[test]
    fn renders_vllm_names() {
        let m = SimMetrics::new("m\"x", 16, 100, true);
        m.observe_finished(
            Finish::Length,
            RequestTimings {
                ttft: Some(0.1),
                queue: Some(0.0),
                e2e: 1.0,
            },
        );
        let stats = EngineStats {
            running: 3,
            waiting: 2,
            kv_usage: 0.5,
            prefix_cache_queries: 10,
            prefix_cache_hits: 4,
            ..EngineStats::default()
        };
        let text = m.render(&stats, None, &LagStats::default());
        for want in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"m_x\"} 3.0",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m_x\"} 2.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m_x\"} 0.5",
            "num_gpu_blocks=\"100\"",
            "block_size=\"16\"",
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m_x\"} 10.0",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m_x\"} 4.0",
            "finished_reason=\"length\"} 1.0",
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m_x\"} 1",
        ] {
            assert!(text.contains(want), "missing {want}\n{text}");
        }
    }
}
