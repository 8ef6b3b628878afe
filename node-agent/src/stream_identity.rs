//! The stream endpoint's TLS identity: the agent's certificate chain and key from `[streams]`,
//! TLS 1.2 and 1.3 with ring. The gateway proves itself with its bearer token, not with a
//! certificate, so no client certificate is asked for.

use std::path::Path;
use std::sync::Arc;

use ongrid_service::pem::{self, PemError};
use rustls::ServerConfig;

/// Why the stream endpoint's TLS identity could not be loaded; each message names the key to
/// fix.
#[derive(Debug, thiserror::Error)]
pub enum StreamsIdentityError {
    #[error(transparent)]
    File(#[from] PemError),
    #[error("tls_cert and tls_key do not make a usable server identity")]
    Identity(#[source] rustls::Error),
}

/// The server configuration of the stream endpoint.
pub fn server_config(
    tls_cert: &Path,
    tls_key: &Path,
) -> Result<ServerConfig, StreamsIdentityError> {
    let chain = pem::read_certificates("tls_cert", tls_cert)?;
    let key = pem::read_private_key("tls_key", tls_key)?;
    ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(StreamsIdentityError::Identity)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(StreamsIdentityError::Identity)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn write_identity(dir: &Path) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["node1.example.org".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert_path, key_path) = (dir.join("agent.crt"), dir.join("agent.key"));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    #[test]
    fn a_pem_certificate_and_key_make_a_server_config() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = write_identity(dir.path());
        let config = server_config(&cert, &key).unwrap();
        assert!(config.alpn_protocols.is_empty());
    }

    #[test]
    fn bad_files_name_the_key_to_fix() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = write_identity(dir.path());
        let missing = dir.path().join("missing.crt");
        let err = server_config(&missing, &key).unwrap_err();
        assert!(err.to_string().starts_with("reading tls_cert "), "{err}");

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let err = server_config(&cert, &empty).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "tls_key {} holds no private key: it must be PEM",
                empty.display()
            )
        );
        let err = server_config(&empty, &key).unwrap_err();
        assert!(
            matches!(
                err,
                StreamsIdentityError::File(PemError::Empty {
                    key: "tls_cert",
                    ..
                })
            ),
            "{err:?}"
        );

        // A key that is not the certificate's.
        let other_dir = tempfile::tempdir().unwrap();
        let (_, other_key) = write_identity(other_dir.path());
        let err = server_config(&cert, &other_key).unwrap_err();
        assert!(matches!(err, StreamsIdentityError::Identity(_)), "{err:?}");
    }
}
