//! One-step-ahead predictors of a series (requests per second, mean input length, mean output
//! length), one observation per planner interval.
//!
//! - `Constant`: the last value.
//! - `MovingAverage`: the mean of the last `window` values.
//! - `Holt`: level and trend smoothed separately; initialised from the first two values, so a
//!   straight line is predicted exactly from the third observation on.
//! - `Kalman`: a local-linear-trend filter (state: level, slope; `x' = F x + w`,
//!   `F = [[1,1],[0,1]]`, `w` a random acceleration of variance `q` per interval, so
//!   `Q = q·[[1/4, 1/2], [1/2, 1]]`; measurement `z = level + v`, `var v = r`) on the series
//!   divided by its first non-zero value; the slope's prior is diffuse.
//!
//! Leading zeros are skipped (an idle pool before its first request says nothing about the
//! load to come), non-finite and negative values are ignored, and predictions are never
//! negative. Each observation and prediction is O(1), the moving average's O(window).

use std::collections::VecDeque;

use crate::config::PredictorKind;

/// A predictor of one series.
#[derive(Debug, Clone)]
pub struct Predictor {
    kind: PredictorKind,
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    /// Nothing but zeros seen yet.
    Idle,
    Last(f64),
    Window(VecDeque<f64>),
    Holt {
        level: f64,
        trend: Option<f64>,
    },
    Kalman {
        scale: f64,
        x: [f64; 2],
        p: [[f64; 2]; 2],
    },
}

/// The slope's prior variance: diffuse, so the second observation sets it.
const DIFFUSE: f64 = 1e9;

impl Predictor {
    /// An empty predictor.
    pub fn new(kind: PredictorKind) -> Self {
        Self {
            kind,
            state: State::Idle,
        }
    }

    /// The predictor's kind.
    pub fn kind(&self) -> PredictorKind {
        self.kind
    }

    /// Forgets everything.
    pub fn reset(&mut self) {
        self.state = State::Idle;
    }

    /// Adds the latest interval's value.
    pub fn observe(&mut self, value: f64) {
        if !(value.is_finite() && value >= 0.0) {
            return;
        }
        if matches!(self.state, State::Idle) {
            if value == 0.0 {
                return;
            }
            self.state = match self.kind {
                PredictorKind::Constant => State::Last(value),
                PredictorKind::MovingAverage { .. } => State::Window(VecDeque::from([value])),
                PredictorKind::Holt { .. } => State::Holt {
                    level: value,
                    trend: None,
                },
                PredictorKind::Kalman {
                    measurement_noise, ..
                } => State::Kalman {
                    scale: value,
                    x: [1.0, 0.0],
                    p: [[measurement_noise, 0.0], [0.0, DIFFUSE]],
                },
            };
            return;
        }
        match (&mut self.state, self.kind) {
            (State::Last(last), _) => *last = value,
            (State::Window(values), PredictorKind::MovingAverage { window }) => {
                values.push_back(value);
                while values.len() > window.max(1) as usize {
                    values.pop_front();
                }
            }
            (State::Holt { level, trend }, PredictorKind::Holt { alpha, beta }) => match trend {
                None => {
                    *trend = Some(value - *level);
                    *level = value;
                }
                Some(t) => {
                    let previous = *level;
                    *level = alpha * value + (1.0 - alpha) * (previous + *t);
                    *t = beta * (*level - previous) + (1.0 - beta) * *t;
                }
            },
            (
                State::Kalman { scale, x, p },
                PredictorKind::Kalman {
                    process_noise: q,
                    measurement_noise: r,
                },
            ) => {
                let z = value / *scale;
                // Predict: x = F x, P = F P Fᵀ + Q.
                let [l, s] = *x;
                let [[p00, p01], [p10, p11]] = *p;
                let xp = [l + s, s];
                let pp00 = p00 + p01 + p10 + p11 + q / 4.0;
                let pp01 = p01 + p11 + q / 2.0;
                let pp10 = p10 + p11 + q / 2.0;
                let pp11 = p11 + q;
                // Update with z = H x + v, H = [1, 0].
                let innovation = z - xp[0];
                let s_var = pp00 + r;
                let (k0, k1) = (pp00 / s_var, pp10 / s_var);
                *x = [xp[0] + k0 * innovation, xp[1] + k1 * innovation];
                *p = [
                    [(1.0 - k0) * pp00, (1.0 - k0) * pp01],
                    [pp10 - k1 * pp00, pp11 - k1 * pp01],
                ];
            }
            // A kind and a state always match (both come from `self.kind`).
            _ => {}
        }
    }

    /// The next interval's value; `None` before the first non-zero observation.
    pub fn predict(&self) -> Option<f64> {
        let v = match &self.state {
            State::Idle => return None,
            State::Last(v) => *v,
            State::Window(values) => values.iter().sum::<f64>() / values.len().max(1) as f64,
            State::Holt { level, trend } => *level + trend.unwrap_or(0.0),
            State::Kalman { scale, x, .. } => (x[0] + x[1]) * *scale,
        };
        Some(v.max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded uniform draw in [-1, 1) (splitmix64).
    fn noise(state: &mut u64) -> f64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    fn run(kind: PredictorKind, series: &[f64]) -> Vec<Option<f64>> {
        let mut p = Predictor::new(kind);
        series
            .iter()
            .map(|&v| {
                p.observe(v);
                p.predict()
            })
            .collect()
    }

    const HOLT: PredictorKind = PredictorKind::Holt {
        alpha: 0.5,
        beta: 0.3,
    };
    const KALMAN: PredictorKind = PredictorKind::Kalman {
        process_noise: 1e-6,
        measurement_noise: 1e-2,
    };

    #[test]
    fn every_predictor_returns_a_constant_series() {
        let series = [7.5; 20];
        for kind in [
            PredictorKind::Constant,
            PredictorKind::MovingAverage { window: 4 },
            HOLT,
            KALMAN,
        ] {
            for p in run(kind, &series) {
                let p = p.unwrap();
                assert!((p - 7.5).abs() < 1e-9, "{kind:?}: {p}");
            }
        }
    }

    #[test]
    fn constant_is_the_last_value_and_moving_average_the_window_mean() {
        let series = [1.0, 2.0, 3.0, 4.0, 10.0];
        let c = run(PredictorKind::Constant, &series);
        assert_eq!(c, series.map(Some));
        let m = run(PredictorKind::MovingAverage { window: 3 }, &series);
        assert_eq!(m, [1.0, 1.5, 2.0, 3.0, 17.0 / 3.0].map(Some));
    }

    #[test]
    fn holt_predicts_a_linear_trend_exactly() {
        let series: Vec<f64> = (0..30).map(|i| 10.0 + 2.5 * f64::from(i)).collect();
        let predictions = run(HOLT, &series);
        for (i, p) in predictions.iter().enumerate().skip(1) {
            let want = 10.0 + 2.5 * (i as f64 + 1.0);
            assert!((p.unwrap() - want).abs() < 1e-9, "step {i}");
        }
        // A constant predictor lags the same line by one step.
        let lag = run(PredictorKind::Constant, &series);
        assert!((lag[10].unwrap() - (10.0 + 25.0)).abs() < 1e-9);
    }

    #[test]
    fn kalman_smooths_a_noisy_constant_better_than_the_last_value() {
        let mut seed = 42;
        let series: Vec<f64> = (0..400).map(|_| 100.0 + 10.0 * noise(&mut seed)).collect();
        let k = run(KALMAN, &series);
        let c = run(PredictorKind::Constant, &series);
        // Prediction error on the next value against the true level (100), after a burn-in.
        let err = |p: &[Option<f64>]| {
            p[100..399]
                .iter()
                .map(|v| (v.unwrap() - 100.0).abs())
                .sum::<f64>()
                / 299.0
        };
        assert!(err(&k) < 2.0, "kalman error {}", err(&k));
        assert!(err(&k) < err(&c) / 2.5, "{} vs {}", err(&k), err(&c));
        assert!((k[399].unwrap() - 100.0).abs() < 3.0);
    }

    #[test]
    fn kalman_follows_a_trend() {
        let series: Vec<f64> = (0..60).map(|i| 50.0 + 5.0 * f64::from(i)).collect();
        let k = run(KALMAN, &series);
        for (i, p) in k.iter().enumerate().skip(10) {
            let want = 50.0 + 5.0 * (i as f64 + 1.0);
            assert!((p.unwrap() - want).abs() < 0.01 * want, "step {i}: {p:?}");
        }
    }

    #[test]
    fn leading_zeros_and_bad_values_are_skipped_and_predictions_stay_non_negative() {
        for kind in [PredictorKind::Constant, HOLT, KALMAN] {
            let mut p = Predictor::new(kind);
            for v in [0.0, 0.0, f64::NAN, -3.0] {
                p.observe(v);
                assert_eq!(p.predict(), None, "{kind:?}");
            }
            p.observe(4.0);
            assert_eq!(p.predict(), Some(4.0), "{kind:?}");
            p.observe(f64::INFINITY);
            assert_eq!(p.predict(), Some(4.0), "{kind:?}");
            p.reset();
            assert_eq!(p.predict(), None);
        }
        let falling = run(HOLT, &[10.0, 5.0, 0.0]);
        assert_eq!(falling[2], Some(0.0), "a falling trend predicts 0, not −5");
    }
}
