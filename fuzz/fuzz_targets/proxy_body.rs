//! The sidecar's P/D proxy bodies (`kvgate_sidecar::proxy`): the client's request body
//! (`rewrite::parse_request`), the NIXL flow's prefill and decode legs (`prefill_request`,
//! `decode_request`, `to_bytes`) with the `kv_transfer_params` read from the prefiller's answer
//! (`transfer_params`), the SGLang flow's bootstrap fields (`bootstrap::shape`, `inject`), and
//! the `x-prefiller-host-port` header naming the prefiller (`headers::prefiller`).
//!
//! Input: an option byte (API, bootstrap port, random bits), then the header value, the client
//! body and the prefill response, separated by `0xff` bytes (never in UTF-8 JSON).
//!
//! Asserts, besides "no panic":
//! - the prefill leg is the client's body with `kv_transfer_params` asking for a remote decode,
//!   `stream: false`, no `stream_options`, `max_tokens: 1` (and `max_completion_tokens: 1` for
//!   chat), every other field unchanged, and it serialises to a JSON object with the same keys;
//! - `transfer_params` returns exactly the response's `kv_transfer_params` object, and the
//!   decode leg is the client's body with that object and nothing else changed;
//! - the bootstrap body carries one room per sequence (`shape`), each below 2^63, the host and
//!   port of the prefiller, every other field unchanged; only a batch over `MAX_BATCH` is
//!   refused;
//! - a header whose first entry is an `ip:port` names that address.
#![no_main]

use std::net::SocketAddr;

use http::{HeaderMap, HeaderValue};
use kvgate_sidecar::proxy::bootstrap::{
    self, FIELD_HOST, FIELD_PORT, FIELD_ROOM, MAX_BATCH, Shape, Target,
};
use kvgate_sidecar::proxy::headers::{Prefiller, prefiller};
use kvgate_sidecar::proxy::rewrite::{
    Api, Request, decode_request, parse_request, prefill_request, prefill_transfer_params,
    to_bytes, transfer_params,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const HEADER: &str = "x-prefiller-host-port";

/// `after` is `before` with exactly `changed` keys set or removed.
fn same_except(before: &Request, after: &Request, changed: &[&str]) {
    for (k, v) in before {
        if !changed.contains(&k.as_str()) {
            assert_eq!(after.get(k), Some(v), "field {k:?} changed");
        }
    }
    for k in after.keys() {
        assert!(
            before.contains_key(k) || changed.contains(&k.as_str()),
            "field {k:?} added"
        );
    }
}

fn reparses(req: &Request) {
    let bytes = to_bytes(req);
    let again = parse_request(&bytes).expect("a serialised body parses");
    assert_eq!(again.len(), req.len());
    assert!(req.keys().all(|k| again.contains_key(k)));
}

fn prefiller_addr(value: &[u8]) -> Option<SocketAddr> {
    let mut headers = HeaderMap::new();
    let v = HeaderValue::from_bytes(value).ok()?;
    headers.insert(HEADER, v);
    let first = String::from_utf8_lossy(value)
        .split(',')
        .next()
        .unwrap_or("")
        .trim()
        .parse::<SocketAddr>()
        .ok();
    match prefiller(&headers) {
        Prefiller::At(addr) => {
            assert_eq!(Some(addr), first);
            Some(addr)
        }
        Prefiller::None | Prefiller::Malformed(_) => {
            assert_eq!(first, None);
            None
        }
    }
}

fn nixl(api: Api, original: &Request, response: &[u8]) {
    let p = prefill_request(api, original);
    assert_eq!(p.get("stream"), Some(&Value::Bool(false)));
    assert!(!p.contains_key("stream_options"));
    assert_eq!(p.get("max_tokens"), Some(&Value::from(1)));
    assert_eq!(
        p.get("kv_transfer_params"),
        Some(&prefill_transfer_params())
    );
    let mut changed = vec![
        "stream",
        "stream_options",
        "max_tokens",
        "kv_transfer_params",
    ];
    if api == Api::Chat {
        assert_eq!(p.get("max_completion_tokens"), Some(&Value::from(1)));
        changed.push("max_completion_tokens");
    }
    same_except(original, &p, &changed);
    reparses(&p);

    let Ok(params) = transfer_params(response) else {
        return;
    };
    assert!(params.is_object());
    let whole: Value = serde_json::from_slice(response).expect("the response parsed once");
    assert_eq!(whole.get("kv_transfer_params"), Some(&params));
    let d = decode_request(original.clone(), params.clone());
    assert_eq!(d.get("kv_transfer_params"), Some(&params));
    same_except(original, &d, &["kv_transfer_params"]);
    reparses(&d);
}

fn sglang(api: Api, original: &Request, target: &Target, mut random: u64) {
    let shape = bootstrap::shape(api, original);
    let next = || {
        random = random.rotate_left(7) ^ 0x9e37_79b9_7f4a_7c15;
        random
    };
    let (body, rooms) = match bootstrap::inject(api, original.clone(), target, next) {
        Ok(r) => r,
        Err(_) => {
            assert!(matches!(shape, Shape::Batch(n) if n > MAX_BATCH));
            return;
        }
    };
    assert!(rooms.iter().all(|r| *r <= i64::MAX as u64));
    same_except(original, &body, &[FIELD_HOST, FIELD_PORT, FIELD_ROOM]);
    let (host, port) = (Value::from(target.host.clone()), Value::from(target.port));
    match shape {
        Shape::Single => {
            assert_eq!(rooms.len(), 1);
            assert_eq!(body.get(FIELD_HOST), Some(&host));
            assert_eq!(body.get(FIELD_PORT), Some(&port));
            assert_eq!(body.get(FIELD_ROOM), Some(&Value::from(rooms[0])));
        }
        Shape::Batch(n) => {
            assert!(n <= MAX_BATCH);
            assert_eq!(rooms.len(), n);
            assert_eq!(body.get(FIELD_HOST), Some(&Value::Array(vec![host; n])));
            assert_eq!(body.get(FIELD_PORT), Some(&Value::Array(vec![port; n])));
            let want: Vec<Value> = rooms.iter().copied().map(Value::from).collect();
            assert_eq!(body.get(FIELD_ROOM), Some(&Value::Array(want)));
        }
    }
    reparses(&body);
}

fuzz_target!(|data: &[u8]| {
    let Some((&options, rest)) = data.split_first() else {
        return;
    };
    let mut parts = rest.splitn(3, |b| *b == 0xff);
    let header = parts.next().unwrap_or_default();
    let body = parts.next().unwrap_or_default();
    let response = parts.next().unwrap_or_default();
    let api = if options & 1 == 0 {
        Api::Completions
    } else {
        Api::Chat
    };
    let addr = prefiller_addr(header).unwrap_or_else(|| SocketAddr::from(([10, 0, 0, 7], 8000)));
    let target = Target::for_prefiller(addr, u16::from(options >> 1) * 257);

    let _ = transfer_params(body);
    let Ok(original) = parse_request(body) else {
        return;
    };
    nixl(api, &original, response);
    sglang(
        api,
        &original,
        &target,
        u64::from(options).wrapping_mul(0x2545_f491_4f6c_dd1d),
    );
});
