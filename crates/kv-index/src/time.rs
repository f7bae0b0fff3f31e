//! Time, passed in by the caller: the index never reads a clock.

/// A point in time or a duration in milliseconds, on the caller's monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Millis(pub u64);

impl Millis {
    /// `self + d`, saturating.
    pub const fn after(self, d: Millis) -> Millis {
        Millis(self.0.saturating_add(d.0))
    }
}
