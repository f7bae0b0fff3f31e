//! Snapshots of a source's resident set: what a receiver fetches after a gap or a new epoch.
//!
//! Protocol (DESIGN.md § KV events), over core NATS request/reply:
//! 1. The receiver subscribes to a fresh inbox and publishes a [`SnapshotRequest`] on
//!    `kvgate.snapshot.<namespace>.<pool>.<pod>` with that inbox as the reply subject.
//! 2. The publisher answers with one or more [`SnapshotChunk`]s on the inbox, numbered from 0,
//!    the final one marked `last`. Every chunk carries the same source, epoch and `next_seq`.
//! 3. The snapshot holds exactly the effect of the publisher's envelopes with `seq < next_seq`
//!    of that epoch. The receiver replaces the source's entries with it, drops buffered
//!    envelopes below `next_seq` and applies the rest in order; a gap after that starts over.
//!
//! [`SnapshotAssembler`] is the receiver's pure half: it checks and joins chunks.
//! [`Snapshot::into_chunks`] is the publisher's.

use serde::{Deserialize, Serialize};

use crate::envelope::{ENVELOPE_VERSION, EnvelopeError, Source};
use crate::key::BlockKey;
use crate::tier::Tier;

/// Keys per chunk when the request does not say: at most 9 bytes each in MessagePack, so a
/// chunk stays well under NATS's default 1 MiB payload.
pub const DEFAULT_KEYS_PER_CHUNK: u32 = 65_536;

/// The most keys per chunk a publisher honours.
pub const MAX_KEYS_PER_CHUNK: u32 = 100_000;

/// A receiver's request for a source's resident set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// Protocol major version (the envelope's).
    pub v: u16,
    /// Which data-parallel rank of the pod (0 when the engine has one).
    #[serde(default)]
    pub dp_rank: u32,
    /// Largest chunk the receiver wants, in keys; the publisher clamps it to
    /// `1..=`[`MAX_KEYS_PER_CHUNK`].
    #[serde(default)]
    pub max_keys_per_chunk: Option<u32>,
    /// The source's model, for node sources: a node's KV block manager publishes one source
    /// per model on the node's one snapshot subject. Absent for pod sources (and from
    /// receivers older than the field, which a node serving one model still answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl SnapshotRequest {
    /// A request for `dp_rank` with the default chunk size.
    pub fn new(dp_rank: u32) -> Self {
        Self {
            v: ENVELOPE_VERSION,
            dp_rank,
            max_keys_per_chunk: None,
            model: None,
        }
    }

    /// The request for `source`'s snapshot: its DP rank, and its model when it is a node
    /// source.
    pub fn for_source(source: &Source) -> Self {
        let mut r = Self::new(source.dp_rank);
        if source.pod.is_none() && source.node.is_some() {
            r.model = Some(source.model.clone());
        }
        r
    }

    /// Encodes the request.
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        rmp_serde::to_vec_named(self).map_err(EnvelopeError::Encode)
    }

    /// Decodes a request, refusing unknown major versions.
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        if bytes.len() > 4096 {
            return Err(EnvelopeError::TooLarge {
                what: "bytes",
                count: bytes.len(),
                limit: 4096,
            });
        }
        let req: SnapshotRequest = rmp_serde::from_slice(bytes).map_err(EnvelopeError::Decode)?;
        if req.v != ENVELOPE_VERSION {
            return Err(EnvelopeError::UnsupportedVersion(req.v));
        }
        Ok(req)
    }

    /// The chunk size to use.
    pub fn keys_per_chunk(&self) -> usize {
        let n = self
            .max_keys_per_chunk
            .unwrap_or(DEFAULT_KEYS_PER_CHUNK)
            .clamp(1, MAX_KEYS_PER_CHUNK);
        n as usize
    }
}

/// The keys resident in one tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierKeys {
    /// The tier.
    pub tier: Tier,
    /// Its resident keys, in no particular order.
    pub keys: Vec<BlockKey>,
}

/// One part of a snapshot reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotChunk {
    /// Protocol major version (the envelope's).
    pub v: u16,
    /// The publisher, as in its envelopes.
    pub source: Source,
    /// The publisher's epoch.
    pub epoch: u64,
    /// The snapshot reflects every envelope of `epoch` with `seq < next_seq`.
    pub next_seq: u64,
    /// This chunk's number, from 0.
    pub part: u32,
    /// Whether this is the final chunk.
    pub last: bool,
    /// Resident keys by tier.
    pub tiers: Vec<TierKeys>,
}

impl SnapshotChunk {
    /// Encodes the chunk.
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        rmp_serde::to_vec_named(self).map_err(EnvelopeError::Encode)
    }

    /// Decodes a chunk, refusing unknown major versions and oversized input.
    pub fn decode(bytes: &[u8], max_bytes: usize) -> Result<Self, EnvelopeError> {
        if bytes.len() > max_bytes {
            return Err(EnvelopeError::TooLarge {
                what: "bytes",
                count: bytes.len(),
                limit: max_bytes,
            });
        }
        let chunk: SnapshotChunk = rmp_serde::from_slice(bytes).map_err(EnvelopeError::Decode)?;
        if chunk.v != ENVELOPE_VERSION {
            return Err(EnvelopeError::UnsupportedVersion(chunk.v));
        }
        Ok(chunk)
    }

    fn key_count(&self) -> usize {
        self.tiers.iter().map(|t| t.keys.len()).sum()
    }
}

/// A whole snapshot: a source's resident set at a point of its event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The publisher.
    pub source: Source,
    /// The publisher's epoch.
    pub epoch: u64,
    /// The snapshot reflects every envelope of `epoch` with `seq < next_seq`.
    pub next_seq: u64,
    /// Resident keys by tier; a tier may appear in several entries.
    pub tiers: Vec<TierKeys>,
}

impl Snapshot {
    /// Every resident (key, tier) pair.
    pub fn entries(&self) -> impl Iterator<Item = (BlockKey, Tier)> + '_ {
        self.tiers
            .iter()
            .flat_map(|t| t.keys.iter().map(move |k| (*k, t.tier)))
    }

    /// How many (key, tier) pairs it holds.
    pub fn len(&self) -> usize {
        self.tiers.iter().map(|t| t.keys.len()).sum()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits the snapshot into chunks of at most `keys_per_chunk` keys (at least one chunk,
    /// so an empty resident set still answers).
    pub fn into_chunks(self, keys_per_chunk: usize) -> Vec<SnapshotChunk> {
        let per = keys_per_chunk.max(1);
        let mut chunks = Vec::new();
        let mut current: Vec<TierKeys> = Vec::new();
        let mut in_current = 0usize;
        let chunk = |tiers: Vec<TierKeys>, part: usize| SnapshotChunk {
            v: ENVELOPE_VERSION,
            source: self.source.clone(),
            epoch: self.epoch,
            next_seq: self.next_seq,
            part: u32::try_from(part).unwrap_or(u32::MAX),
            last: false,
            tiers,
        };
        for tk in &self.tiers {
            let mut rest = tk.keys.as_slice();
            while !rest.is_empty() {
                let room = per - in_current;
                let (take, after) = rest.split_at(room.min(rest.len()));
                current.push(TierKeys {
                    tier: tk.tier,
                    keys: take.to_vec(),
                });
                in_current += take.len();
                rest = after;
                if in_current == per {
                    let part = chunks.len();
                    chunks.push(chunk(std::mem::take(&mut current), part));
                    in_current = 0;
                }
            }
        }
        if !current.is_empty() || chunks.is_empty() {
            let part = chunks.len();
            chunks.push(chunk(current, part));
        }
        if let Some(last) = chunks.last_mut() {
            last.last = true;
        }
        chunks
    }
}

/// Why a snapshot reply was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// A chunk arrived out of order (lost or duplicated on the way).
    #[error("snapshot chunk {got} arrived where chunk {expected} was due")]
    OutOfOrder {
        /// The chunk number due.
        expected: u32,
        /// The one that came.
        got: u32,
    },
    /// A chunk names a different source, epoch or position than the first.
    #[error("snapshot chunk {part} does not match the first chunk's source, epoch or seq")]
    Mismatch {
        /// The offending chunk.
        part: u32,
    },
    /// The reply exceeds the receiver's bound on keys.
    #[error("snapshot holds more than {limit} keys")]
    TooLarge {
        /// The bound.
        limit: usize,
    },
    /// A chunk arrived after the last one.
    #[error("snapshot chunk after the last one")]
    AfterLast,
}

impl SnapshotError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            SnapshotError::OutOfOrder { .. } => "out_of_order",
            SnapshotError::Mismatch { .. } => "mismatch",
            SnapshotError::TooLarge { .. } => "too_large",
            SnapshotError::AfterLast => "after_last",
        }
    }
}

/// Joins a snapshot reply's chunks, checking order, identity and size.
#[derive(Debug)]
pub struct SnapshotAssembler {
    max_keys: usize,
    keys: usize,
    first: Option<(Source, u64, u64)>,
    next_part: u32,
    tiers: Vec<TierKeys>,
    done: bool,
}

impl SnapshotAssembler {
    /// An assembler accepting at most `max_keys` keys in all.
    pub fn new(max_keys: usize) -> Self {
        Self {
            max_keys,
            keys: 0,
            first: None,
            next_part: 0,
            tiers: Vec::new(),
            done: false,
        }
    }

    /// Adds a chunk; returns the snapshot once the last chunk has arrived.
    pub fn push(&mut self, chunk: SnapshotChunk) -> Result<Option<Snapshot>, SnapshotError> {
        if self.done {
            return Err(SnapshotError::AfterLast);
        }
        if chunk.part != self.next_part {
            return Err(SnapshotError::OutOfOrder {
                expected: self.next_part,
                got: chunk.part,
            });
        }
        match &self.first {
            None => self.first = Some((chunk.source.clone(), chunk.epoch, chunk.next_seq)),
            Some((source, epoch, next_seq)) => {
                if *source != chunk.source || *epoch != chunk.epoch || *next_seq != chunk.next_seq {
                    return Err(SnapshotError::Mismatch { part: chunk.part });
                }
            }
        }
        self.keys = self.keys.saturating_add(chunk.key_count());
        if self.keys > self.max_keys {
            return Err(SnapshotError::TooLarge {
                limit: self.max_keys,
            });
        }
        self.next_part = self.next_part.saturating_add(1);
        let last = chunk.last;
        self.tiers.extend(chunk.tiers);
        if !last {
            return Ok(None);
        }
        self.done = true;
        let Some((source, epoch, next_seq)) = self.first.take() else {
            return Ok(None);
        };
        Ok(Some(Snapshot {
            source,
            epoch,
            next_seq,
            tiers: std::mem::take(&mut self.tiers),
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

    use super::*;
    use crate::envelope::EngineKind;
    use proptest::prelude::*;

    fn source() -> Source {
        Source {
            namespace: "ns".into(),
            pool: Some("pool".into()),
            pod: Some("pod-0".into()),
            ip: Some("10.0.0.1".into()),
            port: Some(8000),
            dp_rank: 0,
            node: None,
            model: "m".into(),
            engine: EngineKind::Vllm,
            block_size: 16,
        }
    }

    fn snapshot(gpu: u64, host: u64) -> Snapshot {
        Snapshot {
            source: source(),
            epoch: 7,
            next_seq: 42,
            tiers: vec![
                TierKeys {
                    tier: Tier::Gpu,
                    keys: (0..gpu).map(BlockKey).collect(),
                },
                TierKeys {
                    tier: Tier::Host,
                    keys: (1000..1000 + host).map(BlockKey).collect(),
                },
            ],
        }
    }

    #[test]
    fn node_sources_name_their_model_and_old_requests_still_decode() {
        let pod = SnapshotRequest::for_source(&source());
        assert_eq!(pod.model, None);
        let mut node = source();
        (node.pool, node.pod, node.ip, node.port) = (None, None, None, None);
        node.node = Some("n1".into());
        let req = SnapshotRequest::for_source(&node);
        assert_eq!(req.model.as_deref(), Some("m"));
        assert_eq!(
            SnapshotRequest::decode(&req.encode().unwrap()).unwrap(),
            req
        );
        // A request without the field (an older receiver) decodes with no model.
        #[derive(Serialize)]
        struct Old {
            v: u16,
            dp_rank: u32,
        }
        let old = rmp_serde::to_vec_named(&Old { v: 1, dp_rank: 0 }).unwrap();
        assert_eq!(SnapshotRequest::decode(&old).unwrap().model, None);
    }

    fn reassemble(chunks: Vec<SnapshotChunk>) -> Result<Option<Snapshot>, SnapshotError> {
        let mut asm = SnapshotAssembler::new(1 << 20);
        let mut out = None;
        for c in chunks {
            let bytes = c.encode().unwrap();
            let c = SnapshotChunk::decode(&bytes, 1 << 20).unwrap();
            out = asm.push(c)?;
        }
        Ok(out)
    }

    proptest! {
        #[test]
        fn chunks_round_trip(gpu in 0u64..300, host in 0u64..300, per in 1usize..200) {
            let snap = snapshot(gpu, host);
            let chunks = snap.clone().into_chunks(per);
            prop_assert!(chunks.iter().all(|c| c.key_count() <= per));
            prop_assert_eq!(chunks.iter().filter(|c| c.last).count(), 1);
            let back = reassemble(chunks).unwrap().unwrap();
            let mut a: Vec<_> = snap.entries().collect();
            let mut b: Vec<_> = back.entries().collect();
            a.sort();
            b.sort();
            prop_assert_eq!(a, b);
            prop_assert_eq!((back.epoch, back.next_seq), (7, 42));
        }
    }

    #[test]
    fn an_empty_set_still_answers_with_one_last_chunk() {
        let chunks = snapshot(0, 0).into_chunks(10);
        assert_eq!(chunks.len(), 1);
        assert!(chunks[0].last);
        assert!(reassemble(chunks).unwrap().unwrap().is_empty());
    }

    #[test]
    fn refuses_lost_mixed_or_oversized_replies() {
        let mut chunks = snapshot(30, 0).into_chunks(10);
        chunks.remove(1);
        assert_eq!(
            reassemble(chunks).unwrap_err(),
            SnapshotError::OutOfOrder {
                expected: 1,
                got: 2
            }
        );

        let mut chunks = snapshot(30, 0).into_chunks(10);
        chunks[2].epoch = 8;
        assert_eq!(
            reassemble(chunks).unwrap_err(),
            SnapshotError::Mismatch { part: 2 }
        );

        let mut asm = SnapshotAssembler::new(15);
        let mut chunks = snapshot(30, 0).into_chunks(10).into_iter();
        asm.push(chunks.next().unwrap()).unwrap();
        assert_eq!(
            asm.push(chunks.next().unwrap()).unwrap_err(),
            SnapshotError::TooLarge { limit: 15 }
        );

        let mut asm = SnapshotAssembler::new(100);
        let only = snapshot(1, 0).into_chunks(10);
        asm.push(only[0].clone()).unwrap().unwrap();
        assert_eq!(
            asm.push(only[0].clone()).unwrap_err(),
            SnapshotError::AfterLast
        );
    }

    #[test]
    fn requests_round_trip_and_clamp_the_chunk_size() {
        let mut req = SnapshotRequest::new(2);
        assert_eq!(req.keys_per_chunk(), DEFAULT_KEYS_PER_CHUNK as usize);
        req.max_keys_per_chunk = Some(0);
        assert_eq!(req.keys_per_chunk(), 1);
        req.max_keys_per_chunk = Some(u32::MAX);
        assert_eq!(req.keys_per_chunk(), MAX_KEYS_PER_CHUNK as usize);
        let back = SnapshotRequest::decode(&req.encode().unwrap()).unwrap();
        assert_eq!(back, req);
        let mut bad = req;
        bad.v = 99;
        assert!(matches!(
            SnapshotRequest::decode(&bad.encode().unwrap()),
            Err(EnvelopeError::UnsupportedVersion(99))
        ));
    }

    #[test]
    fn a_full_default_chunk_of_the_widest_keys_fits_a_nats_payload() {
        let n = u64::from(DEFAULT_KEYS_PER_CHUNK);
        let snap = Snapshot {
            source: source(),
            epoch: u64::MAX,
            next_seq: u64::MAX,
            tiers: vec![TierKeys {
                tier: Tier::Gpu,
                keys: (0..n).map(|i| BlockKey(u64::MAX - i)).collect(),
            }],
        };
        let chunks = snap.into_chunks(DEFAULT_KEYS_PER_CHUNK as usize);
        assert_eq!(chunks.len(), 1);
        let bytes = chunks[0].encode().unwrap();
        assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
    }
}
