//! Decoding of engine payloads (both event encodings).

use super::{BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, RawValue};
use crate::msgpack::{self, Head, Int, Reader};
use crate::tier::Medium;

/// Bounds on what one payload may contain; larger inputs are refused, not truncated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Events in one batch.
    pub max_events: usize,
    /// Block hashes in one event.
    pub max_blocks_per_event: usize,
    /// Token ids in one event.
    pub max_tokens_per_event: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_events: 65_536,
            max_blocks_per_event: 65_536,
            max_tokens_per_event: 1 << 22,
        }
    }
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not well-formed MessagePack, or a value has the wrong type.
    #[error(transparent)]
    Msgpack(#[from] msgpack::Error),
    /// The batch is not an array `[ts, events, dp_rank?]`.
    #[error("event batch must be an array of at least 2 elements, got {0}")]
    BatchShape(usize),
    /// Bytes follow the batch.
    #[error("{0} trailing bytes after the event batch")]
    TrailingBytes(usize),
    /// An event is neither a tagged array nor a map.
    #[error("event {index}: {reason}")]
    EventShape {
        /// The event's position in the batch.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A required field is missing.
    #[error("event {index} ({event}): missing field `{field}`")]
    MissingField {
        /// The event's position in the batch.
        index: usize,
        /// The event type.
        event: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A medium name no engine is known to publish.
    #[error("event {index}: unknown medium {medium:?}")]
    UnknownMedium {
        /// The event's position in the batch.
        index: usize,
        /// The name on the wire.
        medium: String,
    },
    /// A binary block hash shorter than 8 bytes.
    #[error("event {index}: binary block hash of {len} bytes, need at least 8")]
    HashTooShort {
        /// The event's position in the batch.
        index: usize,
        /// Its length.
        len: usize,
    },
    /// The payload exceeds a configured [`Limits`] bound.
    #[error("{what} = {count} exceeds the limit of {limit}")]
    LimitExceeded {
        /// Which bound.
        what: &'static str,
        /// The count found.
        count: usize,
        /// The bound.
        limit: usize,
    },
}

impl DecodeError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DecodeError::Msgpack(_) => "msgpack",
            DecodeError::BatchShape(_) => "batch_shape",
            DecodeError::TrailingBytes(_) => "trailing_bytes",
            DecodeError::EventShape { .. } => "event_shape",
            DecodeError::MissingField { .. } => "missing_field",
            DecodeError::UnknownMedium { .. } => "unknown_medium",
            DecodeError::HashTooShort { .. } => "hash_too_short",
            DecodeError::LimitExceeded { .. } => "limit_exceeded",
        }
    }
}

type Result<T, E = DecodeError> = std::result::Result<T, E>;

/// Decodes one payload with the default [`Limits`].
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch> {
    decode_batch_with(payload, &Limits::default())
}

/// Decodes one payload.
pub fn decode_batch_with(payload: &[u8], limits: &Limits) -> Result<EventBatch> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if n < 2 {
        return Err(DecodeError::BatchShape(n));
    }
    let ts = r.number()?;
    let count = r.array_len()?;
    check(limits.max_events, count, "events per batch")?;
    let mut events = Vec::with_capacity(count);
    for index in 0..count {
        events.push(
            EventDecoder {
                r: &mut r,
                index,
                limits,
            }
            .event()?,
        );
    }
    let dp_rank = if n >= 3 { r.opt_i64()? } else { None };
    for _ in 3..n {
        r.skip_value()?;
    }
    if r.remaining() != 0 {
        return Err(DecodeError::TrailingBytes(r.remaining()));
    }
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

fn check(limit: usize, count: usize, what: &'static str) -> Result<()> {
    if count > limit {
        Err(DecodeError::LimitExceeded { what, count, limit })
    } else {
        Ok(())
    }
}

/// The event types this decoder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn parse(tag: &str) -> Option<Self> {
        match tag {
            "BlockStored" => Some(Kind::Stored),
            "BlockRemoved" => Some(Kind::Removed),
            "AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }
}

/// Field positions of the array encoding, after the tag (vLLM ≤ 0.23 declaration order).
const STORED_ARRAY_FIELDS: [Field; 11] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
];
const REMOVED_ARRAY_FIELDS: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

/// The fields this decoder reads; everything else is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    CacheSalt,
}

impl Field {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::ParentBlockHash,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "lora_id" => Field::LoraId,
            "medium" => Field::Medium,
            "lora_name" => Field::LoraName,
            "extra_keys" => Field::ExtraKeys,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::SpecKind,
            "kv_cache_spec_sliding_window" => Field::SlidingWindow,
            "cache_salt" => Field::CacheSalt,
            _ => return None,
        })
    }
}

/// Fields gathered from either encoding before the event is assembled.
#[derive(Default)]
struct Fields {
    stored: BlockStored,
    seen_hashes: bool,
    seen_tokens: bool,
    seen_block_size: bool,
}

struct EventDecoder<'r, 'a> {
    r: &'r mut Reader<'a>,
    index: usize,
    limits: &'r Limits,
}

impl EventDecoder<'_, '_> {
    fn event(mut self) -> Result<EngineEvent> {
        match self.r.head()? {
            Head::Array(n) => self.array_event(n),
            Head::Map(n) => self.map_event(n),
            _ => Err(self.shape("event is neither an array nor a map")),
        }
    }

    fn shape(&self, reason: &'static str) -> DecodeError {
        DecodeError::EventShape {
            index: self.index,
            reason,
        }
    }

    fn array_event(&mut self, n: usize) -> Result<EngineEvent> {
        if n == 0 {
            return Err(self.shape("empty event array"));
        }
        let tag = self.r.str()?;
        let Some(kind) = Kind::parse(tag) else {
            let type_name = tag.to_owned();
            for _ in 1..n {
                self.r.skip_value()?;
            }
            return Ok(EngineEvent::Unknown { type_name });
        };
        let layout: &[Field] = match kind {
            Kind::Stored => &STORED_ARRAY_FIELDS,
            Kind::Removed => &REMOVED_ARRAY_FIELDS,
            Kind::Cleared => &[],
        };
        let mut fields = Fields::default();
        for i in 1..n {
            match layout.get(i - 1) {
                Some(&field) => self.field(field, &mut fields)?,
                None => {
                    self.r.skip_value()?;
                }
            }
        }
        self.finish(kind, fields)
    }

    fn map_event(&mut self, n: usize) -> Result<EngineEvent> {
        let mut kind: Option<std::result::Result<Kind, String>> = None;
        let mut fields = Fields::default();
        for _ in 0..n {
            let key = self.r.str()?;
            if key == "type" {
                let tag = self.r.str()?;
                kind = Some(Kind::parse(tag).ok_or_else(|| tag.to_owned()));
                continue;
            }
            match Field::parse(key) {
                Some(field) => self.field(field, &mut fields)?,
                None => {
                    self.r.skip_value()?;
                }
            }
        }
        match kind {
            None => Err(self.shape("event map has no \"type\" key")),
            Some(Err(type_name)) => Ok(EngineEvent::Unknown { type_name }),
            Some(Ok(kind)) => self.finish(kind, fields),
        }
    }

    fn field(&mut self, field: Field, f: &mut Fields) -> Result<()> {
        let s = &mut f.stored;
        match field {
            Field::BlockHashes => {
                s.block_hashes = self.hashes()?;
                f.seen_hashes = true;
            }
            Field::ParentBlockHash => {
                s.parent_block_hash = if self.r.eat_nil()? {
                    None
                } else {
                    Some(self.hash()?)
                };
            }
            Field::TokenIds => {
                s.token_ids = self.tokens()?;
                f.seen_tokens = true;
            }
            Field::BlockSize => {
                s.block_size = self.r.u32()?;
                f.seen_block_size = true;
            }
            Field::LoraId => s.lora_id = self.r.opt_i64()?,
            Field::Medium => s.medium = self.medium()?,
            Field::LoraName => s.lora_name = self.r.opt_str()?.map(str::to_owned),
            Field::ExtraKeys => s.extra_keys = self.extra_keys()?,
            Field::GroupIdx => s.group_idx = self.r.opt_i64()?,
            Field::SpecKind => s.kv_cache_spec_kind = self.r.opt_str()?.map(str::to_owned),
            Field::SlidingWindow => s.kv_cache_spec_sliding_window = self.r.opt_i64()?,
            Field::CacheSalt => s.cache_salt = self.r.opt_str()?.map(str::to_owned),
        }
        Ok(())
    }

    fn finish(&self, kind: Kind, f: Fields) -> Result<EngineEvent> {
        let missing = |event, field| DecodeError::MissingField {
            index: self.index,
            event,
            field,
        };
        match kind {
            Kind::Stored => {
                if !f.seen_hashes {
                    return Err(missing("BlockStored", "block_hashes"));
                }
                if !f.seen_tokens {
                    return Err(missing("BlockStored", "token_ids"));
                }
                if !f.seen_block_size {
                    return Err(missing("BlockStored", "block_size"));
                }
                Ok(EngineEvent::BlockStored(f.stored))
            }
            Kind::Removed => {
                if !f.seen_hashes {
                    return Err(missing("BlockRemoved", "block_hashes"));
                }
                let s = f.stored;
                Ok(EngineEvent::BlockRemoved(BlockRemoved {
                    block_hashes: s.block_hashes,
                    medium: s.medium,
                    group_idx: s.group_idx,
                }))
            }
            Kind::Cleared => Ok(EngineEvent::AllBlocksCleared),
        }
    }

    fn hash(&mut self) -> Result<EngineHash> {
        let start = self.r.position();
        match self.r.head()? {
            Head::Int(Int::Unsigned(v)) => Ok(EngineHash(v)),
            Head::Int(Int::Negative(v)) => Ok(EngineHash(v as u64)),
            Head::Bin(b) => {
                let tail = b.len().checked_sub(8).and_then(|at| b.get(at..)).ok_or(
                    DecodeError::HashTooShort {
                        index: self.index,
                        len: b.len(),
                    },
                )?;
                let mut be = [0u8; 8];
                be.copy_from_slice(tail);
                Ok(EngineHash(u64::from_be_bytes(be)))
            }
            _ => Err(msgpack::Error {
                offset: start,
                kind: msgpack::ErrorKind::UnexpectedType {
                    expected: "block hash (integer or binary)",
                    found: self.r.slice(start, start + 1).first().copied().unwrap_or(0),
                },
            }
            .into()),
        }
    }

    fn hashes(&mut self) -> Result<Vec<EngineHash>> {
        let n = self.r.array_len()?;
        check(
            self.limits.max_blocks_per_event,
            n,
            "block hashes per event",
        )?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Result<Vec<u32>> {
        if self.r.eat_nil()? {
            return Ok(Vec::new());
        }
        let n = self.r.array_len()?;
        check(self.limits.max_tokens_per_event, n, "token ids per event")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.r.u32()?);
        }
        Ok(out)
    }

    fn medium(&mut self) -> Result<Option<Medium>> {
        match self.r.opt_str()? {
            None => Ok(None),
            Some(name) => Medium::parse(name)
                .map(Some)
                .ok_or_else(|| DecodeError::UnknownMedium {
                    index: self.index,
                    medium: name.to_owned(),
                }),
        }
    }

    fn extra_keys(&mut self) -> Result<Option<Vec<Option<RawValue>>>> {
        if self.r.eat_nil()? {
            return Ok(None);
        }
        let n = self.r.array_len()?;
        check(self.limits.max_blocks_per_event, n, "extra keys per event")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            if self.r.eat_nil()? {
                out.push(None);
            } else {
                out.push(Some(RawValue(self.r.skip_value()?.to_vec())));
            }
        }
        Ok(Some(out))
    }
}
