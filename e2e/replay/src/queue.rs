//! The event queue: events ordered by virtual time, equal times in insertion order.
//!
//! A binary heap keyed on `(time, sequence)`: the sequence number makes the order total and
//! deterministic, so a replay with the same inputs processes the same events in the same order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use engine_model::Nanos;

/// A min-queue of `(time, event)` pairs; pops the earliest, first-pushed first among equals.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<Entry<E>>>,
    next_seq: u64,
}

#[derive(Debug)]
struct Entry<E> {
    at: Nanos,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Entry<E> {}

impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self {
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }
}

impl<E> EventQueue<E> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Schedules `event` at `at`.
    pub fn push(&mut self, at: Nanos, event: E) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Reverse(Entry { at, seq, event }));
    }

    /// The earliest event, first pushed among equal times.
    pub fn pop(&mut self) -> Option<(Nanos, E)> {
        self.heap.pop().map(|Reverse(e)| (e.at, e.event))
    }

    /// The time of the earliest event.
    pub fn peek_time(&self) -> Option<Nanos> {
        self.heap.peek().map(|Reverse(e)| e.at)
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no event waits.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Push(Nanos),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![(0u64..20).prop_map(Op::Push), Just(Op::Pop)]
    }

    proptest! {
        /// Against a naive model: a list searched for the earliest time, first inserted first.
        #[test]
        fn pops_like_a_stable_sorted_list(ops in proptest::collection::vec(op(), 0..200)) {
            let mut q = EventQueue::new();
            let mut model: Vec<(Nanos, usize)> = Vec::new();
            for (i, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push(at) => {
                        q.push(at, i);
                        model.push((at, i));
                    }
                    Op::Pop => {
                        let want = model
                            .iter()
                            .enumerate()
                            .min_by_key(|(_, (at, id))| (*at, *id))
                            .map(|(pos, _)| pos)
                            .map(|pos| model.remove(pos));
                        prop_assert_eq!(q.peek_time(), want.map(|(at, _)| at));
                        prop_assert_eq!(q.pop(), want);
                    }
                }
                prop_assert_eq!(q.len(), model.len());
            }
        }
    }

    #[test]
    fn equal_times_pop_in_push_order() {
        let mut q = EventQueue::new();
        q.push(5, 'a');
        q.push(1, 'b');
        q.push(5, 'c');
        assert_eq!(q.pop(), Some((1, 'b')));
        assert_eq!(q.pop(), Some((5, 'a')));
        assert_eq!(q.pop(), Some((5, 'c')));
        assert!(q.is_empty());
    }
}
