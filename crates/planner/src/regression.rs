//! The load mode's model: an online least-squares line of latency against load per replica,
//! with exponential forgetting (each new point multiplies the older points' weights by
//! `forgetting`). O(1) per point and per query: it keeps five weighted sums.

/// A fitted line `latency = intercept + slope · load`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    /// Latency at zero load on the line (negative when the points sit past a knee).
    pub intercept: f64,
    /// Latency added per unit of load per replica (> 0).
    pub slope: f64,
}

impl Line {
    /// The load per replica at which the line reaches `latency`; `None` when even zero load
    /// exceeds it.
    pub fn load_at(&self, latency: f64) -> Option<f64> {
        let x = (latency - self.intercept) / self.slope;
        (x.is_finite() && x > 0.0).then_some(x)
    }
}

/// Weighted sums of `(load, latency)` points.
#[derive(Debug, Clone, Default)]
pub struct Regression {
    forgetting: f64,
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

/// Fewer effective points than this give no fit.
const MIN_WEIGHT: f64 = 3.0;
/// The loads' coefficient of variation below which the slope is not trusted.
const MIN_SPREAD: f64 = 0.05;

impl Regression {
    /// An empty regression whose old points fade by `forgetting` ∈ (0, 1] per new point.
    pub fn new(forgetting: f64) -> Self {
        Self {
            forgetting,
            ..Self::default()
        }
    }

    /// Forgets every point.
    pub fn reset(&mut self) {
        *self = Self::new(self.forgetting);
    }

    /// Adds a point; non-finite or negative values are ignored.
    pub fn observe(&mut self, load: f64, latency: f64) {
        if !(load.is_finite() && latency.is_finite() && load >= 0.0 && latency >= 0.0) {
            return;
        }
        let f = self.forgetting;
        self.w = f * self.w + 1.0;
        self.sx = f * self.sx + load;
        self.sy = f * self.sy + latency;
        self.sxx = f * self.sxx + load * load;
        self.sxy = f * self.sxy + load * latency;
    }

    /// Effective number of points (Σ weights).
    pub fn weight(&self) -> f64 {
        self.w
    }

    /// The fitted line, when there are enough points, their loads are spread enough to tell
    /// a slope, and latency grows with load.
    pub fn fit(&self) -> Option<Line> {
        if self.w < MIN_WEIGHT {
            return None;
        }
        let mean_x = self.sx / self.w;
        let var_x = self.sxx / self.w - mean_x * mean_x;
        if !(mean_x > 0.0 && var_x.max(0.0).sqrt() >= MIN_SPREAD * mean_x) {
            return None;
        }
        let cov = self.sxy / self.w - mean_x * (self.sy / self.w);
        let slope = cov / var_x;
        if !(slope.is_finite() && slope > 0.0) {
            return None;
        }
        // Not clamped at zero: the line is a local fit around the points (a latency with a
        // knee gives a steep line with a negative intercept), and clamping it would move the
        // line off the points it was fitted to.
        let intercept = self.sy / self.w - slope * mean_x;
        Some(Line { intercept, slope })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_line_and_its_load_at_a_target() {
        let mut r = Regression::new(1.0);
        for x in [10.0, 20.0, 30.0, 40.0] {
            r.observe(x, 16.0 + 0.5 * x);
        }
        let line = r.fit().unwrap();
        assert!((line.slope - 0.5).abs() < 1e-9 && (line.intercept - 16.0).abs() < 1e-9);
        assert!((line.load_at(41.0).unwrap() - 50.0).abs() < 1e-9);
        assert_eq!(line.load_at(10.0), None, "below the intercept");
    }

    #[test]
    fn no_fit_without_enough_points_spread_or_a_rising_slope() {
        let mut r = Regression::new(1.0);
        r.observe(10.0, 20.0);
        r.observe(20.0, 25.0);
        assert!(r.fit().is_none(), "two points");
        let mut flat = Regression::new(1.0);
        for _ in 0..10 {
            flat.observe(30.0, 40.0);
        }
        flat.observe(30.5, 41.0);
        assert!(flat.fit().is_none(), "loads not spread");
        let mut falling = Regression::new(1.0);
        for x in [10.0, 20.0, 30.0] {
            falling.observe(x, 100.0 - x);
        }
        assert!(falling.fit().is_none(), "negative slope");
        falling.observe(f64::NAN, 1.0);
        assert_eq!(falling.weight(), 3.0);
        falling.reset();
        assert_eq!(falling.weight(), 0.0);
    }

    #[test]
    fn forgetting_follows_a_changed_line() {
        let mut r = Regression::new(0.7);
        for i in 0..30 {
            let x = 10.0 + f64::from(i % 5) * 5.0;
            r.observe(x, 10.0 + x);
        }
        for i in 0..30 {
            let x = 10.0 + f64::from(i % 5) * 5.0;
            r.observe(x, 10.0 + 3.0 * x);
        }
        let line = r.fit().unwrap();
        assert!((line.slope - 3.0).abs() < 0.05, "{line:?}");
    }
}
