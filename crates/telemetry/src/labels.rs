//! Bounding label values that come from outside (model names in requests).

use std::collections::HashSet;
use std::sync::{PoisonError, RwLock};

/// The value every label past the cap is folded into.
pub const OVERFLOW_LABEL: &str = "other";

/// Admits at most `cap` distinct label values; later new values map to [`OVERFLOW_LABEL`].
#[derive(Debug)]
pub struct LabelCap {
    cap: usize,
    seen: RwLock<HashSet<String>>,
}

impl LabelCap {
    /// A cap of `cap` distinct values.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            seen: RwLock::new(HashSet::new()),
        }
    }

    /// The value to emit for `value`: itself if admitted (now or before), else `other`.
    pub fn admit<'a>(&self, value: &'a str) -> &'a str {
        if self
            .seen
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(value)
        {
            return value;
        }
        let mut seen = self.seen.write().unwrap_or_else(PoisonError::into_inner);
        if seen.contains(value) {
            return value;
        }
        if seen.len() < self.cap {
            seen.insert(value.to_owned());
            value
        } else {
            OVERFLOW_LABEL
        }
    }

    /// Distinct values admitted so far.
    pub fn len(&self) -> usize {
        self.seen
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether nothing was admitted yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folds_values_past_the_cap() {
        let cap = LabelCap::new(2);
        assert_eq!(cap.admit("a"), "a");
        assert_eq!(cap.admit("b"), "b");
        assert_eq!(cap.admit("c"), OVERFLOW_LABEL);
        assert_eq!(cap.admit("a"), "a", "admitted values stay");
        assert_eq!(cap.len(), 2);
    }
}
