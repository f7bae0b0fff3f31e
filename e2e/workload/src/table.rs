//! A plain-text table of several runs side by side, one row per run (or per load of a sweep).

use std::fmt::Write as _;

use crate::summary::Summary;

const HEADERS: [&str; 19] = [
    "run",
    "load",
    "requests",
    "ok",
    "failed",
    "429",
    "ttft p50",
    "ttft p90",
    "ttft p95",
    "ttft p99",
    "ttft mean",
    "tpot p50",
    "tpot p95",
    "e2e p50",
    "e2e p95",
    "out tok/s",
    "req/s",
    "goodput",
    "hit rate",
];

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn cells(s: &Summary) -> Vec<String> {
    let pct = |part: usize| {
        if s.requests == 0 {
            "-".into()
        } else {
            format!("{:.1}%", 100.0 * part as f64 / s.requests as f64)
        }
    };
    vec![
        s.run.clone(),
        s.load.map_or_else(|| "-".into(), |l| format!("{l}")),
        s.requests.to_string(),
        s.ok.to_string(),
        s.failed.to_string(),
        s.rejected.to_string(),
        ms(s.ttft_ms.p50),
        ms(s.ttft_ms.p90),
        ms(s.ttft_ms.p95),
        ms(s.ttft_ms.p99),
        ms(s.ttft_ms.mean),
        ms(s.tpot_ms.p50),
        ms(s.tpot_ms.p95),
        ms(s.e2e_ms.p50),
        ms(s.e2e_ms.p95),
        format!("{:.1}", s.output_tokens_per_s),
        format!("{:.2}", s.requests_per_s),
        pct(s.good),
        s.prefix_hit_rate
            .map_or_else(|| "-".into(), |h| format!("{:.1}%", 100.0 * h)),
    ]
}

/// The table: a header row (latencies in ms; goodput as a share of requests in the window),
/// then one row per summary, columns right-aligned except the run label.
#[must_use]
pub fn render_table(summaries: &[Summary]) -> String {
    let rows: Vec<Vec<String>> = std::iter::once(HEADERS.iter().map(|h| (*h).to_owned()).collect())
        .chain(summaries.iter().map(cells))
        .collect();
    let widths: Vec<usize> = (0..HEADERS.len())
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in &rows {
        for (c, (cell, width)) in row.iter().zip(&widths).enumerate() {
            let sep = if c == 0 { "" } else { "  " };
            // Writing to a String cannot fail.
            let _ = if c == 0 {
                write!(out, "{sep}{cell:<width$}")
            } else {
                write!(out, "{sep}{cell:>width$}")
            };
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::record::{RequestRecord, Status};
    use crate::summary::{Slo, Window, summarize};

    #[test]
    fn one_aligned_row_per_run() {
        let r = RequestRecord {
            run: "round-robin".into(),
            load: Some(60.0),
            session: 0,
            turn: 0,
            group: 0,
            start_ms: 0.0,
            ttft_ms: Some(274.0),
            tpot_ms: Some(28.0),
            e2e_ms: 1_000.0,
            prompt_tokens: 100,
            output_tokens: 10,
            cached_tokens: Some(50),
            status: Status::Ok,
            http_status: Some(200),
            endpoint: None,
            error: None,
        };
        let a = summarize(
            std::slice::from_ref(&r),
            Window {
                from_ms: 0.0,
                to_ms: 1_000.0,
            },
            Slo::default(),
        );
        let b = summarize(
            &[],
            Window {
                from_ms: 0.0,
                to_ms: 1_000.0,
            },
            Slo::default(),
        );
        let text = render_table(&[a, b]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("run "));
        assert!(lines[1].starts_with("round-robin"));
        assert!(
            lines[1].contains("274.0") && lines[1].contains("50.0%") && lines[1].contains("100.0%")
        );
        assert_eq!(lines[0].len(), lines[1].len(), "aligned");
        assert!(lines[2].contains(" - "), "an empty run shows dashes");
    }
}
