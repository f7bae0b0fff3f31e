//! Where the bucket is and how to reach it: `s3://bucket[/prefix]` and the options beside it,
//! checked at start, and the credentials and region the environment gives.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::remote::RemoteError;

/// The longest object-key prefix (S3 keys are at most 1,024 bytes; a block's name takes 33).
pub(super) const MAX_PREFIX: usize = 512;

/// Long-term or temporary AWS credentials. Debug shows the secret and the session token as
/// `"<redacted>"`.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The access key ID, e.g. `AKIAIOSFODNN7EXAMPLE`.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// The session token of temporary credentials (STS), sent as `x-amz-security-token`.
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// How a bucket is addressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Addressing {
    /// Virtual-hosted for AWS's default endpoint (when the bucket name allows it), path-style
    /// for an endpoint given with `--s3-endpoint`.
    #[default]
    Auto,
    /// `https://endpoint/bucket/key`.
    Path,
    /// `https://bucket.endpoint/key`.
    Virtual,
}

/// Where and how to reach the bucket.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// `https` (true) or `http`.
    pub https: bool,
    /// The endpoint's host (without the bucket for virtual-hosted addressing).
    pub host: String,
    /// The endpoint's port.
    pub port: u16,
    /// The bucket.
    pub bucket: String,
    /// Prepended to every object key: empty, or ending in `/`.
    pub prefix: String,
    /// The signing region.
    pub region: String,
    /// Path-style (true) or virtual-hosted addressing, resolved.
    pub path_style: bool,
    /// Whether the endpoint is AWS's own (no `--s3-endpoint`).
    pub aws_endpoint: bool,
    /// Signing credentials.
    pub credentials: Credentials,
    /// Deadline of one request, connecting and reading the body included.
    pub timeout: Duration,
    /// The largest object read back.
    pub max_value_bytes: usize,
    /// PEM bundle of the CAs to trust for `https` (the system's roots when absent).
    pub ca_file: Option<PathBuf>,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint())
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("path_style", &self.path_style)
            .field("aws_endpoint", &self.aws_endpoint)
            .field("credentials", &self.credentials)
            .field("timeout", &self.timeout)
            .field("max_value_bytes", &self.max_value_bytes)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

/// The options beside `--remote-url s3://bucket[/prefix]`.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    /// `http[s]://host[:port]`; AWS's endpoint of the region when absent.
    pub endpoint: Option<String>,
    /// The signing region.
    pub region: String,
    /// How the bucket is addressed.
    pub addressing: Addressing,
}

impl S3Config {
    /// Parses `s3://bucket[/prefix]` with its options.
    pub fn from_url(
        url: &str,
        options: &S3Options,
        credentials: Credentials,
        timeout: Duration,
        max_value_bytes: usize,
    ) -> Result<Self, RemoteError> {
        let bad = |why: String| RemoteError::Url(format!("{why}: {url}"));
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("must start with s3://".into()))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        check_bucket(bucket).map_err(bad)?;
        let prefix = normalise_prefix(prefix).map_err(bad)?;
        if !valid_region(&options.region) {
            return Err(RemoteError::Url(format!(
                "--s3-region {:?} is not a region name (letters, digits and '-')",
                options.region
            )));
        }
        let (https, host, port, aws) = match &options.endpoint {
            Some(endpoint) => {
                let (https, host, port) = parse_endpoint(endpoint)
                    .map_err(|why| RemoteError::Url(format!("--s3-endpoint {endpoint}: {why}")))?;
                (https, host, port, false)
            }
            None => (
                true,
                format!("s3.{}.amazonaws.com", options.region),
                443,
                true,
            ),
        };
        // A dotted bucket name under a wildcard certificate fails verification: path-style.
        let ip_host = host.parse::<std::net::IpAddr>().is_ok();
        let path_style = match options.addressing {
            Addressing::Path => true,
            Addressing::Virtual if ip_host => {
                return Err(RemoteError::Url(format!(
                    "--s3-addressing virtual needs a host name, not the address {host}"
                )));
            }
            Addressing::Virtual => false,
            Addressing::Auto => !aws || bucket.contains('.'),
        };
        Ok(Self {
            https,
            host,
            port,
            bucket: bucket.to_owned(),
            prefix,
            region: options.region.clone(),
            path_style,
            aws_endpoint: aws,
            credentials,
            timeout,
            max_value_bytes,
            ca_file: None,
        })
    }

    /// `scheme://host[:port]` (for logs).
    pub fn endpoint(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        let default = if self.https { 443 } else { 80 };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == default {
            format!("{scheme}://{host}")
        } else {
            format!("{scheme}://{host}:{}", self.port)
        }
    }

    /// The endpoint the SDK is given: the one of `--s3-endpoint`, or `None` for AWS's, which
    /// the SDK resolves from the region (the same `s3.<region>.amazonaws.com` outside AWS's
    /// partitions with other domains).
    pub(super) fn endpoint_url(&self) -> Option<String> {
        (!self.aws_endpoint).then(|| self.endpoint())
    }
}

/// S3's bucket naming rules (3–63 of lowercase letters, digits, `.` and `-`, starting and
/// ending with a letter or digit).
fn check_bucket(bucket: &str) -> Result<(), String> {
    let ok_len = (3..=63).contains(&bucket.len());
    let ok_chars = bucket
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    let ends = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok_len && ok_chars && ends(bucket.bytes().next()) && ends(bucket.bytes().last()) {
        Ok(())
    } else {
        Err(format!(
            "bucket {bucket:?} is not a valid S3 bucket name (3–63 of a-z, 0-9, '.', '-')"
        ))
    }
}

/// The prefix as keys take it: empty, or ending in one `/`; no control characters, no `//`.
fn normalise_prefix(prefix: &str) -> Result<String, String> {
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return Ok(String::new());
    }
    if prefix.len() > MAX_PREFIX {
        return Err(format!("the prefix is longer than {MAX_PREFIX} bytes"));
    }
    if prefix.chars().any(char::is_control) || prefix.contains("//") || prefix.starts_with('/') {
        return Err("the prefix has a control character or an empty segment".into());
    }
    Ok(format!("{prefix}/"))
}

fn valid_region(region: &str) -> bool {
    !region.is_empty()
        && region.len() <= 64
        && region
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// `http[s]://host[:port]` with nothing after the authority but an optional `/`.
fn parse_endpoint(endpoint: &str) -> Result<(bool, String, u16), String> {
    let (https, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err("must start with http:// or https://".into());
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '@', '?', '#']) {
        return Err("give only scheme, host and port".into());
    }
    let default = if https { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or("unclosed '['")?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| "the port is not a number")?,
            None if after.is_empty() => default,
            None => return Err("junk after the host".into()),
        };
        (host, port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().map_err(|_| "the port is not a number")?),
            None => (authority, default),
        }
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    Ok((https, host.to_owned(), port))
}

/// Credentials from the standard environment variables (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`), as `env` reads them.
pub fn credentials_from(env: impl Fn(&str) -> Option<String>) -> Result<Credentials, RemoteError> {
    let get = |name: &str| env(name).filter(|v| !v.is_empty());
    match (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY")) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Credentials {
            access_key_id,
            secret_access_key,
            session_token: get("AWS_SESSION_TOKEN"),
        }),
        _ => Err(RemoteError::Credentials(
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for \
             temporary credentials) in the daemon's environment"
                .into(),
        )),
    }
}

/// The region from `AWS_REGION`, then `AWS_DEFAULT_REGION`, else `us-east-1`.
pub fn region_from(env: impl Fn(&str) -> Option<String>) -> String {
    env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "us-east-1".to_owned())
}
