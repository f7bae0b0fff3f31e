//! Every decoder that reads wire data, fed arbitrary bytes: none may panic, and a payload that
//! decodes must re-encode to bytes that decode to the same batch.
#![no_main]

use kv_events::engine::{WireFormat, decode_batch, encode_batch};
use kv_events::envelope::{Envelope, EnvelopeLimits};
use kv_events::frame::{KvFrame, ReplayReply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = decode_batch(data) {
        if batch.ts.is_finite() {
            for format in [
                WireFormat::VllmArray,
                WireFormat::VllmMap,
                WireFormat::Sglang,
            ] {
                let again = encode_batch(&batch, format);
                assert!(decode_batch(&again).is_ok(), "re-encoded batch must decode");
            }
        }
    }
    let _ = Envelope::decode(data, &EnvelopeLimits::default());
    // Split the input into frames at 0xfe bytes to exercise the multipart layouts.
    let parts: Vec<&[u8]> = data.split(|b| *b == 0xfe).take(5).collect();
    let _ = KvFrame::from_parts(&parts);
    let _ = ReplayReply::from_parts(&parts);
});
