//! SGLang's bootstrap-based P/D roles (`--disaggregation-mode prefill|decode`, SGLang's flag).
//!
//! A router sends the same request to a prefill and a decode server, each carrying
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (scalars, or lists with one entry
//! per prompt of a batch). The simulator plays both sides of the rendezvous:
//!
//! - **prefill**: the request runs as a one-token prefill; when it finishes, its room is marked
//!   ready with the number of prompt tokens in full blocks (what a decode engine can pull). A
//!   second listener on `--disaggregation-bootstrap-port` (SGLang's flag, default 8998) answers
//!   `GET /kvgate/room/{room}?wait_ms=W` with `{"room", "num_tokens"}` as soon as the room is
//!   ready (long poll: it holds the request up to `W` ms, at most [`LONG_POLL_MAX`]), 404 if it
//!   is not by then;
//! - **decode**: before the request is scheduled, each prompt's room is long-polled at
//!   `http://{bootstrap_host}:{bootstrap_port}/kvgate/room/{room}` until it is ready (or
//!   `--disaggregation-bootstrap-timeout-ms` passes: 500), then those tokens are treated as
//!   pulled, as with vLLM's NIXL `do_remote_prefill` (`cached_tokens`, transfer time). The long
//!   poll makes the rendezvous event-driven, so the simulator adds no polling delay.
//!
//! The room endpoint is the simulator's own, not SGLang's bootstrap-server API: the fidelity
//! kept is *who meets whom where* (the host, port and room a router wrote), not the wire format
//! between engines. Every seat received, in any mode, is kept (the last [`SEEN_MAX`]) and listed
//! by `GET /sim/bootstrap`, so tests can compare what both sides saw.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{Value, json};

use super::openai::ApiError;

/// Seats remembered for `GET /sim/bootstrap`.
pub const SEEN_MAX: usize = 256;
/// Ready rooms remembered on the prefill side (oldest forgotten first).
pub const ROOMS_MAX: usize = 4096;
/// Delay before polling again after a poll that failed at once (connection refused).
const POLL_EVERY: Duration = Duration::from_millis(2);
/// Longest a room request is held waiting for the room.
pub const LONG_POLL_MAX: Duration = Duration::from_secs(1);
/// How long the decode side asks each long poll to wait.
const LONG_POLL_ASK: Duration = Duration::from_millis(250);

/// SGLang's `--disaggregation-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DisaggMode {
    /// Not disaggregated: bootstrap fields are recorded and otherwise ignored.
    #[default]
    Null,
    /// Prefill server: runs one-token prefills and serves their rooms.
    Prefill,
    /// Decode server: waits for each room, then decodes with the pulled KV.
    Decode,
}

/// One sequence's rendezvous, as the router wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Seat {
    /// The prefill server's host (IPv6 may be bracketed).
    pub host: String,
    /// Its bootstrap port.
    pub port: u16,
    /// The room.
    pub room: u64,
}

/// The seats of a request with `n` prompts: `None` without bootstrap fields.
pub fn seats(
    host: Option<&Value>,
    port: Option<&Value>,
    room: Option<&Value>,
    n: usize,
) -> Result<Option<Vec<Seat>>, ApiError> {
    let (host, port, room) = match (host, port, room) {
        (None | Some(Value::Null), None | Some(Value::Null), None | Some(Value::Null)) => {
            return Ok(None);
        }
        (Some(h), Some(p), Some(r)) => (h, p, r),
        _ => {
            return Err(ApiError::bad_request(
                "bootstrap_host, bootstrap_port and bootstrap_room go together",
            ));
        }
    };
    let hosts = per_prompt(host, n, "bootstrap_host", |v| v.as_str().map(str::to_owned))?;
    let ports = per_prompt(port, n, "bootstrap_port", |v| {
        v.as_u64().and_then(|p| u16::try_from(p).ok())
    })?;
    let rooms = per_prompt(room, n, "bootstrap_room", |v| {
        v.as_u64().filter(|r| *r <= i64::MAX as u64)
    })?;
    Ok(Some(
        hosts
            .into_iter()
            .zip(ports)
            .zip(rooms)
            .map(|((host, port), room)| Seat { host, port, room })
            .collect(),
    ))
}

/// A field as one value per prompt: a list of exactly `n`, or a scalar when `n` is 1.
fn per_prompt<T>(
    v: &Value,
    n: usize,
    name: &str,
    item: impl Fn(&Value) -> Option<T>,
) -> Result<Vec<T>, ApiError> {
    let bad = || ApiError::bad_request(format!("{name} is invalid for a request of {n} prompt(s)"));
    match v {
        Value::Array(items) if items.len() == n => {
            items.iter().map(|i| item(i).ok_or_else(bad)).collect()
        }
        Value::Array(_) => Err(bad()),
        scalar if n == 1 => item(scalar).map(|x| vec![x]).ok_or_else(bad),
        _ => Err(bad()),
    }
}

#[derive(Debug, Default)]
struct Rooms {
    ready: HashMap<u64, u32>,
    order: VecDeque<u64>,
}

/// The simulator's side of the rendezvous.
#[derive(Debug)]
pub struct Bootstrap {
    /// The role.
    pub mode: DisaggMode,
    timeout: Duration,
    rooms: Mutex<Rooms>,
    ready: tokio::sync::Notify,
    seen: Mutex<VecDeque<Seat>>,
    client: Client<HttpConnector, Body>,
    opened: AtomicU64,
    joined: AtomicU64,
    timeouts: AtomicU64,
}

impl Bootstrap {
    /// A role; `timeout` bounds a decode's wait for one room.
    pub fn new(mode: DisaggMode, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(1)));
        Self {
            mode,
            timeout,
            rooms: Mutex::default(),
            ready: tokio::sync::Notify::new(),
            seen: Mutex::default(),
            client: Client::builder(TokioExecutor::new()).build(connector),
            opened: AtomicU64::new(0),
            joined: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
        }
    }

    /// Remembers the seats a request carried.
    pub fn record(&self, seats: &[Seat]) {
        if let Ok(mut seen) = self.seen.lock() {
            for s in seats {
                if seen.len() == SEEN_MAX {
                    seen.pop_front();
                }
                seen.push_back(s.clone());
            }
        }
    }

    /// Prefill side: the room's KV (`num_tokens` prompt tokens) is ready to be pulled.
    pub fn room_ready(&self, room: u64, num_tokens: u32) {
        self.opened.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut rooms) = self.rooms.lock() {
            if rooms.ready.insert(room, num_tokens).is_none() {
                rooms.order.push_back(room);
            }
            while rooms.order.len() > ROOMS_MAX {
                if let Some(old) = rooms.order.pop_front() {
                    rooms.ready.remove(&old);
                }
            }
        }
        self.ready.notify_waiters();
    }

    /// The room's tokens once ready, waiting up to `wait` for it.
    async fn wait_for(&self, room: u64, wait: Duration) -> Option<u32> {
        let deadline = tokio::time::Instant::now() + wait.min(LONG_POLL_MAX);
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(n) = self.lookup(room) {
                return Some(n);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.lookup(room);
            }
        }
    }

    fn lookup(&self, room: u64) -> Option<u32> {
        self.rooms.lock().ok()?.ready.get(&room).copied()
    }

    /// Decode side: waits until the seat's room is ready on its prefill server; returns the
    /// tokens it holds.
    pub async fn join(&self, seat: &Seat) -> Result<u32, ApiError> {
        let deadline = Instant::now() + self.timeout;
        let uri: Uri = format!(
            "http://{}:{}/kvgate/room/{}?wait_ms={}",
            seat.host,
            seat.port,
            seat.room,
            LONG_POLL_ASK.as_millis()
        )
        .parse()
        .map_err(|_| {
            ApiError::bad_request(format!("bootstrap_host {:?} is not a host", seat.host))
        })?;
        loop {
            let asked = Instant::now();
            let remaining = deadline.saturating_duration_since(asked);
            if let Ok(Some(n)) = tokio::time::timeout(remaining, self.poll(&uri)).await {
                self.joined.fetch_add(1, Ordering::Relaxed);
                return Ok(n);
            }
            if Instant::now() >= deadline {
                self.timeouts.fetch_add(1, Ordering::Relaxed);
                return Err(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: format!(
                        "KV transfer failed: bootstrap room {} on {}:{} was not ready within {} ms",
                        seat.room,
                        seat.host,
                        seat.port,
                        self.timeout.as_millis()
                    ),
                });
            }
            if asked.elapsed() < POLL_EVERY {
                tokio::time::sleep(POLL_EVERY).await;
            }
        }
    }

    async fn poll(&self, uri: &Uri) -> Option<u32> {
        let resp = self.client.get(uri.clone()).await.ok()?;
        if resp.status() != StatusCode::OK {
            return None;
        }
        let body = axum::body::to_bytes(Body::new(resp.into_body()), 4096)
            .await
            .ok()?;
        let v: Value = serde_json::from_slice(&body).ok()?;
        v.get("num_tokens")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
    }

    /// `GET /sim/bootstrap`: the role and the seats seen, oldest first.
    pub fn seen_json(&self) -> Value {
        let seen: Vec<Seat> = self
            .seen
            .lock()
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        json!({"mode": self.mode, "seen": seen})
    }

    /// Appends the rendezvous counters to a metrics page.
    pub fn render(&self, out: &mut String) {
        for (name, help, v) in [
            (
                "kvgate_sim_bootstrap_rooms_ready_total",
                "Prefill side: rooms whose KV became ready.",
                &self.opened,
            ),
            (
                "kvgate_sim_bootstrap_rooms_joined_total",
                "Decode side: rooms joined (KV pulled).",
                &self.joined,
            ),
            (
                "kvgate_sim_bootstrap_room_timeouts_total",
                "Decode side: rooms that were not ready in time.",
                &self.timeouts,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
    }
}

/// The prefill side's bootstrap listener: `GET /kvgate/room/{room}?wait_ms=W`.
pub fn router(b: Arc<Bootstrap>) -> Router {
    Router::new()
        .route("/kvgate/room/{room}", get(room))
        .with_state(b)
}

/// The `wait_ms` query parameter (0 when absent or malformed).
fn wait_ms(uri: &Uri) -> u64 {
    uri.query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("wait_ms=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn room(State(b): State<Arc<Bootstrap>>, Path(room): Path<u64>, uri: Uri) -> Response {
    match b.wait_for(room, Duration::from_millis(wait_ms(&uri))).await {
        Some(n) => axum::Json(json!({"room": room, "num_tokens": n})).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
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

    #[test]
    fn seats_in_scalar_and_list_shapes() {
        assert_eq!(seats(None, None, None, 1).unwrap(), None);
        let one = seats(
            Some(&json!("10.0.0.7")),
            Some(&json!(8998)),
            Some(&json!(42)),
            1,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            one,
            vec![Seat {
                host: "10.0.0.7".into(),
                port: 8998,
                room: 42
            }]
        );
        let two = seats(
            Some(&json!(["a", "b"])),
            Some(&json!([1, 2])),
            Some(&json!([3, 4])),
            2,
        )
        .unwrap()
        .unwrap();
        assert_eq!(two[1].host, "b");
        assert_eq!(two[1].room, 4);
        // A batch needs lists; lengths must match; rooms stay below 2^63; all three go together.
        for (h, p, r, n) in [
            (json!("a"), json!(1), json!(3), 2),
            (json!(["a"]), json!([1]), json!([3, 4]), 1),
            (json!("a"), json!(70000), json!(3), 1),
            (json!("a"), json!(1), json!(u64::MAX), 1),
            (json!(1), json!(1), json!(1), 1),
        ] {
            assert!(
                seats(Some(&h), Some(&p), Some(&r), n).is_err(),
                "{h} {p} {r} {n}"
            );
        }
        assert!(seats(Some(&json!("a")), None, Some(&json!(1)), 1).is_err());
    }

    #[test]
    fn rooms_are_bounded_and_seen_is_bounded() {
        let b = Bootstrap::new(DisaggMode::Prefill, Duration::from_millis(1));
        for r in 0..(ROOMS_MAX as u64 + 10) {
            b.room_ready(r, 16);
        }
        assert_eq!(b.lookup(0), None, "the oldest room was forgotten");
        assert_eq!(b.lookup(ROOMS_MAX as u64 + 9), Some(16));
        let seat = Seat {
            host: "h".into(),
            port: 1,
            room: 1,
        };
        b.record(&vec![seat; SEEN_MAX + 5]);
        assert_eq!(b.seen_json()["seen"].as_array().unwrap().len(), SEEN_MAX);
        assert_eq!(b.seen_json()["mode"], "prefill");
    }

    #[test]
    fn wait_ms_is_read_from_the_query() {
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        assert_eq!(wait_ms(&uri("/kvgate/room/1?wait_ms=250")), 250);
        assert_eq!(wait_ms(&uri("/kvgate/room/1?x=1&wait_ms=7")), 7);
        assert_eq!(wait_ms(&uri("/kvgate/room/1")), 0);
        assert_eq!(wait_ms(&uri("/kvgate/room/1?wait_ms=-3")), 0);
    }

    #[tokio::test]
    async fn a_long_poll_answers_as_soon_as_the_room_is_ready() {
        let b = Arc::new(Bootstrap::new(
            DisaggMode::Prefill,
            Duration::from_millis(1),
        ));
        assert_eq!(b.wait_for(5, Duration::from_millis(20)).await, None);
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.wait_for(5, Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        b.room_ready(6, 32);
        b.room_ready(5, 16);
        let started = Instant::now();
        assert_eq!(waiter.await.unwrap(), Some(16));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(b.wait_for(5, Duration::ZERO).await, Some(16));
    }

    #[tokio::test]
    async fn decode_times_out_on_an_unreachable_room() {
        let b = Bootstrap::new(DisaggMode::Decode, Duration::from_millis(50));
        // Bound but not listening: refused, and the port stays ours while the test runs.
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = held.local_addr().unwrap().port();
        let err = b
            .join(&Seat {
                host: "127.0.0.1".into(),
                port,
                room: 9,
            })
            .await
            .unwrap_err();
        assert_eq!(err.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(err.message.contains("room 9"), "{}", err.message);
        let mut out = String::new();
        b.render(&mut out);
        assert!(out.contains("kvgate_sim_bootstrap_room_timeouts_total 1"));
    }
}
