//! The Mooncake conversation trace (FAST'25) as a workload: one single-turn session per row,
//! sent at the row's timestamp.
//!
//! Each row is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [..]}`,
//! one hash id per 512-token block of the prompt, the last block possibly partial. The prompt
//! becomes one [`Span`] per hash id whose seed depends on the id alone, so rows that share their
//! first k ids share a 512·k-token prefix, at any engine block size that divides 512.

use std::io::{BufRead, Read as _};
use std::ops::Range;
use std::time::Duration;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::content::{Span, Vocab};
use crate::session::{Pacing, Session, Turn, Workload};

/// Tokens per hash id in the trace.
pub const BLOCK_TOKENS: u32 = 512;

/// Longest line accepted, in bytes (the longest real row is about 2 KB).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Salt of the span seeds, so trace content differs from the other workloads' content.
const SEED_SALT: u64 = 0x6d6f_6f6e_6361_6b65;

/// How to read the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct MooncakeOptions {
    /// Replay this many times faster: session starts are `(timestamp − window start) ÷ speedup`.
    /// Finite and positive.
    pub speedup: f64,
    /// Keep only rows whose timestamp falls in this window (trace time, before speed-up).
    /// `None`: all rows.
    pub window: Option<Range<Duration>>,
    /// Stop after this many kept rows.
    pub limit: Option<usize>,
    /// Token ids of the synthesized content.
    pub vocab: Vocab,
}

impl Default for MooncakeOptions {
    fn default() -> Self {
        Self {
            speedup: 1.0,
            window: None,
            limit: None,
            vocab: Vocab::default(),
        }
    }
}

/// Why the trace could not be read. Line numbers count from 1.
#[derive(Debug, thiserror::Error)]
pub enum MooncakeError {
    /// The options make no sense.
    #[error("invalid trace options: {0}")]
    Options(&'static str),
    /// Reading failed.
    #[error("reading line {line} of the trace")]
    Io {
        /// Where.
        line: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line longer than [`MAX_LINE_BYTES`].
    #[error("line {line} of the trace is longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong {
        /// Where.
        line: usize,
    },
    /// A line that is not a trace row.
    #[error("line {line} of the trace is not a trace row")]
    Json {
        /// Where.
        line: usize,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A row whose prompt length does not fit its block count.
    #[error(
        "line {line} of the trace: input_length {input_length} does not fit {blocks} blocks of {BLOCK_TOKENS} tokens"
    )]
    Blocks {
        /// Where.
        line: usize,
        /// The row's `input_length`.
        input_length: u32,
        /// The row's number of hash ids.
        blocks: usize,
    },
}

impl MooncakeError {
    /// A bounded label for metrics and logs.
    #[must_use]
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Options(_) => "options",
            Self::Io { .. } => "io",
            Self::LineTooLong { .. } => "line_too_long",
            Self::Json { .. } => "json",
            Self::Blocks { .. } => "blocks",
        }
    }
}

/// `Result` of this module.
pub(crate) type Result<T, E = MooncakeError> = std::result::Result<T, E>;

#[derive(Debug, Deserialize)]
struct Row {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// The span seed of block `hash_id`: a function of the id alone.
#[must_use]
pub fn block_seed(hash_id: u64) -> u64 {
    xxh3_64_with_seed(&hash_id.to_le_bytes(), SEED_SALT)
}

/// Reads the trace into an open-loop workload named `mooncake`. Session ids are the rows'
/// 0-based line indices; sessions are ordered by start (stable, so equal timestamps keep the
/// trace's order); `group` is 0.
pub fn read_mooncake<R: BufRead>(mut reader: R, options: &MooncakeOptions) -> Result<Workload> {
    if !(options.speedup.is_finite() && options.speedup > 0.0) {
        return Err(MooncakeError::Options(
            "speedup must be finite and positive",
        ));
    }
    let origin = options.window.as_ref().map_or(Duration::ZERO, |w| w.start);
    let mut sessions = Vec::new();
    let mut buf = Vec::new();
    for index in 0usize.. {
        if options.limit.is_some_and(|limit| sessions.len() >= limit) {
            break;
        }
        let line = index + 1;
        buf.clear();
        let limit = u64::try_from(MAX_LINE_BYTES).unwrap_or(u64::MAX) + 1;
        let read = reader
            .by_ref()
            .take(limit)
            .read_until(b'\n', &mut buf)
            .map_err(|source| MooncakeError::Io { line, source })?;
        if read == 0 {
            break;
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
        } else if buf.len() > MAX_LINE_BYTES {
            return Err(MooncakeError::LineTooLong { line });
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let row: Row =
            serde_json::from_slice(&buf).map_err(|source| MooncakeError::Json { line, source })?;
        let at = Duration::from_millis(row.timestamp);
        // Rows outside the window are skipped, not a reason to stop: the published trace is
        // sorted, but a reordered file must not lose rows.
        if options.window.as_ref().is_some_and(|w| !w.contains(&at)) {
            continue;
        }
        let user = spans(&row, line)?;
        let start =
            Duration::try_from_secs_f64(at.saturating_sub(origin).as_secs_f64() / options.speedup)
                .map_err(|_| MooncakeError::Options("speedup too small: start times overflow"))?;
        sessions.push(Session {
            id: index as u64,
            start,
            group: 0,
            turns: vec![Turn {
                user,
                max_tokens: row.output_length.max(1),
                think: Duration::ZERO,
            }],
        });
    }
    sessions.sort_by_key(|s| s.start);
    Ok(Workload {
        name: "mooncake".into(),
        pacing: Pacing::Open,
        vocab: options.vocab,
        sessions,
    })
}

fn spans(row: &Row, line: usize) -> Result<Vec<Span>> {
    let blocks = row.hash_ids.len();
    let full = u64::from(BLOCK_TOKENS) * blocks as u64;
    let input = u64::from(row.input_length);
    if input > full || input + u64::from(BLOCK_TOKENS) <= full {
        return Err(MooncakeError::Blocks {
            line,
            input_length: row.input_length,
            blocks,
        });
    }
    let mut left = row.input_length;
    Ok(row
        .hash_ids
        .iter()
        .map(|&id| {
            let len = left.min(BLOCK_TOKENS);
            left -= len;
            Span {
                seed: block_seed(id),
                len,
            }
        })
        .collect())
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

    const ROWS: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]}

{"timestamp": 2000, "input_length": 512, "output_length": 7, "hash_ids": [4]}
{"timestamp": 5000, "input_length": 10, "output_length": 1, "hash_ids": [0]}
"#;

    fn read(text: &str, options: &MooncakeOptions) -> Result<Workload> {
        read_mooncake(text.as_bytes(), options)
    }

    #[test]
    fn rows_become_single_turn_sessions_with_block_spans() {
        let w = read(ROWS, &MooncakeOptions::default()).unwrap();
        assert_eq!(w.pacing, Pacing::Open);
        assert_eq!(w.sessions.len(), 4);
        let ids: Vec<u64> = w.sessions.iter().map(|s| s.id).collect();
        assert_eq!(ids, [0, 1, 3, 4], "line indices; the blank line is skipped");
        let first = &w.sessions[0].turns[0];
        let lens: Vec<u32> = first.user.iter().map(|s| s.len).collect();
        assert_eq!(lens, [512, 512, 76]);
        assert_eq!(first.max_tokens, 5);
        assert_eq!(w.sessions[1].turns[0].max_tokens, 1, "output 0 → 1");
        assert_eq!(w.sessions[2].start, Duration::from_secs(2));
        for s in &w.sessions {
            assert_eq!(s.turns.len(), 1);
            let prompt = s.prompt(&w.vocab, 0, &[]).unwrap();
            assert_eq!(prompt.len() as u64, s.user_tokens());
        }
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens() {
        let w = read(ROWS, &MooncakeOptions::default()).unwrap();
        let a = w.sessions[0].prompt(&w.vocab, 0, &[]).unwrap();
        let b = w.sessions[1].prompt(&w.vocab, 0, &[]).unwrap();
        let d = w.sessions[3].prompt(&w.vocab, 0, &[]).unwrap();
        assert_eq!(a[..512], b[..512], "shared block 0");
        assert_ne!(a[512..600], b[512..600], "block 1 vs block 3");
        assert_eq!(
            d[..],
            a[..10],
            "a partial block 0 is a prefix of the full one"
        );
    }

    #[test]
    fn speedup_window_and_limit() {
        let options = MooncakeOptions {
            speedup: 2.0,
            window: Some(Duration::from_secs(1)..Duration::from_secs(6)),
            ..MooncakeOptions::default()
        };
        let w = read(ROWS, &options).unwrap();
        let starts: Vec<Duration> = w.sessions.iter().map(|s| s.start).collect();
        assert_eq!(starts, [Duration::from_millis(500), Duration::from_secs(2)]);
        let limited = read(
            ROWS,
            &MooncakeOptions {
                limit: Some(2),
                ..MooncakeOptions::default()
            },
        )
        .unwrap();
        assert_eq!(limited.sessions.len(), 2);
    }

    #[test]
    fn bad_input_is_a_typed_error_with_its_line() {
        let bad_json = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\nnot json\n";
        match read(bad_json, &MooncakeOptions::default()) {
            Err(MooncakeError::Json { line: 2, .. }) => {}
            other => panic!("{other:?}"),
        }
        let too_many_blocks =
            r#"{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}"#;
        match read(too_many_blocks, &MooncakeOptions::default()) {
            Err(e @ MooncakeError::Blocks { line: 1, .. }) => {
                assert_eq!(e.metric_label(), "blocks")
            }
            other => panic!("{other:?}"),
        }
        let too_long =
            r#"{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}"#;
        assert!(matches!(
            read(too_long, &MooncakeOptions::default()),
            Err(MooncakeError::Blocks { .. })
        ));
        let huge = "x".repeat(MAX_LINE_BYTES + 10);
        assert!(matches!(
            read(&huge, &MooncakeOptions::default()),
            Err(MooncakeError::LineTooLong { line: 1 })
        ));
        let zero = MooncakeOptions {
            speedup: 0.0,
            ..MooncakeOptions::default()
        };
        assert!(matches!(read(ROWS, &zero), Err(MooncakeError::Options(_))));
    }
}
