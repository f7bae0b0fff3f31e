//! Mid-stream migration, the pure part: following a streamed (SSE) OpenAI answer event by event,
//! the request that continues it on another engine, and the rewrite that makes the continuation
//! look like the rest of the same stream.
//!
//! A streamed answer is migratable when the client asked for one choice of a generation API
//! (`/v1/completions` with a text prompt, or `/v1/chat/completions`) and nothing the engine sent
//! has to be repeated: the continuation's prompt is the original one plus the text generated so
//! far (for chat: an assistant message with that text, `continue_final_message: true`,
//! `add_generation_prompt: false`, as vLLM serves it), and its token budget is what is left.
//! The continuation's events get the original's `id`, `created` and `model`; its chat deltas
//! lose their `role` (the client already has one), and one left empty is dropped.
//!
//! What cannot be carried over: token ids (a prompt given as ids, `prompt_logprobs`), more than
//! one choice, and a generation the engine had already finished. `usage` in a migrated answer is
//! the continuation's (its prompt includes the generated text).

use serde_json::{Map, Value};

use super::rewrite::Api;

/// Longest SSE event kept while it arrives (an event is one token's delta; anything larger is
/// not an answer this module understands).
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// One complete SSE event (`data: …` lines and the blank line ending it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event's bytes as they arrived, blank line included.
    pub raw: Vec<u8>,
    /// The `data:` payload (lines joined with `\n`), if any.
    pub data: Option<String>,
}

/// Splits a byte stream into SSE events.
#[derive(Debug, Default)]
pub struct EventSplitter {
    pending: Vec<u8>,
}

/// The stream is not SSE as expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an SSE event longer than {MAX_EVENT_BYTES} bytes")]
pub struct EventTooLong;

impl EventSplitter {
    /// Feeds bytes; returns the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<Event>, EventTooLong> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = event_end(&self.pending) {
            let raw: Vec<u8> = self.pending.drain(..end).collect();
            out.push(Event {
                data: data_of(&raw),
                raw,
            });
        }
        if self.pending.len() > MAX_EVENT_BYTES {
            return Err(EventTooLong);
        }
        Ok(out)
    }

    /// Bytes of an event not yet complete.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

/// Where the first event in `buf` ends (after its blank line), LF or CRLF.
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn data_of(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?;
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

/// What a streamed answer has shown so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The stream's `id`, `created` and `model`, from its first event.
    pub id: Option<Value>,
    /// See `id`.
    pub created: Option<Value>,
    /// See `id`.
    pub model: Option<Value>,
    /// Text generated so far (choice 0).
    pub text: String,
    /// Events that carried generated text (about one token each).
    pub tokens: u32,
    /// A `finish_reason` or `[DONE]` was seen: nothing is left to migrate.
    pub finished: bool,
    /// Something the continuation could not carry (another choice, an unreadable event).
    pub unmigratable: Option<&'static str>,
}

impl Progress {
    /// Takes in one event of the original stream.
    pub fn observe(&mut self, api: Api, event: &Event) {
        let Some(data) = &event.data else { return };
        if data.trim() == "[DONE]" {
            self.finished = true;
            return;
        }
        let Ok(Value::Object(v)) = serde_json::from_str::<Value>(data) else {
            self.unmigratable.get_or_insert("unreadable event");
            return;
        };
        for (field, slot) in [
            ("id", &mut self.id),
            ("created", &mut self.created),
            ("model", &mut self.model),
        ] {
            if slot.is_none() {
                *slot = v.get(field).cloned();
            }
        }
        let Some(choices) = v.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                self.unmigratable.get_or_insert("more than one choice");
                continue;
            }
            let text = match api {
                Api::Completions => choice.get("text").and_then(Value::as_str),
                Api::Chat => choice
                    .get("delta")
                    .and_then(|d| d.get("content"))
                    .and_then(Value::as_str),
            };
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                self.text.push_str(t);
                self.tokens += 1;
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                self.finished = true;
            }
        }
    }
}

/// Why a request cannot be migrated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotMigratable {
    /// Not a streamed request.
    NotStreamed,
    /// More than one choice (`n`), or `best_of`.
    SeveralChoices,
    /// The prompt is not text (token ids, or a batch of prompts).
    PromptNotText,
    /// The request asks for things tied to the first engine's tokens (`prompt_logprobs`, `echo`).
    TokenBound,
    /// The messages are not a list.
    NoMessages,
}

impl NotMigratable {
    /// Bounded label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Self::NotStreamed => "not_streamed",
            Self::SeveralChoices => "several_choices",
            Self::PromptNotText => "prompt_not_text",
            Self::TokenBound => "token_bound",
            Self::NoMessages => "no_messages",
        }
    }
}

/// Whether a request's streamed answer could be continued elsewhere, decided before it is sent.
pub fn migratable(api: Api, req: &Map<String, Value>) -> Result<(), NotMigratable> {
    if req.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err(NotMigratable::NotStreamed);
    }
    let several = |k: &str| req.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    if several("n") || several("best_of") {
        return Err(NotMigratable::SeveralChoices);
    }
    if req.get("prompt_logprobs").is_some_and(|v| !v.is_null())
        || req.get("echo").and_then(Value::as_bool) == Some(true)
    {
        return Err(NotMigratable::TokenBound);
    }
    match api {
        Api::Completions if !req.get("prompt").is_some_and(Value::is_string) => {
            Err(NotMigratable::PromptNotText)
        }
        Api::Chat if !req.get("messages").is_some_and(Value::is_array) => {
            Err(NotMigratable::NoMessages)
        }
        _ => Ok(()),
    }
}

/// The request that continues `original` after `progress`: the generated text appended to the
/// prompt, the token budget reduced by what was generated (at least one token left). `None`
/// when nothing is left to generate.
pub fn continuation(
    api: Api,
    original: &Map<String, Value>,
    progress: &Progress,
) -> Option<Map<String, Value>> {
    let mut req = original.clone();
    for budget in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = req.get(budget).and_then(Value::as_u64) {
            let left = n.saturating_sub(u64::from(progress.tokens));
            if left == 0 {
                return None;
            }
            req.insert(budget.into(), left.into());
        }
    }
    match api {
        Api::Completions => {
            let prompt = req.get("prompt").and_then(Value::as_str)?.to_owned();
            req.insert("prompt".into(), Value::String(prompt + &progress.text));
        }
        Api::Chat => {
            let Some(Value::Array(messages)) = req.get_mut("messages") else {
                return None;
            };
            messages.push(serde_json::json!({"role": "assistant", "content": progress.text}));
            req.insert("continue_final_message".into(), Value::Bool(true));
            req.insert("add_generation_prompt".into(), Value::Bool(false));
        }
    }
    // A minimum length counts the tokens the first engine already produced.
    if let Some(n) = req.get("min_tokens").and_then(Value::as_u64) {
        req.insert(
            "min_tokens".into(),
            n.saturating_sub(u64::from(progress.tokens)).into(),
        );
    }
    Some(req)
}

/// Rewrites one event of the continuation as part of the original stream: its `id`, `created`
/// and `model` become the original's; chat deltas lose `role`, and an event that only announced
/// the assistant role is dropped (`None`). `[DONE]` and events that are not JSON objects pass unchanged.
pub fn splice(api: Api, original: &Progress, event: &Event) -> Option<Vec<u8>> {
    let Some(data) = &event.data else {
        return Some(event.raw.clone());
    };
    let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(data) else {
        return Some(event.raw.clone());
    };
    if api == Api::Chat {
        if is_role_only(&v) {
            return None;
        }
        // The client has its role delta already; an engine may send the role with the first
        // token.
        if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
            for delta in choices.iter_mut().filter_map(|c| c.get_mut("delta")) {
                if let Some(d) = delta.as_object_mut() {
                    d.remove("role");
                }
            }
        }
    }
    for (field, value) in [
        ("id", &original.id),
        ("created", &original.created),
        ("model", &original.model),
    ] {
        if let (Some(value), Some(slot)) = (value, v.get_mut(field)) {
            *slot = value.clone();
        }
    }
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(Value::Object(std::mem::take(&mut v)).to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
    Some(out)
}

/// A chat chunk whose only news is `role: assistant` (no content, no finish, no usage).
fn is_role_only(v: &Map<String, Value>) -> bool {
    if v.get("usage").is_some_and(|u| !u.is_null()) {
        return false;
    }
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return false;
    };
    !choices.is_empty()
        && choices.iter().all(|c| {
            let delta = c.get("delta");
            let content = delta
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
                .unwrap_or("");
            let finished = c.get("finish_reason").is_some_and(|f| !f.is_null());
            let tools = delta.and_then(|d| d.get("tool_calls")).is_some();
            content.is_empty() && !finished && !tools
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn event(data: &str) -> Event {
        let raw = format!("data: {data}\n\n").into_bytes();
        Event {
            data: Some(data.to_owned()),
            raw,
        }
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    proptest! {
        /// However the bytes are cut, the splitter yields the same events, in order, whole.
        #[test]
        fn any_chunking_yields_the_same_events(
            datas in proptest::collection::vec("[a-z0-9 {}:\",]{0,40}", 1..12),
            cuts in proptest::collection::vec(1usize..30, 1..40),
            crlf in any::<bool>(),
        ) {
            let sep = if crlf { "\r\n\r\n" } else { "\n\n" };
            let whole: String = datas.iter().map(|d| format!("data: {d}{sep}")).collect();
            let bytes = whole.as_bytes();
            let mut s = EventSplitter::default();
            let mut got = Vec::new();
            let (mut at, mut i) = (0, 0);
            while at < bytes.len() {
                let n = cuts[i % cuts.len()].min(bytes.len() - at);
                got.extend(s.feed(&bytes[at..at + n]).unwrap());
                at += n;
                i += 1;
            }
            prop_assert_eq!(s.pending(), 0);
            let want: Vec<Option<String>> = datas.iter().map(|d| Some(d.clone())).collect();
            let have: Vec<Option<String>> = got.iter().map(|e| e.data.clone()).collect();
            prop_assert_eq!(have, want);
            let raw: Vec<u8> = got.iter().flat_map(|e| e.raw.clone()).collect();
            prop_assert_eq!(raw, bytes.to_vec());
        }
    }

    #[test]
    fn an_endless_event_is_refused() {
        let mut s = EventSplitter::default();
        assert!(s.feed(&vec![b'x'; MAX_EVENT_BYTES + 1]).is_err());
    }

    #[test]
    fn progress_follows_chat_deltas_and_the_finish() {
        let mut p = Progress::default();
        for d in [
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" Hello"},"finish_reason":null}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" there"},"finish_reason":null}]}"#,
        ] {
            p.observe(Api::Chat, &event(d));
        }
        assert_eq!(
            (p.text.as_str(), p.tokens, p.finished),
            (" Hello there", 2, false)
        );
        assert_eq!(p.id, Some(json!("c1")));
        p.observe(
            Api::Chat,
            &event(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#),
        );
        assert!(p.finished);
        let mut done = Progress::default();
        done.observe(Api::Completions, &event("[DONE]"));
        assert!(done.finished);
    }

    #[test]
    fn another_choice_makes_it_unmigratable() {
        let mut p = Progress::default();
        p.observe(
            Api::Completions,
            &event(r#"{"choices":[{"index":1,"text":"x"}]}"#),
        );
        assert_eq!(p.unmigratable, Some("more than one choice"));
    }

    #[test]
    fn only_single_choice_text_streams_are_migratable() {
        let ok = obj(json!({"model":"m","prompt":"hi","stream":true,"max_tokens":5}));
        assert_eq!(migratable(Api::Completions, &ok), Ok(()));
        for (api, body, why) in [
            (
                Api::Completions,
                json!({"prompt":"hi"}),
                NotMigratable::NotStreamed,
            ),
            (
                Api::Completions,
                json!({"prompt":[1,2],"stream":true}),
                NotMigratable::PromptNotText,
            ),
            (
                Api::Completions,
                json!({"prompt":"hi","stream":true,"n":2}),
                NotMigratable::SeveralChoices,
            ),
            (
                Api::Completions,
                json!({"prompt":"hi","stream":true,"echo":true}),
                NotMigratable::TokenBound,
            ),
            (
                Api::Chat,
                json!({"stream":true,"messages":"x"}),
                NotMigratable::NoMessages,
            ),
        ] {
            assert_eq!(migratable(api, &obj(body)), Err(why));
        }
    }

    #[test]
    fn the_continuation_carries_the_text_and_the_rest_of_the_budget() {
        let progress = Progress {
            text: " a b".into(),
            tokens: 2,
            ..Progress::default()
        };
        let req = obj(json!({"prompt":"Say","stream":true,"max_tokens":10,"min_tokens":3}));
        let next = continuation(Api::Completions, &req, &progress).unwrap();
        assert_eq!(next["prompt"], "Say a b");
        assert_eq!(next["max_tokens"], 8);
        assert_eq!(next["min_tokens"], 1);
        let chat = obj(
            json!({"messages":[{"role":"user","content":"q"}],"stream":true,
                              "max_completion_tokens":2}),
        );
        assert_eq!(
            continuation(Api::Chat, &chat, &progress),
            None,
            "nothing left"
        );
        let chat = obj(
            json!({"messages":[{"role":"user","content":"q"}],"stream":true,
                              "max_tokens":5}),
        );
        let next = continuation(Api::Chat, &chat, &progress).unwrap();
        assert_eq!(
            next["messages"],
            json!([{"role":"user","content":"q"},{"role":"assistant","content":" a b"}])
        );
        assert_eq!(next["continue_final_message"], true);
        assert_eq!(next["add_generation_prompt"], false);
        assert_eq!(next["max_tokens"], 3);
    }

    #[test]
    fn spliced_events_take_the_original_identity_and_lose_the_role_delta() {
        let original = Progress {
            id: Some(json!("first")),
            created: Some(json!(1)),
            model: Some(json!("alias")),
            ..Progress::default()
        };
        let role = event(
            r#"{"id":"second","created":2,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
        );
        assert_eq!(splice(Api::Chat, &original, &role), None);
        let text = event(
            r#"{"id":"second","created":2,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"x"}}]}"#,
        );
        let out = splice(Api::Chat, &original, &text).unwrap();
        let mut s = EventSplitter::default();
        let back = s.feed(&out).unwrap();
        let v: Value = serde_json::from_str(back[0].data.as_ref().unwrap()).unwrap();
        assert_eq!(
            (&v["id"], &v["created"], &v["model"]),
            (&json!("first"), &json!(1), &json!("alias"))
        );
        assert_eq!(v["choices"][0]["delta"], json!({"content": "x"}));
        let done = event("[DONE]");
        assert_eq!(splice(Api::Chat, &original, &done), Some(done.raw.clone()));
    }
}
