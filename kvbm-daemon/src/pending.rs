//! The puts of one lower tier's write queue that are not done yet, as a small state machine
//! (pure; the service holds it under a mutex beside the queue's channel).
//!
//! Per block name it keeps the latest bytes (onboards read them while the write is pending)
//! and three counts:
//! - **queued**: puts sent to the writer and not yet taken by it;
//! - **writing**: puts the writer took and has not finished;
//! - **superseded**: queued puts a later delete of the name made pointless. The store queues a
//!   delete when the block leaves the tier, so whatever those puts would write the delete
//!   removes again; the writer skips them. The channel is first in, first out and a name's
//!   operations are sent in the order they are recorded here, so the first `superseded` puts
//!   of a name the writer takes are exactly those.
//!
//! The queue's bounds apply to the queued and writing puts: a superseded put frees its room
//! when its delete is queued, not when the writer reaches it. When a tier is slower than the
//! blocks flowing through it, most queued puts are of blocks its budget has already evicted
//! again, and writing them only to delete them is what would fill the queue.

use std::collections::HashMap;

use bytes::Bytes;

/// One name's pending puts.
#[derive(Debug)]
struct Entry {
    data: Bytes,
    queued: u32,
    writing: u32,
    superseded: u32,
}

/// The pending puts of one tier.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    puts: HashMap<String, Entry>,
    ops: usize,
    bytes: u64,
}

impl Pending {
    /// Records a put about to be sent, unless it would take the queued and writing puts over
    /// `max_ops` or `max_bytes`: then false, and nothing changes.
    pub(crate) fn push(
        &mut self,
        name: &str,
        data: &Bytes,
        max_ops: usize,
        max_bytes: u64,
    ) -> bool {
        let len = data.len() as u64;
        if self.ops >= max_ops || self.bytes.saturating_add(len) > max_bytes {
            return false;
        }
        self.ops += 1;
        self.bytes += len;
        match self.puts.get_mut(name) {
            Some(e) => {
                e.data = data.clone();
                e.queued += 1;
            }
            None => {
                self.puts.insert(
                    name.to_owned(),
                    Entry {
                        data: data.clone(),
                        queued: 1,
                        writing: 0,
                        superseded: 0,
                    },
                );
            }
        }
        true
    }

    /// The writer took a put of `name` from the channel: true to write it, false to skip it
    /// (a later delete superseded it; its room is already free).
    pub(crate) fn take(&mut self, name: &str) -> bool {
        let Some(e) = self.puts.get_mut(name) else {
            return true;
        };
        if e.superseded > 0 {
            e.superseded -= 1;
            self.remove_if_idle(name);
            return false;
        }
        if e.queued > 0 {
            e.queued -= 1;
            e.writing += 1;
        }
        true
    }

    /// A put of `name` the writer took is done (written or failed).
    pub(crate) fn done(&mut self, name: &str) {
        self.forget_one(name, |e| &mut e.writing);
    }

    /// A put of `name` recorded by [`Pending::push`] was never sent (the writer is gone).
    pub(crate) fn unsent(&mut self, name: &str) {
        self.forget_one(name, |e| &mut e.queued);
    }

    /// Takes one put of `name` off the count `which` picks, if it has one, and frees its room.
    fn forget_one(&mut self, name: &str, which: fn(&mut Entry) -> &mut u32) {
        let Some(count) = self.puts.get_mut(name).map(which).filter(|c| **c > 0) else {
            return;
        };
        *count -= 1;
        self.release(name, 1);
    }

    /// A delete of `name` is about to be sent: the puts of it still queued are superseded.
    /// Returns how many.
    pub(crate) fn supersede(&mut self, name: &str) -> u32 {
        let Some(e) = self.puts.get_mut(name) else {
            return 0;
        };
        let n = e.queued;
        e.queued = 0;
        e.superseded += n;
        self.release(name, n);
        n
    }

    /// The bytes of a put of `name` queued or being written.
    pub(crate) fn readable(&self, name: &str) -> Option<Bytes> {
        self.puts
            .get(name)
            .filter(|e| e.queued + e.writing > 0)
            .map(|e| e.data.clone())
    }

    /// Block bytes of the puts queued or being written.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Frees the room of `n` puts of `name` and drops the entry once nothing refers to it.
    fn release(&mut self, name: &str, n: u32) {
        let len = self.puts.get(name).map_or(0, |e| e.data.len() as u64);
        self.ops = self.ops.saturating_sub(n as usize);
        self.bytes = self.bytes.saturating_sub(len * u64::from(n));
        self.remove_if_idle(name);
    }

    fn remove_if_idle(&mut self, name: &str) {
        if self
            .puts
            .get(name)
            .is_some_and(|e| e.queued == 0 && e.writing == 0 && e.superseded == 0)
        {
            self.puts.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    fn block(byte: u8) -> Bytes {
        Bytes::from(vec![byte; 4])
    }

    #[test]
    fn a_delete_supersedes_the_queued_puts_only() {
        let mut p = Pending::default();
        assert!(p.push("a", &block(1), 10, 100));
        assert!(p.take("a"), "taken before the delete: written");
        assert!(p.push("a", &block(2), 10, 100));
        assert!(p.push("a", &block(3), 10, 100));
        assert_eq!(p.supersede("a"), 2);
        assert_eq!(p.bytes(), 4, "only the put being written holds room");
        assert!(p.push("a", &block(4), 10, 100));
        assert_eq!(p.readable("a"), Some(block(4)));
        assert!(!p.take("a") && !p.take("a"), "the two superseded puts");
        assert!(p.take("a"), "the put queued after the delete");
        p.done("a");
        p.done("a");
        assert_eq!((p.bytes(), p.readable("a")), (0, None));
        assert!(p.puts.is_empty());
    }

    #[test]
    fn bounds_count_ops_and_bytes() {
        let mut p = Pending::default();
        assert!(p.push("a", &block(1), 2, 100));
        assert!(p.push("b", &block(1), 2, 100));
        assert!(!p.push("c", &block(1), 2, 100), "two ops at most");
        p.supersede("a");
        assert!(
            p.push("c", &block(1), 2, 100),
            "a superseded put frees its room"
        );
        assert!(!p.push("d", &block(1), 10, 11), "twelve bytes over eleven");
        p.unsent("c");
        assert_eq!(p.bytes(), 4);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u8),
        Delete(u8),
        /// The writer takes the channel's next operation.
        Take,
        /// The writer finishes its oldest write in progress.
        Done,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..3).prop_map(Op::Push),
            1 => (0u8..3).prop_map(Op::Delete),
            3 => Just(Op::Take),
            2 => Just(Op::Done),
        ]
    }

    proptest! {
        /// Against a naive model: the channel as a list, each put marked superseded when a
        /// delete of its name is sent after it. The writer writes exactly the puts no later
        /// delete followed, in order; the room held is that of the unsuperseded puts not done.
        #[test]
        fn agrees_with_a_channel_of_marked_puts(ops in proptest::collection::vec(op(), 0..200)) {
            const MAX_OPS: usize = 5;
            let mut p = Pending::default();
            // (name, is_put, superseded)
            let mut channel: VecDeque<(u8, bool, bool)> = VecDeque::new();
            let mut writing: VecDeque<u8> = VecDeque::new();
            let mut latest: HashMap<u8, u8> = HashMap::new();
            let mut version = 0u8;
            for op in ops {
                match op {
                    Op::Push(n) => {
                        version = version.wrapping_add(1);
                        let held = channel.iter().filter(|c| c.1 && !c.2).count() + writing.len();
                        let accepted = p.push(&n.to_string(), &block(version), MAX_OPS, u64::MAX);
                        prop_assert_eq!(accepted, held < MAX_OPS);
                        if accepted {
                            channel.push_back((n, true, false));
                            latest.insert(n, version);
                        }
                    }
                    Op::Delete(n) => {
                        let superseded = p.supersede(&n.to_string());
                        let mut expected = 0;
                        for c in channel.iter_mut().filter(|c| c.0 == n && c.1 && !c.2) {
                            c.2 = true;
                            expected += 1;
                        }
                        prop_assert_eq!(superseded, expected);
                        channel.push_back((n, false, false));
                    }
                    Op::Take => {
                        if let Some((n, true, superseded)) = channel.pop_front() {
                            prop_assert_eq!(p.take(&n.to_string()), !superseded);
                            if !superseded {
                                writing.push_back(n);
                            }
                        }
                    }
                    Op::Done => {
                        if let Some(n) = writing.pop_front() {
                            p.done(&n.to_string());
                        }
                    }
                }
                let held = channel.iter().filter(|c| c.1 && !c.2).count() + writing.len();
                prop_assert_eq!(p.bytes(), held as u64 * 4);
                for n in 0u8..3 {
                    let live = channel.iter().any(|c| c.0 == n && c.1 && !c.2)
                        || writing.contains(&n);
                    let expected = live.then(|| block(latest[&n]));
                    prop_assert_eq!(p.readable(&n.to_string()), expected);
                }
            }
            // Drained, nothing is left behind.
            while let Some((n, is_put, superseded)) = channel.pop_front() {
                if is_put {
                    prop_assert_eq!(p.take(&n.to_string()), !superseded);
                    if !superseded {
                        writing.push_back(n);
                    }
                }
            }
            while let Some(n) = writing.pop_front() {
                p.done(&n.to_string());
            }
            prop_assert!(p.puts.is_empty());
            prop_assert_eq!((p.ops, p.bytes), (0, 0));
        }
    }
}
