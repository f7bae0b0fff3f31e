//! Pacing sessions against the endpoint: open loop (each session at its start time, scaled by
//! the speed-up) or closed loop (a fixed number of sessions in flight). Within a session each
//! turn is sent after the previous answer (and the turn's think time); the prompt resends the
//! whole history with the engine's own output ids as the answers.
//!
//! Limits: no request starts after the deadline (warm-up + duration) or beyond the request
//! budget; a failed turn ends its session, since the conversation has no answer to build on.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use workload::{Pacing, RequestRecord, Session, Status, Workload, synth_answer};

use super::client::{Client, Reply};
use super::sink::Sink;

/// How to run a workload.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Open loop: session starts and think times are divided by this.
    pub speedup: f64,
    /// The engines run this many times faster than their model (`kvgate-sim --time-scale`):
    /// starts and think times are divided by it as well, and every recorded time is multiplied
    /// by it, so records are in model time. 1 for real engines.
    pub time_scale: f64,
    /// The run label of the records.
    pub run: String,
    /// The load label of the records.
    pub load: Option<f64>,
    /// No request starts after this long from the start.
    pub deadline: Option<Duration>,
    /// At most this many requests.
    pub max_requests: Option<u64>,
}

/// When to stop starting requests.
#[derive(Debug)]
struct Limits {
    deadline: Option<Instant>,
    max_requests: Option<u64>,
    admitted: AtomicU64,
    stopped: AtomicBool,
}

impl Limits {
    fn exhausted(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
            || self.deadline.is_some_and(|d| Instant::now() >= d)
            || self
                .max_requests
                .is_some_and(|m| self.admitted.load(Ordering::Relaxed) >= m)
    }

    /// Takes one request from the budget, or says no.
    fn admit(&self) -> bool {
        if self.exhausted() {
            return false;
        }
        let n = self.admitted.fetch_add(1, Ordering::Relaxed);
        if self.max_requests.is_some_and(|m| n >= m) {
            self.stopped.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }
}

#[derive(Debug)]
struct Ctx {
    workload: Arc<Workload>,
    client: Client,
    sink: Sink,
    plan: Plan,
    limits: Limits,
    t0: Instant,
    missing_ids_logged: AtomicBool,
}

/// Runs `workload` to its end or its limits. Returns when every started session has ended.
pub async fn drive(workload: Arc<Workload>, client: Client, sink: Sink, plan: Plan) {
    let t0 = Instant::now();
    let limits = Limits {
        deadline: plan.deadline.map(|d| t0 + d),
        max_requests: plan.max_requests,
        admitted: AtomicU64::new(0),
        stopped: AtomicBool::new(false),
    };
    let pacing = workload.pacing;
    let ctx = Arc::new(Ctx {
        workload,
        client,
        sink,
        plan,
        limits,
        t0,
        missing_ids_logged: AtomicBool::new(false),
    });
    match pacing {
        Pacing::Open => open_loop(&ctx).await,
        Pacing::Closed { concurrency } => closed_loop(&ctx, concurrency).await,
    }
}

async fn open_loop(ctx: &Arc<Ctx>) {
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..ctx.workload.sessions.len() {
        let Some(start) = ctx.workload.sessions.get(index).map(|s| s.start) else {
            break;
        };
        tokio::time::sleep_until(ctx.t0 + scaled(start, ctx.plan.speedup * ctx.plan.time_scale))
            .await;
        if ctx.limits.exhausted() {
            break;
        }
        let ctx = Arc::clone(ctx);
        tasks.spawn(async move { run_session(&ctx, index).await });
        // Reap finished sessions as we go so the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

async fn closed_loop(ctx: &Arc<Ctx>, concurrency: u32) {
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let ctx = Arc::clone(ctx);
        let next = Arc::clone(&next);
        workers.spawn(async move {
            loop {
                let index =
                    usize::try_from(next.fetch_add(1, Ordering::Relaxed)).unwrap_or(usize::MAX);
                if index >= ctx.workload.sessions.len() {
                    if index == ctx.workload.sessions.len() && !ctx.limits.exhausted() {
                        tracing::warn!(
                            sessions = index,
                            "the workload ran out of sessions before its limits"
                        );
                    }
                    break;
                }
                if ctx.limits.exhausted() {
                    break;
                }
                run_session(&ctx, index).await;
            }
        });
    }
    while workers.join_next().await.is_some() {}
}

fn scaled(d: Duration, speedup: f64) -> Duration {
    Duration::try_from_secs_f64(d.as_secs_f64() / speedup).unwrap_or(Duration::MAX)
}

async fn run_session(ctx: &Ctx, index: usize) {
    let Some(session) = ctx.workload.sessions.get(index) else {
        return;
    };
    let vocab = ctx.workload.vocab;
    let mut answers: Vec<Vec<u32>> = Vec::with_capacity(session.turns.len());
    for (k, turn) in session.turns.iter().enumerate() {
        if k > 0 && !turn.think.is_zero() {
            tokio::time::sleep(scaled(turn.think, ctx.plan.speedup * ctx.plan.time_scale)).await;
        }
        if !ctx.limits.admit() {
            return;
        }
        let Some(prompt) = session.prompt(&vocab, k, &answers) else {
            return;
        };
        let start = ctx.t0.elapsed();
        ctx.sink.sent();
        let reply = ctx.client.complete(&prompt, turn.max_tokens).await;
        let turn_index = u32::try_from(k).unwrap_or(u32::MAX);
        let record = to_record(&ctx.plan, session, turn_index, start, prompt.len(), &reply);
        let ok = reply.status == Status::Ok;
        let answer = reply.output_ids.unwrap_or_else(|| {
            if ok && !ctx.missing_ids_logged.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "the server returned no output token ids (return_token_ids); later turns resend \
                     synthesized answers of the same length, so their prefix is not the engine's own output"
                );
            }
            synth_answer(&vocab, session.id, turn_index, record.output_tokens)
        });
        answers.push(answer);
        ctx.sink.record(record);
        if !ok {
            return;
        }
    }
}

/// The record of one request.
pub fn to_record(
    plan: &Plan,
    session: &Session,
    turn: u32,
    start: Duration,
    prompt_len: usize,
    reply: &Reply,
) -> RequestRecord {
    let ms = |d: Duration| d.as_secs_f64() * 1_000.0 * plan.time_scale;
    let ttft_ms = reply.ttft.map(ms);
    let e2e_ms = ms(reply.e2e);
    let tpot_ms = match (ttft_ms, reply.output_tokens) {
        (Some(ttft), n) if n >= 2 && reply.status == Status::Ok => {
            Some((e2e_ms - ttft) / f64::from(n - 1))
        }
        _ => None,
    };
    RequestRecord {
        run: plan.run.clone(),
        load: plan.load,
        session: session.id,
        turn,
        group: session.group,
        start_ms: ms(start),
        ttft_ms,
        tpot_ms,
        e2e_ms,
        prompt_tokens: reply
            .prompt_tokens
            .unwrap_or_else(|| u32::try_from(prompt_len).unwrap_or(u32::MAX)),
        output_tokens: reply.output_tokens,
        cached_tokens: reply.cached_tokens,
        status: reply.status,
        http_status: reply.http_status,
        endpoint: reply.endpoint.clone(),
        error: reply.error.clone(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    fn plan() -> Plan {
        Plan {
            speedup: 1.0,
            time_scale: 1.0,
            run: "kv".into(),
            load: Some(60.0),
            deadline: None,
            max_requests: Some(2),
        }
    }

    #[test]
    fn records_carry_tpot_only_for_two_tokens_or_more() {
        let session = Session {
            id: 3,
            start: Duration::ZERO,
            group: 1,
            turns: vec![],
        };
        let mut reply = Reply {
            status: Status::Ok,
            http_status: Some(200),
            ttft: Some(Duration::from_millis(100)),
            e2e: Duration::from_millis(1_000),
            prompt_tokens: None,
            output_tokens: 10,
            cached_tokens: Some(16),
            output_ids: None,
            endpoint: Some("sim-0".into()),
            error: None,
        };
        let r = to_record(&plan(), &session, 2, Duration::from_millis(5), 77, &reply);
        assert_eq!((r.session, r.turn, r.group, r.prompt_tokens), (3, 2, 1, 77));
        assert!((r.tpot_ms.unwrap() - 100.0).abs() < 1e-9);
        assert_eq!(
            (r.run.as_str(), r.load, r.start_ms),
            ("kv", Some(60.0), 5.0)
        );
        reply.output_tokens = 1;
        assert_eq!(
            to_record(&plan(), &session, 0, Duration::ZERO, 1, &reply).tpot_ms,
            None
        );
    }

    #[test]
    fn the_budget_admits_exactly_max_requests() {
        let limits = Limits {
            deadline: None,
            max_requests: Some(2),
            admitted: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        };
        assert!(limits.admit() && limits.admit());
        assert!(!limits.admit());
        assert!(limits.exhausted());
    }
}
