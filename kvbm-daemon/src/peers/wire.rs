//! The peer protocol's messages (pure): frames as on the connector socket (a 4-byte
//! big-endian length, then a MessagePack map, at most [`MAX_FRAME_BYTES`]), and after a
//! [`Frame::Blocks`] header the blocks' raw bytes.
//!
//! ```text
//! server: hello {node, nonce}
//! client: auth {node, nonce, mac}            mac of the server's nonce
//! server: welcome {mac}                      mac of the client's nonce
//! client: pull {layout, keys, fabrics}       at most MAX_BLOCKS keys, in chain order
//! server: blocks {block_bytes, sums}         the leading blocks it holds (maybe none),
//!         sums.len() × block_bytes raw bytes   each block's xxh3-64 in `sums`
//!   …or   blocks {block_bytes, sums, via}    the same blocks, exposed on a fabric the
//! client: fetched {ok}                         client named; no raw bytes follow. The client
//! server: (if not ok) the raw bytes            READs them and says whether they arrived with
//!                                              the right sums; if not, they come over TCP
//!   …or   refused {message}
//! (pull / blocks repeat; either end closes when done)
//! ```

use serde::{Deserialize, Serialize};

pub use crate::protocol::{MAX_BLOCKS, MAX_FRAME_BYTES, body_len, encode};
use crate::store::Layout;

/// The block bytes one answer carries at most (as a connector request's chunk).
pub const MAX_ANSWER_BYTES: u64 = 64 << 20;

/// One message of the peer protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Frame {
    /// The server's opening: who it is, and the nonce the client must MAC.
    Hello {
        /// The server's node.
        node: String,
        /// Random bytes.
        nonce: Vec<u8>,
    },
    /// The client's proof, and the nonce the server must MAC.
    Auth {
        /// The client's node.
        node: String,
        /// Random bytes.
        nonce: Vec<u8>,
        /// The client's MAC of the server's nonce.
        mac: Vec<u8>,
    },
    /// The server's proof; requests may follow.
    Welcome {
        /// The server's MAC of the client's nonce.
        mac: Vec<u8>,
    },
    /// The leading blocks of `keys` the server holds under `layout`.
    Pull {
        /// The blocks' layout (the same fields on both nodes).
        layout: Layout,
        /// Block keys, in chain order.
        keys: Vec<u64>,
        /// Fabrics the client can read an answer from (besides this connection).
        #[serde(default)]
        fabrics: Vec<String>,
    },
    /// The answer to a pull: the raw bytes of `sums.len()` blocks follow.
    Blocks {
        /// Bytes of each block.
        block_bytes: u64,
        /// Each block's xxh3-64, in order.
        sums: Vec<u64>,
        /// The key before the first block in its chain, as the server stored it.
        #[serde(default)]
        parent: Option<u64>,
        /// Where to read the blocks instead, when the server exposed them on a fabric the
        /// client named; then no raw bytes follow this frame.
        #[serde(default)]
        via: Option<Offer>,
    },
    /// After an answer `via` a fabric: whether the client read every block with its sum.
    /// If not, the server sends the raw bytes after all.
    Fetched {
        /// The blocks arrived.
        ok: bool,
    },
    /// The request or the handshake was refused; the server closes the connection.
    Refused {
        /// Why.
        message: String,
    },
}

/// An answer's blocks, exposed on a fabric: one buffer of `sums.len() × block_bytes` bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// The fabric (`nixl`).
    pub fabric: String,
    /// What a reader on that fabric needs (NIXL: the server agent's metadata).
    pub metadata: Vec<u8>,
    /// The buffer's address on the server.
    pub addr: u64,
}

/// A frame that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Its body is not a frame.
    #[error("undecodable frame: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    /// A pull names too many keys.
    #[error("{0} keys in one pull; the limit is {MAX_BLOCKS}")]
    TooManyKeys(usize),
    /// An answer announces more bytes than a pull may carry.
    #[error("an answer of {blocks} blocks of {block_bytes} bytes exceeds {MAX_ANSWER_BYTES} bytes")]
    TooLarge {
        /// Blocks announced.
        blocks: usize,
        /// Bytes of each.
        block_bytes: u64,
    },
}

/// Decodes a frame body, refusing a pull with too many keys or an answer above the bound.
pub fn decode(body: &[u8]) -> Result<Frame, WireError> {
    let frame: Frame = rmp_serde::from_slice(body)?;
    match &frame {
        Frame::Pull { keys, .. } if keys.len() > MAX_BLOCKS => {
            Err(WireError::TooManyKeys(keys.len()))
        }
        Frame::Blocks {
            block_bytes, sums, ..
        } if (sums.len() as u64).saturating_mul(*block_bytes) > MAX_ANSWER_BYTES => {
            Err(WireError::TooLarge {
                blocks: sums.len(),
                block_bytes: *block_bytes,
            })
        }
        _ => Ok(frame),
    }
}

/// The checksum carried for each block.
pub fn sum(block: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(block)
}

/// How many leading blocks of `block_bytes` fit one answer (at least one).
pub fn answer_blocks(block_bytes: u64) -> usize {
    usize::try_from(MAX_ANSWER_BYTES / block_bytes.max(1))
        .unwrap_or(usize::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            model: "m".into(),
            dtype: "bf16".into(),
            layers: 2,
            block_size: 16,
            block_bytes: 4096,
            shard: 0,
            shards: 1,
        }
    }

    fn round_trip(frame: &Frame) -> Result<Frame, WireError> {
        let mut out = Vec::new();
        encode(frame, &mut out);
        let len = body_len(out[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, out.len() - 4);
        decode(&out[4..])
    }

    #[test]
    fn frames_round_trip() {
        for frame in [
            Frame::Hello {
                node: "a".into(),
                nonce: vec![1; 32],
            },
            Frame::Auth {
                node: "b".into(),
                nonce: vec![2; 32],
                mac: vec![3; 32],
            },
            Frame::Welcome { mac: vec![4; 32] },
            Frame::Pull {
                layout: layout(),
                keys: vec![1, u64::MAX],
                fabrics: vec!["nixl".into()],
            },
            Frame::Blocks {
                block_bytes: 4096,
                sums: vec![7, 8],
                parent: Some(3),
                via: None,
            },
            Frame::Blocks {
                block_bytes: 4096,
                sums: vec![7],
                parent: None,
                via: Some(Offer {
                    fabric: "nixl".into(),
                    metadata: vec![0, 255, 9],
                    addr: u64::MAX,
                }),
            },
            Frame::Fetched { ok: false },
            Frame::Refused {
                message: "no".into(),
            },
        ] {
            assert_eq!(round_trip(&frame).unwrap(), frame);
        }
    }

    #[test]
    fn frames_from_a_node_without_fabrics_still_decode() {
        // The frames as a node built before fabrics existed sends them.
        #[derive(Serialize)]
        #[serde(tag = "op", rename_all = "snake_case")]
        enum Before {
            Pull { layout: Layout, keys: Vec<u64> },
            Blocks { block_bytes: u64, sums: Vec<u64> },
        }
        for (before, now) in [
            (
                Before::Pull {
                    layout: layout(),
                    keys: vec![5],
                },
                Frame::Pull {
                    layout: layout(),
                    keys: vec![5],
                    fabrics: Vec::new(),
                },
            ),
            (
                Before::Blocks {
                    block_bytes: 4096,
                    sums: vec![1],
                },
                Frame::Blocks {
                    block_bytes: 4096,
                    sums: vec![1],
                    parent: None,
                    via: None,
                },
            ),
        ] {
            let body = rmp_serde::to_vec_named(&before).unwrap();
            assert_eq!(decode(&body).unwrap(), now);
        }
    }

    #[test]
    fn the_largest_pull_fits_a_frame_and_bounds_are_enforced() {
        let pull = Frame::Pull {
            layout: layout(),
            keys: vec![u64::MAX; MAX_BLOCKS],
            fabrics: vec!["nixl".into()],
        };
        let mut out = Vec::new();
        encode(&pull, &mut out);
        assert!(out.len() - 4 <= MAX_FRAME_BYTES);
        let over = Frame::Pull {
            layout: layout(),
            keys: vec![1; MAX_BLOCKS + 1],
            fabrics: Vec::new(),
        };
        assert!(matches!(round_trip(&over), Err(WireError::TooManyKeys(_))));
        let big = Frame::Blocks {
            block_bytes: MAX_ANSWER_BYTES,
            sums: vec![1, 2],
            parent: None,
            via: None,
        };
        assert!(matches!(round_trip(&big), Err(WireError::TooLarge { .. })));
        assert!(decode(b"\x93\x01\x02\x03").is_err());
        assert_eq!(answer_blocks(MAX_ANSWER_BYTES * 2), 1);
        assert_eq!(answer_blocks(1 << 20), 64);
    }
}
