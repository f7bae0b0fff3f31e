//! KV-event ingestion. Direct-ZMQ mode (llm-d's): the EPP subscribes to every engine's PUB
//! socket and runs the `kv-events` normaliser in-process, for clusters without sidecars. NATS
//! mode ([`nats`]): sidecars publish normalised envelopes, the EPP resynchronises from
//! snapshots, and EPP replicas share their in-flight load.

pub mod nats;
pub mod source;
pub mod zmq_direct;
