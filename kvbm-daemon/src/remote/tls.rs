//! TLS client settings shared by the remote tier's clients (`rediss://`, `https://` S3
//! endpoints): rustls on ring, TLS 1.2 and 1.3, the server verified against a CA bundle or the
//! system's roots. No client certificate is sent.

use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;

use super::RemoteError;

/// A rustls client configuration trusting the CAs of `ca_file` (PEM), or the system's roots
/// when it is `None`.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, RemoteError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                .map_err(|e| RemoteError::Tls(format!("reading {}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(RemoteError::Tls(format!(
                    "{} holds no certificate",
                    path.display()
                )));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| RemoteError::Tls(format!("{}: {e}", path.display())))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for e in &native.errors {
                tracing::warn!(error = %e, "loading the system's CA certificates");
            }
            roots.add_parsable_certificates(native.certs);
            if roots.is_empty() {
                return Err(RemoteError::Tls(
                    "no system CA certificates found; give --remote-ca-file".into(),
                ));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| RemoteError::Tls(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}
