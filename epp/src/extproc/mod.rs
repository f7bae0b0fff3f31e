//! The Envoy `ext_proc` side of the Endpoint Picker Protocol (GIE v1), without I/O.
//!
//! One [`ExtProcStream`] per `Process` stream turns Envoy's `ProcessingRequest` messages into
//! `ProcessingResponse` messages, calling a [`Router`] once per request and reporting the
//! response phase back to it. The gRPC plumbing lives in [`crate::server`]; nothing here touches
//! a socket, a runtime or a clock.
//!
//! Protocol facts followed (DESIGN.md § EPP ↔ Envoy, `reference/gie_llmd.md` §1.1):
//! - the pick goes out as the header `x-gateway-destination-endpoint: ip:port` (the primary; with
//!   `HeaderEndpoints::All` the fallbacks too, comma-separated) and the primary with its fallbacks
//!   in dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`, with
//!   `clear_route_cache: true`;
//! - `FULL_DUPLEX_STREAMED` request bodies: the headers reply is deferred until the body is
//!   complete, then the body is re-sent as `streamed_response` chunks of at most 62,000 bytes, the
//!   last with `end_of_stream` (unless request trailers follow);
//! - `BUFFERED` request bodies: empty headers reply, the pick rides on the body reply;
//! - requests without a body are answered on the headers message;
//! - the subset hint is read from `metadata_context` `envoy.lb.subset_hint` /
//!   `x-gateway-destination-endpoint-subset`, the served endpoint from `envoy.lb` /
//!   `x-gateway-destination-endpoint-served`;
//! - model rewrite: when the router served the request under another model name, response
//!   bodies (streamed or buffered) get the client's name back and lose `content-length`;
//! - the response-observer layout ([`Handoffs`]): a routing filter that sends only the request
//!   parks its ticket under `x-request-id`, and a second filter's stream (gRPC metadata
//!   `x-kvgate-ext-proc-role: response`, or observability mode) claims it and sees the response;
//!   with several replicas, an observer that finds no ticket relays the response's events to the
//!   replica named in `x-kvgate-epp-replica` ([`Relay`]).

mod body;
mod handoff;
mod headers;
mod immediate;
mod metadata;
mod relay;
mod rewrite;
mod router;
mod stream;
#[cfg(test)]
mod trace_tests;
mod usage;

pub use body::MAX_CHUNK_BYTES;
pub use handoff::{HandoffStats, Handoffs, RELAY_SILENCE_SWEEPS};
pub use relay::{
    MAX_RELAYED_ID_BYTES, Outgoing, REPLICA_HEADER, RESPONSE_MODEL_HEADER, Relay, RelayEvent,
    RelaySink, RelayStats, id_hash, parse_replica, replica_header_value,
};
pub use rewrite::ResponseRewriter;
pub use router::{Decision, Rejection, ResponseEvent, ResponseModel, Router, RoutingInput};
pub use stream::{
    BodyMode, ExtProcStream, HeaderEndpoints, StreamConfig, StreamError, request_span,
};

/// Header carrying the pick, primary first (GIE `DestinationEndpointKey`).
pub const DESTINATION_ENDPOINT_HEADER: &str = "x-gateway-destination-endpoint";
/// Header a gateway may turn into the subset hint; never forwarded.
pub const SUBSET_HEADER: &str = "x-gateway-destination-endpoint-subset";
/// Header naming the endpoint that served the request; never accepted from clients.
pub const SERVED_ENDPOINT_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Dynamic-metadata namespace of the pick and of the served endpoint.
pub const LB_METADATA_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace of the subset hint.
pub const SUBSET_METADATA_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Metadata key of the subset hint.
pub const SUBSET_METADATA_KEY: &str = SUBSET_HEADER;
/// Metadata key of the pick in [`LB_METADATA_NAMESPACE`].
pub const DESTINATION_METADATA_KEY: &str = DESTINATION_ENDPOINT_HEADER;
/// Metadata key of the served endpoint in [`LB_METADATA_NAMESPACE`].
pub const SERVED_METADATA_KEY: &str = SERVED_ENDPOINT_HEADER;
/// Header naming why the EPP answered a request itself.
pub const DROP_REASON_HEADER: &str = "x-kvgate-drop-reason";
/// Request id header, injected when the client sent none.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
