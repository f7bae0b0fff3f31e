//! Per-rank endpoints: vLLM and SGLang bind data-parallel rank `r`'s KV-event and replay
//! sockets on the configured port + `r`.

/// Why a rank's endpoint could not be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// Not `tcp://host:port` and not `ipc://`.
    #[error("endpoint {0:?} is neither tcp://host:port nor ipc://path")]
    Malformed(String),
    /// The port plus the rank does not fit in 16 bits.
    #[error("endpoint {endpoint:?} has no port for rank {rank}")]
    PortOverflow {
        /// The base endpoint.
        endpoint: String,
        /// The rank.
        rank: u32,
    },
}

/// The endpoint of data-parallel rank `rank`: the TCP port offset by the rank; an `ipc://` path
/// gets a `-<rank>` suffix for ranks above 0 (rank 0 is the path as given).
pub fn rank_endpoint(base: &str, rank: u32) -> Result<String, EndpointError> {
    if let Some(path) = base.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(EndpointError::Malformed(base.to_owned()));
        }
        return Ok(if rank == 0 {
            base.to_owned()
        } else {
            format!("{base}-{rank}")
        });
    }
    let rest = base
        .strip_prefix("tcp://")
        .ok_or_else(|| EndpointError::Malformed(base.to_owned()))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| EndpointError::Malformed(base.to_owned()))?;
    let port: u16 = port
        .parse()
        .map_err(|_| EndpointError::Malformed(base.to_owned()))?;
    if host.is_empty() {
        return Err(EndpointError::Malformed(base.to_owned()));
    }
    let port = u16::try_from(u32::from(port) + rank).map_err(|_| EndpointError::PortOverflow {
        endpoint: base.to_owned(),
        rank,
    })?;
    Ok(format!("tcp://{host}:{port}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ranks_offset_the_port() {
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:5557", 0).unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            rank_endpoint("tcp://[::1]:5557", 3).unwrap(),
            "tcp://[::1]:5560"
        );
        assert_eq!(
            rank_endpoint("ipc:///tmp/kv", 2).unwrap(),
            "ipc:///tmp/kv-2"
        );
        assert!(matches!(
            rank_endpoint("tcp://h:65535", 1),
            Err(EndpointError::PortOverflow { .. })
        ));
        for bad in ["udp://h:1", "tcp://h", "tcp://:1", "tcp://h:x", "ipc://"] {
            assert!(rank_endpoint(bad, 0).is_err(), "{bad}");
        }
    }
}
