//! TLS towards the manager and the node agents: the roots are exactly the CA certificates of
//! `ca_dir` (every `*.0` and `*.pem` file, IGTF layout), never the system's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::CertificateDer;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read CA directory {dir}")]
    CaDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read CA file {path}")]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CA directory {0} holds no certificate (*.0 or *.pem): put the CA that signed the manager's and the agents' certificates there")]
    NoCa(PathBuf),
    #[error("CA certificate from {path} is not usable")]
    BadCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("building the TLS client configuration")]
    Config(#[source] rustls::Error),
}

/// A CA certificate and the file it came from.
#[derive(Debug, Clone)]
pub struct CaCertificate {
    pub path: PathBuf,
    pub der: CertificateDer<'static>,
}

/// The certificates of every `*.0` and `*.pem` file in `dir` (CRLs `*.r0`, signing policies and
/// other files are skipped).
pub fn load_ca_dir(dir: &Path) -> Result<Vec<CaCertificate>, TlsError> {
    let entries = std::fs::read_dir(dir).map_err(|source| TlsError::CaDir {
        dir: dir.to_owned(),
        source,
    })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TlsError::CaDir {
            dir: dir.to_owned(),
            source,
        })?;
        let path = entry.path();
        let wanted = path
            .extension()
            .is_some_and(|ext| ext == "0" || ext == "pem");
        if wanted && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    let mut certificates = Vec::new();
    for path in paths {
        let pem = std::fs::read(&path).map_err(|source| TlsError::CaFile {
            path: path.clone(),
            source,
        })?;
        for der in rustls_pemfile::certs(&mut pem.as_slice()) {
            let der = der.map_err(|source| TlsError::CaFile {
                path: path.clone(),
                source,
            })?;
            certificates.push(CaCertificate {
                path: path.clone(),
                der,
            });
        }
    }
    if certificates.is_empty() {
        return Err(TlsError::NoCa(dir.to_owned()));
    }
    Ok(certificates)
}

/// A rustls client configuration (ring provider) trusting exactly `roots`.
pub fn client_config(roots: &[CaCertificate]) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store
            .add(root.der.clone())
            .map_err(|source| TlsError::BadCa {
                path: root.path.clone(),
                source,
            })?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(TlsError::Config)?
    .with_root_certificates(store)
    .with_no_client_auth();
    Ok(Arc::new(config))
}
