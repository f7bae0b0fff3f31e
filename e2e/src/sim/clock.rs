//! The simulator's clock: model (virtual) time runs `scale` times faster than wall time.

use std::time::{Duration, Instant};

use engine_model::Nanos;

/// Maps wall time to model time and back.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
    scale: f64,
}

impl Clock {
    /// A clock starting now; `scale` > 0 (validated by the arguments).
    pub fn new(scale: f64) -> Self {
        Self {
            origin: Instant::now(),
            scale,
        }
    }

    /// How many times faster than wall time model time runs.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The current model time.
    pub fn now(&self) -> Nanos {
        self.model_at(Instant::now())
    }

    /// The model time of a wall instant.
    pub fn model_at(&self, at: Instant) -> Nanos {
        let wall = at.saturating_duration_since(self.origin).as_nanos() as f64;
        (wall * self.scale) as Nanos
    }

    /// The wall instant at which model time `t` is reached.
    pub fn wall_at(&self, t: Nanos) -> Instant {
        self.origin + Duration::from_nanos((t as f64 / self.scale) as u64)
    }

    /// Model nanoseconds → seconds.
    pub fn seconds(t: Nanos) -> f64 {
        t as f64 / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_maps_both_ways() {
        let c = Clock::new(4.0);
        let at = c.wall_at(4_000_000_000);
        assert_eq!(at.duration_since(c.origin), Duration::from_secs(1));
        assert_eq!(c.model_at(at), 4_000_000_000);
    }
}
