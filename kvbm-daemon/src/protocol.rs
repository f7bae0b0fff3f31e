//! The connector protocol on the daemon's Unix socket. Pure: types, framing, bounds.
//!
//! A connection carries one connector's control messages for one layout; block bytes never
//! travel on it. They live in a shared-memory segment the connector creates (a `memfd`) and
//! passes once:
//!
//! 1. **Handshake.** The connector's first write is the single byte [`HANDSHAKE`] with the
//!    segment's file descriptor attached (`SCM_RIGHTS`).
//! 2. **Frames.** Then requests and responses alternate, each a frame: a 4-byte big-endian
//!    length, then that many bytes of MessagePack (a map with field names). The first request
//!    is [`Request::Register`]; the others name block slots by their byte offset in the
//!    segment: [`Request::Offload`] reads blocks from their slots, [`Request::Onboard`] writes
//!    the blocks it finds into the slots given.
//!
//! Every frame is bounded ([`MAX_FRAME_BYTES`], [`MAX_BLOCKS`]); a connector that breaks the
//! protocol gets an [`Response::Error`] and the connection is closed.

use serde::{Deserialize, Serialize};

use crate::store::Layout;

/// The byte that carries the segment's descriptor.
pub const HANDSHAKE: u8 = b'K';
/// The largest frame either side sends (keys and offsets only: 4,096 blocks take ~80 KiB).
pub const MAX_FRAME_BYTES: usize = 1 << 20;
/// The most blocks (or keys) in one request.
pub const MAX_BLOCKS: usize = 4096;

/// A block and where its bytes are in the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    /// The kvgate block key.
    pub key: u64,
    /// Byte offset of the block's slot in the segment.
    pub offset: u64,
}

/// A connector's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Declares the connection's layout and how many bytes of the segment it may use.
    Register {
        /// The layout of every block on this connection.
        layout: Layout,
        /// Bytes of the segment in use, from offset 0 (at most its size).
        segment_bytes: u64,
    },
    /// Store these blocks (a chain after `parent`), reading each from its slot.
    Offload {
        /// The key before the first block, if any.
        #[serde(default)]
        parent: Option<u64>,
        /// The blocks, in chain order.
        blocks: Vec<Slot>,
    },
    /// How many leading blocks of `keys` are held (host, and any tier); with `pin_ms`, pins
    /// those held for that long (bounded by the daemon), so they stay until the onboard.
    Lookup {
        /// The chain's keys.
        keys: Vec<u64>,
        /// Pin the leading held blocks this long, milliseconds (0: no pin).
        #[serde(default)]
        pin_ms: u32,
    },
    /// Release the pins of `keys` (after the onboard, or when the request went away).
    Unpin {
        /// The keys.
        keys: Vec<u64>,
    },
    /// Copy the leading blocks held into the given slots; stops at the first block not held.
    Onboard {
        /// The chain's keys and where each found block goes.
        blocks: Vec<Slot>,
    },
}

impl Request {
    /// The operation's name, for logs and metric labels.
    pub const fn op(&self) -> &'static str {
        match self {
            Request::Register { .. } => "register",
            Request::Offload { .. } => "offload",
            Request::Lookup { .. } => "lookup",
            Request::Unpin { .. } => "unpin",
            Request::Onboard { .. } => "onboard",
        }
    }

    /// Blocks or keys the request names.
    pub fn len(&self) -> usize {
        match self {
            Request::Register { .. } => 0,
            Request::Offload { blocks, .. } | Request::Onboard { blocks } => blocks.len(),
            Request::Lookup { keys, .. } | Request::Unpin { keys } => keys.len(),
        }
    }

    /// Whether it names no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The frame could not be decoded or broke a bound.
    Malformed,
    /// A request came before `Register`, or `Register` came twice.
    Sequence,
    /// The layout or segment was refused.
    Layout,
    /// A slot lies outside the segment, or a block has the wrong size.
    Slot,
    /// The segment could not be read or written.
    Segment,
    /// The daemon is shutting down.
    Unavailable,
}

/// The daemon's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    /// The layout is registered.
    Registered {
        /// Its id in this daemon (informational).
        layout_id: u32,
    },
    /// What an offload did.
    Offloaded {
        /// Blocks newly stored.
        stored: u32,
        /// Blocks already held.
        present: u32,
        /// Blocks not stored: pinned blocks left their tier too little room.
        #[serde(default)]
        skipped: u32,
    },
    /// A lookup's answer.
    Found {
        /// Leading blocks in host memory.
        host: u32,
        /// Leading blocks in any tier.
        any: u32,
        /// Of those, how many are now pinned (fewer than `any` at the daemon's pin limit;
        /// a peer's blocks are never pinned).
        #[serde(default)]
        pinned: u32,
        /// Of `any`, the trailing blocks another node's block manager holds (pulled at the
        /// onboard).
        #[serde(default)]
        peer: u32,
    },
    /// An unpin's answer.
    Unpinned {
        /// Pins released.
        blocks: u32,
    },
    /// An onboard's answer: the first `blocks` slots now hold their blocks.
    Onboarded {
        /// Blocks written to their slots.
        blocks: u32,
        /// Of which from host memory.
        from_host: u32,
        /// Of which read from disk.
        #[serde(default)]
        from_disk: u32,
        /// Of which fetched from the remote store.
        from_remote: u32,
        /// Of which pulled from another node's block manager.
        #[serde(default)]
        from_peer: u32,
    },
    /// The request failed; after `malformed` and `sequence` the daemon closes the connection.
    Error {
        /// The kind.
        code: ErrorCode,
        /// What was wrong.
        message: String,
    },
}

/// A frame that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// Its declared length is above the bound.
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME_BYTES}")]
    TooLarge(usize),
    /// Its body is not a message of the expected type.
    #[error("undecodable frame: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    /// It names more than [`MAX_BLOCKS`] blocks.
    #[error("{0} blocks in one request; the limit is {MAX_BLOCKS}")]
    TooManyBlocks(usize),
}

/// Appends `message` as a frame to `out`.
pub fn encode<T: Serialize>(message: &T, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    // Serialising these plain enums into a Vec cannot fail.
    if rmp_serde::encode::write_named(out, message).is_err() {
        out.truncate(start);
        return;
    }
    let len = u32::try_from(out.len() - start - 4).unwrap_or(u32::MAX);
    if let Some(header) = out.get_mut(start..start + 4) {
        header.copy_from_slice(&len.to_be_bytes());
    }
}

/// The body length a frame header declares, refusing lengths above the bound.
pub fn body_len(header: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len)
}

/// Decodes a request body, refusing one that names too many blocks.
pub fn decode_request(body: &[u8]) -> Result<Request, FrameError> {
    let request: Request = rmp_serde::from_slice(body)?;
    if request.len() > MAX_BLOCKS {
        return Err(FrameError::TooManyBlocks(request.len()));
    }
    Ok(request)
}

/// Decodes a response body.
pub fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    Ok(rmp_serde::from_slice(body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            model: "m".into(),
            dtype: "fp8".into(),
            layers: 2,
            block_size: 4,
            block_bytes: 8,
            shard: 0,
            shards: 1,
        }
    }

    fn body(frame: &[u8]) -> &[u8] {
        let len = body_len(frame[..4].try_into().unwrap()).unwrap();
        assert_eq!(frame.len(), 4 + len);
        &frame[4..]
    }

    #[test]
    fn requests_and_responses_round_trip() {
        let requests = [
            Request::Register {
                layout: layout(),
                segment_bytes: 64,
            },
            Request::Offload {
                parent: Some(3),
                blocks: vec![Slot { key: 1, offset: 0 }],
            },
            Request::Lookup {
                keys: vec![1, 2],
                pin_ms: 100,
            },
            Request::Unpin { keys: vec![1] },
            Request::Onboard {
                blocks: vec![Slot { key: 1, offset: 8 }],
            },
        ];
        for r in requests {
            let mut frame = Vec::new();
            encode(&r, &mut frame);
            assert_eq!(decode_request(body(&frame)).unwrap(), r);
        }
        let responses = [
            Response::Registered { layout_id: 0 },
            Response::Offloaded {
                stored: 1,
                present: 2,
                skipped: 0,
            },
            Response::Found {
                host: 1,
                any: 2,
                pinned: 2,
                peer: 0,
            },
            Response::Unpinned { blocks: 1 },
            Response::Onboarded {
                blocks: 2,
                from_host: 1,
                from_disk: 0,
                from_remote: 1,
                from_peer: 1,
            },
            Response::Error {
                code: ErrorCode::Slot,
                message: "x".into(),
            },
        ];
        for r in responses {
            let mut frame = Vec::new();
            encode(&r, &mut frame);
            assert_eq!(decode_response(body(&frame)).unwrap(), r);
        }
    }

    #[test]
    fn oversized_and_malformed_frames_are_refused() {
        assert!(matches!(
            body_len(((MAX_FRAME_BYTES + 1) as u32).to_be_bytes()),
            Err(FrameError::TooLarge(_))
        ));
        assert!(matches!(
            decode_request(b"\x81\xa2op\xa4nope"),
            Err(FrameError::Decode(_))
        ));
        let mut frame = Vec::new();
        encode(
            &Request::Lookup {
                keys: vec![0; MAX_BLOCKS + 1],
                pin_ms: 0,
            },
            &mut frame,
        );
        assert!(matches!(
            decode_request(&frame[4..]),
            Err(FrameError::TooManyBlocks(_))
        ));
    }
}
