//! A Prometheus text-exposition reader for the few model-server load gauges kvgate routes on
//! (vLLM, SGLang, TRT-LLM and Triton's TRT-LLM backend names). Pure: the EPP's scraper and the
//! sidecar's load relay both feed it bytes they fetched.
//!
//! Only the sample lines of the recognised metric names are parsed; everything else (comments,
//! `# HELP` / `# TYPE`, other families) is skipped after reading its name. Samples of the same
//! signal under several label sets (several ranks or models in one exposition) are summed for
//! the request counts; for the KV-cache fraction the largest one is kept (summing fractions is
//! meaningless, and vLLM exposes the old and new name side by side during its deprecation).

/// Largest exposition accepted.
pub const MAX_EXPOSITION: usize = 4 * 1024 * 1024;

/// Why an exposition could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The body is larger than [`MAX_EXPOSITION`].
    #[error("exposition of {0} bytes exceeds the {MAX_EXPOSITION}-byte limit")]
    TooLarge(usize),
    /// The body is not UTF-8.
    #[error("exposition is not UTF-8")]
    NotUtf8,
    /// A sample line of a recognised metric is malformed.
    #[error("malformed sample on line {0}")]
    Malformed(usize),
    /// None of the recognised gauges is present.
    #[error("no recognised engine load gauge in the exposition")]
    NoGauges,
}

/// Which engine signal a sample feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signal {
    Waiting,
    Running,
    KvUsage,
}

/// The signal a plain (label-independent) metric name carries.
fn plain_signal(name: &str) -> Option<Signal> {
    match name {
        "vllm:num_requests_waiting" | "sglang:num_queue_reqs" | "trtllm_num_requests_waiting" => {
            Some(Signal::Waiting)
        }
        "vllm:num_requests_running" | "sglang:num_running_reqs" | "trtllm_num_requests_running" => {
            Some(Signal::Running)
        }
        "vllm:kv_cache_usage_perc"
        | "vllm:gpu_cache_usage_perc"
        | "sglang:token_usage"
        | "trtllm_kv_cache_utilization" => Some(Signal::KvUsage),
        _ => None,
    }
}

/// Triton TRT-LLM backend families, whose signal is chosen by a label.
const TRITON_REQUESTS: &str = "nv_trt_llm_request_metrics";
const TRITON_KV_BLOCKS: &str = "nv_trt_llm_kv_cache_block_metrics";

/// The signal of a Triton TRT-LLM sample, from its labels.
fn triton_signal(name: &str, labels: &[(String, String)]) -> Option<Signal> {
    let label = |key: &str| {
        labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    match name {
        TRITON_REQUESTS => match label("request_type")? {
            "waiting" => Some(Signal::Waiting),
            "scheduled" => Some(Signal::Running),
            _ => None,
        },
        TRITON_KV_BLOCKS => {
            (label("kv_cache_block_type")? == "fraction").then_some(Signal::KvUsage)
        }
        _ => None,
    }
}

/// Raw totals of the recognised gauges.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Gauges {
    /// Sum of the queued-request gauges, if any was present.
    pub waiting: Option<f64>,
    /// Sum of the running-request gauges, if any was present.
    pub running: Option<f64>,
    /// Largest KV-cache usage fraction, if any was present.
    pub kv_usage: Option<f64>,
}

impl Gauges {
    fn add(&mut self, signal: Signal, value: f64) {
        // NaN and negative samples carry no load information.
        let value = if value.is_nan() { 0.0 } else { value.max(0.0) };
        match signal {
            Signal::Waiting => *self.waiting.get_or_insert(0.0) += value,
            Signal::Running => *self.running.get_or_insert(0.0) += value,
            Signal::KvUsage => {
                let slot = self.kv_usage.get_or_insert(0.0);
                *slot = slot.max(value);
            }
        }
    }

    /// Whether nothing was recognised.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_none() && self.running.is_none() && self.kv_usage.is_none()
    }

    /// Queued requests as a count; an absent gauge counts as 0.
    pub fn waiting_count(&self) -> u32 {
        count(self.waiting)
    }

    /// Running requests as a count; an absent gauge counts as 0.
    pub fn running_count(&self) -> u32 {
        count(self.running)
    }

    /// KV-cache usage clamped to `[0, 1]`; an absent gauge counts as 0.
    pub fn kv_usage_fraction(&self) -> f64 {
        self.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0)
    }
}

/// A non-negative gauge total as a request count (rounded, saturating at `u32::MAX`).
fn count(v: Option<f64>) -> u32 {
    let v = v.unwrap_or(0.0).round();
    if v >= f64::from(u32::MAX) {
        u32::MAX
    } else if v > 0.0 {
        // In range and integral: the cast is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = v as u32;
        n
    } else {
        0
    }
}

/// Reads the recognised gauges from a text exposition.
pub fn parse_gauges(body: &[u8]) -> Result<Gauges, ParseError> {
    if body.len() > MAX_EXPOSITION {
        return Err(ParseError::TooLarge(body.len()));
    }
    let text = std::str::from_utf8(body).map_err(|_| ParseError::NotUtf8)?;
    let mut gauges = Gauges::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let (name, rest) = line.split_at(name_end);
        let plain = plain_signal(name);
        if plain.is_none() && name != TRITON_REQUESTS && name != TRITON_KV_BLOCKS {
            continue;
        }
        let (labels, value) = parse_sample_rest(rest).ok_or(ParseError::Malformed(n + 1))?;
        if let Some(signal) = plain.or_else(|| triton_signal(name, &labels)) {
            gauges.add(signal, value);
        }
    }
    if gauges.is_empty() {
        return Err(ParseError::NoGauges);
    }
    Ok(gauges)
}

/// Parses what follows a sample's name: an optional `{labels}` block, the value, and an
/// optional timestamp (ignored).
fn parse_sample_rest(rest: &str) -> Option<(Vec<(String, String)>, f64)> {
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => parse_labels(inner)?,
        None => (Vec::new(), rest),
    };
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    // At most a timestamp may follow.
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().ok()?;
    }
    fields.next().is_none().then_some((labels, value))
}

/// Parses `k="v",k2="v2"}` (the opening brace already consumed); returns the labels and what
/// follows the closing brace.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let (key, after) = s.split_at(eq);
        let key = key.trim();
        if key.is_empty() {
            return None;
        }
        let after = after.get(1..)?.trim_start().strip_prefix('"')?;
        let (value, after) = parse_quoted(after)?;
        labels.push((key.to_owned(), value));
        s = after.trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

/// Reads a label value up to its closing quote (the opening one already consumed), resolving
/// `\\`, `\"` and `\n`; returns the value and what follows the closing quote.
fn parse_quoted(s: &str) -> Option<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, s.get(i + 1..)?)),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                other => out.push(other),
            },
            _ => out.push(c),
        }
    }
    None
}

/// A sample value: a float, `NaN`, `+Inf` or `-Inf`.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage (deprecated).
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1234.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1234.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="27000"} 1.0
"#;

    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B",note="a, \"quoted\" value, with commas",tp_rank="0"} 5.0
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B",note="back\\slash}",tp_rank="1",} 6.0 1712345678000
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B",tp_rank="0"} 7.0
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B",tp_rank="1"} NaN
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B",tp_rank="0"} 0.42
sglang:gen_throughput{model_name="Qwen/Qwen2.5-7B"} 812.5
"#;

    /// The counts a router uses, as one tuple.
    fn load(body: &[u8]) -> (u32, u32, f64) {
        let g = parse_gauges(body).unwrap();
        (g.waiting_count(), g.running_count(), g.kv_usage_fraction())
    }

    #[test]
    fn vllm_sums_label_sets_and_keeps_the_largest_kv_fraction() {
        assert_eq!(load(VLLM.as_bytes()), (3, 7, 0.5));
    }

    #[test]
    fn sglang_with_escaped_labels_nan_and_timestamps() {
        let g = parse_gauges(SGLANG.as_bytes()).unwrap();
        assert_eq!(g.running, Some(11.0));
        assert_eq!(g.waiting, Some(7.0), "NaN counts as 0");
        assert_eq!(g.kv_usage, Some(0.42));
    }

    #[test]
    fn trtllm_serve_and_triton_names() {
        let serve = "trtllm_num_requests_waiting 2\ntrtllm_num_requests_running 9\n\
                     trtllm_kv_cache_utilization 0.75\n";
        assert_eq!(load(serve.as_bytes()), (2, 9, 0.75));

        let triton = r#"# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="ensemble",request_type="waiting",version="1"} 4
nv_trt_llm_request_metrics{model="ensemble",request_type="scheduled",version="1"} 8
nv_trt_llm_request_metrics{model="ensemble",request_type="active",version="1"} 12
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="ensemble",version="1"} 0.3
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="ensemble",version="1"} 9000
"#;
        assert_eq!(load(triton.as_bytes()), (4, 8, 0.3));
    }

    #[test]
    fn missing_gauges_count_as_zero_and_out_of_range_values_are_clamped() {
        assert_eq!(
            load(b"vllm:num_requests_running -3\nvllm:kv_cache_usage_perc +Inf\n"),
            (0, 0, 1.0)
        );
        assert_eq!(load(b"vllm:num_requests_waiting 1e12\n").0, u32::MAX);
    }

    #[test]
    fn rejects_what_it_cannot_use() {
        assert_eq!(
            parse_gauges(b"# HELP x\nprocess_cpu_seconds_total 1.5\n"),
            Err(ParseError::NoGauges)
        );
        assert_eq!(
            parse_gauges(b"vllm:num_requests_waiting{a=\"1\" 3\n"),
            Err(ParseError::Malformed(1))
        );
        assert_eq!(
            parse_gauges(b"x 1\nvllm:num_requests_waiting{a=\"unterminated} 3\n"),
            Err(ParseError::Malformed(2))
        );
        assert_eq!(
            parse_gauges(b"vllm:num_requests_waiting three\n"),
            Err(ParseError::Malformed(1))
        );
        assert_eq!(parse_gauges(&[0xff, 0xfe]), Err(ParseError::NotUtf8));
        let big = vec![b'#'; MAX_EXPOSITION + 1];
        assert_eq!(
            parse_gauges(&big),
            Err(ParseError::TooLarge(MAX_EXPOSITION + 1))
        );
    }
}
