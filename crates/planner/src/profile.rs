//! A replica's measured performance: prefill TTFT against prefill load, and decode throughput
//! against inter-token latency and context length. `kvgate-bench profile` measures one on the
//! engine model (or a live simulator) and writes it as YAML into a ConfigMap.
//!
//! Every lookup is piecewise linear between measured points (bilinear over the decode grid)
//! and clamped at the edges: the planner never extrapolates a capacity beyond what was
//! measured. Lookups are O(points) (the tables are a few dozen entries).

use serde::{Deserialize, Serialize};

/// One measured prefill point of a single replica.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillPoint {
    /// Prompt tokens per second offered to the replica.
    pub tokens_per_s: f64,
    /// TTFT at the profile's percentile under that load, milliseconds.
    pub ttft_ms: f64,
}

/// Decode throughput of a single replica over a grid of context lengths × inter-token
/// latencies (the latency grows with the batch, and so does the throughput).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTable {
    /// Context lengths (tokens per sequence), strictly increasing.
    pub context_tokens: Vec<f64>,
    /// Inter-token latencies, milliseconds, strictly increasing.
    pub itl_ms: Vec<f64>,
    /// Output tokens per second, one row per context length, one column per ITL; each row
    /// non-decreasing (a replica allowed a longer ITL batches more).
    pub tokens_per_s: Vec<Vec<f64>>,
}

/// A replica's profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// What was measured: the engine, the prompt length, the percentile (free text, for people).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// Prefill: TTFT against load, by strictly increasing load, TTFT non-decreasing.
    pub prefill: Vec<PrefillPoint>,
    /// Decode: throughput against ITL and context.
    pub decode: DecodeTable,
}

/// A profile the planner cannot use.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// No prefill point, or an empty decode axis.
    #[error("{0} is empty")]
    Empty(&'static str),
    /// A value that must be finite and non-negative (positive for axes and loads) is not.
    #[error("{field}[{index}] = {value} is not a valid number here")]
    BadNumber {
        /// Which table.
        field: &'static str,
        /// Position.
        index: usize,
        /// The value.
        value: f64,
    },
    /// Points or an axis out of order.
    #[error("{field} must be strictly increasing (at {index})")]
    NotIncreasing {
        /// Which table.
        field: &'static str,
        /// Position of the first offending value.
        index: usize,
    },
    /// A latency or throughput that falls where it should grow.
    #[error("{field} must not decrease (at {index})")]
    Decreasing {
        /// Which table.
        field: &'static str,
        /// Position of the first offending value.
        index: usize,
    },
    /// The throughput grid does not match the axes.
    #[error("decode.tokens_per_s is {rows}×{cols}, the axes want {want_rows}×{want_cols}")]
    Shape {
        /// Rows given.
        rows: usize,
        /// Columns of the first bad row.
        cols: usize,
        /// Context lengths.
        want_rows: usize,
        /// ITLs.
        want_cols: usize,
    },
}

impl ProfileError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Empty(_) => "empty",
            Self::BadNumber { .. } => "bad_number",
            Self::NotIncreasing { .. } => "not_increasing",
            Self::Decreasing { .. } => "decreasing",
            Self::Shape { .. } => "shape",
        }
    }
}

fn check_axis(field: &'static str, axis: &[f64]) -> Result<(), ProfileError> {
    if axis.is_empty() {
        return Err(ProfileError::Empty(field));
    }
    for (index, &value) in axis.iter().enumerate() {
        if !(value.is_finite() && value > 0.0) {
            return Err(ProfileError::BadNumber {
                field,
                index,
                value,
            });
        }
    }
    if let Some(index) = axis.windows(2).position(|w| matches!(w, [a, b] if b <= a)) {
        return Err(ProfileError::NotIncreasing {
            field,
            index: index + 1,
        });
    }
    Ok(())
}

/// Where `x` falls on `axis`: the lower index and the weight of the upper one, clamped.
fn locate(axis: &[f64], x: f64) -> (usize, f64) {
    let last = axis.len().saturating_sub(1);
    match axis.iter().position(|&a| a >= x) {
        None => (last, 0.0),
        Some(0) => (0, 0.0),
        Some(hi) => {
            let lo = hi - 1;
            match (axis.get(lo), axis.get(hi)) {
                (Some(&a), Some(&b)) if b > a => (lo, ((x - a) / (b - a)).clamp(0.0, 1.0)),
                _ => (hi, 0.0),
            }
        }
    }
}

fn lerp(a: f64, b: f64, w: f64) -> f64 {
    a + (b - a) * w
}

/// Interpolates `ys` over increasing `xs` at `x`, clamped at both ends.
fn interpolate(xs: &[f64], ys: &[f64], x: f64) -> f64 {
    let (i, w) = locate(xs, x);
    let y0 = ys.get(i).copied().unwrap_or(0.0);
    let y1 = ys.get(i + 1).copied().unwrap_or(y0);
    lerp(y0, y1, w)
}

/// The smallest `x` with `f(x) ≥ y` on the piecewise-linear, non-decreasing `(xs, ys)`,
/// clamped to the ends.
fn invert(xs: &[f64], ys: &[f64], y: f64) -> f64 {
    let first_x = xs.first().copied().unwrap_or(0.0);
    match ys.iter().position(|&v| v >= y) {
        None => xs.last().copied().unwrap_or(0.0),
        Some(0) => first_x,
        Some(hi) => match (xs.get(hi - 1), xs.get(hi), ys.get(hi - 1), ys.get(hi)) {
            (Some(&x0), Some(&x1), Some(&y0), Some(&y1)) if y1 > y0 => {
                lerp(x0, x1, ((y - y0) / (y1 - y0)).clamp(0.0, 1.0))
            }
            (_, Some(&x1), _, _) => x1,
            _ => first_x,
        },
    }
}

impl Profile {
    /// Checks shapes, orders and numbers.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.prefill.is_empty() {
            return Err(ProfileError::Empty("prefill"));
        }
        let loads: Vec<f64> = self.prefill.iter().map(|p| p.tokens_per_s).collect();
        check_axis("prefill.tokens_per_s", &loads)?;
        for (index, p) in self.prefill.iter().enumerate() {
            if !(p.ttft_ms.is_finite() && p.ttft_ms > 0.0) {
                return Err(ProfileError::BadNumber {
                    field: "prefill.ttft_ms",
                    index,
                    value: p.ttft_ms,
                });
            }
        }
        if let Some(index) = self
            .prefill
            .windows(2)
            .position(|w| matches!(w, [a, b] if b.ttft_ms < a.ttft_ms))
        {
            return Err(ProfileError::Decreasing {
                field: "prefill.ttft_ms",
                index: index + 1,
            });
        }
        let d = &self.decode;
        check_axis("decode.context_tokens", &d.context_tokens)?;
        check_axis("decode.itl_ms", &d.itl_ms)?;
        let bad_row = d
            .tokens_per_s
            .iter()
            .find(|r| r.len() != d.itl_ms.len())
            .map(Vec::len);
        if d.tokens_per_s.len() != d.context_tokens.len() || bad_row.is_some() {
            return Err(ProfileError::Shape {
                rows: d.tokens_per_s.len(),
                cols: bad_row.unwrap_or(d.itl_ms.len()),
                want_rows: d.context_tokens.len(),
                want_cols: d.itl_ms.len(),
            });
        }
        for (r, row) in d.tokens_per_s.iter().enumerate() {
            for (c, &value) in row.iter().enumerate() {
                if !(value.is_finite() && value >= 0.0) {
                    return Err(ProfileError::BadNumber {
                        field: "decode.tokens_per_s",
                        index: r * row.len() + c,
                        value,
                    });
                }
            }
            if let Some(c) = row.windows(2).position(|w| matches!(w, [a, b] if b < a)) {
                return Err(ProfileError::Decreasing {
                    field: "decode.tokens_per_s",
                    index: r * row.len() + c + 1,
                });
            }
        }
        Ok(())
    }

    /// Prompt tokens/s one replica sustains with TTFT at most `ttft_ms`: the load where the
    /// measured curve crosses the target. If even the lightest measured load misses it, that
    /// load (nothing does better); if the heaviest meets it, the heaviest (no extrapolation).
    pub fn prefill_capacity(&self, ttft_ms: f64) -> f64 {
        let loads: Vec<f64> = self.prefill.iter().map(|p| p.tokens_per_s).collect();
        let ttfts: Vec<f64> = self.prefill.iter().map(|p| p.ttft_ms).collect();
        // The largest load whose TTFT is within the target: the crossing of the first segment
        // that ends above it.
        match ttfts.iter().position(|&t| t > ttft_ms) {
            None => loads.last().copied().unwrap_or(0.0),
            Some(0) => loads.first().copied().unwrap_or(0.0),
            Some(hi) => match (
                loads.get(hi - 1),
                loads.get(hi),
                ttfts.get(hi - 1),
                ttfts.get(hi),
            ) {
                (Some(&l0), Some(&l1), Some(&t0), Some(&t1)) if t1 > t0 => {
                    lerp(l0, l1, ((ttft_ms - t0) / (t1 - t0)).clamp(0.0, 1.0))
                }
                (Some(&l0), ..) => l0,
                _ => 0.0,
            },
        }
    }

    /// The TTFT the profile expects at `tokens_per_s` per replica: interpolated, the lightest
    /// point's below the range, the last segment extended above it (overload keeps growing).
    pub fn expected_ttft(&self, tokens_per_s: f64) -> f64 {
        let loads: Vec<f64> = self.prefill.iter().map(|p| p.tokens_per_s).collect();
        let ttfts: Vec<f64> = self.prefill.iter().map(|p| p.ttft_ms).collect();
        let n = loads.len();
        match (
            loads.get(n.wrapping_sub(2)),
            loads.last(),
            ttfts.get(n.wrapping_sub(2)),
            ttfts.last(),
        ) {
            (Some(&l0), Some(&l1), Some(&t0), Some(&t1)) if tokens_per_s > l1 && l1 > l0 => {
                t1 + (t1 - t0) / (l1 - l0) * (tokens_per_s - l1)
            }
            _ => interpolate(&loads, &ttfts, tokens_per_s),
        }
    }

    /// The decode row at `context` (linear between the two nearest measured contexts).
    fn decode_row(&self, context: f64) -> Vec<f64> {
        let d = &self.decode;
        let (i, w) = locate(&d.context_tokens, context);
        let lo = d.tokens_per_s.get(i);
        let hi = d.tokens_per_s.get(i + 1).or(lo);
        match (lo, hi) {
            (Some(lo), Some(hi)) => lo.iter().zip(hi).map(|(&a, &b)| lerp(a, b, w)).collect(),
            _ => Vec::new(),
        }
    }

    /// Output tokens/s one replica sustains at inter-token latency `itl_ms` with `context`
    /// tokens per sequence: bilinear over the grid, clamped to its edges.
    pub fn decode_capacity(&self, itl_ms: f64, context: f64) -> f64 {
        interpolate(&self.decode.itl_ms, &self.decode_row(context), itl_ms)
    }

    /// Sequences one replica decodes at once at inter-token latency `itl_ms` and `context`
    /// (Little's law: tokens/s × seconds per token), at the least ITL where the profile
    /// reaches its capacity there: past an engine's largest batch the capacity stays flat and
    /// so does the batch, however long the ITL allowed.
    pub fn decode_sequences(&self, itl_ms: f64, context: f64) -> f64 {
        let capacity = self.decode_capacity(itl_ms, context);
        capacity * self.expected_itl(capacity, context).min(itl_ms) / 1000.0
    }

    /// The ITL the profile expects when one replica produces `tokens_per_s` at `context`:
    /// the smallest profiled ITL reaching that throughput, clamped to the grid.
    pub fn expected_itl(&self, tokens_per_s: f64, context: f64) -> f64 {
        invert(&self.decode.itl_ms, &self.decode_row(context), tokens_per_s)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A profile with simple numbers: prefill TTFT 500 ms up to 4k tokens/s, 2 s at 8k, 6 s at
    /// 10k; decode throughput `f(c, l) = 100 + l·(20 − c/1000)` on a 2 × 3 grid (bilinear).
    pub(crate) fn profile() -> Profile {
        let f = |c: f64, l: f64| 100.0 + l * (20.0 - c / 1000.0);
        let contexts = vec![1000.0, 9000.0];
        let itls = vec![10.0, 50.0, 100.0];
        Profile {
            description: "test".into(),
            prefill: vec![
                PrefillPoint {
                    tokens_per_s: 1000.0,
                    ttft_ms: 500.0,
                },
                PrefillPoint {
                    tokens_per_s: 4000.0,
                    ttft_ms: 500.0,
                },
                PrefillPoint {
                    tokens_per_s: 8000.0,
                    ttft_ms: 2000.0,
                },
                PrefillPoint {
                    tokens_per_s: 10000.0,
                    ttft_ms: 6000.0,
                },
            ],
            decode: DecodeTable {
                tokens_per_s: contexts
                    .iter()
                    .map(|&c| itls.iter().map(|&l| f(c, l)).collect())
                    .collect(),
                context_tokens: contexts,
                itl_ms: itls,
            },
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn prefill_capacity_is_where_the_curve_crosses_the_target() {
        let p = profile();
        assert!(close(p.prefill_capacity(2000.0), 8000.0));
        assert!(close(p.prefill_capacity(1250.0), 6000.0));
        assert!(close(p.prefill_capacity(4000.0), 9000.0));
        assert!(close(p.prefill_capacity(500.0), 4000.0), "flat start");
        assert!(
            close(p.prefill_capacity(100.0), 1000.0),
            "unreachable: the lightest"
        );
        assert!(close(p.prefill_capacity(1e9), 10000.0), "no extrapolation");
    }

    #[test]
    fn expected_ttft_interpolates_and_extends_the_last_segment() {
        let p = profile();
        assert!(close(p.expected_ttft(6000.0), 1250.0));
        assert!(close(p.expected_ttft(10.0), 500.0));
        assert!(close(p.expected_ttft(11000.0), 8000.0));
    }

    #[test]
    fn decode_sequences_stop_growing_where_the_capacity_does() {
        let p = profile();
        // Rising everywhere: capacity × ITL.
        let f = |c: f64, l: f64| 100.0 + l * (20.0 - c / 1000.0);
        assert!(close(
            p.decode_sequences(50.0, 1000.0),
            f(1000.0, 50.0) * 0.05
        ));
        // Flat past 20 ms (a batch limit: 64 sequences at 20 ms): the batch stays 64.
        let flat = Profile {
            decode: DecodeTable {
                context_tokens: vec![1000.0],
                itl_ms: vec![10.0, 20.0, 50.0],
                tokens_per_s: vec![vec![1600.0, 3200.0, 3200.0]],
            },
            ..p
        };
        assert!(close(flat.decode_sequences(50.0, 1000.0), 64.0));
        assert!(close(flat.decode_sequences(15.0, 1000.0), 2400.0 * 0.015));
    }

    #[test]
    fn decode_is_bilinear_inside_and_clamped_outside() {
        let p = profile();
        let f = |c: f64, l: f64| 100.0 + l * (20.0 - c / 1000.0);
        for (c, l) in [
            (1000.0, 10.0),
            (5000.0, 30.0),
            (8999.0, 99.0),
            (3000.0, 75.0),
        ] {
            assert!(close(p.decode_capacity(l, c), f(c, l)), "{c} {l}");
        }
        assert!(close(p.decode_capacity(5.0, 0.0), f(1000.0, 10.0)));
        assert!(close(p.decode_capacity(500.0, 1e6), f(9000.0, 100.0)));
        // The inverse: the ITL that yields a throughput.
        assert!(close(p.expected_itl(f(5000.0, 30.0), 5000.0), 30.0));
        assert!(close(p.expected_itl(0.0, 5000.0), 10.0));
        assert!(close(p.expected_itl(1e9, 5000.0), 100.0));
    }

    #[test]
    fn validation_names_the_fault() {
        let check = |f: &dyn Fn(&mut Profile)| {
            let mut p = profile();
            f(&mut p);
            p.validate().unwrap_err().metric_label()
        };
        profile().validate().unwrap();
        assert_eq!(check(&|p| p.prefill.clear()), "empty");
        assert_eq!(
            check(&|p| p.prefill[1].tokens_per_s = 1000.0),
            "not_increasing"
        );
        assert_eq!(check(&|p| p.prefill[2].ttft_ms = 100.0), "decreasing");
        assert_eq!(check(&|p| p.prefill[0].ttft_ms = f64::NAN), "bad_number");
        assert_eq!(check(&|p| p.decode.itl_ms.clear()), "empty");
        assert_eq!(check(&|p| p.decode.itl_ms[0] = -1.0), "bad_number");
        assert_eq!(
            check(&|p| p.decode.tokens_per_s[1].pop().map(drop).unwrap()),
            "shape"
        );
        assert_eq!(
            check(&|p| p.decode.tokens_per_s.pop().map(drop).unwrap()),
            "shape"
        );
        assert_eq!(check(&|p| p.decode.tokens_per_s[0][2] = 0.0), "decreasing");
        assert_eq!(
            check(&|p| p.decode.tokens_per_s[0][0] = f64::INFINITY),
            "bad_number"
        );
    }

    #[test]
    fn profiles_read_from_yaml() {
        let text = "prefill:\n- {tokens_per_s: 1000, ttft_ms: 400}\n\
                    decode:\n  context_tokens: [2048]\n  itl_ms: [20, 40]\n  tokens_per_s: [[500, 900]]\n";
        let p: Profile = serde_yaml_ng::from_str(text).unwrap();
        p.validate().unwrap();
        assert!(close(p.decode_capacity(30.0, 100.0), 700.0));
        assert!(close(p.prefill_capacity(400.0), 1000.0));
        let back: Profile =
            serde_yaml_ng::from_str(&serde_yaml_ng::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}
