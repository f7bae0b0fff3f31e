//! The files a stack writes into its run directory, rendered from the configuration and the
//! ports: the EPP's endpoints file and scheduler configuration, and Envoy's bootstrap. Pure.

use std::fmt::Write as _;

use super::config::{Component, EnvoyLb, KvEventsPath, StackConfig};
use super::ports::Ports;

/// The command line of the stack's Redis, the block manager's remote tier: on loopback, no
/// persistence, and a `maxmemory` with `allkeys-lru` that holds the block manager's whole
/// `remote_bytes` without evicting (see [`redis_maxmemory`]), so it only ages out copies no
/// daemon indexes any more.
pub fn redis_args(port: u16, remote_bytes: u64) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        &redis_maxmemory(remote_bytes).to_string(),
        "--maxmemory-policy",
        "allkeys-lru",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Redis's `maxmemory` for a block manager that keeps up to `remote_bytes` of blocks in it.
/// Redis counts what its allocator hands out, not the values' lengths: jemalloc rounds a large
/// allocation up to a size class a quarter of a power of two apart, so a power-of-two block
/// (2 MiB for a 16-token Llama-3.1-8B block) plus its string header costs 1.25 times its
/// length. Half again above the budget leaves room for that, for the request buffer of a
/// `SET` in flight and for Redis's own baseline; a quarter above, Redis evicted 2 of 32
/// 2-MiB blocks at 64 MiB.
pub fn redis_maxmemory(remote_bytes: u64) -> u64 {
    remote_bytes
        .saturating_add(remote_bytes / 2)
        .saturating_add(16 << 20)
}

/// The EPP's file-discovery document: one entry per engine pod, named by its pod, listing its
/// sidecar's proxy port + rank for each data-parallel rank (the addresses the sidecar stamps
/// into its envelopes' `Source`). `live[i]` false leaves pod `i` out.
pub fn endpoints_yaml(config: &StackConfig, ports: &Ports, live: &[bool]) -> String {
    let mut out = String::from("endpoints:\n");
    for (i, p) in ports.engines.iter().enumerate() {
        if !live.get(i).copied().unwrap_or(true) {
            continue;
        }
        let rank_ports: Vec<String> = (0..ports.dp_ranks.max(1))
            .map(|r| p.proxy.saturating_add(r).to_string())
            .collect();
        let _ = write!(
            out,
            "  - {{name: {}, address: 127.0.0.1, ports: [{}]",
            Component::pod_name(i),
            rank_ports.join(", ")
        );
        if let Some(k) = &config.kvbm {
            let _ = write!(out, ", node: {}", k.node);
        }
        if config.kv_events == KvEventsPath::Direct {
            let _ = write!(
                out,
                ", events: \"tcp://127.0.0.1:{}\", replay: \"tcp://127.0.0.1:{}\"",
                p.events, p.replay
            );
        }
        out.push_str("}\n");
    }
    out
}

/// The EPP's scheduler file.
pub fn scheduler_yaml(config: &StackConfig) -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(&config.scheduler)
}

/// vLLM's `KVEventsConfig` JSON for an engine publishing on `events` with replay on `replay`.
pub fn kv_events_config(events: u16, replay: u16) -> String {
    serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{events}"),
        "replay_endpoint": format!("tcp://*:{replay}"),
    })
    .to_string()
}

/// Response headers Envoy adds so clients (and the tests) see where a request went:
/// `x-kvgate-upstream` is the host Envoy sent to, `x-kvgate-picked` the EPP's ordered list (from
/// the `envoy.lb` metadata: the destination header carries the primary alone).
pub const UPSTREAM_HEADER: &str = "x-kvgate-upstream";
/// See [`UPSTREAM_HEADER`].
pub const PICKED_HEADER: &str = "x-kvgate-picked";
/// The request header Envoy turns into the subset hint metadata
/// (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`) for the EPP, with
/// [`StackConfig::subset_header`] only: the subset is the data plane's to set (GIE), and a
/// client that could send it would pin a pool member of its choice.
pub const SUBSET_HEADER: &str = "x-gateway-destination-endpoint-subset";

/// The largest request body the stack takes: the EPP's `--max-body-bytes` (its default) and
/// Envoy's connection buffer, which with fail-open holds whole bodies (Envoy's default of
/// 1 MiB would refuse larger ones with a plain-text 413).
pub const MAX_BODY_BYTES: u32 = 16 << 20;

/// The OpenAI paths the listener routes to the pool; anything else (the engines' `/metrics`,
/// `/health`, admin paths) is answered 404 by Envoy.
pub const ROUTED_PATHS: &[&str] = &["/v1/completions", "/v1/chat/completions", "/v1/models"];

/// The pool cluster's circuit breakers. Envoy allows 3 retries in flight per cluster by
/// default; past that a retry is refused (flag `UO`) and the client gets the engine's 502. When
/// an engine dies under load every request in flight on it retries at once, so the budget is a
/// share of the active requests instead, with a floor for small pools.
const POOL_RETRY_BUDGET: &str = concat!(
    "    circuit_breakers:\n",
    "      thresholds:\n",
    "      - retry_budget:\n",
    "          budget_percent: { value: 50.0 }\n",
    "          min_retry_concurrency: 64\n",
);

/// Envoy's bootstrap: one listener → (header-to-metadata for the subset hint, in tests) →
/// ext_proc (the EPP, FULL_DUPLEX_STREAMED both ways; with fail-open the request body is
/// BUFFERED, because Envoy 1.40 can only fail open before it has streamed a body chunk to the
/// processor, and a dead EPP is noticed after that) → router to the pool cluster, which
/// follows the EPP's pick (`override_host` with the fallback list, or `ORIGINAL_DST` on the
/// destination header). Connect failures and 502/503 from a sidecar are retried on the next
/// host of the EPP's list. Only [`ROUTED_PATHS`] reach the pool. When the EPP cannot be
/// reached and the filter fails closed, the client gets a JSON 503 that says so (Envoy's own
/// answer is an empty 500).
pub fn envoy_yaml(config: &StackConfig, ports: &Ports) -> String {
    let hosts: String = ports
        .endpoint_ports()
        .iter()
        .map(|p| {
            format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"
            )
        })
        .collect();
    let breakers = POOL_RETRY_BUDGET;
    let pool = match config.envoy_lb {
        EnvoyLb::OverrideHost => format!(
            r#"  - name: pool
    type: STATIC
    connect_timeout: 1s
{breakers}    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
{hosts}    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{ key: envoy.lb, path: [ {{ key: x-gateway-destination-endpoint }} ] }}
            selected_host_key: {{ key: envoy.lb, path: [ {{ key: x-gateway-destination-endpoint-served }} ] }}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
"#
        ),
        EnvoyLb::OriginalDst => format!(
            r#"  - name: pool
    type: ORIGINAL_DST
    connect_timeout: 1s
{breakers}    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
"#
        ),
    };
    format!(
        r#"# Envoy for the kvgate local stack (written by kvgate-bench up).
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: llm
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
    per_connection_buffer_limit_bytes: {max_body}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm
          access_log:
          - name: envoy.access_loggers.stdout
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog
              log_format: {{ text_format_source: {{ inline_string: "ACCESS status=%RESPONSE_CODE% upstream=%UPSTREAM_HOST% picked=%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)% flags=%RESPONSE_FLAGS% ms=%DURATION% pick_us=%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% rxend_us=%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)% ushdr_us=%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%\n" }} }}
          local_reply_config:
            mappers:
            - filter:
                extension_filter:
                  name: envoy.access_loggers.extension_filters.cel
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter
                    expression: "response.code == 500 && response.code_details.startsWith('ext_proc_error')"
              status_code: 503
              body_format_override:
                json_format:
                  error:
                    message: "the endpoint picker could not be reached (%RESPONSE_CODE_DETAILS%); retry later"
                    type: service_unavailable
                    code: endpoint_picker_unreachable
                content_type: application/json
          route_config:
            name: llm
            virtual_hosts:
            - name: default
              domains: ["*"]
              routes:
{routes}              - match: {{ prefix: "/" }}
                direct_response:
                  status: 404
                  body: {{ inline_string: "{{\"error\": {{\"message\": \"not found: this gateway serves the OpenAI API under /v1\", \"type\": \"not_found\", \"code\": \"not_found\"}}}}" }}
                response_headers_to_add:
                - header: {{ key: content-type, value: application/json }}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
          http_filters:
{subset_filter}          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: ext_proc, authority: "localhost" }}
                timeout: 10s
              failure_mode_allow: {fail_open}
              # The routing filter sees only the request: once the pick is made Envoy closes
              # its stream, so losing the EPP cannot cut a response in flight.
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SKIP
                request_body_mode: {request_body}
                response_body_mode: NONE
                request_trailer_mode: SEND
                response_trailer_mode: SKIP
              message_timeout: 10s
              metadata_options:
                forwarding_namespaces: {{ untyped: ["envoy.lb.subset_hint", "envoy.lb"] }}
                receiving_namespaces: {{ untyped: ["envoy.lb"] }}
          # The response observer: request headers (for x-request-id) and the response, body
          # chunks STREAMED (each held until the EPP answers, so one the EPP swaps a rewritten
          # model name back in is never lost), and always fail-open: if the EPP goes away, the
          # response goes on without it. The EPP (--response-observer) reports first byte,
          # usage and end against the ticket the routing stream parked under the request id.
          - name: kvgate.response_observer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: ext_proc, authority: "localhost" }}
                timeout: 10s
                initial_metadata:
                - {{ key: x-kvgate-ext-proc-role, value: response }}
              failure_mode_allow: true
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: NONE
                response_body_mode: STREAMED
                request_trailer_mode: SKIP
                response_trailer_mode: SEND
              # A stopped EPP holds a chunk this long before the response goes on without it.
              message_timeout: 2s
              metadata_options:
                forwarding_namespaces: {{ untyped: ["envoy.lb"] }}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{pool}  # The EPP replicas, active-active. Each is health-checked over gRPC on its health port (the
  # ext_proc service's status follows the EPP's readiness) every 250 ms, one failure (a refused
  # connection, NOT_SERVING, or no answer within 1 s) taking it out, so a replica that dies or
  # is not ready stops getting streams within about 250 ms; until then its streams fail (open or
  # closed, as the filter says). A stream in flight on a replica that dies is lost.
  - name: ext_proc
    type: STATIC
    connect_timeout: 1s
    lb_policy: LEAST_REQUEST
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    health_checks:
    - timeout: 1s
      interval: 0.25s
      no_traffic_interval: 0.25s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {{ service_name: "envoy.service.ext_proc.v3.ExternalProcessor" }}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - lb_endpoints:
{epps}"#,
        admin = ports.envoy_admin,
        listen = ports.envoy_listen,
        epps = epp_endpoints(config, ports),
        fail_open = config.fail_open,
        request_body = if config.fail_open {
            "BUFFERED"
        } else {
            "FULL_DUPLEX_STREAMED"
        },
        max_body = MAX_BODY_BYTES,
        routes = routes(),
        subset_filter = if config.subset_header {
            subset_filter()
        } else {
            String::new()
        },
    )
}

/// The ext_proc cluster's endpoints: each EPP replica's gRPC port, health-checked on its
/// health port.
fn epp_endpoints(config: &StackConfig, ports: &Ports) -> String {
    (0..config.epp_replicas.max(1))
        .filter_map(|r| ports.epp(r))
        .map(|e| {
            format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }}, health_check_config: {{ port_value: {} }} }}\n",
                e.grpc, e.health
            )
        })
        .collect()
}

/// The pool's routes: one per [`ROUTED_PATHS`] prefix.
fn routes() -> String {
    ROUTED_PATHS
        .iter()
        .map(|path| {
            format!(
                r#"              - match: {{ prefix: "{path}" }}
                route:
                  cluster: pool
                  timeout: 300s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,retriable-status-codes
                    retriable_status_codes: [502, 503]
                    num_retries: 3
                response_headers_to_add:
                - header: {{ key: {upstream}, value: "%UPSTREAM_HOST%" }}
                - header: {{ key: {picked}, value: "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%" }}
"#,
                upstream = UPSTREAM_HEADER,
                picked = PICKED_HEADER,
            )
        })
        .collect()
}

/// Turns [`SUBSET_HEADER`] into the subset hint metadata (and removes it).
fn subset_filter() -> String {
    format!(
        r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: {subset}
                on_header_present: {{ metadata_namespace: envoy.lb.subset_hint, key: {subset}, type: STRING }}
                remove: true
"#,
        subset = SUBSET_HEADER
    )
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use super::*;

    fn ports() -> Ports {
        Ports::allocate(2, 1, 1).unwrap()
    }

    #[test]
    fn data_parallel_pods_list_one_port_per_rank_and_envoy_knows_them_all() {
        let p = Ports::allocate(2, 2, 1).unwrap();
        let c = StackConfig {
            engines: 2,
            dp_ranks: 2,
            ..StackConfig::default()
        };
        let y = endpoints_yaml(&c, &p, &[true, true]);
        assert!(y.contains(&format!(
            "{{name: sim-1, address: 127.0.0.1, ports: [{}, {}]}}",
            p.engines[1].proxy,
            p.engines[1].proxy + 1
        )));
        let e = envoy_yaml(&c, &p);
        for port in p.endpoint_ports() {
            assert!(
                e.contains(&format!("port_value: {port} ")),
                "{port} missing"
            );
        }
    }

    #[test]
    fn endpoints_list_the_sidecar_proxies_under_pod_names() {
        let p = ports();
        let c = StackConfig::default();
        let y = endpoints_yaml(&c, &p, &[true, true]);
        assert!(y.contains(&format!(
            "{{name: sim-0, address: 127.0.0.1, ports: [{}]}}",
            p.engines[0].proxy
        )));
        assert!(y.contains(&format!(
            "{{name: sim-1, address: 127.0.0.1, ports: [{}]}}",
            p.engines[1].proxy
        )));
        assert!(!y.contains("events"));
        let y = endpoints_yaml(&c, &p, &[false, true]);
        assert!(!y.contains("sim-0") && y.contains("sim-1"));
        let direct = StackConfig {
            kv_events: KvEventsPath::Direct,
            ..c
        };
        let y = endpoints_yaml(&direct, &p, &[true, true]);
        assert!(y.contains(&format!(
            "events: \"tcp://127.0.0.1:{}\"",
            p.engines[1].events
        )));
    }

    #[test]
    fn scheduler_file_round_trips_the_policy() {
        let c = StackConfig::default().with_policy(scheduler::Policy::RoundRobin);
        let y = scheduler_yaml(&c).unwrap();
        let back = scheduler::SchedulerConfig::from_yaml(&y).unwrap();
        assert_eq!(back, c.scheduler);
    }

    #[test]
    fn envoy_config_names_every_port_and_the_fail_open_choice() {
        let p = ports();
        let y = envoy_yaml(&StackConfig::default(), &p);
        for port in [
            p.envoy_admin,
            p.envoy_listen,
            p.epp_grpc,
            p.engines[0].proxy,
            p.engines[1].proxy,
        ] {
            assert!(y.contains(&format!("port_value: {port} ")), "{port}");
        }
        assert!(y.contains("failure_mode_allow: false"));
        assert!(y.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(y.contains("override_host"));
        // Envoy's default of 3 retries in flight per cluster refuses most of a dead engine's
        // retries under load (`UO`): the pool has a retry budget instead.
        assert!(y.contains("retry_budget"));
        let closed = StackConfig {
            fail_open: false,
            envoy_lb: EnvoyLb::OriginalDst,
            ..StackConfig::default()
        };
        let y = envoy_yaml(&closed, &p);
        assert!(y.contains("failure_mode_allow: false") && y.contains("ORIGINAL_DST"));
        assert!(y.contains("retry_budget"));
        assert!(!y.contains(&format!("port_value: {} ", p.engines[0].proxy)));
    }

    #[test]
    fn every_epp_replica_is_an_ext_proc_host_health_checked_on_its_health_port() {
        let p = Ports::allocate(2, 1, 2).unwrap();
        let c = StackConfig {
            epp_replicas: 2,
            ..StackConfig::default()
        };
        let y = envoy_yaml(&c, &p);
        for r in 0..2 {
            let e = p.epp(r).unwrap();
            assert!(
                y.contains(&format!(
                    "port_value: {} }} }}, health_check_config: {{ port_value: {} }}",
                    e.grpc, e.health
                )),
                "replica {r}: {y}"
            );
        }
        assert_eq!(y.matches("health_check_config").count(), 2);
        assert!(y.contains("grpc_health_check"));
        // The YAML parses, and the ext_proc cluster lists both replicas.
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&y).unwrap();
        let clusters = doc["static_resources"]["clusters"].as_sequence().unwrap();
        let ext_proc = clusters
            .iter()
            .find(|c| c["name"].as_str() == Some("ext_proc"))
            .unwrap();
        assert_eq!(
            ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]
                .as_sequence()
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn envoy_takes_no_routing_input_from_clients_and_routes_only_the_openai_paths() {
        let p = ports();
        let y = envoy_yaml(&StackConfig::default(), &p);
        assert!(!y.contains("header_to_metadata"), "{y}");
        assert!(!y.contains(SUBSET_HEADER));
        for path in ROUTED_PATHS {
            assert!(y.contains(&format!("prefix: \"{path}\"")), "{path}");
        }
        assert_eq!(y.matches("cluster: pool").count(), ROUTED_PATHS.len());
        assert!(y.contains("status: 404"));
        assert!(y.contains(&format!("per_connection_buffer_limit_bytes: {}", 16 << 20)));
        assert!(y.contains("status_code: 503"));
        let trusting = StackConfig {
            subset_header: true,
            ..StackConfig::default()
        };
        let y = envoy_yaml(&trusting, &p);
        assert!(y.contains("header_to_metadata") && y.contains(SUBSET_HEADER));
    }
}
