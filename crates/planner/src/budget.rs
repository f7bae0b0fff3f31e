//! Sharing the GPU budget among the roles.
//!
//! Each role asks for `want` replicas (already within its bounds) from `current`. Without a
//! budget every role gets its `want`. With one:
//!
//! 1. every role keeps `min(current, want)` (scale-downs always apply), at least its minimum;
//! 2. if that alone exceeds the budget (the budget was lowered, or replicas were added by
//!    hand), roles shed replicas, the one furthest above its minimum first, down to the
//!    minimums (which the configuration guarantees fit);
//! 3. the GPUs left are granted one replica at a time to the role missing the largest fraction
//!    of its `want`, while its replica fits.
//!
//! O(roles × replicas granted or shed); roles are at most three.

/// One role's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ask {
    /// Replicas now.
    pub(crate) current: u32,
    /// Replicas wanted (within bounds).
    pub(crate) want: u32,
    /// The role's minimum.
    pub(crate) min: u32,
    /// GPUs per replica.
    pub(crate) gpus: u32,
}

/// The replicas each role gets, in `asks` order, and whether any got less than its `want`.
pub(crate) fn allocate(asks: &[Ask], budget: Option<u32>) -> (Vec<u32>, bool) {
    let Some(budget) = budget.map(u64::from) else {
        return (asks.iter().map(|a| a.want).collect(), false);
    };
    let mut got: Vec<u32> = asks
        .iter()
        .map(|a| a.current.min(a.want).max(a.min))
        .collect();
    let used = |got: &[u32]| -> u64 {
        got.iter()
            .zip(asks)
            .map(|(&n, a)| u64::from(n) * u64::from(a.gpus))
            .sum()
    };
    let mut limited = false;
    while used(&got) > budget {
        let shed = got
            .iter()
            .zip(asks)
            .enumerate()
            .filter(|(_, (n, a))| **n > a.min && a.gpus > 0)
            .max_by_key(|&(i, (n, a))| (*n - a.min, std::cmp::Reverse(i)))
            .map(|(i, _)| i);
        match shed.and_then(|i| got.get_mut(i)) {
            Some(n) => {
                *n -= 1;
                limited = true;
            }
            // Unreachable with a validated configuration (the minimums fit).
            None => break,
        }
    }
    let mut free = budget.saturating_sub(used(&got));
    loop {
        let grant = got
            .iter()
            .zip(asks)
            .enumerate()
            .filter(|(_, (n, a))| **n < a.want && u64::from(a.gpus) <= free)
            .max_by(|&(i, (n, a)), &(j, (m, b))| {
                let short = |n: u32, a: &Ask| f64::from(a.want - n) / f64::from(a.want);
                short(*n, a)
                    .total_cmp(&short(*m, b))
                    .then_with(|| j.cmp(&i))
            })
            .map(|(i, (_, a))| (i, a.gpus));
        let Some((i, gpus)) = grant else { break };
        if let Some(n) = got.get_mut(i) {
            *n += 1;
            free -= u64::from(gpus);
        }
    }
    limited |= got.iter().zip(asks).any(|(&n, a)| n < a.want);
    (got, limited)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(current: u32, want: u32, min: u32, gpus: u32) -> Ask {
        Ask {
            current,
            want,
            min,
            gpus,
        }
    }

    #[test]
    fn no_budget_grants_every_want() {
        let (got, limited) = allocate(&[ask(1, 9, 0, 1), ask(5, 2, 1, 1)], None);
        assert_eq!((got, limited), (vec![9, 2], false));
    }

    #[test]
    fn scale_downs_free_gpus_for_scale_ups_and_shortfalls_share_fairly() {
        // 10 GPUs: the second role drops to 2, the first gets 8 of its 9.
        let (got, limited) = allocate(&[ask(4, 9, 1, 1), ask(6, 2, 1, 1)], Some(10));
        assert_eq!((got, limited), (vec![8, 2], true));
        // Two roles growing: the one missing the larger fraction goes first.
        let (got, _) = allocate(&[ask(2, 4, 1, 1), ask(2, 10, 1, 1)], Some(10));
        assert_eq!(got, vec![3, 7]);
    }

    #[test]
    fn over_budget_sheds_from_the_role_furthest_above_its_minimum() {
        let (got, limited) = allocate(&[ask(6, 6, 1, 1), ask(3, 3, 1, 1)], Some(6));
        assert_eq!((got, limited), (vec![3, 3], true));
        let (got, _) = allocate(&[ask(5, 5, 5, 1), ask(3, 3, 1, 1)], Some(6));
        assert_eq!(got, vec![5, 1], "minimums are kept");
    }

    #[test]
    fn wide_replicas_only_where_they_fit() {
        // 4-GPU replicas cannot use the last 3 GPUs; the 1-GPU role can.
        let (got, limited) = allocate(&[ask(1, 3, 1, 4), ask(1, 5, 1, 1)], Some(9));
        assert_eq!((got, limited), (vec![1, 5], true));
        assert_eq!(
            allocate(&[ask(0, 3, 0, 0)], Some(0)).0,
            vec![3],
            "GPU-free roles"
        );
    }
}
