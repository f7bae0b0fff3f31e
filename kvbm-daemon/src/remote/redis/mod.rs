//! The remote tier's Redis client, on the `redis` crate: its [`ConnectionManager`] keeps one
//! multiplexed connection and reconnects when it breaks, so a Redis restart costs the commands
//! that were in flight, never the daemon. Every command runs under a deadline, connecting
//! included; one whose connection broke goes once more on the connection the library opens
//! next (the commands used, `SET`, `GET`, `DEL`, are idempotent).
//!
//! Reads are bounded: a value is fetched with `GETRANGE` up to one byte past the bound, so a
//! larger one is refused without Redis sending it whole. (Not in a `MULTI` transaction with
//! `EXISTS`: the library, 1.8.1, underflows a counter when the server refuses `MULTI` itself,
//! a panic in debug builds.)
//!
//! `rediss://` URLs speak TLS (rustls on ring; TLS 1.2 and 1.3), verifying the server's
//! certificate against a CA bundle ([`TlsSettings::ca_file`]) or the system's roots, for the
//! URL's host name.

mod config;
mod errors;

use std::future::Future;
use std::sync::OnceLock;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{RedisResult, Value};
use bytes::Bytes;

pub use super::RemoteError;
pub use config::{RedisConfig, TlsSettings, redact};

/// Retries of one reconnection, after the first try, before the library gives up until the
/// next command (which then starts another).
const RECONNECT_RETRIES: usize = 2;
/// The first pause between reconnection tries (it doubles, with jitter).
const RECONNECT_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// A Redis client for the remote tier.
pub struct Redis {
    config: RedisConfig,
    /// The library's client, built once (by [`Redis::prepare_tls`] or the first command).
    client: OnceLock<::redis::Client>,
    /// The connection manager, made at the first command (it needs the runtime).
    manager: OnceLock<ConnectionManager>,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis")
            .field("config", &self.config)
            .field("connected", &self.manager.get().is_some())
            .finish_non_exhaustive()
    }
}

impl Redis {
    /// A client; nothing is connected until the first command.
    pub fn new(config: RedisConfig) -> Self {
        Self {
            config,
            client: OnceLock::new(),
            manager: OnceLock::new(),
        }
    }

    /// Builds the library's client now, so a CA bundle that cannot be read (for `rediss://`)
    /// fails at start rather than at the first command.
    pub fn prepare_tls(&self) -> Result<(), RemoteError> {
        self.client().map(|_| ())
    }

    fn client(&self) -> Result<&::redis::Client, RemoteError> {
        if let Some(client) = self.client.get() {
            return Ok(client);
        }
        let built = self.config.client()?;
        Ok(self.client.get_or_init(|| built))
    }

    fn manager(&self) -> Result<ConnectionManager, RemoteError> {
        if let Some(manager) = self.manager.get() {
            return Ok(manager.clone());
        }
        let timeout = self.config.timeout;
        let settings = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(RECONNECT_RETRIES)
            .set_min_delay(RECONNECT_DELAY)
            .set_max_delay(timeout / 4);
        let made = ConnectionManager::new_lazy_with_config(self.client()?.clone(), settings)
            .map_err(|source| RemoteError::Redis {
                command: "connect",
                source,
            })?;
        Ok(self.manager.get_or_init(|| made).clone())
    }

    /// Where it connects (for logs).
    pub fn address(&self) -> String {
        format!(
            "{}:{}/{}",
            self.config.host, self.config.port, self.config.db
        )
    }

    /// `PING`.
    pub async fn ping(&self) -> Result<(), RemoteError> {
        let cmd = ::redis::cmd("PING");
        let reply: Value = self
            .call("PING", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        match reply {
            Value::SimpleString(s) if s == "PONG" => Ok(()),
            reply => Err(RemoteError::Unexpected {
                command: "PING",
                reply: format!("{reply:?}"),
            }),
        }
    }

    /// `SET key value`.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), RemoteError> {
        let mut cmd = ::redis::cmd("SET");
        cmd.arg(key).arg(value);
        let reply: Value = self
            .call("SET", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        match reply {
            Value::Okay => Ok(()),
            reply => Err(RemoteError::Unexpected {
                command: "SET",
                reply: format!("{reply:?}"),
            }),
        }
    }

    /// The value of `key`, at most [`RedisConfig::max_value_bytes`]: `None` when Redis does
    /// not have it. One `GETRANGE` that stops one byte past the bound, so a larger value is
    /// refused without being sent whole. Redis answers a missing key with an empty string, so
    /// an empty value reads as missing: the tier never stores one (a block has at least one
    /// byte).
    pub async fn get(&self, key: &[u8]) -> Result<Option<Bytes>, RemoteError> {
        let limit = self.config.max_value_bytes;
        let mut cmd = ::redis::cmd("GETRANGE");
        cmd.arg(key)
            .arg(0)
            .arg(isize::try_from(limit).unwrap_or(isize::MAX));
        let value: Vec<u8> = self
            .call("GET", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        if value.len() > limit {
            return Err(RemoteError::TooLarge { op: "GET", limit });
        }
        Ok((!value.is_empty()).then(|| Bytes::from(value)))
    }

    /// `DEL key`.
    pub async fn delete(&self, key: &[u8]) -> Result<(), RemoteError> {
        let mut cmd = ::redis::cmd("DEL");
        cmd.arg(key);
        let _deleted: i64 = self
            .call("DEL", |mut c| {
                let cmd = &cmd;
                async move { cmd.query_async(&mut c).await }
            })
            .await?;
        Ok(())
    }

    /// Runs `op` on the connection under the deadline; once more if the connection broke.
    async fn call<T, F, Fut>(&self, command: &'static str, op: F) -> Result<T, RemoteError>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let timeout = self.config.timeout;
        let manager = self.manager()?;
        let attempt = async {
            match op(manager.clone()).await {
                Err(e) if errors::broken_connection(&e) => {
                    tracing::debug!(error = %e, command, "Redis connection lost; retrying");
                    op(manager).await
                }
                result => result,
            }
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(errors::classify(command, e, timeout)),
            Err(_) => Err(RemoteError::Timeout(timeout)),
        }
    }
}

#[cfg(test)]
mod tests;
