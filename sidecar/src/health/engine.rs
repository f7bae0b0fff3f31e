//! The engine liveness poller: `GET /health` on the engine every interval; readiness follows the
//! last answers (200 within the timeout is healthy). With data-parallel ranks served on their own
//! ports, every rank is polled and the pod is healthy only while all of them are.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};

use super::readiness::Readiness;
use crate::proxy::upstream::Upstream;

/// One check: whether the engine answered 200.
pub async fn check(client: &Upstream, engine: &str, timeout: Duration) -> bool {
    let Ok(req) = Request::get(format!("http://{engine}/health")).body(Body::empty()) else {
        return false;
    };
    matches!(
        tokio::time::timeout(timeout, client.request(req)).await,
        Ok(Ok(resp)) if resp.status() == StatusCode::OK
    )
}

/// Polls `engines` (one authority per data-parallel rank) forever, logging each rank's
/// transitions; readiness's engine input is the conjunction.
pub async fn run(
    client: Upstream,
    engines: Vec<String>,
    every: Duration,
    timeout: Duration,
    readiness: Readiness,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Vec<Option<bool>> = vec![None; engines.len()];
    loop {
        tick.tick().await;
        // Every rank at once, so a hung rank costs one timeout per tick, not one per rank.
        let mut checks = tokio::task::JoinSet::new();
        for (rank, engine) in engines.iter().enumerate() {
            let (client, engine) = (client.clone(), engine.clone());
            checks.spawn(async move { (rank, check(&client, &engine, timeout).await) });
        }
        let mut all = true;
        while let Some(done) = checks.join_next().await {
            let (rank, ok) = done.unwrap_or((usize::MAX, false));
            all &= ok;
            if let (Some(last), Some(engine)) = (last.get_mut(rank), engines.get(rank))
                && *last != Some(ok)
            {
                tracing::info!(engine = %engine, healthy = ok, "engine health changed");
                *last = Some(ok);
            }
        }
        readiness.set_engine_healthy(all);
    }
}
