//! The router's part of a request's trace (target [`otel::TARGET`]): the decision's stages, and
//! the response from the pick to its first token and its end. The request's own span
//! (`epp.request`) is the ext_proc stream's; these hang under it. Disabled spans (tracing off)
//! make every call here a no-op.
//!
//! The EPP holds no queue of its own: a request is picked as soon as its body is in. The wait in
//! the engine's queue and its prefill are the `first_token` span.

use std::time::Duration;

use tracing::Span;

use super::stats::Completed;

/// Whether the current span is a request's trace span: the stages are spans only then (an
/// unsampled or untraced request gets none, and no stage span becomes a trace of its own).
pub(super) fn active() -> bool {
    Span::current()
        .metadata()
        .is_some_and(|m| m.target() == otel::TARGET)
}

/// Around request parsing and the model rewrite.
pub(super) fn parse(traced: bool, body_bytes: usize) -> Span {
    if !traced {
        return Span::none();
    }
    tracing::info_span!(target: otel::TARGET, "parse", body_bytes = otel::int(body_bytes))
}

/// Around tokenizing and keying; records what the keyer did.
pub(super) fn tokenize(traced: bool) -> Span {
    if !traced {
        return Span::none();
    }
    tracing::info_span!(
        target: otel::TARGET,
        "tokenize",
        prompt_tokens = tracing::field::Empty,
        tokenized_tokens = tracing::field::Empty,
        prompt_blocks = tracing::field::Empty,
        stopped_early = tracing::field::Empty,
    )
}

/// Around the scheduler (its `index_lookup` and `score` spans hang under it); records the pick.
pub(super) fn pick(traced: bool, candidates: usize) -> Span {
    if !traced {
        return Span::none();
    }
    tracing::info_span!(
        target: otel::TARGET,
        "pick",
        candidates = otel::int(candidates),
        endpoint = tracing::field::Empty,
        reason = tracing::field::Empty,
        prompt_blocks = tracing::field::Empty,
        cached_blocks = tracing::field::Empty,
    )
}

/// A routed request's response side: `first_token` from the pick to the first byte, then
/// `decode` to the end; TTFT, ITL and usage land on the request's span.
#[derive(Debug)]
pub(super) struct ResponseTrace {
    request: Span,
    phase: Span,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl ResponseTrace {
    /// Starts waiting for the first token under `request` (the current span at the pick).
    pub(super) fn start(request: Span, model: &str) -> Self {
        // Only a request's trace span: not the log's stream span, nor nothing (tracing off).
        if request
            .metadata()
            .is_none_or(|m| m.target() != otel::TARGET)
        {
            return Self {
                request: Span::none(),
                phase: Span::none(),
            };
        }
        request.record("model", model);
        let phase = tracing::info_span!(target: otel::TARGET, parent: &request, "first_token");
        Self { request, phase }
    }

    /// The first response byte arrived `ttft` after the pick.
    pub(super) fn first_byte(&mut self, ttft: Duration) {
        if self.request.is_disabled() {
            return;
        }
        self.request.record("ttft_ms", ms(ttft));
        self.phase = tracing::info_span!(
            target: otel::TARGET,
            parent: &self.request,
            "decode",
            completion_tokens = tracing::field::Empty,
            itl_ms = tracing::field::Empty,
        );
    }

    /// The response ended.
    pub(super) fn completed(self, done: &Completed) {
        if self.request.is_disabled() {
            return;
        }
        // One record per span (each is a dispatch through the subscriber); `None` records nothing.
        let usage = done.usage;
        let completion = usage.map(|(_, c, _)| otel::int(c));
        let itl_ms = done.itl_seconds().map(|itl| itl * 1e3);
        tracing::record_all!(
            self.request,
            prompt_tokens = usage.map(|(p, _, _)| otel::int(p)),
            completion_tokens = completion,
            cached_tokens = usage.and_then(|(_, _, c)| c).map(otel::int),
            itl_ms = itl_ms,
        );
        tracing::record_all!(self.phase, completion_tokens = completion, itl_ms = itl_ms);
    }
}
