//! The EPP↔EPP relay message on `kvgate.handoff.<namespace>.<pool>.<replica>`: a response
//! observer's events for requests the addressed replica routed (see [`crate::extproc::Relay`]).
//! MessagePack with field names, versioned, bounded on decode.

use serde::{Deserialize, Serialize};

use crate::extproc::{MAX_RELAYED_ID_BYTES, Outgoing, RelayEvent, ResponseEvent};

/// The version this build writes and reads.
pub const RELAY_VERSION: u16 = 1;
/// Largest encoded message a receiver accepts.
pub const MAX_RELAY_BYTES: usize = 1 << 20;
/// Most items one message carries (the sender splits larger batches).
pub const MAX_RELAY_ITEMS: usize = 1024;
/// Most request hashes one heartbeat lists.
pub const MAX_OBSERVING: usize = 1 << 16;

/// One relayed item, as on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireItem {
    /// The observer took the request over.
    Claim {
        /// Request id.
        id: String,
    },
    /// Response headers.
    Headers {
        /// Request id.
        id: String,
        /// HTTP status.
        status: u16,
        /// The endpoint that served it, when the data plane said.
        served: Option<String>,
    },
    /// The first response byte.
    FirstByte {
        /// Request id.
        id: String,
    },
    /// Token usage.
    Usage {
        /// Request id.
        id: String,
        /// Prompt tokens.
        prompt: u32,
        /// Completion tokens.
        completion: u32,
        /// Cached prompt tokens, when reported.
        cached: Option<u32>,
    },
    /// The response completed.
    End {
        /// Request id.
        id: String,
    },
    /// The response ended early.
    Aborted {
        /// Request id.
        id: String,
    },
    /// Heartbeat: every request of the addressed replica the observer still observes.
    Observing {
        /// Request id hashes (`crate::extproc::id_hash`).
        ids: Vec<u64>,
    },
}

/// What a received item asks of the handoff table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// An event for one request.
    Event(String, RelayEvent),
    /// A heartbeat.
    Observing(Vec<u64>),
}

impl WireItem {
    /// The wire form of a queued item (its owner goes in the subject).
    pub fn from_outgoing(item: Outgoing) -> Self {
        match item {
            Outgoing::Observing { ids, .. } => Self::Observing { ids },
            Outgoing::Event {
                request_id, event, ..
            } => {
                let id = request_id.to_string();
                match event {
                    RelayEvent::Claim => Self::Claim { id },
                    RelayEvent::Report(ResponseEvent::Headers { status, served }) => {
                        // An endpoint name longer than any `ip:port` is not worth the item.
                        let served = served.filter(|s| s.len() <= MAX_RELAYED_ID_BYTES);
                        Self::Headers { id, status, served }
                    }
                    RelayEvent::Report(ResponseEvent::FirstByte) => Self::FirstByte { id },
                    RelayEvent::Report(ResponseEvent::Usage {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    }) => Self::Usage {
                        id,
                        prompt: prompt_tokens,
                        completion: completion_tokens,
                        cached: cached_tokens,
                    },
                    RelayEvent::Report(ResponseEvent::End) => Self::End { id },
                    RelayEvent::Report(ResponseEvent::Aborted) => Self::Aborted { id },
                }
            }
        }
    }

    /// Bytes this item adds to a message, roughly (for splitting batches).
    pub fn size_hint(&self) -> usize {
        match self {
            Self::Observing { ids } => 16 + 9 * ids.len(),
            Self::Headers { id, served, .. } => {
                48 + id.len() + served.as_ref().map_or(0, String::len)
            }
            Self::Claim { id }
            | Self::FirstByte { id }
            | Self::Usage { id, .. }
            | Self::End { id }
            | Self::Aborted { id } => 48 + id.len(),
        }
    }

    fn into_received(self) -> Received {
        let ev = |id, e| Received::Event(id, RelayEvent::Report(e));
        match self {
            Self::Claim { id } => Received::Event(id, RelayEvent::Claim),
            Self::Headers { id, status, served } => {
                ev(id, ResponseEvent::Headers { status, served })
            }
            Self::FirstByte { id } => ev(id, ResponseEvent::FirstByte),
            Self::Usage {
                id,
                prompt,
                completion,
                cached,
            } => ev(
                id,
                ResponseEvent::Usage {
                    prompt_tokens: prompt,
                    completion_tokens: completion,
                    cached_tokens: cached,
                },
            ),
            Self::End { id } => ev(id, ResponseEvent::End),
            Self::Aborted { id } => ev(id, ResponseEvent::Aborted),
            Self::Observing { ids } => Received::Observing(ids),
        }
    }

    fn check(&self) -> Result<(), RelayWireError> {
        match self {
            Self::Observing { ids } => bound("observing ids", ids.len(), MAX_OBSERVING),
            Self::Headers { id, served, .. } => {
                bound("request id bytes", id.len(), MAX_RELAYED_ID_BYTES)?;
                bound(
                    "served endpoint bytes",
                    served.as_ref().map_or(0, String::len),
                    MAX_RELAYED_ID_BYTES,
                )
            }
            Self::Claim { id }
            | Self::FirstByte { id }
            | Self::Usage { id, .. }
            | Self::End { id }
            | Self::Aborted { id } => bound("request id bytes", id.len(), MAX_RELAYED_ID_BYTES),
        }
    }
}

/// One message from one observer replica to one owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayMessage {
    /// Version.
    pub v: u16,
    /// The observer's replica id.
    pub observer: u64,
    /// Items in the order they were queued.
    pub items: Vec<WireItem>,
}

/// Why a relay message was refused.
#[derive(Debug, thiserror::Error)]
pub enum RelayWireError {
    /// Encoding failed.
    #[error("encoding a relay message: {0}")]
    Encode(#[source] rmp_serde::encode::Error),
    /// Not a well-formed message.
    #[error("decoding a relay message: {0}")]
    Decode(#[source] rmp_serde::decode::Error),
    /// Unknown version.
    #[error("relay message version {0} is not supported (this build reads {RELAY_VERSION})")]
    Version(u16),
    /// A bound was exceeded.
    #[error("relay message {what} = {count} exceeds {limit}")]
    TooLarge {
        /// Which bound.
        what: &'static str,
        /// Found.
        count: usize,
        /// The bound.
        limit: usize,
    },
}

impl RelayWireError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Encode(_) => "encode",
            Self::Decode(_) => "decode",
            Self::Version(_) => "version",
            Self::TooLarge { .. } => "too_large",
        }
    }
}

fn bound(what: &'static str, count: usize, limit: usize) -> Result<(), RelayWireError> {
    if count > limit {
        return Err(RelayWireError::TooLarge { what, count, limit });
    }
    Ok(())
}

impl RelayMessage {
    /// A message from `observer`.
    pub fn new(observer: u64, items: Vec<WireItem>) -> Self {
        Self {
            v: RELAY_VERSION,
            observer,
            items,
        }
    }

    /// MessagePack with field names.
    pub fn encode(&self) -> Result<Vec<u8>, RelayWireError> {
        rmp_serde::to_vec_named(self).map_err(RelayWireError::Encode)
    }

    /// Decodes and checks the bounds. An item over its bounds is dropped, not the message
    /// (the others are other requests' events); the second value counts those dropped.
    pub fn decode(bytes: &[u8]) -> Result<(Self, usize), RelayWireError> {
        bound("bytes", bytes.len(), MAX_RELAY_BYTES)?;
        let mut m: Self = rmp_serde::from_slice(bytes).map_err(RelayWireError::Decode)?;
        if m.v != RELAY_VERSION {
            return Err(RelayWireError::Version(m.v));
        }
        bound("items", m.items.len(), MAX_RELAY_ITEMS)?;
        let before = m.items.len();
        m.items.retain(|item| item.check().is_ok());
        let dropped = before - m.items.len();
        Ok((m, dropped))
    }

    /// The items, as the handoff table takes them.
    pub fn into_received(self) -> impl Iterator<Item = Received> {
        self.items.into_iter().map(WireItem::into_received)
    }
}

/// Splits `items` into messages of at most [`MAX_RELAY_ITEMS`] items and about `max_bytes`.
pub fn split(observer: u64, items: Vec<WireItem>, max_bytes: usize) -> Vec<RelayMessage> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0;
    for item in items {
        let size = item.size_hint();
        if !current.is_empty() && (current.len() == MAX_RELAY_ITEMS || bytes + size > max_bytes) {
            out.push(RelayMessage::new(observer, std::mem::take(&mut current)));
            bytes = 0;
        }
        bytes += size;
        current.push(item);
    }
    if !current.is_empty() {
        out.push(RelayMessage::new(observer, current));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;

    fn event(id: &str, event: RelayEvent) -> Outgoing {
        Outgoing::Event {
            owner: 9,
            request_id: Arc::from(id),
            event,
        }
    }

    fn every_event() -> Vec<RelayEvent> {
        vec![
            RelayEvent::Claim,
            RelayEvent::Report(ResponseEvent::Headers {
                status: 200,
                served: Some("10.0.0.1:8000".into()),
            }),
            RelayEvent::Report(ResponseEvent::Headers {
                status: 503,
                served: None,
            }),
            RelayEvent::Report(ResponseEvent::FirstByte),
            RelayEvent::Report(ResponseEvent::Usage {
                prompt_tokens: 100,
                completion_tokens: 7,
                cached_tokens: Some(64),
            }),
            RelayEvent::Report(ResponseEvent::End),
            RelayEvent::Report(ResponseEvent::Aborted),
        ]
    }

    #[test]
    fn every_event_and_a_heartbeat_round_trip() {
        let mut items: Vec<WireItem> = every_event()
            .into_iter()
            .map(|e| WireItem::from_outgoing(event("req-1", e)))
            .collect();
        items.push(WireItem::from_outgoing(Outgoing::Observing {
            owner: 9,
            ids: vec![1, u64::MAX],
        }));
        let msg = RelayMessage::new(42, items);
        let (back, dropped) = RelayMessage::decode(&msg.encode().unwrap()).unwrap();
        assert_eq!((&back, dropped), (&msg, 0));
        let received: Vec<Received> = back.into_received().collect();
        let mut want: Vec<Received> = every_event()
            .into_iter()
            .map(|e| Received::Event("req-1".into(), e))
            .collect();
        want.push(Received::Observing(vec![1, u64::MAX]));
        assert_eq!(received, want);
    }

    #[test]
    fn bounds_and_versions_are_enforced() {
        // An item over its bounds is dropped; the rest of the message stands.
        let long = "x".repeat(MAX_RELAYED_ID_BYTES + 1);
        let msg = RelayMessage::new(
            1,
            vec![
                WireItem::End { id: long.clone() },
                WireItem::End { id: "ok".into() },
                WireItem::Headers {
                    id: "ok".into(),
                    status: 200,
                    served: Some(long.clone()),
                },
            ],
        );
        let (back, dropped) = RelayMessage::decode(&msg.encode().unwrap()).unwrap();
        assert_eq!(dropped, 2);
        assert_eq!(back.items, [WireItem::End { id: "ok".into() }]);
        // The sender leaves out a served endpoint too long to send.
        let item = WireItem::from_outgoing(event(
            "r",
            RelayEvent::Report(ResponseEvent::Headers {
                status: 200,
                served: Some(long),
            }),
        ));
        assert!(matches!(item, WireItem::Headers { served: None, .. }));

        let mut msg = RelayMessage::new(1, vec![]);
        msg.v = 2;
        let err = RelayMessage::decode(&msg.encode().unwrap()).unwrap_err();
        assert_eq!(err.metric_label(), "version");

        let many = vec![WireItem::FirstByte { id: "a".into() }; MAX_RELAY_ITEMS + 1];
        let msg = RelayMessage::new(1, many);
        let err = RelayMessage::decode(&msg.encode().unwrap()).unwrap_err();
        assert_eq!(err.metric_label(), "too_large");

        assert_eq!(
            RelayMessage::decode(b"\xc1junk")
                .unwrap_err()
                .metric_label(),
            "decode"
        );
        let huge = vec![0u8; MAX_RELAY_BYTES + 1];
        assert_eq!(
            RelayMessage::decode(&huge).unwrap_err().metric_label(),
            "too_large"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Splitting keeps every item in order, and each message decodes within the bounds.
        #[test]
        fn split_keeps_order_and_bounds(
            ids in proptest::collection::vec("[a-z0-9-]{0,256}", 0..2500),
            max_bytes in 64usize..200_000,
        ) {
            let items: Vec<WireItem> =
                ids.iter().map(|id| WireItem::End { id: id.clone() }).collect();
            let messages = split(5, items.clone(), max_bytes);
            let mut back = Vec::new();
            for m in messages {
                prop_assert!(!m.items.is_empty());
                prop_assert!(m.items.len() <= MAX_RELAY_ITEMS);
                let size: usize = m.items.iter().map(WireItem::size_hint).sum();
                prop_assert!(m.items.len() == 1 || size <= max_bytes);
                let bytes = m.encode().unwrap();
                prop_assert!(bytes.len() <= MAX_RELAY_BYTES);
                back.extend(RelayMessage::decode(&bytes).unwrap().0.items);
            }
            prop_assert_eq!(back, items);
        }
    }
}
