//! Engine load samples a sidecar relays on `kvgate.load.<namespace>.<pool>.<pod>`, so EPP
//! replicas need not each scrape every pod.
//!
//! MessagePack with field names, like the envelope: receivers ignore fields they do not know
//! and refuse major versions they do not know.

use serde::{Deserialize, Serialize};

use crate::envelope::{ENVELOPE_VERSION, EnvelopeError, Source};

/// Largest encoded sample a receiver accepts.
pub const MAX_LOAD_SAMPLE_BYTES: usize = 4096;

/// One engine load sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadSample {
    /// Protocol major version (the envelope's).
    pub v: u16,
    /// The engine (pod and data-parallel rank) the sample is of.
    pub source: Source,
    /// When the engine's metrics were read, in Unix milliseconds (wall clock; receivers judge
    /// staleness by arrival time, not by this, so clock skew cannot make a sample look fresh).
    pub unix_ms: u64,
    /// Requests queued in the engine.
    pub waiting: u32,
    /// Requests in the engine's running batch.
    pub running: u32,
    /// KV-cache usage in `[0, 1]`.
    pub kv_usage: f64,
}

impl LoadSample {
    /// Encodes the sample.
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        rmp_serde::to_vec_named(self).map_err(EnvelopeError::Encode)
    }

    /// Decodes a sample; refuses oversized input and unknown versions, and clamps `kv_usage`
    /// into `[0, 1]` (NaN becomes 0).
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        if bytes.len() > MAX_LOAD_SAMPLE_BYTES {
            return Err(EnvelopeError::TooLarge {
                what: "bytes",
                count: bytes.len(),
                limit: MAX_LOAD_SAMPLE_BYTES,
            });
        }
        let mut s: LoadSample = rmp_serde::from_slice(bytes).map_err(EnvelopeError::Decode)?;
        if s.v != ENVELOPE_VERSION {
            return Err(EnvelopeError::UnsupportedVersion(s.v));
        }
        s.kv_usage = if s.kv_usage.is_nan() {
            0.0
        } else {
            s.kv_usage.clamp(0.0, 1.0)
        };
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::envelope::EngineKind;

    fn sample(kv_usage: f64) -> LoadSample {
        LoadSample {
            v: ENVELOPE_VERSION,
            source: Source {
                namespace: "ns".into(),
                pool: Some("p".into()),
                pod: Some("pod".into()),
                ip: Some("10.0.0.9".into()),
                port: Some(8000),
                dp_rank: 1,
                node: Some("node-a".into()),
                model: "m".into(),
                engine: EngineKind::Sglang,
                block_size: 16,
            },
            unix_ms: 1_790_000_000_000,
            waiting: 3,
            running: 17,
            kv_usage,
        }
    }

    #[test]
    fn round_trips_and_sanitises_usage() {
        let s = sample(0.25);
        assert_eq!(LoadSample::decode(&s.encode().unwrap()).unwrap(), s);
        let back = LoadSample::decode(&sample(f64::NAN).encode().unwrap()).unwrap();
        assert_eq!(back.kv_usage, 0.0);
        let back = LoadSample::decode(&sample(7.0).encode().unwrap()).unwrap();
        assert_eq!(back.kv_usage, 1.0);
    }

    #[test]
    fn refuses_unknown_versions_and_junk() {
        let mut s = sample(0.5);
        s.v = 2;
        assert!(matches!(
            LoadSample::decode(&s.encode().unwrap()),
            Err(EnvelopeError::UnsupportedVersion(2))
        ));
        assert!(LoadSample::decode(b"\xc1").is_err());
        assert!(LoadSample::decode(&vec![0u8; MAX_LOAD_SAMPLE_BYTES + 1]).is_err());
    }
}
