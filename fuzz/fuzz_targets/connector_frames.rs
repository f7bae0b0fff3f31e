//! The block manager's connector protocol (`kvgate_kvbm::protocol`), fed a byte stream read as
//! the daemon's socket loop reads it: a 4-byte big-endian length (`body_len`, bounded), then that
//! many bytes of MessagePack, frame after frame (the last one cut short when the input ends).
//! Each body is decoded as a request (`decode_request`, as the daemon does) and as a response
//! (`decode_response`, as the reference connector does); a registration's layout is validated
//! and fingerprinted, and every slot is checked against a segment of the registered size (a
//! real memfd, as a connector passes). The peer protocol shares the framing: each body is also
//! decoded as a peer frame (`peers::wire::decode`, as both ends of a pull do) and as a peer
//! announce (`Announce::decode`).
//!
//! Asserts, besides "no panic":
//! - `body_len` accepts exactly the lengths up to `MAX_FRAME_BYTES`;
//! - a decoded request names at most `MAX_BLOCKS` blocks;
//! - every decoded request and response re-encodes as one frame whose header is its body's
//!   length, and that body decodes to the same message;
//! - a valid layout's fingerprint is stable, and its group is the fingerprint of its shard 0;
//! - a slot passes the segment check exactly when it lies inside the segment;
//! - a decoded peer frame keeps its bounds (a pull's keys, an answer's bytes) and re-encodes
//!   to itself; so does a decoded announce.
#![no_main]

use std::sync::OnceLock;

use kvgate_kvbm::protocol::{
    self, MAX_BLOCKS, MAX_FRAME_BYTES, Request, Response, Slot, body_len, decode_request,
    decode_response,
};
use kvgate_kvbm::peers::directory::Announce;
use kvgate_kvbm::peers::wire;
use kvgate_kvbm::segment::{self, Segment};
use kvgate_kvbm::store::Layout;
use libfuzzer_sys::fuzz_target;

/// The segment every slot is checked against: 1 MiB declared, created once.
const SEGMENT_BYTES: u64 = 1 << 20;

fn segment() -> Option<&'static Segment> {
    static SEGMENT: OnceLock<Option<Segment>> = OnceLock::new();
    SEGMENT
        .get_or_init(|| {
            let fd = segment::create("kvgate-fuzz", SEGMENT_BYTES).ok()?;
            Segment::new(fd, SEGMENT_BYTES, SEGMENT_BYTES).ok()
        })
        .as_ref()
}

/// Encodes `message` as a frame and returns its body, checking the header.
fn reframe<T: serde::Serialize>(message: &T) -> Vec<u8> {
    let mut frame = Vec::new();
    protocol::encode(message, &mut frame);
    let (header, body) = frame.split_at(4);
    let declared = u32::from_be_bytes(header.try_into().expect("4-byte header"));
    assert_eq!(
        declared as usize,
        body.len(),
        "header names the body's length"
    );
    body.to_vec()
}

fn check_layout(layout: &Layout) {
    if layout.validate().is_err() {
        return;
    }
    assert_eq!(layout.fingerprint(), layout.clone().fingerprint());
    let shard0 = Layout {
        shard: 0,
        ..layout.clone()
    };
    assert_eq!(layout.group(), shard0.fingerprint());
}

fn check_slots(slots: &[Slot], block_bytes: u64) {
    let Some(seg) = segment() else {
        return;
    };
    for slot in slots {
        let inside = slot
            .offset
            .checked_add(block_bytes)
            .is_some_and(|end| end <= SEGMENT_BYTES);
        assert_eq!(seg.check(slot.offset, block_bytes).is_ok(), inside);
    }
}

fn check_request(request: &Request, block_bytes: &mut u64) {
    assert!(request.len() <= MAX_BLOCKS, "{} blocks", request.len());
    let body = reframe(request);
    let again = decode_request(&body).expect("a re-encoded request decodes");
    assert_eq!(&again, request);
    match request {
        Request::Register { layout, .. } => {
            check_layout(layout);
            *block_bytes = layout.block_bytes;
        }
        Request::Offload { blocks, .. } | Request::Onboard { blocks } => {
            check_slots(blocks, *block_bytes);
        }
        Request::Lookup { .. } | Request::Unpin { .. } => {}
    }
}

fn check_peer(frame: &wire::Frame) {
    match frame {
        wire::Frame::Pull { keys, .. } => assert!(keys.len() <= MAX_BLOCKS),
        wire::Frame::Blocks {
            block_bytes, sums, ..
        } => assert!((sums.len() as u64).saturating_mul(*block_bytes) <= wire::MAX_ANSWER_BYTES),
        _ => {}
    }
    let body = reframe(frame);
    let again = wire::decode(&body).expect("a re-encoded peer frame decodes");
    assert_eq!(&again, frame);
}

fn check_response(response: &Response) {
    let body = reframe(response);
    let again = decode_response(&body).expect("a re-encoded response decodes");
    assert_eq!(&again, response);
}

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    // The block size slots are checked with, until a registration names one.
    let mut block_bytes = 4096;
    while let Some((header, tail)) = rest.split_first_chunk::<4>() {
        let declared = u32::from_be_bytes(*header) as usize;
        let len = match body_len(*header) {
            Ok(len) => {
                assert!(declared <= MAX_FRAME_BYTES && len == declared);
                len
            }
            Err(_) => {
                assert!(declared > MAX_FRAME_BYTES);
                // The daemon answers `malformed` and closes; read on for coverage with the
                // frame taken as the rest of the input.
                tail.len()
            }
        };
        let (body, next) = tail.split_at(len.min(tail.len()));
        if let Ok(request) = decode_request(body) {
            check_request(&request, &mut block_bytes);
        }
        if let Ok(response) = decode_response(body) {
            check_response(&response);
        }
        if let Ok(frame) = wire::decode(body) {
            check_peer(&frame);
        }
        if let Ok(announce) = Announce::decode(body) {
            assert_eq!(Announce::decode(&announce.encode()).ok(), Some(announce));
        }
        rest = next;
    }
});
