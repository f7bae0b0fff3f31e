//! Command-line and environment configuration.

use std::path::PathBuf;

use crate::remote::s3::Addressing;

/// kvgate KV block manager (node daemon): keeps KV blocks that engines offload in host memory,
/// on local disk and in a remote store (Redis or S3), gives them back on request, and publishes what
/// it holds so the endpoint picker can route to the pods of this node.
///
/// Engine connectors connect to `--socket`, pass a shared-memory segment and exchange control
/// messages; block bytes move through the segment only.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvgate-kvbm", version, about, long_about)]
pub struct Args {
    /// Control socket for engine connectors (created mode 0660; a stale socket is replaced,
    /// a live one is an error).
    #[arg(long, default_value = "/run/kvgate/kvbm.sock")]
    pub socket: PathBuf,
    /// Metrics and health port (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, default_value_t = 9092)]
    pub metrics_port: u16,
    /// Address the metrics port binds.
    #[arg(long, env = "KVGATE_LISTEN_ADDRESS", default_value = "0.0.0.0")]
    pub metrics_bind: std::net::IpAddr,
    /// Host-memory tier (G2) capacity in bytes; 0 disables it.
    #[arg(long, default_value_t = 8 << 30)]
    pub host_bytes: u64,
    /// Directory for the disk tier (G3): one slab file per block size, blocks as slots;
    /// disabled when absent. It must belong to the daemon's user and is made private (0700);
    /// the daemon locks it, and removes its slab files at start (blocks are not indexed
    /// across runs). Put it on a local NVMe file system.
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Disk tier capacity in bytes (with `--disk-dir`); its least recently used blocks are
    /// deleted beyond it.
    #[arg(long, default_value_t = 64 << 30)]
    pub disk_bytes: u64,
    /// Read and write the disk tier with O_DIRECT (bypassing the page cache) when the file
    /// system supports it and blocks are a multiple of 4 KiB; `--disk-direct-io=false` for
    /// page-cache I/O.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub disk_direct_io: bool,
    /// Uses (offloads and onboards, estimated by a frequency sketch) a block needs before
    /// it is written to disk, so blocks used once do not wear the disk; 0 admits every block.
    #[arg(long, default_value_t = 0)]
    pub disk_min_uses: u8,
    /// Write a block to disk when host memory stores it (if admitted), not only when host
    /// memory evicts it.
    #[arg(long)]
    pub disk_write_through: bool,
    /// Disk puts queued at most; beyond it demotions to disk are dropped and counted (deletes
    /// are never dropped).
    #[arg(long, default_value_t = 4096)]
    pub disk_queue: usize,
    /// Block bytes queued for the disk at most; beyond it demotions to disk are dropped and
    /// counted.
    #[arg(long, default_value_t = 1 << 30)]
    pub disk_queue_bytes: u64,
    /// Remote tier (G4): `redis://[[user]:password@]host[:port][/db]`, `rediss://…` for TLS
    /// (the server's certificate is verified for the URL's host), or `s3://bucket[/prefix]`
    /// for an S3 bucket (AWS or S3-compatible: see `--s3-endpoint`; credentials from
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and optional `AWS_SESSION_TOKEN`);
    /// disabled when absent.
    #[arg(long, env = "KVGATE_KVBM_REMOTE_URL", hide_env_values = true)]
    pub remote_url: Option<String>,
    /// PEM bundle of the CAs that sign the remote store's certificate, for `rediss://` or an
    /// `https://` S3 endpoint (default: the system's roots).
    #[arg(long, env = "KVGATE_KVBM_REMOTE_CA_FILE")]
    pub remote_ca_file: Option<PathBuf>,
    /// S3 endpoint, `http[s]://host[:port]` (MinIO, Ceph RGW, …); default AWS's
    /// `https://s3.<region>.amazonaws.com`. Use `https://` unless the endpoint is on the node.
    #[arg(long, env = "KVGATE_KVBM_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// S3 signing region; default `AWS_REGION`, then `AWS_DEFAULT_REGION`, then `us-east-1`.
    #[arg(long)]
    pub s3_region: Option<String>,
    /// S3 bucket addressing: `auto` is virtual-hosted (`bucket.host`) for AWS's endpoint and
    /// path-style (`host/bucket`) for `--s3-endpoint`.
    #[arg(long, value_enum, default_value_t = Addressing::Auto)]
    pub s3_addressing: Addressing,
    /// Bytes this node may keep in the remote store (its least recently used blocks are
    /// deleted beyond it).
    #[arg(long, default_value_t = 32 << 30)]
    pub remote_bytes: u64,
    /// Deadline of one remote command, milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub remote_timeout_ms: u64,
    /// Remote puts queued at most; beyond it demotions to the remote store are dropped and counted
    /// (deletes are never dropped).
    #[arg(long, default_value_t = 4096)]
    pub remote_queue: usize,
    /// Block bytes queued for the remote store at most (memory above `--host-bytes` while
    /// the remote store is slow or away); beyond it demotions are dropped and counted.
    #[arg(long, default_value_t = 1 << 30)]
    pub remote_queue_bytes: u64,
    /// NATS server.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Kubernetes namespace (subjects are `kvgate.kvbm.<namespace>.<node>`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Node name (from the downward API in Kubernetes).
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    /// The served model name (the key seed of its blocks): the EPP follows one KV-event stream
    /// per node, so a daemon serves one model, and every connector's layout must name it.
    #[arg(long, env = "KVGATE_MODEL")]
    pub model: String,
    /// Tokens per KV block (every connector's layout must match).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Blocks pinned at once at most (a `lookup` with `pin_ms` pins the blocks it found, so
    /// they are not evicted before the connector onboards them).
    #[arg(long, default_value_t = 65536)]
    pub max_pinned_blocks: usize,
    /// The longest a pin lasts, milliseconds (a connector asking for longer gets this).
    #[arg(long, default_value_t = 30_000)]
    pub max_pin_ms: u32,
    /// Connectors served at once.
    #[arg(long, default_value_t = 256)]
    pub max_connections: u64,
    /// The largest shared-memory segment a connector may declare, bytes.
    #[arg(long, default_value_t = 16 << 30)]
    pub max_segment_bytes: u64,
    /// Close a connector connection idle this long, seconds.
    #[arg(long, default_value_t = 300)]
    pub idle_timeout_s: u64,
    /// Bytes of blocks one connection may offload per second, in bursts of up to one second's
    /// worth; the blocks of an offload past it are not stored (answered as `skipped`), so one
    /// flooding connector cannot evict every other's blocks. 0: no bound.
    #[arg(long, default_value_t = 0)]
    pub connector_offload_bytes_per_s: u64,
    /// The most block keys in one published envelope.
    #[arg(long, default_value_t = 4096)]
    pub max_keys_per_envelope: usize,
    /// Publish pending events at least this often, milliseconds.
    #[arg(long, default_value_t = 20)]
    pub publish_interval_ms: u64,
    /// Serve pulls to other nodes' block managers on this address, and pull from them: a block
    /// this node misses that a peer (same model and block size, found on NATS) holds is
    /// fetched over TCP instead of recomputed. Off when absent. Needs `--peer-secret-file`.
    #[arg(long, env = "KVGATE_PEER_LISTEN")]
    pub peer_listen: Option<std::net::SocketAddr>,
    /// The IP address peers connect to (the pod IP), on `--peer-listen`'s port; defaults to
    /// `--peer-listen`'s address unless that is an unspecified one such as 0.0.0.0.
    #[arg(long, env = "KVGATE_PEER_ADVERTISE_IP")]
    pub peer_advertise_ip: Option<std::net::IpAddr>,
    /// A file holding the secret every node of the mesh shares (16 to 4096 bytes; surrounding
    /// white space is ignored): both ends of a pull prove they hold it.
    #[arg(long, env = "KVGATE_PEER_SECRET_FILE")]
    pub peer_secret_file: Option<PathBuf>,
    /// The longest a pull from a peer may take (connecting, at most 500 ms of it;
    /// authenticating; up to 64 MiB of blocks), milliseconds; a pull past it fails and the
    /// engine computes the blocks. Keep it below the connectors' own call timeout (2 s for
    /// vLLM's).
    #[arg(long, default_value_t = 1000)]
    pub peer_timeout_ms: u64,
    /// Peer connections served at once.
    #[arg(long, default_value_t = 64)]
    pub peer_max_connections: u64,
    /// How often this node announces its pull address, seconds; peers forget a node not
    /// heard from for three intervals.
    #[arg(long, default_value_t = 10)]
    pub peer_announce_interval_s: u64,
    /// How answers to pulls travel: `tcp`, on the pull connection; or `nixl`, read by the
    /// puller through NIXL's UCX backend (RDMA where the nodes have it), each answer falling
    /// back to the connection if that read fails. Both ends must say `nixl` for it to be used.
    /// `nixl` needs NIXL's `libnixl_capi.so` (see `--nixl-library`); without it the daemon
    /// does not start.
    #[arg(long, value_enum, default_value_t = PeerFabric::Tcp, env = "KVGATE_PEER_FABRIC")]
    pub peer_fabric: PeerFabric,
    /// Where NIXL's `libnixl_capi.so` is, for `--peer-fabric nixl`; found through the library
    /// search path (`LD_LIBRARY_PATH`, the loader's cache) when absent. NIXL loads its plugins
    /// from `plugins/` beside `libnixl.so`, or from `NIXL_PLUGIN_DIR`.
    #[arg(long)]
    pub nixl_library: Option<PathBuf>,
    /// Buffers of 64 MiB (the largest answer) NIXL transfers use, each registered with NIXL
    /// once, when first needed (under RDMA that pins its pages), and reused: at most this many
    /// answers are served or read through NIXL at once; more go on the connection.
    #[arg(long, default_value_t = 4)]
    pub nixl_buffers: usize,
}

/// How answers to pulls travel between block managers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PeerFabric {
    /// On the pull connection.
    Tcp,
    /// NIXL READs (UCX), the connection as fallback.
    Nixl,
}

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        let url = self.remote_url.as_deref();
        if let Some(url) = url
            && !["redis://", "rediss://", "s3://"]
                .iter()
                .any(|scheme| url.starts_with(scheme))
        {
            return Err(format!(
                "--remote-url must be redis://…, rediss://… or s3://…, got {}",
                crate::remote::redis::redact(url)
            ));
        }
        let s3 = url.is_some_and(|u| u.starts_with("s3://"));
        let tls = url.is_some_and(|u| u.starts_with("rediss://"))
            || (s3
                && !self
                    .s3_endpoint
                    .as_deref()
                    .is_some_and(|e| e.starts_with("http://")));
        if self.remote_ca_file.is_some() && !tls {
            return Err(
                "--remote-ca-file needs a rediss:// --remote-url or an https S3 endpoint".into(),
            );
        }
        if !s3
            && (self.s3_endpoint.is_some()
                || self.s3_region.is_some()
                || self.s3_addressing != Addressing::Auto)
        {
            return Err(
                "--s3-endpoint, --s3-region and --s3-addressing need an s3:// --remote-url".into(),
            );
        }
        let disk = self.disk_dir.is_some() && self.disk_bytes > 0;
        let remote = self.remote_url.is_some() && self.remote_bytes > 0;
        if self.host_bytes == 0 && !disk && !remote {
            return Err(
                "no tier: give --host-bytes > 0, --disk-dir with --disk-bytes > 0, or --remote-url with --remote-bytes > 0"
                    .into(),
            );
        }
        if self.node.is_empty() {
            return Err("--node (NODE_NAME) must not be empty".into());
        }
        if self.model.is_empty() || self.model.len() > crate::store::MAX_NAME_BYTES {
            return Err("--model must be 1 to 256 bytes".into());
        }
        if self.block_size == 0 {
            return Err("--block-size must be positive".into());
        }
        if self.remote_timeout_ms == 0 || self.idle_timeout_s == 0 || self.publish_interval_ms == 0
        {
            return Err(
                "--remote-timeout-ms, --idle-timeout-s and --publish-interval-ms must be positive"
                    .into(),
            );
        }
        if self.disk_min_uses > 15 {
            return Err(
                "--disk-min-uses must be at most 15 (the use counters saturate there)".into(),
            );
        }
        if self.disk_queue == 0 || self.remote_queue == 0 {
            return Err("--disk-queue and --remote-queue must be positive".into());
        }
        if self.max_connections == 0 || self.max_keys_per_envelope == 0 {
            return Err("--max-connections and --max-keys-per-envelope must be positive".into());
        }
        self.validate_peers()
    }

    fn validate_peers(&self) -> Result<(), String> {
        if self.nixl_library.is_some() && self.peer_fabric != PeerFabric::Nixl {
            return Err("--nixl-library needs --peer-fabric nixl".into());
        }
        if self.nixl_buffers == 0 {
            return Err("--nixl-buffers must be positive".into());
        }
        let Some(listen) = self.peer_listen else {
            if self.peer_advertise_ip.is_some() || self.peer_secret_file.is_some() {
                return Err("--peer-advertise-ip and --peer-secret-file need --peer-listen".into());
            }
            if self.peer_fabric != PeerFabric::Tcp {
                return Err("--peer-fabric nixl needs --peer-listen (pulls between nodes)".into());
            }
            return Ok(());
        };
        if self.peer_secret_file.is_none() {
            return Err("--peer-listen needs --peer-secret-file (the mesh's shared secret)".into());
        }
        if listen.port() == 0 {
            return Err("--peer-listen needs a fixed port: peers are told it".into());
        }
        if self.peer_advertise_ip.is_none() && listen.ip().is_unspecified() {
            return Err(format!(
                "--peer-listen {listen} is not an address peers can reach: give --peer-advertise-ip (the pod IP)"
            ));
        }
        if self.peer_advertise_ip.is_some_and(|ip| ip.is_unspecified()) {
            return Err("--peer-advertise-ip must be an address peers can reach".into());
        }
        if self.peer_timeout_ms == 0
            || self.peer_max_connections == 0
            || self.peer_announce_interval_s == 0
        {
            return Err(
                "--peer-timeout-ms, --peer-max-connections and --peer-announce-interval-s must be positive"
                    .into(),
            );
        }
        Ok(())
    }

    /// The address peers are told to pull from, when peers are on.
    pub fn peer_address(&self) -> Option<std::net::SocketAddr> {
        let listen = self.peer_listen?;
        Some(std::net::SocketAddr::new(
            self.peer_advertise_ip.unwrap_or(listen.ip()),
            listen.port(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn parse(extra: &[&str]) -> Args {
        let mut argv = vec!["kvgate-kvbm", "--node", "n1", "--model", "m"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    }

    #[test]
    fn defaults_validate() {
        assert_eq!(parse(&[]).validate(), Ok(()));
        assert_eq!(
            parse(&["--remote-url", "redis://r:6379"]).validate(),
            Ok(())
        );
        // The disk alone is a tier.
        let disk_only = parse(&["--host-bytes", "0", "--disk-dir", "/d"]);
        assert_eq!(disk_only.validate(), Ok(()));
        assert!(disk_only.disk_direct_io);
        assert!(!parse(&["--disk-direct-io=false"]).disk_direct_io);
        let policy = parse(&["--disk-min-uses", "2", "--disk-write-through"]);
        assert_eq!((policy.disk_min_uses, policy.disk_write_through), (2, true));
        assert_eq!(
            (disk_only.disk_min_uses, disk_only.disk_write_through),
            (0, false)
        );
    }

    #[test]
    fn peers_advertise_the_listen_address_unless_told_otherwise() {
        let on = parse(&["--peer-listen", "10.0.0.1:9094", "--peer-secret-file", "/s"]);
        assert_eq!(on.validate(), Ok(()));
        assert_eq!(on.peer_address(), Some(([10, 0, 0, 1], 9094).into()));
        let pod = parse(&[
            "--peer-listen",
            "0.0.0.0:9094",
            "--peer-secret-file",
            "/s",
            "--peer-advertise-ip",
            "10.1.2.3",
        ]);
        assert_eq!(pod.validate(), Ok(()));
        assert_eq!(pod.peer_address(), Some(([10, 1, 2, 3], 9094).into()));
        let v6 = parse(&[
            "--peer-listen",
            "[::]:9094",
            "--peer-secret-file",
            "/s",
            "--peer-advertise-ip",
            "fd00::7",
        ]);
        assert_eq!(v6.validate(), Ok(()));
        assert_eq!(v6.peer_address(), Some("[fd00::7]:9094".parse().unwrap()));
        assert_eq!(parse(&[]).peer_address(), None);
    }

    #[test]
    fn bad_configurations_are_explained() {
        for (flags, needle) in [
            (vec!["--disk-queue", "0"], "positive"),
            (vec!["--disk-min-uses", "16"], "at most 15"),
            (
                vec!["--host-bytes", "0", "--disk-dir", "/d", "--disk-bytes", "0"],
                "no tier",
            ),
            (vec!["--remote-url", "gs://b"], "s3://"),
            (vec!["--s3-region", "eu-west-1"], "s3:// --remote-url"),
            (
                vec!["--remote-url", "redis://h", "--s3-endpoint", "http://m"],
                "s3:// --remote-url",
            ),
            (
                vec![
                    "--remote-url",
                    "s3://b",
                    "--s3-endpoint",
                    "http://m:9000",
                    "--remote-ca-file",
                    "/ca.pem",
                ],
                "https S3 endpoint",
            ),
            (vec!["--host-bytes", "0"], "no tier"),
            (vec!["--publish-interval-ms", "0"], "positive"),
            (vec!["--peer-listen", "10.0.0.1:9094"], "--peer-secret-file"),
            (vec!["--peer-secret-file", "/s"], "need --peer-listen"),
            (
                vec!["--peer-listen", "0.0.0.0:9094", "--peer-secret-file", "/s"],
                "--peer-advertise-ip",
            ),
            (
                vec!["--peer-listen", "10.0.0.1:0", "--peer-secret-file", "/s"],
                "fixed port",
            ),
            (
                vec![
                    "--peer-listen",
                    "0.0.0.0:9094",
                    "--peer-secret-file",
                    "/s",
                    "--peer-advertise-ip",
                    "::",
                ],
                "peers can reach",
            ),
            (
                vec![
                    "--peer-listen",
                    "10.0.0.1:9094",
                    "--peer-secret-file",
                    "/s",
                    "--peer-timeout-ms",
                    "0",
                ],
                "positive",
            ),
        ] {
            let e = parse(&flags).validate().unwrap_err();
            assert!(e.contains(needle), "{flags:?}: {e}");
        }
        let e = parse(&["--remote-url", "http://u:pw@h"])
            .validate()
            .unwrap_err();
        assert!(!e.contains("pw"), "{e}");
        assert_eq!(
            parse(&[
                "--remote-url",
                "rediss://u:pw@h",
                "--remote-ca-file",
                "/ca.pem"
            ])
            .validate(),
            Ok(())
        );
        let s3 = parse(&[
            "--remote-url",
            "s3://bucket/p",
            "--s3-endpoint",
            "https://minio:9000",
            "--s3-addressing",
            "path",
            "--remote-ca-file",
            "/ca.pem",
        ]);
        assert_eq!(s3.validate(), Ok(()));
        assert_eq!(s3.s3_addressing, Addressing::Path);
        let e = parse(&["--remote-url", "redis://h", "--remote-ca-file", "/ca.pem"])
            .validate()
            .unwrap_err();
        assert!(e.contains("rediss://"), "{e}");
    }
}
