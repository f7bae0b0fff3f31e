//! Mutual authentication of a peer connection with a shared secret (pure).
//!
//! The server opens with a random nonce; the client answers with its own nonce and an
//! HMAC-SHA256 of the server's; the server answers with an HMAC of the client's. Each MAC
//! covers a role byte, the nonce, the sender's node name and the server's address (the one the
//! client dialed, which the server checks is the one it advertises), so a MAC cannot be
//! reflected back (the roles differ), replayed on another connection (the nonces differ) or
//! relayed by a third party that announced its own address (the addresses differ). Both ends
//! prove they hold the secret; the bytes that follow are neither encrypted nor MACed (see
//! docs/kvbm.md § Pulls from peers).

use ring::hmac;
use ring::rand::{SecureRandom as _, SystemRandom};

/// Bytes of a nonce.
pub const NONCE_BYTES: usize = 32;
/// The shortest secret accepted.
pub const MIN_SECRET_BYTES: usize = 16;
/// The longest secret accepted.
pub const MAX_SECRET_BYTES: usize = 4096;

const CONTEXT: &[u8] = b"kvgate-kvbm-peer-v1\0";

/// Which end computed a MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The end that accepted the connection (serves blocks).
    Server,
    /// The end that connected (pulls blocks).
    Client,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Server => b'S',
            Role::Client => b'C',
        }
    }
}

/// Why a secret was refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("reading the peer secret {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Too short or too long (after trimming surrounding white space).
    #[error(
        "the peer secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes (after trimming white space), got {0}"
    )]
    Length(usize),
}

/// The secret every node of the mesh shares.
pub struct Secret(hmac::Key);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl Secret {
    /// A secret from its bytes; surrounding ASCII white space (a file's trailing newline) is
    /// not part of it.
    pub fn new(bytes: &[u8]) -> Result<Self, SecretError> {
        let bytes = bytes.trim_ascii();
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&bytes.len()) {
            return Err(SecretError::Length(bytes.len()));
        }
        Ok(Self(hmac::Key::new(hmac::HMAC_SHA256, bytes)))
    }

    /// The secret in `path` (a mounted Kubernetes Secret).
    pub fn from_file(path: &std::path::Path) -> Result<Self, SecretError> {
        let bytes = std::fs::read(path).map_err(|source| SecretError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::new(&bytes)
    }

    /// The MAC `role`, named `node`, sends for `nonce` on a connection to the server at
    /// `server`.
    pub fn mac(&self, role: Role, nonce: &[u8], node: &str, server: &str) -> Vec<u8> {
        hmac::sign(&self.0, &message(role, nonce, node, server))
            .as_ref()
            .to_vec()
    }

    /// Whether `mac` is what `role`, named `node`, must send for `nonce` on a connection to
    /// the server at `server` (in constant time).
    pub fn verify(&self, role: Role, nonce: &[u8], node: &str, server: &str, mac: &[u8]) -> bool {
        hmac::verify(&self.0, &message(role, nonce, node, server), mac).is_ok()
    }
}

/// What a MAC covers: each variable-length field preceded by its length, so no two
/// different field sets read the same.
fn message(role: Role, nonce: &[u8], node: &str, server: &str) -> Vec<u8> {
    let mut msg = Vec::with_capacity(CONTEXT.len() + 25 + nonce.len() + node.len() + server.len());
    msg.extend_from_slice(CONTEXT);
    msg.push(role.byte());
    for field in [nonce, node.as_bytes(), server.as_bytes()] {
        msg.extend_from_slice(&(field.len() as u64).to_be_bytes());
        msg.extend_from_slice(field);
    }
    msg
}

/// A fresh random nonce (`None` if the system's generator failed).
pub fn nonce() -> Option<Vec<u8>> {
    let mut n = vec![0u8; NONCE_BYTES];
    SystemRandom::new().fill(&mut n).ok()?;
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_verifies_only_for_its_secret_role_nonce_node_and_server() {
        let secret = Secret::new(b"0123456789abcdef\n").unwrap();
        let other = Secret::new(b"0123456789abcdeX").unwrap();
        let n = nonce().unwrap();
        let at = "10.0.0.1:9094";
        let mac = secret.mac(Role::Client, &n, "node-a", at);
        assert!(secret.verify(Role::Client, &n, "node-a", at, &mac));
        assert!(!other.verify(Role::Client, &n, "node-a", at, &mac));
        assert!(
            !secret.verify(Role::Server, &n, "node-a", at, &mac),
            "reflected"
        );
        assert!(!secret.verify(Role::Client, &n, "node-b", at, &mac));
        assert!(
            !secret.verify(Role::Client, &n, "node-a", "10.0.0.2:9094", &mac),
            "relayed through another address"
        );
        let m = nonce().unwrap();
        assert_ne!(n, m);
        assert!(
            !secret.verify(Role::Client, &m, "node-a", at, &mac),
            "replayed"
        );
        assert!(!secret.verify(Role::Client, &n, "node-a", at, &mac[..16]));
        // Fields cannot slide into one another.
        assert!(!secret.verify(Role::Client, &n, "node-a1", "0.0.0.1:9094", &mac));
    }

    #[test]
    fn short_and_long_secrets_are_refused_and_white_space_is_trimmed() {
        assert!(matches!(
            Secret::new(b"  short \n"),
            Err(SecretError::Length(5))
        ));
        assert!(Secret::new(&vec![b'x'; MAX_SECRET_BYTES + 1]).is_err());
        let a = Secret::new(b"0123456789abcdef").unwrap();
        let b = Secret::new(b"\t0123456789abcdef\r\n").unwrap();
        let n = nonce().unwrap();
        assert!(b.verify(
            Role::Server,
            &n,
            "x",
            "s",
            &a.mac(Role::Server, &n, "x", "s")
        ));
    }
}
