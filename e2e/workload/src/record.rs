//! One measured request: what the live load generator and the discrete-event replay both write,
//! one JSON object per line.

use serde::{Deserialize, Serialize};

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every asked-for token arrived.
    Ok,
    /// The gateway or engine answered with an HTTP error (see [`RequestRecord::http_status`]).
    HttpError,
    /// The connection failed or the stream broke before its end.
    Transport,
    /// No answer within the client's deadline.
    Timeout,
}

/// One request's measurements. Times are milliseconds; `start_ms` is from the start of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Which run this belongs to (the routing policy or router under test).
    pub run: String,
    /// The load the run was driven at (concurrency for a closed loop, requests per second or
    /// speed-up for an open one), when the run is one point of a sweep. Reports plot against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<f64>,
    /// [`crate::Session::id`].
    pub session: u64,
    /// Turn index within the session, from 0.
    pub turn: u32,
    /// [`crate::Session::group`].
    pub group: u32,
    /// When the request was sent.
    pub start_ms: f64,
    /// Time to first token; `None` when no token arrived.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first: (e2e − ttft) / (output_tokens − 1); `None` for
    /// fewer than two tokens. The ITL percentiles of reports are over this per-request mean.
    pub tpot_ms: Option<f64>,
    /// Send to last byte.
    pub e2e_ms: f64,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Output tokens received.
    pub output_tokens: u32,
    /// Prompt tokens the engine served from its prefix cache (`usage.prompt_tokens_details.
    /// cached_tokens`), when it reports them.
    pub cached_tokens: Option<u32>,
    /// How it ended.
    pub status: Status,
    /// The HTTP status, when there was one.
    pub http_status: Option<u16>,
    /// Which engine served it (`x-kvgate-pod`, or the replay's engine index), when known.
    pub endpoint: Option<String>,
    /// A short reason for a failure.
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn records_are_one_json_line_and_round_trip() {
        let r = RequestRecord {
            run: "kv".into(),
            load: Some(60.0),
            session: 1,
            turn: 0,
            group: 2,
            start_ms: 10.5,
            ttft_ms: Some(120.0),
            tpot_ms: Some(30.0),
            e2e_ms: 3_120.0,
            prompt_tokens: 4_000,
            output_tokens: 101,
            cached_tokens: Some(3_984),
            status: Status::Ok,
            http_status: Some(200),
            endpoint: Some("sim-0".into()),
            error: None,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        assert!(line.contains(r#""status":"ok""#));
        assert_eq!(serde_json::from_str::<RequestRecord>(&line).unwrap(), r);
        let no_load = RequestRecord { load: None, ..r };
        let line = serde_json::to_string(&no_load).unwrap();
        assert!(!line.contains("load"));
        assert_eq!(
            serde_json::from_str::<RequestRecord>(&line).unwrap(),
            no_load
        );
    }
}
