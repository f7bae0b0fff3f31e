//! The trust the remote tier's TLS clients (`rediss://`, `https://` S3 endpoints) start
//! from, checked at start: a CA bundle (`--remote-ca-file`, PEM) that is read and parsed
//! before the first command, or the system's roots, which must hold at least one certificate.
//! The Redis library does its own handshakes from these (rustls on ring, the process default);
//! so does the S3 SDK's HTTP client (rustls on ring), given the same bundle. TLS 1.2 and 1.3;
//! no client certificate is sent.

use std::path::Path;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;

use super::RemoteError;

/// The PEM bundle at `path`, once every certificate in it parses and there is at least one.
pub fn ca_bundle(path: &Path) -> Result<Vec<u8>, RemoteError> {
    let pem = std::fs::read(path)
        .map_err(|e| RemoteError::Tls(format!("reading {}: {e}", path.display())))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RemoteError::Tls(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(RemoteError::Tls(format!(
            "{} holds no certificate",
            path.display()
        )));
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| RemoteError::Tls(format!("{}: {e}", path.display())))?;
    }
    Ok(pem)
}

/// Fails when the system has no CA certificate the clients could trust.
pub fn check_system_roots() -> Result<(), RemoteError> {
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::warn!(error = %e, "loading the system's CA certificates");
    }
    if native.certs.is_empty() {
        return Err(RemoteError::Tls(
            "no system CA certificates found; give --remote-ca-file".into(),
        ));
    }
    Ok(())
}

/// Makes ring the process's rustls provider, unless one is installed already: the clients'
/// libraries build their TLS configurations from the process default.
pub fn install_ring() {
    // An error means a provider was installed first; that one stays.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_bundle_without_certificates_or_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("kvgate-tls-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, b"not a certificate\n").unwrap();
        for path in [junk, dir.join("missing.pem")] {
            let e = ca_bundle(&path).unwrap_err();
            assert_eq!(e.metric_label(), "tls", "{e}");
        }
        let good = dir.join("ca.pem");
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        std::fs::write(&good, cert.cert.pem()).unwrap();
        assert!(!ca_bundle(&good).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
