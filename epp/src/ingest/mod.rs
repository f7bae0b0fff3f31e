//! KV-event ingestion. Direct-ZMQ mode (llm-d's): the EPP subscribes to every engine's PUB
//! socket and runs the `kv-events` normaliser in-process, for clusters without sidecars. The
//! NATS path (sidecar envelopes) shares [`source`]'s sequencing logic.

pub mod source;
pub mod zmq_direct;
