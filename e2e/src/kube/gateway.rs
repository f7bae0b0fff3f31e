//! The gateway in front of the pool, as Envoy AI Gateway configures Envoy for an HTTPRoute whose
//! backend is an InferencePool (`manifests/gateways/envoy-ai-gateway/`): the HTTPRoute's path
//! prefixes and request timeout; an ext_proc filter calling the EPP Service with request and
//! response bodies `FULL_DUPLEX_STREAMED`, trailers sent, a 300 s message timeout and
//! fail-closed (Envoy AI Gateway ignores the pool's failure mode); the EPP cluster over HTTP/2
//! and TLS without certificate verification (the EPP's certificate is self-signed); and an
//! `ORIGINAL_DST` cluster that sends each request to the `x-gateway-destination-endpoint`
//! header. Two response headers are added for the tests: the upstream Envoy used and the
//! header's value. With the chart's response observer on, the response-observer layout instead:
//! the ext_proc filter sends the request alone, and a second filter (fail-open, 2 s message
//! timeout) sends the request headers and the response, body `STREAMED`, to the EPP's observer
//! port. Pure.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

/// What the configuration needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayConfig {
    /// The listener.
    pub listen: SocketAddr,
    /// Envoy's admin port (on the listener's address).
    pub admin_port: u16,
    /// The EPP Service's endpoints (each EPP pod's ext_proc address).
    pub epp: Vec<SocketAddr>,
    /// The EPP pods' response-observer addresses (the chart's `epp.responseObserver`): when
    /// any, the ext_proc filter sends the request alone and a second, fail-open filter sends
    /// the request headers and the response there (as manifests/gateways/envoy-gateway/
    /// observer.yaml configures Envoy Gateway).
    pub observer: Vec<SocketAddr>,
    /// TLS to the EPP (the chart's default).
    pub epp_tls: bool,
    /// The HTTPRoute's path prefixes.
    pub paths: Vec<String>,
    /// The HTTPRoute's request timeout.
    pub request_timeout: Duration,
}

/// The upstream Envoy sent a request to (response header added for tests).
pub const UPSTREAM_HEADER: &str = "x-kvgate-upstream";
/// The destination header as the EPP set it (response header added for tests).
pub const DESTINATION_HEADER: &str = "x-kvgate-destination";

/// Envoy's bootstrap.
pub fn envoy_yaml(c: &GatewayConfig) -> String {
    let mut routes = String::new();
    for p in &c.paths {
        let _ = write!(
            routes,
            r#"              - match: {{ prefix: "{p}" }}
                route: {{ cluster: pool, timeout: {timeout}s, auto_host_rewrite: false }}
                response_headers_to_add:
                - header: {{ key: {UPSTREAM_HEADER}, value: "%UPSTREAM_HOST%" }}
                - header: {{ key: {DESTINATION_HEADER}, value: "%REQ(x-gateway-destination-endpoint)%" }}
"#,
            timeout = c.request_timeout.as_secs(),
        );
    }
    let tls = if c.epp_tls {
        r#"    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: { validation_context: {} }
"#
    } else {
        ""
    };
    let epp_cluster = grpc_cluster("epp", &c.epp, tls);
    let observing = !c.observer.is_empty();
    let (response_header, response_body, response_trailer) = if observing {
        ("SKIP", "NONE", "SKIP")
    } else {
        ("SEND", "FULL_DUPLEX_STREAMED", "SEND")
    };
    let observer_filter = if observing {
        r#"          - name: kvgate.response_observer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: { cluster_name: epp_observer }
              failure_mode_allow: true
              processing_mode:
                request_header_mode: SEND
                request_body_mode: NONE
                request_trailer_mode: SKIP
                response_header_mode: SEND
                response_body_mode: STREAMED
                response_trailer_mode: SKIP
              message_timeout: 2s
"#
    } else {
        ""
    };
    let observer_cluster = if observing {
        grpc_cluster("epp_observer", &c.observer, tls)
    } else {
        String::new()
    };
    format!(
        r#"# The gateway as Envoy AI Gateway configures an InferencePool backend (written by kvgate's Kubernetes stack).
admin: {{ address: {{ socket_address: {{ address: {ip}, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: gateway
    address: {{ socket_address: {{ address: {ip}, port_value: {listen} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          access_log:
          - name: envoy.access_loggers.stdout
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog
              log_format: {{ text_format_source: {{ inline_string: "ACCESS status=%RESPONSE_CODE% path=%REQ(:PATH)% upstream=%UPSTREAM_HOST% picked=%REQ(x-gateway-destination-endpoint)% flags=%RESPONSE_FLAGS% ms=%DURATION%\n" }} }}
          route_config:
            name: httproute
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
{routes}          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: epp }}
              failure_mode_allow: false
              processing_mode:
                request_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_header_mode: {response_header}
                response_body_mode: {response_body}
                response_trailer_mode: {response_trailer}
              message_timeout: 300s
{observer_filter}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 10s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
{epp_cluster}{observer_cluster}"#,
        ip = c.listen.ip(),
        admin = c.admin_port,
        listen = c.listen.port(),
    )
}

/// A static HTTP/2 cluster of the EPP's `hosts`, least-request balanced, with `tls` (a
/// transport socket, or nothing).
fn grpc_cluster(name: &str, hosts: &[SocketAddr], tls: &str) -> String {
    let mut endpoints = String::new();
    for a in hosts {
        let _ = writeln!(
            endpoints,
            "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
            a.ip(),
            a.port()
        );
    }
    format!(
        r#"  - name: {name}
    type: STATIC
    lb_policy: LEAST_REQUEST
    connect_timeout: 10s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
{tls}    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
{endpoints}"#
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_gateway_routes_the_openai_paths_through_the_epp() {
        let c = GatewayConfig {
            listen: "127.0.0.1:8080".parse().unwrap(),
            admin_port: 8081,
            epp: vec![
                "127.0.1.2:9002".parse().unwrap(),
                "127.0.1.3:9002".parse().unwrap(),
            ],
            observer: Vec::new(),
            epp_tls: true,
            paths: vec!["/v1/completions".into(), "/v1/chat/completions".into()],
            request_timeout: Duration::from_secs(300),
        };
        let y = envoy_yaml(&c);
        assert!(y.contains(r#"prefix: "/v1/chat/completions""#));
        assert!(y.contains("timeout: 300s"));
        assert!(y.contains("address: 127.0.1.3, port_value: 9002"));
        assert!(y.contains("UpstreamTlsContext"));
        assert!(y.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(y.contains("ORIGINAL_DST"));
        assert!(
            !y.contains(r#"prefix: "/""#),
            "nothing but the route's paths"
        );
        assert!(!y.contains("response_observer"));
        let plain = envoy_yaml(&GatewayConfig {
            epp_tls: false,
            ..c.clone()
        });
        assert!(!plain.contains("UpstreamTlsContext"));
        // The observer layout: the first filter leaves the response alone, the second sees it.
        let o = envoy_yaml(&GatewayConfig {
            observer: vec!["127.0.1.2:9004".parse().unwrap()],
            ..c
        });
        let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&o).unwrap();
        let filters = &v["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            ["http_filters"];
        assert_eq!(
            filters[0]["typed_config"]["processing_mode"]["response_body_mode"],
            "NONE"
        );
        assert_eq!(filters[1]["name"], "kvgate.response_observer");
        assert_eq!(filters[1]["typed_config"]["failure_mode_allow"], true);
        assert!(o.contains("address: 127.0.1.2, port_value: 9004"));
        assert!(o.contains("cluster_name: epp_observer"));
    }
}
