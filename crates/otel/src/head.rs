//! Head sampling, decided before any span exists: a request that will not be recorded costs no
//! span at all, only this decision.
//!
//! The decision follows W3C trace context: a request whose `traceparent` is valid keeps its
//! caller's sampled flag; one without is sampled with the configured ratio. An unsampled request
//! that arrived without context leaves with a generated, unsampled `traceparent`, so that the
//! hops after this one (the sidecar, the engine) keep the decision instead of making their own.

use std::sync::OnceLock;

use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};

/// The sample ratio of the process's exporter; unset while tracing is off.
static RATIO: OnceLock<f64> = OnceLock::new();

/// Records the exporter's sample ratio (the first exporter set up in the process wins).
pub(crate) fn set_ratio(ratio: f64) {
    let _ = RATIO.set(ratio);
}

/// What to do with one request's trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// Record it: create the request's spans (under the caller's context, see
    /// [`crate::set_parent`]).
    Trace,
    /// Create no span. `traceparent`, when set, goes to the next hop in place of the request's
    /// (which had none, or an invalid one): an unsampled context carrying the decision on.
    Skip {
        /// The header value to send on.
        traceparent: Option<String>,
    },
}

/// The caller's sampled flag, when `value` is a valid version-00 `traceparent`.
fn caller_sampled(value: &str) -> Option<bool> {
    let mut parts = value.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let valid = version == "00"
        && parts.next().is_none()
        && hex(trace, 32)
        && hex(span, 16)
        && hex(flags, 2)
        && trace.bytes().any(|b| b != b'0')
        && span.bytes().any(|b| b != b'0');
    if !valid {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(flags & 1 == 1)
}

/// Decides one request's trace from its headers (lower-case names).
pub fn head<I: AsRef<str>>(headers: &[(I, I)]) -> Head {
    let Some(&ratio) = RATIO.get() else {
        return Head::Skip { traceparent: None };
    };
    let parent = headers
        .iter()
        .find(|(k, _)| k.as_ref().eq_ignore_ascii_case("traceparent"))
        .and_then(|(_, v)| caller_sampled(v.as_ref()));
    decide(parent, ratio, &RandomIdGenerator::default())
}

fn decide(parent: Option<bool>, ratio: f64, ids: &dyn IdGenerator) -> Head {
    match parent {
        Some(true) => Head::Trace,
        Some(false) => Head::Skip { traceparent: None },
        None => {
            let trace = ids.new_trace_id();
            if sampled(trace, ratio) {
                return Head::Trace;
            }
            let span: SpanId = ids.new_span_id();
            Head::Skip {
                traceparent: Some(format!("00-{trace:032x}-{span:016x}-00")),
            }
        }
    }
}

/// The trace-id-ratio rule: the low 63 bits of the trace id below `ratio` of their range.
fn sampled(trace: TraceId, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let bytes = trace.to_bytes();
    let mut low = [0u8; 8];
    low.copy_from_slice(&bytes[8..]);
    let draw = u64::from_be_bytes(low) >> 1;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    draw < bound
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const UNSAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

    #[test]
    fn a_callers_valid_context_decides() {
        assert_eq!(caller_sampled(SAMPLED), Some(true));
        assert_eq!(caller_sampled(UNSAMPLED), Some(false));
        assert_eq!(
            caller_sampled(" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03 "),
            Some(true)
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-zz-00f067aa0ba902b7-01",
        ] {
            assert_eq!(caller_sampled(bad), None, "{bad:?}");
        }
        let ids = RandomIdGenerator::default();
        assert_eq!(decide(Some(true), 0.0, &ids), Head::Trace);
        assert_eq!(
            decide(Some(false), 1.0, &ids),
            Head::Skip { traceparent: None }
        );
    }

    #[test]
    fn without_context_the_ratio_decides_and_a_skip_carries_an_unsampled_parent() {
        let ids = RandomIdGenerator::default();
        assert_eq!(decide(None, 1.0, &ids), Head::Trace);
        let Head::Skip {
            traceparent: Some(tp),
        } = decide(None, 0.0, &ids)
        else {
            panic!("ratio 0 never samples");
        };
        assert_eq!(caller_sampled(&tp), Some(false), "{tp}");
        let n = 20_000;
        let traced = (0..n)
            .filter(|_| decide(None, 0.1, &ids) == Head::Trace)
            .count();
        // 10% of 20,000 draws: 2,000 ± 5 standard deviations (212).
        assert!((1_788..=2_212).contains(&traced), "{traced} of {n}");
    }
}
