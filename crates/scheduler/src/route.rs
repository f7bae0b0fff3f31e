//! One routing step exactly as the EPP performs it: schedule the request, then account it in
//! flight on the primary. The EPP's picker and the discrete-event replay (`e2e/replay`) both
//! call [`Scheduler::route`], so the replay routes with the EPP's own code path.

use kv_index::KvIndex;

use crate::decision::{Decision, ScheduleError};
use crate::endpoint::Endpoint;
use crate::inflight::{InflightToken, InflightTracker};
use crate::load::LoadBook;
use crate::scheduler::{ScheduleRequest, Scheduler};

/// Expected output blocks a routed request is accounted with, as the EPP cannot see how many
/// tokens a request will generate (it does not parse `max_tokens` into the accounting).
pub const DEFAULT_DECODE_BLOCKS: u32 = 16;

/// A decision and the in-flight handle of the request it placed.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// Where the request goes, and why.
    pub decision: Decision,
    /// Report the first token ([`InflightTracker::on_first_token`]) and the end
    /// ([`InflightTracker::on_finished`]) with it.
    pub token: InflightToken,
}

impl Scheduler {
    /// [`Scheduler::schedule`], then [`InflightTracker::on_routed`] on the primary with the
    /// decision's prompt and uncached blocks and [`DEFAULT_DECODE_BLOCKS`].
    pub fn route(
        &self,
        req: &ScheduleRequest<'_>,
        endpoints: &[Endpoint],
        index: &KvIndex,
        inflight: &InflightTracker,
        loads: &LoadBook,
    ) -> Result<Routed, ScheduleError> {
        let decision = self.schedule(req, endpoints, index, inflight, loads)?;
        let token = inflight.on_routed(
            decision.primary.endpoint,
            decision.prompt_blocks,
            decision.uncached_blocks,
            DEFAULT_DECODE_BLOCKS,
        );
        Ok(Routed { decision, token })
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
    use crate::{Millis, SchedulerConfig};
    use kv_events::BlockKey;
    use kv_index::{EndpointId, IndexConfig};

    #[test]
    fn route_accounts_the_request_on_the_primary_until_it_finishes() {
        let scheduler = Scheduler::new(SchedulerConfig::default(), 3).unwrap();
        let index = KvIndex::new(IndexConfig::default()).unwrap();
        let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
        let endpoints: Vec<Endpoint> = (0..3u32)
            .map(|i| {
                Endpoint::new(
                    EndpointId::new(i).unwrap(),
                    format!("10.0.0.{i}:8000").parse().unwrap(),
                )
            })
            .collect();
        let keys = [BlockKey(1), BlockKey(2), BlockKey(3)];
        let req = ScheduleRequest {
            keys: &keys,
            prompt_tokens: 48,
            prompt_blocks: None,
            model: "m",
            subset: None,
            now: Millis(0),
            timed: false,
        };
        let routed = scheduler
            .route(&req, &endpoints, &index, &inflight, &loads)
            .unwrap();
        let primary = routed.decision.primary.endpoint;
        assert_eq!(routed.token.endpoint(), primary);
        let load = inflight.load(primary);
        assert_eq!(load.requests, 1);
        assert_eq!(
            load.prefill_blocks, 3,
            "nothing cached: every block uncached"
        );
        assert!(inflight.on_first_token(routed.token));
        assert_eq!(
            inflight.load(primary).decode_blocks,
            3 + u64::from(DEFAULT_DECODE_BLOCKS)
        );
        assert!(inflight.on_finished(routed.token));
        assert!(inflight.is_empty());
        // The speculated prefix makes the same prompt follow before any engine event.
        let again = scheduler
            .route(&req, &endpoints, &index, &inflight, &loads)
            .unwrap();
        assert_eq!(again.decision.primary.endpoint, primary);
    }

    #[test]
    fn route_accounts_nothing_when_no_endpoint_qualifies() {
        let scheduler = Scheduler::new(SchedulerConfig::default(), 3).unwrap();
        let index = KvIndex::new(IndexConfig::default()).unwrap();
        let (inflight, loads) = (InflightTracker::new(), LoadBook::new());
        let req = ScheduleRequest {
            keys: &[],
            prompt_tokens: 0,
            prompt_blocks: None,
            model: "m",
            subset: None,
            now: Millis(0),
            timed: false,
        };
        assert!(
            scheduler
                .route(&req, &[], &index, &inflight, &loads)
                .is_err()
        );
        assert!(inflight.is_empty());
    }
}
