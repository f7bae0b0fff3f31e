//! The SGLang flow's two concurrent legs, as a pure state machine: which answer the client gets,
//! given the order in which the prefill leg ends and the decode leg's response head arrives.
//!
//! Rules (sgl-router's, see `docs/sidecar.md`):
//!
//! - the decode answer is released only once the prefill leg succeeded;
//! - a failed or refused prefill leg decides the answer whenever it ends (the decode leg, held
//!   or still running, is dropped);
//! - a decode head that is not a success (or a decode request that failed) decides the answer
//!   as soon as it arrives (the prefill leg is dropped).
//!
//! The I/O glue ([`super::sglang`]) feeds the events and acts on the verdict; it keeps the
//! payloads (responses, errors), this module only their kinds.

/// How the prefill leg ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillEnd {
    /// 2xx.
    Done,
    /// The prefiller's own 4xx.
    Refused,
    /// Attempts out, timeout, a final 5xx.
    Failed,
}

/// How the decode leg's head arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeHead {
    /// A 2xx head.
    Ok,
    /// A non-2xx head.
    NotOk,
    /// No head: the request to the engine failed.
    Failed,
}

/// What the client gets, once decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing decided yet: keep waiting for the other leg.
    Wait,
    /// Relay the decode engine's answer (2xx or not) as it comes.
    Decode,
    /// The decode request's error (engine unreachable).
    DecodeFailed,
    /// The prefiller's 4xx, as is.
    PrefillRefused,
    /// 502: the prefill leg failed.
    PrefillFailed,
}

/// The two legs' state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dual {
    prefill: Option<PrefillEnd>,
    decode: Option<DecodeHead>,
}

impl Dual {
    /// Neither leg has ended.
    pub fn new() -> Self {
        Self::default()
    }

    /// The prefill leg ended.
    pub fn prefill(&mut self, end: PrefillEnd) -> Verdict {
        self.prefill = Some(end);
        self.verdict()
    }

    /// The decode leg's head arrived (or its request failed).
    pub fn decode(&mut self, head: DecodeHead) -> Verdict {
        self.decode = Some(head);
        self.verdict()
    }

    /// Whether the decode leg still has to be waited for.
    pub fn awaiting_decode(&self) -> bool {
        self.decode.is_none()
    }

    fn verdict(&self) -> Verdict {
        match (self.prefill, self.decode) {
            (Some(PrefillEnd::Failed), _) => Verdict::PrefillFailed,
            (Some(PrefillEnd::Refused), _) => Verdict::PrefillRefused,
            (_, Some(DecodeHead::Failed)) => Verdict::DecodeFailed,
            (_, Some(DecodeHead::NotOk)) | (Some(PrefillEnd::Done), Some(DecodeHead::Ok)) => {
                Verdict::Decode
            }
            _ => Verdict::Wait,
        }
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

    #[test]
    fn the_table() {
        use DecodeHead as D;
        use PrefillEnd as P;
        // Prefill first, then decode.
        for (p, d, first, second) in [
            (P::Done, D::Ok, Verdict::Wait, Verdict::Decode),
            (P::Done, D::NotOk, Verdict::Wait, Verdict::Decode),
            (P::Done, D::Failed, Verdict::Wait, Verdict::DecodeFailed),
        ] {
            let mut m = Dual::new();
            assert_eq!(m.prefill(p), first);
            assert_eq!(m.decode(d), second);
        }
        // A failed or refused prefill decides at once.
        assert_eq!(Dual::new().prefill(P::Failed), Verdict::PrefillFailed);
        assert_eq!(Dual::new().prefill(P::Refused), Verdict::PrefillRefused);
        // Decode first: a good head waits for the prefill, a bad one decides.
        let mut m = Dual::new();
        assert_eq!(m.decode(D::Ok), Verdict::Wait);
        assert!(!m.awaiting_decode());
        assert_eq!(m.prefill(P::Failed), Verdict::PrefillFailed);
        assert_eq!(Dual::new().decode(D::NotOk), Verdict::Decode);
        assert_eq!(Dual::new().decode(D::Failed), Verdict::DecodeFailed);
    }

    fn arb_prefill() -> impl Strategy<Value = PrefillEnd> {
        prop::sample::select(vec![
            PrefillEnd::Done,
            PrefillEnd::Refused,
            PrefillEnd::Failed,
        ])
    }

    fn arb_decode() -> impl Strategy<Value = DecodeHead> {
        prop::sample::select(vec![DecodeHead::Ok, DecodeHead::NotOk, DecodeHead::Failed])
    }

    /// The naive model: whichever leg ends first decides if it is bad; else the second decides
    /// with prefill failures taking precedence over a good decode head.
    fn model(p: PrefillEnd, d: DecodeHead, prefill_first: bool) -> Vec<Verdict> {
        let bad_prefill = |p| match p {
            PrefillEnd::Failed => Some(Verdict::PrefillFailed),
            PrefillEnd::Refused => Some(Verdict::PrefillRefused),
            PrefillEnd::Done => None,
        };
        let decode_answer = |d| match d {
            DecodeHead::Failed => Verdict::DecodeFailed,
            DecodeHead::Ok | DecodeHead::NotOk => Verdict::Decode,
        };
        if prefill_first {
            match bad_prefill(p) {
                Some(v) => vec![v],
                None => vec![Verdict::Wait, decode_answer(d)],
            }
        } else if d == DecodeHead::Ok {
            vec![Verdict::Wait, bad_prefill(p).unwrap_or(Verdict::Decode)]
        } else {
            vec![decode_answer(d)]
        }
    }

    proptest! {
        /// Feeding the events in either order until a verdict other than `Wait` gives the naive
        /// model's verdicts; exactly one final verdict, and it is never `Wait`.
        #[test]
        fn matches_naive_model(p in arb_prefill(), d in arb_decode(), prefill_first in any::<bool>()) {
            let mut m = Dual::new();
            let mut got = Vec::new();
            let events: [bool; 2] = [prefill_first, !prefill_first];
            for is_prefill in events {
                let v = if is_prefill { m.prefill(p) } else { m.decode(d) };
                got.push(v);
                if v != Verdict::Wait { break; }
            }
            prop_assert_eq!(&got, &model(p, d, prefill_first));
            prop_assert_ne!(got.last().copied(), Some(Verdict::Wait));
        }
    }
}
