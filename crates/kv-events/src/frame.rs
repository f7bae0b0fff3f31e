//! ZMQ message layouts: the live PUB message and the replay request/reply.
//!
//! Live: `[topic, seq (u64 big-endian), payload]`. Replay (ROUTER socket): a DEALER sends
//! `[b"", start_seq (8 bytes BE)]`; it receives `[b"", seq, payload]` from vLLM ≤ 0.25 and
//! `[b"", topic, seq, payload]` from vLLM ≥ 0.26 and SGLang; the end marker carries seq -1 and
//! an empty payload.

/// Why a multipart message could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not the number of parts the layout has.
    #[error("expected {expected} message parts, got {got}")]
    PartCount {
        /// What the layout allows.
        expected: &'static str,
        /// What arrived.
        got: usize,
    },
    /// The sequence number is not 8 bytes.
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLength(usize),
    /// The topic is not UTF-8.
    #[error("topic is not valid UTF-8")]
    TopicUtf8,
    /// A replay reply that does not start with the empty delimiter frame.
    #[error("replay reply must start with an empty delimiter frame")]
    MissingDelimiter,
}

impl FrameError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            FrameError::PartCount { .. } => "part_count",
            FrameError::SeqLength(_) => "seq_length",
            FrameError::TopicUtf8 => "topic_utf8",
            FrameError::MissingDelimiter => "missing_delimiter",
        }
    }
}

/// One live KV-event message, borrowed from its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvFrame<'a> {
    /// The topic (`kv@<ip>:<port>@<model>` by convention; may be empty).
    pub topic: &'a str,
    /// The publisher's sequence number, from 0.
    pub seq: u64,
    /// The MessagePack payload.
    pub payload: &'a [u8],
}

impl<'a> KvFrame<'a> {
    /// Reads a live PUB message.
    pub fn from_parts<P: AsRef<[u8]>>(parts: &'a [P]) -> Result<Self, FrameError> {
        let [topic, seq, payload] = parts else {
            return Err(FrameError::PartCount {
                expected: "3",
                got: parts.len(),
            });
        };
        Ok(Self {
            topic: topic_str(topic.as_ref())?,
            seq: seq_u64(seq.as_ref())?,
            payload: payload.as_ref(),
        })
    }

    /// The message's parts, as a publisher sends them.
    pub fn to_parts(&self) -> [Vec<u8>; 3] {
        [
            self.topic.as_bytes().to_vec(),
            self.seq.to_be_bytes().to_vec(),
            self.payload.to_vec(),
        ]
    }
}

fn topic_str(bytes: &[u8]) -> Result<&str, FrameError> {
    std::str::from_utf8(bytes).map_err(|_| FrameError::TopicUtf8)
}

fn seq_u64(bytes: &[u8]) -> Result<u64, FrameError> {
    let arr: [u8; 8] = bytes
        .try_into()
        .map_err(|_| FrameError::SeqLength(bytes.len()))?;
    Ok(u64::from_be_bytes(arr))
}

/// The sequence number that marks the end of a replay (-1 as a signed 8-byte integer).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// The parts a DEALER sends to ask for every buffered batch with seq ≥ `start_seq`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// The two reply layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayLayout {
    /// vLLM ≤ 0.25: `[b"", seq, payload]`.
    Legacy,
    /// vLLM ≥ 0.26 and SGLang: `[b"", topic, seq, payload]`.
    WithTopic,
}

/// One reply received by a replay DEALER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch {
        /// The layout it came in.
        layout: ReplayLayout,
        /// The batch, with an empty topic for the legacy layout.
        frame: KvFrame<'a>,
    },
    /// No more batches follow.
    End,
}

impl<'a> ReplayReply<'a> {
    /// Reads a reply as a DEALER receives it (with the leading empty delimiter).
    pub fn from_parts<P: AsRef<[u8]>>(parts: &'a [P]) -> Result<Self, FrameError> {
        let (layout, delim, topic, seq, payload) = match parts {
            [delim, seq, payload] => (ReplayLayout::Legacy, delim, &[][..], seq, payload),
            [delim, topic, seq, payload] => {
                (ReplayLayout::WithTopic, delim, topic.as_ref(), seq, payload)
            }
            _ => {
                return Err(FrameError::PartCount {
                    expected: "3 or 4",
                    got: parts.len(),
                });
            }
        };
        if !delim.as_ref().is_empty() {
            return Err(FrameError::MissingDelimiter);
        }
        let seq = seq_u64(seq.as_ref())?;
        if seq == REPLAY_END_SEQ {
            return Ok(ReplayReply::End);
        }
        Ok(ReplayReply::Batch {
            layout,
            frame: KvFrame {
                topic: topic_str(topic)?,
                seq,
                payload: payload.as_ref(),
            },
        })
    }

    /// The parts a publisher's ROUTER sends for this reply in `layout` (without the identity
    /// frame). The topic is left out of the legacy layout; the end marker has an empty topic.
    pub fn to_parts(&self, layout: ReplayLayout) -> Vec<Vec<u8>> {
        let (topic, seq, payload) = match self {
            ReplayReply::Batch { frame, .. } => (frame.topic, frame.seq, frame.payload),
            ReplayReply::End => ("", REPLAY_END_SEQ, &[][..]),
        };
        let mut parts = vec![Vec::new()];
        if layout == ReplayLayout::WithTopic {
            parts.push(topic.as_bytes().to_vec());
        }
        parts.push(seq.to_be_bytes().to_vec());
        parts.push(payload.to_vec());
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_frame_round_trips() {
        let frame = KvFrame {
            topic: "kv@10.0.0.1:8200@m",
            seq: 258,
            payload: b"\x93",
        };
        let parts = frame.to_parts();
        assert_eq!(parts[1], [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(KvFrame::from_parts(&parts).unwrap(), frame);
    }

    #[test]
    fn malformed_live_frames_are_errors() {
        let two: [&[u8]; 2] = [b"", b"12345678"];
        assert!(matches!(
            KvFrame::from_parts(&two),
            Err(FrameError::PartCount { got: 2, .. })
        ));
        let short_seq: [&[u8]; 3] = [b"", b"1234", b""];
        assert_eq!(
            KvFrame::from_parts(&short_seq),
            Err(FrameError::SeqLength(4))
        );
        let bad_topic: [&[u8]; 3] = [b"\xff", &[0; 8], b""];
        assert_eq!(KvFrame::from_parts(&bad_topic), Err(FrameError::TopicUtf8));
    }

    #[test]
    fn both_replay_layouts_and_end_markers() {
        let frame = KvFrame {
            topic: "t",
            seq: 7,
            payload: b"p",
        };
        for layout in [ReplayLayout::Legacy, ReplayLayout::WithTopic] {
            let reply = ReplayReply::Batch { layout, frame };
            let parts = reply.to_parts(layout);
            let back = ReplayReply::from_parts(&parts).unwrap();
            let want_topic = if layout == ReplayLayout::Legacy {
                ""
            } else {
                "t"
            };
            assert_eq!(
                back,
                ReplayReply::Batch {
                    layout,
                    frame: KvFrame {
                        topic: want_topic,
                        ..frame
                    }
                }
            );
            let end = ReplayReply::End.to_parts(layout);
            assert_eq!(ReplayReply::from_parts(&end).unwrap(), ReplayReply::End);
        }
        let no_delim: [&[u8]; 3] = [b"x", &[0; 8], b""];
        assert_eq!(
            ReplayReply::from_parts(&no_delim),
            Err(FrameError::MissingDelimiter)
        );
        assert_eq!(replay_request(8), [vec![], vec![0, 0, 0, 0, 0, 0, 0, 8]]);
    }
}
