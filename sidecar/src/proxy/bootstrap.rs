//! Pure request rewriting for SGLang's bootstrap-based P/D (the `sglang` connector).
//!
//! SGLang's prefill and decode servers meet in a *room* on the prefill server's bootstrap port
//! and move the KV cache between themselves. The router's only job is to send the **same**
//! request to both, carrying where and in which room to meet:
//!
//! - `bootstrap_host`: the prefiller's IP (IPv6 in brackets, as SGLang's mini load balancer
//!   writes it, so the decode engine can build `http://host:port` from it);
//! - `bootstrap_port`: the prefill server's bootstrap port (SGLang's default 8998);
//! - `bootstrap_room`: a random integer in `[0, 2^63 − 1]`, fresh per request (per prompt for a
//!   batch), as SGLang's mini load balancer (`random.randint(0, 2**63 - 1)`) and sgl-router's
//!   `generate_room_id` draw it.
//!
//! For a batch — a completions `prompt` that is a list of texts or of token lists, or a chat
//! request with `n > 1` (sgl-router's rule) — each field becomes a list with one entry per
//! sequence, because SGLang indexes them per sequence. Everything else in the body (`stream`,
//! `max_tokens`, `stream_options`, …) is left as the client sent it: both engines get it as is.
//! Client-supplied `bootstrap_*` fields are always overwritten: a client must not choose where the
//! decode engine connects.
//!
//! No I/O here; the randomness comes in through a closure.

use std::net::{IpAddr, SocketAddr};

use serde_json::Value;

use super::rewrite::{Api, Request};

/// The body field naming the prefill server's host.
pub const FIELD_HOST: &str = "bootstrap_host";
/// The body field naming the prefill server's bootstrap port.
pub const FIELD_PORT: &str = "bootstrap_port";
/// The body field naming the rendezvous room.
pub const FIELD_ROOM: &str = "bootstrap_room";

/// SGLang's default bootstrap port (`--disaggregation-bootstrap-port`).
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Most sequences one request may carry through the rewrite (sgl-router's batch bound).
pub const MAX_BATCH: usize = 10_000;

/// Why a body cannot carry bootstrap fields.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    /// The batch is larger than [`MAX_BATCH`].
    #[error("a batch of {0} sequences exceeds the {MAX_BATCH}-sequence limit")]
    BatchTooLarge(usize),
}

/// Where the decode engine finds the prefill engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The prefiller's host as SGLang expects it (IPv6 bracketed).
    pub host: String,
    /// Its bootstrap port.
    pub port: u16,
}

impl Target {
    /// The target for the prefiller named by `x-prefiller-host-port` (its HTTP port is not the
    /// bootstrap port; only its address is kept).
    pub fn for_prefiller(prefiller: SocketAddr, bootstrap_port: u16) -> Self {
        let host = match prefiller.ip() {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        Self {
            host,
            port: bootstrap_port,
        }
    }
}

/// How many sequences a request is, as SGLang counts them for the bootstrap fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One sequence: scalar fields.
    Single,
    /// A batch: list fields of this length.
    Batch(usize),
}

/// The shape of a request body.
pub fn shape(api: Api, req: &Request) -> Shape {
    match api {
        Api::Completions => match req.get("prompt") {
            Some(Value::Array(items))
                if items
                    .first()
                    .is_some_and(|first| first.is_string() || first.is_array()) =>
            {
                Shape::Batch(items.len())
            }
            _ => Shape::Single,
        },
        Api::Chat => match req.get("n").and_then(Value::as_u64) {
            Some(n) if n > 1 => Shape::Batch(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => Shape::Single,
        },
    }
}

/// A room id from 64 random bits: the low 63 (SGLang's range, `[0, 2^63 − 1]`).
pub fn room(random: u64) -> u64 {
    random & (i64::MAX as u64)
}

/// The body both legs send: the client's request with the bootstrap fields set. Returns it and
/// the rooms drawn (one per sequence). `next_random` supplies 64 random bits per room.
pub fn inject(
    api: Api,
    mut req: Request,
    target: &Target,
    mut next_random: impl FnMut() -> u64,
) -> Result<(Request, Vec<u64>), BootstrapError> {
    let shape = shape(api, &req);
    let (host, port, rooms, room_value) = match shape {
        Shape::Single => {
            let r = room(next_random());
            (
                Value::from(target.host.clone()),
                Value::from(target.port),
                vec![r],
                Value::from(r),
            )
        }
        Shape::Batch(n) => {
            if n > MAX_BATCH {
                return Err(BootstrapError::BatchTooLarge(n));
            }
            let rooms: Vec<u64> = (0..n).map(|_| room(next_random())).collect();
            (
                Value::Array(vec![Value::from(target.host.clone()); n]),
                Value::Array(vec![Value::from(target.port); n]),
                rooms.clone(),
                Value::Array(rooms.into_iter().map(Value::from).collect()),
            )
        }
    };
    req.insert(FIELD_HOST.into(), host);
    req.insert(FIELD_PORT.into(), port);
    req.insert(FIELD_ROOM.into(), room_value);
    Ok((req, rooms))
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
    use serde_json::json;

    fn obj(v: Value) -> Request {
        v.as_object().unwrap().clone()
    }

    fn v4() -> Target {
        Target::for_prefiller("10.0.0.7:8000".parse().unwrap(), 8998)
    }

    #[test]
    fn host_is_the_prefillers_ip_and_port_the_bootstrap_port() {
        assert_eq!(
            v4(),
            Target {
                host: "10.0.0.7".into(),
                port: 8998
            }
        );
        let t = Target::for_prefiller("[fd00::7]:8000".parse().unwrap(), 9000);
        assert_eq!(t.host, "[fd00::7]");
        assert_eq!(t.port, 9000);
    }

    #[test]
    fn streaming_completion_keeps_every_client_field() {
        let orig = obj(json!({
            "model": "m", "prompt": "hi", "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 50,
            "bootstrap_host": "evil.example", "bootstrap_room": 1
        }));
        let (body, rooms) = inject(Api::Completions, orig.clone(), &v4(), || u64::MAX).unwrap();
        assert_eq!(rooms, vec![i64::MAX as u64]);
        assert_eq!(body["bootstrap_host"], json!("10.0.0.7"));
        assert_eq!(body["bootstrap_port"], json!(8998));
        assert_eq!(body["bootstrap_room"], json!(i64::MAX));
        for k in ["model", "prompt", "stream", "stream_options", "max_tokens"] {
            assert_eq!(body[k], orig[k], "{k}");
        }
        assert!(!body.contains_key("kv_transfer_params"));
    }

    #[test]
    fn batches_get_one_room_per_sequence() {
        let mut n = 0u64;
        let mut next = || {
            n += 1;
            n
        };
        let texts = obj(json!({"prompt": ["a", "b", "c"]}));
        let (body, rooms) = inject(Api::Completions, texts, &v4(), &mut next).unwrap();
        assert_eq!(rooms, vec![1, 2, 3]);
        assert_eq!(body["bootstrap_room"], json!([1, 2, 3]));
        assert_eq!(
            body["bootstrap_host"],
            json!(["10.0.0.7", "10.0.0.7", "10.0.0.7"])
        );
        assert_eq!(body["bootstrap_port"], json!([8998, 8998, 8998]));
        let ids = obj(json!({"prompt": [[1, 2], [3]]}));
        assert_eq!(shape(Api::Completions, &ids), Shape::Batch(2));
        // One prompt as token ids is a single sequence.
        let one = obj(json!({"prompt": [1, 2, 3]}));
        assert_eq!(shape(Api::Completions, &one), Shape::Single);
        assert_eq!(
            shape(Api::Completions, &obj(json!({"prompt": []}))),
            Shape::Single
        );
        let chat = obj(json!({"messages": [], "n": 4}));
        assert_eq!(shape(Api::Chat, &chat), Shape::Batch(4));
        assert_eq!(shape(Api::Chat, &obj(json!({"n": 1}))), Shape::Single);
        assert_eq!(shape(Api::Chat, &obj(json!({"n": "4"}))), Shape::Single);
        // `n` on completions does not make a batch (sgl-router counts it for chat only).
        assert_eq!(
            shape(Api::Completions, &obj(json!({"prompt": "x", "n": 3}))),
            Shape::Single
        );
    }

    #[test]
    fn oversized_batches_are_refused() {
        let chat = obj(json!({"messages": [], "n": MAX_BATCH + 1}));
        assert_eq!(
            inject(Api::Chat, chat, &v4(), || 0).unwrap_err(),
            BootstrapError::BatchTooLarge(MAX_BATCH + 1)
        );
        let huge = obj(json!({"messages": [], "n": u64::MAX}));
        assert!(inject(Api::Chat, huge, &v4(), || 0).is_err());
    }

    fn arb_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z ]{0,8}".prop_map(Value::from),
        ]
    }

    fn arb_prompt() -> impl Strategy<Value = Value> {
        prop_oneof![
            "[a-z ]{0,12}".prop_map(Value::from),
            prop::collection::vec("[a-z]{0,4}".prop_map(Value::from), 0..6).prop_map(Value::Array),
            prop::collection::vec(any::<u32>().prop_map(Value::from), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                prop::collection::vec(any::<u32>().prop_map(Value::from), 0..4)
                    .prop_map(Value::Array),
                0..6
            )
            .prop_map(Value::Array),
        ]
    }

    proptest! {
        /// Against a naive model: the three fields are set (scalars for one sequence, lists of
        /// the batch's length otherwise), every room is below 2^63 and is the masked random
        /// value in order, and every other client field is untouched.
        #[test]
        fn matches_naive_model(
            extra in prop::collection::btree_map("[a-z_]{1,10}", arb_leaf(), 0..8),
            prompt in arb_prompt(),
            stream in any::<bool>(),
            chat in any::<bool>(),
            n in 0u64..6,
            randoms in prop::collection::vec(any::<u64>(), 8),
            ip in any::<[u8; 4]>(),
            port in 1u16..,
        ) {
            let api = if chat { Api::Chat } else { Api::Completions };
            let mut orig = Request::new();
            for (k, v) in extra { orig.insert(k, v); }
            orig.insert("stream".into(), Value::from(stream));
            orig.insert("n".into(), Value::from(n));
            if chat {
                orig.insert("messages".into(), json!([{"role": "user", "content": "x"}]));
            } else {
                orig.insert("prompt".into(), prompt.clone());
            }
            let target = Target::for_prefiller(SocketAddr::from((ip, 8000)), port);
            let mut it = randoms.iter().copied().cycle();
            let (body, rooms) = inject(api, orig.clone(), &target, || it.next().unwrap_or(0)).unwrap();

            let expected_batch = if chat {
                (n > 1).then_some(n as usize)
            } else {
                match &prompt {
                    Value::Array(items) if items.first().is_some_and(|f| f.is_string() || f.is_array()) => Some(items.len()),
                    _ => None,
                }
            };
            let count = expected_batch.unwrap_or(1);
            let expected_rooms: Vec<u64> = randoms.iter().cycle().take(count).map(|r| r & (u64::MAX >> 1)).collect();
            prop_assert_eq!(&rooms, &expected_rooms);
            prop_assert!(rooms.iter().all(|r| *r < (1u64 << 63)));
            let host = Value::from(format!("{}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3]));
            match expected_batch {
                None => {
                    prop_assert_eq!(&body[FIELD_HOST], &host);
                    prop_assert_eq!(&body[FIELD_PORT], &Value::from(port));
                    prop_assert_eq!(&body[FIELD_ROOM], &Value::from(expected_rooms[0]));
                }
                Some(len) => {
                    prop_assert_eq!(&body[FIELD_HOST], &Value::Array(vec![host; len]));
                    prop_assert_eq!(&body[FIELD_PORT], &Value::Array(vec![Value::from(port); len]));
                    prop_assert_eq!(&body[FIELD_ROOM], &Value::Array(expected_rooms.iter().map(|r| Value::from(*r)).collect()));
                }
            }
            for (k, v) in &orig {
                if ![FIELD_HOST, FIELD_PORT, FIELD_ROOM].contains(&k.as_str()) {
                    prop_assert_eq!(body.get(k), Some(v), "{} changed", k);
                }
            }
            prop_assert_eq!(body.len(), orig.len() + 3 - [FIELD_HOST, FIELD_PORT, FIELD_ROOM].iter().filter(|f| orig.contains_key(**f)).count());
        }
    }
}
