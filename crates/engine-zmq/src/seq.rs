//! The sequence checker: which engine frames follow on from the last one delivered.
//!
//! Engines number their batches from 0, contiguously per publisher start. A frame above the
//! expected seq means frames were lost (repair through replay, or resynchronise); a frame at
//! seq 0 below the expected one means the engine restarted; anything else below is a
//! duplicate (a replay overlapping the live stream).

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
    /// The engine restarted (seq back to 0); deliver it as the first of a new stream.
    Restarted,
    /// Already delivered; drop it.
    Duplicate,
}

/// Tracks the next expected seq of one engine stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sequencer {
    next: Option<u64>,
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

    /// Forgets the position: the next frame is accepted whatever its seq.
    pub fn reset(&mut self) {
        self.next = None;
    }

    /// Checks a live frame.
    pub fn on_live(&mut self, seq: u64) -> SeqOutcome {
        match self.next {
            Some(next) if seq > next => SeqOutcome::Gap {
                from: next,
                got: seq,
            },
            Some(next) if seq < next && seq == 0 => {
                self.next = Some(1);
                SeqOutcome::Restarted
            }
            Some(next) if seq < next => SeqOutcome::Duplicate,
            _ => {
                self.next = Some(seq.saturating_add(1));
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

    /// The naive model: the set of seqs delivered since the last restart, and the position.
    #[derive(Default)]
    struct Model {
        last: Option<u64>,
    }

    impl Model {
        fn live(&mut self, seq: u64) -> SeqOutcome {
            match self.last {
                None => {
                    self.last = Some(seq);
                    SeqOutcome::Deliver
                }
                Some(l) if seq == l + 1 => {
                    self.last = Some(seq);
                    SeqOutcome::Deliver
                }
                Some(l) if seq > l + 1 => SeqOutcome::Gap {
                    from: l + 1,
                    got: seq,
                },
                Some(_) if seq == 0 => {
                    self.last = Some(0);
                    SeqOutcome::Restarted
                }
                Some(_) => SeqOutcome::Duplicate,
            }
        }
    }

    proptest! {
        #[test]
        fn agrees_with_a_naive_model(seqs in proptest::collection::vec(0u64..20, 1..60)) {
            let mut s = Sequencer::new();
            let mut m = Model::default();
            for seq in seqs {
                prop_assert_eq!(s.on_live(seq), m.live(seq));
                prop_assert_eq!(s.expected(), m.last.map(|l| l + 1));
            }
        }

        #[test]
        fn delivers_each_seq_of_a_shuffled_replay_once_in_order(
            n in 1u64..30, dup in proptest::collection::vec(0u64..30, 0..20)
        ) {
            // A live stream from 0..n with duplicates sprinkled in: exactly 0..n delivered.
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
        assert_eq!(s.expected(), Some(1));
        s.reset();
        assert_eq!(s.on_live(u64::MAX), SeqOutcome::Deliver);
        assert_eq!(s.expected(), Some(u64::MAX));
    }
}
