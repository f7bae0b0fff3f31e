//! The EPP↔EPP in-flight message on `kvgate.inflight.<namespace>.<pool>` (DESIGN.md § KV
//! events): MessagePack with field names, versioned like the envelope, bounded on decode.
//!
//! Each replica (a random id per start) publishes, at most every few milliseconds, the changes
//! its own routing made — routed, first token, finished — as signed differences per endpoint,
//! and periodically its full in-flight load (`full`), which replaces whatever a receiver holds
//! for it. Endpoints are named by (pod, target port), not by the process-local ids, through a
//! table each message carries. Sequence numbers are contiguous per replica: a receiver that sees
//! a gap keeps applying and is corrected by the next full state.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use kv_index::EndpointId;
use scheduler::{ChangeKind, InflightChange, InflightLoad};

/// The version this build writes and reads.
pub const INFLIGHT_VERSION: u16 = 1;
/// Largest encoded message a receiver accepts.
pub const MAX_INFLIGHT_BYTES: usize = 512 << 10;
/// Most deltas one message carries; more changes than that are sent as full state instead.
pub const MAX_DELTAS: usize = 4096;
/// Most endpoints one message names.
pub const MAX_ENDPOINTS: usize = 4096;

/// An endpoint as every replica names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerEndpoint {
    /// Pod name.
    pub pod: String,
    /// Target port.
    pub port: u16,
}

/// A lifecycle step, as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeltaKind {
    /// Routed.
    Routed,
    /// First token.
    FirstToken,
    /// Finished.
    Finished,
}

/// One change of the sender's load on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// The step.
    pub kind: DeltaKind,
    /// Index into the message's endpoint table.
    pub ep: u32,
    /// Change in requests.
    pub requests: i64,
    /// Change in prefill blocks.
    pub prefill: i64,
    /// Change in decode blocks.
    pub decode: i64,
}

/// The sender's whole load on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Total {
    /// Index into the message's endpoint table.
    pub ep: u32,
    /// Requests in flight.
    pub requests: u64,
    /// Prefill blocks.
    pub prefill: u64,
    /// Decode blocks.
    pub decode: u64,
}

/// One message from one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflightMessage {
    /// Version.
    pub v: u16,
    /// The sender's id (random per start).
    pub replica: u64,
    /// Contiguous per replica from 0.
    pub seq: u64,
    /// Endpoints the deltas and totals refer to.
    #[serde(default)]
    pub endpoints: Vec<PeerEndpoint>,
    /// Changes since the previous message.
    #[serde(default)]
    pub deltas: Vec<Delta>,
    /// When present, the sender's whole load after `deltas` (endpoints not listed have none).
    #[serde(default)]
    pub full: Option<Vec<Total>>,
    /// The sender is shutting down: forget its contribution now.
    #[serde(default)]
    pub bye: bool,
}

/// Why a message was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Encoding failed.
    #[error("encoding an in-flight message: {0}")]
    Encode(#[source] rmp_serde::encode::Error),
    /// Not a well-formed message.
    #[error("decoding an in-flight message: {0}")]
    Decode(#[source] rmp_serde::decode::Error),
    /// Unknown version.
    #[error("in-flight message version {0} is not supported (this build reads {INFLIGHT_VERSION})")]
    Version(u16),
    /// A bound was exceeded.
    #[error("in-flight message {what} = {count} exceeds {limit}")]
    TooLarge {
        /// Which bound.
        what: &'static str,
        /// Found.
        count: usize,
        /// The bound.
        limit: usize,
    },
}

impl WireError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            WireError::Encode(_) => "encode",
            WireError::Decode(_) => "decode",
            WireError::Version(_) => "version",
            WireError::TooLarge { .. } => "too_large",
        }
    }
}

fn bound(what: &'static str, count: usize, limit: usize) -> Result<(), WireError> {
    if count > limit {
        return Err(WireError::TooLarge { what, count, limit });
    }
    Ok(())
}

impl InflightMessage {
    /// Encodes the message.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        rmp_serde::to_vec_named(self).map_err(WireError::Encode)
    }

    /// Decodes and checks a message.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        bound("bytes", bytes.len(), MAX_INFLIGHT_BYTES)?;
        let m: InflightMessage = rmp_serde::from_slice(bytes).map_err(WireError::Decode)?;
        if m.v != INFLIGHT_VERSION {
            return Err(WireError::Version(m.v));
        }
        bound("endpoints", m.endpoints.len(), MAX_ENDPOINTS)?;
        bound("deltas", m.deltas.len(), MAX_DELTAS)?;
        bound("totals", m.full.as_ref().map_or(0, Vec::len), MAX_ENDPOINTS)?;
        Ok(m)
    }
}

/// Builds one replica's messages: numbers them and names endpoints.
#[derive(Debug)]
pub struct Outbox {
    replica: u64,
    seq: u64,
}

impl Outbox {
    /// The outbox of replica `replica`.
    pub fn new(replica: u64) -> Self {
        Self { replica, seq: 0 }
    }

    /// The replica id.
    pub fn replica(&self) -> u64 {
        self.replica
    }

    /// A message carrying `changes`, or — when `full` is asked for, or the changes are more
    /// than a message carries — the full own load `own` instead. `name` gives an endpoint's
    /// (pod, port); endpoints it cannot name (left the pool) are skipped. `None` when there is
    /// nothing to send.
    pub fn build(
        &mut self,
        changes: &[InflightChange],
        own: &[(EndpointId, InflightLoad)],
        full: bool,
        name: impl Fn(EndpointId) -> Option<PeerEndpoint>,
    ) -> Option<InflightMessage> {
        let full = (full || changes.len() > MAX_DELTAS).then_some(own);
        if full.is_none() && changes.is_empty() {
            return None;
        }
        let mut table = Table::default();
        let mut msg = InflightMessage {
            v: INFLIGHT_VERSION,
            replica: self.replica,
            seq: self.seq,
            endpoints: Vec::new(),
            deltas: Vec::new(),
            full: None,
            bye: false,
        };
        match full {
            Some(own) => {
                let totals = own
                    .iter()
                    .filter_map(|(id, l)| {
                        Some(Total {
                            ep: table.index(*id, &name)?,
                            requests: l.requests,
                            prefill: l.prefill_blocks,
                            decode: l.decode_blocks,
                        })
                    })
                    .take(MAX_ENDPOINTS)
                    .collect();
                msg.full = Some(totals);
            }
            None => {
                msg.deltas = changes
                    .iter()
                    .filter_map(|c| {
                        Some(Delta {
                            kind: match c.kind {
                                ChangeKind::Routed => DeltaKind::Routed,
                                ChangeKind::FirstToken => DeltaKind::FirstToken,
                                ChangeKind::Finished => DeltaKind::Finished,
                            },
                            ep: table.index(c.endpoint, &name)?,
                            requests: c.requests,
                            prefill: c.prefill_blocks,
                            decode: c.decode_blocks,
                        })
                    })
                    .take(MAX_DELTAS)
                    .collect();
            }
        }
        msg.endpoints = table.names;
        self.seq = self.seq.wrapping_add(1);
        Some(msg)
    }

    /// The goodbye message sent on shutdown.
    pub fn bye(&mut self) -> InflightMessage {
        let msg = InflightMessage {
            v: INFLIGHT_VERSION,
            replica: self.replica,
            seq: self.seq,
            endpoints: Vec::new(),
            deltas: Vec::new(),
            full: Some(Vec::new()),
            bye: true,
        };
        self.seq = self.seq.wrapping_add(1);
        msg
    }
}

#[derive(Default)]
struct Table {
    names: Vec<PeerEndpoint>,
    by_id: HashMap<EndpointId, Option<u32>>,
}

impl Table {
    fn index(
        &mut self,
        id: EndpointId,
        name: &impl Fn(EndpointId) -> Option<PeerEndpoint>,
    ) -> Option<u32> {
        if let Some(i) = self.by_id.get(&id) {
            return *i;
        }
        let i = match name(id) {
            Some(n) if self.names.len() < MAX_ENDPOINTS => {
                self.names.push(n);
                u32::try_from(self.names.len() - 1).ok()
            }
            _ => None,
        };
        self.by_id.insert(id, i);
        i
    }
}
