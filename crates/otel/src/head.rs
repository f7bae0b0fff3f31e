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

use crate::Parent;

/// The sample ratio of the process's exporter; unset while tracing is off.
static RATIO: OnceLock<f64> = OnceLock::new();

/// Records the exporter's sample ratio (the first exporter set up in the process wins).
pub(crate) fn set_ratio(ratio: f64) {
    let _ = RATIO.set(ratio);
}

/// What to do with one request's trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// Record it: create the request's spans under `parent`, the caller's context (none: a new
    /// trace), with [`crate::RequestSpan::start`] or, for a `tracing` span, [`crate::set_parent`].
    Trace {
        /// The caller's context, read from the headers once.
        parent: Option<Parent>,
    },
    /// Create no span. `traceparent`, when set, goes to the next hop in place of the request's
    /// (which had none, or an invalid one): an unsampled context carrying the decision on.
    Skip {
        /// The header value to send on.
        traceparent: Option<String>,
    },
}

/// A valid `traceparent`: the caller's trace id, span id and flags. Version `00` has exactly
/// four fields; a later version (not `ff`) may add fields after them, which are ignored, as W3C
/// Trace Context asks. Ids of all zeros, upper-case or missing digits make it invalid (the
/// request then starts a new trace). Read by position (the fields have fixed widths): it runs
/// for every request while tracing is on.
pub(crate) fn traceparent(value: &str) -> Option<(TraceId, SpanId, u8)> {
    /// `version-trace-span-flags`: 2 + 1 + 32 + 1 + 16 + 1 + 2.
    const LEN: usize = 55;
    let v = value.trim_ascii().as_bytes();
    let (head, more) = (v.get(..LEN)?, v.get(LEN..)?);
    let dashes = [2, 35, 52].iter().all(|&i| head.get(i) == Some(&b'-'));
    let version = hex(head.get(0..2)?)?;
    let valid_tail = match (version, more.first()) {
        (_, None) => true,
        (0, Some(_)) => false,
        (_, Some(&b)) => b == b'-',
    };
    if !dashes || !valid_tail || version == 0xff {
        return None;
    }
    let trace = hex(head.get(3..35)?).filter(|&t| t != 0)?;
    let span = hex(head.get(36..52)?).filter(|&s| s != 0)?;
    let flags = hex(head.get(53..55)?)?;
    Some((
        TraceId::from(trace),
        SpanId::from(u64::try_from(span).ok()?),
        u8::try_from(flags).ok()?,
    ))
}

/// Lower-case hex digits (at most 32) as a number; `None` for any other byte.
fn hex(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |n, &b| {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        Some((n << 4) | u128::from(d))
    })
}

/// Decides one request's trace from its headers (lower-case names).
pub fn head<I: AsRef<str>>(headers: &[(I, I)]) -> Head {
    let Some(&ratio) = RATIO.get() else {
        return Head::Skip { traceparent: None };
    };
    decide(
        Parent::from_headers(headers),
        ratio,
        &RandomIdGenerator::default(),
    )
}

fn decide(caller: Option<Parent>, ratio: f64, ids: &dyn IdGenerator) -> Head {
    match caller {
        Some(parent) if parent.is_sampled() => Head::Trace {
            parent: Some(parent),
        },
        Some(_) => Head::Skip { traceparent: None },
        None => {
            let trace = ids.new_trace_id();
            if sampled(trace, ratio) {
                return Head::Trace { parent: None };
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

    /// The caller's sampled flag, when `value` is a valid `traceparent`.
    fn caller_sampled(value: &str) -> Option<bool> {
        traceparent(value).map(|(_, _, flags)| flags & 1 == 1)
    }

    fn caller(value: &str) -> Option<Parent> {
        Parent::from_headers(&[("traceparent", value)])
    }

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
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-zz-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(caller_sampled(bad), None, "{bad:?}");
        }
        // A later version's extra fields are ignored.
        for later in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever",
        ] {
            assert_eq!(caller_sampled(later), Some(true), "{later:?}");
        }
        let ids = RandomIdGenerator::default();
        assert_eq!(
            decide(caller(SAMPLED), 0.0, &ids),
            Head::Trace {
                parent: caller(SAMPLED)
            }
        );
        assert_eq!(
            decide(caller(UNSAMPLED), 1.0, &ids),
            Head::Skip { traceparent: None }
        );
    }

    #[test]
    fn without_context_the_ratio_decides_and_a_skip_carries_an_unsampled_parent() {
        let ids = RandomIdGenerator::default();
        assert_eq!(decide(None, 1.0, &ids), Head::Trace { parent: None });
        let Head::Skip {
            traceparent: Some(tp),
        } = decide(None, 0.0, &ids)
        else {
            panic!("ratio 0 never samples");
        };
        assert_eq!(caller_sampled(&tp), Some(false), "{tp}");
        let n = 20_000;
        let traced = (0..n)
            .filter(|_| decide(None, 0.1, &ids) == Head::Trace { parent: None })
            .count();
        // 10% of 20,000 draws: 2,000 ± 5 standard deviations (212).
        assert!((1_788..=2_212).contains(&traced), "{traced} of {n}");
    }

    mod props {
        use super::super::traceparent;
        use proptest::prelude::*;

        /// The specification's reading of a header, written plainly: split on `-`, check each
        /// field's width and digits, then the version's rules.
        fn naive(value: &str) -> Option<(u128, u64, u8)> {
            let fields: Vec<&str> = value.trim_matches([' ', '\t']).split('-').collect();
            let lower_hex = |f: &str, n: usize| {
                f.len() == n
                    && f.chars()
                        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            };
            let [version, trace, span, flags] = fields.get(..4)? else {
                return None;
            };
            let ok = lower_hex(version, 2)
                && *version != "ff"
                && (*version != "00" || fields.len() == 4)
                && lower_hex(trace, 32)
                && lower_hex(span, 16)
                && lower_hex(flags, 2);
            let parsed = (
                u128::from_str_radix(trace, 16).ok()?,
                u64::from_str_radix(span, 16).ok()?,
                u8::from_str_radix(flags, 16).ok()?,
            );
            (ok && parsed.0 != 0 && parsed.1 != 0).then_some(parsed)
        }

        fn header() -> impl Strategy<Value = String> {
            let valid = (
                0u8..=0xfe,
                any::<u128>(),
                any::<u64>(),
                any::<u8>(),
                0usize..3,
            )
                .prop_map(|(v, t, s, f, extra)| {
                    let mut h = format!("{v:02x}-{t:032x}-{s:016x}-{f:02x}");
                    for _ in 0..extra {
                        h.push_str("-x");
                    }
                    h
                });
            // A valid header with one byte replaced by one of the bytes that matter.
            let bytes = prop::sample::select(vec![b'-', b'0', b'f', b'g', b'A', b' ', b'\t']);
            (valid, any::<prop::sample::Index>(), bytes, any::<bool>()).prop_map(
                |(h, at, b, mutate)| {
                    if !mutate {
                        return h;
                    }
                    let mut raw = h.into_bytes();
                    let i = at.index(raw.len());
                    raw[i] = b;
                    String::from_utf8(raw).unwrap_or_default()
                },
            )
        }

        proptest! {
            #[test]
            fn reads_a_header_as_the_specification_does(h in header()) {
                let got = traceparent(&h)
                    .map(|(t, s, f)| (u128::from_be_bytes(t.to_bytes()), u64::from_be_bytes(s.to_bytes()), f));
                prop_assert_eq!(got, naive(&h), "{:?}", h);
            }
        }
    }
}
