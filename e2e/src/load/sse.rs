//! Reading an OpenAI streaming completion: server-sent-event framing, then the chunks.
//!
//! [`SseDecoder`] turns body bytes, split anywhere, into the `data:` payloads of complete
//! events. [`StreamState`] folds the payloads of one completion into what the load generator
//! records: whether a token has arrived (for TTFT), the final usage, the output token ids, and
//! an error event if the server sent one. Pure: the caller supplies bytes and timestamps.

use serde::Deserialize;

/// The longest event accepted, in bytes; a longer one is a protocol error.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// Why a stream could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event longer than [`MAX_EVENT_BYTES`].
    #[error("a server-sent event longer than {MAX_EVENT_BYTES} bytes")]
    EventTooLong,
}

/// Incremental SSE framing: events end at a blank line (`\n\n`, `\r\n\r\n` or mixed).
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
}

impl SseDecoder {
    /// Feeds bytes; returns the `data` of every event completed by them, in order. Multi-line
    /// `data:` fields are joined with `\n`; other fields (`event:`, `id:`, comments) are ignored.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut consumed = 0;
        let mut line_start = 0;
        let mut event: Option<String> = None;
        let mut i = 0;
        while let Some(offset) = self
            .buf
            .get(i..)
            .and_then(|rest| rest.iter().position(|&b| b == b'\n'))
        {
            let end = i + offset;
            let line = self.buf.get(line_start..end).unwrap_or_default();
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                if let Some(data) = event.take() {
                    out.push(data);
                }
                consumed = end + 1;
            } else if let Some(value) = line.strip_prefix(b"data:") {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                let text = String::from_utf8_lossy(value);
                match &mut event {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(&text);
                    }
                    None => event = Some(text.into_owned()),
                }
            }
            line_start = end + 1;
            i = end + 1;
        }
        self.buf.drain(..consumed);
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(SseError::EventTooLong);
        }
        Ok(out)
    }
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    usage: Option<ChunkUsage>,
    error: Option<ChunkError>,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
struct ChunkUsage {
    prompt_tokens: u32,
    completion_tokens: u32,
    prompt_tokens_details: Option<Details>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
struct Details {
    cached_tokens: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct ChunkError {
    #[serde(default)]
    message: String,
}

/// What a completion stream has said so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StreamState {
    /// A chunk carrying output (text or token ids) has arrived.
    pub got_token: bool,
    /// Chunks carrying output.
    pub content_chunks: u32,
    /// `[DONE]` arrived.
    pub done: bool,
    /// From the usage chunk: prompt tokens.
    pub prompt_tokens: Option<u32>,
    /// From the usage chunk: completion tokens.
    pub completion_tokens: Option<u32>,
    /// From the usage chunk: cached prompt tokens.
    pub cached_tokens: Option<u32>,
    /// Every chunk's `token_ids`, concatenated (vLLM sends per-chunk deltas).
    pub all_ids: Vec<u32>,
    /// The last chunk's `token_ids` (`kvgate-sim` sends the whole output on the last chunk).
    pub last_ids: Vec<u32>,
    /// An error event's message.
    pub error: Option<String>,
    /// Payloads that were not JSON chunks.
    pub malformed: u32,
}

/// What one payload changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The first output arrived with this payload.
    FirstToken,
    /// Anything else.
    Other,
}

impl StreamState {
    /// Folds one `data` payload in.
    pub fn apply(&mut self, data: &str) -> Step {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Step::Other;
        }
        let Ok(chunk) = serde_json::from_str::<Chunk>(data) else {
            self.malformed += 1;
            return Step::Other;
        };
        if let Some(e) = chunk.error {
            self.error = Some(e.message);
        }
        if let Some(u) = chunk.usage {
            self.prompt_tokens = Some(u.prompt_tokens);
            self.completion_tokens = Some(u.completion_tokens);
            self.cached_tokens = u.prompt_tokens_details.and_then(|d| d.cached_tokens);
        }
        let mut content = false;
        for choice in chunk.choices {
            if let Some(ids) = choice.token_ids
                && !ids.is_empty()
            {
                content = true;
                self.all_ids.extend_from_slice(&ids);
                self.last_ids = ids;
            }
            if choice.text.is_some_and(|t| !t.is_empty()) {
                content = true;
            }
        }
        if !content {
            return Step::Other;
        }
        self.content_chunks += 1;
        if self.got_token {
            Step::Other
        } else {
            self.got_token = true;
            Step::FirstToken
        }
    }

    /// Output tokens: the usage figure, else the number of content chunks.
    #[must_use]
    pub fn output_tokens(&self) -> u32 {
        self.completion_tokens.unwrap_or(self.content_chunks)
    }

    /// The output token ids, when the server returned all of them: the concatenated deltas or
    /// the last chunk's list, whichever has the output's length.
    #[must_use]
    pub fn output_ids(&self) -> Option<&[u32]> {
        let n = self.output_tokens() as usize;
        if n == 0 {
            None
        } else if self.all_ids.len() == n {
            Some(&self.all_ids)
        } else if self.last_ids.len() == n {
            Some(&self.last_ids)
        } else {
            None
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

    const STREAM: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"\"}],\"usage\":null}\n\n\
        data: {\"choices\":[{\"index\":0,\"text\":\" hello\"}],\"usage\":null}\r\n\r\n\
        : a comment\n\
        data: {\"choices\":[{\"index\":0,\"text\":\" world\",\"token_ids\":[11,12]}],\"usage\":null}\n\n\
        data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n\
        data: [DONE]\n\n";

    fn naive_events(text: &str) -> Vec<String> {
        text.replace("\r\n", "\n")
            .split("\n\n")
            .filter_map(|ev| {
                let data: Vec<&str> = ev
                    .lines()
                    .filter_map(|l| {
                        l.strip_prefix("data:")
                            .map(|v| v.strip_prefix(' ').unwrap_or(v))
                    })
                    .collect();
                (!data.is_empty()).then(|| data.join("\n"))
            })
            .collect()
    }

    proptest! {
        #[test]
        fn any_split_gives_the_events_of_the_whole(cuts in prop::collection::vec(0usize..STREAM.len(), 0..12)) {
            let bytes = STREAM.as_bytes();
            let mut cuts = cuts;
            cuts.sort_unstable();
            let mut d = SseDecoder::default();
            let mut got = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                got.extend(d.feed(&bytes[at..c.max(at)]).unwrap());
                at = c.max(at);
            }
            prop_assert_eq!(got, naive_events(STREAM));
        }
    }

    #[test]
    fn a_completion_stream_folds_into_its_figures() {
        let mut d = SseDecoder::default();
        let mut s = StreamState::default();
        let steps: Vec<Step> = d
            .feed(STREAM.as_bytes())
            .unwrap()
            .iter()
            .map(|e| s.apply(e))
            .collect();
        assert_eq!(
            steps,
            [
                Step::Other,
                Step::FirstToken,
                Step::Other,
                Step::Other,
                Step::Other
            ]
        );
        assert!(s.done);
        assert_eq!(
            (s.prompt_tokens, s.output_tokens(), s.cached_tokens),
            (Some(7), 2, Some(4))
        );
        assert_eq!(s.output_ids(), Some(&[11, 12][..]));
        assert_eq!(s.content_chunks, 2);
    }

    #[test]
    fn deltas_concatenate_and_errors_are_kept() {
        let mut s = StreamState::default();
        s.apply(r#"{"choices":[{"text":"a","token_ids":[1]}]}"#);
        s.apply(r#"{"choices":[{"text":"b","token_ids":[2]}]}"#);
        s.apply(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#);
        assert_eq!(s.output_ids(), Some(&[1, 2][..]));
        assert_eq!(s.cached_tokens, None);
        s.apply(r#"{"error":{"message":"engine stopped","type":"x","code":503}}"#);
        s.apply("not json");
        assert_eq!(s.error.as_deref(), Some("engine stopped"));
        assert_eq!(s.malformed, 1);
        let mut wrong = StreamState::default();
        wrong.apply(r#"{"choices":[{"text":"a","token_ids":[1]}],"usage":{"prompt_tokens":3,"completion_tokens":5}}"#);
        assert_eq!(
            wrong.output_ids(),
            None,
            "ids that do not add up are not used"
        );
    }

    #[test]
    fn an_endless_event_is_an_error() {
        let mut d = SseDecoder::default();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(d.feed(&big), Err(SseError::EventTooLong));
    }
}
