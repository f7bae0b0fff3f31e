//! The kvgate NATS envelope: versioned MessagePack carrying one source's kvgate events.
//!
//! Encoded as maps with field names (`rmp_serde::to_vec_named`), so fields can be added without
//! breaking older receivers, which ignore unknown fields and skip unknown event types. The major
//! version `v` changes only for incompatible changes; receivers refuse versions they do not know.

use serde::{Deserialize, Serialize};

use crate::event::KvEvent;

/// The envelope version this crate writes and reads.
pub const ENVELOPE_VERSION: u16 = 1;

/// Which kind of engine (or daemon) a source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// TensorRT-LLM.
    TrtLlm,
    /// kvgate's engine simulator.
    Sim,
    /// kvgate's KV block manager daemon (a node source).
    Kvbm,
    /// A kind from a newer kvgate.
    #[serde(other)]
    Other,
}

/// Who published the events: a pod's engine (one DP rank) or a node's block manager.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Source {
    /// Kubernetes namespace.
    pub namespace: String,
    /// InferencePool name; absent for node sources.
    #[serde(default)]
    pub pool: Option<String>,
    /// Pod name; absent for node sources.
    #[serde(default)]
    pub pod: Option<String>,
    /// Pod IP; absent for node sources.
    #[serde(default)]
    pub ip: Option<String>,
    /// The engine's serving port for this rank; absent for node sources.
    #[serde(default)]
    pub port: Option<u16>,
    /// Data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// The node the source runs on, when known.
    #[serde(default)]
    pub node: Option<String>,
    /// Served model name.
    pub model: String,
    /// Engine kind.
    pub engine: EngineKind,
    /// Tokens per block.
    pub block_size: u32,
}

/// One published batch of events from one source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Envelope major version.
    pub v: u16,
    /// The publisher.
    pub source: Source,
    /// Random per publisher start; a new epoch means the receiver must resynchronise.
    pub epoch: u64,
    /// Contiguous per epoch, from 0; a gap means the receiver must resynchronise.
    pub seq: u64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
}

/// Bounds a receiver enforces before trusting an envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeLimits {
    /// Encoded size (NATS's default max payload is 1 MiB).
    pub max_bytes: usize,
    /// Block keys over all events.
    pub max_keys: usize,
}

impl Default for EnvelopeLimits {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 20,
            max_keys: 1 << 17,
        }
    }
}

/// Why an envelope could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// Serialisation failed.
    #[error("encoding the envelope: {0}")]
    Encode(#[source] rmp_serde::encode::Error),
    /// The bytes are not a well-formed envelope.
    #[error("decoding the envelope: {0}")]
    Decode(#[source] rmp_serde::decode::Error),
    /// A major version this receiver does not know.
    #[error("envelope version {0} is not supported (this build reads {ENVELOPE_VERSION})")]
    UnsupportedVersion(u16),
    /// The envelope exceeds a bound.
    #[error("envelope {what} = {count} exceeds the limit of {limit}")]
    TooLarge {
        /// Which bound.
        what: &'static str,
        /// Found.
        count: usize,
        /// The bound.
        limit: usize,
    },
}

impl EnvelopeError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            EnvelopeError::Encode(_) => "encode",
            EnvelopeError::Decode(_) => "decode",
            EnvelopeError::UnsupportedVersion(_) => "version",
            EnvelopeError::TooLarge { .. } => "too_large",
        }
    }
}

impl Envelope {
    /// Encodes the envelope.
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        rmp_serde::to_vec_named(self).map_err(EnvelopeError::Encode)
    }

    /// Decodes and checks an envelope.
    pub fn decode(bytes: &[u8], limits: &EnvelopeLimits) -> Result<Self, EnvelopeError> {
        if bytes.len() > limits.max_bytes {
            return Err(EnvelopeError::TooLarge {
                what: "bytes",
                count: bytes.len(),
                limit: limits.max_bytes,
            });
        }
        let env: Envelope = rmp_serde::from_slice(bytes).map_err(EnvelopeError::Decode)?;
        if env.v != ENVELOPE_VERSION {
            return Err(EnvelopeError::UnsupportedVersion(env.v));
        }
        let keys: usize = env.events.iter().map(KvEvent::key_count).sum();
        if keys > limits.max_keys {
            return Err(EnvelopeError::TooLarge {
                what: "keys",
                count: keys,
                limit: limits.max_keys,
            });
        }
        Ok(env)
    }
}
