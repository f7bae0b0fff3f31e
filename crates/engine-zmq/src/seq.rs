//! The sequence checker: which engine frames follow on from the last one delivered.
//!
//! Engines number their batches from 0, contiguously per publisher start, and one publisher's
//! live stream only moves forward. A live frame above the expected seq means frames were lost
//! (repair through replay, or resynchronise). A live frame at or below the last live one, or
//! at seq 0 below the expected one, comes from a new publisher: the engine restarted, even when
//! its first frames were missed while the subscriber reconnected. Anything else below the
//! expected seq is a duplicate (live frames buffered while a replay already delivered them).

/// What a frame's seq means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqOutcome {
    /// In sequence: deliver it (the checker now expects the next seq).
    Deliver,
    /// Frames `from..got` are missing; the frame was NOT accepted.
    Gap {
        /// The first missing seq.
        from: u64,
        /// The frame's seq.
        got: u64,
    },
    /// The engine restarted: the frame was NOT accepted, and the checker now expects seq 0 of
    /// the new stream. Check the frame again: it is delivered when it is seq 0, and otherwise
    /// the frames of the new stream before it are a gap to repair.
    Restarted,
    /// Already delivered; drop it.
    Duplicate,
}

/// Tracks the next expected seq of one engine stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sequencer {
    next: Option<u64>,
    /// The last live frame delivered since the last restart.
    last_live: Option<u64>,
}

impl Sequencer {
    /// A checker that accepts whatever seq comes first.
    pub fn new() -> Self {
        Self::default()
    }

    /// The seq expected next, once known.
    pub fn expected(&self) -> Option<u64> {
        self.next
    }

    /// Expects `seq` next (after a resynchronisation, or to catch up from the start).
    pub fn expect(&mut self, seq: u64) {
        self.next = Some(seq);
    }

    /// Starts over with a new stream (the engine restarted): seq 0 is expected next.
    pub fn restart(&mut self) {
        self.next = Some(0);
        self.last_live = None;
    }

    /// Forgets the position: the next frame is accepted whatever its seq.
    pub fn reset(&mut self) {
        self.next = None;
    }

    /// Checks a live frame.
    pub fn on_live(&mut self, seq: u64) -> SeqOutcome {
        let backwards = self.last_live.is_some_and(|last| seq <= last);
        let back_to_zero = seq == 0 && self.next.is_some_and(|next| next > 0);
        if backwards || back_to_zero {
            self.restart();
            return SeqOutcome::Restarted;
        }
        match self.next {
            Some(next) if seq > next => SeqOutcome::Gap {
                from: next,
                got: seq,
            },
            Some(next) if seq < next => SeqOutcome::Duplicate,
            _ => {
                self.next = Some(seq.saturating_add(1));
                self.last_live = Some(seq);
                SeqOutcome::Deliver
            }
        }
    }

    /// Checks a replayed frame (a replay never signals a restart: seqs below the expected one
    /// are old frames the replay buffer still holds).
    pub fn on_replay(&mut self, seq: u64) -> SeqOutcome {
        match self.next {
            Some(next) if seq < next => SeqOutcome::Duplicate,
            Some(next) if seq > next => SeqOutcome::Gap {
                from: next,
                got: seq,
            },
            _ => {
                self.next = Some(seq.saturating_add(1));
                SeqOutcome::Deliver
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use proptest::prelude::*;

    /// What the stream loop does with a live frame: restarts and gaps reported, the frame
    /// delivered or dropped. Gaps are treated as lost (no replay): resynchronise and deliver.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Seen {
        Delivered,
        Restarted,
        Gap,
        Dropped,
    }

    fn live(s: &mut Sequencer, seq: u64) -> Vec<Seen> {
        let mut seen = Vec::new();
        let mut outcome = s.on_live(seq);
        if outcome == SeqOutcome::Restarted {
            seen.push(Seen::Restarted);
            outcome = s.on_live(seq);
        }
        if let SeqOutcome::Gap { .. } = outcome {
            seen.push(Seen::Gap);
            s.reset();
            outcome = s.on_live(seq);
        }
        seen.push(match outcome {
            SeqOutcome::Deliver => Seen::Delivered,
            _ => Seen::Dropped,
        });
        seen
    }

    /// Engine lifetimes, each publishing `0..len`, and which of their frames the subscriber
    /// receives (a restarted engine's first frames are often missed while it reconnects).
    fn lifetimes() -> impl Strategy<Value = Vec<Vec<(u64, bool)>>> {
        proptest::collection::vec(
            (1u64..40).prop_flat_map(|len| {
                proptest::collection::vec(proptest::bool::weighted(0.8), len as usize).prop_map(
                    |kept| {
                        kept.into_iter()
                            .enumerate()
                            .map(|(i, k)| (i as u64, k))
                            .collect()
                    },
                )
            }),
            1..6,
        )
    }

    proptest! {
        /// Against the engines' truth: within a lifetime every received frame is delivered,
        /// with a gap before it exactly when frames before it were missed; the first frame
        /// received from a new lifetime reports a restart unless its seq lies beyond every
        /// frame received before (then it looks like a gap, which the loop resynchronises).
        #[test]
        fn live_frames_of_restarting_engines(engines in lifetimes()) {
            let mut s = Sequencer::new();
            let mut last: Option<u64> = None;
            for (life, frames) in engines.iter().enumerate() {
                let mut first_of_life = life > 0;
                for &(seq, kept) in frames {
                    if !kept {
                        continue;
                    }
                    let seen = live(&mut s, seq);
                    let mut want = Vec::new();
                    match last {
                        Some(l) if first_of_life && seq <= l => {
                            want.push(Seen::Restarted);
                            if seq > 0 {
                                want.push(Seen::Gap);
                            }
                        }
                        Some(l) if seq > l + 1 => want.push(Seen::Gap),
                        _ => {}
                    }
                    want.push(Seen::Delivered);
                    prop_assert_eq!(seen, want, "life {} seq {} after {:?}", life, seq, last);
                    last = Some(seq);
                    first_of_life = false;
                }
            }
        }

        /// After a catch-up replay up to `caught`, live frames buffered meanwhile are dropped
        /// as duplicates (seq 0 aside, which only a new stream sends once one is under way).
        #[test]
        fn live_frames_a_replay_delivered_are_duplicates(caught in 2u64..50, from in 1u64..50) {
            let mut s = Sequencer::new();
            s.expect(0);
            for seq in 0..caught {
                prop_assert_eq!(s.on_replay(seq), SeqOutcome::Deliver);
            }
            for seq in from.min(caught - 1)..caught {
                prop_assert_eq!(s.on_live(seq), SeqOutcome::Duplicate);
            }
            prop_assert_eq!(s.on_live(caught), SeqOutcome::Deliver);
            prop_assert_eq!(s.on_live(caught), SeqOutcome::Restarted);
        }

        #[test]
        fn delivers_each_seq_of_a_shuffled_replay_once_in_order(
            n in 1u64..30, dup in proptest::collection::vec(0u64..30, 0..20)
        ) {
            // A replayed stream 0..n with duplicates sprinkled in: exactly 0..n delivered.
            let mut s = Sequencer::new();
            s.expect(0);
            let mut delivered = Vec::new();
            let mut stream: Vec<u64> = (0..n).collect();
            for (i, d) in dup.iter().enumerate() {
                let at = (i * 7) % stream.len();
                let d = d % n;
                if d < stream[at] {
                    stream.insert(at + 1, d);
                }
            }
            for seq in stream {
                if s.on_replay(seq) == SeqOutcome::Deliver {
                    delivered.push(seq);
                }
            }
            prop_assert_eq!(delivered, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn gaps_leave_the_position_and_replays_fill_it() {
        let mut s = Sequencer::new();
        assert_eq!(s.on_live(5), SeqOutcome::Deliver);
        assert_eq!(s.on_live(8), SeqOutcome::Gap { from: 6, got: 8 });
        assert_eq!(s.expected(), Some(6));
        assert_eq!(s.on_replay(5), SeqOutcome::Duplicate);
        assert_eq!(s.on_replay(6), SeqOutcome::Deliver);
        assert_eq!(s.on_replay(8), SeqOutcome::Gap { from: 7, got: 8 });
        assert_eq!(s.on_replay(7), SeqOutcome::Deliver);
        assert_eq!(s.on_live(8), SeqOutcome::Deliver);
        assert_eq!(s.on_live(0), SeqOutcome::Restarted);
        assert_eq!(s.expected(), Some(0));
        assert_eq!(s.on_live(0), SeqOutcome::Deliver);
        s.reset();
        assert_eq!(s.on_live(u64::MAX), SeqOutcome::Deliver);
        assert_eq!(s.expected(), Some(u64::MAX));
    }

    #[test]
    fn a_restart_whose_first_frames_were_missed_is_seen() {
        // The old engine reached seq 9; the new one's 0..3 went by before the subscriber
        // reconnected. Seq 3 is a restart, then a gap 0..3 to repair from the new replay.
        let mut s = Sequencer::new();
        for seq in 0..10 {
            assert_eq!(s.on_live(seq), SeqOutcome::Deliver);
        }
        assert_eq!(s.on_live(3), SeqOutcome::Restarted);
        assert_eq!(s.on_live(3), SeqOutcome::Gap { from: 0, got: 3 });
        for seq in 0..3 {
            assert_eq!(s.on_replay(seq), SeqOutcome::Deliver);
        }
        assert_eq!(s.on_live(3), SeqOutcome::Deliver);
        assert_eq!(s.on_live(4), SeqOutcome::Deliver);
    }
}
