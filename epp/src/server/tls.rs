//! TLS material for the ext_proc listener: a self-signed certificate made at start (GIE's
//! `--secure-serving` default; gateways connect without verifying it) or PEM files.

use std::path::{Path, PathBuf};

/// A certificate chain and its private key, PEM-encoded.
#[derive(Clone)]
pub struct TlsMaterial {
    /// The certificate chain.
    pub cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// Why TLS material could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Generating the self-signed certificate failed.
    #[error("cannot generate a self-signed certificate")]
    Generate(#[source] rcgen::Error),
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not the PEM it should be.
    #[error("{path} holds no PEM {what}")]
    NotPem {
        /// The file.
        path: PathBuf,
        /// What was expected.
        what: &'static str,
    },
}

impl TlsError {
    /// Bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Generate(_) => "generate",
            Self::Read { .. } => "read",
            Self::NotPem { .. } => "not_pem",
        }
    }
}

impl TlsMaterial {
    /// A fresh self-signed certificate for `names` (DNS names or IP addresses).
    pub fn self_signed(names: &[String]) -> Result<Self, TlsError> {
        let certified =
            rcgen::generate_simple_self_signed(names.to_vec()).map_err(TlsError::Generate)?;
        Ok(Self {
            cert_pem: certified.cert.pem(),
            key_pem: certified.signing_key.serialize_pem(),
        })
    }

    /// A certificate chain and key read from PEM files.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| TlsError::Read {
                path: path.to_owned(),
                source,
            })
        };
        let cert_pem = read(cert)?;
        let key_pem = read(key)?;
        if !cert_pem.contains("-----BEGIN CERTIFICATE-----") {
            return Err(TlsError::NotPem {
                path: cert.to_owned(),
                what: "certificate",
            });
        }
        if !key_pem.contains("PRIVATE KEY-----") {
            return Err(TlsError::NotPem {
                path: key.to_owned(),
                what: "private key",
            });
        }
        Ok(Self { cert_pem, key_pem })
    }

    /// The identity tonic serves with.
    pub(super) fn identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_is_pem() {
        let m = TlsMaterial::self_signed(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(m.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(m.key_pem.contains("PRIVATE KEY-----"));
        assert!(
            !format!("{m:?}").contains(&m.key_pem),
            "the key never reaches logs"
        );
    }

    #[test]
    fn files_are_checked() {
        let dir = std::env::temp_dir().join(format!("kvgate-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = TlsMaterial::self_signed(&["localhost".into()]).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, &m.cert_pem).unwrap();
        std::fs::write(&key, &m.key_pem).unwrap();
        assert_eq!(
            TlsMaterial::from_files(&cert, &key).unwrap().cert_pem,
            m.cert_pem
        );
        let err = TlsMaterial::from_files(&key, &cert).unwrap_err();
        assert_eq!(err.metric_label(), "not_pem");
        let err = TlsMaterial::from_files(&dir.join("missing"), &key).unwrap_err();
        assert_eq!(err.metric_label(), "read");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
