//! `--kv-events-config`: vLLM's `KVEventsConfig` JSON, plus the simulator's own wire choices.

use serde::Deserialize;

/// vLLM's `KVEventsConfig` (the fields vLLM 0.32 accepts; unknown fields are an error, so a typo
/// does not silently disable events).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Publish KV-cache events at all.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`.
    pub publisher: String,
    /// PUB endpoint; bound when it contains `*`, `::` or is `ipc://`/`inproc://`, else connected.
    pub endpoint: String,
    /// ROUTER endpoint answering replay requests (always bound).
    pub replay_endpoint: Option<String>,
    /// How many published batches the replay buffer keeps.
    pub buffer_steps: usize,
    /// The PUB socket's send high-water mark.
    pub hwm: i32,
    /// Batches queued between the engine loop and the publisher thread before new ones are dropped.
    pub max_queue_size: usize,
    /// The topic frame; `None` means kvgate's default `kv@<ip>:<port>@<model>` (llm-d's
    /// convention). vLLM's own default is the empty topic: pass `"topic": ""` for that.
    pub topic: Option<String>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: "null".into(),
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: None,
        }
    }
}

impl KvEventsConfig {
    /// Parses the JSON given to `--kv-events-config`.
    pub fn parse(json: &str) -> Result<Self, String> {
        let config: Self =
            serde_json::from_str(json).map_err(|e| format!("--kv-events-config: {e}"))?;
        config.validate()?;
        Ok(config)
    }

    /// Whether a ZMQ publisher should run.
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == "zmq"
    }

    fn validate(&self) -> Result<(), String> {
        match self.publisher.as_str() {
            "zmq" | "null" => {}
            other => {
                return Err(format!(
                    "--kv-events-config: publisher {other:?} is not supported (use \"zmq\" or \"null\")"
                ));
            }
        }
        if self.publishes() {
            if self.endpoint.is_empty() {
                return Err("--kv-events-config: endpoint is empty".into());
            }
            if self.max_queue_size == 0 {
                return Err("--kv-events-config: max_queue_size must be positive".into());
            }
        }
        Ok(())
    }

    /// The PUB endpoint for a data-parallel rank: vLLM offsets a TCP port by the rank.
    pub fn endpoint_for_rank(endpoint: &str, rank: u16) -> Result<String, String> {
        offset_port(endpoint, rank)
    }

    /// Whether vLLM would bind (rather than connect) this endpoint.
    pub fn binds(endpoint: &str) -> bool {
        endpoint.contains('*')
            || endpoint.contains("::")
            || endpoint.starts_with("ipc://")
            || endpoint.starts_with("inproc://")
    }
}

fn offset_port(endpoint: &str, rank: u16) -> Result<String, String> {
    if rank == 0 || !endpoint.starts_with("tcp://") {
        return Ok(endpoint.to_owned());
    }
    let (host, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| format!("endpoint {endpoint:?} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("endpoint {endpoint:?} has a bad port"))?;
    let port = port
        .checked_add(rank)
        .ok_or_else(|| format!("endpoint {endpoint:?} + rank {rank} overflows the port"))?;
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_json_and_rejects_typos() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
                "replay_endpoint":"tcp://*:5558","topic":"kv@1.2.3.4:8200@m"}"#,
        )
        .unwrap();
        assert!(c.publishes());
        assert_eq!(c.buffer_steps, 10_000);
        assert_eq!(c.topic.as_deref(), Some("kv@1.2.3.4:8200@m"));
        let err = KvEventsConfig::parse(r#"{"enable_kv_cache_event":true}"#).unwrap_err();
        assert!(err.contains("unknown field"), "{err}");
        assert!(KvEventsConfig::parse(r#"{"publisher":"kafka"}"#).is_err());
        assert!(!KvEventsConfig::parse("{}").unwrap().publishes());
    }

    #[test]
    fn rank_offsets_and_bind_rules() {
        assert_eq!(
            KvEventsConfig::endpoint_for_rank("tcp://*:5557", 2).unwrap(),
            "tcp://*:5559"
        );
        assert_eq!(
            KvEventsConfig::endpoint_for_rank("ipc:///tmp/x", 2).unwrap(),
            "ipc:///tmp/x"
        );
        assert!(KvEventsConfig::endpoint_for_rank("tcp://*:65535", 1).is_err());
        assert!(KvEventsConfig::binds("tcp://*:5557"));
        assert!(!KvEventsConfig::binds("tcp://10.0.0.1:5557"));
    }
}
