//! The router's part of a request's trace: the decision's stages (`parse`, `tokenize`, `pick`
//! with the scheduler's `index_lookup` and `score` under it) and the response's (`first_token`
//! from the pick to the first byte, then `decode` to the end). They are kept in an
//! [`otel::StageLog`] and exported as children of the request's span (`epp.request`, the
//! ext_proc stream's [`otel::RequestSpan`]) when the response ends, or at once when the request is refused: the
//! decision itself pays a clock read per stage boundary. An untraced request's log is inactive,
//! and every call here is then a no-op.
//!
//! The EPP holds no queue of its own: a request is picked as soon as its body is in. The wait in
//! the engine's queue and its prefill are the `first_token` span.

use std::time::Duration;

use otel::{KeyValue, RequestSpan, StageId, StageLog};
use scheduler::Decision;

use super::keys::Keyed;
use super::stats::Completed;

fn int(key: &'static str, value: impl TryInto<i64>) -> KeyValue {
    KeyValue::new(key, otel::int(value))
}

/// Opens `parse` (request parsing and the model rewrite); close it with [`StageLog::close`]. A
/// request refused while parsing leaves it open: it ends when the log is exported.
pub(super) fn parse(stages: &mut StageLog, body_bytes: usize) -> StageId {
    let parse = stages.open("parse", None);
    if stages.is_active() {
        stages.annotate(parse, [int("body_bytes", body_bytes)]);
    }
    parse
}

/// Closes `tokenize` (tokenizing and keying) with what the keyer did.
pub(super) fn tokenized(stages: &mut StageLog, tokenize: StageId, keyed: &Keyed) {
    if stages.is_active() {
        stages.close(
            tokenize,
            [
                int("prompt_tokens", keyed.prompt_tokens),
                int("tokenized_tokens", keyed.tokenized),
                int("prompt_blocks", keyed.prompt_blocks),
                KeyValue::new("stopped_early", keyed.stopped_early),
            ],
        );
    }
}

/// Closes `pick` (the scheduler) with the choice, and adds the scheduler's own stages under it.
pub(super) fn picked(
    stages: &mut StageLog,
    pick: StageId,
    candidates: usize,
    decision: Option<&Decision>,
) {
    if !stages.is_active() {
        return;
    }
    let Some(d) = decision else {
        stages.close(pick, [int("candidates", candidates)]);
        return;
    };
    if let Some(phases) = d.phases {
        let (start, end) = phases.lookup;
        stages.record(
            "index_lookup",
            Some(pick),
            start,
            end,
            [int("candidates", d.scores.len())],
        );
        let (start, end) = phases.score;
        stages.record("score", Some(pick), start, end, []);
    }
    stages.close(
        pick,
        [
            int("candidates", candidates),
            KeyValue::new("endpoint", d.primary.address.to_string()),
            KeyValue::new("reason", d.reason.as_str()),
            int("prompt_blocks", d.prompt_blocks),
            int(
                "cached_blocks",
                d.prompt_blocks.saturating_sub(d.uncached_blocks),
            ),
        ],
    );
}

/// A routed request's response side: `first_token` from the pick to the first byte, then
/// `decode` to the end; TTFT, ITL and usage land on the request's span. Dropping it (the
/// response ended, or the request was forgotten) exports the request's stages.
#[derive(Debug)]
pub(super) struct ResponseTrace {
    request: RequestSpan,
    stages: StageLog,
    phase: Option<StageId>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl ResponseTrace {
    /// Starts waiting for the first token under `request`, with the decision's `stages`.
    pub(super) fn start(request: RequestSpan, mut stages: StageLog, model: &str) -> Self {
        if !stages.is_active() {
            return Self {
                request: RequestSpan::none(),
                stages,
                phase: None,
            };
        }
        request.set(KeyValue::new("model", model.to_owned()));
        let phase = Some(stages.open("first_token", None));
        Self {
            request,
            stages,
            phase,
        }
    }

    /// The first response byte arrived `ttft` after the pick.
    pub(super) fn first_byte(&mut self, ttft: Duration) {
        let Some(first_token) = self.phase else {
            return;
        };
        self.request.set(KeyValue::new("ttft_ms", ms(ttft)));
        self.stages.close(first_token, []);
        self.phase = Some(self.stages.open("decode", None));
    }

    /// The response ended.
    pub(super) fn completed(mut self, done: &Completed) {
        let Some(phase) = self.phase else {
            return;
        };
        let usage = done.usage;
        let completion = usage.map(|(_, c, _)| otel::int(c));
        let itl_ms = done.itl_seconds().map(|itl| itl * 1e3);
        let kv = |key, value: Option<i64>| value.map(|v| KeyValue::new(key, v));
        self.request.set_all(
            [
                kv("prompt_tokens", usage.map(|(p, _, _)| otel::int(p))),
                kv("completion_tokens", completion),
                kv(
                    "cached_tokens",
                    usage.and_then(|(_, _, c)| c).map(otel::int),
                ),
                itl_ms.map(|itl| KeyValue::new("itl_ms", itl)),
            ]
            .into_iter()
            .flatten(),
        );
        let attributes = completion
            .map(|c| KeyValue::new("completion_tokens", c))
            .into_iter()
            .chain(itl_ms.map(|itl| KeyValue::new("itl_ms", itl)));
        self.stages.close(phase, attributes);
    }
}
