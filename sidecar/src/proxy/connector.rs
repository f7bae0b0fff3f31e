//! Which P/D connector protocol the proxy speaks when a request names a prefiller (the names
//! are llm-d's pd-sidecar `--kv-connector` values).

/// The P/D connector protocol (`--kv-connector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Connector {
    /// vLLM's NIXL connector: a one-token prefill on the prefiller, then the decode on the local
    /// engine with the `kv_transfer_params` the prefiller returned (sequential).
    #[default]
    Nixlv2,
    /// SGLang's bootstrap rendezvous: the same request, carrying `bootstrap_host`,
    /// `bootstrap_port` and a random `bootstrap_room`, sent to the prefiller and the local engine
    /// at once; the engines meet in the room and move the KV between themselves.
    Sglang,
}

impl Connector {
    /// Every variant, for metric exposition.
    pub const ALL: [Self; 2] = [Self::Nixlv2, Self::Sglang];

    /// The metric label (and the flag value).
    pub fn label(self) -> &'static str {
        match self {
            Self::Nixlv2 => "nixlv2",
            Self::Sglang => "sglang",
        }
    }
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
    use clap::ValueEnum as _;

    #[test]
    fn labels_are_the_flag_values() {
        for c in Connector::ALL {
            let parsed = Connector::from_str(c.label(), false).unwrap();
            assert_eq!(parsed, c);
        }
        assert!(Connector::from_str("mooncake", false).is_err());
        assert_eq!(Connector::default(), Connector::Nixlv2);
    }
}
