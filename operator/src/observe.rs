//! Load and latency from the EPP replicas' `/metrics`: the request counter, the input and output
//! token histograms, and the TTFT and time-per-output-token histograms (GIE's names, which the
//! EPP exports). Two scrapes of each replica give rates and the latency percentile over the
//! interval between them. Pure: callers fetch the pages and pass the time.

use std::collections::BTreeMap;

use prometheus_parse::{Scrape, Value};

/// Requests routed, per model (counter).
const REQUESTS: &str = "inference_objective_request_total";
/// Prompt tokens per request (histogram).
const INPUT: &str = "inference_objective_input_tokens";
/// Output tokens per request (histogram).
const OUTPUT: &str = "inference_objective_output_tokens";
/// Time to first token (histogram, seconds).
const TTFT: &str = "inference_objective_request_ttft_seconds";
/// Time per output token after the first (histogram, seconds).
const ITL: &str = "inference_objective_request_tpot_seconds";
/// The pool's mean engine queue (gauge).
const QUEUE: &str = "inference_pool_average_queue_size";
/// Requests running or waiting on a role's ready endpoints (gauge, label `role`).
const ROLE_REQUESTS: &str = "kvgate_epp_pool_requests";

/// Why a page could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// Not the Prometheus text format.
    #[error("not a Prometheus text page: {0}")]
    Parse(#[source] std::io::Error),
    /// The page has none of the EPP's request metrics.
    #[error("the page has no {REQUESTS}: not an EPP's /metrics")]
    NotAnEpp,
}

/// A cumulative histogram: `(upper bound, cumulative count)` by bound, plus sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Cumulative counts by upper bound (`+Inf` included).
    pub buckets: Vec<(f64, f64)>,
    /// Sum of the observations.
    pub sum: f64,
    /// Number of observations.
    pub count: f64,
}

impl Histogram {
    fn add(&mut self, buckets: &[(f64, f64)]) {
        for (le, n) in buckets {
            match self
                .buckets
                .iter_mut()
                .find(|(b, _)| b.total_cmp(le).is_eq())
            {
                Some((_, c)) => *c += n,
                None => self.buckets.push((*le, *n)),
            }
        }
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    /// `self − earlier`, or `None` when a counter went backwards (a restart).
    fn since(&self, earlier: &Histogram) -> Option<Histogram> {
        if self.count < earlier.count || self.sum < earlier.sum {
            return None;
        }
        let mut buckets = Vec::with_capacity(self.buckets.len());
        for (le, n) in &self.buckets {
            let before = earlier
                .buckets
                .iter()
                .find(|(b, _)| b.total_cmp(le).is_eq())
                .map_or(0.0, |(_, c)| *c);
            if *n < before {
                return None;
            }
            buckets.push((*le, n - before));
        }
        Some(Histogram {
            buckets,
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        })
    }

    fn plus(&self, other: &Histogram) -> Histogram {
        let mut out = self.clone();
        out.add(&other.buckets);
        out.sum += other.sum;
        out.count += other.count;
        out
    }

    /// The `q` quantile (0–1) by linear interpolation inside its bucket, as Prometheus's
    /// `histogram_quantile` does; `None` without observations. A quantile in the `+Inf` bucket
    /// is the highest finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last().map(|(_, n)| *n)?;
        if total <= 0.0 || !(0.0..=1.0).contains(&q) {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for (le, n) in &self.buckets {
            if *n >= rank {
                if le.is_infinite() {
                    return Some(lower.0);
                }
                let width = n - lower.1;
                let frac = if width > 0.0 {
                    (rank - lower.1) / width
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * frac);
            }
            lower = (*le, *n);
        }
        Some(lower.0)
    }
}

/// One EPP replica's cumulative counters at one scrape (summed over its label sets).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    /// Requests routed.
    pub requests: f64,
    /// Prompt tokens.
    pub input: Histogram,
    /// Output tokens.
    pub output: Histogram,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time per output token.
    pub itl: Histogram,
    /// The pool's mean engine queue as this replica sees it.
    pub queue: Option<f64>,
    /// Requests on the decode endpoints as this replica sees them.
    pub decode_requests: Option<f64>,
}

impl Counters {
    /// Reads an EPP's `/metrics` page.
    pub fn parse(page: &str) -> Result<Counters, ObserveError> {
        let lines = page.lines().map(|l| Ok(l.to_owned()));
        let scrape = Scrape::parse(lines).map_err(ObserveError::Parse)?;
        let mut c = Counters::default();
        let mut seen = false;
        for s in &scrape.samples {
            match (s.metric.as_str(), &s.value) {
                (REQUESTS, Value::Counter(v) | Value::Untyped(v)) => {
                    c.requests += v;
                    seen = true;
                }
                (INPUT | OUTPUT | TTFT | ITL, Value::Histogram(buckets)) => {
                    let target = match s.metric.as_str() {
                        INPUT => &mut c.input,
                        OUTPUT => &mut c.output,
                        TTFT => &mut c.ttft,
                        _ => &mut c.itl,
                    };
                    let b: Vec<(f64, f64)> =
                        buckets.iter().map(|h| (h.less_than, h.count)).collect();
                    target.add(&b);
                }
                (QUEUE, Value::Gauge(v) | Value::Untyped(v)) => {
                    c.queue = Some(c.queue.unwrap_or(0.0) + v);
                }
                (ROLE_REQUESTS, Value::Gauge(v) | Value::Untyped(v))
                    if s.labels.get("role") == Some("decode") =>
                {
                    c.decode_requests = Some(c.decode_requests.unwrap_or(0.0) + v);
                }
                _ => {}
            }
        }
        // prometheus-parse folds `_sum` and `_count` into separate samples.
        for s in &scrape.samples {
            let (base, is_sum) = match s.metric.strip_suffix("_sum") {
                Some(b) => (b, true),
                None => match s.metric.strip_suffix("_count") {
                    Some(b) => (b, false),
                    None => continue,
                },
            };
            let target = match base {
                INPUT => &mut c.input,
                OUTPUT => &mut c.output,
                TTFT => &mut c.ttft,
                ITL => &mut c.itl,
                _ => continue,
            };
            let v = match s.value {
                Value::Counter(v) | Value::Untyped(v) | Value::Gauge(v) => v,
                _ => continue,
            };
            if is_sum {
                target.sum += v;
            } else {
                target.count += v;
            }
        }
        if !seen {
            return Err(ObserveError::NotAnEpp);
        }
        Ok(c)
    }
}

/// One scrape of every EPP replica: counters by replica (its pod name), and when.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Seconds on the caller's clock.
    pub at_s: f64,
    /// By replica.
    pub replicas: BTreeMap<String, Counters>,
}

/// What an interval shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// Requests per second.
    pub rps: f64,
    /// Mean prompt tokens.
    pub isl_tokens: f64,
    /// Mean output tokens.
    pub osl_tokens: f64,
    /// TTFT at the percentile, milliseconds (`None` without completions).
    pub ttft_ms: Option<f64>,
    /// Time per output token at the percentile, milliseconds.
    pub itl_ms: Option<f64>,
    /// The pool's mean engine queue (mean of the replicas' views).
    pub queue_depth: Option<f64>,
    /// Requests on the decode endpoints (mean of the replicas' views of the later scrape).
    pub decode_requests: Option<f64>,
}

/// Why an interval gives no observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoObservation {
    /// The two scrapes share no replica (replicas replaced, or the first scrape).
    NoCommonReplica,
    /// No time passed between them.
    NoTime,
}

/// The mean of some replicas' views, if any.
#[allow(clippy::cast_precision_loss)]
fn mean_of(views: &[f64]) -> Option<f64> {
    (!views.is_empty()).then(|| views.iter().sum::<f64>() / views.len() as f64)
}

/// The load and latency between two snapshots: per replica present in both (a restarted
/// replica, whose counters went back, is left out), the deltas summed; `percentile` in 1–100.
pub fn between(
    earlier: &Snapshot,
    later: &Snapshot,
    percentile: f64,
) -> Result<Observed, NoObservation> {
    let dt = later.at_s - earlier.at_s;
    if dt <= 0.0 {
        return Err(NoObservation::NoTime);
    }
    let mut requests = 0.0;
    let (mut input, mut output, mut ttft, mut itl) = (
        Histogram::default(),
        Histogram::default(),
        Histogram::default(),
        Histogram::default(),
    );
    let mut queues = Vec::new();
    let mut decoding = Vec::new();
    let mut common = 0;
    for (name, now) in &later.replicas {
        let Some(before) = earlier.replicas.get(name) else {
            continue;
        };
        let deltas = (
            now.input.since(&before.input),
            now.output.since(&before.output),
            now.ttft.since(&before.ttft),
            now.itl.since(&before.itl),
        );
        let (Some(i), Some(o), Some(t), Some(l)) = deltas else {
            continue;
        };
        if now.requests < before.requests {
            continue;
        }
        common += 1;
        requests += now.requests - before.requests;
        input = input.plus(&i);
        output = output.plus(&o);
        ttft = ttft.plus(&t);
        itl = itl.plus(&l);
        if let Some(q) = now.queue {
            queues.push(q);
        }
        if let Some(d) = now.decode_requests {
            decoding.push(d);
        }
    }
    if common == 0 {
        return Err(NoObservation::NoCommonReplica);
    }
    let mean = |h: &Histogram| if h.count > 0.0 { h.sum / h.count } else { 0.0 };
    let q = (percentile / 100.0).clamp(0.0, 1.0);
    Ok(Observed {
        rps: requests / dt,
        isl_tokens: mean(&input),
        osl_tokens: mean(&output),
        ttft_ms: ttft.quantile(q).map(|s| s * 1000.0),
        itl_ms: itl.quantile(q).map(|s| s * 1000.0),
        queue_depth: mean_of(&queues),
        decode_requests: mean_of(&decoding),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::float_cmp)]
    use proptest::prelude::*;

    use super::*;

    fn page(requests: u64, ttft: &[(f64, u64)], ttft_sum: f64, input_sum: f64) -> String {
        let mut s = format!(
            "# TYPE inference_objective_request_total counter\n\
             inference_objective_request_total{{model_name=\"m\",target_model_name=\"m\"}} {requests}\n\
             # TYPE inference_objective_request_ttft_seconds histogram\n"
        );
        for (le, n) in ttft {
            s += &format!(
                "inference_objective_request_ttft_seconds_bucket{{model_name=\"m\",le=\"{le}\"}} {n}\n"
            );
        }
        let count = ttft.last().map_or(0, |(_, n)| *n);
        s += &format!(
            "inference_objective_request_ttft_seconds_bucket{{model_name=\"m\",le=\"+Inf\"}} {count}\n\
             inference_objective_request_ttft_seconds_sum{{model_name=\"m\"}} {ttft_sum}\n\
             inference_objective_request_ttft_seconds_count{{model_name=\"m\"}} {count}\n\
             # TYPE inference_objective_input_tokens histogram\n\
             inference_objective_input_tokens_bucket{{model_name=\"m\",le=\"+Inf\"}} {requests}\n\
             inference_objective_input_tokens_sum{{model_name=\"m\"}} {input_sum}\n\
             inference_objective_input_tokens_count{{model_name=\"m\"}} {requests}\n\
             # TYPE inference_pool_average_queue_size gauge\n\
             inference_pool_average_queue_size{{name=\"p\"}} 3\n\
             # TYPE kvgate_epp_pool_requests gauge\n\
             kvgate_epp_pool_requests{{pool=\"p\",role=\"prefill\"}} 4\n\
             kvgate_epp_pool_requests{{pool=\"p\",role=\"decode\"}} 17\n"
        );
        s
    }

    fn snap(at_s: f64, pages: &[(&str, String)]) -> Snapshot {
        Snapshot {
            at_s,
            replicas: pages
                .iter()
                .map(|(n, p)| ((*n).to_owned(), Counters::parse(p).unwrap()))
                .collect(),
        }
    }

    #[test]
    fn two_scrapes_give_rates_means_and_the_percentile() {
        let a = snap(
            0.0,
            &[("epp-0", page(10, &[(0.1, 5), (0.5, 10)], 2.0, 1000.0))],
        );
        let b = snap(
            10.0,
            &[("epp-0", page(110, &[(0.1, 55), (0.5, 110)], 22.0, 21_000.0))],
        );
        let o = between(&a, &b, 90.0).unwrap();
        assert_eq!(o.rps, 10.0);
        assert_eq!(o.isl_tokens, 200.0);
        // 100 observations: 50 under 0.1 s, 50 in (0.1, 0.5]; p90 is 80% into the second bucket.
        assert!((o.ttft_ms.unwrap() - 420.0).abs() < 1e-6, "{o:?}");
        assert_eq!(o.queue_depth, Some(3.0));
        assert_eq!(o.decode_requests, Some(17.0), "the decode role's only");
        assert_eq!(o.itl_ms, None, "no ITL observations");
    }

    #[test]
    fn replicas_are_summed_and_a_restarted_or_new_one_left_out() {
        let a = snap(
            0.0,
            &[
                ("epp-0", page(10, &[(1.0, 10)], 1.0, 100.0)),
                ("epp-1", page(50, &[(1.0, 50)], 1.0, 100.0)),
            ],
        );
        let b = snap(
            5.0,
            &[
                ("epp-0", page(20, &[(1.0, 20)], 2.0, 200.0)),
                ("epp-1", page(3, &[(1.0, 3)], 0.1, 10.0)),
                ("epp-2", page(1000, &[(1.0, 1000)], 9.0, 9.0)),
            ],
        );
        let o = between(&a, &b, 50.0).unwrap();
        assert_eq!(
            o.rps, 2.0,
            "only epp-0 counts: epp-1 restarted, epp-2 is new"
        );
        let fresh = snap(1.0, &[("epp-9", page(1, &[(1.0, 1)], 0.1, 1.0))]);
        assert_eq!(
            between(&a, &fresh, 90.0),
            Err(NoObservation::NoCommonReplica)
        );
        assert_eq!(between(&a, &a, 90.0), Err(NoObservation::NoTime));
    }

    #[test]
    fn a_page_without_request_metrics_is_refused() {
        assert!(matches!(
            Counters::parse("# TYPE x counter\nx 1\n"),
            Err(ObserveError::NotAnEpp)
        ));
    }

    proptest! {
        /// Against the naive model: the quantile of the observations themselves lies in the
        /// same bucket as the histogram's answer.
        #[test]
        fn the_quantile_lands_in_the_right_bucket(
            mut values in prop::collection::vec(0.0f64..10.0, 1..200),
            q in 0.01f64..1.0,
        ) {
            let bounds = [0.5, 1.0, 2.0, 5.0, 10.0, f64::INFINITY];
            let buckets: Vec<(f64, f64)> = bounds
                .iter()
                .map(|b| (*b, values.iter().filter(|v| **v <= *b).count() as f64))
                .collect();
            let h = Histogram { buckets, sum: values.iter().sum(), count: values.len() as f64 };
            values.sort_by(f64::total_cmp);
            let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
            let exact = values[rank - 1];
            let got = h.quantile(q).unwrap();
            let bucket_of = |v: f64| bounds.iter().position(|b| v <= *b).unwrap();
            let lower = if bucket_of(exact) == 0 { 0.0 } else { bounds[bucket_of(exact) - 1] };
            prop_assert!(got >= lower - 1e-9 && got <= bounds[bucket_of(exact)] + 1e-9,
                "q {q}: exact {exact}, histogram {got}");
        }
    }
}
