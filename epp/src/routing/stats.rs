//! Per-request metrics under GIE's names (`inference_objective_*`, `inference_extension_*`), so
//! dashboards built for the reference EPP work unchanged, plus kvgate's decision histogram.
//!
//! Series are keyed by (requested model, served model). Model names come from requests, so
//! each is admitted through a [`LabelCap`]; past the cap they fold into `other`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use telemetry::{Exposition, Histogram, Kind, LabelCap, buckets};

/// Distinct model names admitted as label values.
const MODEL_LABEL_CAP: usize = 64;

/// Why a request failed, as GIE's `error_code` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// 400 from the EPP.
    BadRequest,
    /// 413 from the EPP.
    PayloadTooLarge,
    /// 429 from the EPP.
    ResourceExhausted,
    /// 503 from the EPP.
    ServiceUnavailable,
    /// The model server answered with a non-2xx status.
    ModelServerError,
    /// The stream ended before the response completed.
    Aborted,
}

impl ErrorCode {
    const ALL: [ErrorCode; 6] = [
        ErrorCode::BadRequest,
        ErrorCode::PayloadTooLarge,
        ErrorCode::ResourceExhausted,
        ErrorCode::ServiceUnavailable,
        ErrorCode::ModelServerError,
        ErrorCode::Aborted,
    ];

    fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "BadRequest",
            ErrorCode::PayloadTooLarge => "PayloadTooLarge",
            ErrorCode::ResourceExhausted => "ResourceExhausted",
            ErrorCode::ServiceUnavailable => "ServiceUnavailable",
            ErrorCode::ModelServerError => "ModelServerError",
            ErrorCode::Aborted => "Aborted",
        }
    }
}

/// One (model, target model) series.
#[derive(Debug)]
pub struct Series {
    requests: AtomicU64,
    errors: [AtomicU64; 6],
    running: AtomicI64,
    duration: Histogram,
    ttft: Histogram,
    tpot: Histogram,
    input_tokens: Histogram,
    output_tokens: Histogram,
    cached_tokens: Histogram,
    request_sizes: Histogram,
}

impl Series {
    fn new() -> Self {
        Self {
            requests: AtomicU64::new(0),
            errors: Default::default(),
            running: AtomicI64::new(0),
            duration: Histogram::new(buckets::SECONDS),
            ttft: Histogram::new(buckets::SECONDS),
            tpot: Histogram::new(buckets::TOKEN_SECONDS),
            input_tokens: Histogram::new(buckets::TOKENS),
            output_tokens: Histogram::new(buckets::TOKENS),
            cached_tokens: Histogram::new(buckets::TOKENS),
            request_sizes: Histogram::new(buckets::BYTES),
        }
    }

    /// A request was routed.
    pub fn on_routed(&self, body_bytes: usize) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.running.fetch_add(1, Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)]
        self.request_sizes.observe(body_bytes as f64);
    }

    /// A routed request completed.
    pub fn on_completed(&self, done: &Completed) {
        self.running.fetch_sub(1, Ordering::Relaxed);
        self.duration.observe_duration(done.duration);
        if let Some(ttft) = done.ttft {
            self.ttft.observe_duration(ttft);
        }
        if let Some((prompt, completion, cached)) = done.usage {
            self.input_tokens.observe(f64::from(prompt));
            self.output_tokens.observe(f64::from(completion));
            if let Some(c) = cached {
                self.cached_tokens.observe(f64::from(c));
            }
            if let Some(itl) = done.itl_seconds() {
                self.tpot.observe(itl);
            }
        }
        if !(200..300).contains(&done.status) {
            self.error(ErrorCode::ModelServerError);
        }
    }

    /// A routed request's stream ended early.
    pub fn on_aborted(&self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
        self.error(ErrorCode::Aborted);
    }

    fn error(&self, code: ErrorCode) {
        if let Some(i) = ErrorCode::ALL.iter().position(|c| *c == code)
            && let Some(c) = self.errors.get(i)
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What the response phase saw of a completed request.
#[derive(Debug, Clone, Copy)]
pub struct Completed {
    /// Routed → end of response.
    pub duration: Duration,
    /// Routed → first response byte.
    pub ttft: Option<Duration>,
    /// `(prompt, completion, cached)` tokens, when the server reported usage.
    pub usage: Option<(u32, u32, Option<u32>)>,
    /// HTTP status (0 if unknown).
    pub status: u16,
}

impl Completed {
    /// The mean time between output tokens after the first (inter-token latency, TPOT), in
    /// seconds: the decode time over all but the first token, when both are known.
    pub fn itl_seconds(&self) -> Option<f64> {
        let (_, completion, _) = self.usage?;
        let ttft = self.ttft?;
        (completion > 1)
            .then(|| self.duration.saturating_sub(ttft).as_secs_f64() / f64::from(completion - 1))
    }
}

/// The request metrics of one EPP.
#[derive(Debug)]
pub struct RequestMetrics {
    models: LabelCap,
    series: RwLock<HashMap<(String, String), Arc<Series>>>,
    /// Scheduling alone (candidates → pick).
    pub scheduler: Histogram,
    /// The whole decision (parse → tokenize → keys → lookup → score → pick).
    pub decision: Histogram,
    attempts_ok: AtomicU64,
    attempts_failed: AtomicU64,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        Self {
            models: LabelCap::new(MODEL_LABEL_CAP),
            series: RwLock::default(),
            scheduler: Histogram::new(buckets::SECONDS),
            decision: Histogram::new(buckets::SECONDS),
            attempts_ok: AtomicU64::new(0),
            attempts_failed: AtomicU64::new(0),
        }
    }
}

impl RequestMetrics {
    /// The series of requests for `model` served as `target`.
    pub fn series(&self, model: &str, target: &str) -> Arc<Series> {
        let key = (
            self.models.admit(model).to_owned(),
            self.models.admit(target).to_owned(),
        );
        if let Some(s) = self
            .series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Arc::clone(s);
        }
        let mut map = self.series.write().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(map.entry(key).or_insert_with(|| Arc::new(Series::new())))
    }

    /// A request the EPP answered itself.
    pub fn on_rejected(&self, model: &str, code: ErrorCode) {
        self.series(model, model).error(code);
    }

    /// A scheduling attempt and its duration.
    pub fn on_scheduled(&self, ok: bool, took: Duration) {
        let c = if ok {
            &self.attempts_ok
        } else {
            &self.attempts_failed
        };
        c.fetch_add(1, Ordering::Relaxed);
        self.scheduler.observe_duration(took);
    }

    /// Writes every family.
    pub fn render(&self, e: &mut Exposition, pool: &str) {
        let series: Vec<((String, String), Arc<Series>)> = {
            let map = self.series.read().unwrap_or_else(PoisonError::into_inner);
            let mut v: Vec<_> = map
                .iter()
                .map(|(k, s)| (k.clone(), Arc::clone(s)))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let counter = |e: &mut Exposition, name: &str, help: &str, f: &dyn Fn(&Series) -> u64| {
            e.family(name, Kind::Counter, help);
            for ((m, t), s) in &series {
                #[allow(clippy::cast_precision_loss)]
                e.sample(
                    name,
                    &[("model_name", m), ("target_model_name", t)],
                    f(s) as f64,
                );
            }
        };
        counter(
            e,
            "inference_objective_request_total",
            "Requests routed, by requested and served model.",
            &|s| s.requests.load(Ordering::Relaxed),
        );
        e.family(
            "inference_objective_request_error_total",
            Kind::Counter,
            "Requests that failed, by error code.",
        );
        for ((m, t), s) in &series {
            for (code, n) in ErrorCode::ALL.iter().zip(&s.errors) {
                let n = n.load(Ordering::Relaxed);
                if n > 0 {
                    #[allow(clippy::cast_precision_loss)]
                    e.sample(
                        "inference_objective_request_error_total",
                        &[
                            ("model_name", m),
                            ("target_model_name", t),
                            ("error_code", code.as_str()),
                        ],
                        n as f64,
                    );
                }
            }
        }
        e.family(
            "inference_objective_running_requests",
            Kind::Gauge,
            "Requests routed and not yet completed.",
        );
        for ((m, _), s) in &series {
            #[allow(clippy::cast_precision_loss)]
            e.sample(
                "inference_objective_running_requests",
                &[("model_name", m)],
                s.running.load(Ordering::Relaxed).max(0) as f64,
            );
        }
        let hist =
            |e: &mut Exposition, name: &str, help: &str, f: &dyn Fn(&Series) -> &Histogram| {
                e.family(name, Kind::Histogram, help);
                for ((m, t), s) in &series {
                    e.histogram(
                        name,
                        &[("model_name", m), ("target_model_name", t)],
                        &f(s).snapshot(),
                    );
                }
            };
        hist(
            e,
            "inference_objective_request_duration_seconds",
            "Routed → end of response.",
            &|s| &s.duration,
        );
        hist(
            e,
            "inference_objective_request_ttft_seconds",
            "Routed → first response byte.",
            &|s| &s.ttft,
        );
        hist(
            e,
            "inference_objective_request_tpot_seconds",
            "Time per output token after the first.",
            &|s| &s.tpot,
        );
        hist(
            e,
            "inference_objective_input_tokens",
            "Prompt tokens reported by the model server.",
            &|s| &s.input_tokens,
        );
        hist(
            e,
            "inference_objective_output_tokens",
            "Completion tokens reported by the model server.",
            &|s| &s.output_tokens,
        );
        hist(
            e,
            "inference_objective_prompt_cached_tokens",
            "Prompt tokens served from the prefix cache, as reported.",
            &|s| &s.cached_tokens,
        );
        hist(
            e,
            "inference_objective_request_sizes",
            "Request body sizes in bytes.",
            &|s| &s.request_sizes,
        );
        let pool_label = [("pool", pool)];
        e.family(
            "inference_extension_scheduler_e2e_duration_seconds",
            Kind::Histogram,
            "Scheduling time per request.",
        )
        .histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            &[],
            &self.scheduler.snapshot(),
        );
        e.family(
            "inference_extension_scheduler_attempts_total",
            Kind::Counter,
            "Scheduling attempts by outcome.",
        );
        #[allow(clippy::cast_precision_loss)]
        {
            e.sample(
                "inference_extension_scheduler_attempts_total",
                &[("status", "success")],
                self.attempts_ok.load(Ordering::Relaxed) as f64,
            );
            e.sample(
                "inference_extension_scheduler_attempts_total",
                &[("status", "failure")],
                self.attempts_failed.load(Ordering::Relaxed) as f64,
            );
        }
        e.family(
            "kvgate_epp_decision_duration_seconds",
            Kind::Histogram,
            "Parse → tokenize → keys → lookup → score → pick, per routed request.",
        )
        .histogram(
            "kvgate_epp_decision_duration_seconds",
            &pool_label,
            &self.decision.snapshot(),
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn completed_requests_fill_the_gie_families() {
        let m = RequestMetrics::default();
        let s = m.series("llama", "llama-lora");
        s.on_routed(2048);
        s.on_completed(&Completed {
            duration: Duration::from_millis(1100),
            ttft: Some(Duration::from_millis(100)),
            usage: Some((1000, 11, Some(512))),
            status: 200,
        });
        let s2 = m.series("llama", "llama-lora");
        s2.on_routed(10);
        s2.on_aborted();
        m.on_rejected("", ErrorCode::BadRequest);
        m.on_scheduled(true, Duration::from_micros(20));
        let mut e = Exposition::new();
        m.render(&mut e, "pool-a");
        let text = e.finish();
        for line in [
            "inference_objective_request_total{model_name=\"llama\",target_model_name=\"llama-lora\"} 2",
            "inference_objective_request_error_total{model_name=\"llama\",target_model_name=\"llama-lora\",error_code=\"Aborted\"} 1",
            "inference_objective_request_error_total{model_name=\"\",target_model_name=\"\",error_code=\"BadRequest\"} 1",
            "inference_objective_running_requests{model_name=\"llama\"} 0",
            "inference_objective_request_ttft_seconds_bucket{model_name=\"llama\",target_model_name=\"llama-lora\",le=\"0.1\"} 1",
            "inference_objective_request_tpot_seconds_bucket{model_name=\"llama\",target_model_name=\"llama-lora\",le=\"0.1\"} 1",
            "inference_objective_prompt_cached_tokens_sum{model_name=\"llama\",target_model_name=\"llama-lora\"} 512",
            "inference_extension_scheduler_attempts_total{status=\"success\"} 1",
            "inference_extension_scheduler_e2e_duration_seconds_count 1",
        ] {
            assert!(text.contains(line), "missing {line}\n{text}");
        }
    }

    #[test]
    fn a_non_2xx_answer_counts_as_a_model_server_error() {
        let m = RequestMetrics::default();
        let s = m.series("a", "a");
        s.on_routed(1);
        s.on_completed(&Completed {
            duration: Duration::from_millis(5),
            ttft: None,
            usage: None,
            status: 500,
        });
        let mut e = Exposition::new();
        m.render(&mut e, "p");
        assert!(e.finish().contains("error_code=\"ModelServerError\"} 1"));
    }

    #[test]
    fn model_labels_are_capped() {
        let m = RequestMetrics::default();
        for i in 0..200 {
            m.series(&format!("m{i}"), &format!("m{i}"));
        }
        assert!(m.series.read().unwrap().len() <= MODEL_LABEL_CAP + 1);
    }
}
